"""The local launcher and the environment it hands each process, without JAX processes: a process's place in the
job read back from the environment, bad settings named, a failing process reported with its status and the
others stopped."""

from __future__ import annotations

import io
import sys

import pytest

from clover_jax import parallel
from clover_jax.cli import launch
from clover_jax.validation import InputError

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
