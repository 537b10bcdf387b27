"""One process of tests/io/test_files.py: saves to the shared cache files as fast as it can, at the same moment as
another process.

  python tests/io/cache_writer.py saves NAME COUNT HEAD_FOLDER GO_FILE   # COUNT choices and COUNT/2 calibrations
  python tests/io/cache_writer.py tokenizer OUT_FILE GO_FILE              # the first use of SmolLM2's tokenizer
  python tests/io/cache_writer.py read FILE STOP_FILE                     # reads FILE until STOP_FILE appears

Each prints "ready" when its imports are done, then waits for GO_FILE, so the writers start together.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def wait_for(go: Path) -> None:
    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.002)


def saves(name: str, count: int, head: str, go: Path) -> None:
    from clover_jax.generation.calibration import entry_key, save_entry
    from clover_jax.tuning.choose import save_choice

    wait_for(go)
    for i in range(count):
        assert save_choice(f"{name}-{i}", {"process": name, "i": i}) is not None
        if i % 2 == 0:
            assert save_entry(head, entry_key("test-cpu", "float32", 1000 * len(name) + i),
                              {"best": "chain-3", "process": name, "version": 99}) is not None
    print("done", flush=True)


def tokenizer(out: Path, go: Path) -> None:
    from clover_jax.io.loader import load_tokenizer
    import transformers  # noqa: F401 (imported before the start, as load_tokenizer would)

    wait_for(go)
    tok = load_tokenizer("smollm2-135m-instruct")
    out.write_text(json.dumps(tok.encode("Two processes at once.")))


def read(path: Path, stop: Path) -> None:
    """Counts the reads of `path` that were not a whole JSON object (a file replaced in one rename never is)."""
    reads = bad = 0
    print("ready", flush=True)
    while not stop.exists():
        try:
            text = path.read_text()
        except FileNotFoundError:
            continue
        reads += 1
        try:
            assert isinstance(json.loads(text), dict)
        except (ValueError, AssertionError):
            bad += 1
    print(json.dumps({"reads": reads, "bad": bad}), flush=True)


if __name__ == "__main__":
    what, *args = sys.argv[1:]
    if what == "saves":
        saves(args[0], int(args[1]), args[2], Path(args[3]))
    elif what == "tokenizer":
        tokenizer(Path(args[0]), Path(args[1]))
    else:
        read(Path(args[0]), Path(args[1]))
