"""Streaming (`generate(..., stream=sink)`, `stream_text`): the tokens handed over while the loop runs are the
result's tokens, in order, step by step; the loop's output is unchanged; bad use is a clear error."""

import threading

import numpy as np
import pytest

import clover_jax
from clover_jax import generate
from clover_jax.decoding import streaming
from clover_jax.models.llama import init_llama
from clover_jax.validation import InputError
from tiny_llama import TINY_LLAMA

CFG = TINY_LLAMA


@pytest.fixture(scope="module")
def tiny():
    return init_llama(CFG, seed=0)


def _prompts():
    rng = np.random.RandomState(1)
    # repeated patterns, so the lookup chain drafts tokens that get accepted (steps of several tokens)
    return [(rng.randint(3, 64, 5).tolist() * 4)[: n] for n in (7, 19, 12)]


def _collect():
    calls = []
    lock = threading.Lock()

    def sink(row, ids):
        with lock:
            calls.append((row, list(ids)))

    return calls, sink


@pytest.mark.parametrize("mode, tree", [("ar", None), ("speculative", "lookup-4")])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.slow  # a streaming loop per mode and temperature
def test_streamed_tokens_are_the_result(tiny, mode, tree, temperature):
    prompts = _prompts()
    kw = dict(max_new_tokens=24, mode=mode, tree=tree, temperature=temperature, seed=3)
    plain = generate(tiny, prompts, **kw)
    calls, sink = _collect()
    res = generate(tiny, prompts, stream=sink, **kw)
    assert res.token_ids == plain.token_ids  # streaming changes nothing the loop computes
    for row in range(len(prompts)):
        pieces = [ids for r, ids in calls if r == row]
        assert [t for ids in pieces for t in ids] == res.token_ids[row]
        assert all(ids for ids in pieces)
        # one call for the first token, then one per step of the row's own decoding
        assert len(pieces) == 1 + res.row_steps[row]
        if mode == "ar":
            assert all(len(ids) == 1 for ids in pieces)
    if mode == "speculative" and temperature == 0.0:
        assert max(len(ids) for _, ids in calls) > 1  # steps that accepted drafts hand over several tokens at once


def test_stream_errors_are_clear_and_leave_no_state(tiny):
    with pytest.raises(InputError, match="stream: expected a callable"):
        generate(tiny, [[5, 6, 7]], max_new_tokens=4, stream="print")
    with pytest.raises(InputError, match="stream: streaming runs on one device"):
        generate(tiny, [[5, 6, 7]], max_new_tokens=4, stream=print, mesh="tp=2")

    def bad(row, ids):
        raise ValueError("my sink broke")

    with pytest.raises(ValueError, match="my sink broke"):  # raised after the loop, not inside it
        generate(tiny, [[5, 6, 7]], max_new_tokens=6, stream=bad)
    calls, sink = _collect()  # the next streaming call works, and the failed sink is gone
    res = generate(tiny, [[5, 6, 7]], max_new_tokens=6, stream=sink)
    assert [t for _, ids in calls for t in ids] == res.token_ids[0]
    with streaming.streaming_to(sink):  # one streaming call at a time per process
        with pytest.raises(InputError, match="another streaming generate is running"):
            with streaming.streaming_to(sink):
                pass


@pytest.mark.slow
@pytest.mark.optimized
def test_stream_text_pieces_join_to_the_reply(smollm):
    """The real SmolLM2 and its shipped head: the pieces `stream_text` yields join to the reply `generate` returns,
    and arrive in more than one piece."""
    prompt = "Write a short poem about the moon, with an emoji at the end."
    kw = dict(max_new_tokens=40, mode="speculative", head="smollm2-135m-instruct-clover2", tree="default")
    ref = generate(smollm, [prompt], **kw)
    it = clover_jax.stream_text(smollm, prompt, **kw)
    pieces = []
    while True:
        try:
            pieces.append(next(it))
        except StopIteration as stop:
            result = stop.value
            break
    assert "".join(pieces) == ref.texts[0] == result.texts[0]
    assert result.token_ids == ref.token_ids
    assert len(pieces) > 3 and all(pieces)
    with pytest.raises(InputError, match="one prompt at a time"):
        next(clover_jax.stream_text(smollm, ["a", "b"]))
    with pytest.raises(InputError, match="set by stream_text itself"):
        next(clover_jax.stream_text(smollm, "a", stream=print))
