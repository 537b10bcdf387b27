"""Files that several processes may write at once (the user cache's calibrations, choices and tokenizers): each
written whole or not at all, and a read-modify-write that loses no other process's update.

    atomic_write_text(path, text)               # a temporary file of a unique name beside `path`, renamed over it
    with locked(path):                          # an exclusive fcntl lock on `.<name>.lock` beside `path`
        ...
    update_json(path, lambda data: {**data, key: entry})   # both: read, change and write under the lock
    with building_dir(target) as tmp:           # a folder built under a unique temporary name, renamed into place
        tokenizer.save_pretrained(tmp)
    fd, locks = open_lock_file(lock, busy)      # the lock under `locked` (and under a training run's lock)

A reader needs no lock: a file is replaced in one rename, so it sees the old contents or the new, never a mix. The
lock file exists only while it is held (removed before it is released; a waiter that then holds the removed file
opens the new one), so a folder keeps no lock files behind, and a process killed while holding the lock releases it
(the kernel drops a dead process's locks). Where the filesystem has no locks (`ENOLCK`, some network mounts), the
writes go ahead unlocked and stay whole. Nothing here is fsynced: the job is concurrent writers, not power loss.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gzip
import json
import os
import secrets
import shutil
import socket
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

from clover_jax.validation import InputError

LOCK_TIMEOUT_S = 60.0  # a lock is held for one read-modify-write (milliseconds) or one tokenizer conversion
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # flock on a filesystem without locks
STALE_TEMP_S = 3600.0  # a temporary file or folder this old is a killed writer's: removed by the next writer


def _writer() -> str:
    """This process as a temporary name spells it: `<host>-<pid>` (dots in the host name as underscores)."""
    return f"{socket.gethostname().replace('.', '_')}-{os.getpid()}"


def temporary_name(path: Path) -> Path:
    """A name beside `path` that no other writer uses (`.<name>.<host>-<pid>.<random>.tmp`)."""
    return path.with_name(f".{path.name}.{_writer()}.{secrets.token_hex(4)}.tmp")


def _dead_writer(path: Path, tmp: Path) -> bool:
    """Whether `tmp` (a `temporary_name` of `path`) was made by a process of this host that no longer runs."""
    writer = tmp.name[len(path.name) + 2:-len(".tmp")].rsplit(".", 1)[0]  # <host>-<pid>
    host, _, pid = writer.rpartition("-")
    if host != _writer().rpartition("-")[0] or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # it runs, under another user
        return False
    return False


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Writes `data` to `path` whole or not at all: into a temporary file of a unique name in the same folder,
    renamed over `path` (the folder is created). The file gets the permissions of any new file (the umask's)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    tmp = temporary_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def lock_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}.lock")


def open_lock_file(lock: Path, busy: Callable[[int], None], mode: int = 0o666) -> tuple[int, bool]:
    """Opens the lock file `lock` (created) and takes its exclusive fcntl lock: `(fd, True)`, the file held, or
    `(fd, False)` where the filesystem has no locks (the file open, unlocked). While another process holds it,
    `busy(fd)` is called with the file open (closed after it): it raises to give up, or returns to try again. A
    holder removes the file before it unlocks (`close_lock_file`), so a file that is no longer at `lock` once locked
    is closed and the one there now opened."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locks = True
        except BlockingIOError:
            try:
                busy(fd)
            finally:
                os.close(fd)
            continue
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                os.close(fd)
                raise
            locks = False
        try:  # the file may have been removed (and made anew) by the holder before us: then lock the new one
            same = os.path.samestat(os.fstat(fd), os.stat(lock))
        except FileNotFoundError:
            same = False
        if same:
            return fd, locks
        os.close(fd)


def close_lock_file(fd: int, lock: Path) -> None:
    """Releases a lock `open_lock_file` took: removes the file while still holding it (a waiter on it then sees it
    is gone and opens the new one) and closes it, which unlocks."""
    with contextlib.suppress(OSError):
        if os.path.samestat(os.fstat(fd), os.stat(lock)):
            os.unlink(lock)
    os.close(fd)


