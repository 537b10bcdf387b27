"""The quickstart notebook runs end to end (tiny budget: 2 training steps, 16 new tokens)."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_quickstart_notebook_executes(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    env = {"CLOVER_QUICKSTART_STEPS": "2", "CLOVER_QUICKSTART_TOKENS": "16",
           "CLOVER_QUICKSTART_HEAD": str(tmp_path / "no-head-yet"),
           "XLA_FLAGS": ""}  # the kernel sees one CPU device, as a user's notebook does (not the 8 test devices)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        # the notebook trains into runs/quickstart relative to its working directory: use a scratch copy
        work = tmp_path / "work"
        work.mkdir()
        (work / "configs").symlink_to(ROOT / "configs")
        client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                         resources={"metadata": {"path": str(work)}})
        client.execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "tau =" in outputs and "trained 2 steps" in outputs
    assert (work / "runs" / "quickstart").is_dir()
