"""`tree="auto"`: the draft tree that makes this head fastest on this hardware, measured and remembered.

    python -m clover_jax.calibrate --model smollm2-135m-instruct --head smollm2-135m-instruct-clover2
    clover_jax.generate(lm, prompts, mode="speculative", head="smollm2-135m-instruct-clover2", tree="auto")
    python infer.py --mode speculative --tree auto

Which tree pays depends on two things no preset knows: the head's acceptance profile (how often each depth and
each child rank is accepted) and the hardware's price for verifying more tokens per step (nearly flat on a
GPU or TPU at small batch; on a CPU a 26-token verify costs several decode steps). Rather than model both, a
calibration measures their product directly: on a few prompts (Spec-Bench questions that are not MT-Bench's
by default), it runs autoregressive decoding and speculative decoding with each candidate tree (static
presets and dynamic budgets the head supports) in the same process, interleaved per batch, and records each
candidate's tau, acceptance per depth, tokens/s and speedup over autoregressive decoding. `auto` is the
candidate with the highest speedup, or plain autoregressive decoding when no tree beats it (speculation that
does not pay is not used).

For heads that draft static trees the calibration also fits trees to the head (`clover_jax.decoding.tree_fit`,
after Sequoia, Chen et al. 2024): a probe tree (a comb of the first child ranks along the top-1 path) joins the
candidates, the loop's per-node acceptance counts of every static run give the head's acceptance per depth and
child rank, a least-squares model of the step cost in verified tokens and depth comes from the same runs, and
the fitted trees with the highest predicted speed are measured in a final round, beside the first round's two
fastest candidates measured again, and `auto` is the fastest tree of that final round (one baseline for all of
them: on a 2-core AMD EPYC the first round's winner, `small-10` at 1.17x, ran at 0.98x on 52 Spec-Bench prompts
where the fitted `fit-5-411aab`, 1.11x in the second round, ran at 1.13x). Fitted trees are named `fit-N-<hash>`
(N nodes, root included); the calibration stores their shapes, so `auto` can pick one, and keeps the shapes of
an entry it replaces (`kept_trees`), so a fitted tree named elsewhere (a registered head's default tree) still
resolves after a new calibration fits other shapes. The final round also runs
the best fitted tree and the first round's best static tree with a prompt-lookup chain of `LOOKUP_LENGTH` tokens
beside them (`TREE+lookup-4`, `clover_jax.decoding.lookup`), so `auto` can pick a merged tree where it pays.

A calibration is keyed by the hardware (backend and device kind; on a CPU the processor model and core
count), the compute dtype and the batch size; it is saved beside the head (`calibration.json` in the head's
folder) when that folder is writable, else in `~/.cache/clover_jax/calibration/` (`CLOVER_JAX_CACHE`
overrides), and reused by later runs. `auto` without a saved calibration for this hardware runs one and says
so (measured for the shipped SmolLM2 head on 2 CPU cores: 7 minutes for the presets alone, 15 with the probe
and the fitted trees while another job shared the machine; `--candidates` and `--no-fit` shorten it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from clover_jax.validation import InputError

_MEMO: dict[tuple, dict] = {}  # (head, entry key) -> entry, for heads whose calibration cannot be saved

AUTO = "auto"
AR = "ar"  # the calibration's answer when no tree beats autoregressive decoding
FILE_NAME = "calibration.json"
KEPT_TREES = "kept_trees"  # calibration.json: tree shapes of replaced entries, still resolvable by name
STATIC_CANDIDATES = ("chain-1", "chain-2", "chain-3", "chain-4", "small-10", "clover2-26")
DYNAMIC_CANDIDATES = ("dynamic-4", "dynamic-6", "dynamic-10", "dynamic-16", "dynamic-26")
BEAM_CANDIDATES = ("beam-2x3", "beam-2x4", "beam-3x4", "beam-4x5")  # for beam-search drafters (ReDrafter)
PROBE_WIDTHS = (8, 6, 4, 3, 3)  # child ranks measured per depth by the probe tree: 24 drafts, 25 nodes
FITTED_TO_MEASURE = 2  # fitted trees measured per calibration (the best predicted ones)
FINALISTS = 2  # the first round's fastest candidates, measured again beside the fitted trees
LOOKUP_LENGTH = 4  # the final round also runs its best static tree and best fitted tree with a lookup chain this long
# What a calibration tries. An entry saved by an older version never measured candidates the current one would
# try, so `auto` calibrates again rather than trust its answer: 1 the presets and dynamic trees; 2 also the probe,
# the fitted trees and a final round with prompt-lookup chains; 3 also the n-gram table's chains (`...-table`).
VERSION = 3
# Spec-Bench categories other than MT-Bench's, so a calibration does not see the usual evaluation prompts
DEFAULT_PROMPTS = (("spec_bench", "translation", 3), ("spec_bench", "qa", 3), ("spec_bench", "math_reasoning", 2))


class CalibrationError(InputError):
    """A calibration that cannot run (no candidate tree fits the head)."""


# ----------------------------------------------------------------------------------------------- keys
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_key(mesh=None) -> str:
    """Where step costs were measured: backend and device kind (CPU: processor model and cores), and the
    mesh shape when decoding is sharded."""
    import jax

    dev = jax.devices()[0]
    if dev.platform == "cpu":
        where = f"cpu: {_cpu_name()} x{os.cpu_count()}"
    else:
        where = f"{dev.platform}: {getattr(dev, 'device_kind', dev.platform)}"
    if mesh is not None:
        where += " mesh " + ",".join(f"{k}={v}" for k, v in dict(mesh.shape).items() if v > 1)
    return where


def entry_key(hardware: str, dtype: str, batch_size: int) -> str:
    return f"{hardware} | {dtype} | batch {int(batch_size)}"


# -------------------------------------------------------------------------------------------- storage
def cache_dir() -> Path:
    root = os.environ.get("CLOVER_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "clover_jax")
    return Path(root) / "calibration"


def _head_folder(head_source) -> Path | None:
    from clover_jax import pretrained

    if not isinstance(head_source, (str, os.PathLike)):
        return None
    path = pretrained.head_path(head_source)
    return path if path.is_dir() else None


_WEIGHT_SUFFIXES = (".safetensors", ".msgpack", ".bin", ".pt")
_DIGESTS: dict[tuple, str] = {}


def weights_digest(head_source) -> str | None:
    """A digest of the contents of a head folder's weight files (not their dates, so a fresh clone of a repository
    agrees with the copy that was calibrated); None for a head given as a module. A calibration saved with one
    digest is not reused for other weights (a head replaced in place, a run directory trained further)."""
    folder = _head_folder(head_source)
    if folder is None:
        return None
    files = sorted(p for p in folder.rglob("*") if p.is_file() and (p.suffix in _WEIGHT_SUFFIXES or
                                                                      "checkpoints" in p.relative_to(folder).parts))
    stamp = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    if stamp not in _DIGESTS:
        h = hashlib.sha1()
        for p in files:
            h.update(str(p.relative_to(folder)).encode())
            with p.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        _DIGESTS[stamp] = h.hexdigest()[:16]
    return _DIGESTS[stamp]


def calibration_files(head_source) -> list[Path]:
    """Where calibrations of this head are read from, in order: the head's folder, then the user cache."""
    folder = _head_folder(head_source)
    if folder is None:
        return []
    return [folder / FILE_NAME, cache_dir() / f"{weights_digest(head_source)}.json"]  # the cache: by contents


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def is_stale(entry: dict) -> bool:
    """An entry made by an older calibration (`VERSION`): it never measured some of today's candidates."""
    return int(entry.get("version", 1)) < VERSION


