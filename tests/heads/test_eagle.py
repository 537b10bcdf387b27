"""EAGLE-1 heads through the head registry: every drafted node equals a full causal recompute of the draft over
its path (the cached tree drafting with per-node ancestor keys is checked against the plain definition), exact
greedy decoding over static and dynamic trees, acceptance when the drafts are right, the reference architecture
in torch loading the export strictly and computing the same outputs, a training run, export and import back."""

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

from clover_jax import parallel
from clover_jax.heads.registry import drafter_for
from clover_jax.heads import registry
from clover_jax.heads.eagle.head import (EagleConfig, EagleDrafter, EagleDynamicDrafter, EagleHead, check_compatible,
                                         init_from_base)
from clover_jax.models.cache import causal_mask
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import init_llama
from clover_jax.heads.losses import base_features
from clover_jax.validation import InputError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))  # training_helpers, test_trainer
sys.path.insert(0, str(Path(__file__).resolve().parent))  # spec_helpers
from spec_helpers import CFG, NO_EOS, prompts, same_as_greedy, spec  # noqa: E402


def _head(base, seed=1, init="reference"):
    """A head with attention sharp enough that which keys a node sees changes its drafts."""
    head = init_from_base(base, EagleConfig(init=init), seed=seed)
    kq, kk = jax.random.split(jax.random.key(seed + 7))
    head.layer.wq[...] = head.layer.wq[...] + 0.6 * jax.random.normal(kq, head.layer.wq.shape)
    head.layer.wk[...] = head.layer.wk[...] + 0.6 * jax.random.normal(kk, head.layer.wk.shape)
    return head


def test_registry_and_drafters():
    ht = registry.get("eagle")
    assert registry.of_head(EagleHead) is ht and ht.default_tree == "clover2-26"
    assert isinstance(drafter_for(EagleHead, "clover2-26"), EagleDrafter)
    assert isinstance(drafter_for(EagleHead, "dynamic-10"), EagleDynamicDrafter)
    with pytest.raises(InputError, match="beam-search policy"):
        drafter_for(EagleHead, "beam-2x3")
    with pytest.raises(InputError, match="init must be one of"):
        EagleConfig(init="random")


_PAD = 16  # prompt (<= 8) + path (<= 5) positions, padded so one compile serves every path


@jax.jit
def _recompute(head, base, h, y, length):
    """The layer's output at position `length - 1` of one causal pass of FC + the layer over `h [_PAD, D]`,
    `y [_PAD]` (positions past `length` are padding that no earlier position sees). `[D]`."""
    z = head.fc(head.embed(base, y), h)[None]  # [1, _PAD, D]
    valid = (jnp.arange(_PAD) < length)[None]
    out, _, _ = head.layer(z, jnp.arange(_PAD, dtype=jnp.int32)[None], causal_mask(valid))
    return out[0, length - 1]


_order = jax.jit(lambda head, base, out: jnp.argsort(-head.logits(base, out), stable=True))


def _reference_output(head, base, h_prefix, y_prefix, path_tokens, path_feats):
    """The draft's output after a path, recomputed from scratch without any cache: one causal pass of FC + the
    layer over the committed pairs (h_t, x_{t+1}) then the path's pairs (f^ of the parent, the node's token)."""
    y = jnp.concatenate([y_prefix, jnp.asarray(path_tokens, jnp.int32)])
    h = jnp.concatenate([h_prefix] + [f[None] for f in path_feats], axis=0) if path_feats else h_prefix
    n = y.shape[0]
    assert n <= _PAD
    return _recompute(head, base, jnp.pad(h, ((0, _PAD - n), (0, 0))), jnp.pad(y, (0, _PAD - n)), n)


