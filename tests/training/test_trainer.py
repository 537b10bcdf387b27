"""Trainer pieces: gradient accumulation equals one big batch, schedules, bf16/remat, eval, the CLI's errors."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax import parallel
from clover_jax.cli import train as train_cli
from clover_jax.training import steps as steps_lib
from clover_jax.training.trainer import Trainer
from training_helpers import TINY, SyntheticBatcher, make_cfg, tiny_base

ROOT = Path(__file__).resolve().parents[2]
CFG = ("optim.eps=1e-3", "optim.clip_value=null", "optim.warmup_steps=0", "optim.lr=1e-3", "head.num_heads=2")


def one_step(accum, mesh_shape=(1, 1, 1), *overrides):
    mesh = parallel.make_mesh(*mesh_shape, devices=jax.devices("cpu")[:int(np.prod(mesh_shape))])
    trainer = Trainer(make_cfg(*CFG, f"optim.grad_accum={accum}", *overrides), tiny_base(), mesh=mesh,
                      donate=False)
    metrics, grads = trainer.train_step(SyntheticBatcher(seed=5).batch(0), return_grads=True)
    return jax.device_get((metrics, grads, trainer.state.params))


@pytest.mark.parametrize("packed", [0, 3], ids=["dense", "packed-ce"])
@pytest.mark.slow  # compiles training steps on one and four devices
def test_grad_accumulation_equals_one_big_batch(packed):
    batch = SyntheticBatcher(seed=5).batch(0)
    # the two micro-batches (rows 0,2,4,6 and 1,3,5,7) have different mask counts, so averaging their
    # separately normalised losses (optax.MultiSteps) would not give the big-batch loss
    micro = [{k: v[j::2] for k, v in batch.items()} for j in range(2)]
    counts = [float(steps_lib.head_counts(m, 2)[0][0]) for m in micro]
    assert counts[0] != counts[1]

    extra = (f"loss.vocab_positions_per_row={packed}",)  # packed: 3 cross-entropy positions per row
    m1, g1, p1 = one_step(1, (1, 1, 1), *extra)
    m2, g2, p2 = one_step(2, (2, 2, 1), *extra)  # accumulated and sharded (micro-batches of 4 rows over 4 shards)
    if packed:
        assert np.all(m1["p_count"] < m1["count"])
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-5)
    np.testing.assert_allclose(m2["acc"], m1["acc"], atol=1e-6)
    np.testing.assert_allclose(m2["count"], m1["count"])
    scale = max(float(np.max(np.abs(x))) for x in jax.tree.leaves(g1))
    for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale)
    for a, b in zip(jax.tree.leaves(p2), jax.tree.leaves(p1)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_schedules():
    cfg = make_cfg("optim.lr=1.0", "optim.warmup_steps=10", "optim.total_steps=110", "train.steps=110")
    lin = steps_lib.make_schedule(cfg.optim, 110)
    np.testing.assert_allclose([lin(0), lin(5), lin(10), lin(60), lin(110)], [0, 0.5, 1.0, 0.5, 0.0], atol=1e-6)
    cos = steps_lib.make_schedule(make_cfg("optim.lr=1.0", "optim.warmup_steps=10", "optim.schedule=cosine",
                                           "train.steps=110").optim, 110)
    np.testing.assert_allclose([cos(10), cos(60), cos(110)], [1.0, 0.5, 0.0], atol=1e-6)
    const = steps_lib.make_schedule(make_cfg("optim.lr=2.0", "optim.warmup_steps=0",
                                             "optim.schedule=constant").optim, 6)
    np.testing.assert_allclose([const(0), const(1000)], [2.0, 2.0])


def test_clip_by_value_in_the_chain():
    """Element 0 sees gradients (3, 0.5), element 1 (0.5, 0.5): identical after clipping each element to
    [-0.5, 0.5] (by value, not by norm), so their Adam updates at step 2 must be equal."""
    cfg = make_cfg("optim.clip_value=0.5", "optim.warmup_steps=0", "optim.schedule=constant")
    tx, _ = steps_lib.make_optimizer(cfg.optim, 6)
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    _, state = tx.update({"w": jnp.array([3.0, 0.5])}, state, params)
    updates, _ = tx.update({"w": jnp.array([0.5, 0.5])}, state, params)
    np.testing.assert_allclose(updates["w"][0], updates["w"][1], rtol=1e-6)
    no_clip, _ = steps_lib.make_optimizer(make_cfg("optim.clip_value=null", "optim.warmup_steps=0").optim, 6)
    state = no_clip.init(params)
    _, state = no_clip.update({"w": jnp.array([3.0, 0.5])}, state, params)
    updates, _ = no_clip.update({"w": jnp.array([0.5, 0.5])}, state, params)
    assert abs(float(updates["w"][0] - updates["w"][1])) > 1e-5


def test_clip_by_global_norm_in_the_chain():
    """With clip_norm 1, a first gradient of norm 5 enters Adam as the same direction at norm 1: two steps (norm 5,
    then norm 1) give the update of the unclipped chain fed norm 1 twice; without the clip they differ."""

    def second_update(first, *overrides):
        tx, _ = steps_lib.make_optimizer(make_cfg("optim.warmup_steps=0", "optim.schedule=constant",
                                                  "optim.clip_value=null", *overrides).optim, 6)
        params = {"w": jnp.zeros(2)}
        state = tx.init(params)
        _, state = tx.update({"w": jnp.array(first)}, state, params)
        return tx.update({"w": jnp.array([0.6, 0.8])}, state, params)[0]["w"]  # norm 1

    want = second_update([0.6, 0.8])
    np.testing.assert_allclose(second_update([3.0, 4.0], "optim.clip_norm=1.0"), want, rtol=1e-5)
    assert not np.allclose(second_update([3.0, 4.0]), want, rtol=1e-3)
    with pytest.raises(Exception, match="clip_norm"):
        make_cfg("optim.clip_norm=0")


@pytest.mark.slow  # compiles training and evaluation steps
def test_bf16_remat_label_mask_accum_and_eval():
    """One compile covering the other code paths: bf16 head compute, remat, the label mask (whose
    accumulation falls back to averaging per-micro-batch losses) and evaluation."""
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices("cpu")[:1])
    cfg = make_cfg("train.compute_dtype=bfloat16", "train.remat=true", "head.num_heads=2", "optim.grad_accum=2",
                   "loss.label_mask_topk=8", "loss.label_mask_topp=0.8")
    trainer = Trainer(cfg, tiny_base(), mesh=mesh)
    assert trainer.head_cfg.dtype == jnp.bfloat16 and trainer.head_cfg.remat and trainer.loss_cfg.label_mask
    batcher = SyntheticBatcher()
    held = [SyntheticBatcher(seed=9).batch(i) for i in range(2)]
    before = trainer.evaluate(held)
    metrics = jax.device_get(trainer.train_step(next(batcher)))
    assert np.isfinite(metrics["loss"]) and metrics["loss"] > 0
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(trainer.state.params))  # fp32 master params
    after = trainer.evaluate(held)
    assert set(after) >= {"loss", "vloss", "ploss", "acc", "chain_acc", "count", "tokens"}
    assert len(after["acc"]) == 2 and after["count"] == before["count"]
    assert after["chain_acc"][1] <= after["acc"][1] + 1e-9
    assert trainer.evaluate([]) == {}


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True,
                          env=env, timeout=120, cwd=ROOT)


def _one_error_line(stderr, message):
    lines = [line for line in stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert len(lines) == 1 and lines[0].startswith(message), stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("args,message", [
    (["--set", "optm.lr=1"], "error: --set: unknown section 'optm'"),
    (["--config", "does/not/exist.yaml"], "error: config file not found: does/not/exist.yaml"),
    (["--set", "mesh.data=3", "--set", "mesh.fsdp=5"], "error: mesh: data*fsdp*tp = 3*5*1 = 15, but there are"),
])
def test_cli_config_errors_are_one_line(args, message, capsys, monkeypatch):
    """The CLI's `main` in this process (what a process adds is tested below): status 2 and one `error:` line."""
    monkeypatch.chdir(ROOT)
    assert train_cli.main(args) == 2
    _one_error_line(capsys.readouterr().err, message)


