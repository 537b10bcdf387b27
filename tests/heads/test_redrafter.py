"""ReDrafter through the head registry: the reference's beam search (against a numpy transcription of it), the
merge of beams into a prefix tree, exact greedy decoding and lossless sampling over beam trees, acceptance when
the drafts are right, the distillation loss, a training run, and export under the reference's parameter names
(loaded by a torch re-implementation of the reference's `Drafter` with strict key matching) and import back."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax import parallel
from clover_jax import generate
from clover_jax.decoding.autoregressive import ar_generate
from clover_jax.decoding.sampling import SamplingParams
from clover_jax.decoding.speculative import spec_generate
from clover_jax.decoding.tree import BeamTree, TreeSpecError, get_tree
from clover_jax.heads import registry
from clover_jax.heads.clover2.model import Clover2Head
from clover_jax.heads.redrafter.head import (BeamDrafter, ReDrafterConfig, ReDrafterHead, beam_search, beams_to_tree,
                                        init_from_base)
from clover_jax.heads.registry import drafter_for
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import init_llama, rms_norm
from clover_jax.heads.losses import LossConfig, pack_positions
from clover_jax.validation import InputError
from tiny_llama import TINY_LLAMA

CFG = TINY_LLAMA
NO_EOS = ()
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))  # training_helpers, test_trainer


def _head(base, seed=1, **kw):
    head = init_from_base(base, ReDrafterConfig(**kw), seed=seed)
    nnx.update(head, {"vocab_proj": head.vocab_proj[...] * 8})  # peaked drafts: beams share prefixes
    return head


def _prompts(b=2, t=8, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(3, CFG.vocab_size, (b, t)), jnp.int32), jnp.asarray([t, t - 3][:b], jnp.int32)


def _same_as_greedy(base, out, prompt, lens, n, eos):
    ar = ar_generate(base, prompt, lens, max_new_tokens=n, cache_size=160, eos_ids=eos)
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ar.lengths))
    for r in range(prompt.shape[0]):
        k = int(ar.lengths[r])
        np.testing.assert_array_equal(np.asarray(out.tokens)[r, :k], np.asarray(ar.tokens)[r, :k])


def _spec(base, head, tree, prompt, lens, n=24, eos=NO_EOS, vocab=None):
    out, stats, _ = spec_generate(base, head, prompt, lens, max_new_tokens=n, cache_size=160,
                                  sampling=SamplingParams(), key=jax.random.key(0), eos_ids=eos,
                                  drafter=drafter_for(type(head), tree, vocab))
    return out, stats


def test_beam_tree_names_and_errors():
    t = get_tree("beam-4x5")
    assert isinstance(t, BeamTree) and (t.width, t.length, t.num_nodes, t.max_depth) == (4, 5, 17, 4)
    assert get_tree("beam-3x4-u7").num_nodes == 7 and get_tree("beam-3x4-u7").name == "beam-3x4-u7"
    with pytest.raises(TreeSpecError, match="budget 3 must lie between the beam length 4"):
        get_tree("beam-3x4-u3")
    with pytest.raises(TreeSpecError, match="length must be an integer >= 2"):
        BeamTree(3, 1)
    assert registry.get("redrafter").default_tree == "beam-4x5"
    assert isinstance(drafter_for(ReDrafterHead, "beam-2x3"), BeamDrafter)
    with pytest.raises(InputError, match="redrafter heads draft a beam-search policy"):
        drafter_for(ReDrafterHead, "chain-3")
    with pytest.raises(InputError, match="beam-search policy"):
        drafter_for(Clover2Head, "beam-2x3")


def _reference_beam_search(head, base, h, root, width, length):
    """A numpy transcription of the reference's `Drafter.beam_search_candidates` (+ `compute_logits`)."""
    p = {k: np.asarray(v, np.float64) for k, v in nnx.to_pure_dict(nnx.state(head)).items()}
    emb = np.asarray(base.embed[...], np.float64)
    silu = lambda x: x / (1 + np.exp(-x))  # noqa: E731
    b, d = h.shape
    log_p = np.tile(np.array([0.0] + [-50000.0] * (width - 1)), (b, 1))
    beams = np.repeat(root[:, None, None], width, axis=1)
    state = np.zeros((b, width, d))
    ctx = np.repeat(h[:, None], width, axis=1)
    for _ in range(length - 1):
        state = silu(emb[beams[..., -1]] @ p["rnn_w"] + state @ p["rnn_u"] + p["rnn_b"])
        z = np.concatenate([ctx, state], -1)
        for j in range(head.cfg.num_layers):
            z = z + silu(z @ p["block_w"][j] + p["block_b"][j])
        logits = z @ p["vocab_proj"]
        logits = logits - logits.max(-1, keepdims=True)
        kth = np.sort(logits, -1)[..., -50][..., None]
        logits = np.where(logits < kth, -50000.0, logits)
        logq = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        total = (logq + log_p[..., None]).reshape(b, -1)
        idx = np.argsort(-total, axis=-1, kind="stable")[:, :width]
        log_p = np.take_along_axis(total, idx, -1)
        src, tok = idx // logits.shape[-1], idx % logits.shape[-1]
        beams = np.concatenate([np.take_along_axis(beams, src[..., None], 1), tok[..., None]], -1)
        state = np.take_along_axis(state, src[..., None], 1)
    return beams, log_p


