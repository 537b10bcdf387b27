"""The one timing estimator (`clover_jax.tuning.timing`) and the one side-by-side compile helper
(`clover_jax.generation.compiling`) that the tree choice, the warm-up, the evaluation and the bench scripts share."""

import threading
import time

import pytest

from clover_jax.generation.compiling import side_by_side, thread_count
from clover_jax.tuning.timing import at_depth, per_iteration, timed_calls


def test_per_iteration_is_the_fastest_long_call_less_the_fastest_short_call():
    # a call costs 2 s fixed + 0.5 s per iteration, disturbed upwards only: the fastest calls cancel the fixed part
    short = [2.5 + d for d in (0.3, 0.0, 0.7)]  # 1 iteration
    long = [2.0 + 0.5 * 9 + d for d in (0.1, 0.9, 0.0)]  # 9 iterations
    assert per_iteration(short, long, 8) == pytest.approx(0.5)
    assert per_iteration([1.0], [3.0], 0) == 2.0  # no iteration between them: over 1, not a division by zero


def test_at_depth_is_affine_in_the_depth():
    assert at_depth({2: 2.0, 8: 5.0}, 30) == pytest.approx(16.0)
    assert at_depth({8: 5.0, 2: 2.0, 30: 7.0}, 30) == 7.0  # timed at that depth
    assert at_depth({2: 2.0, 8: 5.0, 16: 100.0}, 4) == pytest.approx(3.0)  # the two shallowest depths


def test_timed_calls_times_each_call_and_keeps_the_last_result():
    calls = []
    seconds, out = timed_calls(lambda: calls.append(time.sleep(0.01)) or len(calls), 3)
    assert len(seconds) == 3 and all(s >= 0.009 for s in seconds) and out == 3
    assert len(timed_calls(lambda: None, 0)[0]) == 1  # one call at least


def test_side_by_side_runs_the_calls_at_once_and_times_each():
    barrier = threading.Barrier(3, timeout=10)  # passes only when three calls run at the same time
    names = []

    def call(delay):
        names.append(threading.current_thread().name)
        barrier.wait()
        time.sleep(delay)

    seconds = side_by_side(call, [0.0, 0.05, 0.0], threads=3, name="compile-test")
    assert len(seconds) == 3 and seconds[1] >= 0.05 and all(n.startswith("compile-test") for n in names)
    assert thread_count(5, None) >= 1 and thread_count(5, 2) == 2 and thread_count(0) == 1

    def broken(item):
        raise ValueError(f"no program for {item}")

    with pytest.raises(ValueError, match="no program for 1"):
        side_by_side(broken, [1], threads=1)
