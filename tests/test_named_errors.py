"""Small inputs that used to end in a traceback or be accepted, each now an error naming what is wrong: a binary file
as train.py's config, calibrate's --batch-size 0 / --limit -1 / --max-new-tokens 0 (before the model loads), a file
name where generate takes draft-vocabulary token ids."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from clover_jax.cli import calibrate as calibrate_cli
from clover_jax.validation import InputError, check_draft_vocab

ROOT = Path(__file__).resolve().parents[1]


def test_a_binary_config_file_is_one_error_line(tmp_path):
    config = tmp_path / "weights.bin"
    config.write_bytes(bytes(range(256)) * 4)
    env = dict(os.environ, PYTHONPATH=str(ROOT), CLOVER_JAX_COMPILE_CACHE="off")
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", str(config),
                           "--output-dir", str(tmp_path / "run")], capture_output=True, text=True, env=env,
                          timeout=240, cwd=ROOT)
    lines = [line for line in done.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines == [f"error: {config}: not a YAML text file (byte 128 is not UTF-8 text: invalid start byte); give "
                     "a config such as configs/smollm2-135m-clover2.yaml"], lines
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args, message", [
    (["--batch-size", "0"], "--batch-size: expected an integer >= 1, got 0"),
    (["--limit", "-1"], "--limit: expected an integer >= 1, got -1"),
    (["--max-new-tokens", "0"], "--max-new-tokens: expected an integer >= 1, got 0"),
])
def test_calibrate_refuses_counts_below_one(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("CLOVER_JAX_CACHE", str(tmp_path))
    loaded = []
    monkeypatch.setattr(calibrate_cli, "load_model", lambda *a, **k: loaded.append(a))
    assert calibrate_cli.main(["--quick", *args]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {message}"]
    assert loaded == [] and not (tmp_path / "calibration").exists()  # refused before the model loads


def test_draft_vocab_takes_token_ids_not_a_file_name(tmp_path):
    for path in ("x.json", tmp_path / "draft_vocab.json"):
        with pytest.raises(InputError, match=r"draft_vocab: expected token ids \(a list or 1-D array of ints\), got "
                                             r"the path .*draft_vocab\.load_draft_vocab\(path\)"):
            check_draft_vocab(path, 64)
    for bad, got in (([[1, 2], [3]], "list"), ({"ids": [1, 2]}, "dict"), ([1.0, 2.0], "shape (2,) of float64"),
                     ([], "shape (0,) of float64"), (7, "int 7")):
        with pytest.raises(InputError, match=r"draft_vocab: expected a non-empty 1-D list or array of token ids "
                                             rf"\(ints\), got {got[:4]}"):
            check_draft_vocab(bad, 64)
    np.testing.assert_array_equal(check_draft_vocab([5, 3, 9], 64), [3, 5, 9])


def test_generate_names_a_draft_vocab_file_name_before_anything_runs():
    import clover_jax
    from flax import nnx

    from clover_jax.models.llama import Llama
    from tiny_llama import TINY_LLAMA

    model = nnx.eval_shape(lambda: Llama(TINY_LLAMA, rngs=nnx.Rngs(0)))  # shapes only: the check needs no weights
    with pytest.raises(InputError, match="draft_vocab: expected token ids .* got the path 'x.json'"):
        clover_jax.generate(model, [[3, 4, 5]], max_new_tokens=4, draft_vocab="x.json")
