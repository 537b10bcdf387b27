"""Running a plan: `run_plan` (the jitted loop, then token ids and texts out: `GenerationResult`), `stream_pieces`
(a single prompt's text piece by piece as the loop accepts tokens) and `run_request` (plan and run a checked request
whose tree is named). The public calls, `clover_jax.generate` and the rest, are `clover_jax.api`'s; the jitted loops
live in `clover_jax.decoding`.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Any, Iterator

import jax

from clover_jax import parallel
from clover_jax.decoding.streaming import streaming_to
from clover_jax.generation.plan import GenerationPlan, plan_request
from clover_jax.generation.request import Request


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[list[int]]  # generated tokens per prompt (EOS included when emitted)
    texts: list[str] | None
    prompt_lengths: list[int]
    steps: int  # decode-phase base forwards for the whole batch
    row_steps: list[int]  # decode-phase base forwards per row
    seconds: float  # wall time of the jitted call (compile excluded if warmed up)
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated / self.seconds if self.seconds > 0 else float("nan")


def run_plan(plan: GenerationPlan, decode_text: bool | None = None) -> GenerationResult:
    """Runs a checked `GenerationPlan` (the jitted loop compiles on its first shapes); `decode_text` (None: the
    request's) decodes the replies to text."""
    decode_text = plan.decode_text if decode_text is None else decode_text
    model, lens, tokenizer = plan.model, plan.prompt_lengths, plan.tokenizer
    key = jax.random.key(plan.seed)
    weights = (model,) if plan.mode == "ar" else (model, plan.head)
    with streaming_to(plan.stream):
        out, stats, seconds = plan.loop(*weights, plan.prompt, lens, max_new_tokens=plan.row_new_tokens,
                                        sampling=plan.sampling, key=key, stat_rows=len(plan.ids))
    tokens = parallel.to_host(out.tokens)  # [B, S]: gathered when the batch is spread over several processes
    lengths = parallel.to_host(out.lengths)
    gen = [tokens[i, lens[i]: lengths[i]].tolist() for i in range(len(plan.ids))]
    texts = [tokenizer.decode(g, skip_special_tokens=True) for g in gen] if (decode_text and tokenizer) else None
    rows = len(plan.ids)
    stats = {**stats, "mode": plan.mode, "layers": plan.layers}
    if plan.tree is not None:
        stats["tree"] = plan.tree.name
    if plan.choice is not None:
        stats["choice"] = dict(plan.choice)
    if plan.notes:
        stats = {**stats, "notes": list(plan.notes)}
    return GenerationResult(token_ids=gen, texts=texts, prompt_lengths=lens[:rows].tolist(), steps=int(parallel.to_host(out.steps)),
                            row_steps=parallel.to_host(out.row_steps)[:rows].tolist(), seconds=seconds, stats=stats)


def stream_pieces(plan: GenerationPlan, pieces: "queue.Queue[list[int]]") -> Iterator[str]:
    """Runs `plan` in a thread of its own and yields its single prompt's text piece by piece, from the token ids its
    stream sink puts in `pieces` (the plan's `stream` puts each accepted run of tokens there). The generator's return
    value (the `value` of its `StopIteration`) is the `GenerationResult`.

    The pieces joined are the result's text: each is the newly decodable end of the text so far (a token that
    ends inside a multi-byte character waits for the next one), decoded over the last few tokens only, so a long
    reply costs no more per piece than a short one. A caller that stops iterating early leaves the loop running to
    its end (another streaming call waits for no one: it fails)."""
    tokenizer = plan.tokenizer
    done = object()
    outcome: dict = {}

    def run():
        try:
            outcome["result"] = run_plan(plan)
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            outcome["error"] = e
        finally:
            pieces.put(done)

    thread = threading.Thread(target=run, name="clover_jax.stream_text", daemon=True)
    thread.start()
    ids: list[int] = []
    start = shown_to = 0  # ids[start:shown_to]: tokens already shown, decoded again only as context for spacing
    sent = ""
    while (item := pieces.get()) is not done:
        ids += item
        shown = tokenizer.decode(ids[start:shown_to], skip_special_tokens=True)
        text = tokenizer.decode(ids[start:], skip_special_tokens=True)
        if text.endswith("\ufffd") or len(text) <= len(shown) or not text.startswith(shown):
            continue  # a character still incomplete, or nothing new: wait for the next tokens
        yield text[len(shown):]
        sent += text[len(shown):]
        start, shown_to = shown_to, len(ids)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    result = outcome["result"]
    text = result.texts[0]
    if text.startswith(sent) and len(text) > len(sent):
        yield text[len(sent):]
    return result


def run_request(request: Request) -> GenerationResult:
    """Generates for a checked request whose tree is named or the head's default (`plan_request`, then `run_plan`):
    what the tuning layer's measurements and the base model's replies for self-distillation run."""
    return run_plan(plan_request(request))


__all__ = ["GenerationResult", "run_plan", "run_request", "stream_pieces"]
