"""`clover_jax.warmup` compiles every decoding program a workload needs ahead of its first request: afterwards the
requests compile nothing and return what they would have."""

import pytest

import clover_jax
from clover_jax.compile_cache import CompileCounter
from clover_jax.validation import InputError
from tiny_llama import random_prompt, tiny_base_and_clover2


@pytest.fixture(scope="module")
def tiny():
    return tiny_base_and_clover2()


_prompt = random_prompt


@pytest.mark.parametrize("mode", ["ar", "speculative"])
def test_after_a_warmup_the_requests_compile_nothing(tiny, mode):
    base, head = tiny
    kw = dict(mode="speculative", head=head, tree="chain-3") if mode == "speculative" else {}
    lengths = [5, 40, 33]  # buckets 32, 64, 64
    report = clover_jax.warmup(base, prompt_lengths=lengths, max_new_tokens=20, **kw)
    assert [p["bucket"] for p in report["programs"]] == [32, 64]
    assert report["mode"] == mode and report["seconds"] >= max(p["seconds"] for p in report["programs"])
    loop = "speculative_loop" if mode == "speculative" else "autoregressive_loop"
    for i, n in enumerate(lengths):
        with CompileCounter() as count:
            out = clover_jax.generate(base, [_prompt(n, i)], max_new_tokens=20, **kw)
        assert count.compiled[loop] == 0, (n, dict(count.compiled))
        assert out.token_ids == clover_jax.generate(base, [_prompt(n, i)], max_new_tokens=20).token_ids


def test_warmup_takes_prompts_or_lengths_and_names_what_it_sets(tiny):
    base, _ = tiny
    with pytest.raises(InputError, match="not both"):
        clover_jax.warmup(base, [[5, 6]], prompt_lengths=[2])
    with pytest.raises(InputError, match="prompt_lengths"):
        clover_jax.warmup(base, prompt_lengths=[])
    with pytest.raises(InputError, match="stream is set by warmup"):
        clover_jax.warmup(base, prompt_lengths=[4], stream=print)
    report = clover_jax.warmup(base, [[5, 6, 7]] * 3, batch_size=2, max_new_tokens=4)
    assert [(p["batch"], p["bucket"]) for p in report["programs"]] == [(2, 32), (1, 32)]