def test_cli_config_error_ends_the_process_with_status_2():
    """`python train.py` itself: a bad value ends the process with exit status 2 and one line on stderr, nothing
    else a starting JAX process prints there."""
    out = _cli("--set", "optim.lr=abc")
    assert out.returncode == 2
    _one_error_line(out.stderr, "error: --set optim.lr: expected float, got 'abc'")


@pytest.mark.slow  # trains three heads
def test_warm_start_from_an_exported_head(tmp_path):
    from clover_jax.training.config import ConfigError
    from clover_jax.heads.export import export_head

    base = tiny_base()
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices("cpu")[:1])
    first = Trainer(make_cfg(*CFG), base, mesh=mesh, donate=False)
    first.train_step(SyntheticBatcher(seed=1).batch(0))
    export_head(first.head(), tmp_path / "head", base=base, base_name="tiny")
    warm = Trainer(make_cfg(*CFG, f"train.init_head_from={tmp_path / 'head'}", "train.eval_every=2"), base,
                   mesh=mesh, donate=False)
    for a, b in zip(jax.tree.leaves(warm.state.params), jax.tree.leaves(first.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert warm.state.step == 0  # new optimizer state and schedule, the old weights
    # a warm start evaluates the head it starts from before its first step (its baseline), then as configured
    held = [SyntheticBatcher(seed=9).batch(i) for i in range(2)]
    baseline = warm.evaluate(held)
    summary = warm.fit(SyntheticBatcher(seed=2), eval_batches=held, steps=2, progress=False)
    assert [e["step"] for e in summary["evals"]] == [0, 2]
    assert summary["evals"][0]["acc"] == baseline["acc"] and summary["evals"][0]["loss"] == baseline["loss"]
    # a fresh head: no baseline evaluation
    cold = Trainer(make_cfg(*CFG, "train.eval_every=2"), base, mesh=mesh, donate=False)
    assert [e["step"] for e in cold.fit(SyntheticBatcher(seed=2), eval_batches=held, steps=2,
                                        progress=False)["evals"]] == [2]
    with pytest.raises(ConfigError, match="head.num_heads"):
        Trainer(make_cfg(*CFG[:-1], "head.num_heads=3", f"train.init_head_from={tmp_path / 'head'}"), base,
                mesh=mesh)
    with pytest.raises(ConfigError, match="train.init_head_from"):
        Trainer(make_cfg(*CFG, f"train.init_head_from={tmp_path / 'nothing'}"), base, mesh=mesh)


def _tiny_dataset(lengths=(5, 16, 9, 12, 3, 16, 7, 11, 14, 6, 15, 10), seed=0):
    from clover_jax.training.data import Example, TokenizedDataset

    rng = np.random.default_rng(seed)
    examples = [Example(str(i), rng.integers(0, 64, n).astype(np.int32), (np.arange(n) >= 2).astype(np.int32))
                for i, n in enumerate(lengths)]
    return TokenizedDataset(examples, pad_id=0, max_length=16)


@pytest.mark.slow  # compiles training steps twice
def test_cached_base_features_give_the_online_step():
    from clover_jax.training.data import BucketedBatcher
    from clover_jax.training.features import attach_features
    from clover_jax.heads.losses import base_features

    base, ds = tiny_base(), _tiny_dataset()
    batcher = attach_features(BucketedBatcher(ds, 8, [8, 16], seed=0), base, batch_size=3, dtype=jnp.float32,
                              progress=False)
    for i in (0, 4, 5):  # each example's features: the base over that example alone, whatever its batch-mates
        ex = ds[i]
        alone = base_features(base, jnp.asarray(ex.tokens[None]), jnp.ones((1, len(ex)), bool))[0]
        np.testing.assert_allclose(batcher.features[i], np.asarray(alone), atol=1e-5)
    batch = next(batcher)
    assert batch["features"].shape == (*batch["tokens"].shape, TINY.hidden_size)
    assert not np.any(batch["features"][~batch["valid"]]) and np.any(batch["features"][batch["valid"]])

    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices("cpu")[:1])
    results = []
    for b in ({k: v for k, v in batch.items() if k != "features"}, batch):
        trainer = Trainer(make_cfg(*CFG), base, mesh=mesh, donate=False)
        results.append(jax.device_get(trainer.train_step(b, return_grads=True)))
    (m_online, g_online), (m_cached, g_cached) = results
    np.testing.assert_allclose(m_cached["loss"], m_online["loss"], rtol=1e-5)
    for a, c in zip(jax.tree.leaves(g_online), jax.tree.leaves(g_cached)):
        np.testing.assert_allclose(c, a, rtol=1e-4, atol=1e-6)

    default = attach_features(BucketedBatcher(ds, 8, [8, 16], seed=0), base, progress=False)
    assert default.features[0].dtype == jnp.bfloat16  # the memory-saving default


@pytest.mark.slow  # runs the base over data sets
def test_features_on_disk_are_cached_per_example_for_the_same_model(tmp_path, monkeypatch):
    """The second run on the same base and data loads every example (the base never runs), bit-equal in bfloat16; a
    grown data set runs the base over its new examples only; another base gets its own folder; a shard whose size
    does not fit its index is an error naming it."""
    from clover_jax.training import features
    from clover_jax.training.data import BucketedBatcher

    base, ds = tiny_base(), _tiny_dataset()
    first = features.attach_features(BucketedBatcher(ds, 8, [8, 16], seed=0), base, progress=False, cache_dir=tmp_path)
    folders = sorted(tmp_path.glob("features-*"))
    assert len(folders) == 1 and len(list(folders[0].glob("shard-*.npy"))) == 1

    ran = []
    real = features.compute_features

    def counting(base, dataset, *a, indices=None, **k):
        ran.append(len(dataset) if indices is None else len(indices))
        return real(base, dataset, *a, indices=indices, **k)

    monkeypatch.setattr(features, "compute_features", counting)
    again = features.attach_features(BucketedBatcher(ds, 8, [8, 16], seed=0), base, progress=False, cache_dir=tmp_path)
    assert ran == []  # every example came from disk
    for a, b in zip(first.features, again.features):
        assert b.dtype == jnp.bfloat16 and np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))

    extra = _tiny_dataset((5, 9, 3), seed=1)  # three new examples after the first data set's
    grown = type(ds)(ds.examples + extra.examples, pad_id=ds.pad_id, max_length=ds.max_length)
    g = features.attach_features(BucketedBatcher(grown, 8, [8, 16], seed=0), base, progress=False, cache_dir=tmp_path)
    assert ran == [len(extra)]  # the base ran over the new examples only
    alone = features.attach_features(BucketedBatcher(extra, 8, [8, 16], seed=0), base, progress=False)
    for i in range(len(grown)):
        want = first.features[i] if i < len(ds) else alone.features[i - len(ds)]
        np.testing.assert_allclose(np.asarray(g.features[i], np.float32), np.asarray(want, np.float32), atol=2e-2)
    assert len(list(folders[0].glob("shard-*.npy"))) == 2
    monkeypatch.undo()

    other = tiny_base()
    other.final_norm[...] = other.final_norm[...] * 2
    features.attach_features(BucketedBatcher(ds, 8, [8, 16], seed=0), other, progress=False, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("features-*"))) == 2

    shard = sorted(folders[0].glob("shard-*.npy"))[0]
    np.save(shard, np.zeros((7, TINY.hidden_size), np.uint16))  # a damaged shard under the right name
    with pytest.raises(ValueError, match=f"{shard.name}.*delete both files"):
        features.attach_features(BucketedBatcher(ds, 8, [8, 16], seed=0), base, progress=False, cache_dir=tmp_path)


