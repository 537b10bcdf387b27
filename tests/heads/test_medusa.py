"""Medusa-1 heads through the head registry: exact speculative decoding, acceptance, the distillation loss, a
training run with checkpoints, export under the reference names (loaded by a torch re-implementation of the
reference's heads with strict key matching) and import back."""

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
from clover_jax.decoding.autoregressive import ar_generate
from clover_jax.decoding.sampling import SamplingParams
from clover_jax.decoding.speculative import spec_generate
from clover_jax.heads import registry
from clover_jax.heads.clover2.model import Clover2Head
from clover_jax.heads.medusa.head import MedusaConfig, MedusaDrafter, MedusaHead, init_from_base
from clover_jax.heads.per_depth import per_depth_node_index as node_index
from clover_jax.heads.registry import drafter_for
from clover_jax.models.llama import init_llama, rms_norm
from clover_jax.heads.losses import LossConfig, kd_loss, pack_positions
from clover_jax.validation import InputError
from tiny_llama import TINY_LLAMA

CFG = TINY_LLAMA
NO_EOS = ()
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))  # training_helpers, test_trainer


def _prompts(b=2, t=8, seed=0):
    rng = np.random.default_rng(seed)
    prompt = jnp.asarray(rng.integers(3, CFG.vocab_size, (b, t)), jnp.int32)
    lens = jnp.asarray([t, t - 3][:b], jnp.int32)
    return prompt, lens


def _spec(base, head, tree, prompt, lens, n=24, eos=NO_EOS, vocab=None):
    out, stats, _ = spec_generate(base, head, prompt, lens, max_new_tokens=n, cache_size=160,
                                  sampling=SamplingParams(), key=jax.random.key(0), eos_ids=eos,
                                  drafter=drafter_for(type(head), tree, vocab))
    return out, stats


def _same_as_greedy(base, out, prompt, lens, n, eos):
    ar = ar_generate(base, prompt, lens, max_new_tokens=n, cache_size=160, eos_ids=eos)
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ar.lengths))
    for r in range(prompt.shape[0]):
        k = int(ar.lengths[r])
        np.testing.assert_array_equal(np.asarray(out.tokens)[r, :k], np.asarray(ar.tokens)[r, :k])


def test_registry_knows_both_heads_and_names_the_unknown():
    assert {"clover2", "medusa"} <= set(registry.names())
    assert registry.of_head(MedusaHead).name == "medusa" and registry.of_head(Clover2Head).name == "clover2"
    assert registry.of_config(MedusaConfig()).name == "medusa"
    with pytest.raises(InputError, match="unknown head type 'eagle9'.*clover2.*medusa"):
        registry.get("eagle9")
    with pytest.raises(InputError, match="not a registered draft head"):
        registry.of_head(int)
    assert isinstance(drafter_for(MedusaHead, "chain-3"), MedusaDrafter)
    from clover_jax.training.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="head.type: must be a registered head type"):
        load_config(None, ["head.type=eagle9"])


@pytest.mark.parametrize("tree", ["chain-3", "small-10", "medusa-63"])
@pytest.mark.slow  # a speculative loop per tree
def test_speculative_medusa_equals_greedy(tree):
    base = init_llama(CFG, seed=0)
    head = init_from_base(base, MedusaConfig(num_heads=5), seed=1)
    nnx.update(head, {"res_w": jax.random.normal(jax.random.key(3), head.res_w.shape) * 0.3})  # non-trivial blocks
    prompt, lens = _prompts()
    for eos in (NO_EOS, (2,)):
        out, stats = _spec(base, head, tree, prompt, lens, eos=eos)
        _same_as_greedy(base, out, prompt, lens, 24, eos)
    out, _ = _spec(base, head, tree, prompt, lens, vocab=list(range(0, 64, 2)))  # a draft vocabulary
    _same_as_greedy(base, out, prompt, lens, 24, NO_EOS)


def _constant_base():
    """A base whose final norm is 0: all logits 0, so greedy decoding emits token 0 forever."""
    base = init_llama(CFG, seed=0)
    base.final_norm[...] = jnp.zeros_like(base.final_norm[...])
    return base