@pytest.mark.slow  # compiles beam search against a reference
def test_beam_search_is_the_references():
    base = init_llama(CFG, seed=0)
    head = _head(base)
    rng = np.random.default_rng(0)
    h = rng.normal(size=(3, CFG.hidden_size)).astype(np.float32)
    root = rng.integers(0, CFG.vocab_size, 3).astype(np.int32)
    beams, log_p = beam_search(head, base, jnp.asarray(h), jnp.asarray(root), 4, 5, head.projection())
    want_beams, want_logp = _reference_beam_search(head, base, h, root, 4, 5)
    np.testing.assert_array_equal(np.asarray(beams), want_beams)
    np.testing.assert_allclose(np.asarray(log_p), want_logp, rtol=1e-4, atol=1e-4)
    assert len({tuple(x) for x in want_beams[0, :, :2]}) < 4  # the peaked drafter makes beams share prefixes


def _paths(tokens, parent):
    """{node: tuple of tokens root..node} of one row."""
    out = {}
    for u in range(len(parent)):
        if u and parent[u] < 0:
            continue
        chain, v = [], u
        while v > 0:
            chain.append(int(tokens[v]))
            v = int(parent[v])
        out[u] = (int(tokens[0]),) + tuple(reversed(chain))
    return out


def test_beams_to_tree_merges_shared_prefixes():
    r, a, b, c, d, e, f, g, hh, i = range(10)
    beams = jnp.asarray([[[r, a, b, c], [r, a, b, d], [r, a, e, f], [r, g, hh, i]]], jnp.int32)
    tokens, parent = beams_to_tree(beams, 13)
    tokens, parent = np.asarray(tokens[0]), np.asarray(parent[0])
    assert list(tokens[:10]) == [r, a, b, c, d, e, f, g, hh, i]  # (beam, depth) order, duplicates skipped
    assert list(parent) == [-1, 0, 1, 2, 2, 1, 5, 0, 7, 8, -1, -1, -1]
    tokens, parent = beams_to_tree(beams, 6)  # a budget: the first beams kept whole, later ones cut
    assert list(np.asarray(parent[0])) == [-1, 0, 1, 2, 2, 1]

    # random beams over 3 tokens (much sharing): every beam prefix is exactly one node's path
    rng = np.random.default_rng(0)
    beams = rng.integers(0, 3, (5, 6, 4)).astype(np.int32)
    beams[:, :, 0] = 7
    tokens, parent = beams_to_tree(jnp.asarray(beams), 1 + 6 * 3)
    for row in range(5):
        paths = _paths(np.asarray(tokens[row]), np.asarray(parent[row]))
        assert len(set(paths.values())) == len(paths)  # no duplicated node
        want = {tuple(beams[row, w, :j + 1]) for w in range(6) for j in range(4)}
        assert set(paths.values()) == want


@pytest.mark.parametrize("tree", ["beam-3x4", "beam-4x5-u9"])
@pytest.mark.slow  # a speculative loop per tree
def test_speculative_redrafter_equals_greedy(tree):
    base = init_llama(CFG, seed=0)
    head = _head(base)
    prompt, lens = _prompts()
    for eos in (NO_EOS, (2,)):
        out, _ = _spec(base, head, tree, prompt, lens, eos=eos)
        _same_as_greedy(base, out, prompt, lens, 24, eos)
    out, _ = _spec(base, head, tree, prompt, lens, vocab=list(range(0, 64, 2)))  # a draft vocabulary
    _same_as_greedy(base, out, prompt, lens, 24, NO_EOS)


