"""`tree="auto"`: the draft tree that makes this head fastest on this hardware, measured and remembered.

    python -m clover_jax.cli.calibrate --model smollm2-135m-instruct --head smollm2-135m-instruct-clover2
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

For heads that draft static trees the calibration also fits trees to the head (`clover_jax.decoding.trees.fit`,
after Sequoia, Chen et al. 2024): a probe tree (a comb of the first child ranks along the top-1 path) joins the
candidates, the loop's per-node acceptance counts of every static run give the head's acceptance per depth and
child rank, a least-squares model of the step cost in verified tokens and depth comes from the same runs, and
the fitted trees with the highest predicted speed are measured in a final round, beside the first round's two
fastest candidates measured again, and `auto` is the fastest tree of that final round (one baseline for all of
them: each round times its own autoregressive runs, and a first round's winner can lose to a fitted tree once
both are timed against the same one). Fitted trees are named `fit-N-<hash>`
(N nodes, root included); the calibration stores their shapes, so `auto` can pick one, and keeps the shapes of
an entry it replaces (`kept_trees`), so a fitted tree named elsewhere (a registered head's default tree) still
resolves after a new calibration fits other shapes. The final round also runs
the best fitted tree and the first round's best static tree with a prompt-lookup chain of `LOOKUP_LENGTH` tokens
beside them (`TREE+lookup-4`, `clover_jax.decoding.lookup`), so `auto` can pick a merged tree where it pays.

A calibration is keyed by the hardware (backend and device kind; on a CPU the processor model and core
count), the compute dtype and the batch size; it is saved beside the head (`calibration.json` in the head's
folder) when that folder is writable, else in `~/.cache/clover_jax/calibration/` (`CLOVER_JAX_CACHE`
overrides), and reused by later runs. `auto` without a saved calibration for this hardware runs one and says
so (minutes on a CPU for the presets alone, about twice that with the probe and the fitted trees;
`--candidates` and `--no-fit` shorten it).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from clover_jax.decoding.ngram import resolve_ngram_table
from clover_jax.decoding.tree import TreeSpec, get_tree
from clover_jax.decoding.trees.fit import (
    fit_step_cost,
    fitted_candidates,
    probe_tree,
    rank_acceptance,
    smooth_acceptance,
)
from clover_jax.generation.calibration import (
    AR,
    VERSION,
    CalibrationError,
    entry_key,
    hardware_key,
    load_entry,
    save_entry,
)
from clover_jax.generation.request import AUTO, NAMED, Request
from clover_jax.generation.draft import shipped_head
from clover_jax.heads.folder import HeadFolder, fitted_trees
from clover_jax.io.loader import LoadedModel
from clover_jax.heads.registry import drafter_for
from clover_jax.io.prompts import read_prompts
from clover_jax.training.loading import open_head_or_run
from clover_jax.tuning.evaluation import DV, evaluate
from clover_jax.validation import InputError

_MEMO: dict[tuple, dict] = {}  # (head, entry key) -> entry, for heads whose calibration cannot be saved

STATIC_CANDIDATES = ("chain-1", "chain-2", "chain-3", "chain-4", "small-10", "clover2-26")
DYNAMIC_CANDIDATES = ("dynamic-4", "dynamic-6", "dynamic-10", "dynamic-16", "dynamic-26")
BEAM_CANDIDATES = ("beam-2x3", "beam-2x4", "beam-3x4", "beam-4x5")  # for beam-search drafters (ReDrafter)
PROBE_WIDTHS = (8, 6, 4, 3, 3)  # child ranks measured per depth by the probe tree: 24 drafts, 25 nodes
FITTED_TO_MEASURE = 2  # fitted trees measured per calibration (the best predicted ones)
FINALISTS = 2  # the first round's fastest candidates, measured again beside the fitted trees
LOOKUP_LENGTH = 4  # the final round also runs its best static tree and best fitted tree with a lookup chain this long
# Spec-Bench categories other than MT-Bench's, so a calibration does not see the usual evaluation prompts
DEFAULT_PROMPTS = (("spec_bench", "translation", 3), ("spec_bench", "qa", 3), ("spec_bench", "math_reasoning", 2))


# -------------------------------------------------------------------------------------------- measure
def _row(run: dict) -> dict:
    return {"tau": run["tau"], "speedup": run["speedup_vs_ar"], "tokens_per_second": run["tokens_per_second"],
            "accept_rate_per_depth": run["accept_rate_per_depth"]}


def candidate_trees(head, base, draft_vocab=None, candidates: Sequence[str] | None = None,
                    ngram_table=None, known=None) -> list[str]:
    """The candidate trees this head can draft (depth within its heads, tree kind supported by its drafter)."""

    names = list(candidates) if candidates else list(STATIC_CANDIDATES + DYNAMIC_CANDIDATES + BEAM_CANDIDATES)
    ok = []
    for name in names:
        try:
            drafter_for(type(head), get_tree(name, known), draft_vocab, ngram_table).check(head, base)
        except (InputError, ValueError):
            continue
        ok.append(name)
    return ok


def max_candidate_nodes() -> int:
    """The most tokens any default candidate verifies (to size a cache before `auto` is resolved)."""
    sizes = [get_tree(t).num_nodes for t in STATIC_CANDIDATES + DYNAMIC_CANDIDATES + BEAM_CANDIDATES]
    return max(sizes + [probe_tree(PROBE_WIDTHS).num_nodes]) + LOOKUP_LENGTH


def _lookup_variants(head, base, draft_vocab, trees: Sequence[str], ngram_table=None, known=None) -> list[str]:
    """`TREE+lookup-LOOKUP_LENGTH` for each of `trees` (distinct) the head can draft, and with an n-gram table
    also `TREE+lookup-LOOKUP_LENGTH-table` and the chain alone, `lookup-LOOKUP_LENGTH-table` (no head: the
    table and prompt lookup draft without the head's cost; `clover_jax.decoding.ngram`)."""
    ends = [""] + (["-table"] if ngram_table is not None else [])
    alone = [f"lookup-{LOOKUP_LENGTH}-table"] if ngram_table is not None else []
    return candidate_trees(head, base, draft_vocab, [f"{t}+lookup-{LOOKUP_LENGTH}{e}" for t in dict.fromkeys(trees)
                                                     for e in ends] + alone, ngram_table, known)


def probe_for(head, base, draft_vocab=None):
    """The deepest prefix of the probe comb (`PROBE_WIDTHS`) this head can draft, or None for heads that draft no
    static tree."""

    for depth in range(len(PROBE_WIDTHS), 0, -1):
        spec = probe_tree(PROBE_WIDTHS[:depth])
        try:
            drafter_for(type(head), spec, draft_vocab).check(head, base)
        except (InputError, ValueError):
            continue
        return spec
    return None


def _fit(table: dict, runs: dict, names: dict, probe) -> tuple[list, dict]:
    """The fitted trees to measure (best predicted first) and what the fit found (per-rank acceptance, step
    cost points), from the first round's static runs."""

    known = {probe.name: probe}
    static = {t: get_tree(t, known) for t in table
              if isinstance(get_tree(t, known), TreeSpec) and runs[names[t]].get("node_hist")}
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
    known = {probe.name: probe} if probe is not None else {}  # trees named here, not by the grammar
    res = evaluate(loaded, head, prompts, trees=list(names.values()), batch_size=batch_size,
                   max_new_tokens=max_new_tokens, draft_vocab=draft_vocab, progress=progress, mesh=mesh,
                   ngram_table=ngram_table, known_trees=known)
    runs = res["runs"]
    mismatches = res["greedy_mismatches"]
    table = {t: _row(runs[names[t]]) for t in trees}
    fitted, fit_info = [], {}
    if probe is not None:
        fitted, fit_info = _fit(table, runs, names, probe)
    known.update({spec.name: spec for spec, _, _ in fitted})
    final = list(table)  # the runs `best` is chosen from: the first round's, or the final round's
    finalists = sorted(table, key=lambda t: -table[t]["speedup"])[:FINALISTS]
    lookups = _lookup_variants(head, loaded.model, draft_vocab, [spec.name for spec, _, _ in fitted[:1]] + [
        t for t in finalists if isinstance(get_tree(t, known), TreeSpec)][:1], ngram_table, known)
    if fitted or lookups:
        # The final round measures the fitted trees beside the first round's fastest candidates, against the same
        # autoregressive runs: a speed-up measured in another round meets another baseline (the machine's speed
        # drifts between rounds), and the first round's maximum over many candidates is biased upwards. The best
        # static and fitted trees also run with a prompt-lookup chain beside them (`clover_jax.decoding.lookup`).
        more = {spec.name: spec.name + dv for spec, _, _ in fitted} | {t: names[t] for t in finalists} | {
            t: t + dv for t in lookups}
        res2 = evaluate(loaded, head, prompts, trees=list(more.values()), batch_size=batch_size,
                        max_new_tokens=max_new_tokens, draft_vocab=draft_vocab, progress=progress, mesh=mesh,
                        ngram_table=ngram_table, known_trees=known)
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
    model = loaded.model if hasattr(loaded, "model") else loaded
    key = entry_key(hardware_key(mesh), jnp.dtype(model.dtype).name, batch_size)
    folder = head_source if isinstance(head_source, HeadFolder) else None
    memo = (str(getattr(head_source, "name", head_source)) if head_source is not None else id(head), key)
    stale: list[str] = []
    entry = None if recalibrate else (_MEMO.get(memo) or load_entry(head_source, key, stale))
    if entry is None:
        why = (f"the saved one ({stale[0]}) predates candidates this version tries (calibration version "
               f"{VERSION})" if stale else f"no calibration of this head for {key}")
        msg = (f"tree='auto': {why}; calibrating now (autoregressive vs each candidate tree on a few prompts)")
        print(msg, file=sys.stderr)
        entry = measure(loaded, head, batch_size=batch_size, draft_vocab=draft_vocab, mesh=mesh,
                        ngram_table=(ngram_table if ngram_table is not None else folder.ngram_table) if folder
                        else resolve_ngram_table(ngram_table), **measure_kw)
        where = save_entry(head_source, key, entry)
        print(f"tree='auto' -> {entry['best']}" + (f" (saved in {where})" if where else ""), file=sys.stderr)
    _MEMO[memo] = entry
    return entry["best"], entry


def decide_auto(request: Request) -> tuple[Request, tuple[str, ...], dict | None]:
    """(request with its tree decided, notes, choice) for `tree="auto"`: the tree the head's calibration here
    found fastest (`resolve_auto`: calibrating when none is saved, which needs a tokenizer), or plain decoding."""
    if not request.speculative or request.tree_rule != AUTO:
        return request, (), None
    head = request.head if request.head is not None else shipped_head(request.model_source)
    bundle = open_head_or_run(head, request.model)
    key = entry_key(hardware_key(request.mesh), jnp.dtype(request.model.dtype).name, request.batch_size)
    if request.tokenizer is None and (bundle.folder is None or load_entry(bundle.folder, key) is None):
        raise InputError("tree='auto': this head has no calibration for this hardware, and calibrating needs a "
                         "tokenizer (pass tokenizer=..., or run python -m clover_jax.cli.calibrate first)")
    loaded = LoadedModel(request.model.config, request.model, request.tokenizer, request.model_source or "")
    draft_vocab = request.draft_vocab if request.draft_vocab is not None else bundle.draft_vocab
    best, entry = resolve_auto(loaded, bundle.module, bundle.folder, batch_size=request.batch_size,
                               draft_vocab=draft_vocab, mesh=request.mesh,
                               ngram_table=request.ngram_table if request.ngram_table is not None
                               else bundle.ngram_table)
    about = {"tree": best, "by": "calibration"}
    if best == AR:
        return (request.replace(speculative=False),
                ("tree auto -> ar (autoregressive: no tree beats it on this hardware)",), about)
    known = fitted_trees({"entries": {key: entry}})
    tree = known[best] if best in known else bundle.tree(best)
    return request.replace(head=bundle, tree=tree, tree_rule=NAMED), (f"tree auto -> {best}",), about
