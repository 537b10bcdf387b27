"""What speculative decoding drafts with when the request names no tree: the head and tree that are fastest on this
machine, dtype and batch size, or plain autoregressive decoding when none pays.

    clover_jax.generate(lm, prompts, mode="speculative")        # the default head's tree or AR (or a saved choice)
    clover_jax.generate(lm, prompts, mode="speculative", head="smollm2-135m-instruct-eagle")  # that head's tree or AR
    python -m clover_jax.cli.calibrate --quick --model smollm2-135m-instruct   # compare every shipped head (refresh)

A request's time is the loop's iterations times an iteration's cost. Plain decoding iterates once per token of the
longest reply in the batch; speculative decoding once per step of the row that needs the most steps. So the
speed-up of a tree is `tau_B / cost`: `tau_B`, the longest reply's tokens over the most steps of a batch's rows,
depends on the head and the text, not on the machine (at batch 1 it is tau, tokens per step; at a larger batch the
row that accepts least sets the pace); `cost`, an iteration's time in decode iterations, depends on the machine,
the dtype and the batch size (a verify of many tokens costs several decode steps on a small CPU, barely more than
one on a GPU at batch 1), and not on the text (shapes are static). The choice measures the cost here and takes
`tau_B` from a reference:

1. Candidates, the default first: the named head's default tree; with no head named, the default head's
   (`clover_jax.pretrained`), and, when every candidate is compared (`compare="all"`, `calibrate --quick`), each
   other shipped head's default tree and the head-less chains `lookup-4-table` and `lookup-2-table` (prompt
   lookup, else the model's n-gram table; `lookup-4` / `lookup-2` where there is no table). A request compares
   its default tree with plain decoding (two programs; at a batch above 1 the shortest head-less chain too, as
   verifying gets dearer with the batch; a saved comparison of every candidate is used where there is one), on its
   own shapes (prompt bucket, cache size, layers), so that the default tree's program it compiles is the one the
   request then runs; where its batch's prompt tokens pass `REUSE_TOKENS`, on its cache sizes with the prompts cut
   to the smallest bucket (each call prefills the batch). It times rounds for `REQUEST_BUDGET_S` after its warm-up
   (one round at least), and above batch `LARGE_BATCH` its calls decode fewer tokens.
2. For each candidate and our autoregressive loop, on `PROMPTS` (a short held-out Spec-Bench question, repeated to
   the batch size; cut to a request's prompt bucket): the jitted call for 1 new token and for `NEW_TOKENS` new
   tokens, after a warm-up that compiles every program side by side. `ROUNDS` rounds time every program's two calls,
   in an order turned by one each round. A program's iteration time is its fastest long call less its fastest short
   call (prefill, dispatch and compile cancel), over the loop iterations between them: a call's time varies from
   call to call and does not fall below what it costs, so each call's fastest is the estimate least disturbed
   (`clover_jax.tuning.timing`; the fastest round's difference of two disturbed calls was not). On a GPU, where every loop runs its layers unrolled and such a loop compiles in time growing
   faster than the depth, an unrolled loop is timed on the model's first `PROBE_DEPTHS` layers
   (`clover_jax.models.llama.first_layers`) and its iteration time extrapolated to the full depth (affine in the
   depth); elsewhere every loop runs on the full model, so the measurement also sees each tree's speed-up and
   compares its tokens with plain decoding's.
3. `cost` is the tree's iteration time over plain decoding's. `tau_B` comes from the head's
   `calibration.json` `reference` (per held-out ShareGPT prompt: decode tokens and steps of the tree at batch 1,
   the command beside them): the mean over random batches of `batch_size` of those prompts of the longest reply
   over the most steps (`batch_tau`). A head without a reference keeps what the measurement saw (the longest reply's new
   tokens over the tree's iterations, drafted on the full model): a few short prompts tell the cost well and the
   acceptance badly.
4. `decide`: the default candidate (the default head's tree, or the named head's) is kept unless another one, or
   plain decoding at 1.0x, is predicted more than `TOLERANCE` (10%) faster; then the fastest. The choice, its
   reason, what was compared and every candidate's numbers are kept in the user's cache
   (`~/.cache/clover_jax/calibration/choices.json`, `CLOVER_JAX_CACHE` overrides), keyed by the heads' weights,
   the hardware, the dtype and the batch size, and announced on stderr in one line when made. A request's choice
   that is not clear (`CLEAR_MARGIN`) and has fewer than `ROUNDS` rounds, or departs from the default on one
   measurement, is measured again by the next request and merged (`settled`, `merge`).

How long a choice takes and what it chose for SmolLM2-135M are in docs/trees.md and docs/results.md. A measured
choice is reused afterwards. The full calibration
(`tree="auto"`, `clover_jax.tuning.calibrate`) searches many more trees and fits new ones.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax import pretrained
from clover_jax.decoding import acceptance_stats
from clover_jax.decoding.lookup import NoHead
from clover_jax.decoding.sizes import MIN_BUCKET, bucket_length
from clover_jax.generation.api import run_request
from clover_jax.generation.calibration import AR, entry_key, hardware_key
from clover_jax.generation.compiling import side_by_side
from clover_jax.generation.plan import plan_request
from clover_jax.generation.request import DEFAULT, FASTEST, NAMED, Request, check_request
from clover_jax.heads.bundle import HeadBundle
from clover_jax.io.loader import LoadedModel
from clover_jax.heads.folder import HeadFolder, cache_dir, open_folder, read_json
from clover_jax.io.files import update_json
from clover_jax.io.prompts import read_prompts
from clover_jax.models.llama import first_layers
from clover_jax.tuning.timing import at_depth, per_iteration
from clover_jax.training.loading import open_head_or_run
from clover_jax.validation import InputError

VERSION = 7  # a saved choice of another version is measured again
# a short question outside MT-Bench's categories: a step's cost grows with the context (attention over the cache), so
# the prompt is of a chat request's length (40 tokens: one prompt bucket, one program per run), not a long document's
PROMPTS = (("spec_bench", "qa", 1),)
NEW_TOKENS = 16
CACHE_SIZE = 512  # every call of the measurement: one compiled program per run, a chat request's cache
ROUNDS = 3
# a request's measurement (`compare="request"`) stops timing rounds where one more would end past this many seconds
# after its warm-up (it times one round at least): on a 2-core CPU a round of two programs takes under 3 s at batch 1
# (three rounds fit), while from batch 2 on one round of three programs does (docs/trees.md)
REQUEST_BUDGET_S = 10.0
# a request's measurement is settled (kept without measuring again) when its decision is clear, the speed-up chosen
# (plain decoding's 1.0 counted) at least this times the next one's, or when it has `ROUNDS` rounds and, where it
# departs from the default candidate, a second measurement; else the next request (in this process or another)
# measures again within the budget, and each run's iteration time is the fastest of the measurements (`merge`), up
# to `MEASUREMENTS` of them. A single measurement on a 2-core CPU once put the default tree at 3.17 decode steps where
# two other processes measured 2.32 and 2.34 (its choice of plain decoding would otherwise be kept for good), and a
# budget of one round at a large batch is noisier still
CLEAR_MARGIN = 1.25
MEASUREMENTS = 3
# a request's measurement runs its request's own shapes (the default tree's program is then the one the request runs)
# while the batch's prompt tokens (rows x prompt bucket) stay within this; above, it cuts the prompts to the smallest
# bucket and keeps the request's cache sizes: each call prefills, and on a 2-core CPU a call for one new token takes
# 3.6 s for 16 prompts of 128 tokens and 0.5 s for 8 of 32, where compiling the request's own program anew takes 6-11 s
REUSE_TOKENS = 512
# the new tokens of a request's long calls above batch 4: at batch 16 on a 2-core CPU, plain decoding's 16 tokens
# take 2.7 s and the default tree's 5.4 s
LARGE_BATCH, LARGE_BATCH_NEW_TOKENS = 4, 8
# on a GPU every loop runs the layers unrolled, whose compile grows faster than the depth: such a loop is timed on the
# model's first 2 and 8 layers and its iteration time extrapolated to the full depth. On a CPU an unrolled loop
# compiles in time growing more slowly than the depth (SmolLM2's plain decoding on a 2-core CPU: 6.0 s for its 30
# layers alone, 2.4 s and 4.8 s for its first 2 and 8 layers compiled beside the other programs): every loop is timed
# on the full model
PROBE_DEPTHS = (2, 8)
PROBE_BACKENDS = ("gpu",)
PROBE_REPEATS = 3  # times per round a loop on a part of the model is timed
# another candidate (plain decoding included) replaces the default one (the first: the default head's tree) only when
# predicted this much faster: on a 2-core CPU a speculative loop's time varies by up to 25% from call to call, and a
# prediction from three calls' fastest by 10-15% from one measurement to the next
TOLERANCE = 0.10
HEADLESS = ("lookup-4-table", "lookup-2-table")
CHOICES_FILE = "choices.json"
# what a measurement compares with plain decoding: a request's few candidates (the default tree; at a batch above 1
# the shortest head-less chain too, as verifying gets dearer with the batch), or every candidate (`python -m
# clover_jax.cli.calibrate --quick`)
REQUEST, ALL = "request", "all"
SCOPES = (REQUEST, ALL)


@dataclasses.dataclass(frozen=True)
class Choice:
    head: str | None  # the head's name or folder; None for a head-less chain (or plain decoding)
    tree: str  # the tree, or "ar" for plain autoregressive decoding
    predicted: float  # predicted speed-up over plain decoding (1.0 for plain decoding)
    note: str  # one line: what was chosen and why
    entry: dict = dataclasses.field(default_factory=dict, compare=False)  # the measurement it was chosen from
    bundle: HeadBundle | None = dataclasses.field(default=None, compare=False)  # the chosen head, where it was opened
    announced: bool = False  # its note was printed on stderr when it was made (measured by this call)


Head = HeadBundle | HeadFolder | str | None  # a candidate's head: opened, its folder, a name or path; None: head-less


def _name(head: Head) -> str | None:
    """How a saved choice names a candidate's head: its registered name, else its source as given."""
    return head if head is None or isinstance(head, str) else head.name


