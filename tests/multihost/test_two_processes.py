"""Two JAX processes on this machine, 4 simulated CPU devices each, one 8-device mesh (`clover_jax.cli.launch`,
gloo collectives): what a TPU pod's hosts do, for real.

* Training on two processes equals training in one process with 8 devices: the loss at every step to 1e-6
  relative and the head parameters to 1e-6 (the reductions run over the same 8 shards; only which process holds
  them differs, and with it some summation orders).
* Killing one process (SIGKILL) mid-run, or while its asynchronous checkpoint save is under way, stops the other
  within JAX's heartbeat timeout instead of hanging; the half-written checkpoint is not taken for one; relaunching
  both with --resume ends bit-identical to the uninterrupted two-process run.
* SIGTERM to the launcher stops both processes at one step, saved whole, and the launcher exits 0 after them.
* Greedy autoregressive and speculative decoding (chain-3) on the two-process mesh give the one-device tokens
  (trees on a mesh: tests/decoding/test_mesh.py, one process).

The processes run `tests/multihost/worker.py` (see there).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from clover_jax.cli import launch
from clover_jax.training.checkpoint import Checkpointer

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

WORKER = str(Path(__file__).with_name("worker.py"))
HEARTBEAT = 3  # seconds: how long the survivor of a killed process waits before it stops


def run_job(*args: str, processes: int = 2) -> tuple[int, str, float]:
    """(exit status, output, seconds) of the worker as a job of `processes` processes with 4 devices each."""
    out = io.StringIO()
    t0 = time.monotonic()
    code = launch.launch([WORKER, *args], processes, devices_per_process=4, heartbeat_timeout=HEARTBEAT, grace=20,
                         out=out)
    return code, out.getvalue(), time.monotonic() - t0


def run_alone(*args: str, devices: int) -> None:
    """The worker as one ordinary process with `devices` devices (the reference)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COORDINATOR", "CLOVER_NUM", "CLOVER_PROC"))}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, WORKER, *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def final_params(out: Path) -> dict[str, np.ndarray]:
    with np.load(out / "final.npz") as f:
        return {k: f[k] for k in f.files}


def losses(out: Path) -> list[tuple[int, float]]:
    lines = (out / "run" / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r.get("split") == "train"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one")
    run_alone("train", "--out", str(out), devices=8)
    return out


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("two")
    code, log, _ = run_job("train", "--out", str(out))
    assert code == 0, log[-4000:]
    return out


def test_training_on_two_processes_equals_one_process(one_process, two_processes):
    assert json.loads((two_processes / "summary.json").read_text())["processes"] == 2
    one, two = losses(one_process), losses(two_processes)
    assert [s for s, _ in two] == [s for s, _ in one] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([x for _, x in two], [x for _, x in one], rtol=1e-6, atol=0)
    a, b = final_params(one_process), final_params(two_processes)
    assert a.keys() == b.keys() and len(a) > 10
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=0, atol=1e-6, err_msg=k)
    # both processes wrote their shards of every checkpoint: steps 2, 4, 6 restore in one process
    ckpt = Checkpointer(two_processes / "run" / "checkpoints", read_only=True, async_save=False,
                        save_on_preemption=False)
    assert ckpt.all_steps() == [2, 4, 6]
    assert ckpt.read_meta(6)["step"] == 6


@pytest.mark.parametrize("kill", ["--kill-at", "--kill-in-save"])
def test_a_killed_process_stops_the_job_and_resume_is_bit_identical(kill, two_processes, tmp_path):
    """--kill-at 5: process 1 dies after step 5 (the asynchronous saves of steps 2 and 4 behind it); --kill-in-save
    4: it dies right after the asynchronous save of step 4 started. Either way the survivor stops through the
    heartbeat, only complete checkpoints are listed (a save cut short stays a temporary folder), and --resume
    continues from the latest of them."""
    code, log, seconds = run_job("train", "--out", str(tmp_path), kill, "5" if kill == "--kill-at" else "4")
    assert code != 0
    assert "process 1 killed by SIGKILL" in log and "process 0 killed by SIGABRT" in log, log[-3000:]
    assert "JAX distributed service detected fatal errors" in log  # stopped by the heartbeat, not by the launcher
    assert "stopping process" not in log
    stopped_after = float(log.rsplit(", ", 1)[1].split(" s after")[0])
    assert stopped_after < HEARTBEAT + 15, log[-2000:]
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints", read_only=True, async_save=False, save_on_preemption=False)
    steps = ckpt.all_steps()
    assert steps in ([2], [2, 4]), steps  # the step-4 save completes before the kill, or is cut short by it
    for step in steps:
        assert ckpt.read_meta(step)["step"] == step  # listed only once complete
    if steps == [2]:
        assert any(p.name.startswith("4.") for p in ckpt.directory.iterdir())  # the cut save: a temporary folder
    code, log, _ = run_job("train", "--out", str(tmp_path), "--resume")
    assert code == 0, log[-4000:]
    assert json.loads((tmp_path / "summary.json").read_text())["start_step"] == steps[-1]
    assert losses(tmp_path) == losses(two_processes)
    a, b = final_params(two_processes), final_params(tmp_path)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_sigterm_to_the_launcher_stops_the_job_at_a_saved_step(two_processes, tmp_path):
    """SIGTERM to the launcher alone (a scheduler's timeout, `kill <pid>`) reaches both processes: JAX's preemption
    sync stops them at one step, which is saved whole; both exit 0, and so does the launcher, after them; the run
    folder's lock is released. (A resume from a listed checkpoint is bit-identical: the tests above.)"""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), CLOVER_JAX_COMPILE_CACHE="off")
    launcher = subprocess.Popen([sys.executable, "-m", "clover_jax.cli.launch", "-n", "2", "--devices-per-process",
                                 "4", "--heartbeat-timeout", str(HEARTBEAT), "--", WORKER, "train", "--out",
                                 str(tmp_path), "--step-delay", "1"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        t0 = time.monotonic()
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):  # steps 1 and 2 done
            assert launcher.poll() is None and time.monotonic() - t0 < 300, launcher.stdout.read()[-4000:]
            time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)
        log, _ = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
        launcher.wait()
    assert launcher.returncode == 0, log[-4000:]
    assert "launch: received SIGTERM: passing SIGTERM on to processes 0, 1" in log
    stops = sorted(line.split()[:5] for line in log.splitlines() if "stopping at step" in line)
    assert len(stops) == 2 and stops[0][4] == stops[1][4], stops  # both processes, at one step
    step = int(stops[0][4])
    assert 2 <= step < 6
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints", read_only=True, async_save=False, save_on_preemption=False)
    assert ckpt.all_steps()[-1] == step and ckpt.read_meta(step)["step"] == step
    assert not (tmp_path / "run" / "run.lock").exists()
    assert losses(tmp_path) == losses(two_processes)[:step]  # the same run, up to the stop


def test_decoding_on_two_processes_equals_one_device(tmp_path):
    run_alone("decode", "--out", str(tmp_path / "one"), "--one-device", devices=1)
    code, log, _ = run_job("decode", "--out", str(tmp_path / "two"))
    assert code == 0, log[-4000:]
    one = json.loads((tmp_path / "one" / "decode.json").read_text())
    two = json.loads((tmp_path / "two" / "decode.json").read_text())
    assert one.keys() == two.keys() == {"ar", "chain-3"}
    for run in one:
        assert two[run]["tokens"] == one[run]["tokens"] == one["ar"]["tokens"], run
        assert two[run]["accept_hist"] == one[run]["accept_hist"], run
