"""Clover-2 head: init invariants, dims checks, incremental commit == full recompute, padding
isolation, inference recurrence == teacher-forced training forward, attention decoder vs torch."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax.heads.clover2.model import (Clover2Config, Clover2Head, attention_decoder, check_compatible,
                                      init_from_base)
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import init_llama

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5)
HCFG = Clover2Config()
D, V = CFG.hidden_size, CFG.vocab_size


def _perturb(module, seed, scale=0.1):
    """Adds host-side noise to every parameter (no XLA compile), so identity-like inits and unit
    norms cannot hide a wiring bug."""
    rng = np.random.RandomState(seed)
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x) + scale * rng.randn(*x.shape), x.dtype), module)


def random_base(config, seed):
    """A Llama with random weights built on the host (norm weights around 1)."""
    rng = np.random.RandomState(seed)
    abstract = nnx.eval_shape(lambda: init_llama(config))

    def fill(path, x):
        norm = "norm" in jax.tree_util.keystr(path)
        return jnp.asarray((1.0 if norm else 0.0) + (0.1 if norm else 0.2) * rng.randn(*x.shape), x.dtype)

    return jax.tree_util.tree_map_with_path(fill, abstract)


@pytest.fixture(scope="module")
def base():
    return random_base(CFG, 1)


@pytest.fixture(scope="module")
def head_init(base):
    return init_from_base(base, HCFG, seed=0)


@pytest.fixture(scope="module")
def head(head_init):
    return _perturb(head_init, 2)


_train = jax.jit(lambda h, b, f, tok, valid: h.train_outputs(b, f, tok, valid))
_commit = jax.jit(lambda h, b, c, f, y, n: h.commit(b, c, f, y, n))
_commit_fresh = jax.jit(lambda h, b, c, f, y, n: h.commit(b, c, f, y, n, fresh=True))
_step = jax.jit(lambda h, b, s, tok: h.step(b, s, tok))
_head0 = jax.jit(lambda h, s: h.head0(s))
_logits = jax.jit(lambda h, b, o: h.logits(b, o))


def _data(b, t, seed):
    rng = np.random.RandomState(seed)
    f = jnp.asarray(rng.randn(b, t, D), jnp.float32)
    tokens = jnp.asarray(rng.randint(0, V, (b, t)), jnp.int32)
    y = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)  # y_t = x_{t+1}
    return f, tokens, y


# ----------------------------------------------------------------------------- init / config
def test_init_invariants(base, head_init):
    h = head_init
    eye = np.eye(D, dtype=np.float32)
    in_u = lambda x: bool(np.all(x >= 0) and np.all(x < 0.01) and np.std(x) > 1e-4)  # noqa: E731
    for name, value in base.layers.layer_params().items():
        aug = np.asarray(getattr(h.aug, name)[...])
        assert aug.shape[0] == HCFG.num_aug_layers
        for layer in aug:
            np.testing.assert_array_equal(layer, np.asarray(value[-1]), err_msg=name)
    np.testing.assert_array_equal(np.asarray(h.aug_norm[...]), np.asarray(base.final_norm[...]))
    np.testing.assert_array_equal(np.asarray(h.head_norm[...]), np.asarray(base.final_norm[...]))
    assert in_u(np.asarray(h.fc0_w[...]) - eye)
    np.testing.assert_array_equal(np.asarray(h.fc0_b[...]), 0)
    fcout = np.asarray(h.fcout_w[...])
    assert fcout.shape == (2 * D, D)
    assert in_u(fcout[:D] - eye) and in_u(fcout[D:])  # identity on the state half [s ; e]
    np.testing.assert_array_equal(np.asarray(h.fcout_b[...]), 0)
    for ad in ("ad1", "ad2"):
        get = lambda n: np.asarray(getattr(h, f"{ad}_{n}")[...])  # noqa: E731
        assert in_u(get("wq") - eye) and in_u(get("wk") - eye) and in_u(get("wv"))
        for b in ("bq", "bk", "bv"):
            np.testing.assert_array_equal(get(b), 0)
        np.testing.assert_array_equal(get("norm"), 1)
    assert not np.array_equal(np.asarray(h.ad1_wq[...]), np.asarray(h.ad2_wq[...]))  # independent draws


def test_config_options(base):
    with pytest.raises(ValueError, match="embed_source"):
        Clover2Config(embed_source="tied")
    h = nnx.eval_shape(lambda: Clover2Head(CFG, Clover2Config(rope_theta=10000.0, embed_source="input",
                                                              num_aug_layers=1), rngs=nnx.Rngs(0)))
    assert h.aug.config.rope_theta == 10000.0 and h.aug.wq.shape[0] == 1
    tok = jnp.array([[3, 5]])
    np.testing.assert_array_equal(np.asarray(h.embed(base, tok)), np.asarray(base.embed[...])[[3, 5]][None])
    assert HCFG.embed_source == "lm_head"  # default: the frozen lm_head copy, E = W_lm^T


def test_dims_mismatch_is_a_clear_error(head):
    for field, value in [("hidden_size", 48), ("intermediate_size", 40), ("num_key_value_heads", 4),
                         ("vocab_size", 65), ("head_dim", 4)]:
        other = dataclasses.replace(CFG, **{field: value})
        with pytest.raises(ValueError, match=field):
            check_compatible(head, other)
        abstract_base = nnx.eval_shape(lambda: init_llama(other))  # no weights materialised
        with pytest.raises(ValueError, match=field):
            head.logits(abstract_base, jnp.zeros((1, D)))


def test_shapes(base, head):
    b, t = 3, 8  # the shapes of the tests below, so the compiled functions are shared
    f, tokens, y = _data(b, t, 0)
    out = _train(head, base, f, tokens, jnp.ones((b, t), bool))
    assert out.shape == (HCFG.num_heads, b, t, D)
    for i in range(1, HCFG.num_heads):  # zero padded past T - i
        np.testing.assert_array_equal(np.asarray(out[i, :, t - i:]), 0)
    cache = head.init_cache(b, 16)
    assert cache.k.shape == (HCFG.num_aug_layers, b, CFG.num_key_value_heads, 16, CFG.head_dim)
    state, cache = _commit(head, base, cache, f, y, jnp.array([t, 3, 0]))
    assert state.shape == (b, D) and np.asarray(cache.lengths).tolist() == [t, 3, 0]
    states = jnp.broadcast_to(state[:, None], (b, t, D))  # [B, E, D]
    o0 = _head0(head, states)
    s1, o1 = _step(head, base, states, tokens)
    assert o0.shape == s1.shape == o1.shape == (b, t, D)
    lg = _logits(head, base, o1)
    assert lg.shape == (b, t, V) and lg.dtype == jnp.float32


# ----------------------------------------------------------------------------- inference == training
def test_commit_in_chunks_equals_one_call_and_padding_is_isolated(base, head):
    """Per-row schedules with different chunk fills (0 allowed) and NaN garbage in every padding slot."""
    b, size = 3, 16
    f, _, y = _data(b, 8, 1)
    lengths = np.array([7, 4, 5])
    schedule = np.array([[3, 3, 1], [2, 1, 1], [2, 0, 3]])  # new positions per call, per row
    assert (schedule.sum(1) == lengths).all()

    def padded(counts, starts, width, seed):
        rng = np.random.RandomState(seed)
        fc = np.full((b, width, D), np.nan, np.float32)
        yc = rng.randint(-5, V + 5, (b, width))  # garbage ids, some out of range
        for r in range(b):
            fc[r, :counts[r]] = f[r, starts[r]:starts[r] + counts[r]]
            yc[r, :counts[r]] = y[r, starts[r]:starts[r] + counts[r]]
        return jnp.asarray(fc), jnp.asarray(yc, jnp.int32)

    fc, yc = padded(lengths, np.zeros(b, int), 8, 10)
    state_full, cache_full = _commit(head, base, head.init_cache(b, size), fc, yc, jnp.asarray(lengths))
    assert np.isfinite(np.asarray(state_full)).all()
    # the prompt's commit skips the (empty) cache: the same state and valid cache slots as attending to its
    # masked slots (what padding slots past a row's length hold may differ; nothing reads them)
    state_fresh, cache_fresh = _commit_fresh(head, base, head.init_cache(b, size), fc, yc, jnp.asarray(lengths))
    np.testing.assert_array_equal(np.asarray(state_fresh), np.asarray(state_full))
    for r in range(b):
        np.testing.assert_array_equal(np.asarray(cache_fresh.k[:, r, :, :lengths[r]]),
                                      np.asarray(cache_full.k[:, r, :, :lengths[r]]))

    cache, starts = head.init_cache(b, size), np.zeros(b, int)
    for j, counts in enumerate(schedule.T):
        fc, yc = padded(counts, starts, 3, 20 + j)
        state, cache = _commit(head, base, cache, fc, yc, jnp.asarray(counts))
        starts += counts
    assert np.asarray(cache.lengths).tolist() == lengths.tolist() == np.asarray(cache_full.lengths).tolist()
    np.testing.assert_allclose(np.asarray(state), np.asarray(state_full), atol=2e-5, rtol=2e-5)
    for r in range(b):  # the valid cache slots agree
        for kv in ("k", "v"):
            np.testing.assert_allclose(np.asarray(getattr(cache, kv)[:, r, :, :lengths[r]]),
                                       np.asarray(getattr(cache_full, kv)[:, r, :, :lengths[r]]), atol=2e-5)

    # ... and equal the teacher-forced forward (head 0) at each row's last position, whatever
    # the padding holds in the training batch too.
    valid = jnp.arange(8)[None] < jnp.asarray(lengths)[:, None]
    f_train = jnp.where(valid[..., None], f, jnp.nan)
    out = _train(head, base, f_train, jnp.concatenate([jnp.zeros((b, 1), jnp.int32), y[:, :-1]], 1), valid)
    o0 = head.head0(state_full)
    for r in range(b):
        np.testing.assert_allclose(np.asarray(o0[r]), np.asarray(out[0, r, lengths[r] - 1]), atol=2e-5, rtol=2e-5)


def test_inference_recurrence_matches_teacher_forcing(base, head):
    """commit one position at a time -> s^0_t; head0 / step chains reproduce train_outputs o^i_t."""
    b, t = 3, 8
    f, tokens, y = _data(b, t, 2)
    out = np.asarray(_train(head, base, f, tokens, jnp.ones((b, t), bool)))  # [nh, B, T, D]
    cache, states = head.init_cache(b, 16), []
    for p in range(t):
        s, cache = _commit(head, base, cache, f[:, p:p + 1], y[:, p:p + 1], jnp.ones((b,), jnp.int32))
        states.append(s)
    s = jnp.stack(states, axis=1)  # s^0_t: [B, T(=E), D]
    np.testing.assert_allclose(np.asarray(_head0(head, s)), out[0], atol=2e-5, rtol=2e-5)
    for i in range(1, HCFG.num_heads):
        tok = jnp.pad(y[:, i:], ((0, 0), (0, i)))  # the token fed at depth i is y_{t+i} = x_{t+1+i}
        s, o = _step(head, base, s, tok)
        np.testing.assert_allclose(np.asarray(o[:, :t - i]), out[i, :, :t - i], atol=3e-5, rtol=3e-5,
                                   err_msg=f"head {i}")
    # logits of head 0 through the frozen lm_head
    lg = _logits(head, base, jnp.asarray(out[0]))
    np.testing.assert_allclose(np.asarray(lg), out[0] @ np.asarray(base.lm_head_matrix()), atol=1e-4)


# ----------------------------------------------------------------------------- torch reference
def _torch_res_attention_block(torch, x, e, w, eps, num_heads):
    """The spec's ResAttentionBlock written in torch: q from RMSNorm(x), k/v from the token embedding,
    per-head torch cosine_similarity(eps=rms_norm_eps) gating v, residual add."""
    d = x.shape[-1]
    hd = d // num_heads
    var = x.pow(2).mean(-1, keepdim=True)
    xn = w["norm"] * (x * torch.rsqrt(var + eps))
    q = torch.nn.functional.linear(xn, w["wq"].T, w["bq"])  # torch Linear weight is [out, in]
    k = torch.nn.functional.linear(e, w["wk"].T, w["bk"])
    v = torch.nn.functional.linear(e, w["wv"].T, w["bv"])
    att = torch.nn.functional.cosine_similarity(q.reshape(-1, hd), k.reshape(-1, hd), dim=1, eps=eps)
    gated = v.reshape(-1, num_heads, hd) * att.reshape(-1, num_heads, 1)
    return x + gated.reshape(x.shape)


@pytest.mark.torch
@pytest.mark.parametrize("eps,scale", [(1e-5, 1.0), (0.3, 0.05)])  # the second hits the norm clamp
def test_attention_decoder_matches_torch(eps, scale):
    torch = pytest.importorskip("torch")
    rng = np.random.RandomState(0)
    n_heads = 4
    w = {"norm": 1 + 0.1 * rng.randn(D), "wq": np.eye(D) + 0.3 * rng.randn(D, D), "bq": 0.1 * rng.randn(D),
         "wk": np.eye(D) + 0.3 * rng.randn(D, D), "bk": 0.1 * rng.randn(D), "wv": 0.3 * rng.randn(D, D),
         "bv": 0.1 * rng.randn(D)}
    w = {k: v.astype(np.float32) for k, v in w.items()}
    x = rng.randn(2, 5, D).astype(np.float32)
    e = (scale * rng.randn(2, 5, D)).astype(np.float32)
    if scale < 1:
        w["bk"] *= scale  # keep |k| around eps so some heads clamp and some do not

    tw = {k: torch.tensor(v, requires_grad=True) for k, v in w.items()}
    tx, te = torch.tensor(x, requires_grad=True), torch.tensor(e, requires_grad=True)
    ref = _torch_res_attention_block(torch, tx, te, tw, eps, n_heads)
    cot = rng.randn(*ref.shape).astype(np.float32)
    (ref * torch.tensor(cot)).sum().backward()

    def f(p, x, e):
        return jnp.sum(attention_decoder(p, x, e, n_heads, eps) * cot)

    jw = {k: jnp.asarray(v) for k, v in w.items()}
    out = attention_decoder(jw, jnp.asarray(x), jnp.asarray(e), n_heads, eps)
    np.testing.assert_allclose(np.asarray(out), ref.detach().numpy(), atol=1e-5, rtol=1e-5)
    gp, gx, ge = jax.grad(f, argnums=(0, 1, 2))(jw, jnp.asarray(x), jnp.asarray(e))
    np.testing.assert_allclose(np.asarray(gx), tx.grad.numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(ge), te.grad.numpy(), atol=1e-4, rtol=1e-4)
    for k in w:
        np.testing.assert_allclose(np.asarray(gp[k]), tw[k].grad.numpy(), atol=1e-4, rtol=1e-4, err_msg=k)


def test_blockwise_top_k_equals_lax_top_k():
    from clover_jax.decoding.sampling import top_k_ids

    for v, k in [(49152, 10), (1000, 10), (50, 10), (300, 1), (129, 4)]:
        x = jax.random.normal(jax.random.key(v), (3, 2, v))
        np.testing.assert_array_equal(np.asarray(top_k_ids(x, k)), np.asarray(jax.lax.top_k(x, k)[1]))


@pytest.mark.slow  # compiles the commit twice (scan and unrolled layers)
def test_commit_with_unrolled_layers_equals_the_scan(base, head):
    """The decoding loop runs the Augmenting Block unrolled on per-layer weights taken once before it
    (`RecurrentDrafter.init_state(layers="unrolled")`): the same state and cache as the scan over stacked layers."""
    b, size = 2, 16
    f, _, y = _data(b, 5, 3)
    num = jnp.asarray([5, 3])
    lw = head.aug.per_layer_weights()
    assert len(lw) == HCFG.num_aug_layers
    unrolled = jax.jit(lambda h, b_, c, f, y, n, lw: h.commit(b_, c, f, y, n, layer_weights=lw))
    s_scan, c_scan = _commit(head, base, head.init_cache(b, size), f, y, num)
    s_unr, c_unr = unrolled(head, base, head.init_cache(b, size), f, y, num, lw)
    np.testing.assert_allclose(np.asarray(s_unr), np.asarray(s_scan), atol=1e-5, rtol=1e-5)
    # a second commit reads the first one's cache
    s_scan, c_scan = _commit(head, base, c_scan, f[:, :2], y[:, :2], jnp.asarray([2, 1]))
    s_unr, c_unr = unrolled(head, base, c_unr, f[:, :2], y[:, :2], jnp.asarray([2, 1]), lw)
    np.testing.assert_allclose(np.asarray(s_unr), np.asarray(s_scan), atol=1e-5, rtol=1e-5)
    assert np.asarray(c_unr.lengths).tolist() == np.asarray(c_scan.lengths).tolist() == [7, 4]
    for kv in ("k", "v"):
        np.testing.assert_allclose(np.asarray(getattr(c_unr, kv)[:, 0, :, :7]),
                                   np.asarray(getattr(c_scan, kv)[:, 0, :, :7]), atol=1e-5)
