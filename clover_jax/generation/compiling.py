"""Compiling several programs side by side: one call per program on a thread pool.

    seconds = side_by_side(lambda shape: run_once(shape), shapes)          # one thread per shape, up to the cores
    seconds = side_by_side(warm, calls, threads=2)                         # two at a time

A first call of a jitted function traces it in Python and then compiles it in XLA, which runs outside Python's lock:
calls made from several threads compile their programs at once where the machine has cores for them. What each call
built lands in JAX's caches (in memory, and the persistent compilation cache, `clover_jax.compile_cache`), so the
calls that follow reuse it. `clover_jax.generation.warmup` builds a workload's programs this way, and the tuning
layer the programs it is about to time.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from typing import Any, Callable, Sequence


def thread_count(items: int, threads: int | None = None) -> int:
    """The threads `side_by_side` runs `items` calls on: `threads`, else one per call up to the machine's cores."""
    return threads or max(1, min(items, os.cpu_count() or 1))


def side_by_side(call: Callable[[Any], Any], items: Sequence[Any], *, threads: int | None = None,
                 name: str = "clover_jax.compile") -> list[float]:
    """Runs `call(item)` for every item, `thread_count(len(items), threads)` at a time on threads named `name`, and
    returns each call's wall seconds in the order of `items`. An exception of a call is raised here."""

    def timed(item) -> float:
        t0 = time.perf_counter()
        call(item)
        return time.perf_counter() - t0

    workers = thread_count(len(items), threads)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name) as pool:
        return list(pool.map(timed, items))


__all__ = ["side_by_side", "thread_count"]