@pytest.mark.slow  # compiles speculative loops
def test_redrafter_drafts_are_accepted_when_right_and_rejected_when_wrong():
    """The base emits token 0 forever (final norm 0, so h = 0 too). A drafter whose state is constant and whose
    projection favours token 0 puts [0, 0, 0, 0] in beam 0: every step accepts the whole beam (tau = length).
    Ranking token 0 last keeps it out of every beam: nothing is accepted (tau = 1). A merge or tree layout that
    misplaced beam 0's tokens would fail the first half."""
    base = init_llama(CFG, seed=0)
    base.final_norm[...] = jnp.zeros_like(base.final_norm[...])
    head = _head(base, num_layers=1)
    d = CFG.hidden_size
    zero = lambda x: jnp.zeros_like(x[...])  # noqa: E731
    proj = np.zeros((2 * d, CFG.vocab_size), np.float32)
    proj[d:, 0] = 1.0  # s = SiLU(1) > 0 everywhere: token 0 first, the rest tied
    nnx.update(head, {"rnn_w": zero(head.rnn_w), "rnn_u": zero(head.rnn_u), "rnn_b": jnp.ones(d),
                      "block_w": zero(head.block_w), "block_b": zero(head.block_b), "vocab_proj": jnp.asarray(proj)})
    prompt, lens = _prompts()
    out, stats = _spec(base, head, "beam-3x5", prompt, lens, n=2 + 5 * 6)
    assert stats["tau"] == 5, stats
    _same_as_greedy(base, out, prompt, lens, 2 + 5 * 6, NO_EOS)
    nnx.update(head, {"vocab_proj": jnp.asarray(-proj)})
    out, stats = _spec(base, head, "beam-3x5", prompt, lens, n=12)
    assert stats["tau"] == 1.0 and stats["accept_hist"][0] > 0, stats
    _same_as_greedy(base, out, prompt, lens, 12, NO_EOS)


@pytest.mark.slow  # sampling loops over many rows
def test_sampling_over_beam_trees_is_lossless():
    """Tokens 2..3 under speculative sampling with beam drafts vs plain sampling: chi-square homogeneity (the
    reference's own sampling rule is not lossless; ours verifies the merged tree with the deterministic-children
    rule)."""
    cfg = LlamaConfig(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, eos_token_ids=(99,))
    base = init_llama(cfg, seed=1)
    base.embed[...] = base.embed[...] * 40  # a peaked but not degenerate distribution
    head = init_from_base(base, ReDrafterConfig(num_layers=1), seed=2)
    nnx.update(head, {"vocab_proj": head.vocab_proj[...] * 10})
    rows = 3000
    kw = dict(max_new_tokens=3, cache_size=64, temperature=1.0)
    first = lambda res: np.array([t[:3] for t in res.token_ids])  # noqa: E731
    ar = first(generate(base, [[3, 5, 7]] * rows, seed=11, **kw))
    res = generate(base, [[3, 5, 7]] * rows, seed=12, mode="speculative", head=head, tree="beam-3x3", **kw)
    sp = first(res)
    assert res.stats["accept_hist"][1] + res.stats["accept_hist"][2] > rows // 10, "too few drafts accepted"
    for pos in (1, 2):
        a, s = np.bincount(ar[:, pos], minlength=12), np.bincount(sp[:, pos], minlength=12)
        keep = (a + s) > 0
        a, s = a[keep], s[keep]
        exp_a, exp_s = (a + s) * a.sum() / (a.sum() + s.sum()), (a + s) * s.sum() / (a.sum() + s.sum())
        chi2 = ((a - exp_a) ** 2 / exp_a).sum() + ((s - exp_s) ** 2 / exp_s).sum()
        pval = float(jax.scipy.special.gammaincc((keep.sum() - 1) / 2, chi2 / 2))
        assert pval > 1e-3, f"position {pos}: chi2={chi2:.1f} p={pval:.2e}\nar={a}\nsp={s}"


