"""Checkpoints: kill-and-resume is bit-identical, bad checkpoints give clear errors and stay untouched."""

import dataclasses
import hashlib
import logging
import os
import signal

import jax
import numpy as np
import pytest

from clover_jax import parallel
from clover_jax.training.checkpoint import Checkpointer, CheckpointError, load_head_from_run
from clover_jax.training.run import run_experiment
from clover_jax.training.trainer import Trainer
from training_helpers import ODD, SyntheticBatcher, make_cfg, tiny_base

STEPS = 6


def one_device_mesh():
    return parallel.make_mesh(1, 1, 1, devices=jax.devices("cpu")[:1])


def cfg_for(run_dir, *extra):
    return make_cfg(f"train.steps={STEPS}", "checkpoint.save_every=2", "checkpoint.keep=2", *extra,
                    output_dir=str(run_dir))


def train(run_dir, *, resume=False, stop_at=None, extra=(), base=None):
    """run_experiment on the tiny model + synthetic data; `stop_at` sends SIGTERM to this process after that step."""
    seen = {}

    def on_step(step, trainer):
        if stop_at is not None and step == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # let the Python-level handler run
                pass
        seen["trainer"] = trainer

    batcher = SyntheticBatcher()
    summary = run_experiment(cfg_for(run_dir, *extra), resume=resume, progress=False, mesh=one_device_mesh(),
                             loaded=base if base is not None else tiny_base(), batcher=batcher, on_step=on_step)
    return summary, seen.get("trainer"), batcher


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def snapshot(directory):
    out = {}
    for root, _, files in os.walk(directory):
        for f in files:
            p = os.path.join(root, f)
            out[p] = (os.path.getsize(p), hashlib.sha256(open(p, "rb").read()).hexdigest())
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full")
    summary, trainer, batcher = train(run_dir)
    return run_dir, summary, trainer, batcher


@pytest.mark.slow  # trains, stops and resumes
def test_kill_and_resume_is_bit_identical(uninterrupted, tmp_path):
    _, full_summary, full, _ = uninterrupted
    assert full_summary["final_step"] == STEPS and not full_summary["stopped_early"]

    first, t1, b1 = train(tmp_path, stop_at=3)
    assert first["stopped_early"] and first["final_step"] == 3
    assert first["checkpoint_step"] == 3
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler removed after the loop

    # a fresh process-like start: new trainer, new batcher, restored from the checkpoint
    ck = Checkpointer(tmp_path / "checkpoints")
    t_probe = Trainer(cfg_for(tmp_path), tiny_base(), base_name="tiny", mesh=one_device_mesh())
    data_state = t_probe.restore(ck)
    ck.close()
    assert data_state["index"] == 3 == b1.index  # data position
    np.testing.assert_array_equal(np.asarray(t_probe.state.rng), np.asarray(t1.state.rng))  # RNG key
    for a, b in zip(leaves(t_probe.state.params), leaves(t1.state.params)):
        assert np.array_equal(a, b)

    second, t2, b2 = train(tmp_path, resume=True)
    assert second["start_step"] == 3 and second["final_step"] == STEPS and b2.index == STEPS
    for a, b in zip(leaves(t2.state.params), leaves(full.state.params)):
        assert np.array_equal(a, b)  # BIT-identical to the uninterrupted run
    for a, b in zip(leaves(t2.state.opt_state), leaves(full.state.opt_state)):
        assert np.array_equal(a, b)


@pytest.mark.slow  # needs the module's training run (uninterrupted)
def test_keep_last_k_and_run_files(uninterrupted, caplog):
    run_dir, _, _, _ = uninterrupted
    absl_log = logging.getLogger("absl")
    for f in list(absl_log.filters):  # as in a process that opens its first checkpoint
        absl_log.removeFilter(f)
    with caplog.at_level(logging.WARNING):
        ck = Checkpointer(run_dir / "checkpoints", read_only=True)
    assert not caplog.records  # opening a run to read it is not worth a warning
    assert ck.all_steps() == [4, 6]
    meta = ck.read_meta(6)
    ck.close()
    assert meta["data"]["index"] == 6 and meta["head"]["head_config"]["num_heads"] == 3
    assert (run_dir / "metrics.jsonl").is_file() and (run_dir / "config.yaml").is_file()
    assert (run_dir / "head.json").is_file() and any((run_dir / "tb").iterdir())


