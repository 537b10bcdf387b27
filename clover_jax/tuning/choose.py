"""What speculative decoding drafts with when the request names no tree: the head and tree that are fastest on this
machine, dtype and batch size, or plain autoregressive decoding when none pays.

    clover_jax.generate(lm, prompts, mode="speculative")                  # chooses among the model's shipped heads
    clover_jax.generate(lm, prompts, mode="speculative", head="smollm2-135m-instruct-eagle")  # that head's tree or AR
    python -m clover_jax.cli.calibrate --quick --model smollm2-135m-instruct   # measure again (refresh)

A speculative step's speed-up over a decode step is `tau / cost`: tau (tokens per step) depends on the head and
the text, not on the machine; the cost of a step in decode steps depends on the machine, the dtype and the batch
size (on a 2-core CPU a 9-token verify costs about two decode steps, on a GPU at batch 1 barely more than one), and
not on the text (shapes are static). The choice measures the cost here and takes tau from a reference:

1. Candidates: each head's registered default tree (`clover_jax.pretrained`; a head folder's type default
   otherwise), and the head-less chains `lookup-4-table` and `lookup-2-table` (prompt lookup, else the model's
   n-gram table; `lookup-4` / `lookup-2` where there is no table) when no head was named.
2. For each candidate and our autoregressive loop, on `PROMPTS` (two short held-out Spec-Bench questions, each
   repeated to the batch size): the jitted call for 1 new token and for `NEW_TOKENS` new tokens, after a warm-up
   that compiles. The difference is the decode phase (prefill, dispatch and compile cancel); each run's is the
   fastest of `ROUNDS` rounds that time every run in turn. As both loops emit the same tokens, the ratio of the
   decode phases is the speed-up measured on these prompts.
3. That speed-up is rescaled from the acceptance measured on these prompts to the reference acceptance
   (`predicted = measured * tau_reference / tau_measured`): a few short prompts tell the step's cost well and
   tau badly. The reference tau is the head's `calibration.json` `reference` (measured on held-out ShareGPT
   prompts, its recipe beside it); a head without one keeps the measured tau.
4. The candidate with the highest predicted speed-up is chosen when it is at least `MARGIN`; else plain
   decoding. The choice, its reason and every candidate's numbers are kept in the user's cache
   (`~/.cache/clover_jax/calibration/choices.json`, `CLOVER_JAX_CACHE` overrides), keyed by the heads' weights,
   the hardware, the dtype and the batch size, and announced on stderr in one line when made.

About 40 s on a 2-core CPU for SmolLM2-135M (five programs compiled; a measured choice is reused afterwards). The
full calibration (`tree="auto"`, `clover_jax.tuning.calibrate`) searches many more trees and fits new ones.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from clover_jax import pretrained
from clover_jax.decoding import acceptance_stats
from clover_jax.decoding.lookup import NoHead
from clover_jax.decoding.ngram import resolve_ngram_table
from clover_jax.generation.api import generate
from clover_jax.generation.calibration import (AR, FILE_NAME, cache_dir, entry_key, hardware_key, register_saved_trees,
                                               weights_digest)
from clover_jax.generation.plan import set_auto_choice
from clover_jax.io.prompts import read_prompts

VERSION = 2  # a saved choice of another version is measured again
# two short questions outside MT-Bench's categories: a step's cost grows with the context (attention over the cache),
# so the prompts are of a chat request's length (40 and 85 tokens), not a long document's
PROMPTS = (("spec_bench", "qa", 1), ("spec_bench", "math_reasoning", 1))
NEW_TOKENS = 48
ROUNDS = 2
MARGIN = 1.05  # a tree must be predicted this much faster than plain decoding to be chosen
HEADLESS = ("lookup-4-table", "lookup-2-table")
CHOICES_FILE = "choices.json"


@dataclasses.dataclass(frozen=True)
class Choice:
    head: str | None  # the head's name or folder; None for a head-less chain (or plain decoding)
    tree: str  # the tree, or "ar" for plain autoregressive decoding
    predicted: float  # predicted speed-up over plain decoding (1.0 for plain decoding)
    note: str  # one line: what was chosen and why
    entry: dict = dataclasses.field(default_factory=dict, compare=False)  # the measurement it was chosen from


def _label(head, tree) -> str:
    return tree if head is None else f"{head} {tree}"


def candidates(model_source, head_source=None, head_tree: str | None = None, *,
               has_table: bool) -> list[tuple[str | None, str]]:
    """(head or None, tree) pairs to measure: the named head's default tree (`head_tree`), or, when no head is
    named, each shipped head's default tree and the head-less chains."""
    if head_source is not None:
        return [(str(head_source), head_tree or pretrained.default_tree(head_source))]
    out = [(h, pretrained.default_tree(h)) for h in pretrained.heads_for(model_source)]
    headless = HEADLESS if has_table else tuple(t.removesuffix("-table") for t in HEADLESS)
    return out + [(None, t) for t in headless]