def load_entry(head_source, key: str, stale: list | None = None) -> dict | None:
    """The saved calibration entry for `key`; else one of the same hardware and dtype at the nearest batch
    size (a step's cost changes slowly with the batch); else None. Entries measured on other weights (their
    `weights` digest differs from the head's, `weights_digest`) are skipped, and so are stale ones (`is_stale`):
    their keys are appended to `stale` when it is given."""
    hardware, dtype, batch = key.split(" | ")
    nearest = None
    digest = weights_digest(head_source)
    for path in calibration_files(head_source):
        entries = {k: e for k, e in _read(path).get("entries", {}).items()
                   if not (digest and e.get("weights") and e["weights"] != digest)}
        if stale is not None:
            stale += [k for k, e in entries.items() if is_stale(e) and k.split(" | ")[:2] == [hardware, dtype]]
        entries = {k: e for k, e in entries.items() if not is_stale(e)}
        if entries.get(key):
            return entries[key]
        for k, entry in entries.items():
            h, d, b = k.split(" | ")
            if (h, d) == (hardware, dtype):
                gap = abs(int(b.split()[-1]) - int(batch.split()[-1]))
                if nearest is None or gap < nearest[0]:
                    nearest = (gap, entry)
    return nearest[1] if nearest else None


def save_entry(head_source, key: str, entry: dict) -> Path | None:
    """Adds `entry` under `key` to the head folder's calibration file, or the user cache's when the folder is
    not writable, stamped with the digest of the head's weights; returns the file (None for a head given as a
    module)."""
    digest = weights_digest(head_source)
    if digest:
        entry = {**entry, "weights": digest}
    for path in calibration_files(head_source):
        try:
            data = _read(path)
            # the shapes of the replaced entry's fitted trees stay in the file (`KEPT_TREES`): a name that a
            # registry's default tree or a user's script holds (`fit-5-411aab`) keeps resolving after a new
            # calibration fits other shapes (a fitted tree's name is a hash of its shape)
            replaced = (data.get("entries", {}).get(key) or {}).get("trees") or {}
            if replaced:
                data[KEPT_TREES] = {**replaced, **data.get(KEPT_TREES, {})}
            data.setdefault("entries", {})[key] = entry
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data, indent=1) + "\n")
            tmp.replace(path)
            return path
        except OSError:
            continue
    return None


