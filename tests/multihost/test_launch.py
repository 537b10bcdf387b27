"""The local launcher and the environment it hands each process: a process's place in the job read back from the
environment, bad settings named, a failing process reported with its status and the others stopped; with real
processes, a signal to the launcher passed on to every process (which saves and exits) and its status returned,
and a two-process job holding one run-folder lock."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clover_jax import parallel
from clover_jax.cli import launch
from clover_jax.validation import InputError

ROOT = Path(__file__).resolve().parents[2]
ENV = ("JAX_COORDINATOR_ADDRESS", parallel.NUM_PROCESSES_ENV, parallel.PROCESS_ID_ENV, parallel.HEARTBEAT_ENV)


@pytest.fixture
def clean_env(monkeypatch):
    for key in ENV:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_each_process_is_told_its_place_and_reads_it_back(clean_env):
    env = launch.process_env(1, 2, 12345, 4, 7, base={"XLA_FLAGS": "--xla_cpu_foo=1 "
                                                       "--xla_force_host_platform_device_count=8"})
    assert env["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=4"
    for key in ENV:
        clean_env.setenv(key, env[key])
    assert parallel.distributed_arguments() == {"coordinator_address": "127.0.0.1:12345", "num_processes": 2,
                                                "process_id": 1, "heartbeat_timeout_seconds": 7}
    assert parallel._multi_host_env() == "JAX_COORDINATOR_ADDRESS"  # train.py's mesh.multi_host: auto sees it


@pytest.mark.parametrize("env, message", [
    ({parallel.NUM_PROCESSES_ENV: "2"}, "go together"),
    ({parallel.NUM_PROCESSES_ENV: "2", parallel.PROCESS_ID_ENV: "2", "JAX_COORDINATOR_ADDRESS": "h:1"},
     "must be below"),
    ({parallel.NUM_PROCESSES_ENV: "two", parallel.PROCESS_ID_ENV: "0"}, "CLOVER_NUM_PROCESSES='two'"),
    ({parallel.NUM_PROCESSES_ENV: "2", parallel.PROCESS_ID_ENV: "0"}, "need JAX_COORDINATOR_ADDRESS"),
    ({parallel.HEARTBEAT_ENV: "0"}, "CLOVER_HEARTBEAT_TIMEOUT='0': must be an integer >= 1"),
])
def test_a_bad_place_in_the_job_is_named(clean_env, env, message):
    for key, value in env.items():
        clean_env.setenv(key, value)
    with pytest.raises(InputError, match=message):
        parallel.distributed_arguments()


def test_commands(tmp_path):
    assert launch.command_line(["train.py", "--resume"]) == [sys.executable, "train.py", "--resume"]
    assert launch.command_line(["-m", "clover_jax.cli.train"]) == [sys.executable, "-m", "clover_jax.cli.train"]
    assert launch.command_line(["echo", "x"]) == ["echo", "x"]
    with pytest.raises(InputError, match="no command to launch"):
        launch.command_line([])
    assert launch.main(["-n", "0", "--", "x.py"]) == 2  # a bad count is one error line
    assert launch.main(["-n", "2"]) == 2


def test_a_failing_process_is_reported_and_the_others_stopped(tmp_path):
    """Process 1 fails at once; process 0 would run for a minute: the launcher stops it after the heartbeat
    timeout plus the grace period and reports both."""
    script = tmp_path / "job.py"
    script.write_text("import os, sys, time\n"
                      "print('hello from', os.environ['CLOVER_PROCESS_ID'], flush=True)\n"
                      "if os.environ['CLOVER_PROCESS_ID'] == '1':\n    sys.exit(3)\n"
                      "time.sleep(60)\n")
    out = io.StringIO()
    code = launch.launch([str(script)], 2, heartbeat_timeout=1, grace=1, out=out)
    log = out.getvalue()
    assert code == 3, log
    assert "[0] hello from 0" in log and "[1] hello from 1" in log
    assert "process 1 exited with status 3" in log
    assert "stopping process" in log and "process 0 killed by SIGTERM" in log
    out = io.StringIO()
    assert launch.launch([sys.executable, "-c", "print('ok')"], 2, out=out) == 0
    assert out.getvalue().count("ok") == 2


# ------------------------------------------------------------------------------------- settings and signals
@pytest.mark.parametrize("args, message", [
    (["--grace", "-5"], "--grace: expected a number >= 0, got -5.0"),
    (["--grace", "nan"], "--grace: expected a finite number, got nan"),
    (["--port", "70000"], "--port: expected an integer in [1, 65535], got 70000"),
    (["--port", "0"], "--port: expected an integer in [1, 65535], got 0"),
    (["-n", "0"], "--num-processes: expected an integer in [1, 64], got 0"),
    (["-n", "100000"], "--num-processes: expected an integer in [1, 64], got 100000"),
    (["--devices-per-process", "0"], "--devices-per-process: expected an integer in [1, 1024], got 0"),
    (["--heartbeat-timeout", "0"], "--heartbeat-timeout: expected an integer >= 1, got 0"),
])
def test_bad_settings_are_one_error_line(args, message, tmp_path, capsys):
    script = tmp_path / "job.py"
    script.write_text("print('ran')\n")
    argv = (["-n", "2"] if "-n" not in args else []) + args + ["--", str(script)]
    assert launch.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {message}"], err
    assert "ran" not in capsys.readouterr().out


def test_a_busy_port_or_a_missing_script_is_named(tmp_path, capsys):
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert launch.main(["-n", "2", "--port", str(port), "--", str(tmp_path / "x.py")]) == 2
    assert capsys.readouterr().err.startswith(f"error: --port {port}: cannot be the coordinator's port")
    assert launch.main(["-n", "2", "--", str(tmp_path / "missing.py"), "--resume"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'missing.py'}: no such script to launch")


JOB = """
import os, signal, sys, time
from pathlib import Path
out, mode, status = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
i = os.environ["CLOVER_PROCESS_ID"]
got = []
signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "ignore" else lambda s, f: got.append(s))
(out / f"pid{i}.tmp").write_text(str(os.getpid()))
(out / f"pid{i}.tmp").rename(out / f"pid{i}")  # whole or absent: the test polls for it
t0 = time.time()
while not got and time.time() - t0 < 120:
    time.sleep(0.05)
