"""The block head through the head registry: its config and errors, the window the drafter keeps (against a slow
numpy reference), teacher-forced training outputs equal to the drafter's block at every anchor, the distillation
loss by hand, exact speculative decoding over chains and trees, acceptance when right and rejection when wrong, a
training run with checkpoints, and export / import under its own tensor names."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from spec_helpers import CFG, NO_EOS, prompts, same_as_greedy, spec

from clover_jax import parallel
from clover_jax.decoding.drafter import check_state
from clover_jax.decoding.sampling import SamplingParams
from clover_jax.decoding.speculative import spec_generate
from clover_jax.heads import registry
from clover_jax.heads.block import (
    BlockConfig,
    BlockDrafter,
    BlockHead,
    BlockOptions,
    init_from_base,
)
from clover_jax.heads.block.drafter import shift_in
from clover_jax.heads.losses import LossConfig, base_features, pack_positions
from clover_jax.heads.registry import drafter_for
from clover_jax.models.llama import init_llama, rms_norm
from clover_jax.tuning.calibrate import candidate_trees, probe_for
from clover_jax.validation import InputError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))  # training_helpers, test_trainer


def _head(base, block_size=5, window=6, seed=1, num_layers=2):
    return init_from_base(base, BlockConfig(block_size=block_size, window=window, num_layers=num_layers), seed=seed)


def _batch(seed=0, t=12):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, t)), jnp.int32)
    valid = jnp.asarray(np.arange(t)[None] < np.array([[t], [t - 3]]))
    loss_mask = valid & (jnp.arange(t)[None] >= 2)
    return tokens, valid, loss_mask


# ------------------------------------------------------------------------------------------------ config
def test_layers_can_start_as_the_bases_last_layers():
    from clover_jax.training.config import ConfigError, load_config

    base = init_llama(CFG, seed=0)
    head = init_from_base(base, BlockConfig(num_layers=2, init_layers="base"), seed=1)
    for name, value in base.layers.layer_params().items():
        np.testing.assert_array_equal(np.asarray(getattr(head.layers, name)[...]), np.asarray(value[-2:]))
    fresh = _head(base, num_layers=2)
    assert not np.array_equal(np.asarray(fresh.layers.wq[...]), np.asarray(base.layers.wq[...][-2:]))
    cfg = load_config(None, ["head.type=block", "head.init_layers=base"])
    assert cfg.head.head_config().init_layers == "base"
    with pytest.raises(InputError, match="init_layers must be one of"):
        BlockConfig(init_layers="first")
    with pytest.raises(ConfigError, match="head.init_layers"):
        load_config(None, ["head.type=block", "head.init_layers=first"])
    with pytest.raises(InputError, match="copies 9 layers; the base model has"):
        init_from_base(base, BlockConfig(num_layers=9, init_layers="base"))


@pytest.mark.slow  # compiles speculative loops
def test_registered_with_its_own_section_and_clear_errors():
    from clover_jax.training.config import ConfigError, load_config

    ht = registry.get("block")
    assert "block" in registry.names() and registry.of_head(BlockHead) is ht and ht.default_tree == "chain-4"
    assert isinstance(drafter_for(BlockHead, "chain-3"), BlockDrafter)
    cfg = load_config(None, ["head.type=block", "head.num_heads=6", "head.window=8"])
    assert isinstance(cfg.head, BlockOptions)
    assert cfg.head.head_config() == BlockConfig(block_size=6, num_layers=2, window=8)
    for key, value in (("block_size", 0), ("window", 0), ("num_layers", -1), ("window", 2.5)):
        with pytest.raises(InputError, match=f"block head: {key} must be an integer >= 1"):
            BlockConfig(**{key: value})
    with pytest.raises(ConfigError, match="head.window"):
        load_config(None, ["head.type=block", "head.window=0"])
    with pytest.raises(ConfigError, match="unknown key 'head.num_aug_layers' for a block head"):
        load_config(None, ["head.type=block", "head.num_aug_layers=1"])
    with pytest.raises(InputError, match="block heads draft a static tree"):
        drafter_for(BlockHead, "dynamic-10")

    base = init_llama(CFG, seed=0)
    head = _head(base, block_size=3)
    prompt, lens = prompts()
    with pytest.raises(InputError, match="4 drafts deep but the block head.*only 3"):
        spec(base, head, "chain-4", prompt, lens, n=4)
    # the tree fitting's candidates and probe are the static trees within the block
    assert candidate_trees(head, base, candidates=["chain-3", "chain-4", "dynamic-10", "small-10"]) == ["chain-3"]
    assert probe_for(head, base).max_depth == 3
    other = init_llama(dataclasses.replace(CFG, hidden_size=16, head_dim=4), seed=0)
    with pytest.raises(InputError, match="block head does not fit the base model: hidden_size"):
        spec(other, head, "chain-2", prompt, lens, n=4)


# ------------------------------------------------------------------------------------------------ the window
def _window_reference(f, y, count, f_new, y_new, num):
    """The window after a commit, entry by entry: the row's valid entries, then its new ones, the last S kept."""
    f, y, count = np.array(f), np.array(y), np.array(count)
    b, s = y.shape
    out_f, out_y, out_n = np.zeros_like(f), np.zeros_like(y), np.zeros_like(count)
    for r in range(b):
        ef = list(f[r, s - count[r]:]) + list(np.asarray(f_new)[r, :num[r]])
        ey = list(y[r, s - count[r]:]) + list(np.asarray(y_new)[r, :num[r]])
        ef, ey = ef[-s:], ey[-s:]
        n = len(ey)
        out_n[r] = n
        if n:
            out_f[r, s - n:] = np.stack(ef)
            out_y[r, s - n:] = ey
    return out_f, out_y, out_n


