"""Generation: prompts in, text and statistics out, for a request whose tree is named (or the head's default).

`generate(model, prompts, ...)` = `prepare_generate` (check the request, resolve the draft, build the plan:
`clover_jax.generation.plan`) then `run_plan`; the jitted loops live in `clover_jax.decoding`. The public
`clover_jax.generate` adds the choice of a tree where the request names none (`clover_jax.tuning`).
"""

from __future__ import annotations

import dataclasses
import numbers
import queue
import threading
from typing import Any, Callable, Iterator, Sequence

import jax

from clover_jax import parallel
from clover_jax.decoding.streaming import streaming_to
from clover_jax.generation.plan import Decide, GenerationPlan, prepare_generate
from clover_jax.heads.bundle import RunLoader
from clover_jax.validation import InputError


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


def generate(model, prompts: Sequence[Any], *, tokenizer=None, max_new_tokens: int = 128, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, chat: bool = True, system: str | None = None,
             cache_size: int | None = None, mode: str = "ar", head=None, tree=None, draft_vocab=None,
             decode_text: bool = True, mesh=None, layers: str = "auto", ngram_table=None,
             stream=None, prompt_bucket: int | None = None, decide: Decide | None = None,
             run_loader: RunLoader | None = None) -> GenerationResult:
    """Generates for a batch of prompts.

    Args:
      model: a `Llama` or the `LoadedModel` returned by `load_model` (then its tokenizer is used).
      prompts: strings (chat template applied when `chat`), message lists, or token-id lists.
      mode: "ar" (plain autoregressive) or "speculative" (needs `head`, optionally `tree`).
      head: a draft head module, or where to load one: a registered name (`clover_jax.pretrained`, e.g.
        "smollm2-135m-instruct-clover2"), an exported head folder or a hub id (a training run directory through
        `clover_jax.generate`, which reads Orbax checkpoints); None: the model's shipped head, or none for a
        prompt-lookup tree.
      tree: a tree name (`chain-4`, `clover2-26`, `dynamic-26`, `lookup-4`, a head's fitted `fit-5-411aab`), a JSON
        file, a tree policy or a list of paths ([[0], [0, 0], [1]]); None or "default": the head's registered default
        tree, else its type's. (`clover_jax.generate` chooses what is fastest here for None and calibrates for
        "auto".)
      draft_vocab: token ids the drafts are drawn from (`clover_jax.heads.draft_vocab`); None: all, or, for
        a head given by name or path, the vocabulary it was trained on (if any).
      ngram_table: for trees named `...lookup-K-table`: an n-gram table (`clover_jax.decoding.ngram`) or its
        path; None: the one shipped beside a head given by name or path (`ngram_table.npz`), if any.
      mesh: decode on several devices: a `jax.sharding.Mesh` of `clover_jax.parallel.make_mesh`, or a string
        like "data=2,tp=4" (`parallel.parse_mesh`). The base model is tensor-parallel over `tp` (attention
        heads, MLP, vocabulary), rows split over `data`; the head's weights and both KV caches are sharded to
        match. The batch is padded to a multiple of the batch shards. Load the model onto the mesh
        (`load_model(..., mesh=mesh)`) to avoid a copy of the weights per call.
      layers: how the loop runs the base model's layers: "unrolled" (fastest for one-token steps; each layer
        reads a view of the stacked weights where the backend can make one, else a copy made per call:
        `clover_jax.models.views`), "scan", or "auto" (measured choice per
        backend, dtype and free memory: `clover_jax.decoding.autoregressive.decode_layers`).
      stream: a callable `sink(row, token_ids)`, called while the loop runs with each prompt's new tokens in order
        (row = the prompt's index; the first token, then what every step accepts), or None. One device only;
        `stream_text` yields a single prompt's text this way.
      prompt_bucket: pad every prompt to this many tokens (an error for a longer one), so a workload of prompts up to
        that length runs one compiled program per loop; None: each batch's own bucket (`decoding.sizes`).
      decide, run_loader: what settles a tree the request leaves open and reads a training run directory (the public
        `clover_jax.generate` passes `clover_jax.tuning`'s; `clover_jax.generation.plan.prepare_generate`).

    Every argument is checked before anything compiles (`prepare_generate`); a bad one raises an
    `InputError` naming it, its value and the limit.
    """
    plan = prepare_generate(model, prompts, tokenizer=tokenizer, max_new_tokens=max_new_tokens,
                            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, chat=chat, system=system,
                            cache_size=cache_size, mode=mode, head=head, tree=tree, draft_vocab=draft_vocab,
                            decode_text=decode_text, mesh=mesh, layers=layers, ngram_table=ngram_table,
                            stream=stream, prompt_bucket=prompt_bucket, decide=decide, run_loader=run_loader)
    return run_plan(plan, decode_text=decode_text)


def run_plan(plan: GenerationPlan, decode_text: bool = True) -> GenerationResult:
    """Runs a checked `GenerationPlan` (the jitted loop compiles on its first shapes)."""
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


def stream_text(model, prompt, *, tokenizer=None, **kwargs) -> Iterator[str]:
    """Generates for one prompt and yields its text piece by piece as the loop accepts tokens (see
    `stream_with`; `generate`'s other keyword arguments apply)."""
    return stream_with(prepare_generate, model, prompt, tokenizer=tokenizer, **kwargs)


def stream_with(prepare: Callable[..., GenerationPlan], model, prompt, *, tokenizer=None, **kwargs) -> Iterator[str]:
    """Generates for one prompt and yields its text piece by piece as the loop accepts tokens (`generate`'s
    other keyword arguments apply; `stream` and `decode_text` are set here). The generator's return value (the
    `value` of its `StopIteration`) is the `GenerationResult`. Every check runs before the first piece.

        for piece in clover_jax.stream_text(lm, "Tell me a story.", mode="speculative",
                                            head="smollm2-135m-instruct-clover2"):
            print(piece, end="", flush=True)

    The pieces joined are the result's text: each is the newly decodable end of the text so far (a token that
    ends inside a multi-byte character waits for the next one), decoded over the last few tokens only, so a long
    reply costs no more per piece than a short one. The loop runs in a thread of its own; a caller
    that stops iterating early leaves it running to its end (another streaming call waits for no one: it fails).
    """

    if "stream" in kwargs or "decode_text" in kwargs:
        raise InputError("stream_text: stream and decode_text are set by stream_text itself")
    if hasattr(model, "tokenizer") and hasattr(model, "model"):
        tokenizer = tokenizer or model.tokenizer
    if tokenizer is None:
        raise InputError("stream_text: text needs a tokenizer (pass a LoadedModel or tokenizer=...)")
    if isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], (numbers.Integral, dict)):
        raise InputError(f"stream_text: one prompt at a time (got {len(prompt)}); generate(..., stream=sink) "
                         f"streams a batch")
    pieces: queue.Queue = queue.Queue()
    done = object()
    plan = prepare(model, [prompt], tokenizer=tokenizer, stream=lambda row, ids: pieces.put(ids), **kwargs)
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
