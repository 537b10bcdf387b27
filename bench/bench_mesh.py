"""Sharded decoding against one device, and bf16 against float32: token-for-token agreement.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/bench_mesh.py           # 8 simulated CPU devices
  python bench/bench_mesh.py --meshes data=4,tp=2 tp=8 --limit 16 --batch-size 8 --max-new-tokens 128
  python bench/bench_mesh.py --dtypes float32 bfloat16 --meshes                            # bf16 agreement only

For each dtype: greedy autoregressive and speculative (the shipped head, or --head) generation of the same
prompts on one device, then on each mesh. Prints, per run, how many prompts give exactly the tokens of the
reference (one-device AR of the same dtype; for bf16 also the float32 AR), the first differing position,
tau and the acceptance histogram, and the wall time. On simulated CPU devices the times say nothing about
speed (the simulated devices share the host's cores); the agreement is the point. `--out PATH` writes the results
JSON.
"""

from __future__ import annotations

import argparse
import os
import sys

import toolkit


def first_diff(a, b):
    """The first position where two token lists differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--head", default="smollm2-135m-instruct-clover2")
    ap.add_argument("--tree", default=None, help="default: the head's own")
    ap.add_argument("--questions", default="mt_bench")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--meshes", nargs="*", default=["data=4,tp=2", "tp=8"])
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    toolkit.add_out_argument(ap)
    args = ap.parse_args(argv)
    if args.meshes and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

    import jax
    import jax.numpy as jnp

    from clover_jax import api
    from clover_jax.decoding import acceptance_stats
    from clover_jax.io.loader import load_model
    from clover_jax.io.prompts import read_prompts

    prompts = read_prompts(args.questions, limit=args.limit)
    print(f"# {args.model}, head {args.head}, {len(prompts)} prompts of {args.questions}, batch {args.batch_size}, "
          f"{args.max_new_tokens} new tokens, greedy; backend {jax.default_backend()}, {len(jax.devices())} devices")
    print("\n| dtype | mode | mesh | identical to ref | first differences | tau | accept hist | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    rows, ar32 = [], None

    def run(loaded, mode, mesh):
        toks, hist, secs = [], None, 0.0
        for i in range(0, len(prompts), args.batch_size):
            kw = dict(max_new_tokens=args.max_new_tokens, mode=mode, mesh=mesh)
            if mode == "speculative":
                kw.update(head=args.head, tree=args.tree)
            res = api.generate(loaded, prompts[i:i + args.batch_size], **kw)
            toks += res.token_ids
            secs += res.seconds
            h = res.stats.get("accept_hist")
            hist = h if hist is None or h is None else [a + b for a, b in zip(hist, h)]
        tau = acceptance_stats.tau(hist) if hist else None
        return toks, hist, tau, secs

    for dtype in args.dtypes:
        loaded = load_model(args.model, dtype=jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)
        ref = None
        for mode in ("ar", "speculative"):
            for mesh in [None] + list(args.meshes):
                toks, hist, tau, secs = run(loaded, mode, mesh)
                if ref is None:
                    ref = toks
                if dtype == "float32" and ar32 is None:
                    ar32 = toks
                refs = [("AR " + dtype, ref)] + ([("AR float32", ar32)] if dtype != "float32" and ar32 else [])
                same = "; ".join(f"{sum(a == b for a, b in zip(toks, r))}/{len(toks)} vs {name}" for name, r in refs)
                diffs = [d for d in (first_diff(a, b) for a, b in zip(toks, ref)) if d is not None]
                row = {"dtype": dtype, "mode": mode, "mesh": mesh or "one device", "identical": same,
                       "first_diffs": diffs, "tau": tau, "accept_hist": hist, "seconds": round(secs, 1)}
                rows.append(row)
                print(f"| {dtype} | {mode} | {row['mesh']} | {same} | {diffs or '-'} | "
                      f"{'-' if tau is None else f'{tau:.3f}'} | {hist or '-'} | {secs:.1f} |", flush=True)
    toolkit.write_results(args.out, toolkit.results(
        __file__, argv, benchmark="bench_mesh", title="Sharded decoding against one device, bf16 against float32",
        settings=f"{args.model}, head {args.head}, {len(prompts)} prompts of {args.questions}, batch "
                 f"{args.batch_size}, {args.max_new_tokens} new tokens, greedy, {len(jax.devices())} devices",
        rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