@pytest.mark.parametrize("tree,depth", [("chain-3", 3), ("medusa-63", 4)])
@pytest.mark.slow  # a speculative loop per tree
def test_medusa_drafts_are_accepted_when_right_and_rejected_when_wrong(tree, depth):
    """With the base emitting 0 forever, heads whose every block outputs 0 draft token 0 at every depth (rank 0):
    every step accepts a full path (tau = depth + 1). Heads that rank token 0 last get nothing accepted (tau = 1).
    A drafter that put tokens in the wrong tree slots or read the wrong head would fail the first half."""
    base = _constant_base()
    head = init_from_base(base, MedusaConfig(num_heads=5), seed=1)
    prompt, lens = _prompts()
    nnx.update(head, {"res_b": jnp.zeros_like(head.res_b[...])})  # x = h = 0 -> all logits 0 -> token 0
    out, stats = _spec(base, head, tree, prompt, lens, n=2 + 4 * (depth + 1) * 2)
    assert stats["tau"] == depth + 1, stats
    _same_as_greedy(base, out, prompt, lens, 2 + 4 * (depth + 1) * 2, NO_EOS)

    b = jnp.ones_like(head.res_b[...])  # x = SiLU(1) > 0; token 0 the heads' least likely (never drafted)
    proj = jnp.zeros_like(head.proj[...]).at[:, :, 1].set(1.0).at[:, :, 0].set(-1.0)
    nnx.update(head, {"res_b": b, "proj": proj})
    out, stats = _spec(base, head, tree, prompt, lens, n=12)
    assert stats["tau"] == 1.0 and stats["accept_hist"][0] > 0, stats
    _same_as_greedy(base, out, prompt, lens, 12, NO_EOS)


def test_node_index_reads_each_depth_from_its_own_head():
    from clover_jax.decoding.tree import build_buffers, get_tree

    spec = get_tree("medusa-63")
    buf = build_buffers(spec)
    idx = node_index(buf, spec.top_k)
    for u, choice in enumerate([()] + list(spec.choices)):
        want = 0 if not choice else 1 + (len(choice) - 1) * spec.top_k + choice[-1]
        assert idx[u] == want, (u, choice)


@pytest.mark.slow  # the loss and its reference by hand
def test_medusa_loss_is_the_soft_cross_entropy_of_each_heads_projection():
    base = init_llama(CFG, seed=0)
    head = init_from_base(base, MedusaConfig(num_heads=3), seed=1)
    nnx.update(head, {"res_w": jax.random.normal(jax.random.key(4), head.res_w.shape) * 0.2})
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 64, (2, 12)), jnp.int32)
    valid = jnp.asarray(np.arange(12)[None] < np.array([[12], [9]]))
    loss_mask = valid & (jnp.arange(12)[None] >= 2)
    from clover_jax.heads.losses import base_features

    f = base_features(base, tokens, valid)
    ht = registry.get("medusa")
    cfg = LossConfig(decay=0.8)
    loss, m = ht.loss_from_features(head, base, f, tokens, loss_mask, valid, cfg)
    assert np.all(np.asarray(m["vloss"]) == 0)

    # by hand: head i at t scores log_softmax(x^i_t P_i) against softmax(W_lm h_{t+1+i}), weights 0.8^i
    h = np.asarray(rms_norm(f, base.final_norm[...], CFG.rms_norm_eps))
    x = np.asarray(head.features(jnp.asarray(h)))
    w_lm = np.asarray(base.lm_head_matrix())
    proj = np.asarray(head.proj[...])
    lm = np.asarray(loss_mask & valid & jnp.concatenate([valid[:, 1:], jnp.zeros((2, 1), bool)], 1))
    total = 0.0
    for i in range(3):
        num, cnt = 0.0, 0
        for b in range(2):
            for t in range(12 - 1 - i):
                if not lm[b, t + i]:
                    continue
                s = x[i, b, t] @ proj[i]
                logp = s - np.log(np.sum(np.exp(s - s.max()))) - s.max()
                tl = h[b, t + 1 + i] @ w_lm
                p = np.exp(tl - tl.max())
                p /= p.sum()
                num += -np.sum(p * logp)
                cnt += 1
        total += 0.8 ** i * num / (cnt + 1)
    np.testing.assert_allclose(float(loss), total, rtol=2e-5)

    # packed with every trained position listed: the same loss; gradients reach the blocks and projections
    index = jnp.asarray(pack_positions(loss_mask, valid, 12))
    loss_p, _ = ht.loss_from_features(head, base, f, tokens, loss_mask, valid, cfg, index=index)
    np.testing.assert_allclose(float(loss_p), float(loss), rtol=1e-5)
    grads = nnx.grad(lambda hd: ht.loss_from_features(hd, base, f, tokens, loss_mask, valid, cfg)[0])(head)
    assert float(jnp.abs(grads["res_w"][...]).sum()) > 0 and float(jnp.abs(grads["proj"][...]).sum()) > 0
    assert kd_loss is not None


