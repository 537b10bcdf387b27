"""Evaluation harness: speculative vs autoregressive decoding on question sets, measured in the same run.

For each prompt batch: our autoregressive loop, then the speculative loop for each tree; compile
time is excluded from the timed calls (a warm-up per shape) and reported separately. tau counts the
tokens generated per base forward in the decode phase, bonus token included.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import numpy as np

from clover_jax.decoding import acceptance_stats
from clover_jax.decoding.sizes import bucket_length, cache_for_bucket
from clover_jax.decoding.tree import get_tree, is_table_tree
from clover_jax.generation.api import run_request
from clover_jax.generation.compiling import side_by_side
from clover_jax.generation.request import check_request
from clover_jax.heads.bundle import HeadBundle
from clover_jax.io.prompts import encode_prompts
from clover_jax.training.checkpoint import load_head_from_run
from clover_jax.tuning.choose import decide_fastest
from clover_jax.tuning.audit import UNEXPLAINED, audit_divergence, float32_copy, replay_check
from clover_jax.validation import InputError
from tqdm.auto import tqdm


@dataclasses.dataclass
class RunStats:
    name: str
    tokens: int = 0
    seconds: float = 0.0
    compile_seconds: float = 0.0
    steps: int = 0  # decode-phase base forwards summed over rows
    accept_hist: np.ndarray | None = None  # steps that accepted n drafts
    node_hist: np.ndarray | None = None  # [U] steps whose accepted path held tree node u (node 0: every step)
    per_prompt: list[dict] = dataclasses.field(default_factory=list)
    # per prompt batch, in order: (new tokens, timed seconds, decode-phase tokens, decode-phase steps); the units a
    # confidence interval resamples (`bootstrap_ci`)
    per_batch: list[tuple[int, float, int, int]] = dataclasses.field(default_factory=list)
    choice: dict | None = None  # the `chosen` run: what was chosen (`GenerationResult.stats["choice"]`)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    @property
    def tau(self) -> float | None:
        if self.accept_hist is None or self.accept_hist.sum() == 0:
            return None
        return acceptance_stats.tau(self.accept_hist)

    def accept_rates(self) -> list[float] | None:
        """P(depth d accepted | depth d-1 accepted), d = 1..Dmax."""
        return None if self.accept_hist is None else acceptance_stats.accept_rates(self.accept_hist)

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "tokens": self.tokens, "seconds": round(self.seconds, 3),
                "tokens_per_second": round(self.tokens_per_second, 2), "compile_seconds": round(self.compile_seconds, 2),
                "tau": None if self.tau is None else round(self.tau, 3),
                "accept_hist": None if self.accept_hist is None else self.accept_hist.tolist(),
                "accept_rate_per_depth": self.accept_rates(),
                "node_hist": None if self.node_hist is None else self.node_hist.tolist(),
                **({"choice": self.choice} if self.choice is not None else {})}


@dataclasses.dataclass
class Reference:
    """An evaluation's autoregressive run, kept to serve as the reference of later evaluations of the same prompts
    with the same settings (`evaluate(..., reference=...)`): its stats and its outputs, one token list per prompt."""
    run: RunStats
    outputs: list[list[int]]
    key: tuple  # what must match: prompts, batch size, new tokens, sampling, prompt bucket


DV = "+dv"  # tree-name suffix: run that tree with the draft vocabulary
CHOSEN = "chosen"  # the run of a request that names no tree: the head and tree chosen here (`tuning.choose`)
CI_LEVEL = 0.95
CI_RESAMPLES = 2000


def bootstrap_ci(num: np.ndarray, den: np.ndarray, *, level: float = CI_LEVEL, resamples: int = CI_RESAMPLES,
                 seed: int = 0) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the ratio of sums `sum(num[:, j]) / sum(den[:, j])`, multiplied over the
    columns j, resampling the rows (prompt batches) with replacement, all columns with the same rows.

    `num`, `den`: `[M]` or `[M, ratios]`, one row per batch. One column gives a rate (tau: decode-phase tokens over
    steps); two columns with `den[:, 1]`, `num[:, 1]` swapped give a ratio of two rates measured on the same batches
    (a speed-up: the tree's tokens/s over the autoregressive loop's, each batch timed back to back), so the interval
    reflects how the ratio varies from prompt to prompt and between timed calls, not only the overall mean. `None`
    with fewer than two rows (no spread to resample). Deterministic for a given `seed`.
    """
    num = np.asarray(num, np.float64).reshape(len(num), -1)  # [M, ratios]
    den = np.asarray(den, np.float64).reshape(len(den), -1)  # [M, ratios]
    n = num.shape[0]
    if n < 2:
        return None
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))  # [resamples, M]
    ratios = np.prod(num[idx].sum(axis=1) / den[idx].sum(axis=1), axis=-1)  # [resamples]
    lo, hi = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def evaluate(loaded, head, prompts: Sequence[str], *, trees: Sequence[str] = ("clover2-26",), batch_size: int = 1,
             max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             categories: Sequence[str] | None = None, progress: bool = True, draft_vocab=None, mesh=None,
             layers: str = "auto", ngram_table=None, replay: bool = False, chosen_head=None,
             known_trees=None, prompt_bucket: int | None = None, warmup_threads: int = 1,
             reference: Reference | None = None, keep_reference: bool = False) -> dict[str, Any]:
    """Runs AR and speculative decoding (one run per tree) on the prompts; returns stats and mismatches.

    `head`: the opened head (`clover_jax.heads.bundle.open_head`'s `HeadBundle`): its module drafts, its fitted
    trees resolve tree names, its draft vocabulary (for `+dv` runs) and n-gram table (for `...-table` trees) are used
    unless `draft_vocab` or `ngram_table` replace them; nothing is read from its folder again. A head module alone
    (no folder) drafts with what is passed. `mesh`: decode on a device mesh; `layers`: how the decoding loops run the
    layers (both as in `generate`). A tree named `chosen` runs a request that names no tree (`generate`'s default:
    the head and tree chosen for this machine, or plain decoding), with the head `chosen_head` (None: what a request
    with no head gets, `clover_jax.tuning.choose`; `loaded` must then know its name).

    `known_trees`: more trees named outside the grammar (a calibration's probe and fitted trees: name -> policy).
    `prompt_bucket`: every prompt padded to this length (one program per run; `generate`'s). `warmup_threads` > 1:
    every run's programs are compiled before the first timed call, that many at a time (`compile_seconds` per run:
    the wall time of its compiles, which overlap).

    `keep_reference`: the result's `reference` holds this evaluation's autoregressive run (a `Reference`, not JSON);
    `reference`: such a run of an earlier evaluation (same prompts and settings, e.g. another head's) is the
    autoregressive run of this one, not timed again: speed-ups and greedy comparisons are against it.

    A tree name ending in `+dv` (e.g. "chain-3+dv") runs that tree with the draft vocabulary `draft_vocab`
    (token ids, `clover_jax.heads.draft_vocab`), so both can be compared in one run.

    Greedy runs are audited (`clover_jax.tuning.audit`): every output that differs from autoregressive decoding
    gets its first divergence classified (`divergences`, `greedy_unexplained`); with `replay`, every speculative
    output is also certified on its own by a float32 replay of the base model (`replay`: per tree, the outputs,
    tokens, near-ties and violations)."""
    bundle = head if isinstance(head, HeadBundle) else HeadBundle(head)
    draft_vocab = bundle.draft_vocab if draft_vocab is None else draft_vocab
    ids = encode_prompts(loaded.tokenizer, list(prompts))
    ref_key = (tuple(map(tuple, ids)), batch_size, max_new_tokens, temperature, top_p, seed, prompt_bucket)
    if reference is not None and reference.key != ref_key:
        raise InputError("the reference run was made on other prompts or settings (prompts, batch size, new tokens, "
                         "sampling, prompt bucket must all match)")
    runs = {"ar": reference.run if reference is not None else RunStats("ar")} | {t: RunStats(t) for t in trees}
    ar_outputs: list[list[int]] = []
    if any(t.endswith(DV) for t in trees) and draft_vocab is None:
        raise InputError(f"trees {[t for t in trees if t.endswith(DV)]} ask for a draft vocabulary; pass draft_vocab")
    specs = {t: get_tree(t.removesuffix(DV), {**bundle.trees, **known_trees}) if known_trees else
             bundle.tree(t.removesuffix(DV)) for t in trees if t != CHOSEN}
    if ngram_table is None and any(is_table_tree(s) for s in specs.values()):
        ngram_table = bundle.ngram_table
    max_nodes = max([s.num_nodes for s in specs.values()] + [0])
    warmed = set()
    mismatches = 0
    compared = 0
    differ = {t: [] for t in trees}  # per tree: the indices of prompts whose greedy output differs from AR's
    divergences: list[dict[str, Any]] = []  # the first divergence of each differing output, classified
    replayed = {t: {"outputs": 0, "tokens": 0, "near_ties": 0, "violations": 0} for t in trees}
    replay_model = None  # the float32 replay model, made on first need
    batches = range(0, len(ids), batch_size)

    def call(name: str, chunk) -> tuple[Any, dict]:
        """(target, generate's keyword arguments) of a run on a batch."""
        bucket = prompt_bucket or bucket_length(max(len(p) for p in chunk))
        cache = cache_for_bucket(bucket, max_new_tokens, max_nodes)  # the cache every tree's run shares
        common = dict(cache_size=cache, temperature=temperature, top_p=top_p, mesh=mesh, layers=layers,
                      prompt_bucket=prompt_bucket)
        if name == "ar":
            return loaded.model, dict(common, mode="ar")
        if name == CHOSEN:  # no tree named (and the head only if `chosen_head`): what the user gets by default
            return loaded, dict(common, mode="speculative", head=chosen_head, cache_size=None, decide=decide_fastest,
                                run_loader=load_head_from_run)
        return loaded.model, dict(common, mode="speculative", head=bundle.module, tree=specs[name],
                                  draft_vocab=draft_vocab if name.endswith(DV) else None, ngram_table=ngram_table)

    def shape_key(name: str, chunk) -> tuple:
        return name, len(chunk), prompt_bucket or bucket_length(max(len(p) for p in chunk))

    if warmup_threads > 1:  # every program first, several at a time (XLA compiles outside Python's lock)
        todo = {}
        for start in batches:
            chunk = ids[start:start + batch_size]
            for name in runs:
                if name == "ar" and reference is not None:
                    continue
                todo.setdefault(shape_key(name, chunk), (name, chunk))

        def warm(item):
            name, chunk, target, kw = item
            run_request(check_request(target, chunk, max_new_tokens=1, decode_text=False, **kw))

        calls = [(name, chunk, *call(name, chunk)) for name, chunk in todo.values()]
        # the `chosen` run's first call may measure a choice: alone, before the others compile beside it
        first = [item for item in calls if item[0] == CHOSEN][:1]
        rest = [item for item in calls if not any(item is f for f in first)]
        for items, threads in ((first, 1), (rest, warmup_threads)):
            for item, seconds in zip(items, side_by_side(warm, items, threads=threads)):
                runs[item[0]].compile_seconds += seconds
        warmed.update(todo)
    for start in tqdm(batches, desc="eval", disable=not progress):
        chunk = ids[start:start + batch_size]
        outs = {}
        for name, run in runs.items():
            if name == "ar" and reference is not None:
                outs[name] = reference.outputs[start:start + len(chunk)]
                continue
            target, kw = call(name, chunk)
            key = shape_key(name, chunk)
            if key not in warmed:
                t0 = time.perf_counter()
                run_request(check_request(target, chunk, max_new_tokens=1, decode_text=False, **kw))
                run.compile_seconds += time.perf_counter() - t0
                warmed.add(key)
            res = run_request(check_request(target, chunk, max_new_tokens=max_new_tokens, seed=seed + start, decode_text=False,
                           **kw))
            if name == CHOSEN:
                run.choice = res.stats.get("choice")
            run.tokens += res.num_generated
            run.seconds += res.seconds
            run.steps += sum(res.row_steps)
            h = None
            if name != "ar":
                # plain decoding (a choice that found no tree pays here) accepts no draft: every step yields one token
                h = np.asarray(res.stats.get("accept_hist", [sum(res.row_steps)]))
                run.accept_hist = h if run.accept_hist is None else run.accept_hist + h
                nh = np.asarray(res.stats.get("node_hist", [sum(res.row_steps)]))
                run.node_hist = nh if run.node_hist is None else run.node_hist + nh
            decoded = (0, 0) if h is None else tuple(int(x) for x in acceptance_stats.tokens_and_steps(h))
            run.per_batch.append((res.num_generated, res.seconds, *decoded))
            for i, toks in enumerate(res.token_ids):
                rec = {"index": start + i, "tokens": len(toks)}
                if categories is not None:
                    rec["category"] = categories[start + i]
                if name != "ar":
                    rec["tau"] = res.stats["row_tau"][i] if "row_tau" in res.stats else 1.0
                run.per_prompt.append(rec)
            outs[name] = res.token_ids
        ar_outputs += [list(t) for t in outs["ar"]]
        if temperature == 0.0:
            for name in trees:
                for i, (a, s) in enumerate(zip(outs["ar"], outs[name])):
                    compared += 1
                    mismatches += int(a != s)
                    if a != s or replay:
                        replay_model = replay_model or float32_copy(loaded.model)
                    if a != s:
                        differ[name].append(start + i)
                        d = audit_divergence(loaded.model, chunk[i], a, s, replay_model=replay_model)
                        divergences.append({"tree": name, "prompt": start + i, **d.to_dict()})
                    if replay:
                        check = replay_check(loaded.model, chunk[i], s, replay_model=replay_model)
                        rec = replayed[name]
                        rec["outputs"] += 1
                        rec["tokens"] += check.tokens
                        rec["near_ties"] += len(check.near_ties)
                        rec["violations"] += len(check.violations)
    result = {"runs": {k: v.summary() for k, v in runs.items()},
              "greedy_mismatches": mismatches if temperature == 0.0 else None,
              "greedy_compared": compared if temperature == 0.0 else None,
              "greedy_differing_prompts": differ if temperature == 0.0 else None,
              "divergences": divergences if temperature == 0.0 else None,
              "greedy_unexplained": sum(d["verdict"] == UNEXPLAINED for d in divergences) if temperature == 0.0
              else None,
              "replay": replayed if (replay and temperature == 0.0) else None,
              "per_prompt": {k: v.per_prompt for k, v in runs.items()},
              "per_batch": {k: [[n, round(sec, 4), dt, ds] for n, sec, dt, ds in v.per_batch] for k, v in runs.items()}}
    if reference is not None:
        result["runs"]["ar"]["reused"] = True
    if keep_reference:
        result["reference"] = reference or Reference(runs["ar"], ar_outputs, ref_key)
    ar_tps = runs["ar"].tokens_per_second
    for t in trees:
        result["runs"][t]["speedup_vs_ar"] = round(runs[t].tokens_per_second / ar_tps, 3)
        tau = runs[t].tau
        result["runs"][t]["speedup_over_tau"] = round(runs[t].tokens_per_second / ar_tps / tau, 3) if tau else None
        tree, ar = np.asarray(runs[t].per_batch), np.asarray(runs["ar"].per_batch)  # [M, 4] each: one row per batch
        if len(tree):
            # tree tokens/s over AR tokens/s: (tokens_t / seconds_t) * (seconds_ar / tokens_ar)
            speed = bootstrap_ci(np.stack([tree[:, 0], ar[:, 1]], 1), np.stack([tree[:, 1], ar[:, 0]], 1))
            stepped = tree[tree[:, 3] > 0]  # a batch with no decode step adds nothing to tau
            taus = bootstrap_ci(stepped[:, 2], stepped[:, 3])
            result["runs"][t]["speedup_ci95"] = None if speed is None else [round(x, 3) for x in speed]
            result["runs"][t]["tau_ci95"] = None if taus is None else [round(x, 3) for x in taus]
    return result