@pytest.mark.slow  # needs the module's training run (uninterrupted)
def test_load_head_from_run(uninterrupted):
    run_dir, _, trainer, _ = uninterrupted
    base = tiny_base()
    head = load_head_from_run(run_dir, base)
    from flax import nnx

    for a, b in zip(leaves(nnx.state(head)), leaves(trainer.state.params)):
        assert np.array_equal(a, b)
    older = load_head_from_run(run_dir, base, step=4)
    assert not all(np.array_equal(a, b) for a, b in zip(leaves(nnx.state(older)), leaves(nnx.state(head))))
    with pytest.raises(CheckpointError, match=r"no checkpoint for step 5 \(available steps: \[4, 6\]\)"):
        load_head_from_run(run_dir, base, step=5)
    with pytest.raises(CheckpointError, match="base model with vocab_size=64.*vocab_size=66"):
        load_head_from_run(run_dir, tiny_base(ODD))
    with pytest.raises(CheckpointError, match="run directory not found"):
        load_head_from_run(run_dir / "nope", base)


@pytest.mark.slow  # needs the module's training run (uninterrupted)
def test_refuses_to_overwrite_without_resume(uninterrupted):
    run_dir, _, _, _ = uninterrupted
    before = snapshot(run_dir / "checkpoints")
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(steps \[4, 6\]\).*--resume"):
        train(run_dir)
    assert snapshot(run_dir / "checkpoints") == before


@pytest.mark.slow  # needs the module's training run (uninterrupted)
def test_resuming_a_finished_run_skips_the_data(uninterrupted):
    """--resume on a finished run returns at once: no data set-up (make_cfg's data source would fail to load:
    the tiny model has no tokenizer), and the checkpoints are still checked against the config."""
    run_dir, summary, _, _ = uninterrupted
    before = snapshot(run_dir / "checkpoints")
    again = run_experiment(cfg_for(run_dir), resume=True, progress=False, mesh=one_device_mesh(), loaded=tiny_base())
    assert again["steps_run"] == 0 and again["final_step"] == summary["final_step"] == STEPS
    with pytest.raises(CheckpointError, match="head config num_heads is 3 in the checkpoint but 2"):
        run_experiment(cfg_for(run_dir, "head.num_heads=2"), resume=True, progress=False, mesh=one_device_mesh(),
                       loaded=tiny_base())
    assert snapshot(run_dir / "checkpoints") == before


@pytest.mark.slow  # needs the module's training run (uninterrupted)
def test_incompatible_checkpoint(uninterrupted):
    run_dir, _, _, _ = uninterrupted
    before = snapshot(run_dir / "checkpoints")
    with pytest.raises(CheckpointError, match=r"checkpoints/4: incompatible checkpoint: head config num_heads is 3 "
                                              r"in the checkpoint but 2 in this run"):
        train(run_dir, resume=True, extra=("head.num_heads=2",))
    with pytest.raises(CheckpointError, match="incompatible checkpoint: base model vocab_size is 64 in the "
                                              "checkpoint but 66"):
        train(run_dir, resume=True, base=tiny_base(ODD))
    # a base whose layers norm queries and keys (Qwen3): the head's copied decoder layer would have to as well
    qk = tiny_base(dataclasses.replace(tiny_base().config, qk_norm=True))
    with pytest.raises(CheckpointError, match="incompatible checkpoint: base model qk_norm is False in the "
                                              "checkpoint but True"):
        train(run_dir, resume=True, base=qk)
    with pytest.raises(CheckpointError, match="the head was trained for a base model with qk_norm=False, this base "
                                              "model has qk_norm=True"):
        load_head_from_run(run_dir, qk)
    assert snapshot(run_dir / "checkpoints") == before