@pytest.mark.slow  # the loss and its unrolled reference
def test_redrafter_loss_is_the_unrolled_soft_cross_entropy():
    base = init_llama(CFG, seed=0)
    head = _head(base, num_steps=3)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 64, (2, 12)), jnp.int32)
    valid = jnp.asarray(np.arange(12)[None] < np.array([[12], [9]]))
    loss_mask = valid & (jnp.arange(12)[None] >= 2)
    from clover_jax.heads.losses import base_features

    f = base_features(base, tokens, valid)
    ht = registry.get("redrafter")
    cfg = LossConfig(decay=1.0)  # the reference's equal weights
    loss, m = ht.loss_from_features(head, base, f, tokens, loss_mask, valid, cfg)
    assert np.all(np.asarray(m["vloss"]) == 0)

    # by hand: step i at t runs the RNN over e(x_{t+1}) .. e(x_{t+1+i}) with context h_t and scores
    # log_softmax(z P) against softmax(W_lm h_{t+1+i})
    h = np.asarray(rms_norm(f, base.final_norm[...], CFG.rms_norm_eps), np.float64)
    emb = np.asarray(base.embed[...], np.float64)[np.asarray(tokens)]
    p = {k: np.asarray(v, np.float64) for k, v in nnx.to_pure_dict(nnx.state(head)).items()}
    silu = lambda x: x / (1 + np.exp(-x))  # noqa: E731
    w_lm = np.asarray(base.lm_head_matrix(), np.float64)
    lm = np.asarray(loss_mask & valid & jnp.concatenate([valid[:, 1:], jnp.zeros((2, 1), bool)], 1))
    total, hard = 0.0, 0.0
    for i in range(3):
        num, cnt, num_h, cnt_h = 0.0, 0, 0.0, 0
        for b in range(2):
            for t in range(12 - 1 - i):
                if not lm[b, t + i]:
                    continue
                s = np.zeros(CFG.hidden_size)
                for k in range(i + 1):
                    e = emb[b, t + 1 + k] if t + 1 + k < 12 else np.zeros(CFG.hidden_size)
                    s = silu(e @ p["rnn_w"] + s @ p["rnn_u"] + p["rnn_b"])
                z = np.concatenate([h[b, t], s])
                for j in range(head.cfg.num_layers):
                    z = z + silu(z @ p["block_w"][j] + p["block_b"][j])
                lg = z @ p["vocab_proj"]
                logp = lg - lg.max() - np.log(np.exp(lg - lg.max()).sum())
                tl = h[b, t + 1 + i] @ w_lm
                q = np.exp(tl - tl.max())
                num += -np.sum(q / q.sum() * logp)
                cnt += 1
                if t + 2 + i < 12 and valid[b, t + 2 + i]:  # the hard label x_{t+2+i}
                    num_h += -logp[int(tokens[b, t + 2 + i])]
                    cnt_h += 1
        total += num / (cnt + 1)
        hard += num_h / (cnt_h + 1)
    np.testing.assert_allclose(float(loss), total, rtol=1e-4)
    hcfg = LossConfig(decay=1.0, hard_labels=True)  # the reference code's ground-truth cross-entropy
    loss_h, m_h = ht.loss_from_features(head, base, f, tokens, loss_mask, valid, hcfg)
    np.testing.assert_allclose(float(loss_h), hard, rtol=1e-4)
    index = jnp.asarray(pack_positions(loss_mask, valid, 12))
    loss_hp, _ = ht.loss_from_features(head, base, f, tokens, loss_mask, valid, hcfg, index=index)
    np.testing.assert_allclose(float(loss_hp), float(loss_h), rtol=1e-5)
    # over a draft vocabulary, positions whose label is outside it have no target
    ids = jnp.asarray(sorted(set(np.asarray(tokens).ravel().tolist()))[::2], jnp.int32)
    from clover_jax.heads.losses import next_token_labels

    lab = np.asarray(next_token_labels(tokens, jnp.ones_like(valid), ids))
    toks = np.asarray(tokens)
    for b in range(2):
        for t in range(11):
            k = lab[b, t]
            assert (k == -1) if toks[b, t + 1] not in np.asarray(ids) else np.asarray(ids)[k] == toks[b, t + 1]
    _, m_v = ht.loss_from_features(head, base, f, tokens, loss_mask, valid, hcfg, vocab_ids=ids)
    assert np.all(np.asarray(m_v["p_count"]) < np.asarray(m_h["p_count"]))

    index = jnp.asarray(pack_positions(loss_mask, valid, 12))
    loss_p, _ = ht.loss_from_features(head, base, f, tokens, loss_mask, valid, cfg, index=index)
    np.testing.assert_allclose(float(loss_p), float(loss), rtol=1e-5)
    grads = nnx.grad(lambda hd: ht.loss_from_features(hd, base, f, tokens, loss_mask, valid, cfg)[0])(head)
    for name in ("rnn_w", "rnn_u", "block_w", "vocab_proj"):
        assert float(jnp.abs(grads[name][...]).sum()) > 0, name


