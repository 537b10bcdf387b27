"""Training runs that go wrong leave a way forward: --from-step past a corrupt checkpoint, a warning on an empty
--resume, no empty folders after a failed start, one metrics record per step after a resume, and config
errors that name where the bad value came from."""

import json
import logging
import sys
from pathlib import Path

import jax
import pytest

from clover_jax import parallel
from clover_jax.training.config import ConfigError, load_config
from clover_jax.training.checkpoint import CheckpointError
from clover_jax.training.run import run_experiment
from training_helpers import SyntheticBatcher, make_cfg, tiny_base

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import train  # noqa: E402


def _mesh():
    return parallel.make_mesh(1, 1, 1, devices=jax.devices("cpu")[:1])


def _cfg(run_dir, *extra):
    return make_cfg("train.steps=6", "checkpoint.save_every=2", "checkpoint.keep=3", *extra, output_dir=str(run_dir))


def _train(run_dir, **kw):
    return run_experiment(_cfg(run_dir), progress=False, mesh=_mesh(), loaded=tiny_base(), batcher=SyntheticBatcher(),
                          **kw)


def _steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # trains and resumes
def test_resume_past_a_corrupt_checkpoint_with_from_step(tmp_path):
    run_dir = tmp_path / "run"
    _train(run_dir)
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4, 6]
    (run_dir / "checkpoints" / "6" / "meta" / "metadata").write_text('{"step": 6, "da')  # a write cut short
    with pytest.raises(CheckpointError, match=r"checkpoints/6: corrupt.*--resume --from-step N \(earlier steps: "
                                              r"\[2, 4\]\)"):
        _train(run_dir, resume=True)
    with pytest.raises(CheckpointError, match=r"--from-step 5: no checkpoint of that step \(available steps: "):
        _train(run_dir, resume=True, from_step=5)
    summary = _train(run_dir, resume=True, from_step=4)
    assert summary["start_step"] == 4 and summary["final_step"] == 6
    assert (run_dir / "discarded_checkpoints" / "6" / "meta" / "metadata").is_file()  # moved aside, not deleted
    assert _steps(run_dir) == [2, 4, 6]  # the re-run step 6 replaced the first run's record
    assert len(list((run_dir / "tb").iterdir())) >= 2


def test_metrics_keep_one_record_per_step(tmp_path):
    from clover_jax.training.trainer import MetricsLogger, drop_records_after

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (2, 4, 6)) + '{"step": 8, "lo')
    assert drop_records_after(path, 4) == 2
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [2, 4]
    logger = MetricsLogger(tmp_path, tensorboard=False, start_step=2)
    logger.log({"step": 3, "loss": 0.5})
    logger.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [2, 3]


@pytest.mark.slow  # trains
def test_resume_on_an_empty_directory_warns(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        summary = run_experiment(_cfg(tmp_path / "typo", "train.steps=2"), resume=True, progress=False,
                                 mesh=_mesh(), loaded=tiny_base(), batcher=SyntheticBatcher())
    assert summary["start_step"] == 0
    assert any("holds no checkpoint; starting from step 0" in r.getMessage() for r in caplog.records)


def test_failed_start_leaves_no_empty_folders(tmp_path):
    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir, f"model.name_or_path={tmp_path / 'no-such-model'}")
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        run_experiment(cfg, progress=False, mesh=_mesh())
    assert not run_dir.exists()


TRAIN_CASES = [  # (arguments, what the error names)
    (["--from-step", "4"], "--from-step"),
    (["--resume", "--from-step", "-1"], "--from-step"),
    (["--set", "optim.lr=-1"], "--set optim.lr"),
    (["--set", "data.batch_size=0"], "--set data.batch_size"),
    (["--set", "model.name_or_path={tmp}/no-such-model"], "no-such-model"),
    (["--set", "model.name_or_path={tmp}/cut.gguf"], "cut.gguf"),
    (["--resume", "--from-step", "3"], "no checkpoint to resume from"),
]


@pytest.mark.parametrize("args,names", TRAIN_CASES, ids=[" ".join(a)[:50] for a, _ in TRAIN_CASES])
def test_train_bad_input(args, names, tmp_path, capsys):
    from clover_jax.io.loader import resolve_model_path

    with open(resolve_model_path("smollm2-135m-instruct"), "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(4 * 1024 ** 2))
    before = sorted(p.name for p in tmp_path.iterdir())
    code = train.main(["--config", str(ROOT / "configs" / "smollm2-135m-clover2.yaml"), "--quiet",
                       "--output-dir", str(tmp_path / "run"), "--set", "data.batch_size=8",  # 8 test devices
                       *[a.format(tmp=tmp_path) for a in args]])
    err = capsys.readouterr().err
    assert code == 2 and names in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no run folder, no empty checkpoints/


def test_set_errors_name_the_override_not_the_file(tmp_path):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("optim:\n  lr: 0.001\n")
    with pytest.raises(ConfigError, match=r"^--set optim.lr: "):
        load_config(yaml_file, ["optim.lr=-2"])
    yaml_file.write_text("optim:\n  lr: -2\n")
    with pytest.raises(ConfigError, match=r"c.yaml: optim.lr: "):
        load_config(yaml_file, ["optim.b1=0.9"])


def test_batch_larger_than_the_data_set_warns(caplog):
    from clover_jax.training import run

    class Tiny:
        def __len__(self):
            return 3

    cfg = make_cfg("data.batch_size=8")
    with caplog.at_level(logging.WARNING):
        run._warn_small_data(cfg, Tiny())
    assert any("data.batch_size=8 is larger than the 3 training examples" in r.getMessage() for r in caplog.records)


@pytest.mark.slow  # trains, then resumes
def test_resuming_a_finished_run_reads_its_last_checkpoint(tmp_path):
    """--resume on a finished run whose last checkpoint is corrupt names the file and the way forward (--from-step),
    as a resume that trains does, instead of saying there is nothing to do."""
    run_dir = tmp_path / "run"
    _train(run_dir)
    params = run_dir / "checkpoints" / "6" / "params"
    target = max((p for p in params.rglob("d/*") if p.is_file()), key=lambda p: p.stat().st_size)
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])  # a copy cut short
    with pytest.raises(CheckpointError) as err:
        run_experiment(_cfg(run_dir), resume=True, progress=False, mesh=_mesh(), loaded=tiny_base())
    msg = str(err.value)
    assert "checkpoints/6: corrupt checkpoint: cannot restore its arrays" in msg, msg
    assert str(target.relative_to(run_dir / "checkpoints" / "6")) in msg, msg  # the file
    assert "params '" in msg and "--resume --from-step N (earlier steps: [2, 4])" in msg, msg
    assert " at 0x" not in msg and "bound method" not in msg, msg