# -------------------------------------------------------------------------------------------- measure
def _row(run: dict) -> dict:
    return {"tau": run["tau"], "speedup": run["speedup_vs_ar"], "tokens_per_second": run["tokens_per_second"],
            "accept_rate_per_depth": run["accept_rate_per_depth"]}


def candidate_trees(head, base, draft_vocab=None, candidates: Sequence[str] | None = None,
                    ngram_table=None) -> list[str]:
    """The candidate trees this head can draft (depth within its heads, tree kind supported by its drafter)."""
    from clover_jax.heads.registry import drafter_for
    from clover_jax.validation import InputError

    names = list(candidates) if candidates else list(STATIC_CANDIDATES + DYNAMIC_CANDIDATES + BEAM_CANDIDATES)
    ok = []
    for name in names:
        try:
            drafter_for(type(head), name, draft_vocab, ngram_table).check(head, base)
        except (InputError, ValueError):
            continue
        ok.append(name)
    return ok


def max_candidate_nodes() -> int:
    """The most tokens any default candidate verifies (to size a cache before `auto` is resolved)."""
    from clover_jax.decoding.tree import get_tree

    from clover_jax.decoding.tree_fit import probe_tree

    sizes = [get_tree(t).num_nodes for t in STATIC_CANDIDATES + DYNAMIC_CANDIDATES + BEAM_CANDIDATES]
    return max(sizes + [probe_tree(PROBE_WIDTHS).num_nodes]) + LOOKUP_LENGTH


def _lookup_variants(head, base, draft_vocab, trees: Sequence[str], ngram_table=None) -> list[str]:
    """`TREE+lookup-LOOKUP_LENGTH` for each of `trees` (distinct) the head can draft, and with an n-gram table
    also `TREE+lookup-LOOKUP_LENGTH-table` and the chain alone, `lookup-LOOKUP_LENGTH-table` (no head: the
    table and prompt lookup draft without the head's cost; `clover_jax.decoding.ngram`)."""
    ends = [""] + (["-table"] if ngram_table is not None else [])
    alone = [f"lookup-{LOOKUP_LENGTH}-table"] if ngram_table is not None else []
    return candidate_trees(head, base, draft_vocab, [f"{t}+lookup-{LOOKUP_LENGTH}{e}" for t in dict.fromkeys(trees)
                                                     for e in ends] + alone, ngram_table)


def probe_for(head, base, draft_vocab=None):
    """The deepest prefix of the probe comb (`PROBE_WIDTHS`) this head can draft (registered by name), or None
    for heads that draft no static tree."""
    from clover_jax.heads.registry import drafter_for
    from clover_jax.decoding.tree import register_tree
    from clover_jax.decoding.tree_fit import probe_tree

    for depth in range(len(PROBE_WIDTHS), 0, -1):
        spec = probe_tree(PROBE_WIDTHS[:depth])
        try:
            drafter_for(type(head), spec, draft_vocab).check(head, base)
        except (InputError, ValueError):
            continue
        return register_tree(spec)
    return None


