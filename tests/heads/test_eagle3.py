"""EAGLE-3 heads through the head registry: training-time test computes what drafting computes, exact greedy
decoding over static and dynamic trees with and without a draft vocabulary of the head's own, the published layout
both ways (ours and vLLM's `layers.0.` naming, `d2t` as the folder's draft vocabulary), named errors for wrong
pairings, and a training run with its export."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from clover_jax import parallel
from clover_jax.heads import registry
from clover_jax.heads.draft_vocab import folder_draft_vocab
from clover_jax.heads.eagle.head import EagleConfig
from clover_jax.heads.eagle.head import init_from_base as eagle1_init
from clover_jax.heads.eagle3 import Eagle3Config, Eagle3Head, default_feature_layers, init_from_base
from clover_jax.heads.eagle3.drafter import Eagle3Drafter, Eagle3DynamicDrafter
from clover_jax.heads.export import export_head, import_head
from clover_jax.heads.losses import LossConfig, base_features
from clover_jax.heads.registry import drafter_for
from clover_jax.io.export import ExportError
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import init_llama
from clover_jax.validation import ConfigError, InputError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))  # training_helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))  # spec_helpers
from spec_helpers import NO_EOS, prompts, same_as_greedy  # noqa: E402

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, rope_theta=500000.0, eos_token_ids=(2,))
TAPS = default_feature_layers(CFG.num_hidden_layers)  # (1, 3, 4)
VOCAB = np.asarray(sorted({0, 1, 2, *range(3, 64, 2)}), np.int32)  # a 34-token draft vocabulary


def _head(base, q=0, seed=1, num_heads=3):
    """A head with attention sharp enough that which keys a node sees changes its drafts."""
    head = init_from_base(base, Eagle3Config(feature_layers=TAPS, draft_vocab_size=q, num_heads=num_heads), seed)
    kq, kk = jax.random.split(jax.random.key(seed + 7))
    head.wq[...] = head.wq[...] + 0.6 * jax.random.normal(kq, head.wq.shape)
    head.wk[...] = head.wk[...] + 0.6 * jax.random.normal(kk, head.wk.shape)
    return head


@pytest.fixture(scope="module")
def base():
    return init_llama(CFG, seed=0)


def _spec(base, head, tree, prompt, lens, n=20, draft_vocab=None):
    from clover_jax.decoding.sampling import SamplingParams
    from clover_jax.decoding.speculative import spec_generate

    out, stats, _ = spec_generate(base, head, prompt, lens, max_new_tokens=n, cache_size=96,
                                  sampling=SamplingParams(), key=jax.random.key(0),
                                  drafter=drafter_for(type(head), tree, draft_vocab), eos_ids=NO_EOS)
    return out, stats


def test_registry_defaults_and_named_errors(base):
    ht = registry.get("eagle3")
    assert registry.of_head(Eagle3Head) is ht and default_feature_layers(30) == (1, 14, 26)
    assert isinstance(drafter_for(Eagle3Head, "clover2-26"), Eagle3Drafter)
    assert isinstance(drafter_for(Eagle3Head, "dynamic-10"), Eagle3DynamicDrafter)
    with pytest.raises(InputError, match="3 distinct base layers"):
        Eagle3Config(feature_layers=(1, 1, 4))
    with pytest.raises(InputError, match="reads base layers"):  # taps the base does not have
        init_from_base(base, Eagle3Config(feature_layers=(1, 3, 9)))
    head = _head(base, q=len(VOCAB))
    with pytest.raises(InputError, match=f"its own {len(VOCAB)}-token vocabulary"):  # drafted without its vocabulary
        drafter_for(Eagle3Head, "chain-3").check(head, base)
    with pytest.raises(InputError, match="EAGLE-3 drafter drafts with an EAGLE-3 head"):  # a head of another type
        drafter_for(Eagle3Head, "chain-3").check(eagle1_init(base, EagleConfig()), base)
    with pytest.raises(InputError, match=f"scores {len(VOCAB)} draft tokens"):  # trained without its vocabulary
        registry.get("eagle3").loss_from_features(head, base, jnp.zeros((1, 4, 4 * 32)), jnp.zeros((1, 4), jnp.int32),
                                                  jnp.ones((1, 4)), jnp.ones((1, 4), bool), LossConfig())


@pytest.mark.slow  # compiles training and drafting paths
def test_training_time_test_is_what_drafting_computes(base):
    """Step i of training-time test at position t equals the drafted node at depth i below a root committed at t."""
    head = _head(base, num_heads=4)
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(3, 64, (2, 12)), jnp.int32)
    valid = jnp.ones((2, 12), bool)
    f = base_features(base, tokens, valid, taps=TAPS)  # [B, T, 4D]
    outs = np.asarray(head.train_outputs(base, f, tokens, valid))  # [4, B, T, D]
    t = 6  # the root pair (g_6, x_7); depth i drafts from x_{7+i}
    y = jnp.concatenate([tokens[:, 1:], jnp.zeros((2, 1), jnp.int32)], axis=1)
    s0, cache = head.commit(base, head.init_cache(2, 32), f[:, :t + 1], y[:, :t + 1], jnp.array([t + 1] * 2),
                            fresh=True)
    np.testing.assert_allclose(np.asarray(head.normed(s0)), outs[0][:, t], atol=2e-5)
    node, _ = head.root_node(base, cache, s0)
    for depth in range(1, 4):
        node, o = head.node_step(base, cache, node, tokens[:, t + 1 + depth:t + 2 + depth], depth)
        np.testing.assert_allclose(np.asarray(head.normed(o[:, 0])), outs[depth][:, t], atol=2e-5)


@pytest.mark.parametrize("q", [0, len(VOCAB)])
@pytest.mark.slow  # a speculative loop per tree
def test_speculative_equals_greedy(base, q):
    head = _head(base, q=q)
    vocab = VOCAB if q else None
    prompt, lens = prompts()
    for tree in ("chain-4", "clover2-26", "dynamic-10", "dynamic-12-d4-k3"):
        out, _ = _spec(base, head, tree, prompt, lens, draft_vocab=vocab)
        same_as_greedy(base, out, prompt, lens, 20, NO_EOS, cache_size=96)


def test_drafts_over_a_draft_vocabulary_are_target_ids(base):
    """A head trained on a draft vocabulary ranks its draft ids; the drafter maps them to target ids of that
    vocabulary (the loop's commit_prompt then sees target ids only)."""
    head = _head(base, q=len(VOCAB))
    d = drafter_for(Eagle3Head, "clover2-26", VOCAB)
    state = d.init_state(head, base, 2, 32)
    hidden = 4 * jax.random.normal(jax.random.key(0), (2, CFG.hidden_size))  # [B, D]
    ids = np.asarray(d._top_k(head, base, state, hidden))  # [B, k]
    assert ids.shape[1] > 1 and all(len(set(row)) == len(row) for row in ids.tolist())
    assert set(ids.ravel().tolist()) <= set(VOCAB.tolist())
    assert np.any(ids >= len(VOCAB))  # mapped: not the draft ids 0..33 themselves


@pytest.mark.parametrize("family", [{"qk_norm": True, "model_type": "qwen3"},
                                    {"attention_bias": True, "model_type": "qwen2"}])
@pytest.mark.slow  # a speculative loop per base family
def test_on_qwen_bases(tmp_path, family):
    """On a Qwen3 base (q/k norms) or a Qwen2 base (q/k/v biases) the head's layer stays EAGLE-3's Llama layer: it
    drafts exactly and exports a Llama-layer config.json."""
    import dataclasses

    qbase = init_llama(dataclasses.replace(CFG, **family), seed=0)
    head = _head(qbase)
    prompt, lens = prompts()
    out, _ = _spec(qbase, head, "dynamic-10", prompt, lens)
    same_as_greedy(qbase, out, prompt, lens, 20, NO_EOS, cache_size=96)
    meta = json.loads((export_head(head, tmp_path / "h", base=qbase) / "config.json").read_text())
    assert meta["model_type"] == "llama" and meta["architectures"] == ["LlamaForCausalLMEagle3"]
    assert meta["base_model"]["model_type"] == family["model_type"]
    assert import_head(tmp_path / "h", qbase).vocab_size == CFG.vocab_size


@pytest.mark.slow  # exports and drafts from each layout
def test_export_import_and_the_published_layouts(base, tmp_path):
    head = _head(base, q=len(VOCAB))
    out = export_head(head, tmp_path / "ours", base=base, draft_vocab=VOCAB)
    meta = json.loads((out / "config.json").read_text())
    assert meta["architectures"] == ["LlamaForCausalLMEagle3"] and meta["draft_vocab_size"] == len(VOCAB)
    assert meta["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # inputs of layers 2, L//2, L-3
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["d2t"].dtype == np.int64 and tensors["t2d"].dtype == np.bool_
    np.testing.assert_array_equal(np.arange(len(VOCAB)) + tensors["d2t"], VOCAB)
    assert tensors["t2d"].sum() == len(VOCAB) and tensors["fc.weight"].shape == (32, 96)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (32, 64)  # q/k/v read 2D
    np.testing.assert_array_equal(folder_draft_vocab(out), VOCAB)  # the folder's vocabulary is its d2t

    back = import_head(out, base)
    for a, b in zip(jax.tree.leaves(nnx.state(back)), jax.tree.leaves(nnx.state(head))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert back.cfg.feature_layers == TAPS and back.cfg.rope_theta is None

    # as vLLM / the speculators format store it: the layer as layers.0.*, no head_type, no embedding copy
    pub = tmp_path / "published"
    pub.mkdir()
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in tensors.items() if k != "embed_tokens.weight"},
              str(pub / "model.safetensors"))
    (pub / "config.json").write_text(json.dumps({k: v for k, v in meta.items() if k not in (
        "head_type", "rope_follows_base", "ttt_steps", "base_model")}))
    assert registry.recognize(json.loads((pub / "config.json").read_text()), pub).name == "eagle3"
    np.testing.assert_array_equal(folder_draft_vocab(pub), VOCAB)
    published = import_head(pub, base)
    prompt, lens = prompts()
    drafted = [np.asarray(_spec(base, h, "dynamic-10", prompt, lens, draft_vocab=VOCAB)[0].tokens)
               for h in (published, head)]
    np.testing.assert_array_equal(*drafted)

    # through the public API by path: the folder's d2t is the draft vocabulary, outputs equal plain decoding
    import clover_jax

    ids = [[5, 9, 11, 3, 7, 21], [4, 8, 15]]
    spec_out = clover_jax.generate(base, ids, max_new_tokens=12, mode="speculative", head=str(pub), tree="dynamic-10")
    ar_out = clover_jax.generate(base, ids, max_new_tokens=12, mode="ar")
    assert spec_out.token_ids == ar_out.token_ids

    # an EAGLE-3 folder is never taken for an EAGLE-1 head (which would accept nothing), nor half a head
    assert not registry.get("eagle").recognizes(json.loads((pub / "config.json").read_text()), pub)
    broken = tmp_path / "broken"
    shutil.copytree(pub, broken)
    t = load_file(str(broken / "model.safetensors"))
    del t["d2t"]
    save_file(t, str(broken / "model.safetensors"))
    with pytest.raises(ExportError, match="no d2t"):
        import_head(broken, base)
    with pytest.raises(ExportError, match="with its draft vocabulary"):
        export_head(head, tmp_path / "no-vocab", base=base)


def test_a_config_must_give_the_head_its_vocabulary():
    from training_helpers import make_cfg

    cfg = make_cfg("head.type=eagle3", "head.feature_layers=[1,3,4]")
    assert cfg.head.config_kwargs()["feature_layers"] == (1, 3, 4)
    with pytest.raises(ConfigError, match="loss.draft_vocab: true and train.draft_vocab_size: 16"):
        make_cfg("head.type=eagle3", "head.feature_layers=[1,3,4]", "head.draft_vocab_size=16")
    with pytest.raises(ConfigError, match="3 distinct base layers"):
        make_cfg("head.type=eagle3")


def test_the_smollm2_recipe_loads():
    from clover_jax.training.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "smollm2-135m-eagle3.yaml")
    assert cfg.head.type == "eagle3" and cfg.head.num_heads == 7
    assert cfg.head.feature_layers == default_feature_layers(30)
    assert cfg.head.draft_vocab_size == cfg.train.draft_vocab_size == 8192 and cfg.loss.draft_vocab
    assert (cfg.loss.decay, cfg.loss.v_weight, cfg.loss.p_weight) == (0.8, 0.0, 1.0)


