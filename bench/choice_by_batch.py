"""What a request with no tree chooses, by batch size: the comparison of every candidate (`calibrate --quick`) and a
request's own measurement (its default tree, plain decoding, at a batch above 1 the shortest head-less chain),
each measured afresh (a new choices file, no compile cache) in its own process.

  python bench/choice_by_batch.py --batch-sizes 1 2 4 8 16 --out results.json

A request's measurement runs on the shapes of an MT-Bench request (`--prompt-bucket 128`, `--reply-tokens 128`), three
times per batch size: a first measurement, the next process's request on the same choices file (the saved choice, or
a second measurement merged with the first where that was not settled), and a second first measurement in a new
choices file (two independent measurements, for how far their predictions differ).
Writes one JSON object (`benchmark: choice`, one row per batch size, which `scripts/render_results.py` renders).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ONE = """
import json, sys
from clover_jax.io.loader import load_model
from clover_jax.tuning.choose import choose
from clover_jax.tuning.choose import settled
model, batch, compare, bucket, reply = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
shapes = dict(prompt_bucket=bucket, reply_tokens=reply) if compare == "request" else {}
choice = choose(load_model(model), batch_size=batch, refresh=sys.argv[6] == "new", model_source=model, quiet=True,
                compare=compare, **shapes)
print("CHOICE " + json.dumps(dict(choice.entry, settled=settled(choice.entry))))
"""


def measure(model: str, batch: int, compare: str, bucket: int, reply: int, cache: str | None = None) -> dict:
    """One process's choice: a new one in a new choices folder, or, with `cache`, what a request finds there (the saved
    choice, or one more measurement merged with it where that was not settled)."""
    env = dict(os.environ, CLOVER_JAX_CACHE=cache or tempfile.mkdtemp(prefix="clover_jax_choice_"),
               CLOVER_JAX_COMPILE_CACHE="off")
    out = subprocess.run([sys.executable, "-c", ONE, model, str(batch), compare, str(bucket), str(reply),
                          "again" if cache else "new"], env=env, check=True, capture_output=True, text=True).stdout
    entry = json.loads(next(line for line in out.splitlines() if line.startswith("CHOICE "))[len("CHOICE "):])
    keep = ("predicted_speedup", "step_cost", "tau_batch", "measured_speedup", "tau_measured", "differing_outputs")
    return {"seconds": entry["seconds"], "best": entry["best"], "rounds": entry["rounds"],
            "programs_reused": entry.get("programs_reused", False), "prompt_bucket": entry["prompt_bucket"],
            "settled": entry["settled"], "measurements": entry.get("measurements", 1), "cache": env["CLOVER_JAX_CACHE"],
            "candidates": {k: {f: v[f] for f in keep if f in v} for k, v in entry["candidates"].items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--prompt-bucket", type=int, default=128)
    ap.add_argument("--reply-tokens", type=int, default=128)
    ap.add_argument("--scopes", nargs="+", choices=("all", "request"), default=["all", "request"],
                    help="what to measure: every candidate compared (all), a request's own measurement (request)")
    ap.add_argument("--out", default=None, help="write the JSON object here (default: print it)")
    args = ap.parse_args(argv)
    rows = []
    for b in args.batch_sizes:
        row = {"batch_size": b}
        if "all" in args.scopes:
            row.update(measure(args.model, b, "all", args.prompt_bucket, args.reply_tokens))
        if "request" in args.scopes:
            first = measure(args.model, b, "request", args.prompt_bucket, args.reply_tokens)
            row["request"] = first
            # the next process's request: the saved choice, or a second measurement merged with the first where
            # that was not settled; and a second new measurement, whose prediction the first's is compared with
            row["request_next"] = measure(args.model, b, "request", args.prompt_bucket, args.reply_tokens,
                                          cache=first["cache"])
            row["request_again"] = measure(args.model, b, "request", args.prompt_bucket, args.reply_tokens)
        print(f"batch {b}: " + "; ".join(f"{scope} {part['best']} ({part['seconds']} s)" for scope, part in
                                         (("all", row), ("request", row.get("request"))) if part and "best" in part),
              flush=True)
        rows.append(row)
    out = {"title": "What a request with no tree chooses, by batch size, CPU", "questions": "choice by batch size",
           "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python "
           f"{platform.python_version()}", "benchmark": "choice",
           "command": "python bench/choice_by_batch.py --batch-sizes " + " ".join(map(str, args.batch_sizes))
                      + " --scopes " + " ".join(args.scopes),
           "settings": f"{args.model}; every candidate compared (calibrate --quick) and a request's measurement "
                       f"(prompt bucket {args.prompt_bucket}, {args.reply_tokens} new tokens), each in a new process "
                       "with a new choices file and no compile cache", "rows": rows}
    write_out(out, args.out)
    return 0


def write_out(out: dict, path: str | None) -> None:
    """The benchmark's JSON object to `path`, or printed where there is none."""
    text = json.dumps(out, indent=1)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    sys.exit(main())
