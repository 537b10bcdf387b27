"""A checkpoint save that fails (a read-only folder, a full disk) or a checkpoint that cannot be read ends the run
with one `error:` line and status 2, within seconds of the failure, with no traceback, and the last good
checkpoint intact and named. Each case is a whole training process (`save_fault_run.py`), as `train.py` runs: a
failed asynchronous save leaves Orbax's writer threads waiting, which only a process's end shows. Marked slow: four
processes, each compiling the tiny model's step (about a minute on 2 cores)."""

import subprocess
import sys
from pathlib import Path

import pytest

from clover_jax.training.checkpoint import load_head_from_run
from training_helpers import tiny_base

RUNNER = Path(__file__).with_name("save_fault_run.py")
pytestmark = pytest.mark.slow


def _run(run_dir: Path, mode: str, *extra: str) -> tuple[int, str]:
    p = subprocess.run([sys.executable, str(RUNNER), str(run_dir), mode, *extra], capture_output=True, text=True,
                       timeout=300)  # a hang fails here
    return p.returncode, p.stdout + p.stderr


def _one_error_line(out: str) -> str:
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out
    assert "Traceback" not in out and "Event loop is closed" not in out, out
    return errors[0]


@pytest.mark.parametrize("mode, cause", [("read-only", "Operation not permitted"),
                                         ("disk-full", "No space left on device")])
def test_a_failing_save_ends_the_run_and_keeps_the_last_checkpoint(tmp_path, mode, cause):
    run_dir = tmp_path / "run"
    code, out = _run(run_dir, mode)
    line = _one_error_line(out)
    assert code == 2, out
    assert str(run_dir / "checkpoints") in line and cause in line, line
    assert line.endswith(f"the last good checkpoint is {run_dir / 'checkpoints' / '4'}"), line
    head = load_head_from_run(run_dir, tiny_base(), step=4)  # restored and checked against its checksums
    assert head is not None


def test_a_corrupt_checkpoint_on_resume_is_one_line(tmp_path):
    run_dir = tmp_path / "run"
    code, out = _run(run_dir, "none")
    assert code == 0, out
    data = max((p for p in (run_dir / "checkpoints" / "8" / "train_state").rglob("d/*") if p.is_file()),
               key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    code, out = _run(run_dir, "none", "--resume", "--steps=10")
    line = _one_error_line(out)
    assert code == 2 and "checkpoints/8: corrupt checkpoint: cannot restore its arrays" in line, out
    assert str(data.relative_to(run_dir / "checkpoints" / "8")) in line, line
