"""A program's time per loop iteration, from calls of two lengths.

    short = timed_calls(lambda: run(1), repeat=3)[0]       # [s] per call, one new token
    long, out = timed_calls(lambda: run(64), repeat=3)     # [s] per call, 64 new tokens
    seconds = per_iteration(short, long, iterations=out.steps - 1)

A decoding call's time is its fixed part (prefill, dispatch, the program's launch) plus its loop iterations. Two calls
that differ only in how many iterations they run differ by those iterations: the fixed part cancels. A call's time
varies from call to call and does not fall below what the call costs, so each length's fastest call is the estimate
least disturbed, and the estimate is `(fastest long call - fastest short call) / iterations between them`.

Where a loop's compile grows faster than the model's depth (unrolled layers on a GPU), it is timed on the model's
first layers and its iteration time extrapolated to the full depth: `at_depth`, affine in the depth (the layers'
share grows with it, the rest of an iteration does not).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence


def timed_calls(call: Callable[[], Any], repeat: int) -> tuple[list[float], Any]:
    """(`[s]` wall seconds of each of `repeat` calls of `call` (one at least), the last call's result). `call` blocks
    until its result is ready (`jax.block_until_ready`, or a result read back to the host)."""
    seconds, out = [], None
    for _ in range(max(repeat, 1)):
        t0 = time.perf_counter()
        out = call()
        seconds.append(time.perf_counter() - t0)
    return seconds, out


def per_iteration(short: Sequence[float], long: Sequence[float], iterations: int) -> float:
    """Seconds per loop iteration: the fastest of the `long` calls less the fastest of the `short` calls, over the
    loop iterations the long call runs beyond the short one (at least 1)."""
    return (min(long) - min(short)) / max(iterations, 1)


def at_depth(per_depth: Mapping[int, float], depth: int) -> float:
    """An iteration's seconds at `depth` layers from its seconds at the depths timed (`{layers: seconds}`): the time
    at that depth where it was timed, else the affine extrapolation through the two shallowest depths."""
    if depth in per_depth:
        return per_depth[depth]
    (d0, t0), (d1, t1) = sorted(per_depth.items())[:2]
    return t0 + (t1 - t0) * (depth - d0) / (d1 - d0)


__all__ = ["at_depth", "per_iteration", "timed_calls"]