def test_the_window_shifts_in_each_rows_accepted_tokens():
    """Rows advance by different amounts (0 included) over several commits; the valid slots match a numpy
    reference, and `start` keeps a prompt's last `window` positions."""
    base = init_llama(CFG, seed=0)
    head = _head(base, window=6)
    drafter = drafter_for(BlockHead, "chain-3")
    rng = np.random.default_rng(0)
    b, d = 3, CFG.hidden_size
    state = drafter.init_state(head, base, b, 64, drafter.arrays())
    f_p = jnp.asarray(rng.normal(size=(b, 9, d)), jnp.float32)
    y_p = jnp.asarray(rng.integers(0, 64, (b, 9)), jnp.int32)
    lens = jnp.asarray([9, 4, 1], jnp.int32)
    new = drafter.start(head, base, state, f_p, y_p, lens)
    check_state(drafter, "start", state, new)
    want = _window_reference(np.zeros((b, 6, d), np.float32), np.zeros((b, 6), np.int32), np.zeros(b, np.int32),
                             f_p, y_p, np.asarray(lens))
    state = new
    for step in range(6):
        num = jnp.asarray(rng.integers(0, 5, b), jnp.int32).at[step % b].set(0)
        f_new = jnp.asarray(rng.normal(size=(b, 4, d)), jnp.float32)
        y_new = jnp.asarray(rng.integers(0, 64, (b, 4)), jnp.int32)
        want = _window_reference(*want, f_new, y_new, np.asarray(num))
        new = jax.jit(lambda s, f, y, n: drafter.commit(head, base, s, f, y, n))(state, f_new, y_new, num)
        check_state(drafter, "commit", state, new)
        state = new
        np.testing.assert_array_equal(np.asarray(state.block_count), want[2])
        for r in range(b):
            n = want[2][r]
            np.testing.assert_array_equal(np.asarray(state.block_f)[r, 6 - n:], want[0][r, 6 - n:])
            np.testing.assert_array_equal(np.asarray(state.block_y)[r, 6 - n:], want[1][r, 6 - n:])
    f, y, n = shift_in(state.block_f, state.block_y, state.block_count, f_new, y_new, jnp.zeros(b, jnp.int32))
    np.testing.assert_array_equal(np.asarray(f), np.asarray(state.block_f))  # nothing accepted: unchanged
    np.testing.assert_array_equal(np.asarray(y), np.asarray(state.block_y))
    np.testing.assert_array_equal(np.asarray(n), np.asarray(state.block_count))


