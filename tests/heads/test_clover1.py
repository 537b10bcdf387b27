"""Clover-1 heads through the head registry: training outputs equal the drafting path, exact greedy decoding over
static and dynamic trees (Clover-1's top-p policy included), acceptance when the drafts are right, a training
run, export and import back."""

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
from clover_jax.heads.registry import drafter_for
from clover_jax.decoding.tree import DynamicTree, TreeSpecError, get_tree
from clover_jax.heads import registry
from clover_jax.heads.clover1.head import Clover1Config, Clover1Head, init_from_base
from clover_jax.heads.recurrent.drafter import RecurrentDynamicDrafter
from clover_jax.models.llama import init_llama
from clover_jax.heads.losses import base_features
from clover_jax.validation import InputError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))  # training_helpers, test_trainer
sys.path.insert(0, str(Path(__file__).resolve().parent))  # spec_helpers
from spec_helpers import CFG, NO_EOS, prompts, same_as_greedy, spec  # noqa: E402


def _head(base, seed=1, num_heads=4):
    head = init_from_base(base, Clover1Config(num_heads=num_heads, num_aug_layers=1), seed=seed)
    k = jax.random.split(jax.random.key(seed), 2)
    nnx.update(head, {"ad_wv": jax.random.normal(k[0], head.ad_wv.shape) * 0.3,  # the state matters
                      "fc_w": head.fc_w[...] + jax.random.normal(k[1], head.fc_w.shape) * 0.3})
    return head


def test_top_p_policy_names_and_registry():
    t = get_tree("dynamic-10-p0.8")
    assert isinstance(t, DynamicTree) and t.top_p == 0.8 and t.num_nodes == 10
    assert DynamicTree(10, top_p=0.5).name == "dynamic-10-d5-k8-p0.5"
    with pytest.raises(TreeSpecError, match="top_p must be in"):
        DynamicTree(10, top_p=1.5)
    assert registry.of_head(Clover1Head).name == "clover1" and registry.get("clover1").default_tree == "dynamic-10-p0.8"
    assert isinstance(drafter_for(Clover1Head, "dynamic-10-p0.8"), RecurrentDynamicDrafter)
    with pytest.raises(InputError, match="beam-search policy"):
        drafter_for(Clover1Head, "beam-2x3")


@pytest.mark.slow  # compiles training and drafting paths
def test_training_outputs_equal_the_drafting_path():
    """Head i's teacher-forced output at t (training) equals what drafting computes along the data's own path:
    commit the prefix x_0..x_t with root x_{t+1}, head 0, then `step` with x_{t+2}, x_{t+3}, ... A drafter that
    read the wrong depth's weights or the wrong token would differ."""
    base = init_llama(CFG, seed=0)
    head = _head(base)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 64, (1, 12)), jnp.int32)
    valid = jnp.ones((1, 12), bool)
    f = base_features(base, tokens, valid)
    out = head.train_outputs(base, f, tokens, valid)  # [n, 1, T, D]
    t = 5
    cache = head.init_cache(1, 32)
    y = jnp.concatenate([tokens[:, 1:], jnp.zeros((1, 1), jnp.int32)], axis=1)
    s, cache = head.commit(base, cache, f[:, :t + 1], y[:, :t + 1], jnp.asarray([t + 1]))
    np.testing.assert_allclose(np.asarray(head.head0(s))[0], np.asarray(out[0, 0, t]), rtol=2e-5, atol=2e-5)
    for i in range(1, 4):
        s, o = head.step(base, s, tokens[:, t + 1 + i], depth=i)
        np.testing.assert_allclose(np.asarray(o)[0], np.asarray(out[i, 0, t]), rtol=2e-5, atol=2e-5)
    with pytest.raises(InputError, match="head 4 does not exist"):
        head.step(base, s, tokens[:, 0], depth=4)


@pytest.mark.parametrize("tree", ["chain-3", *(pytest.param(t, marks=pytest.mark.slow)  # a loop each: chain-3 fast
                                              for t in ("clover2-26", "dynamic-10-p0.8"))])
