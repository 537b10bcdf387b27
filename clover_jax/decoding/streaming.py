"""Streaming: each row's new tokens handed to the host as the decoding loop accepts them.

Both decoding loops (`autoregressive.ar_generate`, `speculative.spec_generate`) run every step inside one jitted
`lax.while_loop`, so nothing reaches the host before the last step. Compiled with `stream=True`, a loop calls
`emit` once after the prefill (each row's first token) and once per step (the tokens the step accepted, bonus token
included, cut at EOS and at the row's budget), through an ordered `jax.experimental.io_callback`: the host receives
them in order while the loop runs, and the values the loop computes are unchanged (the callback returns nothing).

The host side is one sink per process at a time (`streaming_to`): a callable `sink(row, token_ids)` that
`clover_jax.generate(..., stream=sink)` installs around its call. An exception in the sink is kept, later calls of
the sink are skipped, and it is raised when the loop has finished (a callback must not raise inside the loop).
`clover_jax.generation.api.stream_text` builds a generator of text pieces on top.

Streaming costs one device-to-host transfer per step (small: `[B, A]` int32), and a second compiled loop; a mesh is
not supported (the rows of a sharded batch live on several devices).

Shapes and einsum strings use the axis letters of `clover_jax.axes`.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from clover_jax.validation import InputError

Sink = Callable[[int, list], None]  # sink(row, token_ids) with the row's new tokens, in order

_lock = threading.Lock()
_state: dict = {"sink": None, "error": None}


def emit(tokens: jax.Array, num: jax.Array) -> None:
    """Traced, inside a decoding loop: hands `tokens [B, A]` (row b's first `num [B]` of them are new) to the
    current sink, ordered after every earlier call."""
    io_callback(_deliver, None, tokens.astype(jnp.int32), num.astype(jnp.int32), ordered=True)


def _deliver(tokens, num) -> None:
    sink = _state["sink"]
    if sink is None or _state["error"] is not None:
        return
    tokens, num = np.asarray(tokens), np.asarray(num)  # [B, A], [B]
    try:
        for row in np.flatnonzero(num > 0):
            sink(int(row), tokens[row, : int(num[row])].tolist())
    except BaseException as e:  # noqa: BLE001 - raised again by streaming_to once the loop has finished
        _state["error"] = e


@contextlib.contextmanager
def streaming_to(sink: Sink | None):
    """Installs `sink` for the loops run inside the block (None: nothing to install); raises what the sink raised,
    after the block. One streaming call at a time per process: a second one, from another thread, is an error."""
    if sink is None:
        yield
        return
    if not _lock.acquire(blocking=False):
        raise InputError("stream: another streaming generate is running in this process (one at a time)")
    _state.update(sink=sink, error=None)
    try:
        yield
        jax.effects_barrier()  # every callback of the loop has run
    finally:
        error = _state["error"]
        _state.update(sink=None, error=None)
        _lock.release()
    if error is not None:
        raise error
