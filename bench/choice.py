"""What a speculative request that names no tree chooses, and what choosing costs it: each measurement in a new
process with a new choices file and no compile cache (`toolkit.run_child`).

  python bench/choice.py by-batch --batch-sizes 1 2 4 8 16 --out results.json
  python bench/choice.py by-batch --batch-sizes 1 2 4 8 16 --scopes request --out results.json
  python bench/choice.py first-request --batch-sizes 1 2 4 --repeats 2 --out results.json

* `by-batch` (benchmark `choice`): per batch size, the comparison of every candidate (`--scopes all`: `calibrate
  --quick`) and a request's own measurement (`--scopes request`: its default tree, plain decoding, at a batch above
  1 the shortest head-less chain) on the shapes of an MT-Bench request (`--prompt-bucket 128`, `--reply-tokens
  128`), three times: a first measurement, the next process's request on the same choices file (the saved choice,
  or a second measurement merged with the first where that was not settled), and a second first measurement in a
  new choices file (how far two independent predictions differ).
* `first-request` (benchmark `first_request`): the same speculative request with no tree named (its choice measured
  on first use) and with `tree="default"` (the default head's tree, nothing measured), back to back, `--repeats`
  pairs per batch size; one MT-Bench question repeated to the batch size. Timed: the `generate` call alone (model
  loading excluded): compiling, the choice's measurement where there is one, decoding. The difference is what the
  choice costs a first request beyond the program it would compile and run anyway.

`--out PATH` writes the results JSON, which `scripts/render_results.py` renders.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import toolkit

KEEP = ("predicted_speedup", "step_cost", "tau_batch", "measured_speedup", "tau_measured", "differing_outputs")


# -------------------------------------------------------------------------------------------- the children
def child(spec: dict) -> dict:
    """One measurement in this (new) process: a choice (`by-batch`) or a first request (`first-request`)."""
    from clover_jax import generate, load_model
    from clover_jax.io.prompts import read_prompts
    from clover_jax.training.loading import open_head_or_run
    from clover_jax.tuning.choose import choose, settled

    lm = load_model(spec["model"])
    if spec["kind"] == "choice":
        shapes = dict(prompt_bucket=spec["bucket"], reply_tokens=spec["reply"]) if spec["compare"] == "request" else {}
        head = open_head_or_run(spec["head"], lm.model) if spec["head"] else None
        entry = choose(lm, head, batch_size=spec["batch"], refresh=not spec["again"], model_source=spec["model"],
                       quiet=True, compare=spec["compare"], **shapes).entry
        return dict(entry, settled=settled(entry))
    question = read_prompts("mt_bench", limit=1)[0]
    t0 = time.perf_counter()
    out = generate(lm, [question] * spec["batch"], mode="speculative", max_new_tokens=spec["reply"],
                   prompt_bucket=spec["bucket"], head=spec["head"], tree=spec["tree"])
    return {"seconds": round(time.perf_counter() - t0, 1), "tokens": sum(len(t) for t in out.token_ids),
            "tau": out.stats.get("tau"), "tree": out.stats.get("tree", "ar"), "choice": out.stats.get("choice") or {}}


def measure(args, batch: int, compare: str, cache: str, again: bool = False) -> dict:
    """One process's choice in the choices folder `cache`: a new one, or, `again`, what a request finds there (the
    saved choice, or one more measurement merged with it where that was not settled)."""
    entry = toolkit.run_child(__file__, dict(kind="choice", model=args.model, head=args.head, batch=batch,
                                             compare=compare, bucket=args.prompt_bucket, reply=args.reply_tokens,
                                             again=again),
                              env=dict(CLOVER_JAX_CACHE=cache, CLOVER_JAX_COMPILE_CACHE="off")).report
    return {"seconds": entry["seconds"], "best": entry["best"], "rounds": entry["rounds"],
            "programs_reused": entry.get("programs_reused", False), "prompt_bucket": entry["prompt_bucket"],
            "settled": entry["settled"], "measurements": entry.get("measurements", 1),
            "candidates": {k: {f: v[f] for f in KEEP if f in v} for k, v in entry["candidates"].items()}}


def first_request(args, batch: int, tree: str | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="clover_jax_first_") as cache:
        env = dict(CLOVER_JAX_CACHE=cache, CLOVER_JAX_COMPILE_CACHE="off")
        return toolkit.run_child(__file__, dict(kind="first_request", model=args.model, head=args.head, batch=batch,
                                                tree=tree, bucket=args.prompt_bucket, reply=args.reply_tokens),
                                 env=env).report


# ------------------------------------------------------------------------------------------------ commands
def by_batch(args, argv) -> dict:
    rows = []
    for b in args.batch_sizes:
        row = {"batch_size": b}
        with (tempfile.TemporaryDirectory(prefix="clover_jax_choice_") as all_cache,
              tempfile.TemporaryDirectory(prefix="clover_jax_choice_") as first_cache,
              tempfile.TemporaryDirectory(prefix="clover_jax_choice_") as again_cache):
            if "all" in args.scopes:
                row.update(measure(args, b, "all", all_cache))
            if "request" in args.scopes:
                row["request"] = measure(args, b, "request", first_cache)
                # the next process's request: the saved choice, or a second measurement merged with the first where
                # that was not settled; and a second new measurement, whose prediction the first's is compared with
                row["request_next"] = measure(args, b, "request", first_cache, again=True)
                row["request_again"] = measure(args, b, "request", again_cache)
        print(f"batch {b}: " + "; ".join(f"{scope} {part['best']} ({part['seconds']} s)" for scope, part in
                                         (("all", row), ("request", row.get("request"))) if part and "best" in part),
              flush=True)
        rows.append(row)
    return toolkit.results(
        __file__, argv, benchmark="choice", title="What a request with no tree chooses, by batch size, CPU",
        questions="choice by batch size",
        settings=f"{_model(args)}; every candidate compared (calibrate --quick) and a request's measurement (prompt "
                 f"bucket {args.prompt_bucket}, {args.reply_tokens} new tokens), each in a new process with a new "
                 "choices file and no compile cache", rows=rows)


def first_requests(args, argv) -> dict:
    rows = []
    for b in args.batch_sizes:
        for _ in range(args.repeats):  # the two requests back to back, so that both see the machine alike
            row = {"batch_size": b, "no_tree": first_request(args, b, None),
                   "default": first_request(args, b, "default")}
            row["added_s"] = round(row["no_tree"]["seconds"] - row["default"]["seconds"], 1)
            print(f"batch {b}: no tree {row['no_tree']['seconds']} s, default {row['default']['seconds']} s, "
                  f"added {row['added_s']} s", flush=True)
            rows.append(row)
    return toolkit.results(
        __file__, argv, benchmark="first_request", title="What choosing the tree adds to a first request, CPU",
        settings=f"{_model(args)}; one MT-Bench question repeated to the batch size, prompt bucket "
                 f"{args.prompt_bucket}, {args.reply_tokens} new tokens; each request in a new process with a new "
                 "choices file and no compile cache; the generate call timed (model loading excluded)", rows=rows)


def _model(args) -> str:
    return args.model + (f", head {args.head}" if args.head else "")


def main(argv=None) -> int:
    if toolkit.serve_child(argv, child):
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default="smollm2-135m-instruct")
    common.add_argument("--head", default=None, help="the head a request names (default: none, the model's shipped "
                        "heads are the candidates)")
    common.add_argument("--prompt-bucket", type=int, default=128)
    common.add_argument("--reply-tokens", "--max-new-tokens", dest="reply_tokens", type=int, default=128,
                        help="new tokens of the request")
    toolkit.add_out_argument(common)
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("by-batch", parents=[common], help="what a request with no tree chooses, by batch size")
    b.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    b.add_argument("--scopes", nargs="+", choices=("all", "request"), default=["all", "request"],
                   help="what to measure: every candidate compared (all), a request's own measurement (request)")
    f = sub.add_parser("first-request", parents=[common], help="what choosing adds to a first request")
    f.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4])
    f.add_argument("--repeats", type=int, default=2, help="pairs of processes per batch size")
    args = ap.parse_args(argv)
    result = (by_batch if args.command == "by-batch" else first_requests)(args, argv)
    if args.out is None:
        print(json.dumps(result, indent=1))
    toolkit.write_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