def _label(head: Head, tree: str) -> str:
    return tree if head is None else f"{_name(head)} {tree}"


def shipped_folders(model_source) -> list[HeadFolder]:
    """The folders of the model's shipped heads (`clover_jax.pretrained`), the default head first, each opened once
    for a choice: their digests key it, their references price it, their default trees are its candidates."""
    return [open_folder(h) for h in pretrained.heads_for(model_source)] if model_source else []


def candidates(shipped: Sequence[HeadFolder], head: HeadBundle | None = None, *, has_table: bool,
               compare: str = ALL, batch_size: int = 1) -> list[tuple[Head, str]]:
    """(head or None, tree) pairs to measure, the default one first: the named head's default tree, or, when no
    head is named, the default (first) shipped head's default tree, then every other shipped head's and the
    head-less chains (`compare="all"`), or, for a request (`compare="request"`), at a batch above 1 the shortest
    head-less chain."""
    if compare not in SCOPES:
        raise ValueError(f"compare: expected one of {SCOPES}, got {compare!r}")
    if head is not None:
        return [(head, head.default_tree)]
    out: list[tuple[Head, str]] = [(f, f.default_tree) for f in shipped]
    headless = HEADLESS if has_table else tuple(t.removesuffix("-table") for t in HEADLESS)
    out += [(None, t) for t in headless]
    if compare == REQUEST:
        return out[:1] + ([(None, headless[-1])] if batch_size > 1 and out[0][0] is not None else [])
    return out