def reference_tau(head_source, tree: str, model_source=None) -> float | None:
    """The reference acceptance of `tree` drafted by `head_source` (its `calibration.json` `reference.tau`); for a
    head-less chain, the first shipped head of the model that records one."""
    sources = [head_source] if head_source is not None else pretrained.heads_for(model_source)
    for src in sources:
        try:
            path = pretrained.head_path(src) / FILE_NAME
            ref = json.loads(path.read_text()).get("reference") or {}
        except (OSError, ValueError, TypeError):
            continue
        if tree in (ref.get("tau") or {}):
            return float(ref["tau"][tree])
    return None


def _decode(loaded, units, new_tokens: int, **kw) -> tuple[float, list, list]:
    """(decode-phase seconds summed over the prompt batches `units`, their token ids, their accept histograms): per
    batch, the call for `new_tokens` new tokens minus the call for one (prefill and dispatch cancel)."""
    seconds, ids, hists = 0.0, [], []
    for rows in units:
        short = generate(loaded, rows, max_new_tokens=1, decode_text=False, **kw)
        long = generate(loaded, rows, max_new_tokens=new_tokens, decode_text=False, **kw)
        seconds += long.seconds - short.seconds
        ids.append(long.token_ids)
        hists.append(long.stats.get("accept_hist"))
    return seconds, ids, hists


def measure(loaded, pairs: Sequence[tuple[str | None, str]], *, batch_size: int = 1, mesh=None,
            prompts: Sequence[str] | None = None, new_tokens: int = NEW_TOKENS, model_source=None,
            ngram_table=None) -> dict[str, Any]:
    """Measures plain decoding and each (head, tree) pair (see the module docstring); returns the entry to save."""
    if prompts is None:
        prompts = [p for source, cat, n in PROMPTS for p in read_prompts(source, category=cat, limit=n)]
    t0 = time.perf_counter()
    # one batch per prompt, each `batch_size` rows starting at that prompt (the prompts repeated)
    units = [[prompts[(i + j) % len(prompts)] for j in range(batch_size)] for i in range(len(prompts))]
    common = dict(mesh=mesh, temperature=0.0)
    runs = {AR: dict(common, mode="ar")}
    for head, tree in pairs:
        runs[_label(head, tree)] = dict(common, mode="speculative", head=head if head is not None else NoHead(),
                                        tree=tree, ngram_table=ngram_table if head is None else None)
    for kw in runs.values():  # compile every program first (warm-up calls, not timed)
        for rows in units:
            for n in (1, new_tokens):
                generate(loaded, rows, max_new_tokens=n, decode_text=False, **kw)
    # ROUNDS rounds, each timing every run in turn (a drift of the machine's speed spreads over all of them); a
    # run's decode time is its fastest round
    decode = {name: float("inf") for name in runs}
    outputs, hists = {}, {}
    for _ in range(ROUNDS):
        for name, kw in runs.items():
            seconds, outputs[name], hists[name] = _decode(loaded, units, new_tokens, **kw)
            decode[name] = min(decode[name], seconds)
    table: dict[str, dict] = {}
    for head, tree in pairs:
        name = _label(head, tree)
        if outputs[name] != outputs[AR]:  # greedy speculative decoding must equal plain decoding
            raise RuntimeError(f"{name}: speculative output differs from autoregressive decoding")
        tokens, steps = (int(x.sum()) for x in acceptance_stats.tokens_and_steps(np.stack(hists[name])))
        tau = tokens / max(steps, 1)
        measured = decode[AR] / max(decode[name], 1e-9)
        ref = reference_tau(head, tree, model_source)
        table[name] = {
            "head": head, "tree": tree, "measured_speedup": round(measured, 3), "tau_measured": round(tau, 3),
            "tau_reference": ref, "step_cost": round(tau / measured, 3),
            "predicted_speedup": round(measured * (ref / tau if ref else 1.0), 3)}
    best = max(table, key=lambda k: table[k]["predicted_speedup"], default=None)
    if best is None or table[best]["predicted_speedup"] < MARGIN:
        best = AR
    return {"best": best, "candidates": table, "ar_decode_seconds": round(decode[AR], 4), "new_tokens": new_tokens,
            "prompts": len(prompts), "batch_size": batch_size, "rounds": ROUNDS,
            "seconds": round(time.perf_counter() - t0, 1), "version": VERSION, "date": time.strftime("%Y-%m-%d")}


