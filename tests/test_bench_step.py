"""`bench/bench_step.py time` times every part of a step for every registered head type's drafter family, and knows
the shipped heads' fitted trees (tiny shapes). Its other commands, and the other scripts: tests/test_bench_scripts.py."""

import json

import pytest

from test_bench_scripts import render, results, script


@pytest.mark.parametrize("head_type,tree,nodes", [("medusa", "chain-2", 3), ("redrafter", "beam-2x3", 5),
                                                  ("clover1", "dynamic-4-d2-k2-p0.9", 4),
                                                  ("eagle", "dynamic-4-d2-k2", 4), ("block", "chain-2", 3)])
@pytest.mark.slow  # times each part of a step per head
def test_bench_step_reports_each_part(head_type, tree, nodes, tmp_path):
    out = tmp_path / "step.json"
    assert script("bench_step").main(["time", "--shape", "tiny", "--head-type", head_type, "--trees", tree,
                                      "--draft-vocab", "64", "--context", "12", "--cache-size", "128", "--repeat",
                                      "1", "--loop-tokens", "2", "6", "--loop-repeat", "1", "--out", str(out)]) == 0
    report = results(out, "bench_step", "trees", "steps", "summary")
    rows = report["trees"][tree]
    assert report["head_type"] == head_type
    for part in ("spec: draft", "spec: verify forward + KV write", "spec: logits", "spec: acceptance",
                 "spec: KV compaction", "spec: head commit", "ar: forward + KV append"):
        assert rows[part] > 0, (part, rows)
    # ms per step from a difference of two tiny runs: present and finite (its sign is timing noise at this size)
    assert all(abs(rows[k]) < 1e4 for k in ("loop: AR step", "loop: speculative step")), rows
    assert report["summary"][tree]["U"] == nodes and report["summary"][tree]["ratio"] > 0
    assert report["steps"][tree]["verified_tokens"] == nodes


@pytest.mark.slow  # times the shipped head's trees
def test_bench_step_knows_the_shipped_heads_fitted_trees(tmp_path):
    """`--trees fit-N-<hash>` names a tree a shipped head's calibration fitted (it was an unknown name here); a tree
    with a lookup chain has no parts timed, and its row renders with "-" for them."""
    from clover_jax import pretrained

    shipped = pretrained.default_tree("smollm2-135m-instruct-clover2")
    fitted = shipped.split("+")[0]
    assert fitted.startswith("fit-"), fitted
    out = tmp_path / "step.json"
    assert script("bench_step").main(["time", "--shape", "tiny", "--trees", fitted, "chain-2+lookup-2",
                                      "--draft-vocab", "64", "--context", "12", "--cache-size", "128", "--repeat", "1",
                                      "--loop-tokens", "2", "6", "--loop-repeat", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "spec: draft" in report["trees"][fitted]
    assert set(report["trees"]["chain-2+lookup-2"]) == {"loop: AR step", "loop: speculative step"}
    rendered = [line for line in render(results(out, "bench_step"), out).splitlines() if line.startswith("| clover2")]
    assert len(rendered) == 2 and rendered[1].endswith("| - | - | - |") and "`chain-2+lookup-2`" in rendered[1]
