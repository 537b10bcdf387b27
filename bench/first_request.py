"""What choosing the tree adds to a first request: the same speculative request with no tree named (its choice
measured on first use) and with `tree="default"` (the default head's tree, nothing measured), each in a new
process with a new choices file and no compile cache.

  python bench/first_request.py --batch-sizes 1 2 4 --repeats 2 --out results.json

Both requests decode the same MT-Bench question (`--prompt-bucket 128`, `--max-new-tokens 128`, repeated to the
batch size). Timed: the `generate` call alone (model loading excluded): compiling, the choice's measurement where
there is one, and decoding. The difference is what the choice costs a first request beyond compiling and running the
program it would run anyway (where the choice keeps the default tree, the measurement's compile of it is the
request's own; where it picks another run, the request runs that one). Writes one JSON object
(`benchmark: first_request`, which `scripts/render_results.py` renders).
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from choice_by_batch import write_out  # noqa: E402  (the same JSON output)

ONE = """
import json, sys, time
from clover_jax import generate, load_model
from clover_jax.io.prompts import read_prompts
model, batch, tree, bucket, new = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
lm = load_model(model)
question = read_prompts("mt_bench", limit=1)[0]
t0 = time.perf_counter()
out = generate(lm, [question] * batch, mode="speculative", max_new_tokens=new, prompt_bucket=bucket,
               tree=None if tree == "none" else tree)
seconds = time.perf_counter() - t0
choice = out.stats.get("choice") or {}
print("FIRST " + json.dumps({"seconds": round(seconds, 1), "tokens": sum(len(t) for t in out.token_ids),
                             "tau": out.stats.get("tau"), "tree": out.stats.get("tree", "ar"), "choice": choice}))
"""


def run(model: str, batch: int, tree: str, bucket: int, new_tokens: int) -> dict:
    env = dict(os.environ, CLOVER_JAX_CACHE=tempfile.mkdtemp(prefix="clover_jax_first_"),
               CLOVER_JAX_COMPILE_CACHE="off")
    out = subprocess.run([sys.executable, "-c", ONE, model, str(batch), tree, str(bucket), str(new_tokens)],
                         env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("FIRST "))[len("FIRST "):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=2, help="pairs of processes per batch size")
    ap.add_argument("--prompt-bucket", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="write the JSON object here (default: print it)")
    args = ap.parse_args(argv)
    rows = []
    for b in args.batch_sizes:
        for _ in range(args.repeats):  # the two requests back to back, so that both see the machine alike
            row = {"batch_size": b,
                   "no_tree": run(args.model, b, "none", args.prompt_bucket, args.max_new_tokens),
                   "default": run(args.model, b, "default", args.prompt_bucket, args.max_new_tokens)}
            row["added_s"] = round(row["no_tree"]["seconds"] - row["default"]["seconds"], 1)
            print(f"batch {b}: no tree {row['no_tree']['seconds']} s, default {row['default']['seconds']} s, "
                  f"added {row['added_s']} s", flush=True)
            rows.append(row)
    out = {"title": "What choosing the tree adds to a first request, CPU", "date": time.strftime("%Y-%m-%d"),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
           "benchmark": "first_request",
           "command": "python bench/first_request.py --batch-sizes " + " ".join(map(str, args.batch_sizes))
                      + f" --repeats {args.repeats}",
           "settings": f"{args.model}; one MT-Bench question repeated to the batch size, prompt bucket "
                       f"{args.prompt_bucket}, {args.max_new_tokens} new tokens; each request in a new process with a "
                       "new choices file and no compile cache; the generate call timed (model loading excluded)",
           "rows": rows}
    write_out(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