def register_trees(entry: dict) -> None:
    """Makes a calibration entry's probe and fitted trees known by name in this process."""
    from clover_jax.decoding.tree import TreeSpec, register_tree

    for name, t in (entry.get("trees") or {}).items():
        register_tree(TreeSpec([tuple(c) for c in t["choices"]], top_k=int(t["top_k"]), name=name))


def register_saved_trees(head_source, trees) -> None:
    """Makes the probe and fitted trees of this head's saved calibrations known by name when `trees` (a tree
    name or names) asks for one (`tree="fit-3-c5bf00"` wherever the head is given by name or folder); other
    names read nothing."""
    names = [trees] if isinstance(trees, str) else list(trees or ())
    if not any(isinstance(t, str) and t.startswith(("fit-", "probe-")) for t in names):
        return
    for path in calibration_files(head_source):
        data = _read(path)
        register_trees({"trees": data.get(KEPT_TREES)})
        for entry in data.get("entries", {}).values():
            register_trees(entry)


def _fit(table: dict, runs: dict, names: dict, probe) -> tuple[list, dict]:
    """The fitted trees to measure (best predicted first) and what the fit found (per-rank acceptance, step
    cost points), from the first round's static runs."""
    from clover_jax.decoding.tree import TreeSpec, get_tree
    from clover_jax.decoding.tree_fit import fit_step_cost, fitted_candidates, rank_acceptance, smooth_acceptance

    static = {t: get_tree(t) for t in table if isinstance(get_tree(t), TreeSpec) and runs[names[t]].get("node_hist")}
    p, parents = rank_acceptance([(static[t], runs[names[t]]["node_hist"]) for t in static], probe.max_depth,
                                 max(PROBE_WIDTHS))
    points = [(spec.num_nodes, spec.max_depth, table[t]["tau"] / table[t]["speedup"]) for t, spec in static.items()
              if table[t]["speedup"] > 0]
    cost = fit_step_cost(points)
    max_nodes = max(spec.num_nodes for spec in static.values())
    measured = {spec.choices for spec in static.values()}
    picks = [(spec, tau, speed) for spec, tau, speed in
             fitted_candidates(smooth_acceptance(p, parents), cost, max_nodes, probe.max_depth,
                               count=FITTED_TO_MEASURE + len(measured))
             if spec.choices not in measured][:FITTED_TO_MEASURE]
    info = {"rank_acceptance": [[round(float(x), 4) for x in row] for row in p],
            "rank_parents": parents.astype(int).tolist(),
            "step_cost_points": [[int(a), int(b), round(float(c), 4)] for a, b, c in points]}
    return picks, info


def default_prompts() -> list[str]:
    from clover_jax.io.prompts import read_prompts

    out = []
    for source, category, n in DEFAULT_PROMPTS:
        out += read_prompts(source, category=category, limit=n)
    return out