@pytest.mark.slow  # trains, checkpoints and exports
def test_medusa_training_run_checkpoint_export_and_reference_layout(tmp_path):
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
    # a random tiny base predicts a near-uniform distribution (nothing to distil); scaled up, it is peaked
    base.lm_head[...] = base.lm_head[...] * 40
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices("cpu")[:1])
    trainer = Trainer(make_cfg("head.type=medusa", "head.num_heads=3", "loss.decay=0.8", "optim.lr=1e-2",
                               "optim.warmup_steps=0", "train.steps=40"), base, mesh=mesh, donate=False)
    data = SyntheticBatcher(seed=2)
    losses = [float(trainer.train_step(next(data))["loss"]) for _ in range(40)]
    assert np.mean(losses[-5:]) < 0.8 * losses[0], losses  # measured: 20.1 -> 11.9

    run = tmp_path / "run"
    cfg = make_cfg("head.type=medusa", "head.num_heads=3", "train.steps=4", "loss.vocab_positions_per_row=4",
                   output_dir=str(run))
    summary = run_experiment(cfg, progress=False, mesh=mesh, loaded=base,
                             batcher=BucketedBatcher(_tiny_dataset(), 8, [8, 16], seed=0), eval_batches=[])
    assert summary["final_step"] == 4
    from_run = load_head(run, base)
    assert isinstance(from_run, MedusaHead) and from_run.cfg.num_heads == 3

    out = export_head_from_run(run, tmp_path / "head", model=str(export_base(base, tmp_path / "base")))
    assert "type: medusa" in (out / "training_config.yaml").read_text()  # the run's config travels with it
    meta = json.loads((out / "config.json").read_text())
    assert meta["head_type"] == "medusa" and meta["medusa_num_heads"] == 3 and meta["medusa_num_layers"] == 1
    with safe_open(str(out / "medusa_lm_head.safetensors"), framework="numpy") as fh:
        names = set(fh.keys())
        tensors = {k: fh.get_tensor(k) for k in names}
    assert names == {f"{i}.{s}" for i in range(3) for s in ("0.linear.weight", "0.linear.bias", "1.weight")}
    back = import_head(out, base)
    for a, b in zip(jax.tree.leaves(nnx.state(back)), jax.tree.leaves(nnx.state(from_run))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # the reference's heads (`nn.Sequential(ResBlock, Linear)` per head in `MedusaModel.medusa_head`) load the file
    # the way its `from_pretrained` does, `model.medusa_head.load_state_dict(...)`, here with strict key matching
    class ResBlock(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.linear = torch.nn.Linear(d, d)
            self.act = torch.nn.SiLU()

        def forward(self, x):
            return x + self.act(self.linear(x))

    class Heads(torch.nn.Module):
        def __init__(self, d, v, n):
            super().__init__()
            self.medusa_head = torch.nn.ModuleList(
                [torch.nn.Sequential(ResBlock(d), torch.nn.Linear(d, v, bias=False)) for _ in range(n)])

    ref = Heads(CFG.hidden_size, CFG.vocab_size, 3)
    ref.medusa_head.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}, strict=True)
    h = np.random.default_rng(1).normal(size=(4, CFG.hidden_size)).astype(np.float32)
    with torch.no_grad():
        want = np.stack([m(torch.from_numpy(h)).numpy() for m in ref.medusa_head])  # [n, 4, V]
    got = np.einsum("nbd,ndv->nbv", np.asarray(back.features(jnp.asarray(h))), np.asarray(back.proj[...]))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
