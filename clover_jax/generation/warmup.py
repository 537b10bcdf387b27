"""Compiling ahead: every decoding program a workload will run, built before its first request.

    report = clover_jax.warmup(lm, prompt_lengths=[40, 210, 900], max_new_tokens=256, mode="speculative")
    print(report["programs"], report["seconds"])

A workload's programs are fixed by its shapes (`clover_jax.decoding.sizes.loop_shapes`: per batch of prompts, the
prompt bucket and the cache rung that holds it with the new tokens and the draft tree) and by the request's
static settings (model, head, tree, dtype, layers, mesh). `clover_jax.warmup` resolves the request once (the tree chosen or
calibrated where none is named, as `generate` would); `warm_shapes` then runs each shape once with one new token on a dummy
prompt of the bucket's length, in parallel threads: XLA compiles outside Python's lock, so the programs compile
side by side where the machine has cores for it. The programs land in JAX's in-memory cache (the requests that
follow reuse them) and in the persistent compilation cache (`clover_jax.compile_cache`: a later process loads them
instead of compiling).
"""

from __future__ import annotations

from typing import Any, Sequence

from clover_jax.decoding.sizes import MIN_BUCKET, LoopShape, loop_shapes
from clover_jax.generation.api import run_plan
from clover_jax.generation.compiling import side_by_side, thread_count
from clover_jax.generation.draft import Draft
from clover_jax.generation.plan import build_plan
from clover_jax.generation.request import Request, check_request
from clover_jax.validation import InputError, check_int


def workload_lengths(model, prompts=None, prompt_lengths=None, *, tokenizer=None, chat: bool = True,
                     system: str | None = None) -> list[int]:
    """The token counts of a workload's prompts: `prompts` encoded as `generate` would (chat template included,
    checked like its prompts), or `prompt_lengths` checked; exactly one of the two."""
    if (prompts is None) == (prompt_lengths is None):
        raise InputError("warmup: give prompts (as for generate) or prompt_lengths (token counts), not both")
    if prompt_lengths is not None:
        if isinstance(prompt_lengths, (int, str)) or not isinstance(prompt_lengths, Sequence) or not prompt_lengths:
            raise InputError(f"prompt_lengths: expected a non-empty list of token counts, got {prompt_lengths!r}"[:200])
        return [check_int(f"prompt_lengths[{i}]", n, minimum=1) for i, n in enumerate(prompt_lengths)]
    return [len(row) for row in check_request(model, prompts, tokenizer=tokenizer, chat=chat, system=system).ids]


def warm_shapes(request: Request, draft: Draft | None, lengths: Sequence[int], *, batch_size: int = 1,
                threads: int | None = None) -> dict[str, Any]:
    """Compiles the decoding programs a workload of prompts of `lengths` tokens, taken `batch_size` at a time, runs
    with `request`'s settings and its resolved `draft` (None: plain decoding): each shape
    (`clover_jax.decoding.sizes.loop_shapes`, or `request.cache_size` for every one) planned from the same draft and
    run once for one new token on a dummy prompt of its bucket. Returns `programs` (the shapes and their seconds),
    `mode`, `tree` and `threads`."""
    batch_size = check_int("batch_size", batch_size, minimum=1)
    threads = check_int("threads", threads, minimum=1, allow_none=True)
    nodes = draft.drafter.num_nodes if draft is not None else 0
    shapes = loop_shapes(list(lengths), request.max_new_tokens, nodes, batch_size)
    if request.cache_size is not None:
        shapes = list(dict.fromkeys(s._replace(cache_size=request.cache_size) for s in shapes))

    def build(shape: LoopShape) -> None:
        shortest = 1 if shape.bucket <= MIN_BUCKET else shape.bucket // 2 + 1  # the least length of this bucket
        one = request.replace(ids=((1,) * shortest,) * shape.batch, max_new_tokens=1, cache_size=shape.cache_size,
                              check_free_memory=False, decode_text=False, stream=None)
        run_plan(build_plan(one, draft), decode_text=False)

    workers = thread_count(len(shapes), threads)
    seconds = side_by_side(build, shapes, threads=workers, name="clover_jax.warmup")
    return {"programs": [dict(batch=s.batch, bucket=s.bucket, cache_size=s.cache_size, seconds=round(t, 2))
                         for s, t in zip(shapes, seconds)],
            "mode": "speculative" if draft is not None else "ar",
            "tree": draft.policy.name if draft is not None else None, "threads": workers}


__all__ = ["warm_shapes", "workload_lengths"]
