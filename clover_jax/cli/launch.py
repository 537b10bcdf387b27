"""Run one command as N cooperating JAX processes on this machine: the local stand-in for a multi-host job.

  python -m clover_jax.cli.launch -n 2 --devices-per-process 4 -- train.py --config configs/x.yaml
  python -m clover_jax.cli.launch -n 2 --devices-per-process 4 -- train.py --config configs/x.yaml --resume

Every process runs the same command with its place in the job in its environment (`JAX_COORDINATOR_ADDRESS` =
127.0.0.1:PORT, `CLOVER_NUM_PROCESSES`, `CLOVER_PROCESS_ID`; `clover_jax.parallel.maybe_initialize_distributed`
reads them), so `train.py` forms one mesh over the devices of all processes, exactly as on a TPU pod, where every
host runs the command itself (`gcloud compute tpus tpu-vm ssh NAME --worker=all --command "..."`, docs/training.md)
and JAX finds the hosts on its own. `--devices-per-process K` gives each process K simulated CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=K`); CPU processes exchange collectives through gloo.

Output lines are prefixed with the process index. When a process fails or is killed, JAX's coordination service
stops the others after its heartbeat timeout (`--heartbeat-timeout`); should one still be running `--grace`
seconds after that, the launcher stops it (SIGTERM, then SIGKILL). The exit status is the first failure's (a
process killed by a signal counts as 128 + the signal), 0 when all succeed.

SIGTERM, SIGHUP or SIGINT (Ctrl-C) to the launcher (a scheduler's `timeout`, a preemption notice, a closed terminal)
is passed on to every process as SIGTERM: `train.py` saves a checkpoint and exits 0, the launcher waits for them and
exits with their status (0; 130 after Ctrl-C), and `--resume` continues the job. A second signal kills them. The
processes run in a process group of their own, so a terminal's signals reach them through the launcher only.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

from clover_jax.cli import add_debug_argument, run_cli
from clover_jax.parallel import HEARTBEAT_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV
from clover_jax.validation import InputError, check_float, check_int


MAX_PROCESSES = 64  # processes of one job on one machine
MAX_DEVICES = 1024  # simulated devices per process


def free_port() -> int:
    """A TCP port nobody listens on now (the coordinator's)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command_line(command: Sequence[str]) -> list[str]:
    """`train.py ...` and `-m module ...` run with this Python; anything else as it is."""
    command = list(command)
    if not command:
        raise InputError("no command to launch: give it after --, e.g. -- train.py --config configs/x.yaml")
    if command[0] == "-m" or command[0].endswith(".py"):
        return [sys.executable, *command]
    return command


def process_env(index: int, count: int, port: int, devices: int | None, heartbeat: int,
                base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update({"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", NUM_PROCESSES_ENV: str(count),
                PROCESS_ID_ENV: str(index), HEARTBEAT_ENV: str(heartbeat), "PYTHONUNBUFFERED": "1"})
    if devices:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(prefix + line)
        out.flush()
    stream.close()


def describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


_FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class _Signals:
    """While installed (main thread only): SIGTERM, SIGHUP and SIGINT to the launcher are passed on to every
    process still running as SIGTERM (each saves a checkpoint and exits); a second one kills them (SIGKILL)."""

    def __init__(self, procs, out):
        self.procs, self.out, self.received, self.messages = procs, out, [], []
        self.old = {}

    def install(self) -> "_Signals":
        if threading.current_thread() is threading.main_thread():
            self.old = {s: signal.signal(s, self.handle) for s in _FORWARDED}
        return self

    def restore(self) -> None:
        for s, h in self.old.items():
            signal.signal(s, h)
        self.old = {}

    def handle(self, signum, frame) -> None:  # noqa: ARG002
        self.received.append(signum)
        running = [(i, p) for i, p in enumerate(self.procs) if p.poll() is None]
        name, which = signal.Signals(signum).name, ", ".join(str(i) for i, _ in running) or "(none running)"
        if len(self.received) == 1:
            self.messages.append(f"launch: received {name}: passing SIGTERM on to processes {which}; waiting for "
                                 "them to save and exit (send it again to kill them)")
            for _, p in running:
                p.send_signal(signal.SIGTERM)
        else:
            self.messages.append(f"launch: received {name} again: killing processes {which} (SIGKILL)")
            for _, p in running:
                p.kill()

    def report(self) -> None:
        """Writes what the handler did (not from the handler itself: it may interrupt a write to `out`)."""
        while self.messages:
            self.out.write(self.messages.pop(0) + "\n")
            self.out.flush()


def launch(command: Sequence[str], num_processes: int, *, devices_per_process: int | None = None,
           port: int | None = None, heartbeat_timeout: int = 30, grace: float = 30.0, out=None) -> int:
    """Runs `command` as `num_processes` processes of one JAX job; returns the job's exit status (above)."""
    out = out or sys.stdout
    argv = command_line(command)
    port = port or free_port()
    procs, pumps = [], []
    signals = _Signals(procs, out).install()
    try:
        for i in range(num_processes):
            if signals.received:  # stopped while starting: start no more
                break
            # a process group of their own: a terminal's Ctrl-C or hang-up reaches the launcher alone, which passes
            # it on as SIGTERM (a hang-up would kill the processes before they save)
            p = subprocess.Popen(argv, env=process_env(i, num_processes, port, devices_per_process,
                                                       heartbeat_timeout),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                 process_group=0)
            procs.append(p)
            t = threading.Thread(target=_pump, args=(p.stdout, f"[{i}] ", out), daemon=True)
            t.start()
            pumps.append(t)
        first, failed_at, ended = _wait(procs, out, heartbeat_timeout, grace, signals)
    except BaseException:
        _stop([p for p in procs if p.poll() is None], out)
        raise
    finally:
        signals.restore()
        signals.report()
    for t in pumps:
        t.join(timeout=5)
    if first is None:
        first = next(((i, p.returncode) for i, p in enumerate(procs) if p.returncode), None)
    if first is None:
        if signals.received:
            out.write(f"launch: the job stopped on {signal.Signals(signals.received[0]).name}; every process "
                      "exited with status 0\n")
            out.flush()
            return 130 if signals.received[0] == signal.SIGINT else 0
        return 0
    i, code = first
    others = [f"process {j} {describe(p.returncode)}" for j, p in enumerate(procs) if j != i]
    after = f", {ended - failed_at:.1f} s after it" if failed_at is not None else ""
    out.write(f"launch: the job failed: process {i} {describe(code)}" + (f"; {', '.join(others)}{after}" if others
                                                                          else "") + "\n")
    out.flush()
    return 128 - code if code < 0 else code


def _wait(procs, out, heartbeat_timeout: int, grace: float,
          signals: _Signals) -> tuple[tuple[int, int] | None, float | None, float]:
    """Waits for every process; stops those still running `heartbeat_timeout + grace` s after the first failure.
    Returns ((process, status) of the first failure or None, when it failed, when the last one ended)."""
    first: tuple[int, int] | None = None
    deadline = failed_at = None
    while any(p.poll() is None for p in procs):
        signals.report()
        for i, p in enumerate(procs):
            code = p.poll()
            if code not in (None, 0) and first is None:
                first, failed_at = (i, code), time.monotonic()
                deadline = failed_at + heartbeat_timeout + grace
                out.write(f"launch: process {i} {describe(code)}; the others stop within the heartbeat "
                          f"timeout ({heartbeat_timeout} s)\n")
        if deadline is not None and time.monotonic() > deadline:
            _stop([p for p in procs if p.poll() is None], out)
        time.sleep(0.2)
    return first, failed_at, time.monotonic()


def _stop(procs, out) -> None:
    for p in procs:
        out.write(f"launch: stopping process pid {p.pid} (SIGTERM)\n")
        p.terminate()
    t0 = time.monotonic()
    while any(p.poll() is None for p in procs) and time.monotonic() - t0 < 10:
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--num-processes", type=int, required=True, help="processes in the job")
    ap.add_argument("--devices-per-process", type=int, default=None, metavar="K",
                    help="simulated CPU devices per process (XLA_FLAGS); default: the machine's own devices")
    ap.add_argument("--port", type=int, default=None, help="the coordinator's port (default: a free one)")
    ap.add_argument("--heartbeat-timeout", type=int, default=30,
                    help="seconds after which the others stop when a process dies (JAX's coordination service)")
    ap.add_argument("--grace", type=float, default=30.0,
                    help="seconds past the heartbeat timeout before the launcher stops what still runs")
    add_debug_argument(ap)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command every process runs")
    args = ap.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    return args


def check_args(args) -> None:
    """Every setting in range, the script there and the port free: an `InputError` naming the first that is not."""
    check_int("--num-processes", args.num_processes, minimum=1, maximum=MAX_PROCESSES)
    if args.devices_per_process is not None:
        check_int("--devices-per-process", args.devices_per_process, minimum=1, maximum=MAX_DEVICES)
    check_int("--heartbeat-timeout", args.heartbeat_timeout, minimum=1)
    check_float("--grace", args.grace, minimum=0)
    if args.port is not None:
        check_int("--port", args.port, minimum=1, maximum=65535)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", args.port))
            except OSError as e:
                raise InputError(f"--port {args.port}: cannot be the coordinator's port ({e.strerror}); leave it "
                                 "out to use a free one") from None
    argv = command_line(args.command)
    script = next((a for a in argv[1:2] if a.endswith(".py")), None) if argv[0] == sys.executable else None
    if script is not None and not os.path.isfile(script):
        raise InputError(f"{script}: no such script to launch (from {os.getcwd()})")


def _main(argv=None) -> int:
    args = parse_args(argv)
    check_args(args)
    return launch(args.command, args.num_processes, devices_per_process=args.devices_per_process, port=args.port,
                  heartbeat_timeout=args.heartbeat_timeout, grace=args.grace)


def main(argv=None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
