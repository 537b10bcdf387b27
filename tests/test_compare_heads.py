"""`bench/compare_heads.py`'s pieces that need no trained heads: which trees a head type can draft, the training
cost read from a run folder, and the papers' tau ratios computed only where two heads ran the same tree."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("compare_heads", ROOT / "bench" / "compare_heads.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
    shipped = resolve_ngram_table(None, name)
    assert mod.unsupported(clover2, tree, shipped, known) is None
    table_file = pretrained.head_path(name) / "ngram_table.npz"
    assert mod.unsupported(registry.get("eagle"), tree, resolve_ngram_table(str(table_file), None), known) is None


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