# ------------------------------------------------------------------------------------------------ training
@pytest.mark.slow  # compiles the drafter at every anchor
def test_training_outputs_are_the_drafters_block_at_every_anchor():
    """Block position k at anchor s in training is what the drafter computes from the window ending at s under
    the root x_{s+1}: the training and drafting paths agree on the window, the positions and the depths."""
    base = init_llama(CFG, seed=0)
    head = _head(base, block_size=4, window=5)
    tokens, valid, _ = _batch()
    f = base_features(base, tokens, valid)
    out = head.train_outputs(base, f, tokens, valid)  # [C, B, T, D]
    assert out.shape == (4, 2, 12, CFG.hidden_size)
    y = np.concatenate([np.asarray(tokens)[:, 1:], np.zeros((2, 1), np.int32)], axis=1)
    for r, s in [(0, 0), (0, 3), (0, 10), (1, 5), (1, 7)]:
        lo = max(0, s - 4)
        n = s - lo + 1
        f_win = jnp.zeros((1, 5, CFG.hidden_size)).at[0, 5 - n:].set(f[r, lo:s + 1])
        y_win = jnp.zeros((1, 5), jnp.int32).at[0, 5 - n:].set(y[r, lo:s + 1])
        got = head.draft(base, f_win, y_win, jnp.asarray([n]), jnp.asarray(y[r, s:s + 1]))
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(out[:, r, s]), rtol=1e-5, atol=1e-5)


def _hand_loss(out, h, w, lm, anchors_trained: bool):
    """By hand: block position k at anchor s against softmax(W_lm h_{s+1+k}), masked by lm[s+k] (and lm[s] when
    only trained positions are anchors), weights 0.8^k; returns (loss, terms per position)."""
    total, counts = 0.0, []
    for k in range(out.shape[0]):
        num, cnt = 0.0, 0
        for r in range(out.shape[1]):
            for s in range(out.shape[2] - 1 - k):
                if not lm[r, s + k] or (anchors_trained and not lm[r, s]):
                    continue
                z = out[k, r, s] @ w
                logp = z - z.max() - np.log(np.sum(np.exp(z - z.max())))
                t = h[r, s + 1 + k] @ w
                p = np.exp(t - t.max())
                num += -np.sum(p / p.sum() * logp)
                cnt += 1
        total += 0.8 ** k * num / (cnt + 1)
        counts.append(cnt)
    return total, counts


