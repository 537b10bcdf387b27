"""The top-level scripts: infer.py generates from the real model; train.py reports bad configs in one line."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import infer  # noqa: E402
import train  # noqa: E402

from clover_jax.cli import infer as infer_cli  # noqa: E402
from clover_jax.compile_cache import CompileCounter  # noqa: E402

_LOADED: dict = {}


@pytest.fixture(autouse=True)
def _load_each_model_once(monkeypatch):
    """infer.py loads its model on every call; here each (model, dtype, mesh) is read once for the module (the
    loading itself is tested in tests/io)."""
    real = infer_cli.load_model

    def load_model(name, **kw):
        key = (str(name), repr(sorted(kw.items())))
        if key not in _LOADED:
            _LOADED[key] = real(name, **kw)
        return _LOADED[key]

    monkeypatch.setattr(infer_cli, "load_model", load_model)


@pytest.mark.slow
def test_infer_prints_answer_and_speed(capsys):
    assert infer.main(["--prompt", "What is the capital of France?", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out and "tokens/s" in out


def test_infer_needs_a_prompt_and_a_head(capsys, tmp_path):
    assert infer.main([]) == 2
    # a model with no shipped head: speculative decoding needs --head (before anything is loaded)
    assert infer.main(["--prompt", "hi", "--mode", "speculative", "--model", str(tmp_path / "my-model")]) == 2
    err = capsys.readouterr().err
    assert "needs --head" in err and "smollm2-135m-instruct-clover2" in err


@pytest.mark.slow
def test_infer_speculative_chooses_what_is_fastest_here(capsys):
    """`--mode speculative` with no head and no tree: the default head's tree against plain decoding, measured on
    first use on the request's own shapes and printed in one line; the request then runs the program the measurement
    compiled (one speculative loop compiled in all); the answer is plain decoding's. `--tree default` drafts with the
    shipped head's registered tree, measuring nothing."""
    argv = ["--prompt", "What is the capital of France?", "--max-new-tokens", "24"]
    assert infer.main(argv) == 0
    ar = capsys.readouterr().out.split("### prompt 0:")[1].split("\nar: ")[0].strip()
    with CompileCounter() as count:  # plain decoding's loop on these shapes is compiled already (above)
        assert infer.main(argv + ["--mode", "speculative"]) == 0
    built = count.compiled + count.loaded  # compiled, or read from the suite's compile cache
    assert built["speculative_loop"] == 1 and built["autoregressive_loop"] == 0
    captured = capsys.readouterr()
    assert "clover_jax: choosing the draft tree for cpu" in captured.err and "2 runs compiled" in captured.err
    assert ("chose " in captured.err and "predicted" in captured.err) or "plain autoregressive decoding" in captured.err
    assert "Paris" in captured.out and ar in captured.out
    assert infer.main(argv + ["--mode", "speculative", "--tree", "default"]) == 0
    captured = capsys.readouterr()
    assert "choosing" not in captured.err and "shipped head smollm2-135m-instruct-clover2" in captured.err
    from clover_jax.heads.draft_vocab import head_draft_vocab

    n = len(head_draft_vocab("smollm2-135m-instruct-clover2"))
    assert f"drafting from the head's {n}-token training vocabulary" in captured.err
    assert "Paris" in captured.out and "tau = " in captured.out


@pytest.mark.slow
def test_infer_names_a_fitted_tree_of_the_shipped_head(capsys):
    """`--tree fit-5-411aab+lookup-6-table` with no --head: the shipped head drafts, its calibration naming the
    fitted tree (before, the tree was looked up before the head was known, and unknown)."""
    assert infer.main(["--prompt", "What is the capital of France?", "--max-new-tokens", "24", "--mode",
                       "speculative", "--tree", "fit-5-411aab+lookup-6-table"]) == 0
    captured = capsys.readouterr()
    assert "shipped head smollm2-135m-instruct-clover2" in captured.err
    assert "Paris" in captured.out and "tau = " in captured.out