def measure(loaded, head, *, prompts: Sequence[str] | None = None, candidates: Sequence[str] | None = None,
            batch_size: int = 1, max_new_tokens: int = 64, draft_vocab=None, mesh=None, fit: bool = True,
            progress: bool = False, ngram_table=None) -> dict[str, Any]:
    """Runs the calibration (see the module docstring); returns the entry to save, with `best` the tree name
    or "ar". `fit=False` measures the candidates only (no probe, no fitted trees). `ngram_table`: the head's
    n-gram table (`clover_jax.decoding.ngram`), for the final round's `...-table` lookup variants."""
    import jax

    from clover_jax.decoding.tree import TreeSpec, get_tree, register_tree
    from clover_jax.evaluation import DV, evaluate

    prompts = list(prompts) if prompts else default_prompts()
    trees = candidate_trees(head, loaded.model, draft_vocab, candidates, ngram_table)
    if not trees:
        raise CalibrationError(f"no candidate tree fits this head (tried {list(candidates or ())})")
    probe = probe_for(head, loaded.model, draft_vocab) if fit else None
    if probe is not None and probe.name not in trees:
        trees.append(probe.name)
    dv = DV if draft_vocab is not None else ""
    names = {t: t + dv for t in trees}
    t0 = time.perf_counter()
    res = evaluate(loaded, head, prompts, trees=list(names.values()), batch_size=batch_size,
                   max_new_tokens=max_new_tokens, draft_vocab=draft_vocab, progress=progress, mesh=mesh,
                   ngram_table=ngram_table)
    runs = res["runs"]
    mismatches = res["greedy_mismatches"]
    table = {t: _row(runs[names[t]]) for t in trees}
    fitted, fit_info = [], {}
    if probe is not None:
        fitted, fit_info = _fit(table, runs, names, probe)
    for spec, _, _ in fitted:
        register_tree(spec)
    final = list(table)  # the runs `best` is chosen from: the first round's, or the final round's
    finalists = sorted(table, key=lambda t: -table[t]["speedup"])[:FINALISTS]
    lookups = _lookup_variants(head, loaded.model, draft_vocab, [spec.name for spec, _, _ in fitted[:1]] + [
        t for t in finalists if isinstance(get_tree(t), TreeSpec)][:1], ngram_table)
    if fitted or lookups:
        # The final round measures the fitted trees beside the first round's fastest candidates, against the same
        # autoregressive runs: a speed-up measured in another round meets another baseline (the machine's speed
        # drifts between rounds), and the first round's maximum over many candidates is biased upwards. The best
        # static and fitted trees also run with a prompt-lookup chain beside them (`clover_jax.decoding.lookup`).
        more = {spec.name: spec.name + dv for spec, _, _ in fitted} | {t: names[t] for t in finalists} | {
            t: t + dv for t in lookups}
        res2 = evaluate(loaded, head, prompts, trees=list(more.values()), batch_size=batch_size,
                        max_new_tokens=max_new_tokens, draft_vocab=draft_vocab, progress=progress, mesh=mesh,
                        ngram_table=ngram_table)
        mismatches += res2["greedy_mismatches"]
        for spec, tau, speed in fitted:
            table[spec.name] = _row(res2["runs"][more[spec.name]]) | {
                "fitted": True, "predicted_tau": round(tau, 3), "predicted_speedup": round(speed, 3)}
        for t in finalists:
            table[t]["final_speedup"] = res2["runs"][more[t]]["speedup_vs_ar"]
        for t in lookups:
            table[t] = _row(res2["runs"][more[t]]) | {"lookup": True}
        final = list(more)
    speed = {t: table[t].get("final_speedup", table[t]["speedup"]) for t in final}
    best = max(speed, key=speed.get)
    if speed[best] <= 1.0:
        best = AR
    shapes = [probe] if probe is not None else []
    shapes += [spec for spec, _, _ in fitted]
    trees_out = {spec.name: {"choices": [list(c) for c in spec.choices], "top_k": spec.top_k} for spec in shapes}
    return {"best": best, "ar_tokens_per_second": runs["ar"]["tokens_per_second"], "candidates": table,
            "trees": trees_out, **fit_info, "greedy_mismatches": mismatches, "prompts": len(prompts),
            "batch_size": batch_size, "max_new_tokens": max_new_tokens, "seconds": round(time.perf_counter() - t0, 1),
            "date": time.strftime("%Y-%m-%d"), "backend": jax.default_backend(), "version": VERSION}


def resolve_auto(loaded, head, head_source=None, *, batch_size: int = 1, draft_vocab=None, mesh=None,
                 recalibrate: bool = False, ngram_table=None, **measure_kw) -> tuple[str, dict]:
    """(tree name or "ar", calibration entry) for `tree="auto"`: the saved calibration of this head for this
    hardware, dtype and batch size, else a new one (logged, and saved where `save_entry` can). `ngram_table`:
    None takes the one shipped beside the head named by `head_source`, if any."""
    import jax.numpy as jnp

    from clover_jax.decoding.ngram import resolve_ngram_table

    model = loaded.model if hasattr(loaded, "model") else loaded
    key = entry_key(hardware_key(mesh), jnp.dtype(model.dtype).name, batch_size)
    memo = (str(head_source) if head_source is not None else id(head), key)
    stale: list[str] = []
    entry = None if recalibrate else (_MEMO.get(memo) or load_entry(head_source, key, stale))
    if entry is None:
        why = (f"the saved one ({stale[0]}) predates candidates this version tries (calibration version "
               f"{VERSION})" if stale else f"no calibration of this head for {key}")
        msg = (f"tree='auto': {why}; calibrating now (autoregressive vs each candidate tree on a few prompts)")
        print(msg, file=sys.stderr)
        entry = measure(loaded, head, batch_size=batch_size, draft_vocab=draft_vocab, mesh=mesh,
                        ngram_table=resolve_ngram_table(ngram_table, head_source), **measure_kw)
        where = save_entry(head_source, key, entry)
        print(f"tree='auto' -> {entry['best']}" + (f" (saved in {where})" if where else ""), file=sys.stderr)
    register_trees(entry)
    _MEMO[memo] = entry
    return entry["best"], entry


