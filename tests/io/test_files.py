"""Files several processes share (`clover_jax.io.files`): two real processes saving choices and calibrations into
one cache at the same moment lose nothing, a third never reads a half-written file, and two first uses of a
tokenizer at once leave one whole folder and no temporary ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from clover_jax.io import files

WRITER = str(Path(__file__).with_name("cache_writer.py"))
ROOT = Path(__file__).resolve().parents[2]
SAVES = 200


def start(*args: str, cache: Path) -> subprocess.Popen:
    env = dict(os.environ, CLOVER_JAX_CACHE=str(cache), PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    return subprocess.Popen([sys.executable, WRITER, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_ready(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        line = p.stdout.readline()
        assert line.strip() == "ready", (line, p.stderr.read()[-3000:] if p.poll() is not None else "")


def finish(p: subprocess.Popen) -> str:
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    return out


def leftovers(folder: Path) -> list[str]:
    """Temporary files and lock files anywhere under `folder`."""
    return [str(p.relative_to(folder)) for p in folder.rglob("*") if p.name.endswith((".tmp", ".lock"))]


@pytest.fixture(scope="module")
def head_folder(tmp_path_factory) -> Path:
    from flax import nnx

    from clover_jax.heads.clover2.model import Clover2Config, Clover2Head
    from clover_jax.heads.export import export_head
    from clover_jax.models.llama import init_llama
    from tiny_llama import TINY_LLAMA

    base = init_llama(TINY_LLAMA, seed=0)
    head = Clover2Head(TINY_LLAMA, Clover2Config(num_heads=2, num_aug_layers=1), rngs=nnx.Rngs(0))
    return export_head(head, tmp_path_factory.mktemp("head") / "head", base=base, base_name="tiny")


@pytest.mark.slow  # starts three processes
def test_two_processes_saving_at_once_lose_nothing(tmp_path, head_folder):
    cache, go, stop = tmp_path / "cache", tmp_path / "go", tmp_path / "stop"
    choices = cache / "calibration" / "choices.json"
    writers = [start("saves", name, str(SAVES), str(head_folder), str(go), cache=cache) for name in ("a", "bb")]
    reader = start("read", str(choices), str(stop), cache=cache)
    wait_ready(writers + [reader])
    go.touch()
    for p in writers:
        assert finish(p).split() == ["done"]
    stop.touch()
    reads = json.loads(finish(reader))
    saved = json.loads(choices.read_text())
    assert sorted(saved) == sorted(f"{n}-{i}" for n in ("a", "bb") for i in range(SAVES))  # nothing dropped
    assert all(saved[f"{n}-{i}"] == {"process": n, "i": i} for n in ("a", "bb") for i in range(SAVES))
    assert reads["reads"] > 0 and reads["bad"] == 0, reads  # no read saw a half-written file
    entries = json.loads((head_folder / "calibration.json").read_text())["entries"]
    assert len(entries) == SAVES and {e["process"] for e in entries.values()} == {"a", "bb"}
    assert leftovers(cache) == [] and leftovers(head_folder) == []
    assert sorted(p.name for p in (cache / "calibration").iterdir()) == ["choices.json"]


@pytest.mark.slow
def test_two_first_uses_of_a_tokenizer_leave_one_folder(tmp_path):
    """SmolLM2's tokenizer converted from its GGUF file by two processes at once: one converts, the other waits and
    reads the folder it wrote; no temporary folder is left."""
    cache, go = tmp_path / "cache", tmp_path / "go"
    procs = [start("tokenizer", str(tmp_path / f"ids{i}.json"), str(go), cache=cache) for i in range(2)]
    wait_ready(procs)
    go.touch()
    for p in procs:
        finish(p)
    ids = [json.loads((tmp_path / f"ids{i}.json").read_text()) for i in range(2)]
    assert ids[0] == ids[1] and len(ids[0]) > 3
    folders = list((cache / "tokenizers").iterdir())
    assert len(folders) == 1 and (folders[0] / "tokenizer.json").is_file(), folders
    assert leftovers(cache) == []


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    path = files.atomic_write_text(tmp_path / "x.json", '{"a": 1}')
    with pytest.raises(TypeError):
        files.atomic_write_bytes(path, "not bytes")  # fails inside the write
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]
    old = files.temporary_name(tmp_path / "x.json")  # a killed writer's temporary file, an hour old
    old.write_text("{")
    os.utime(old, (time.time() - 2 * files.STALE_TEMP_S,) * 2)
    files.update_json(path, lambda d: {**d, "b": 2})
    assert json.loads(path.read_text()) == {"a": 1, "b": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_a_killed_writers_temporaries_are_removed_at_once(tmp_path):
    """A temporary of a writer of this host that no longer runs goes at the next write, however young; one of a
    running writer (this process) or of another host stays until it is old."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    pid = int(dead.stdout)
    path = tmp_path / "x.json"
    mine = files.temporary_name(path)
    killed = mine.with_name(mine.name.replace(f"-{os.getpid()}.", f"-{pid}."))
    other_host = tmp_path / f".x.json.elsewhere-{pid}.0123abcd.tmp"
    for p in (mine, killed, other_host):
        p.mkdir()
    files.atomic_write_text(path, "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["x.json", mine.name, other_host.name])
    with pytest.raises(ValueError, match=r"x\.txt:2: not UTF-8 text \(byte 4 of the line is b'\\xe9'\)"):
        (tmp_path / "x.txt").write_bytes(b"ok\ncaf\xe9\n")
        files.read_text(tmp_path / "x.txt")


def test_a_held_lock_makes_others_wait_and_names_itself_on_timeout(tmp_path):
    path = tmp_path / "f.json"
    order = []
    with files.locked(path):
        assert files.lock_path(path).exists()
        t = threading.Thread(target=lambda: files.update_json(path, lambda d: order.append("second") or {"x": 1}))
        t.start()
        time.sleep(0.2)
        order.append("first")  # the update waited for the lock
        with pytest.raises(TimeoutError, match=r"another process has held the lock .*\.f\.json\.lock"):
            with files.locked(path, timeout=0.3):  # a second open file: waits like another process would
                pass
    t.join(timeout=10)
    assert order == ["first", "second"] and json.loads(path.read_text()) == {"x": 1}
    assert not files.lock_path(path).exists()  # removed by its last holder


def test_building_a_folder_that_another_process_built_first(tmp_path):
    target = tmp_path / "tok"
    with files.building_dir(target) as tmp:
        (tmp / "a.json").write_text("1")
        with files.building_dir(target) as other:  # finishes first
            (other / "a.json").write_text("2")
    assert (target / "a.json").read_text() == "2" and [p.name for p in tmp_path.iterdir()] == ["tok"]
    with pytest.raises(RuntimeError):
        with files.building_dir(tmp_path / "never") as tmp:
            raise RuntimeError("conversion failed")
    assert [p.name for p in tmp_path.iterdir()] == ["tok"]