@pytest.mark.parametrize("tree", ["clover2-26", "dynamic-10-d4-k3"])
@pytest.mark.slow  # recomputes every drafted path
def test_every_drafted_node_equals_a_full_recompute_of_its_path(tree):
    """A drafted node's token is the rank-r token (static trees; among the top-k for dynamic ones) of the draft's
    output recomputed without any cache over the committed prefix and the node's ancestors. A drafter that let a
    node see its cousins, skipped an ancestor, used a wrong position or a stale cache would differ."""
    base = init_llama(CFG, seed=0)
    head = _head(base)
    prompt, lens = prompts()
    root = jnp.asarray([5, 9], jnp.int32)
    drafter = drafter_for(EagleHead, tree)
    b, t = prompt.shape
    valid = jnp.arange(t)[None] < lens[:, None]
    f = base_features(base, prompt, valid)
    y = jnp.concatenate([prompt[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1).at[jnp.arange(b), lens - 1].set(root)

    @jax.jit  # one compile instead of the eager dispatch of every op of a tree's drafting
    def draft(head, base, arrays, f, y, lens, root):
        state = drafter.start(head, base, drafter.init_state(head, base, b, 64, arrays), f, y, lens)
        return drafter.propose(head, base, state, root, jax.random.key(0))

    # the drafter's arrays are built (and cached on the shared drafter) outside the trace, as the loop does
    prop = draft(head, base, drafter.arrays(), f, y, lens, root)
    tokens = np.asarray(prop.tokens)
    parent, rank, depth = (np.broadcast_to(np.asarray(x), tokens.shape) for x in
                           (prop.buffers.parent, prop.buffers.rank, prop.buffers.depth))
    static = not isinstance(drafter, EagleDynamicDrafter)
    checked = 0
    for r in range(b):
        n = int(lens[r])
        args = (head, base, head.features(base, f[r, :n]), y[r, :n])
        done = {0: ([], [], _reference_output(*args, [], []))}  # node -> (path tokens, path features, output)
        for node in sorted(range(1, tokens.shape[1]), key=lambda i: depth[r, i]):
            p = int(parent[r, node])
            if p < 0:
                continue  # an unused slot
            path, feats, out = done[p]
            order = np.asarray(_order(head, base, out))
            tok = int(tokens[r, node])
            if static:
                assert tok == order[int(rank[r, node])], (r, node)
            else:
                assert tok in order[:drafter.spec.top_k], (r, node)
            done[node] = (path + [tok], feats + [out], _reference_output(*args, path + [tok], feats + [out]))
            checked += 1
    assert checked >= 2 * 9


@pytest.mark.parametrize("tree", ["chain-4", "clover2-26", "dynamic-10"])
@pytest.mark.parametrize("init", ["reference", "base_layer"])
@pytest.mark.slow  # a speculative loop per tree
def test_speculative_eagle_equals_greedy(tree, init):
    base = init_llama(CFG, seed=0)
    head = _head(base, init=init)
    prompt, lens = prompts()
    for eos in (NO_EOS, (2,)):
        out, _ = spec(base, head, tree, prompt, lens, eos=eos)
        same_as_greedy(base, out, prompt, lens, 24, eos)


@pytest.mark.slow  # compiles speculative loops
def test_eagle_drafts_are_accepted_when_right():
    """The base emits token 0 forever (final norm 0). A head whose FC and layer output nothing predicts the zero
    feature: all logits tie and every draft is token 0, so each step accepts its deepest path (depths beyond any
    training: EAGLE drafts as deep as the tree asks). A head whose output is token 1's direction gets nothing."""
    base = init_llama(CFG, seed=0)
    base.final_norm[...] = jnp.zeros_like(base.final_norm[...])
    head = init_from_base(base, EagleConfig(), seed=1)
    zero = {n: jnp.zeros_like(getattr(head.layer, n)[...]) for n in ("wo", "w_down")}
    nnx.update(head, {"fc_w": jnp.zeros_like(head.fc_w[...]), "fc_b": jnp.zeros_like(head.fc_b[...]),
                      "layer": zero})
    prompt, lens = prompts()
    for tree, depth in (("chain-3", 3), ("chain-6", 6), ("dynamic-5-d4-k1", 4)):
        n = 2 + 4 * (depth + 1)
        out, stats = spec(base, head, tree, prompt, lens, n=n)
        assert stats["tau"] == depth + 1, (tree, stats)
        same_as_greedy(base, out, prompt, lens, n, NO_EOS)
    w1 = np.asarray(base.lm_head_matrix())[:, 1]
    head.fc_b[...] = jnp.asarray(w1 / np.linalg.norm(w1))
    out, stats = spec(base, head, "chain-3", prompt, lens, n=12)
    assert stats["tau"] == 1.0 and stats["accept_hist"][0] > 0, stats


# ----------------------------------------------------------------------------- the torch reference
def _reference_model(torch, c: LlamaConfig):
    """The reference's EAGLE-1 `Model` (SafeAILab/EAGLE v1 `cnets.py`) in torch: a frozen `embed_tokens`,
    `fc` (2D -> D, bias) over cat(embedding, feature), `layers.0` a Llama decoder layer without
    `input_layernorm`, RoPE plain with base 10000."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    nn = torch.nn
    layer_cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=1, num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, attention_bias=False, mlp_bias=False, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    layer_cfg._attn_implementation = "eager"

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
            self.layers = nn.ModuleList([LlamaDecoderLayer(layer_cfg, 0)])
            self.layers[0].input_layernorm = nn.Identity()  # the reference's layer 0 has none
            self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=True)
            self.rotary_emb = LlamaRotaryEmbedding(config=layer_cfg)

        def forward(self, hidden_states, input_ids):
            z = self.fc(torch.cat((self.embed_tokens(input_ids), hidden_states), dim=-1))
            b, t, _ = z.shape
            position_ids = torch.arange(t)[None].expand(b, t)
            mask = torch.zeros(b, 1, t, t).masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool)),
                                                        torch.finfo(torch.float32).min)
            return self.layers[0](z, attention_mask=mask, position_ids=position_ids,
                                  position_embeddings=self.rotary_emb(z, position_ids))

    return Model().eval()


@pytest.mark.torch
@pytest.mark.slow  # builds the torch reference
def test_export_loads_strictly_into_the_reference_and_computes_the_same(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    from clover_jax.heads.export import export_head, import_head

    base = init_llama(CFG, seed=0)
    head = _head(base)
    out = export_head(head, tmp_path / "eagle", base=base)
    meta = json.loads((out / "config.json").read_text())
    assert meta["head_type"] == "eagle" and meta["num_hidden_layers"] == 1 and meta["rope_theta"] == 10000.0
    model = _reference_model(torch, CFG)
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == set(model.state_dict())
    model.load_state_dict(tensors, strict=True)

    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 9)), jnp.int32)
    valid = jnp.ones((2, 9), bool)
    f = base_features(base, tokens, valid)
    got = np.asarray(head.train_outputs(base, f, tokens, valid))[0]
    h = np.asarray(head.features(base, f))
    y = np.concatenate([np.asarray(tokens)[:, 1:], np.zeros((2, 1), np.int64)], axis=1)
    with torch.no_grad():
        want = model(torch.tensor(h), torch.tensor(y, dtype=torch.long)).numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

    back = import_head(out, base)
    for a, b in zip(jax.tree.leaves(nnx.state(back)), jax.tree.leaves(nnx.state(head))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    prompt, lens = prompts()
    np.testing.assert_array_equal(np.asarray(spec(base, back, "clover2-26", prompt, lens)[0].tokens),
                                  np.asarray(spec(base, head, "clover2-26", prompt, lens)[0].tokens))


@pytest.mark.slow  # trains, exports and imports
def test_eagle_training_run_export_and_import(tmp_path):
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
    overrides = ("head.type=eagle", "loss.v_weight=1.0", "loss.p_weight=0.1")
    trainer = Trainer(make_cfg(*overrides, "optim.lr=1e-2", "optim.warmup_steps=0", "train.steps=40"), base,
                      mesh=mesh, donate=False)
    data = SyntheticBatcher(seed=2)
    losses = [float(trainer.train_step(next(data))["loss"]) for _ in range(40)]
    assert np.mean(losses[-5:]) < 0.8 * losses[0], losses

    run = tmp_path / "run"
    cfg = make_cfg(*overrides, "head.init=base_layer", "train.steps=4", "loss.vocab_positions_per_row=4",
                   output_dir=str(run))
    summary = run_experiment(cfg, progress=False, mesh=mesh, loaded=base,
                             batcher=BucketedBatcher(_tiny_dataset(), 8, [8, 16], seed=0), eval_batches=[])
    assert summary["final_step"] == 4
    from_run = load_head(run, base)
    assert isinstance(from_run, EagleHead)
    out = export_head_from_run(run, tmp_path / "head", model=str(export_base(base, tmp_path / "base")))
    assert json.loads((out / "config.json").read_text())["head_type"] == "eagle"
    back = import_head(out, base)
    for a, b in zip(jax.tree.leaves(nnx.state(back)), jax.tree.leaves(nnx.state(from_run))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # compiles training steps
def test_feature_noise_is_eagles_uniform_noise_on_inputs_only():
    """`loss.feature_noise`: uniform in +-std*256/length on valid positions, 0 on padding; it changes the training
    loss (inputs only: with zero noise the loss is the clean one), a step's noise is fixed by the step number (a
    resumed run redraws the same), and head types that take no input features refuse it by name."""
    from clover_jax.training.config import ConfigError
    from clover_jax.heads.losses import LossConfig, uniform_feature_noise
    from clover_jax.training.steps import build_steps
    from training_helpers import make_cfg

    valid = jnp.asarray(np.arange(16)[None] < np.array([[16], [4]]))
    z = np.asarray(uniform_feature_noise(jax.random.key(0), valid, 64, 0.2))  # [2, 16, 64]
    for row, length in ((0, 16), (1, 4)):
        a = 0.2 * 512 / length / 2
        v = z[row, :length]
        assert np.abs(v).max() <= a and np.abs(v).max() > 0.9 * a and abs(v.mean()) < 0.1 * a
    assert np.all(z[1, 4:] == 0)

    base = init_llama(CFG, seed=0)
    head = init_from_base(base, EagleConfig(), seed=1)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 64, (2, 16)), jnp.int32)
    f = base_features(base, tokens, valid)
    ht = registry.get("eagle")
    noisy = LossConfig(decay=1.0, v_weight=1.0, p_weight=0.1, feature_noise=0.2)
    clean, _ = ht.loss_from_features(head, base, f, tokens, valid, valid, noisy)  # no rng: eval, no noise
    loss_a, _ = ht.loss_from_features(head, base, f, tokens, valid, valid, noisy, rng=jax.random.key(1))
    loss_b, _ = ht.loss_from_features(head, base, f, tokens, valid, valid, noisy, rng=jax.random.key(2))
    zero = LossConfig(decay=1.0, v_weight=1.0, p_weight=0.1, feature_noise=1e-30)
    loss_0, _ = ht.loss_from_features(head, base, f, tokens, valid, valid, zero, rng=jax.random.key(1))
    assert float(loss_a) != float(clean) and float(loss_a) != float(loss_b)
    np.testing.assert_allclose(float(loss_0), float(clean), rtol=1e-6)  # the targets carry no noise

    import optax

    params = nnx.to_pure_dict(nnx.state(head))
    graph = nnx.graphdef(head)
    step, _ = build_steps(graph, nnx.graphdef(base), optax.sgd(1.0), noisy, 1, donate=False, noise_seed=3)
    batch = {"tokens": tokens, "loss_mask": valid, "valid": valid}
    opt = optax.sgd(1.0).init(params)
    base_state = nnx.state(base)
    m = [float(step(params, opt, base_state, batch, jnp.asarray(s))[2]["loss"]) for s in (5, 5, 6)]
    assert m[0] == m[1] and m[0] != m[2]

    make_cfg("head.type=eagle", "loss.feature_noise=0.2")  # accepted
    with pytest.raises(ConfigError, match="feature_noise: a clover2 head"):
        make_cfg("loss.feature_noise=0.2")


def test_a_base_of_other_dimensions_is_a_named_error():
    head = nnx.eval_shape(lambda: init_from_base(nnx.eval_shape(lambda: init_llama(CFG))))
    check_compatible(head, CFG)
    for field in LlamaConfig.HEAD_FIT_FIELDS:
        value = getattr(CFG, field)
        other = dataclasses.replace(CFG, **{field: (not value) if isinstance(value, bool) else value * 2})
        with pytest.raises(InputError, match=f"EAGLE head does not fit the base model: {field} is"):
            check_compatible(head, other)
