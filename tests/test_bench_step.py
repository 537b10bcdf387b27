"""`bench/bench_step.py` runs for every registered head type and reports every part of a step (tiny shapes)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("head_type,tree,nodes", [("clover2", "chain-2", 3), ("medusa", "chain-2", 3),
                                                  ("redrafter", "beam-2x3", 5), ("clover1", "dynamic-4-d2-k2-p0.9", 4),
                                                  ("eagle", "dynamic-4-d2-k2", 4)])
def test_bench_step_reports_each_part(head_type, tree, nodes, capsys):
    spec = importlib.util.spec_from_file_location("bench_step", ROOT / "bench" / "bench_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--shape", "tiny", "--head-type", head_type, "--trees", tree, "--draft-vocab", "64",
                     "--context", "12", "--cache-size", "128", "--repeat", "1", "--loop-tokens", "2", "6",
                     "--loop-repeat", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = report["trees"][tree]
    assert report["head_type"] == head_type
    for part in ("spec: draft", "spec: verify forward + KV write", "spec: logits", "spec: acceptance",
                 "spec: KV compaction", "spec: head commit", "ar: forward + KV append"):
        assert rows[part] > 0, (part, rows)
    # ms per step from a difference of two tiny runs: present and finite (its sign is timing noise at this size)
    assert all(abs(rows[k]) < 1e4 for k in ("loop: AR step", "loop: speculative step")), rows
    assert report["summary"][tree]["U"] == nodes and report["summary"][tree]["ratio"] > 0


def test_bench_step_runs_on_a_mesh(capsys):
    """`--mesh tp=2` (2 of the 8 simulated CPU devices): the loops run sharded and report ms per step."""
    spec = importlib.util.spec_from_file_location("bench_step", ROOT / "bench" / "bench_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--shape", "tiny", "--trees", "chain-2", "--draft-vocab", "64", "--context", "12",
                     "--cache-size", "128", "--loop-tokens", "2", "6", "--loop-repeat", "1", "--mesh", "tp=2",
                     "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["mesh"] == "tp=2"
    assert set(report["trees"]["chain-2"]) == {"loop: AR step", "loop: speculative step"}


def test_bench_step_knows_the_shipped_heads_fitted_trees(capsys):
    """`--trees fit-N-<hash>` names a tree a shipped head's calibration fitted (it was an unknown name here)."""
    from clover_jax import pretrained

    fitted = pretrained.default_tree("smollm2-135m-instruct-clover2").split("+")[0]
    assert fitted.startswith("fit-"), fitted
    spec = importlib.util.spec_from_file_location("bench_step", ROOT / "bench" / "bench_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--shape", "tiny", "--trees", fitted, "--draft-vocab", "64", "--context", "12",
                     "--cache-size", "128", "--loop-tokens", "2", "6", "--loop-repeat", "1", "--no-parts",
                     "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["trees"][fitted]) == {"loop: AR step", "loop: speculative step"}


def _bench(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_products_reports_each_row_count(capsys):
    assert _bench("bench_products").main(["--shape", "tiny", "--rows", "1", "3", "--repeat", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "3"]
    assert all(float(x) > 0 for r in rows for x in r.strip("|").split("|")[1:])


@pytest.mark.parametrize("tree", ["chain-2", "ar"])
def test_trace_step_ranks_the_ops_of_a_step(tree, capsys):
    """The loop's ops per step from two traced calls (tiny shapes); the environment is left as it was."""
    import os

    flags = os.environ.get("XLA_FLAGS")
    assert _bench("trace_step").main(["--shape", "tiny", "--tree", tree, "--context", "12", "--cache-size", "128",
                                      "--new-tokens", "40", "--top", "5"]) == 0
    assert os.environ.get("XLA_FLAGS") == flags
    out = capsys.readouterr().out
    assert "ms per step" in out
    ops = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert 1 <= len(ops) <= 5