@contextlib.contextmanager
def locked(path: str | os.PathLike, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Holds the exclusive lock of `path` (a file or folder that need not exist yet) inside the block; other
    processes locking the same path wait. A `TimeoutError` (an `OSError`) names the lock after `timeout` s."""
    lock = lock_path(path)
    lock.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    pause = 0.001

    def wait(fd: int) -> None:
        nonlocal pause
        if time.monotonic() > deadline:
            raise TimeoutError(errno.ETIMEDOUT, f"another process has held the lock {lock} for over "
                               f"{timeout:.0f} s") from None
        time.sleep(pause)
        pause = min(2 * pause, 0.05)

    fd, locks = open_lock_file(lock, wait)
    if not locks:
        os.close(fd)
        yield  # a filesystem without locks: the writes stay whole, concurrent updates may be lost
        return
    try:
        yield
    finally:
        close_lock_file(fd, lock)


def read_json_object(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON object file's contents, or {} where it is missing, unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _not_utf8(path, line: int, raw: bytes, e: UnicodeDecodeError) -> InputError:
    return InputError(f"{path}:{line}: not UTF-8 text (byte {e.start + 1} of the line is {raw[e.start:e.start + 1]!r}); "
                      "save the file as UTF-8")


def text_lines(path: str | os.PathLike, *, gz: bool = False) -> Iterator[tuple[int, str]]:
    """`(line number, line)` of a UTF-8 text file (gzip-compressed when `gz`), read as it goes; an `InputError`
    naming the file and the line where the bytes are not UTF-8 or the compressed stream is cut or garbled."""
    try:
        with (gzip.open(path, "rb") if gz else open(path, "rb")) as f:
            for n, raw in enumerate(f, 1):
                try:
                    yield n, raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise _not_utf8(path, n, raw, e) from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise InputError(f"{path}: not a whole gzip file ({type(e).__name__}: {e})") from None


def read_text(path: str | os.PathLike) -> str:
    """A UTF-8 text file's contents; an `InputError` naming the file and the line where the bytes are not UTF-8."""
    raw = Path(path).read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line_start = raw.rfind(b"\n", 0, e.start) + 1
        err = UnicodeDecodeError(e.encoding, e.object, e.start - line_start, e.end - line_start, e.reason)
        raise _not_utf8(path, raw.count(b"\n", 0, e.start) + 1, raw[line_start:], err) from None


def update_json(path: str | os.PathLike, change: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """Reads the JSON object file `path` ({} if missing or unreadable), applies `change` and writes the result
    whole, all under `path`'s lock: two processes updating the same file at once both keep their change. Returns
    what was written; an `OSError` where the file cannot be written."""
    with locked(path):
        data = change(read_json_object(path))
        atomic_write_text(path, json.dumps(data, indent=1) + "\n")
        return data


def remove_stale_temporaries(path: Path, age: float = STALE_TEMP_S) -> None:
    """Removes the temporary files and folders of `path` (`temporary_name`) that a writer killed before its rename
    left: those of a process of this host that no longer runs, and any older than `age` s (another host's)."""
    now = time.time()
    for p in path.parent.glob(f".{path.name}.*.tmp"):
        with contextlib.suppress(OSError):
            if _dead_writer(path, p) or now - p.lstat().st_mtime > age:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


@contextlib.contextmanager
def building_dir(target: str | os.PathLike) -> Iterator[Path]:
    """Yields an empty folder of a unique temporary name beside `target`, renamed to `target` when the block ends
    (when `target` appeared meanwhile, another process built it: the temporary folder is removed). On an error
    inside the block the temporary folder is removed and nothing appears at `target`."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target)
    tmp = temporary_name(target)
    tmp.mkdir()
    try:
        yield tmp
        try:
            os.rename(tmp, target)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) and not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["atomic_write_bytes", "atomic_write_text", "building_dir", "close_lock_file", "lock_path", "locked",
           "open_lock_file", "read_json_object", "read_text", "remove_stale_temporaries", "temporary_name",
           "text_lines", "update_json"]