# -------------------------------------------------------------------------------------------- storage
def _subject(model_source, head_source) -> str:
    """What a saved choice is about: the named head's weights, or the model and its shipped heads' weights."""
    if head_source is not None:
        return f"head {weights_digest(head_source) or head_source}"
    digests = ",".join(str(weights_digest(h)) for h in pretrained.heads_for(model_source))
    return f"model {str(model_source).lower()} [{digests}]"


def _read(path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def load_choice(key: str) -> dict | None:
    entry = _read(cache_dir() / CHOICES_FILE).get(key)
    return entry if entry and entry.get("version") == VERSION else None


def save_choice(key: str, entry: dict):
    path = cache_dir() / CHOICES_FILE
    try:
        data = _read(path)
        data[key] = entry
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)
        return path
    except OSError:
        return None


_MEMO: dict[str, dict] = {}


def choose(loaded, head_source=None, head_tree: str | None = None, *, batch_size: int = 1, mesh=None, refresh: bool = False,
           model_source=None, quiet: bool = False) -> Choice:
    """The head and tree to draft with here (or plain decoding): the saved choice for this machine, dtype and batch
    size, else a new measurement (announced on stderr, saved in the user's cache). `head_source`: the head the
    request named (its default tree `head_tree`, or plain decoding); None: any of the model's shipped heads or a head-less
    chain."""
    model = loaded.model
    model_source = model_source or getattr(loaded, "name", None)
    table_of = head_source if head_source is not None else pretrained.default_head(model_source)
    ngram_table = resolve_ngram_table(None, table_of) if table_of is not None else None
    pairs = candidates(model_source, head_source, head_tree, has_table=ngram_table is not None)
    where = entry_key(hardware_key(mesh), jnp.dtype(model.dtype).name, batch_size)
    key = f"{_subject(model_source, head_source)} | {where}"
    entry = None if refresh else (_MEMO.get(key) or load_choice(key))
    made = entry is None
    if made:
        if not quiet:
            print(f"clover_jax: choosing the draft tree for {where} (first use: ~{12 * (len(pairs) + 1)} s of "
                  f"measurement, then reused)", file=sys.stderr)
        for head, tree in pairs:
            if head is not None:
                register_saved_trees(head, tree)
        entry = measure(loaded, pairs, batch_size=batch_size, mesh=mesh, model_source=model_source,
                        ngram_table=ngram_table)
        save_choice(key, entry)
    _MEMO[key] = entry
    for row in entry["candidates"].values():
        if row["head"] is not None:
            register_saved_trees(row["head"], row["tree"])
    ranked = sorted(entry["candidates"].values(), key=lambda r: -r["predicted_speedup"])
    if entry["best"] == AR:
        top = ranked[0] if ranked else None
        why = (f"no tree is predicted {MARGIN}x faster here (best: {_label(top['head'], top['tree'])} at "
               f"{top['predicted_speedup']}x)" if top else "no candidate tree")
        choice = Choice(None, AR, 1.0, f"plain autoregressive decoding: {why} [{where}]", entry)
    else:
        row = entry["candidates"][entry["best"]]
        choice = Choice(row["head"], row["tree"], row["predicted_speedup"],
                        f"chose {_label(row['head'], row['tree'])}: predicted {row['predicted_speedup']}x plain "
                        f"decoding here (step cost {row['step_cost']} decode steps, reference tau "
                        f"{row['tau_reference'] or row['tau_measured']}) [{where}]", entry)
    if made and not quiet:
        print(f"clover_jax: {choice.note} (measured in {entry['seconds']} s)", file=sys.stderr)
    return choice


set_auto_choice(choose)  # `generate(mode="speculative")` with no tree chooses through this


__all__ = ["Choice", "candidates", "choose", "measure", "reference_tau"]