def _folder(head: Head) -> HeadFolder | None:
    if isinstance(head, HeadBundle):
        return head.folder
    return open_folder(head) if isinstance(head, (str, os.PathLike)) else head


def reference(head: Head, tree: str, shipped: Sequence[HeadFolder] = ()) -> dict | None:
    """The reference of `tree` drafted by `head` (its folder's `calibration.json` `reference`: `tau` and
    `per_prompt` [[decode tokens, steps], ...]); for a head-less chain (None), from the first of the model's
    `shipped` head folders that has one."""
    folders = [_folder(head)] if head is not None else list(shipped)
    for folder in folders:
        if folder is None:
            continue
        try:
            ref = folder.reference
        except (OSError, ValueError, TypeError):
            continue
        if tree in (ref.get("tau") or {}):
            return {"tau": float(ref["tau"][tree]), "per_prompt": (ref.get("per_prompt") or {}).get(tree)}
    return None


def reference_tau(head: Head, tree: str, shipped: Sequence[HeadFolder] = ()) -> float | None:
    """The reference tau (batch 1) of `tree` drafted by `head`, or None."""
    ref = reference(head, tree, shipped)
    return ref["tau"] if ref else None


def batch_tau(per_prompt, batch_size: int, draws: int = 512, seed: int = 0) -> float:
    """Tokens per loop iteration of batches of `batch_size` prompts drawn (without replacement within a batch) from
    `per_prompt` `[[decode tokens, steps], ...]` (one prompt each, drafted alone): the sum over batches of the
    longest reply's tokens over the sum of the most steps of a row. At batch 1, tokens over steps (tau)."""
    a = np.asarray(per_prompt, np.float64)  # [P, 2]
    if batch_size <= 1 or len(a) < 2:
        return float(a[:, 0].sum() / max(a[:, 1].sum(), 1.0))
    rng = np.random.default_rng(seed)
    size = min(batch_size, len(a))
    idx = np.stack([rng.choice(len(a), size=size, replace=False) for _ in range(draws)])  # [draws, B]
    return float(a[idx, 0].max(axis=1).sum() / max(a[idx, 1].max(axis=1).sum(), 1.0))


def _decode(loaded, units, new_tokens: int, **kw) -> tuple[float, float, int, list, list, int]:
    """(seconds of the calls for one new token and for `new_tokens`, the loop iterations between them, summed over
    the prompt batches `units`; the long calls' token ids and accept histograms, the longest reply's new tokens
    summed over the batches). The difference of the two calls is the decode phase: prefill and dispatch cancel."""
    short_s, long_s, iterations, ids, hists, longest = 0.0, 0.0, 0, [], [], 0
    for rows in units:
        short = run_request(check_request(loaded, rows, max_new_tokens=1, decode_text=False, **kw))
        long = run_request(check_request(loaded, rows, max_new_tokens=new_tokens, decode_text=False, **kw))
        short_s, long_s = short_s + short.seconds, long_s + long.seconds
        iterations += long.steps - short.steps
        ids.append(long.token_ids)
        hists.append(long.stats.get("accept_hist"))
        longest += max(len(t) for t in long.token_ids) - 1
    return short_s, long_s, iterations, ids, hists, longest


@dataclasses.dataclass(frozen=True)
class _Variant:
    """One program the measurement times: a run (plain decoding or a candidate) on the full model or on its first
    `depth` layers (`clover_jax.models.llama.first_layers`)."""
    run: str
    depth: int
    loaded: Any
    kw: dict

    @property
    def name(self) -> str:
        return f"{self.run} @{self.depth}"