@pytest.mark.slow  # the loss and its reference by hand
def test_loss_is_the_soft_cross_entropy_of_each_block_position():
    base = init_llama(CFG, seed=0)
    base.lm_head[...] = base.lm_head[...] * 10
    head = _head(base, block_size=3, window=4)
    tokens, valid, loss_mask = _batch()
    f = base_features(base, tokens, valid)
    ht = registry.get("block")
    cfg = LossConfig(decay=0.8)
    loss, m = ht.loss_from_features(head, base, f, tokens, loss_mask, valid, cfg)
    assert np.all(np.asarray(m["vloss"]) == 0) and m["acc"].shape == (3,) and m["chain_acc"].shape == (3,)

    # by hand: block position k at anchor s against softmax(W_lm h_{s+1+k}), masked by lm[s+k], weights 0.8^k
    out = np.asarray(head.train_outputs(base, f, tokens, valid))
    h = np.asarray(rms_norm(f, base.final_norm[...], CFG.rms_norm_eps))
    w = np.asarray(base.lm_head_matrix())
    vm = np.asarray(valid)
    lm = np.asarray(loss_mask) & vm & np.concatenate([vm[:, 1:], np.zeros((2, 1), bool)], 1)
    total, _ = _hand_loss(out, h, w, lm, anchors_trained=False)
    np.testing.assert_allclose(float(loss), total, rtol=2e-5)

    # sampled anchors: every trained position listed, the blocks run there only; the same terms but for starts s
    # that are not trained positions themselves (the last prompt positions)
    index = jnp.asarray(pack_positions(loss_mask, valid, 12))
    loss_p, m_p = ht.loss_from_features(head, base, f, tokens, loss_mask, valid, cfg, index=index)
    total, counts = _hand_loss(out, h, w, lm, anchors_trained=True)
    np.testing.assert_allclose(float(loss_p), total, rtol=2e-5)
    assert np.asarray(m_p["p_count"]).tolist() == counts and np.all(np.asarray(m_p["vloss"]) == 0)
    assert np.all(np.asarray(m_p["chain_acc"]) <= np.asarray(m_p["acc"]) + 1e-6)
    # the anchors' outputs are the dense outputs at those positions
    sub = np.asarray(head.anchor_outputs(base, f, tokens, valid, index))  # [C, B, M, D]
    for r in range(2):
        for j, s in enumerate(np.asarray(index)[r]):
            if s >= 0:
                np.testing.assert_allclose(sub[:, r, j], out[:, r, s], rtol=1e-5, atol=1e-5)
    grads = nnx.grad(lambda hd: ht.loss_from_features(hd, base, f, tokens, loss_mask, valid, cfg, index=index)[0])(head)
    for name in ("ctx_w", "root_w", "mask_emb"):
        assert float(jnp.abs(grads[name][...]).sum()) > 0, name
    assert float(jnp.abs(grads["layers"]["wk"][...]).sum()) > 0  # the window's keys learn


# ------------------------------------------------------------------------------------------------ decoding
def _spec_vocab(base, head, tree, prompt, lens, n, vocab):
    """Greedy speculative decoding drafting from the token ids `vocab`: `(output, stats)`."""
    out, stats, _ = spec_generate(base, head, prompt, lens, max_new_tokens=n, cache_size=160,
                                  sampling=SamplingParams(), key=jax.random.key(0), eos_ids=NO_EOS,
                                  drafter=drafter_for(type(head), tree, vocab))
    return out, stats


@pytest.mark.parametrize("tree", ["chain-4", "medusa-63", "chain-2+lookup-3"])
@pytest.mark.slow  # a speculative loop per tree
def test_speculative_block_equals_greedy(tree):
    base = init_llama(CFG, seed=0)
    head = _head(base)
    prompt, lens = prompts()
    for eos in (NO_EOS, (2,)):
        out, _ = spec(base, head, tree, prompt, lens, eos=eos)
        same_as_greedy(base, out, prompt, lens, 24, eos)
    out, _ = _spec_vocab(base, head, tree, prompt, lens, 24, list(range(0, 64, 2)))
    same_as_greedy(base, out, prompt, lens, 24, NO_EOS)  # a draft vocabulary


@pytest.mark.slow  # speculative loops with and without EOS and a draft vocabulary, per tree
@pytest.mark.parametrize("tree,depth", [("chain-4", 4), ("medusa-63", 4)])
def test_block_drafts_are_accepted_when_right_and_rejected_when_wrong(tree, depth):
    """A base whose final norm is 0 emits token 0 forever; the block's logits (the same final norm and lm_head)
    are then all 0 and it drafts token 0 at rank 0 of every depth: every step accepts a full path. Drafting from
    a vocabulary without token 0, nothing is accepted. Drafts in the wrong tree slots would fail the first half."""
    base = init_llama(CFG, seed=0)
    base.final_norm[...] = jnp.zeros_like(base.final_norm[...])
    head = _head(base)
    prompt, lens = prompts()
    n = 2 + 4 * (depth + 1) * 2
    out, stats = spec(base, head, tree, prompt, lens, n=n)
    assert stats["tau"] == depth + 1, stats
    same_as_greedy(base, out, prompt, lens, n, NO_EOS)
    out, stats = _spec_vocab(base, head, tree, prompt, lens, 12, list(range(1, 64)))
    assert stats["tau"] == 1.0 and stats["accept_hist"][0] > 0, stats
    same_as_greedy(base, out, prompt, lens, 12, NO_EOS)