def test_speculative_clover1_equals_greedy(tree):
    base = init_llama(CFG, seed=0)
    head = _head(base, num_heads=5)
    prompt, lens = prompts()
    for eos in (NO_EOS, (2,)):
        out, _ = spec(base, head, tree, prompt, lens, eos=eos)
        same_as_greedy(base, out, prompt, lens, 24, eos)


@pytest.mark.slow  # compiles speculative loops
def test_clover1_drafts_are_accepted_when_right_and_the_top_p_cut_keeps_them():
    """The base emits token 0 forever (final norm 0); a fresh head's outputs pass head_norm = that zero norm, so
    every draft is token 0 (all logits tie, the lowest id first): each step accepts its deepest path. With top_p
    0.01 each node keeps only its first child: a chain 4 deep out of a 10-node budget (without the cut, the tied
    scores would spend that budget on the two shallowest levels), and still full acceptance. Heads that favour
    token 1 get nothing accepted."""
    base = init_llama(CFG, seed=0)
    base.final_norm[...] = jnp.zeros_like(base.final_norm[...])
    head = init_from_base(base, Clover1Config(num_heads=4, num_aug_layers=1), seed=1)
    prompt, lens = prompts()
    for tree, depth in (("chain-3", 3), ("dynamic-5-d4-k1", 4), ("dynamic-10-d4-k3-p0.01", 4)):
        out, stats = spec(base, head, tree, prompt, lens, n=2 + 4 * (depth + 1))
        assert stats["tau"] == depth + 1, (tree, stats)
        same_as_greedy(base, out, prompt, lens, 2 + 4 * (depth + 1), NO_EOS)
    w1 = np.asarray(base.lm_head_matrix())[:, 1]
    nnx.update(head, {"head_norm": jnp.ones(CFG.hidden_size), "fc_w": jnp.zeros_like(head.fc_w[...]),
                      "fc_b": jnp.broadcast_to(jnp.asarray(w1 / np.linalg.norm(w1)), head.fc_b.shape)})
    out, stats = spec(base, head, "chain-3", prompt, lens, n=12)
    assert stats["tau"] == 1.0 and stats["accept_hist"][0] > 0, stats


@pytest.mark.slow  # compiles a dynamic drafter
def test_top_p_cut_leaves_unused_slots():
    base = init_llama(CFG, seed=0)
    head = _head(base)
    drafter = drafter_for(Clover1Head, "dynamic-10-d3-k4-p0.01")
    state = drafter.init_state(head, base, 2, 64)
    f = base_features(base, *prompts()[:1], jnp.ones((2, 8), bool))
    state = drafter.start(head, base, state, f, jnp.zeros((2, 8), jnp.int32), jnp.asarray([8, 8]))
    prop = drafter.propose(head, base, state, jnp.asarray([3, 4]), jax.random.key(0))
    used = np.asarray(prop.buffers.parent)[:, 1:] >= 0
    assert used.sum(axis=1).tolist() == [3, 3]  # one child per node, 3 deep: the rest of the 10 unused


@pytest.mark.slow  # trains, exports and imports
def test_clover1_training_run_export_and_import(tmp_path):
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
    base.lm_head[...] = base.lm_head[...] * 40
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices("cpu")[:1])
    overrides = ("head.type=clover1", "head.num_heads=3", "head.num_aug_layers=1")
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
    assert isinstance(from_run, Clover1Head) and from_run.cfg.num_heads == 3
    out = export_head_from_run(run, tmp_path / "head", model=str(export_base(base, tmp_path / "base")))
    meta = json.loads((out / "config.json").read_text())
    assert meta["head_type"] == "clover1" and meta["num_heads"] == 3
    back = import_head(out, base)
    for a, b in zip(jax.tree.leaves(nnx.state(back)), jax.tree.leaves(nnx.state(from_run))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