def _layers_form(loaded, kw: dict) -> str:
    """How the run's loop runs the base model's layers here (`"unrolled"` or `"scan"`), as its request would."""
    plan = plan_request(check_request(loaded, ["x"], max_new_tokens=NEW_TOKENS, check_free_memory=False, **kw))
    return plan.loop.layers


def _variants(loaded, runs: dict[str, dict], full_depth: set[str], backend: str | None = None) -> list[_Variant]:
    """The programs to time: on a backend of `PROBE_BACKENDS`, a run whose layers run unrolled on the first
    `PROBE_DEPTHS` layers of the model (its compile grows faster than the depth; its step time is affine in it);
    a scanned one (compiled once whatever the depth), every run on another backend and the runs in `full_depth` on
    the full model."""
    num_layers = loaded.model.config.num_hidden_layers
    probe = (backend or jax.default_backend()) in PROBE_BACKENDS and num_layers > PROBE_DEPTHS[-1]
    truncated: dict[int, LoadedModel] = {}
    out = []
    for run, kw in runs.items():
        form = _layers_form(loaded, kw)
        if not probe or form != "unrolled" or run in full_depth:
            out.append(_Variant(run, num_layers, loaded, kw))
            continue
        for depth in PROBE_DEPTHS:
            if depth not in truncated:  # no end-of-sequence token: every call runs its new tokens
                model = first_layers(loaded.model, depth, eos_token_ids=())
                truncated[depth] = LoadedModel(model.config, model, loaded.tokenizer, loaded.source, loaded.name)
            out.append(_Variant(run, depth, truncated[depth], dict(kw, layers=form)))
    return out


def decide(table: dict[str, dict], default: str | None) -> str:
    """What to draft with, from `table`'s `predicted_speedup`s and plain decoding's 1.0 (`AR`): the fastest, unless
    the `default` candidate is predicted within `TOLERANCE` of it (a difference the measurement does not resolve keeps
    the default tree: plain decoding replaces it only where it is predicted below 1 / (1 + TOLERANCE))."""
    speedup = {AR: 1.0, **{name: row["predicted_speedup"] for name, row in table.items()}}
    best = max(speedup, key=speedup.get)
    if default in table and speedup[best] < speedup[default] * (1 + TOLERANCE):
        return default
    return best


def _request_cache(loaded, kw: dict, prompt_bucket: int, reply_tokens: int) -> int | None:
    """The cache size a request of prompts in `prompt_bucket` asking `reply_tokens` new tokens gets for run `kw`
    (`clover_jax.decoding.sizes`: the tree's nodes count), or None where such a request does not fit the model."""
    try:
        plan = plan_request(check_request(loaded, [[0] * prompt_bucket], max_new_tokens=reply_tokens, check_free_memory=False,
                                **kw))
    except (InputError, ValueError):
        return None
    return plan.cache_size


