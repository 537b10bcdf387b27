"""`bench/compare_heads.py`'s pieces that need no trained heads: which trees a head type can draft, the training
cost read from a run folder, and the papers' tau ratios computed only where two heads ran the same tree."""

import json

from test_bench_scripts import render, script


def _module():
    return script("compare_heads")


def test_supported_trees_per_head_type():
    from clover_jax.heads import registry

    mod = _module()
    eagle, redrafter = registry.get("eagle"), registry.get("redrafter")
    assert mod.unsupported(eagle, "clover2-26") is None and mod.unsupported(eagle, "dynamic-10") is None
    assert "beam" in mod.unsupported(eagle, "beam-4x5")  # the reason, for the skip message
    assert mod.unsupported(redrafter, "beam-4x5") is None and mod.unsupported(redrafter, "chain-4") is not None
    assert mod.unsupported(registry.get("medusa"), "dynamic-10") is not None


def test_supported_takes_merged_fitted_and_table_trees():
    """The shipped head's default tree (a fitted tree with a table-filled lookup chain) runs in a comparison: it
    was dropped without a word when only plain tree names were understood. A head with no table of its own (a
    fresh EAGLE head) drafts a table tree with the table `--ngram-table` gives every head."""
    from clover_jax.heads.folder import open_folder
    from clover_jax.decoding.ngram import resolve_ngram_table
    from clover_jax.heads import registry
    from clover_jax import pretrained

    mod = _module()
    clover2 = registry.get("clover2")
    assert mod.unsupported(clover2, "chain-3+lookup-4") is None
    assert "n-gram table" in mod.unsupported(clover2, "chain-3+lookup-4-table")  # a table tree needs its table
    name = "smollm2-135m-instruct-clover2"
    tree = pretrained.default_tree(name)
    assert tree.startswith("fit-") and tree.endswith("-table"), tree
    known = open_folder(name).trees
    shipped = open_folder(name).ngram_table
    assert mod.unsupported(clover2, tree, shipped, known) is None
    table_file = pretrained.head_path(name) / "ngram_table.npz"
    assert mod.unsupported(registry.get("eagle"), tree, resolve_ngram_table(str(table_file)), known) is None


def test_training_cost_from_a_run_folder(tmp_path):
    mod = _module()
    assert mod.training_cost(tmp_path) == {}
    (tmp_path / "train_summary.jsonl").write_text(
        json.dumps({"final_step": 300, "train_time_s": 600.0, "tokens_per_s": 500.0}) + "\n"
        + json.dumps({"eval_acc": [0.4, 0.2]}) + "\nnot json\n")
    cost = mod.training_cost(tmp_path)
    assert cost["tokens_seen"] == 300000 and cost["final_step"] == 300 and cost["eval_acc"] == [0.4, 0.2]
    assert mod._first_acc(cost) == "0.400" and mod._first_acc({}) == "-"


def test_ratio_lines_only_on_shared_trees():
    mod = _module()
    result = {"heads": {"a": {"type": "clover2", "trees": {"chain-4": {"tau": 2.2}, "clover2-26": {"tau": 2.5}}},
                        "b": {"type": "eagle", "trees": {"chain-4": {"tau": 2.0}, "dynamic-10": {"tau": 2.4}}},
                        "c": {"type": "medusa", "trees": {"clover2-26": {"tau": None}}}}}
    assert mod.ratio_lines(result) == ["", "- Clover-2 / eagle tau on chain-4: 1.100"]