@pytest.mark.parametrize("damage", ["garbage", "truncate", "metadata"])
@pytest.mark.slow  # needs the module's training run (uninterrupted)
def test_corrupt_checkpoint_is_reported_and_kept(uninterrupted, tmp_path, damage):
    import shutil

    src, _, _, _ = uninterrupted
    run_dir = tmp_path / "run"
    shutil.copytree(src / "checkpoints", run_dir / "checkpoints")
    step_dir = run_dir / "checkpoints" / "6"
    if damage == "metadata":
        (step_dir / "meta" / "metadata").write_text('{"step": 6, "data": {')
        expect = "checkpoints/6: corrupt checkpoint: cannot read its metadata"
    else:
        data_files = sorted((step_dir / "params").rglob("d/*"), key=lambda p: p.stat().st_size)
        target = data_files[-1]
        raw = bytearray(target.read_bytes())
        if damage == "garbage":  # same length, flipped bytes: the checksums tell, unless the bytes fall in an
            # encoded (compressed) chunk, which then fails to decode (which file is largest can vary between runs)
            raw[len(raw) // 2: len(raw) // 2 + 64] = bytes(b ^ 0xFF for b in raw[len(raw) // 2: len(raw) // 2 + 64])
            expect = ("checkpoints/6: corrupt checkpoint: (the data of params '.*' does not match the checksum"
                      "|cannot restore its arrays)")
        else:
            raw = raw[: len(raw) // 2]
            expect = "checkpoints/6: corrupt checkpoint: cannot restore its arrays"
        target.write_bytes(bytes(raw))
    before = snapshot(run_dir / "checkpoints")
    with pytest.raises(CheckpointError, match=expect):
        train(run_dir, resume=True)
    assert snapshot(run_dir / "checkpoints") == before  # nothing deleted, nothing rewritten


@pytest.mark.parametrize("damage", ["data", "array_metadata"])
@pytest.mark.slow  # needs the module's training run (uninterrupted)
def test_corrupt_checkpoint_names_the_file_and_parameter(uninterrupted, tmp_path, damage):
    """The error names the step folder, the file and the parameter, never an internal storage object's repr."""
    import re
    import shutil

    src, _, _, _ = uninterrupted
    run_dir = tmp_path / "run"
    shutil.copytree(src / "checkpoints", run_dir / "checkpoints")
    step_dir = run_dir / "checkpoints" / "6"
    if damage == "data":  # the optimizer state's largest data file, cut short
        target = max((p for p in (step_dir / "train_state").rglob("d/*") if p.is_file()), key=lambda p: p.stat().st_size)
        target.write_bytes(target.read_bytes()[:100])
        names = [str(target.relative_to(step_dir)), "train_state 'opt_state."]
    else:
        target = step_dir / "params" / "_METADATA"
        target.write_text('{"tree_metadata": {')
        names = ["params/_METADATA: not valid JSON"]
    with pytest.raises(CheckpointError) as err:
        train(run_dir, resume=True)
    msg = str(err.value)
    assert "checkpoints/6: corrupt checkpoint: cannot restore its arrays: " in msg, msg
    for name in names:
        assert name in msg, msg
    assert not re.search(r"<[^>]*(object at 0x|bound method)", msg), msg


def test_resume_without_checkpoints_starts_fresh(tmp_path):
    ck = Checkpointer(tmp_path / "c")
    assert ck.all_steps() == [] and ck.latest_step() is None
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        ck.read_meta()
    ck.close()


@pytest.mark.slow  # needs the module's training run (uninterrupted)
def test_restore_onto_a_mesh(uninterrupted):
    """A checkpoint written on one device restores onto a (data, fsdp, tp) mesh with the rules' shardings."""
    from jax.sharding import PartitionSpec as P

    run_dir, _, trainer, _ = uninterrupted
    mesh = parallel.make_mesh(2, 2, 2, devices=jax.devices("cpu")[:8])
    sharded = Trainer(cfg_for(run_dir), tiny_base(), base_name="tiny", mesh=mesh)
    ck = Checkpointer(run_dir / "checkpoints", read_only=True)
    sharded.restore(ck)
    ck.close()
    assert sharded.state.step == STEPS
    assert sharded.state.params["aug"]["wq"].sharding.spec == P(None, "fsdp", "tp")
    assert sharded.state.opt_state[1][0].mu["fc0_w"].sharding.spec == P("fsdp", "tp")
    for a, b in zip(leaves(sharded.state.params), leaves(trainer.state.params)):
        assert np.array_equal(a, b)


@pytest.mark.slow  # needs the module's training run (uninterrupted)
def test_orbax_checkpoint_export_import_round_trip(uninterrupted, tmp_path):
    """Orbax checkpoint -> load_head_from_run -> export (reference names) -> import: identical head outputs."""
    import jax
    import jax.numpy as jnp

    from clover_jax.heads.export import export_head, import_head
    from clover_jax.training.checkpoint import load_head_from_run

    run_dir, _, trainer, _ = uninterrupted
    base = tiny_base()
    head = load_head_from_run(run_dir, base)
    for a, b in zip(leaves(head_params(head)), leaves(trainer.state.params)):
        assert np.array_equal(a, b)  # the checkpoint holds the trained parameters
    out = export_head(head, tmp_path / "exported", base=base, base_name="tiny")
    back = import_head(out, base)
    f = jax.random.normal(jax.random.key(0), (2, 9, base.config.hidden_size))
    toks = jax.random.randint(jax.random.key(1), (2, 9), 0, base.config.vocab_size)
    valid = jnp.ones((2, 9), bool)
    np.testing.assert_array_equal(np.asarray(head.train_outputs(base, f, toks, valid)),
                                  np.asarray(back.train_outputs(base, f, toks, valid)))


def head_params(head):
    from flax import nnx

    return nnx.to_pure_dict(nnx.state(head, nnx.Param))