def measure(loaded, pairs: Sequence[tuple[Head, str]], *, batch_size: int = 1, mesh=None,
            prompts: Sequence[str] | None = None, new_tokens: int = NEW_TOKENS, model_source=None,
            ngram_table=None, prompt_bucket: int | None = None, reply_tokens: int | None = None,
            cache_size: int | None = None, layers: str = "auto", compare: str = ALL,
            budget_s: float | None = None, shipped: Sequence[HeadFolder] | None = None) -> dict[str, Any]:
    """Measures plain decoding and each (head, tree) pair (see the module docstring); returns the entry to save. The
    first pair is the default one (the request's tree were nothing chosen), kept against a candidate that is not
    predicted `TOLERANCE` faster (`decide`). With `prompt_bucket` and `reply_tokens` (a request's: its prompts'
    bucket and new tokens, and the cache size it asked for, if any), every run has that request's shapes (the
    prompts cut to the bucket, the cache the request would get with that run's tree), so the program timed for the
    tree chosen is the one the request then runs; else one chat request's shapes (`CACHE_SIZE`)."""
    if prompts is None:
        prompts = [p for source, cat, n in PROMPTS for p in read_prompts(source, category=cat, limit=n)]
    t0 = time.perf_counter()
    num_layers = loaded.model.config.num_hidden_layers
    common = dict(mesh=mesh, temperature=0.0, layers=layers)
    runs = {AR: dict(common, mode="ar")}
    refs = {}
    for head, tree in pairs:
        name = _label(head, tree)
        runs[name] = dict(common, mode="speculative", head=head if head is not None else NoHead(), tree=tree,
                          ngram_table=ngram_table if head is None else None)
        refs[name] = reference(head, tree, shipped if shipped is not None else shipped_folders(model_source))
    caches = {run: None for run in runs}
    if prompt_bucket is not None and reply_tokens is not None:  # the request's shapes, where its prompts fit
        reply_tokens = max(reply_tokens, new_tokens)  # a cache that holds the measurement's calls too
        caches = {run: _request_cache(loaded, dict(kw, cache_size=cache_size), prompt_bucket, reply_tokens)
                  for run, kw in runs.items()}
    reused = False  # whether the request runs the programs timed
    if all(caches.values()):
        reused = batch_size * prompt_bucket <= REUSE_TOKENS
        prompt_bucket = prompt_bucket if reused else MIN_BUCKET
        # token ids, their end kept (the question and the assistant's turn: cut at the front, a prompt of the
        # smallest bucket kept the system prompt alone, and the reply ended after 3 tokens)
        prompts = [ids[-prompt_bucket:] for ids in check_request(loaded, list(prompts)).ids]
        runs = {run: dict(kw, cache_size=caches[run], prompt_bucket=prompt_bucket) for run, kw in runs.items()}
    else:
        prompt_bucket, caches = None, {run: CACHE_SIZE for run in runs}
        runs = {run: dict(kw, cache_size=CACHE_SIZE) for run, kw in runs.items()}
    # one batch per prompt, each `batch_size` rows starting at that prompt (the prompts repeated)
    units = [[prompts[(i + j) % len(prompts)] for j in range(batch_size)] for i in range(len(prompts))]
    # a candidate without a reference takes its tokens per step from these prompts: drafted by the full model
    variants = _variants(loaded, runs, {name for name, ref in refs.items() if ref is None})
    # compile every program first (warm-up calls, not timed), side by side: XLA compiles outside Python's lock, so on a
    # machine with cores to spare the programs build at once; the timed rounds below run one call at a time. A warm-up
    # call runs the decode loop too: a program's first call through its loop is slower (on a 2-core CPU at batch 8,
    # plain decoding's by 15%), and the first round would otherwise favour the programs it times last
    warm = [(v, rows) for v in variants for rows in units]
    side_by_side(lambda item: run_request(check_request(item[0].loaded, item[1], max_new_tokens=new_tokens,
                                                        decode_text=False, **item[0].kw)), warm)
    # up to ROUNDS rounds (within `budget_s` after the warm-up, one at least), each timing every program once (a part of
    # the model PROBE_REPEATS times: its error is multiplied in the extrapolation, and it is quick), in an order turned
    # by one each round.
    # [s] per round, of each program's calls for one and for `new_tokens` new tokens (their fastest of the round)
    short: dict[str, list[float]] = {v.name: [] for v in variants}
    long: dict[str, list[float]] = {v.name: [] for v in variants}
    iterations, outputs, hists, longest = {}, {}, {}, {}
    its_of: dict[str, int] = {}
    rounds, round_s, t_rounds = 0, 0.0, time.perf_counter()
    for r in range(ROUNDS):
        if r and budget_s is not None and time.perf_counter() - t_rounds + round_s > budget_s:
            break
        r0, rounds = time.perf_counter(), r + 1
        shift = r % len(variants)
        for v in variants[shift:] + variants[:shift]:
            calls = [_decode(v.loaded, units, new_tokens, **v.kw)
                     for _ in range(PROBE_REPEATS if v.depth < num_layers else 1)]
            short[v.name].append(min(c[0] for c in calls))
            long[v.name].append(min(c[1] for c in calls))
            its, ids, hist, most = calls[-1][2:]
            its_of[v.name] = max(its, 1)  # the same every call: greedy, static shapes
            if v.depth == num_layers:
                iterations[v.run], outputs[v.run], hists[v.run], longest[v.run] = its, ids, hist, most
        round_s = time.perf_counter() - r0

    # a program's iteration time: its fastest long call less its fastest short call, over the iterations between
    # them (`clover_jax.tuning.timing`; each call's time varies from call to call, on a 2-core CPU by up to 25%), at
    # the full depth; and each round's own, from that round's calls
    def full_depth(run: str, rounds_of) -> float:
        return at_depth({v.depth: per_iteration(rounds_of(short[v.name]), rounds_of(long[v.name]), its_of[v.name])
                         for v in variants if v.run == run}, num_layers)

    iteration = {run: full_depth(run, lambda t: t) for run in runs}
    per_round = [{run: full_depth(run, lambda t, r=r: t[r:r + 1]) for run in runs} for r in range(rounds)]
    table: dict[str, dict] = {}
    for head, tree in pairs:
        name = _label(head, tree)
        cost = iteration[name] / iteration[AR]  # an iteration, in decode iterations
        ref = refs[name]
        row = {"head": _name(head), "tree": tree}
        if name in iterations:  # drafted by the full model: what these prompts showed
            tokens, steps = (int(x.sum()) for x in acceptance_stats.tokens_and_steps(np.stack(hists[name])))
            row["tau_measured"] = round(tokens / max(steps, 1), 3)
        if ref is None:  # plain decoding's iterations (the longest reply's tokens) over the tree's
            tau_b, source = longest[name] / max(iterations[name], 1), "measured"
        elif ref["per_prompt"]:
            tau_b, source = batch_tau(ref["per_prompt"], batch_size), "reference"
        else:
            tau_b, source = ref["tau"], "reference tau"
        if AR in outputs and name in outputs:  # both on the full model: the speed-up seen, and the outputs compared
            # greedy speculative decoding returns plain decoding's tokens; rounding can break a near-tie apart in a
            # lower precision (bfloat16, TF32 products), which the exactness audit classifies
            # (`clover_jax.tuning.audit`)
            row["measured_speedup"] = round(iteration[AR] * iterations[AR] / max(iteration[name] * iterations[name],
                                                                                 1e-9), 3)
            row["differing_outputs"] = sum(a != b for unit_a, unit_b in zip(outputs[name], outputs[AR])
                                           for a, b in zip(unit_a, unit_b))
        table[name] = _priced({**row, "tau_batch": round(tau_b, 3), "tau_source": source}, cost)
    default = _label(*pairs[0]) if pairs else None
    return {"best": decide(table, default), "default": default, "candidates": table, "ar_iteration_ms": round(1e3 * iteration[AR], 3),
            "iteration_ms": {run: round(1e3 * t, 3) for run, t in iteration.items()},
            "round_costs": {name: [round(r[name] / r[AR], 3) for r in per_round] for name in table},
            "round_ms": {v.name: [round(1e3 * (b - a) / its_of[v.name], 2) for a, b in zip(short[v.name], long[v.name])]
                         for v in variants},
            "new_tokens": new_tokens, "prompts": len(prompts), "batch_size": batch_size, "rounds": rounds,
            "compared": compare, "prompt_bucket": prompt_bucket, "cache_size": caches, "programs_reused": reused,
            "seconds": round(time.perf_counter() - t0, 1), "version": VERSION, "date": time.strftime("%Y-%m-%d")}


