"""One training job per run folder: `<run_dir>/run.lock`, held from the start of a run to its end.

    lock = take_run_lock(run_dir)   # a second job on the folder stops here with a RunLockedError
    try:
        ...train...
    finally:
        lock.release()

The file says who holds it (pid, host, start time, command) and is locked (fcntl) by that process while it runs. A
second job on the same folder finds it locked and stops with a `RunLockedError` naming the first job (`train.py`:
one `error: ...` line, exit status 2) before it writes anything. A job that ends removes the file. One that was
killed (SIGKILL, a crash, the machine's OOM killer) leaves the file but not the lock, as the kernel drops a dead
process's locks: the next job takes it over, with a warning naming the job it replaces. Where the lock cannot tell
(a filesystem without locks, or a network filesystem and a file written on another host) the pid decides on the
same host (a job whose process is gone is taken over), and a file from another host is refused with a message
saying to delete it if that job no longer runs.

A multi-host job holds one lock: process 0 takes it and every process learns the outcome (a broadcast), so all of
them stop, with the same message, when the folder is in use.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from clover_jax.io.files import close_lock_file, open_lock_file
from clover_jax.validation import InputError

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
# filesystems on this machine's own disks or memory: a lock on them is seen by every process that can open the file
_LOCAL_FILESYSTEMS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs", "jfs", "reiserfs",
                      "bcachefs", "ramfs"}


class RunLockedError(InputError):
    """The run folder is in use by another training job (or may be: its lock file came from another host)."""


def describe(holder: dict) -> str:
    """'pid 123 on host h (process 0 of a 2-process job), running since 2025-01-02 03:04:05 +0000: train.py ...'"""
    if not holder.get("pid"):
        return "a job that is starting (its lock file is still empty)"
    job = f" (process 0 of a {holder['processes']}-process job)" if int(holder.get("processes", 1)) > 1 else ""
    return (f"pid {holder['pid']} on host {holder.get('host', '?')}{job}, running since {holder.get('since', '?')}: "
            f"{holder.get('command', '?')}")


def _alive(pid: int) -> bool:
    """Whether process `pid` of this host runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def _local_filesystem(path: Path) -> bool:
    """Whether `path` is on a filesystem of this machine (/proc/self/mountinfo), where a lock is authoritative."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return False
    real, best, kind = os.path.realpath(path), "", ""
    for line in mounts:
        fields, _, rest = line.partition(" - ")
        point = fields.split()[4].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, rest.split()[0]
    return kind in _LOCAL_FILESYSTEMS


def _read_holder(fd: int) -> dict:
    try:
        data = json.loads(os.pread(fd, 1 << 16, 0).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _holder_info() -> dict:
    command = " ".join([Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python", *sys.argv[1:]])
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "started": time.time(), "processes": jax.process_count(), "command": command}


@dataclasses.dataclass
class RunLock:
    """A held run lock (`fd` None: held by another process of this job, nothing to release here)."""

    path: Path | None = None
    fd: int | None = None

    def release(self) -> None:
        """Removes the lock file (while still holding it, so a job waiting on it opens a new one) and unlocks."""
        if self.fd is None:
            return
        close_lock_file(self.fd, self.path)
        self.fd = None


def acquire(run_dir: str | os.PathLike) -> RunLock:
    """Takes `<run_dir>/run.lock` for this process (the folder is created); a `RunLockedError` naming the job that
    holds it where another one does (see the module docstring)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE

    def in_use(fd: int) -> None:  # another job holds the lock: no waiting
        holder = {}
        for _ in range(20):  # a job that has just taken the lock writes its name right after
            holder = _read_holder(fd)
            if holder.get("pid"):
                break
            time.sleep(0.05)
        raise RunLockedError(f"{run_dir} is in use by another training job: {describe(holder)}; wait for it to "
                             "end or stop it (SIGTERM: it saves a checkpoint and exits), or choose another "
                             "--output-dir") from None

    fd, locks = open_lock_file(path, in_use, mode=0o644)
    lock = RunLock(path, fd)
    previous = _read_holder(fd)
    if previous.get("pid"):
        here = previous.get("host") == socket.gethostname()
        if (locks and (here or _local_filesystem(run_dir))) or (here and not _alive(int(previous["pid"]))):
            log.warning("%s: taking over the lock of a training job that no longer runs (%s)", path,
                        describe(previous))
        else:
            os.close(fd)
            where = "another host, whose processes cannot be checked from here" if not here else "a running process"
            raise RunLockedError(f"{run_dir} may be in use by another training job: {describe(previous)} ({where}); "
                                 f"if that job no longer runs, delete {path}")
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(_holder_info()) + "\n").encode("utf-8"), 0)
    return lock


def _broadcast_text(text: str, size: int = 2048) -> str:
    """Process 0's `text` on every process of the job."""
    buf = np.zeros(size, np.uint8)
    data = text.encode("utf-8")[:size]
    buf[:len(data)] = np.frombuffer(data, np.uint8)
    out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return bytes(out.astype(np.uint8)).rstrip(b"\0").decode("utf-8", errors="replace")


def take_run_lock(run_dir: str | os.PathLike) -> RunLock:
    """The job's lock of `run_dir`: taken by this process, or in a multi-host job by process 0, every process
    raising the same `RunLockedError` when the folder is in use."""
    if jax.process_count() == 1:
        return acquire(run_dir)
    lock, error = RunLock(), None
    if jax.process_index() == 0:
        try:
            lock = acquire(run_dir)
        except Exception as e:  # noqa: BLE001 - every process must hear of it, then process 0 raises it
            error = e
    # "L<message>": the folder is in use; "E<message>": process 0 could not take the lock for another reason
    message = _broadcast_text("" if error is None else
                              ("L" if isinstance(error, RunLockedError) else "E") + str(error))
    if error is not None:
        raise error
    if message:
        if message[0] == "L":
            raise RunLockedError(message[1:])
        raise InputError(f"{run_dir}: process 0 could not take the run folder's lock: {message[1:]}")
    return lock


__all__ = ["LOCK_FILE", "RunLock", "RunLockedError", "acquire", "describe", "take_run_lock"]