if got:
    time.sleep(1.0)  # a checkpoint being saved
    (out / f"saved{i}").write_text(signal.Signals(got[0]).name)
    print("saved", flush=True)
    sys.exit(status)
sys.exit(9)
"""


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


@pytest.mark.parametrize("sig, mode, status, expected", [
    (signal.SIGTERM, "save", 0, 0),  # train.py: saves and exits 0, and so does the launcher
    pytest.param(signal.SIGHUP, "save", 5, 5,  # a closed terminal: passed on as SIGTERM; the processes' status
                 marks=pytest.mark.slow),  # (slow: two processes per signal; SIGTERM's case is in the fast tier)
    pytest.param(signal.SIGINT, "save", 0, 130,  # Ctrl-C: passed on as SIGTERM too; the status of an interrupt
                 marks=pytest.mark.slow),
    pytest.param(signal.SIGTERM, "ignore", 0, 128 + signal.SIGKILL,  # a process that does not stop: the second
                 marks=pytest.mark.slow),  # signal kills (slow: it waits out the grace period)
], ids=["SIGTERM", "SIGHUP", "SIGINT", "SIGTERM-twice"])
def test_a_signal_to_the_launcher_stops_every_process(sig, mode, status, expected, tmp_path):
    """The launcher as a real process, and only it signalled (as `kill <pid>` or a scheduler's timeout does): each
    process gets SIGTERM, saves, and the launcher exits with their status after them; none keeps running."""
    (tmp_path / "job.py").write_text(JOB)
    env = dict(os.environ, PYTHONPATH=str(ROOT), CLOVER_JAX_COMPILE_CACHE="off")
    launcher = subprocess.Popen([sys.executable, "-m", "clover_jax.cli.launch", "-n", "2", "--grace", "1",
                                 "--heartbeat-timeout", "1", "--", str(tmp_path / "job.py"), str(tmp_path), mode,
                                 str(status)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids = []
    try:
        t0 = time.monotonic()
        while len(pids) < 2:
            assert launcher.poll() is None and time.monotonic() - t0 < 120, launcher.stdout.read()
            pids = [int((tmp_path / f"pid{i}").read_text()) for i in range(2) if (tmp_path / f"pid{i}").is_file()]
            time.sleep(0.1)
        launcher.send_signal(sig)
        if mode == "ignore":
            time.sleep(2)
            assert launcher.poll() is None and all(map(running, pids))  # waiting for them
            launcher.send_signal(sig)
        log, _ = launcher.communicate(timeout=60)
    finally:
        for pid in pids:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.kill()
        launcher.wait()
    assert launcher.returncode == expected, log
    assert not [pid for pid in pids if running(pid)], log  # no orphan
    assert f"launch: received {sig.name}: passing SIGTERM on to processes 0, 1" in log, log
    if mode == "save":
        assert [(tmp_path / f"saved{i}").read_text() for i in range(2)] == ["SIGTERM", "SIGTERM"]
        assert log.count("saved") == 2
        if status:
            assert f"exited with status {status}" in log
        else:
            assert f"the job stopped on {sig.name}; every process exited with status 0" in log
    else:
        assert "again: killing processes 0, 1 (SIGKILL)" in log and "killed by SIGKILL" in log


LOCK_JOB = """
import sys, time
from pathlib import Path
from clover_jax import parallel
parallel.maybe_initialize_distributed("auto")
import jax
from clover_jax.training.run_lock import RunLockedError, take_run_lock
run, release = Path(sys.argv[1]), Path(sys.argv[2])
try:
    lock = take_run_lock(run)
except RunLockedError as e:
    print("refused:", e, flush=True)
    sys.exit(2)
print(f"holds the lock file: {lock.fd is not None}", flush=True)
while not release.exists():
    time.sleep(0.1)
lock.release()
"""


@pytest.mark.multihost
def test_a_job_of_two_processes_holds_one_lock(tmp_path):
    """Process 0 of a two-process job takes the run folder's lock for the job; both processes of a second job on
    the folder stop with the message naming the first job's process 0."""
    (tmp_path / "job.py").write_text(LOCK_JOB)
    run, release = tmp_path / "run", tmp_path / "release"
    env = dict(os.environ, PYTHONPATH=str(ROOT), CLOVER_JAX_COMPILE_CACHE="off")
    first = subprocess.Popen([sys.executable, "-m", "clover_jax.cli.launch", "-n", "2", "--devices-per-process",
                              "1", "--", str(tmp_path / "job.py"), str(run), str(release)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        held, seen = [], []
        while len(held) < 2:
            line = first.stdout.readline()
            assert line, "".join(seen)
            seen.append(line)
            held += [line] if "holds the lock file" in line else []
        assert sorted(held) == ["[0] holds the lock file: True\n", "[1] holds the lock file: False\n"], held
        holder = json.loads((run / "run.lock").read_text())
        assert holder["processes"] == 2 and list(run.iterdir()) == [run / "run.lock"]
        out = io.StringIO()
        assert launch.launch([str(tmp_path / "job.py"), str(run), str(release)], 2, devices_per_process=1,
                             out=out) == 2
        refused = [line for line in out.getvalue().splitlines() if "refused:" in line]
        assert len(refused) == 2, out.getvalue()
        for line in refused:
            assert f"is in use by another training job: pid {holder['pid']} on host" in line
            assert "(process 0 of a 2-process job)" in line
        release.touch()
        log, _ = first.communicate(timeout=60)
    finally:
        release.touch()
        first.kill()
        first.wait()
    assert first.returncode == 0, log
    assert list(run.iterdir()) == []