# ------------------------------------------------------------------------------------------------ a run, export
def test_export_and_import_under_its_own_tensor_names(tmp_path):
    """A head exported (`clover_jax.heads.block.export`) under the block drafter's tensor names and read back equal
    (the trained head's round trip, with drafting from the folder, is the training-run test below)."""
    from safetensors import safe_open

    from clover_jax.heads.export import export_head, import_head

    base = init_llama(CFG, seed=0)
    head = _head(base, block_size=3, window=4)
    head.ctx_w[...] = head.ctx_w[...] + 0.5  # not the initial values: the import must read the file
    folder = export_head(head, tmp_path / "head", base=base, base_name="tiny")
    meta = json.loads((folder / "config.json").read_text())
    assert meta["head_type"] == "block" and (meta["block_size"], meta["num_layers"], meta["window"]) == (3, 2, 4)
    with safe_open(str(folder / "model.safetensors"), framework="numpy") as fh:
        names = set(fh.keys())
    assert {"context.weight", "root.weight", "mask_embeddings.weight", "layers.1.mlp.down_proj.weight",
            "layers.0.input_layernorm.weight"} <= names and not any("embed_tokens" in k for k in names)
    back = import_head(folder, base)
    assert isinstance(back, BlockHead) and back.cfg == head.cfg
    for a, b in zip(jax.tree.leaves(nnx.state(back)), jax.tree.leaves(nnx.state(head))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # trains 30 + 4 steps, then drafts from the exported folder
def test_block_training_run_checkpoint_export_and_import(tmp_path):
    from safetensors import safe_open
    from training_helpers import SyntheticBatcher, make_cfg, tiny_base

    import clover_jax
    from clover_jax.heads.export import export_head, import_head
    from clover_jax.training.loading import load_head
    from clover_jax.training.run import run_experiment
    from clover_jax.training.trainer import Trainer

    base = tiny_base()
    base.lm_head[...] = base.lm_head[...] * 40  # a peaked teacher (a random tiny base is near-uniform)
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices("cpu")[:1])
    opts = ("head.type=block", "head.num_heads=3", "head.window=4", "loss.decay=0.8")
    trainer = Trainer(make_cfg(*opts, "optim.lr=1e-2", "optim.warmup_steps=0", "train.steps=30"), base, mesh=mesh,
                      donate=False)
    data = SyntheticBatcher(seed=2)
    losses = [float(trainer.train_step(next(data))["loss"]) for _ in range(30)]
    assert np.mean(losses[-5:]) < 0.8 * losses[0], losses

    run = tmp_path / "run"
    cfg = make_cfg(*opts, "train.steps=4", "loss.vocab_positions_per_row=4", "optim.warmup_steps=0",
                   output_dir=str(run))
    summary = run_experiment(cfg, progress=False, mesh=mesh, loaded=base, batcher=SyntheticBatcher(seed=1),
                             eval_batches=[])
    assert summary["final_step"] == 4
    trained = load_head(run, base)  # from the run's Orbax checkpoint
    assert isinstance(trained, BlockHead) and trained.cfg == BlockConfig(block_size=3, num_layers=2, window=4)
    start = init_from_base(base, trained.cfg)
    assert not np.allclose(np.asarray(trained.ctx_w[...]), np.asarray(start.ctx_w[...]))  # training moved it

    folder = export_head(trained, tmp_path / "head", base=base, base_name="tiny")
    meta = json.loads((folder / "config.json").read_text())
    assert meta["head_type"] == "block" and (meta["block_size"], meta["num_layers"], meta["window"]) == (3, 2, 4)
    with safe_open(str(folder / "model.safetensors"), framework="numpy") as fh:
        names = set(fh.keys())
    assert {"context.weight", "root.weight", "mask_embeddings.weight", "layers.1.mlp.down_proj.weight",
            "layers.0.input_layernorm.weight"} <= names and not any("embed_tokens" in k for k in names)
    back = import_head(folder, base)
    for a, b in zip(jax.tree.leaves(nnx.state(back)), jax.tree.leaves(nnx.state(trained))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # identical drafts from the imported head, and exact speculative decoding from the folder
    drafter = drafter_for(BlockHead, "medusa-63")
    prompt, lens = prompts()
    f = base_features(base, prompt, jnp.arange(prompt.shape[1])[None] < lens[:, None])
    y = jnp.concatenate([prompt[:, 1:], prompt[:, :1]], axis=1)
    drafts = []
    for h in (trained, back):
        state = drafter.start(h, base, drafter.init_state(h, base, 2, 64, drafter.arrays()), f, y, lens)
        drafts.append(np.asarray(drafter.propose(h, base, state, prompt[:, 0], jax.random.key(0)).tokens))
    np.testing.assert_array_equal(drafts[0], drafts[1])
    prompts_list = [[3, 5, 7, 9, 11, 3, 5, 7], [2, 4, 6, 8, 2, 4]]
    ar = clover_jax.generate(base, prompts_list, max_new_tokens=20, cache_size=128)
    sp = clover_jax.generate(base, prompts_list, max_new_tokens=20, cache_size=128, mode="speculative",
                             head=str(folder), tree="chain-3")
    assert sp.token_ids == ar.token_ids and len(sp.stats["accept_hist"]) == 4


# ------------------------------------------------------------------------------------------------ feature layers
@pytest.mark.slow  # compiles speculative loops
def test_the_context_reads_the_bases_chosen_layers_and_drafts_exactly():
    """With `feature_layers` the loop hands the drafter `[..., 2D]` features (layer 0's output, then the last
    layer's), training and drafting read the same ones, the draft depends on them, and decoding stays exact."""
    base = init_llama(CFG, seed=0)
    head = init_from_base(base, BlockConfig(block_size=4, window=5, feature_layers=[0]), seed=1)
    d = CFG.hidden_size
    assert head.cfg.feature_layers == (0,) and head.ctx_w.shape == (3 * d, d) and head.tap_norm.shape == (1, d)
    assert drafter_for(BlockHead, "chain-2+lookup-3").feature_layers(head) == (0,)  # through the lookup chain
    tokens, valid, _ = _batch()
    f = base_features(base, tokens, valid, taps=(0,))  # [B, T, 2D]
    out = head.train_outputs(base, f, tokens, valid)
    y = np.concatenate([np.asarray(tokens)[:, 1:], np.zeros((2, 1), np.int32)], axis=1)
    for r, s in [(0, 3), (1, 7)]:
        lo = max(0, s - 4)
        n = s - lo + 1
        f_win = jnp.zeros((1, 5, 2 * d)).at[0, 5 - n:].set(f[r, lo:s + 1])
        y_win = jnp.zeros((1, 5), jnp.int32).at[0, 5 - n:].set(y[r, lo:s + 1])
        got = head.draft(base, f_win, y_win, jnp.asarray([n]), jnp.asarray(y[r, s:s + 1]))
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(out[:, r, s]), rtol=1e-5, atol=1e-5)
        other = head.draft(base, f_win.at[..., :d].multiply(-1.0), y_win, jnp.asarray([n]), jnp.asarray(y[r, s:s + 1]))
        assert not np.allclose(np.asarray(other), np.asarray(got), atol=1e-4)  # layer 0's output is read
    prompt, lens = prompts()
    for tree in ("chain-4", "chain-2+lookup-3"):
        for eos in (NO_EOS, (2,)):
            out_tokens, _ = spec(base, head, tree, prompt, lens, eos=eos)
            same_as_greedy(base, out_tokens, prompt, lens, 24, eos)