def _priced(row: dict, cost: float) -> dict:
    """A candidate's row with its iteration's cost in decode iterations and the speed-up predicted from it,
    `tau_batch / cost` (`measure`, and `merge` with the costs of two measurements)."""
    return dict(row, step_cost=round(cost, 3), predicted_speedup=round(row["tau_batch"] / cost, 3))


def _speedups(entry: dict) -> dict[str, float]:
    return {AR: 1.0, **{name: row["predicted_speedup"] for name, row in entry["candidates"].items()}}


def settled(entry: dict) -> bool:
    """Whether a saved choice answers without measuring again (`CLEAR_MARGIN`): a comparison of every candidate
    always (an explicit command), a request's when its decision is clear, when it has `ROUNDS` rounds (and a second
    measurement where it departs from the default), or after `MEASUREMENTS` measurements."""
    if entry.get("compared", ALL) == ALL or entry.get("measurements", 1) >= MEASUREMENTS:
        return True
    speed = sorted(_speedups(entry).values(), reverse=True)
    if len(speed) < 2 or speed[0] >= CLEAR_MARGIN * speed[1]:
        return True
    departs = entry["best"] != entry.get("default", entry["best"])
    return entry.get("rounds_total", entry.get("rounds", ROUNDS)) >= ROUNDS and not (
        departs and entry.get("measurements", 1) < 2)


def merge(earlier: dict, entry: dict) -> dict:
    """`entry`, a new measurement, with `earlier`'s folded in: where both timed the same programs (the same runs,
    prompt bucket and cache sizes), each run's iteration time is the faster of the two (a call does not run faster
    than it costs) and the costs, predictions and decision are derived again; else `entry` alone. Either way the
    measurements and rounds are counted."""
    out = dict(entry, measurements=earlier.get("measurements", 1) + entry.get("measurements", 1),
               rounds_total=earlier.get("rounds_total", earlier.get("rounds", 0)) + entry.get("rounds", 0),
               seconds=round(earlier.get("seconds", 0.0) + entry["seconds"], 1))
    same = all(earlier.get(k) == entry.get(k) for k in ("prompt_bucket", "cache_size", "batch_size", "new_tokens"))
    if not same or not entry.get("iteration_ms") or set(earlier.get("iteration_ms", {})) != set(entry["iteration_ms"]):
        return out
    iteration = {run: min(t, earlier["iteration_ms"][run]) for run, t in entry["iteration_ms"].items()}
    table = {name: _priced(row, iteration[name] / iteration[AR]) for name, row in entry["candidates"].items()}
    return dict(out, iteration_ms=iteration, ar_iteration_ms=iteration[AR], candidates=table,
                best=decide(table, entry.get("default")), merged=True)


# -------------------------------------------------------------------------------------------- storage
def _subject(model_source, head: HeadBundle | None, shipped: Sequence[HeadFolder]) -> str:
    """What a saved choice is about: the named head's weights, or the model and its shipped heads' weights."""
    if head is not None:
        return f"head {head.folder.digest or head.name}"
    digests = ",".join(str(f.digest) for f in shipped)
    return f"model {str(model_source).lower()} [{digests}]"


def load_choice(key: str) -> dict | None:
    entry = read_json(cache_dir() / CHOICES_FILE).get(key)
    return entry if entry and entry.get("version") == VERSION else None


def save_choice(key: str, entry: dict):
    """Adds `entry` under `key` to the user cache's choices file (a locked read-modify-write: choices other processes
    save at the same time are kept); returns the file, or None where it cannot be written."""
    path = cache_dir() / CHOICES_FILE
    try:
        update_json(path, lambda data: {**data, key: entry})
        return path
    except OSError:
        return None


_MEMO: dict[str, dict] = {}