@pytest.mark.slow  # trains twice, then exports
def test_draft_vocabulary_training_run_marks_its_vocabulary_and_exports_it(tmp_path):
    from clover_jax.training.config import ConfigError
    from clover_jax.cli.export import export_head_from_run
    from clover_jax.heads.draft_vocab import head_draft_vocab, load_draft_vocab
    from clover_jax.io.export import export_base
    from clover_jax.training.data import BucketedBatcher
    from clover_jax.training.features import attach_features
    from clover_jax.training.run import run_experiment

    with pytest.raises(ConfigError, match="loss.draft_vocab.*train.draft_vocab_size"):
        make_cfg("loss.draft_vocab=true")
    base, ds = tiny_base(), _tiny_dataset()
    with pytest.raises(ValueError, match="loss.draft_vocab"):
        Trainer(make_cfg("loss.draft_vocab=true", "train.draft_vocab_size=16"), base,
                mesh=parallel.make_mesh(1, 1, 1, devices=jax.devices("cpu")[:1]))

    run = tmp_path / "run"
    cfg = make_cfg("loss.draft_vocab=true", "train.draft_vocab_size=16", "train.steps=4",
                   "loss.vocab_positions_per_row=4", output_dir=str(run))
    batcher = attach_features(BucketedBatcher(ds, 8, [8, 16], seed=0), base, progress=False)
    summary = run_experiment(cfg, progress=False, mesh=parallel.make_mesh(1, 1, 1, devices=jax.devices("cpu")[:1]),
                             loaded=base, batcher=batcher, eval_batches=[])
    assert summary["final_step"] == 4 and np.isfinite(summary["last_log"]["loss"])
    ids = head_draft_vocab(run)
    assert ids is not None and len(ids) == 16
    np.testing.assert_array_equal(ids, load_draft_vocab(run / "draft_vocab.json"))

    base_dir = export_base(base, tmp_path / "base")
    out = export_head_from_run(run, tmp_path / "head", model=str(base_dir))
    np.testing.assert_array_equal(head_draft_vocab(out), ids)  # the exported head drafts from it too
    from clover_jax.decoding.ngram import build_ngram_table, save_ngram_table
    from clover_jax.heads.folder import open_folder
    from clover_jax.cli.export import export_head_from_folder

    save_ngram_table(build_ngram_table([[1, 2, 3, 1, 2, 4]] * 2, base.config.vocab_size), out)
    copy = export_head_from_folder(out, tmp_path / "copy", model=str(base_dir))  # the n-gram table travels too
    np.testing.assert_array_equal(open_folder(copy).ngram_table.keys, open_folder(out).ngram_table.keys)
    np.testing.assert_array_equal(head_draft_vocab(copy), ids)

    # a draft vocabulary written only as an inference option is not the head's training vocabulary
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "draft_vocab.json").write_text('{"size": 2, "ids": [1, 2]}')
    assert head_draft_vocab(plain) is None

    # a warm start keeps the vocabulary of the head it continues (train.draft_vocab_from), not its data's
    again = tmp_path / "again"
    cfg2 = make_cfg("loss.draft_vocab=true", f"train.draft_vocab_from={run}", f"train.init_head_from={run}",
                    "train.steps=2", "loss.vocab_positions_per_row=4", output_dir=str(again))
    other = _tiny_dataset(lengths=(4, 6, 5, 7, 3, 8, 4, 6))  # a different data set: its own top tokens differ
    run_experiment(cfg2, progress=False, mesh=parallel.make_mesh(1, 1, 1, devices=jax.devices("cpu")[:1]),
                   loaded=base, batcher=attach_features(BucketedBatcher(other, 8, [8, 16], seed=0), base,
                                                        progress=False), eval_batches=[])
    np.testing.assert_array_equal(head_draft_vocab(again), ids)
    with pytest.raises(ConfigError, match="train.draft_vocab_from.*holds no draft vocabulary"):
        run_experiment(make_cfg("loss.draft_vocab=true", f"train.draft_vocab_from={plain}", "train.steps=2",
                                output_dir=str(tmp_path / "bad")), progress=False,
                       mesh=parallel.make_mesh(1, 1, 1, devices=jax.devices("cpu")[:1]), loaded=base,
                       batcher=BucketedBatcher(other, 8, [8, 16], seed=0), eval_batches=[])
