"""Clover-2 KD loss vs an independent numpy implementation of the reference formulas (§2.3 / §10.4),
with and without position chunking of the V-sized terms, with the label mask; gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax.heads.clover2.model import Clover2Config, Clover2Head
from clover_jax.models.cache import causal_mask
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import init_llama, rms_norm
from clover_jax.heads.losses import (LossConfig, base_features, kd_loss,
                                      kd_loss_packed, pack_positions)
from clover_jax.heads.recurrent.loss import loss as recurrent_loss, loss_from_features as recurrent_loss_from_features

NH, B, T, D, V = 5, 3, 11, 16, 40
LENGTHS = np.array([11, 8, 3])  # the last row is shorter than the number of heads
LABEL_MASK = dict(label_mask_topk=8, label_mask_topp=0.8)  # the label mask on, with the reference's top-k / top-p


# ----------------------------------------------------------------------------- numpy reference
def _softmax(z):
    z = z - z.max(-1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(-1, keepdims=True)


def reference_loss(outputs, h, tokens, loss_mask, lengths, w, cfg: LossConfig):
    """Per sequence as the reference data pipeline: truncate to its length, loss_mask[-1] = 0,
    input_ids_target = x[1:] ++ [0], target = h[1:] ++ [0]; then the loop of main_clover2.py."""
    o, h, w = (np.asarray(a, np.float64) for a in (outputs, h, w))
    nh, b, t, _ = o.shape
    lm = np.zeros((b, t))
    for r in range(b):
        n = lengths[r]
        lm[r, :n] = loss_mask[r, :n]
        lm[r, n - 1] = 0
    y = np.concatenate([tokens[:, 1:], np.zeros((b, 1), tokens.dtype)], axis=1)
    base_logits = h @ w  # logits at every position t (predict x_{t+1})
    base_p = _softmax(base_logits)
    cor = np.zeros((b, t), bool)  # get_id_mask: x_{t+1} among top-k / top-p of the base at t
    for r in range(b):
        for p in range(t):
            mass = 0.0
            for idx in np.argsort(-base_p[r, p], kind="stable")[:cfg.label_mask_topk or base_p.shape[-1]]:
                if mass > (cfg.label_mask_topp or 1.0):
                    break
                cor[r, p] |= idx == y[r, p]
                mass += base_p[r, p, idx]
    loss, out = 0.0, {k: np.zeros(nh) for k in ("vloss", "ploss", "correct", "chain_correct", "mask_count")}
    for i in range(nh):
        vsum = psum = count = correct = chain = 0.0
        for r in range(b):
            for p in range(t - i):
                m = lm[r, p + i]
                if cfg.label_mask:
                    m *= np.prod(cor[r, p:p + i + 1])
                if not m:
                    continue
                count += 1
                diff = np.abs(o[i, r, p] - h[r, p + 1 + i])
                vsum += np.mean(np.where(diff < 1, 0.5 * diff ** 2, diff - 0.5))
                logits = o[i, r, p] @ w
                logq = logits - logits.max() - np.log(np.sum(np.exp(logits - logits.max())))
                psum += -np.sum(base_p[r, p + 1 + i] * logq)
                right = [np.argmax(o[j, r, p] @ w) == np.argmax(base_logits[r, p + 1 + j]) for j in range(i + 1)]
                correct += right[-1]
                chain += all(right)
        out["vloss"][i], out["ploss"][i] = vsum / (count + 1), psum / (count + 1)
        out["correct"][i], out["chain_correct"][i], out["mask_count"][i] = correct, chain, count
        loss += cfg.decay ** i * (cfg.v_weight * out["vloss"][i] + cfg.p_weight * out["ploss"][i])
    out["loss"] = loss
    return out


def _inputs(seed):
    rng = np.random.RandomState(seed)
    w = 0.7 * rng.randn(D, V)  # peaked teacher distributions, so top-k/top-p masks both ways
    h = rng.randn(B, T, D)
    p = _softmax(h @ w)
    tokens = rng.randint(0, V, (B, T))
    ranked = np.argsort(-p, axis=-1)[:, :-1]  # the base's candidates for x_{t+1}
    pick = rng.rand(B, T - 1)  # data tokens: 40% the base's first choice, 30% its second, 30% random
    tokens[:, 1:] = np.where(pick < 0.4, ranked[..., 0], np.where(pick < 0.7, ranked[..., 1], tokens[:, 1:]))
    h_next = np.stack([np.pad(h[:, 1 + i:], ((0, 0), (0, 1 + i), (0, 0)))[:, :T] for i in range(NH)])
    near = rng.rand(NH, B, T, 1) < 0.6  # outputs close to the target at ~60% of positions
    outputs = np.where(near, h_next + 0.3 * rng.randn(NH, B, T, D), 1.5 * rng.randn(NH, B, T, D))
    loss_mask = (rng.rand(B, T) < 0.8).astype(np.float32)
    valid = np.arange(T)[None] < LENGTHS[:, None]
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    return f32(outputs), f32(h), jnp.asarray(tokens, jnp.int32), f32(loss_mask), jnp.asarray(valid), f32(w)


_kd = jax.jit(kd_loss, static_argnums=6)


@pytest.mark.parametrize("cfg", [LossConfig(), LossConfig(vocab_chunk=3), LossConfig(vocab_chunk=4, **LABEL_MASK),
                                 LossConfig(decay=0.5, v_weight=2.0, **LABEL_MASK)],
                         ids=["plain", "chunk3", "chunk4-label", "label-weights"])
def test_kd_loss_matches_numpy_reference(cfg):
    outputs, h, tokens, loss_mask, valid, w = _inputs(0)
    loss, metrics = _kd(outputs, h, tokens, loss_mask, valid, w, cfg)
    ref = reference_loss(outputs, h, np.asarray(tokens), np.asarray(loss_mask), LENGTHS, w, cfg)
    np.testing.assert_allclose(float(loss), ref["loss"], rtol=1e-5)
    for k in ("vloss", "ploss"):
        np.testing.assert_allclose(np.asarray(metrics[k]), ref[k], rtol=1e-5, atol=1e-6, err_msg=k)
    for k in ("correct", "chain_correct", "mask_count"):
        np.testing.assert_array_equal(np.asarray(metrics[k]), ref[k], err_msg=k)
    assert ref["mask_count"][-1] > 0 and 0 < ref["correct"][0] < ref["mask_count"][0]
    assert ref["chain_correct"][0] == ref["correct"][0]
    assert np.any(ref["chain_correct"] < ref["correct"])  # the chain condition matters here
    if cfg.label_mask:  # the label mask removes some positions but not all
        assert 0 < ref["mask_count"][0] < np.asarray(metrics["loss_mask_count"])[0]


def test_chunking_changes_nothing_including_gradients():
    outputs, h, tokens, loss_mask, valid, w = _inputs(1)
    grad = jax.jit(jax.value_and_grad(lambda o, cfg: kd_loss(o, h, tokens, loss_mask, valid, w, cfg)[0]),
                   static_argnums=1)
    l_full, g_full = grad(outputs, LossConfig(**LABEL_MASK))
    l_chunk, g_chunk = grad(outputs, LossConfig(vocab_chunk=3, **LABEL_MASK))
    np.testing.assert_allclose(float(l_chunk), float(l_full), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g_chunk), np.asarray(g_full), atol=1e-7, rtol=1e-5)
    # entries the loss never reads (t >= T - i, padding rows) get no gradient
    for i in range(1, NH):
        np.testing.assert_array_equal(np.asarray(g_full[i, :, T - i:]), 0)
    np.testing.assert_array_equal(np.asarray(g_full[:, 2, LENGTHS[2] - 1:]), 0)


@pytest.mark.slow  # compiles the loss and gradients twice
def test_packed_loss_with_every_position_listed_equals_the_dense_loss_and_gradients():
    outputs, h, tokens, loss_mask, valid, w = _inputs(2)
    index = jnp.asarray(pack_positions(loss_mask, valid, T))  # room for every trained position
    dense = jax.jit(jax.value_and_grad(lambda o: kd_loss(o, h, tokens, loss_mask, valid, w)[0]))
    packed = jax.jit(jax.value_and_grad(lambda o: kd_loss_packed(o, h, loss_mask, valid, w, index)[0]))
    (l_d, g_d), (l_p, g_p) = dense(outputs), packed(outputs)
    np.testing.assert_allclose(float(l_p), float(l_d), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g_p), np.asarray(g_d), atol=1e-7, rtol=1e-5)
    _, md = kd_loss(outputs, h, tokens, loss_mask, valid, w)
    _, mp = kd_loss_packed(outputs, h, loss_mask, valid, w, index)
    for k in ("vloss", "ploss", "acc", "correct", "mask_count", "p_count"):
        np.testing.assert_allclose(np.asarray(mp[k]), np.asarray(md[k]), rtol=1e-6, err_msg=k)
    # the packed chain only counts heads scored at trained positions (the dense one scores every position)
    assert np.all(np.asarray(mp["chain_correct"]) <= np.asarray(md["chain_correct"]))
    assert float(mp["chain_correct"][0]) == float(md["chain_correct"][0]) > 0


@pytest.mark.slow  # compiles the loss and its reference
def test_packed_loss_on_a_subset_is_the_cross_entropy_over_that_subset():
    outputs, h, tokens, loss_mask, valid, w = _inputs(3)
    k = 4
    index = pack_positions(loss_mask, valid, k, np.random.default_rng(0))
    lm = np.asarray(loss_mask, bool) & np.asarray(valid) & np.pad(np.asarray(valid)[:, 1:], ((0, 0), (0, 1)))
    assert np.all((index == -1) | lm[np.arange(B)[:, None], np.maximum(index, 0)])  # only trained positions
    assert (index[0] >= 0).sum() == k and np.all(np.diff(index[0]) > 0)  # row 0 has more: a sorted subset
    assert set(index[2][index[2] >= 0]) == set(np.flatnonzero(lm[2]))  # row 2 has fewer: all of them
    _, m = kd_loss_packed(outputs, h, loss_mask, valid, w, jnp.asarray(index))
    o, hh, ww = (np.asarray(a, np.float64) for a in (outputs, h, w))
    for i in range(NH):
        ces, right = [], []
        for r in range(B):
            for u in index[r][index[r] >= i]:  # head i scored at start u - i against the teacher at u + 1
                logits = o[i, r, u - i] @ ww
                logq = logits - logits.max() - np.log(np.sum(np.exp(logits - logits.max())))
                ces.append(-np.sum(_softmax(hh[r, u + 1] @ ww) * logq))
                right.append(np.argmax(logits) == np.argmax(hh[r, u + 1] @ ww))
        np.testing.assert_allclose(float(m["ploss"][i]), np.sum(ces) / (len(ces) + 1), rtol=1e-5)
        assert float(m["p_count"][i]) == len(ces) and float(m["correct"][i]) == np.sum(right)
    _, md = kd_loss(outputs, h, tokens, loss_mask, valid, w)  # the regression term is not subsampled
    np.testing.assert_allclose(np.asarray(m["vloss"]), np.asarray(md["vloss"]), rtol=1e-6)
    with pytest.raises(ValueError, match="label mask"):
        kd_loss_packed(outputs, h, loss_mask, valid, w, jnp.asarray(index), LossConfig(**LABEL_MASK))


# ----------------------------------------------------------------------------- with the models
CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8)


def _host_random(abstract, seed):
    """Random weights built on the host for an abstract module (norm weights around 1)."""
    rng = np.random.RandomState(seed)

    def fill(path, x):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            return jnp.asarray(1 + 0.1 * rng.randn(*x.shape), x.dtype)
        if "ad1_w" in name or "ad2_w" in name or "fc0_w" in name:
            return jnp.asarray(0.3 * rng.randn(*x.shape) + (np.eye(x.shape[0]) if "wv" not in name else 0), x.dtype)
        return jnp.asarray(0.2 * rng.randn(*x.shape), x.dtype)

    return jax.tree_util.tree_map_with_path(fill, abstract)


@pytest.mark.slow  # compiles the loss and gradients
def test_clover2_loss_end_to_end_and_gradients_only_reach_the_head():
    base = _host_random(nnx.eval_shape(lambda: init_llama(CFG)), 0)
    head = _host_random(nnx.eval_shape(lambda: Clover2Head(CFG, Clover2Config(), rngs=nnx.Rngs(0))), 1)
    rng = np.random.RandomState(3)
    b, t = 2, 9
    tokens = jnp.asarray(rng.randint(0, CFG.vocab_size, (b, t)), jnp.int32)
    valid = jnp.arange(t)[None] < jnp.array([[9], [6]])
    loss_mask = jnp.asarray(rng.rand(b, t) < 0.8, jnp.float32)
    cfg = LossConfig(vocab_chunk=4)

    (loss, metrics), (g_head, g_base) = jax.jit(jax.value_and_grad(
        lambda hd, bs: recurrent_loss(hd, bs, tokens, loss_mask, valid, cfg), argnums=(0, 1), has_aux=True))(head, base)

    # the same number from the pieces: base forward -> head.train_outputs -> numpy reference
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    f, _, _ = jax.jit(lambda bs: bs.forward_hidden(tokens, pos, causal_mask(valid)))(base)
    outputs = jax.jit(lambda hd, bs: hd.train_outputs(bs, f, tokens, valid))(head, base)
    hpost = rms_norm(f, base.final_norm[...], CFG.rms_norm_eps)
    ref = reference_loss(outputs, hpost, np.asarray(tokens), np.asarray(loss_mask), np.array([9, 6]),
                         base.lm_head_matrix(), cfg)
    np.testing.assert_allclose(float(loss), ref["loss"], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(metrics["mask_count"]), ref["mask_count"])

    for path, g in jax.tree_util.tree_leaves_with_path(g_base):  # frozen: teacher, W_lm, embedding
        assert not np.any(np.asarray(g)), jax.tree_util.keystr(path)
    for path, g in jax.tree_util.tree_leaves_with_path(g_head):
        g = np.asarray(g)
        assert np.isfinite(g).all() and np.any(g), jax.tree_util.keystr(path)


@pytest.mark.slow  # compiles the loss and its reference
def test_draft_vocabulary_loss_is_the_reference_loss_on_those_tokens():
    """vocab_ids: teacher P restricted to the ids and renormalised, student softmax over the ids only."""
    base = _host_random(nnx.eval_shape(lambda: init_llama(CFG)), 0)
    head = _host_random(nnx.eval_shape(lambda: Clover2Head(CFG, Clover2Config(num_heads=3), rngs=nnx.Rngs(0))), 1)
    rng = np.random.RandomState(4)
    b, t = 2, 9
    tokens = jnp.asarray(rng.randint(0, CFG.vocab_size, (b, t)), jnp.int32)
    valid = jnp.arange(t)[None] < jnp.array([[9], [7]])
    loss_mask = jnp.asarray(rng.rand(b, t) < 0.8, jnp.float32)
    ids = np.sort(rng.choice(CFG.vocab_size, 20, replace=False)).astype(np.int32)
    f = base_features(base, tokens, valid)
    loss_fn = jax.jit(lambda ids: recurrent_loss_from_features(head, base, f, tokens, loss_mask, valid, vocab_ids=ids))

    loss, metrics = loss_fn(jnp.asarray(ids))
    outputs = head.train_outputs(base, f, tokens, valid)
    hpost = rms_norm(f, base.final_norm[...], CFG.rms_norm_eps)
    w = np.asarray(base.lm_head_matrix())
    ref = reference_loss(outputs, hpost, np.asarray(tokens), np.asarray(loss_mask), np.array([9, 7]), w[:, ids],
                         LossConfig())
    np.testing.assert_allclose(float(loss), ref["loss"], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(metrics["ploss"]), ref["ploss"], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(metrics["correct"]), ref["correct"])
    # every id listed: the full-vocabulary loss; a proper subset: a different cross-entropy, same regression
    full_loss, full = recurrent_loss(head, base, tokens, loss_mask, valid)
    all_loss, _ = loss_fn(jnp.arange(CFG.vocab_size, dtype=jnp.int32))
    np.testing.assert_allclose(float(all_loss), float(full_loss), rtol=1e-6)
    assert not np.allclose(np.asarray(metrics["ploss"]), np.asarray(full["ploss"]), rtol=1e-3)
    np.testing.assert_allclose(np.asarray(metrics["vloss"]), np.asarray(full["vloss"]), rtol=1e-6)
