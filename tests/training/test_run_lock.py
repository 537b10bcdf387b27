"""One training job per run folder (`clover_jax.training.run_lock`): a second `train.py` on a folder in use stops with
one `error:` line naming the running job and touches nothing; the lock of a job that was killed is taken over; a
lock file the lock itself cannot vouch for is judged by the pid on this host and refused from another host."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clover_jax.training import run_lock
from clover_jax.training.run_lock import LOCK_FILE, RunLockedError

ROOT = Path(__file__).resolve().parents[2]
HOST = socket.gethostname()


def python(*args: str, **env: str) -> subprocess.Popen:
    full = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", CLOVER_JAX_COMPILE_CACHE="off",
                XLA_FLAGS="--xla_force_host_platform_device_count=1", **env)
    return subprocess.Popen([sys.executable, *args], env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)


def write_holder(run_dir: Path, **holder) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_FILE).write_text(json.dumps({"since": "2000-01-01 00:00:00 +0000", "command": "train.py",
                                                 "processes": 1, **holder}))


def no_flock(*args):
    raise OSError(errno.ENOLCK, "No locks available")


def test_a_held_lock_is_refused_and_a_dead_one_taken_over(tmp_path, monkeypatch, caplog):
    run = tmp_path / "run"
    holder = python("-c", "import sys, time; from clover_jax.training.run_lock import acquire; acquire(sys.argv[1]); "
                          "print('locked', flush=True); time.sleep(300)", str(run))
    try:
        assert holder.stdout.readline().strip() == "locked", holder.stderr.read() if holder.poll() else ""
        with pytest.raises(RunLockedError, match=rf"{re.escape(str(run))} is in use by another training job: pid "
                                                 rf"{holder.pid} on host {HOST}, running since 20\d\d-.*: -c .*choose "
                                                 "another --output-dir"):
            run_lock.acquire(run)
        with monkeypatch.context() as m:  # a filesystem without locks: the pid decides, and it runs
            m.setattr(fcntl, "flock", no_flock)
            with pytest.raises(RunLockedError, match=rf"may be in use .*pid {holder.pid} .*a running process.*"
                                                     rf"delete {re.escape(str(run / LOCK_FILE))}"):
                run_lock.acquire(run)
    finally:
        holder.kill()  # a crash: the file stays, the lock goes with the process
        holder.wait()
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == holder.pid
    with caplog.at_level(logging.WARNING, logger=run_lock.__name__):
        lock = run_lock.acquire(run)
    assert f"taking over the lock of a training job that no longer runs (pid {holder.pid} on host {HOST}" in caplog.text
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert list(run.iterdir()) == []  # released: the file is gone

    write_holder(run, pid=holder.pid, host=HOST)  # no locks on the filesystem, the process gone: taken over
    with monkeypatch.context() as m:
        m.setattr(fcntl, "flock", no_flock)
        run_lock.acquire(run).release()
    write_holder(run, pid=1, host="elsewhere")  # another host's job, on a network filesystem: cannot be checked
    monkeypatch.setattr(run_lock, "_local_filesystem", lambda path: False)
    with pytest.raises(RunLockedError, match=r"pid 1 on host elsewhere.*another host, whose processes cannot be "
                                             rf"checked from here\); if that job no longer runs, delete"):
        run_lock.acquire(run)
    assert json.loads((run / LOCK_FILE).read_text())["host"] == "elsewhere"  # left as it was
    monkeypatch.setattr(run_lock, "_local_filesystem", lambda path: True)  # a local disk: the lock is authoritative
    run_lock.acquire(run).release()
    assert not (run / LOCK_FILE).exists()


# ------------------------------------------------------------------------------- two train.py processes
CHAT = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Count from {i} to {i + 9}."},
                                     {"role": "assistant", "content": " ".join(str(i + k) for k in range(10))}]}
        for i in range(24)]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny random Llama folder with SmolLM2's tokenizer, 24 short conversations and a config training a small
    Clover-2 head on them for many steps (checkpoints every 2)."""
    from clover_jax.io.export import export_base
    from clover_jax.io.loader import load_tokenizer
    from clover_jax.models.config import LlamaConfig
    from clover_jax.models.llama import init_llama

    d = tmp_path_factory.mktemp("two_jobs")
    tok = load_tokenizer("smollm2-135m-instruct")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         eos_token_ids=(tok.eos_token_id,), bos_token_id=tok.bos_token_id)
    export_base(init_llama(config, seed=0), d / "model", tokenizer=tok)
    (d / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHAT))
    (d / "config.yaml").write_text(f"""
model: {{name_or_path: {d / 'model'}}}
head: {{type: clover2, num_heads: 2, num_aug_layers: 1}}
loss: {{vocab_positions_per_row: 4}}
data: {{source: {d / 'chat.jsonl'}, max_length: 64, bucket_boundaries: [64], batch_size: 4, heldout_fraction: 0.0}}
optim: {{warmup_steps: 0, total_steps: 0}}
train: {{steps: 100000, log_every: 1, eval_every: 0}}
checkpoint: {{save_every: 2, keep: 2}}
mesh: {{data: 1}}
""")
    return d


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def stopped(pid: int) -> bool:
    """Whether every thread of process `pid` is stopped (SIGSTOP is delivered to each thread on its own time)."""
    states = [(p / "stat").read_text().rsplit(")", 1)[1].split()[0] for p in Path(f"/proc/{pid}/task").iterdir()]
    return all(s in "Tt" for s in states)