def test_head_types_condenses_evaluations_and_step_costs_into_one_rendered_row_per_head(tmp_path):
    """`bench/head_types.py`: a head evaluated on two question sets is one row with both sets' tau and speed-up;
    its drafting cost comes from the bench_step report of its type and tree; a head missing from one set shows '-'
    there; the mismatches of both sets are summed."""
    ht = script("head_types")

    def run(tau, speed):
        return {"tau": tau, "tau_ci95": [tau - 0.1, tau + 0.1], "speedup_vs_ar": speed, "speedup_ci95": None,
                "accept_rate_per_depth": [0.5, float("nan")], "tokens_per_second": 10.0, "node_hist": [1, 2]}

    def compare(questions, heads):
        return {"prompts": 3, "args": {"questions": questions, "categories": None},
                "heads": {name: {"type": kind, "source": f"runs/{name}", "params": 2_000_000,
                                 "training": {"final_step": 300, "tokens_seen": 1000, "eval_acc": [0.3]},
                                 "greedy_mismatches": miss, "greedy_compared": 3, "ar": {"tokens_per_second": 20.0},
                                 "trees": {tree: run(tau, speed)}}
                          for name, (kind, tree, tau, speed, miss) in heads.items()}}

    mt = compare("mt_bench", {"b": ("block", "chain-4", 1.4, 0.7, 0), "r": ("redrafter", "beam-4x5", 1.3, 0.3, 1)})
    sb = compare("spec_bench", {"b": ("block", "chain-4", 1.6, 0.8, 0)})
    paths = []
    for name, d in (("mt", mt), ("sb", sb)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(d))
    step = tmp_path / "step.json"
    step.write_text(json.dumps({"head_type": "block", "trees": {"chain-4": {
        "loop: AR step": 30.0, "loop: speculative step": 50.0, "spec: draft": 6.0, "spec: head commit": 3.0}}}))
    out = tmp_path / "table.json"
    assert ht.main(["--compare", f"mt_bench={paths[0]}", f"spec_bench={paths[1]}", "--steps", str(step),
                    "--out", str(out), "--title", "t", "--machine", "m"]) == 0
    d = json.loads(out.read_text())
    assert list(d["heads"]) == ["b", "r"] and set(d["heads"]["b"]["sets"]) == {"mt_bench", "spec_bench"}
    assert d["draft"] == {"block chain-4": {"ar_step_ms": 30.0, "speculative_step_ms": 50.0, "draft_ms": 6.0,
                                            "commit_ms": 3.0}}
    assert "node_hist" not in d["heads"]["b"]["sets"]["mt_bench"]  # condensed
    table = render(d, out).splitlines()
    rows = [line for line in table if line.startswith("| block") or line.startswith("| ReDrafter")]
    assert "MT-Bench 3: tau" in "\n".join(table) and "Spec-Bench 3: tau" in "\n".join(table)
    block, redrafter = rows
    assert "1.400 (1.300-1.500) | 0.70x | 1.600 (1.500-1.700) | 0.80x | 0.50, - | 1.67 | 0.30 | 0 of 6 |" in block
    assert "| - | - |" in redrafter and redrafter.endswith("| - | - | 1 of 3 |")


def test_head_types_refuses_a_head_with_several_trees_in_one_set(tmp_path):
    """One row per head needs one tree per head and set: an evaluation with the default tree added is refused by
    name, not condensed into whichever tree came last."""
    import pytest

    ht = script("head_types")
    two = {"prompts": 1, "args": {"questions": "mt_bench"}, "heads": {"e": {
        "type": "eagle", "source": "runs/e", "params": 1, "training": {}, "greedy_mismatches": 0,
        "greedy_compared": 2, "ar": {"tokens_per_second": 1.0}, "trees": {"chain-4": {}, "clover2-26": {}}}}}
    with pytest.raises(SystemExit, match="e ran 2 trees on mt_bench"):
        ht.condense([("mt_bench", two)])
    (tmp_path / "step.out").write_text("| a markdown table |\n")
    with pytest.raises(SystemExit, match="no bench_step.py time report"):
        ht.step_report(tmp_path / "step.out")
    report = {"head_type": "block", "trees": {"chain-4": {"loop: AR step": 1.0}}}
    (tmp_path / "step.json").write_text(json.dumps(report, indent=1))  # `time --out`'s file
    (tmp_path / "step.log").write_text("| a table |\n" + json.dumps(report) + "\n")  # an older run's output
    assert ht.step_report(tmp_path / "step.json") == report == ht.step_report(tmp_path / "step.log")
