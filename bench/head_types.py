"""One table of head types: the evaluations `bench/compare_heads.py` wrote (one per question set) and the drafting
cost `bench/bench_step.py time --out` measured per head type, condensed into one results file for
`scripts/render_results.py` (benchmark `head_types`).

  python bench/head_types.py --compare mt_bench=artifacts/mt80/compare.json spec_bench=artifacts/sb30/compare.json \\
      --steps artifacts/step-*.json --out results/<date>-cpu-head-types.json --title "..." --machine "..."

A head found in several evaluations is one row; its training cost is read from the first. A set may be given
several times (heads evaluated in separate runs on the same prompts). Drafting cost rows are matched to heads by
head type and tree.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import toolkit

KEEP = ("tau", "tau_ci95", "accept_rate_per_depth", "speedup_vs_ar", "speedup_ci95", "tokens_per_second")


def condense(compares: list[tuple[str, dict]]) -> dict:
    """[(set name, compare.json)] -> {"sets": {name: {prompts, ...}}, "heads": {head: row}}; a set may come from
    several evaluations of the same prompts (each its own autoregressive run: `ar_tokens_per_second` lists them)."""
    sets, heads = {}, {}
    for which, result in compares:
        info = {"prompts": result["prompts"], "questions": result["args"]["questions"],
                "categories": result["args"].get("categories")}
        known = sets.setdefault(which, dict(info, ar_tokens_per_second=[]))
        if {k: known[k] for k in info} != info:
            raise SystemExit(f"set {which!r}: evaluations on different prompts ({known} and {info})")
        known["ar_tokens_per_second"] += sorted({e["ar"]["tokens_per_second"] for e in result["heads"].values()})
        for spec, e in result["heads"].items():
            cost = e.get("training") or {}
            row = heads.setdefault(spec, {
                "type": e["type"], "source": e["source"], "params": e["params"],
                "train_steps": cost.get("final_step"), "tokens_seen": cost.get("tokens_seen"),
                "held_out_acc": cost.get("eval_acc"), "sets": {}})
            if len(e["trees"]) != 1:
                raise SystemExit(f"{spec} ran {len(e['trees'])} trees on {which} ({', '.join(e['trees'])}): one row "
                                 "per head needs one tree per head and set (compare_heads.py --no-default-tree with "
                                 "one --trees, or HEAD@TREE)")
            for tree, r in e["trees"].items():
                row["sets"][which] = {"tree": tree, **{k: r.get(k) for k in KEEP},
                                      "differing": e["greedy_mismatches"], "compared": e["greedy_compared"]}
    return {"sets": sets, "heads": heads}


def draft_costs(reports: list[dict]) -> dict:
    """bench_step time reports -> {"<head type> <tree>": {draft_ms, commit_ms, ar_step_ms, speculative_step_ms}}."""
    out = {}
    for rep in reports:
        for tree, rows in rep["trees"].items():
            out[f"{rep['head_type']} {tree}"] = {
                "ar_step_ms": round(rows["loop: AR step"], 2),
                "speculative_step_ms": round(rows["loop: speculative step"], 2),
                **{key: round(rows[part], 2) for key, part in (("draft_ms", "spec: draft"),
                                                                ("commit_ms", "spec: head commit")) if part in rows}}
    return out


def step_report(path: Path) -> dict:
    """The report `bench/bench_step.py time --out` wrote (or, from older runs, the JSON line that ends its output)."""
    text = path.read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    for candidate in (text, lines[-1] if lines else ""):
        try:
            report = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if isinstance(report, dict) and "trees" in report:
            return report
    raise SystemExit(f"{path}: no bench_step.py time report (write one with --out)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", nargs="+", required=True, metavar="SET=compare.json")
    ap.add_argument("--steps", nargs="*", default=[], help="bench_step.py time --out reports (later files win)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", required=True)
    ap.add_argument("--machine", required=True)
    ap.add_argument("--machine-short", default="2-core AMD EPYC CPU")
    ap.add_argument("--settings", default="")
    ap.add_argument("--command", default="", help="the commands that made the inputs (default: this one)")
    args = ap.parse_args(argv)
    compares = []
    for item in args.compare:
        which, _, path = item.partition("=")
        if not path:
            raise SystemExit(f"--compare {item!r}: expected SET=path/to/compare.json")
        compares.append((which, json.loads(Path(path).read_text())))
    out = {"title": args.title, "date": time.strftime("%Y-%m-%d"), "machine": args.machine,
           "machine_short": args.machine_short, "settings": args.settings,
           "command": args.command or toolkit.command(__file__, argv),
           "source": "condensed by bench/head_types.py from the commands' outputs", "benchmark": "head_types",
           **condense(compares), "draft": draft_costs([step_report(Path(p)) for p in args.steps]),
           "notes": []}
    toolkit.write_results(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