def wait_until(check, proc: subprocess.Popen, timeout: float = 240) -> None:
    t0 = time.monotonic()
    while not check():
        if proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode}: {proc.stderr.read()[-4000:]}")
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.2)


def train(cfg: Path, *args: str) -> subprocess.Popen:
    return python("train.py", "--config", str(cfg), "--quiet", *args)


@pytest.mark.slow
def test_a_second_training_on_the_same_folder_is_refused_and_a_crashed_one_resumed(tiny_run, tmp_path):
    """Job A trains; job B on the same --output-dir exits 2 with one line naming A (pid, host, since) and leaves the
    folder as it was (A is paused meanwhile, so any change would be B's). A is then killed (SIGKILL): its lock file
    stays, and job C with --resume takes it over and finishes (train.steps=2: the step-2 checkpoint is the end)."""
    run, cfg = tmp_path / "run", tiny_run / "config.yaml"
    a = train(cfg, "--output-dir", str(run))
    try:
        def trained_two_steps() -> bool:
            metrics = run / "metrics.jsonl"
            lines = metrics.read_text().splitlines(keepends=True) if metrics.is_file() else []
            steps = [json.loads(x)["step"] for x in lines if x.endswith("\n")]  # a line being written is skipped
            return max(steps, default=0) >= 3 and (run / "checkpoints" / "2").is_dir()

        wait_until(trained_two_steps, a)
        os.kill(a.pid, signal.SIGSTOP)
        wait_until(lambda: stopped(a.pid), a)
        before = snapshot(run)
        try:
            b = train(cfg, "--output-dir", str(run))
            _, err = b.communicate(timeout=240)
            after = snapshot(run)
        finally:
            os.kill(a.pid, signal.SIGCONT)
        lines = [x for x in err.splitlines() if x.strip() and "WARNING" not in x]
        assert b.returncode == 2 and len(lines) == 1, err[-3000:]
        assert lines[0].startswith(f"error: {run} is in use by another training job: pid {a.pid} on host {HOST}, "
                                   "running since 20"), lines
        assert f"train.py --config {cfg} --quiet --output-dir {run}" in lines[0]
        assert after == before  # B touched nothing
    finally:
        a.kill()
        a.wait()
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == a.pid  # a crash leaves the file
    c = train(cfg, "--output-dir", str(run), "--resume", "--set", "train.steps=2")
    out, err = c.communicate(timeout=240)
    assert c.returncode == 0, err[-4000:]
    assert f"taking over the lock of a training job that no longer runs (pid {a.pid} on host {HOST}" in err
    summary = json.loads(out.splitlines()[-1])
    assert summary["final_step"] == summary["start_step"] >= 2  # the latest checkpoint A completed: nothing to do
    assert not (run / LOCK_FILE).exists()  # released at the end