def test_feature_layers_outside_the_base_or_malformed_are_named_errors():
    base = init_llama(CFG, seed=0)  # two layers: only layer 0 can be read besides the last
    with pytest.raises(InputError, match=r"block head does not fit the base model: feature layers \(1,\)"):
        init_from_base(base, BlockConfig(feature_layers=(1,)))
    for bad in ("0", [0, 0], [-1], [True]):
        with pytest.raises(InputError, match="feature_layers must be distinct layer indices"):
            BlockConfig(feature_layers=bad)


@pytest.mark.slow  # trains, checkpoints and exports
def test_feature_layers_train_from_cached_features_checkpoint_and_export(tmp_path):
    """A run whose head reads layer 0: its cached features hold two layers (a folder of their own), the loss of a
    cached batch equals the online one, the checkpoint records the layers (a checkpoint saved before they existed
    still loads), and the exported folder round-trips."""
    from training_helpers import make_cfg, tiny_base
    from test_trainer import _tiny_dataset

    from clover_jax.heads.export import export_head, import_head
    from clover_jax.training.checkpoint import check_head_metadata, head_metadata
    from clover_jax.training.data import BucketedBatcher
    from clover_jax.training.features import attach_features
    from clover_jax.training.trainer import Trainer

    base, ds = tiny_base(), _tiny_dataset()
    d = CFG.hidden_size
    plain = attach_features(BucketedBatcher(ds, 8, [8, 16], seed=0), base, progress=False, cache_dir=tmp_path,
                            dtype=jnp.float32)
    batcher = attach_features(BucketedBatcher(ds, 8, [8, 16], seed=0), base, progress=False, cache_dir=tmp_path,
                              dtype=jnp.float32, taps=(0,))
    assert len(list(tmp_path.glob("features-*-layer0"))) == 1 and len(list(tmp_path.glob("features-*"))) == 2
    assert batcher.features[0].shape == (len(ds[0]), 2 * d)
    np.testing.assert_allclose(batcher.features[0][:, d:], plain.features[0], atol=1e-6)  # the last layer's last
    batch = next(batcher)

    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices("cpu")[:1])
    opts = ("head.type=block", "head.num_heads=3", "head.window=4", "head.feature_layers=[0]")
    losses = []
    for b in ({k: v for k, v in batch.items() if k != "features"}, batch):
        trainer = Trainer(make_cfg(*opts), base, mesh=mesh, donate=False)
        losses.append(float(trainer.train_step(b)["loss"]))
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    with pytest.raises(ValueError, match="cached base features are 32 wide; the head reads 64"):
        Trainer(make_cfg(*opts), base, mesh=mesh, donate=False).train_step({**batch, "features": batch["features"][
            ..., d:]})

    meta = head_metadata(trainer.head_cfg, base.config, "tiny")
    assert meta["head_config"]["feature_layers"] == [0]
    old = head_metadata(BlockConfig(block_size=3, window=4), base.config, "tiny")
    del old["head_config"]["feature_layers"]  # saved before the field existed: it read the last layer only
    check_head_metadata(old, head_metadata(BlockConfig(block_size=3, window=4), base.config, "tiny"), "old")
    assert registry.get("block").config_from_meta(old["head_config"]).feature_layers == ()

    head = init_from_base(base, BlockConfig(block_size=3, window=4, feature_layers=(0,)), seed=3)
    head.tap_norm[...] = head.tap_norm[...] * 1.5
    folder = export_head(head, tmp_path / "head", base=base, base_name="tiny")
    assert json.loads((folder / "config.json").read_text())["feature_layers"] == [0]
    back = import_head(folder, base)
    assert back.cfg.feature_layers == (0,)
    for a, b in zip(jax.tree.leaves(nnx.state(back)), jax.tree.leaves(nnx.state(head))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
