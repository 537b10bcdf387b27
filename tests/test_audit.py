"""The exactness audit: a constructed near-tie is classified as one, a planted verification bug (a verifier that
accepts one wrong token) as unexplained, and the replay check certifies exact outputs and catches the bug."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.decoding import verify
from clover_jax import generate
from clover_jax.models.llama import init_llama
from clover_jax.tuning import audit
from tiny_llama import TINY_LLAMA


@pytest.fixture(scope="module")
def base():
    model = init_llama(TINY_LLAMA, seed=3)
    model.lm_head[...] = model.lm_head[...] * 40  # peaked next-token distributions (clear argmaxes)
    return model


PROMPTS = [[5, 9, 13, 5, 9, 13, 5], [7, 3, 11, 2]]


def test_the_bound_scales_with_the_dtype_and_the_terms():
    rng = np.random.default_rng(0)
    h, wa, wb = rng.normal(size=(3, 64))
    f32 = audit.near_tie_bound(h, wa, wb, dtype=jnp.float32, num_layers=2)
    bf16 = audit.near_tie_bound(h, wa, wb, dtype=jnp.bfloat16, num_layers=2)
    assert 0 < f32 < 1e-4 < bf16 < 1.0 and bf16 / f32 > 100
    assert audit.near_tie_bound(2 * h, wa, wb, dtype=jnp.float32, num_layers=2) == pytest.approx(2 * f32)
    assert audit.ulp(1.5, jnp.float32) == 2.0 ** -23 and audit.ulp(20.0, jnp.bfloat16) == 2.0 ** -3
    assert audit.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert audit.first_difference([1, 2, 3], [1, 5, 3]) == 1 and audit.first_difference([1, 2], [1, 2, 3]) == 2


def test_a_constructed_near_tie_is_a_near_tie_and_a_wrong_token_is_unexplained(base):
    prompt = PROMPTS[0]
    ar = generate(base, [prompt], max_new_tokens=6, cache_size=64).token_ids[0]
    h, z = audit.replay_logits(base, prompt, ar)
    assert list(z.argmax(-1)) == ar  # the replay is the reference the loops agree with
    # make the runner-up at position 2 tie the argmax: give its output row the argmax's row (plus a hair)
    runner_up = int(np.argsort(z[2])[-2])
    tied = init_llama(TINY_LLAMA, seed=3)
    w = np.asarray(base.lm_head[...]).copy()
    w[:, runner_up] = w[:, ar[2]] * (1 - 1e-7)
    tied.lm_head[...] = jnp.asarray(w)
    ref = generate(tied, [prompt], max_new_tokens=6, cache_size=64).token_ids[0]
    swapped = ref[:2] + [runner_up if ref[2] != runner_up else ar[2]]
    d = audit.audit_divergence(tied, prompt, ref, swapped)
    assert d.position == 2 and d.verdict == audit.NEAR_TIE and d.margin <= d.bound, d
    # a token the model ranks far below its argmax is no rounding tie
    worst = int(np.argmin(z[2]))
    d = audit.audit_divergence(base, prompt, ar, ar[:2] + [worst])
    assert d.verdict == audit.UNEXPLAINED and d.margin > 100 * d.bound and d.top1 == ar[2], d
    assert audit.audit_divergence(base, prompt, ar, list(ar)) is None


@pytest.mark.slow  # generates three runs and replays them
def test_the_replay_catches_a_verifier_that_accepts_one_wrong_token(base, monkeypatch):
    """A planted bug: greedy acceptance that takes the first draft whatever the model says. Outputs that differ
    are unexplained, and the replay check flags the output without looking at the autoregressive one."""
    kw = dict(max_new_tokens=12, cache_size=64, mode="speculative", tree="lookup-3")
    good = generate(base, PROMPTS, **kw).token_ids
    ar = generate(base, PROMPTS, max_new_tokens=12, cache_size=64).token_ids
    assert good == ar
    for p, out in zip(PROMPTS, good):
        assert audit.replay_check(base, p, out).ok

    real = verify.greedy_accept

    def accepts_one_wrong(tokens, logits, buffers):
        acc = real(tokens, logits, buffers)
        forced = jnp.maximum(acc.num_accepted, 1)  # always take node 1 (the first draft), right or wrong
        nodes = acc.accepted_nodes.at[:, 1].set(jnp.where(acc.num_accepted == 0, 1, acc.accepted_nodes[:, 1]))
        return acc.replace(num_accepted=forced, accepted_nodes=nodes)

    monkeypatch.setattr(verify, "greedy_accept", accepts_one_wrong)
    jax.clear_caches()
    bad = generate(base, PROMPTS, **{**kw, "cache_size": 72}).token_ids
    assert bad != ar
    verdicts = [audit.audit_divergence(base, p, a, s) for p, a, s in zip(PROMPTS, ar, bad) if a != s]
    assert verdicts and all(d.verdict == audit.UNEXPLAINED for d in verdicts), verdicts
    checks = [audit.replay_check(base, p, s) for p, s in zip(PROMPTS, bad)]
    assert any(not c.ok for c in checks)