# ------------------------------------------------------------------------------------------------ CLI
def main(argv=None) -> int:
    from clover_jax.cli import run_cli

    return run_cli(_main, argv)


def _main(argv=None) -> int:
    import jax.numpy as jnp

    from clover_jax.cli import add_debug_argument
    from clover_jax.decoding.tree import get_tree
    from clover_jax.heads.draft_vocab import head_draft_vocab
    from clover_jax.heads.loading import load_head
    from clover_jax.io.loader import load_model
    from clover_jax.io.prompts import read_prompts

    ap = argparse.ArgumentParser(prog="python -m clover_jax.calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--head", default="smollm2-135m-instruct-clover2")
    ap.add_argument("--prompts-file", help="questions to calibrate on (default: 8 Spec-Bench questions outside "
                    "MT-Bench: translation, QA, math)")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--candidates", nargs="+", help=f"trees to try (default: {' '.join(STATIC_CANDIDATES)} "
                    f"{' '.join(DYNAMIC_CANDIDATES)}, those the head supports)")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--mesh", default=None, help="calibrate sharded decoding, e.g. 'tp=8'")
    ap.add_argument("--no-fit", action="store_true", help="measure the candidates only: no probe tree and no trees "
                    "fitted to the head's per-rank acceptance")
    add_debug_argument(ap)
    args = ap.parse_args(argv)
    mesh = None
    if args.mesh:
        from clover_jax.parallel import parse_mesh

        mesh = parse_mesh(args.mesh)
    loaded = load_model(args.model, dtype=jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32, mesh=mesh)
    head = load_head(args.head, loaded.model)
    prompts = read_prompts(args.prompts_file, limit=args.limit) if args.prompts_file else None
    best, entry = resolve_auto(loaded, head, args.head, batch_size=args.batch_size, mesh=mesh, recalibrate=True,
                               draft_vocab=head_draft_vocab(args.head), prompts=prompts,
                               candidates=args.candidates, max_new_tokens=args.max_new_tokens, progress=True,
                               fit=not args.no_fit)
    print(f"\n{entry['prompts']} prompts, batch {args.batch_size}, {args.max_new_tokens} new tokens; "
          f"autoregressive {entry['ar_tokens_per_second']:.1f} tokens/s; {entry['greedy_mismatches']} greedy "
          "mismatches\n")
    print("| tree | nodes | tau | speedup vs AR | tokens/s | final round: speedup | fitted: predicted tau / speedup |")
    print("|---|---|---|---|---|---|---|")
    for tree, r in sorted(entry["candidates"].items(), key=lambda kv: -kv[1]["speedup"]):
        fitted = f"{r['predicted_tau']:.3f} / {r['predicted_speedup']:.3f}" if r.get("fitted") else ""
        final = r["final_speedup"] if "final_speedup" in r else (r["speedup"] if r.get("fitted") or r.get("lookup")
                                                                  else "")
        print(f"| {tree} | {get_tree(tree).num_nodes} | {r['tau']:.3f} | {r['speedup']:.3f} | "
              f"{r['tokens_per_second']:.1f} | {final} | {fitted} |")
    if entry.get("rank_acceptance"):
        print("\nacceptance per depth (rows) and child rank (columns), pooled over the static trees (the fit uses "
              "them smoothed: tree_fit.smooth_acceptance):")
        for d, row in enumerate(entry["rank_acceptance"]):
            print(f"  depth {d + 1}: " + " ".join(f"{x:.3f}" for x in row))
        for name, t in entry.get("trees", {}).items():
            print(f"  {name}: {t['choices']}")
    print(f"\nauto -> {best}" + (" (no tree beats autoregressive decoding here)" if best == AR else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
