"""Where one decoding step's time goes, op by op: a profiler trace of the real loop, mapped back to JAX source.

  python bench/trace_step.py --tree chain-3
  python bench/trace_step.py --tree fit-5-411aab+lookup-4-table --layers scan --top 30
  python bench/trace_step.py --tree ar                     # the autoregressive loop

Runs the jitted loop (`spec_generate`, or `ar_generate` for `--tree ar`) on a random model of a real shape (as
`bench_step.py` does, EOS disabled), compiles and warms it, then records two calls under `jax.profiler.trace`, of
16 and `--new-tokens` new tokens: the difference of each op's summed time between the two, divided by the
difference in steps, is its cost per decoding step (the prefill and the call's overhead cancel out). Ops are
grouped by the JAX operation their fusion came from (`op_name` in the optimised HLO's metadata, dumped for this
purpose; the HLO name where there is none), so one row sums that operation over every layer:
`.../while/body/while/body/...` is inside the scan over the base model's layers, `.../while/body/...` the rest of
the step (an unrolled layer's ops land there too). The profiler slows the ops (about a third on a CPU), and ops on
two threads overlap, so the table ranks where the time goes rather than adding up to the step's wall time
(`bench_step.py` measures that).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def hlo_op_names(dump_dir: str) -> dict[str, str]:
    """Instruction name -> `op_name` metadata, from the largest optimised HLO module in `dump_dir` (the loop)."""
    files = [f for f in glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")) if "buffer" not in f]
    if not files:
        return {}
    names = {}
    for line in open(max(files, key=os.path.getsize)):
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*metadata=\{([^}]*)\}", line)
        if m:
            op = re.search(r'op_name="([^"]+)"', m.group(2))
            names[m.group(1)] = op.group(1) if op else ""
    return names


def op_times(trace_dir: str) -> tuple[collections.Counter, collections.Counter]:
    """(total microseconds, calls) per traced op name, over every thread, from the profiler's trace."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        raise SystemExit(f"no trace written under {trace_dir}")
    with gzip.open(files[0]) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    skip = ("$", "Thunk", "Pjit", "Common", "Slinky", "end:")
    total, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith(skip):
            total[e["name"]] += e.get("dur", 0)
            calls[e["name"]] += 1
    return total, calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--head-type", default="clover2")
    ap.add_argument("--tree", default="chain-3", help="a tree name, or 'ar' for the autoregressive loop")
    ap.add_argument("--layers", default="auto", choices=["auto", "unrolled", "scan"])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--cache-size", type=int, default=640)
    ap.add_argument("--new-tokens", type=int, default=80)
    ap.add_argument("--top", type=int, default=25, help="ops listed")
    args = ap.parse_args(argv)
    dump = tempfile.mkdtemp(prefix="trace_step_hlo_")
    # read when JAX starts its backend: in a process where it already has (a test), ops keep their HLO names
    flags = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = ((flags or "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text "
                               "--xla_dump_hlo_module_re=.*jit_(fn|wrapped).*").strip()
    try:
        return _trace(args, dump)
    finally:
        if flags is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = flags


def _trace(args, dump: str) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import bench_step
    from clover_jax.decoding.autoregressive import ar_generate
    from clover_jax.decoding.sampling import SamplingParams
    from clover_jax.decoding.speculative import spec_generate

    config, base, head = bench_step.build(args)
    layers = None if args.layers == "auto" else args.layers
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (1, args.context)), jnp.int32)
    lens = np.array([args.context])
    kw = dict(cache_size=args.cache_size, sampling=SamplingParams(), key=jax.random.key(0), eos_ids=[-1],
              layers=layers)
    if args.tree == "ar":
        def run(n):
            return jax.block_until_ready(ar_generate(base, prompt, lens, max_new_tokens=n, **kw))
    else:
        vocab = np.arange(8192, dtype=np.int32) if config.vocab_size > 8192 else None  # a draft vocabulary
        _, drafter = bench_step.tree_drafter(config, head, args.tree, vocab)

        def run(n):
            return spec_generate(base, head, prompt, lens, max_new_tokens=n, drafter=drafter, **kw)[0]

    if args.new_tokens <= 16:
        raise SystemExit(f"--new-tokens must be above 16 (the shorter traced call), got {args.new_tokens}")
    names = None
    runs = []
    for n in (16, args.new_tokens):
        run(n)
        run(n)
        trace = tempfile.mkdtemp(prefix="trace_step_")
        with jax.profiler.trace(trace, create_perfetto_trace=True):
            out = run(n)
        names = names or hlo_op_names(dump)
        total, calls = op_times(trace)
        by_op, n_by_op = collections.Counter(), collections.Counter()
        for name, us in total.items():
            op = re.sub(r"^jit\([^)]*\)/", "", names.get(name, "")) or name
            by_op[op] += us
            n_by_op[op] += calls[name]
        runs.append((int(out.steps), by_op, n_by_op))
    (s1, t1, c1), (s2, t2, c2) = runs
    steps = max(s2 - s1, 1)
    per_step = {op: (t2[op] - t1[op]) / 1e3 / steps for op in t2}
    print(f"# {args.tree} on {args.shape} shapes, {args.dtype}, batch 1, {args.context} tokens cached; traced calls "
          f"of {s1} and {s2} steps; backend {jax.default_backend()}\n")
    print(f"all traced ops: {sum(per_step.values()):.2f} ms per step (ops on different threads overlap)\n")
    print("| ms per step | calls per step | JAX operation (or HLO op) |")
    print("|---|---|---|")
    for op, ms in sorted(per_step.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"| {ms:.3f} | {(c2[op] - c1[op]) / steps:.1f} | {op[-100:]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