@pytest.mark.slow
def test_infer_streams_the_reply(capsys):
    """`--stream` prints the reply while it is generated: the same answer, then the speed summary."""
    assert infer.main(["--prompt", "What is the capital of France?", "--max-new-tokens", "12", "--mode",
                       "speculative", "--tree", "default", "--stream"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out and "tokens/s" in out and "### prompt 0" in out
    assert infer.main(["--prompt", "hi", "--stream", "--batch-size", "2"]) == 2
    assert "--stream: prints one reply at a time" in capsys.readouterr().err


@pytest.mark.slow
def test_infer_lookup_table_without_a_head(capsys):
    """`--tree lookup-4-table` with no head drafts from the model's shipped head's n-gram table, exactly."""
    argv = ["--prompt", "List three prime numbers.", "--max-new-tokens", "32"]
    assert infer.main(argv) == 0
    ar = capsys.readouterr().out.split("### prompt 0:")[1].split("\nar: ")[0].strip()
    assert infer.main(argv + ["--mode", "speculative", "--tree", "lookup-4-table"]) == 0
    out, err = capsys.readouterr()
    assert "n-gram table of the shipped head smollm2-135m-instruct-clover2" in err
    assert out.split("### prompt 0:")[1].split("\n[tau")[0].strip() == ar and len(ar) > 40


@pytest.mark.slow  # the real SmolLM2 on an 8-device mesh
def test_infer_on_a_mesh_answers_as_on_one_device(capsys):
    """The README's example prompt: `--mesh tp=8` (8 simulated devices) prints the `--mesh tp=1` answer."""
    argv = ["--prompt", "What is the capital of France?", "--max-new-tokens", "24", "--mode", "speculative",
            "--tree", "default"]
    answers = {}
    for mesh in ("tp=1", "tp=8"):
        assert infer.main(argv + ["--mesh", mesh]) == 0
        out, err = capsys.readouterr()
        assert f"decoding on a mesh" in err and "tau =" in out
        answers[mesh] = out.split("### prompt 0:")[1].split("\nspeculative:")[0]
    assert "Paris" in answers["tp=1"]
    assert answers["tp=8"] == answers["tp=1"]
    assert infer.main(argv + ["--mesh", "tp=16"]) == 2
    assert "16 devices asked for" in capsys.readouterr().err


def test_train_unknown_key_is_one_line_error(capsys):
    code = train.main(["--config", str(ROOT / "configs" / "smollm2-135m-clover2.yaml"), "--set", "optim.lrr=1e-3"])
    err = capsys.readouterr().err
    assert code == 2 and "optim.lrr" in err and "did you mean 'optim.lr'" in err and "Traceback" not in err


@pytest.mark.slow  # starts four processes
def test_compile_cache_is_written_and_can_be_turned_off(tmp_path):
    """The CLI tools' persistent compilation cache: a compiled function lands in the folder
    `CLOVER_JAX_COMPILE_CACHE` names (default: `xla/` under `CLOVER_JAX_CACHE`); `off` leaves JAX's cache unset; a
    cache configured through JAX wins. Run in fresh interpreters
    (the cache is process-wide configuration)."""
    import os
    import subprocess

    code = ("import jax, jax.numpy as jnp; from clover_jax.cli import enable_compile_cache; "
            "jax.config.update('jax_persistent_cache_min_compile_time_secs', 0); d = enable_compile_cache(); "
            "jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3)).block_until_ready(); print(d)")

    def run(**env):
        drop = ("JAX_COMPILATION_CACHE_DIR", "CLOVER_JAX_COMPILE_CACHE", "CLOVER_JAX_CACHE")
        full = {k: v for k, v in os.environ.items() if k not in drop} | env
        return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                              check=True).stdout.strip().splitlines()[-1]

    folder = tmp_path / "xla"
    assert run(CLOVER_JAX_COMPILE_CACHE=str(folder)) == str(folder)
    assert any(folder.iterdir())  # the compiled function was stored
    assert run(CLOVER_JAX_CACHE=str(tmp_path / "root")) == str(tmp_path / "root" / "xla")
    assert run(CLOVER_JAX_COMPILE_CACHE="off") == "None"
    theirs = tmp_path / "theirs"
    assert run(CLOVER_JAX_COMPILE_CACHE=str(folder), JAX_COMPILATION_CACHE_DIR=str(theirs)) == str(theirs)