def _opened(loaded, pair: tuple[Head, str], ngram_table) -> tuple[HeadBundle | None, str] | None:
    """The candidate (head, tree) with its head opened (once: a shipped head's folder becomes its bundle), or None
    where the request could not draft it (its plan's checks fail; nothing is compiled)."""
    head, tree = pair
    try:
        if isinstance(head, (HeadFolder, str, os.PathLike)):
            head = open_head_or_run(head, loaded.model)
        plan_request(check_request(loaded, ["x"], mode="speculative", head=head if head is not None else NoHead(),
                                   tree=tree, ngram_table=ngram_table if head is None else None,
                                   max_new_tokens=NEW_TOKENS, cache_size=CACHE_SIZE, check_free_memory=False))
    except (InputError, ValueError, FileNotFoundError):
        return None
    return head, tree


def choose(loaded, head: HeadBundle | None = None, *, batch_size: int = 1, mesh=None, refresh: bool = False,
           model_source=None, quiet: bool = False, measure_new: bool = True, compare: str = ALL,
           prompt_bucket: int | None = None, reply_tokens: int | None = None, cache_size: int | None = None,
           layers: str = "auto", shipped: Sequence[HeadFolder] | None = None) -> Choice | None:
    """The head and tree to draft with here (or plain decoding): the saved choice for this machine, dtype and batch
    size, else a new measurement (announced on stderr, saved in the user's cache). `head`: the head the request
    named, read from a folder (`clover_jax.heads.bundle.open_head`): its default tree or plain decoding; None: the
    model's shipped heads and the head-less chains (`compare="all"`) or the default head's tree alone
    (`compare="request"`: with the shortest head-less chain at a batch above 1; a saved comparison of all is used
    where there is one). `prompt_bucket`, `reply_tokens`, `cache_size`,
    `layers`: the request's, so that the measurement times the programs the request then runs (`measure`).
    `shipped`: the model's shipped head folders, opened by the caller (None: here, `shipped_folders`); each head is
    read once. None when no candidate passes the request's checks (nothing to choose), or when nothing is saved and
    `measure_new` is False."""
    model = loaded.model
    model_source = model_source or getattr(loaded, "name", None)
    if shipped is None:
        shipped = shipped_folders(model_source) if head is None else []
    where = entry_key(hardware_key(mesh), jnp.dtype(model.dtype).name, batch_size)
    key = f"{_subject(model_source, head, shipped)} | {where}"
    compare = ALL if head is not None else compare  # a named head has one tree: its comparison is complete
    entry = None if refresh else (_MEMO.get(key) or load_choice(key))
    if entry is not None and compare == ALL and entry.get("compared", ALL) != ALL:
        entry = None  # a choice that compared the default tree only does not answer for every candidate
    earlier = None  # a request's choice not yet settled: used where nothing may be measured, else measured again
    if entry is not None and measure_new and not settled(entry):
        earlier, entry, compare = entry, None, entry.get("compared", compare)
    made = entry is None
    if made and not measure_new:
        return None
    if made:  # the candidates are checked, and the n-gram table read, only when measuring
        ngram_table = head.ngram_table if head is not None else shipped[0].ngram_table if shipped else None
        # candidates the request could not draft (a tree deeper than the head's heads, ...) are not measured; with
        # none left there is no choice to make, and the request's own checks say what is wrong
        opened = [_opened(loaded, pair, ngram_table)
                  for pair in candidates(shipped, head, has_table=ngram_table is not None, compare=compare,
                                         batch_size=batch_size)]
        pairs = [pair for pair in opened if pair is not None]
        if not pairs:
            return None
        if not quiet and earlier is not None:
            print(f"clover_jax: measuring the draft tree's choice for {where} again (measurement "
                  f"{earlier.get('measurements', 1) + 1}: the last one was not clear)", file=sys.stderr)
        elif not quiet:
            print(f"clover_jax: choosing the draft tree for {where} (first use: {len(pairs) + 1} runs compiled "
                  f"and timed; the answer is kept)", file=sys.stderr)
        budget = dict(budget_s=REQUEST_BUDGET_S, new_tokens=NEW_TOKENS if batch_size <= LARGE_BATCH else
                      LARGE_BATCH_NEW_TOKENS) if compare == REQUEST else {}
        entry = measure(loaded, pairs, batch_size=batch_size, mesh=mesh, model_source=model_source,
                        ngram_table=ngram_table, prompt_bucket=prompt_bucket, reply_tokens=reply_tokens,
                        cache_size=cache_size, layers=layers, compare=compare, shipped=shipped, **budget)
        if earlier is not None:
            entry = merge(earlier, entry)
        save_choice(key, entry)
        opened_heads = {pair[0].name: pair[0] for pair in pairs if pair[0] is not None}
    else:
        opened_heads = {head.name: head} if head is not None else {}
    _MEMO[key] = entry
    ranked = sorted(entry["candidates"].values(), key=lambda r: -r["predicted_speedup"])
    others = ("; the other candidates not compared (python -m clover_jax.cli.calibrate --quick compares every shipped "
              "head and head-less chain)" if entry.get("compared", ALL) == REQUEST else "")
    if entry["best"] == AR:
        top = ranked[0] if ranked else None
        why = (f"no tree is predicted faster here (best: {_label(top['head'], top['tree'])} at "
               f"{top['predicted_speedup']}x{others})" if top else "no candidate tree")
        choice = Choice(None, AR, 1.0, f"plain autoregressive decoding: {why} [{where}]", entry)
    else:
        row = entry["candidates"][entry["best"]]
        rival, speed = _label(ranked[0]["head"], ranked[0]["tree"]), ranked[0]["predicted_speedup"]
        if speed < 1.0:
            rival, speed = "plain decoding", 1.0
        kept = (f"; {rival} predicted {speed}x, less than {TOLERANCE:.0%} faster: the default kept"
                if speed > row["predicted_speedup"] else "")
        choice = Choice(row["head"], row["tree"], row["predicted_speedup"],
                        f"chose {_label(row['head'], row['tree'])}: predicted {row['predicted_speedup']}x plain "
                        f"decoding here (step cost {row['step_cost']} decode steps, tokens per step at this batch "
                        f"{row['tau_batch']}{kept}{others}) [{where}]", entry, opened_heads.get(row["head"]))
    if made and not quiet:
        print(f"clover_jax: {choice.note} (measured in {entry['seconds']} s)", file=sys.stderr)
        choice = dataclasses.replace(choice, announced=True)
    return choice