@pytest.mark.slow  # trains, then exports
def test_training_run_learns_and_exports(tmp_path):
    from clover_jax.cli.export import export_head_from_run
    from clover_jax.training.data import BucketedBatcher
    from clover_jax.training.run import run_experiment
    from clover_jax.training.trainer import Trainer
    from test_trainer import _tiny_dataset
    from training_helpers import SyntheticBatcher, make_cfg

    base = init_llama(CFG, seed=0)
    base.lm_head[...] = base.lm_head[...] * 40  # a confident teacher
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices("cpu")[:1])
    overrides = ("head.type=eagle3", "head.feature_layers=[1,3,4]", "loss.decay=0.8", "loss.v_weight=0")
    trainer = Trainer(make_cfg(*overrides, "optim.lr=1e-2", "optim.warmup_steps=0", "train.steps=30"), base,
                      mesh=mesh, donate=False)
    data = SyntheticBatcher(seed=2)
    losses = [float(trainer.train_step(next(data))["loss"]) for _ in range(30)]
    assert np.mean(losses[-5:]) < 0.8 * losses[0], losses

    run = tmp_path / "run"
    cfg = make_cfg(*overrides, "head.draft_vocab_size=60", "loss.draft_vocab=true", "train.draft_vocab_size=60",
                   "train.steps=4", output_dir=str(run))
    summary = run_experiment(cfg, progress=False, mesh=mesh, loaded=base,
                             batcher=BucketedBatcher(_tiny_dataset(), 8, [8, 16], seed=0), eval_batches=[])
    assert summary["final_step"] == 4
    ids = folder_draft_vocab(run)
    assert ids is not None and len(ids) == 60  # the data's distinct tokens, then unused ids: all 60 columns
    import clover_jax.cli.export as export_cli

    export_cli.load_model = lambda name, with_tokenizer=False: type("L", (), {"model": base})()
    out = export_head_from_run(run, tmp_path / "exported")
    np.testing.assert_array_equal(folder_draft_vocab(out), ids)
    head = import_head(out, base)
    assert head.vocab_size == 60
    prompt, lens = prompts()
    out_tokens, _ = _spec(base, head, "dynamic-10", prompt, lens, draft_vocab=ids)
    same_as_greedy(base, out_tokens, prompt, lens, 20, NO_EOS, cache_size=96)
