"""`bench/bench_precision.py`: float32 products asked explicitly against the backend's default, on the real SmolLM2
and the shipped head. On a CPU both are float32: identical outputs, and speculative equal to autoregressive."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_precision_reports_both_settings(capsys):
    spec = importlib.util.spec_from_file_location("bench_precision", ROOT / "bench" / "bench_precision.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--limit", "1", "--max-new-tokens", "6", "--repeat", "1", "--tree", "chain-2"]) == 0
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| ar") or line.startswith("| spec")}
    assert set(rows) == {"ar", "speculative"}
    for mode, (default_s, asked_s, identical, exact) in rows.items():
        assert float(default_s) > 0 and float(asked_s) > 0
        assert identical == "1/1", (mode, rows)
    assert rows["speculative"][3] == "default 1/1, float32 1/1"
    import jax

    from clover_jax.decoding import autoregressive

    # the caller's precision was chosen inside the benchmark only: afterwards float32 decoding asks for float32 again
    assert jax.config.jax_default_matmul_precision is None
    assert autoregressive.products_precision("float32") == "highest"