# ------------------------------------------------------------------------------------------- the request
def decide_fastest(request: Request) -> tuple[Request, tuple[str, ...], dict | None]:
    """(request with its tree decided, notes, choice) for a speculative request that names no tree
    (`tree_rule` FASTEST): the head and tree `choose` finds fastest here, or plain decoding. Where nothing can be
    measured (a head given as a module, a request naming a draft vocabulary or n-gram table, no tokenizer, a model
    with no shipped head when none is named) the head's default tree, said in the notes."""
    if not request.speculative or request.tree_rule != FASTEST:
        return request, (), None
    default = request.replace(tree_rule=DEFAULT)
    head = request.head
    if isinstance(head, nnx.Module) or (isinstance(head, HeadBundle) and head.folder is None):
        return default, (), None  # an in-memory head has no folder to keep a choice in: its default tree
    if request.draft_vocab is not None or request.ngram_table is not None:
        return default, ("the head's default tree (the request names a draft vocabulary or n-gram table)",), None
    if request.tokenizer is None:
        return default, ("the head's default tree (no tokenizer to measure a choice with)",), None
    if head is None and not (request.model_source and pretrained.heads_for(request.model_source)):
        return default, (), None  # no shipped head to choose among: the draft's resolution says what to pass
    bundle = open_head_or_run(head, request.model) if head is not None else None
    shipped = shipped_folders(request.model_source) if bundle is None else []
    loaded = LoadedModel(request.model.config, request.model, request.tokenizer, request.model_source or "")
    # a request measures its default tree against plain decoding, on its own shapes (the default tree's program is
    # then the one it runs); a saved comparison of every candidate (`calibrate --quick`) is used where there is one.
    # On a mesh a measurement compiles every candidate's sharded loop (minutes; on a pod, on every host): a saved
    # choice is used, else the default tree, and the note says how to measure one
    bucket = request.prompt_bucket or bucket_length(max(len(row) for row in request.ids))
    choice = choose(loaded, bundle, batch_size=request.batch_size, mesh=request.mesh,
                    model_source=request.model_source, measure_new=request.mesh is None, compare=REQUEST,
                    prompt_bucket=bucket, reply_tokens=request.max_new_tokens, cache_size=request.cache_size,
                    layers=request.layers, shipped=shipped)
    if choice is None and request.mesh is not None:
        mesh = ",".join(f"{k}={v}" for k, v in dict(request.mesh.shape).items() if v > 1)
        return default.replace(head=bundle if bundle is not None else head), (
            f"the head's default tree: no choice is saved for mesh {mesh} (measure one: python -m "
            f"clover_jax.cli.calibrate --quick --mesh {mesh} --batch-size {request.batch_size})",), None
    if choice is None:  # no candidate passes the request's checks: the default tree's resolution reports why
        return default.replace(head=bundle if bundle is not None else head), (), None
    about = {"head": choice.head, "tree": choice.tree, "predicted_speedup": choice.predicted,
             "compared": choice.entry.get("compared", ALL), "rounds": choice.entry.get("rounds"),
             "measurements": choice.entry.get("measurements", 1), "settled": settled(choice.entry),
             "programs_reused": choice.entry.get("programs_reused", False),
             "measured_s": choice.entry.get("seconds"),  # how long the measurement took (when it was made)
             "note": choice.note, "announced": choice.announced}  # the note already printed on stderr, or not
    if choice.tree == AR:
        return request.replace(speculative=False), (choice.note,), about
    if choice.head is None:
        chosen_head = NoHead()
    elif choice.bundle is not None:
        chosen_head = choice.bundle  # opened by the measurement
    else:  # a saved choice: its head opened once here, from the folder already read where it is a shipped one
        folder = next((f for f in shipped if f.name == choice.head), choice.head)
        chosen_head = open_head_or_run(folder, request.model)
    return request.replace(head=chosen_head, tree=choice.tree, tree_rule=NAMED), (choice.note,), about


__all__ = ["Choice", "batch_tau", "candidates", "choose", "decide_fastest", "measure", "merge", "reference",
           "reference_tau", "settled", "shipped_folders"]
