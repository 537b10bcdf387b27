"""Speed-up of speculative decoding by batch size: `bench/bench_spec.py` once per batch size, merged into one table.

  python bench/batch_table.py --questions mt_bench --limit 80 --batch-sizes 1 2 4 8 16 \
      --trees chosen fit-5-411aab+lookup-4-table lookup-4-table --out-dir artifacts/batch
  python bench/batch_table.py --merge-only --out-dir artifacts/batch --batch-sizes 1 2 4 8 16   # merge earlier runs

Each batch size runs in its own process (`bench_spec.py --batch-size B --out-dir OUT/bB`), so every speed-up is
against the autoregressive loop timed in the same process at the same batch size. `chosen` is what a request that
names no tree gets (`clover_jax.tuning.choose`, measured once per batch size: the tree shrinks, or plain decoding is
chosen, as verification gets dearer with the batch). Writes OUT/results.json (`benchmark: batch_table`, one row
per batch size, which `scripts/render_results.py` renders) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_one(args, batch: int, out: Path) -> None:
    cmd = [sys.executable, str(HERE / "bench_spec.py"), "--questions", args.questions, "--limit", str(args.limit),
           "--max-new-tokens", str(args.max_new_tokens), "--batch-size", str(batch), "--dtype", args.dtype,
           "--out-dir", str(out), "--trees", *args.trees]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def row(batch: int, result: dict) -> dict:
    runs = result["runs"]
    out = {"batch_size": batch, "ar_tokens_per_second": runs["ar"]["tokens_per_second"],
           "greedy_compared": result.get("greedy_compared"), "greedy_mismatches": result.get("greedy_mismatches"),
           "runs": {}}
    for name, r in runs.items():
        if name in ("ar", "transformers"):
            continue
        out["runs"][name.removesuffix("+dv")] = {k: r.get(k) for k in (
            "tau", "speedup_vs_ar", "speedup_ci95", "tokens_per_second", "choice")}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", default="mt_bench")
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--trees", nargs="+", default=["chosen", "fit-5-411aab+lookup-4-table", "lookup-4-table"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out-dir", default="artifacts/batch")
    ap.add_argument("--merge-only", action="store_true", help="merge OUT/bB/results.json of earlier runs")
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    rows = []
    for b in args.batch_sizes:
        sub = out / f"b{b}"
        if not args.merge_only:
            run_one(args, b, sub)
        path = sub / "results.json"
        if not path.is_file():
            raise SystemExit(f"{path}: no results (run without --merge-only)")
        rows.append(row(b, json.loads(path.read_text())))
    first = json.loads((out / f"b{args.batch_sizes[0]}" / "results.json").read_text())
    result = {"benchmark": "batch_table", "machine": first.get("machine"), "date": first.get("date"),
              "questions": args.questions, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
              "trees": [t for t in args.trees], "rows": rows}
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    names = list(rows[0]["runs"])
    print("| batch | AR tokens/s | " + " | ".join(f"{n}: tau, vs AR" for n in names) + " | differing |")
    print("|---|---|" + "---|" * len(names) + "---|")
    for r in rows:
        cells = [f"{r['runs'][n]['tau']}, {r['runs'][n]['speedup_vs_ar']}x" for n in names]
        print(f"| {r['batch_size']} | {r['ar_tokens_per_second']} | " + " | ".join(cells) +
              f" | {r['greedy_mismatches']} of {r['greedy_compared']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