@pytest.mark.slow  # trains, then exports
def test_redrafter_training_run_export_and_reference_layout(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors import safe_open

    from clover_jax.cli.export import export_head_from_run
    from clover_jax.training.loading import load_head
    from clover_jax.heads.export import import_head
    from clover_jax.io.export import export_base
    from clover_jax.training.data import BucketedBatcher
    from clover_jax.training.run import run_experiment
    from clover_jax.training.trainer import Trainer
    from test_trainer import _tiny_dataset
    from training_helpers import SyntheticBatcher, make_cfg, tiny_base

    base = tiny_base()
    base.lm_head[...] = base.lm_head[...] * 40  # a peaked teacher (a random tiny base is near uniform)
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices("cpu")[:1])
    overrides = ("head.type=redrafter", "head.num_heads=3", "head.num_layers=2", "loss.decay=1.0")
    trainer = Trainer(make_cfg(*overrides, "optim.lr=1e-2", "optim.warmup_steps=0", "train.steps=40"), base,
                      mesh=mesh, donate=False)
    data = SyntheticBatcher(seed=2)
    losses = [float(trainer.train_step(next(data))["loss"]) for _ in range(40)]
    assert np.mean(losses[-5:]) < 0.8 * losses[0], losses

    run = tmp_path / "run"
    cfg = make_cfg(*overrides, "train.steps=4", "loss.vocab_positions_per_row=4", output_dir=str(run))
    summary = run_experiment(cfg, progress=False, mesh=mesh, loaded=base,
                             batcher=BucketedBatcher(_tiny_dataset(), 8, [8, 16], seed=0), eval_batches=[])
    assert summary["final_step"] == 4
    from_run = load_head(run, base)
    assert isinstance(from_run, ReDrafterHead) and from_run.cfg.num_steps == 3 and from_run.cfg.num_layers == 2

    out = export_head_from_run(run, tmp_path / "head", model=str(export_base(base, tmp_path / "base")))
    meta = json.loads((out / "config.json").read_text())
    assert meta["head_type"] == "redrafter" and meta["model_type"] == "recurrent_drafting_drafter"
    assert (meta["exit_dim"], meta["num_draft_layers"], meta["rnn"]) == (64, 2, True)
    with safe_open(str(out / "model.safetensors"), framework="numpy") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    assert set(tensors) == {"lm_head.0.linear.weight", "lm_head.0.linear.bias", "lm_head.1.linear.weight",
                            "lm_head.1.linear.bias", "lm_head.2.weight", "rnn_w.weight", "rnn_u.weight",
                            "rnn_u.bias"}
    back = import_head(out, base)
    for a, b in zip(jax.tree.leaves(nnx.state(back)), jax.tree.leaves(nnx.state(from_run))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # the reference's module layout (lm_head = Sequential(ResBlock x L, Linear(2H, V, bias=False)), rnn_u with a
    # bias, rnn_w without) loads the file with strict key matching and computes the same draft logits
    class ResBlock(torch.nn.Module):
        def __init__(self, e):
            super().__init__()
            self.linear = torch.nn.Linear(e, e, bias=True)

        def forward(self, x):
            return x + torch.nn.functional.silu(self.linear(x))

    class Drafter(torch.nn.Module):
        def __init__(self, d, v, layers):
            super().__init__()
            self.lm_head = torch.nn.Sequential(*[ResBlock(2 * d) for _ in range(layers)],
                                               torch.nn.Linear(2 * d, v, bias=False))
            self.rnn_u = torch.nn.Linear(d, d, bias=True)
            self.rnn_w = torch.nn.Linear(d, d, bias=False)

    d = base.config.hidden_size
    ref = Drafter(d, base.config.vocab_size, 2)
    ref.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}, strict=True)
    rng = np.random.default_rng(1)
    h, e, s = (rng.normal(size=(4, d)).astype(np.float32) for _ in range(3))
    with torch.no_grad():
        s1 = torch.nn.functional.silu(ref.rnn_w(torch.from_numpy(e)) + ref.rnn_u(torch.from_numpy(s)))
        want = ref.lm_head(torch.cat([torch.from_numpy(h), s1], -1)).numpy()
    s1_ours = back.rnn_step(jnp.asarray(s), jnp.asarray(e))
    got = np.asarray(back.features(jnp.asarray(h), s1_ours)) @ np.asarray(back.vocab_proj[...])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.optimized
def test_redrafter_on_smollm2_equals_greedy(smollm, chat_prompts):
    """The real SmolLM2 (tied 49k vocabulary, 30 layers) with a fresh drafter and its beam trees: speculative
    greedy decoding returns exactly the autoregressive tokens, with and without a draft vocabulary."""
    base = smollm.model
    head = init_from_base(base, ReDrafterConfig(), seed=0)
    kw = dict(tokenizer=smollm.tokenizer, max_new_tokens=24)
    ar = generate(base, chat_prompts, **kw)
    for tree, vocab in (("beam-4x5", None), ("beam-3x4-u8", list(range(0, 49152, 3)))):
        sp = generate(base, chat_prompts, mode="speculative", head=head, tree=tree, draft_vocab=vocab, **kw)
        assert sp.token_ids == ar.token_ids, tree
