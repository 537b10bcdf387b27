"""Compiling ahead: every decoding program a workload will run, built before its first request.

    report = clover_jax.warmup(lm, prompt_lengths=[40, 210, 900], max_new_tokens=256, mode="speculative")
    print(report["programs"], report["seconds"])

A workload's programs are fixed by its shapes (`clover_jax.decoding.sizes.loop_shapes`: per batch of prompts, the
prompt bucket and the cache rung that holds it with the new tokens and the draft tree) and by the request's
static settings (model, head, tree, dtype, layers, mesh). `warmup` resolves the request once (the tree chosen or
calibrated where none is named, as `generate` would), then runs each shape once with one new token on a dummy
prompt of the bucket's length, in parallel threads: XLA compiles outside Python's lock, so the programs compile
side by side where the machine has cores for it. The programs land in JAX's in-memory cache (the requests that
follow reuse them) and in the persistent compilation cache (`clover_jax.compile_cache`: a later process loads them
instead of compiling).
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from typing import Any, Callable, Sequence

from clover_jax.decoding.sizes import MIN_BUCKET, LoopShape, loop_shapes
from clover_jax.generation.api import run_plan
from clover_jax.generation.plan import GenerationPlan
from clover_jax.generation.request import check_request
from clover_jax.validation import InputError, check_int


def _lengths(model, prompts, prompt_lengths, kwargs) -> list[int]:
    if (prompts is None) == (prompt_lengths is None):
        raise InputError("warmup: give prompts (as for generate) or prompt_lengths (token counts), not both")
    if prompt_lengths is not None:
        if isinstance(prompt_lengths, (int, str)) or not isinstance(prompt_lengths, Sequence) or not prompt_lengths:
            raise InputError(f"prompt_lengths: expected a non-empty list of token counts, got {prompt_lengths!r}"[:200])
        return [check_int(f"prompt_lengths[{i}]", n, minimum=1) for i, n in enumerate(prompt_lengths)]
    from_request = {k: kwargs[k] for k in ("tokenizer", "chat", "system") if k in kwargs}
    # the prompts as the requests will encode them (chat template included), checked like generate's
    return [len(row) for row in check_request(model, prompts, **from_request).ids]


def warmup(prepare: Callable[..., GenerationPlan], model, prompts=None, *, prompt_lengths=None, batch_size: int = 1,
           max_new_tokens: int = 128, cache_size: int | None = None, threads: int | None = None,
           **kwargs) -> dict[str, Any]:
    """Compiles the decoding programs `generate(model, batch, max_new_tokens=..., **kwargs)` will need for these
    prompts (or prompt lengths) taken `batch_size` at a time; returns what was built: `programs` (the shapes),
    `seconds` (wall time), `mode` and `tree` (as resolved), `resolve_seconds` (the request's resolution, a tree
    choice included). `prepare` plans a request (`clover_jax.prepare_generate`). Other keyword arguments are
    `generate`'s (`mode`, `head`, `tree`, `mesh`, `layers`, ...); `cache_size`, as for `generate`, fixes every
    program's cache (None: each bucket's rung)."""
    t0 = time.perf_counter()
    batch_size = check_int("batch_size", batch_size, minimum=1)
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
    threads = check_int("threads", threads, minimum=1, allow_none=True)
    cache_size = check_int("cache_size", cache_size, minimum=1, allow_none=True)
    for key in ("stream", "decode_text", "check_free_memory"):
        if key in kwargs:
            raise InputError(f"warmup: {key} is set by warmup itself")
    lengths = _lengths(model, prompts, prompt_lengths, kwargs)
    fixed = {k: v for k, v in kwargs.items() if k not in ("tokenizer", "chat", "system")}
    # the request resolved once, at the workload's batch size: the head, the tree (chosen or calibrated where none
    # is named), the draft vocabulary and n-gram table, then reused for every shape
    first = prepare(model, [[1] * lengths[0]] * min(batch_size, len(lengths)), max_new_tokens=max_new_tokens,
                    chat=False, check_free_memory=False, cache_size=cache_size, **fixed)
    resolve_seconds = time.perf_counter() - t0
    if first.mode == "speculative":
        fixed.update(mode="speculative", head=first.head, tree=first.tree, draft_vocab=first.draft_vocab,
                     ngram_table=first.ngram_table)
    else:
        fixed = {k: v for k, v in fixed.items() if k not in ("head", "tree", "draft_vocab", "ngram_table")}
        fixed["mode"] = "ar"
    nodes = first.drafter.num_nodes if first.drafter is not None else 0
    shapes = loop_shapes(lengths, max_new_tokens, nodes, batch_size)
    if cache_size is not None:
        shapes = list(dict.fromkeys(s._replace(cache_size=cache_size) for s in shapes))

    def build(shape: LoopShape) -> float:
        s0 = time.perf_counter()
        shortest = 1 if shape.bucket <= MIN_BUCKET else shape.bucket // 2 + 1  # the least length of this bucket
        plan = prepare(model, [[1] * shortest] * shape.batch, max_new_tokens=1, chat=False,
                       cache_size=shape.cache_size, check_free_memory=False, **fixed)
        run_plan(plan, decode_text=False)
        return time.perf_counter() - s0

    workers = threads or max(1, min(len(shapes), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="clover_jax.warmup") as pool:
        seconds = list(pool.map(build, shapes))
    return {"programs": [dict(batch=s.batch, bucket=s.bucket, cache_size=s.cache_size, seconds=round(t, 2))
                         for s, t in zip(shapes, seconds)],
            "mode": first.mode, "tree": first.tree.name if first.tree is not None else None,
            "resolve_seconds": round(resolve_seconds, 2), "threads": workers,
            "seconds": round(time.perf_counter() - t0, 2)}


__all__ = ["warmup"]
