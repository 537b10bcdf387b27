"""Render docs/results.md (and the results table of README.md) from the result files in results/.

  python scripts/render_results.py            # rewrite docs/results.md, README.md's results block and
                                              # docs/training.md's training-memory table
  python scripts/render_results.py --check    # exit 1 if any is not what the result files render to

Each results/*.json holds one benchmark run: `title`, `date`, `machine`, `machine_short`, `settings`, `command`,
`source` (how the numbers got into the file), `benchmark` (`bench_spec`, `bench_step`, `compare_heads`, ...), the numbers, and optional
`notes` and `summary` (the runs that also go into the short table of README.md). Every bench script writes such a file
with `--out PATH` (`bench/toolkit.py`), which can be dropped into results/ as it is; a benchmark without a table of
its own here renders its `rows` (one row per dict, nested dicts as `key.field` columns). Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
DOC = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
BEGIN = "<!-- results:begin (rendered by scripts/render_results.py from results/*.json; do not edit) -->"
END = "<!-- results:end -->"
TRAINING = ROOT / "docs" / "training.md"  # the training-memory table (bench/bench_train_memory.py)
TRAIN_BEGIN = "<!-- train-memory:begin (rendered by scripts/render_results.py from results/*-train-memory.json) -->"
TRAIN_END = "<!-- train-memory:end -->"
DV = "+dv"  # bench_spec.py's suffix for a run drafting from the head's draft vocabulary

HEADER = """# Results

Current measurements only, one table per benchmark run. Every table is rendered by `python scripts/render_results.py`
from a file in `results/` that records the command, the machine, the date and the numbers; to add a run, add its file
and render again (`--check` fails when this page is stale).

Terms: **tau** is the mean number of tokens a speculative step yields (accepted drafts + 1); **vs our AR** is the
speed-up over this library's own autoregressive loop, timed in the same process on the same prompts; intervals are
95% bootstrap intervals over prompt batches (`clover_jax.tuning.evaluation.bootstrap_ci`). **differing** counts greedy
speculative outputs that are not token for token the autoregressive output. Speed-ups depend on the machine, tau does
not (greedy).
"""


def load() -> list[dict]:
    out = []
    for path in sorted(RESULTS.glob("*.json")):
        d = json.loads(path.read_text())
        for key in ("title", "date", "machine", "machine_short", "command", "benchmark"):
            if key not in d:
                raise SystemExit(f"{path}: missing key {key!r}")
        d["_file"] = path.name
        out.append(d)
    # newest first; within a date, the file names' order
    out.sort(key=lambda d: d["_file"])
    return sorted(out, key=lambda d: d["date"], reverse=True)


def name(run: str) -> str:
    return run[: -len(DV)] if run.endswith(DV) else run


def short_head(head) -> str:
    """A shipped head's name as a table cell: `smollm2-135m-instruct-eagle` -> "EAGLE head"."""
    if not head:
        return "no head,"
    kind = head.rsplit("-", 1)[-1]
    return {"eagle": "EAGLE head", "clover2": "Clover-2 head"}.get(kind, head)


def num(x, fmt="{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def with_ci(value, ci, unit="") -> str:
    if value is None:
        return "-"
    return f"{value:.3f}{unit}" + (f" ({ci[0]:.3f}-{ci[1]:.3f})" if ci else "")


def vs_transformers(d: dict, r: dict):
    """A run's speed-up over transformers: recorded, or its tokens/s over the peer's from the same run."""
    if r.get("speedup_vs_transformers") is not None:
        return r["speedup_vs_transformers"]
    peer = d["runs"].get("transformers", {}).get("tokens_per_second")
    if peer and r.get("tokens_per_second"):
        return r["tokens_per_second"] / peer
    return None


def spec_table(d: dict) -> list[str]:
    runs = d["runs"]
    peer = "transformers" in runs
    head = ["tree (verified tokens)", "tokens/s", "tau (95% CI)", "vs our AR (95% CI)"]
    head += ["vs transformers"] if peer else []
    head += ["accept rate per depth"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, r in runs.items():
        if key == "transformers":
            continue
        if key == "ar":
            label = "our autoregressive loop"
        elif key == "chosen" and r.get("choice"):  # a request with no tree: what it chose here
            c = r["choice"]
            label = "no tree named: " + ("plain decoding" if c["tree"] == "ar" else
                                         f"{short_head(c['head'])} `{c['tree']}`")
        else:
            label = f"`{name(key)}`" + (f" ({r['verified_tokens']})" if r.get("verified_tokens") else "")
        acc = r.get("accept_rate_per_depth")
        row = [label, num(r.get("tokens_per_second"), "{:.1f}"),
               "-" if key == "ar" else with_ci(r.get("tau"), r.get("tau_ci95")),
               "-" if key == "ar" else with_ci(r.get("speedup_vs_ar"), r.get("speedup_ci95"), "x")]
        if peer:
            row.append(num(vs_transformers(d, r), "{:.2f}x"))
        row.append("-" if not acc else ", ".join(f"{a:.2f}" for a in acc))
        lines.append("| " + " | ".join(row) + " |")
    if peer:
        row = ["transformers `generate` (torch, same prompts)", num(runs["transformers"].get("tokens_per_second"), "{:.1f}"),
               "-", "-", "1x", "-"]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    if "greedy_compared" in d:
        lines.append(f"Greedy outputs differing from autoregressive decoding: **{d['greedy_mismatches']} of "
                     f"{d['greedy_compared']}**.")
    if d.get("divergences") is not None:  # the exactness audit (clover_jax.tuning.audit)
        divs = d["divergences"]
        ties = sum(x["verdict"] == "near-tie" for x in divs)
        lines += ["", f"Audit of the differing outputs: **{ties} near-ties, {d['greedy_unexplained']} unexplained**."]
        if divs:
            ulps = sorted(x["margin_ulps"] for x in divs)
            ratio = max(x["margin"] / x["bound"] for x in divs if x["bound"] > 0) if any(
                x["bound"] > 0 for x in divs) else None
            per_tree = {}
            for x in divs:
                per_tree[name(x["tree"])] = per_tree.get(name(x["tree"]), 0) + 1
            lines += ["", "Divergences per tree: " + ", ".join(f"`{t}` {n}" for t, n in per_tree.items())
                      + f"; replayed float32 margin between the two tokens: median {ulps[len(ulps) // 2]:.2f}, "
                      f"largest {ulps[-1]:.2f} ulps of the compute dtype"
                      + (f"; at most {ratio:.2f} of the near-tie bound." if ratio is not None else ".")]
            shown = divs[:12]
            lines += ["", "| tree | prompt | position | autoregressive / speculative token | margin (ulps) | "
                          "near-tie bound | verdict |", "|---|---|---|---|---|---|---|"]
            for x in shown:
                lines.append(f"| `{name(x['tree'])}` | {x['prompt']} | {x['position']} | {x['reference_token']} / "
                             f"{x['token']} | {x['margin']:.3g} ({x['margin_ulps']:.1f}) | {x['bound']:.3g} | "
                             f"{x['verdict']} |")
            if len(divs) > len(shown):
                lines.append(f"\n({len(divs) - len(shown)} more in the result file.)")
    for key, r in (d.get("replay") or {}).items():
        lines.append(f"\nReplay check `{name(key)}`: {r['outputs']} outputs, {r['tokens']} tokens, "
                     f"{r['near_ties']} near-ties, **{r['violations']} violations**.")
    return lines


def step_table(d: dict) -> list[str]:
    """bench/bench_step.py time: a speculative loop step against an autoregressive one per tree; where the rows say
    which head drafted (`head`), also the head's draft and commit as their own jitted functions (`draft_ms`,
    `commit_ms`; "-" for a tree whose parts were not timed)."""
    parts = any("draft_ms" in s for s in d["steps"].values())
    head = "head | " if parts else ""
    cols = " | draft (ms) | draft / autoregressive | head commit (ms)" if parts else ""
    lines = [f"| {head}tree (verified tokens, depth) | autoregressive step (ms) | speculative step (ms) | "
             f"speculative / autoregressive{cols} |", "|---|---|---|---|" + "---|" * (4 if parts else 0)]
    for key, s in d["steps"].items():
        tree = s.get("tree", key)
        row = f"| {s['head']} | " if parts else "| "
        row += (f"`{tree}` ({s['verified_tokens']}, {s['depth']}) | {s['ar_step_ms']:.2f} | "
                f"{s['speculative_step_ms']:.2f} | {s['ratio']:.2f} |")
        if parts and "draft_ms" in s:
            row += f" {s['draft_ms']:.2f} | {s['draft_ms'] / s['ar_step_ms']:.2f} | {s['commit_ms']:.2f} |"
        elif parts:
            row += " - | - | - |"
        lines.append(row)
    return lines


def batch_table(d: dict) -> list[str]:
    """`bench/bench_spec.py --batch-sizes`: one row per batch size, each tree's tau and speed-up over the AR loop of
    that batch."""
    names = list(d["rows"][0]["runs"])
    lines = ["| batch | our AR (tokens/s) | " + " | ".join(f"`{n}`: tau, vs our AR" for n in names) + " | differing |",
             "|---|---|" + "---|" * len(names) + "---|"]
    chosen = []
    for r in d["rows"]:
        cells = []
        for n in names:
            x = r["runs"][n]
            cells.append(f"{num(x.get('tau'))}, **{num(x.get('speedup_vs_ar'), '{:.2f}x')}**")
            if x.get("choice"):
                c = x["choice"]
                chosen.append(f"batch {r['batch_size']}: " + ("plain decoding" if c["tree"] == "ar" else
                                                              f"{short_head(c['head'])} `{c['tree']}`"))
        lines.append(f"| {r['batch_size']} | {num(r.get('ar_tokens_per_second'), '{:.1f}')} | " + " | ".join(cells) +
                     f" | {r.get('greedy_mismatches', '-')} of {r.get('greedy_compared', '-')} |")
    if chosen:
        lines += ["", "`chosen` (what a request with no tree gets) chose: " + "; ".join(chosen) + "."]
    return lines


def choice_table(d: dict) -> list[str]:
    """`python -m clover_jax.cli.calibrate --quick` per batch size: each candidate's predicted speed-up (and, where
    a benchmark ran that tree at that batch size, its measured one), and what was chosen; a run of a request's
    measurements alone (`bench/choice.py by-batch --scopes request`) has "-" for the comparison of every candidate."""
    labels = list(d["rows"][0].get("candidates") or d["rows"][0]["request"]["candidates"])
    measured = d.get("measured", {})  # {batch: {label: speed-up on the benchmark}}
    request = any("request" in r for r in d["rows"])  # a request's own measurement beside the comparison of all

    def best(label: str) -> str:
        return "plain decoding" if label == "ar" else short_label(label)

    again = any("request_next" in r for r in d["rows"])  # the next process's request, a second first measurement

    def said(q: dict) -> str:
        preds = ", ".join(f"{short_label(k)} {v['predicted_speedup']:.2f}x" for k, v in q["candidates"].items())
        how = f"{q['rounds']} round{'s' * (q['rounds'] != 1)}" if "rounds" in q else ""
        if "programs_reused" in q:
            how += ", its programs reused" if q["programs_reused"] else f", bucket {q['prompt_bucket']}"
        if "settled" in q:
            how += "" if q["settled"] else ", not settled"
        return f"{best(q['best'])} ({preds}; {how})" if how else f"{best(q['best'])} ({preds})"

    def next_request(first: dict, q: dict) -> str:
        if q.get("measurements", 1) <= first.get("measurements", 1):
            return "the saved choice"
        return f"measured again, {q['seconds'] - first['seconds']:.0f} s: {said(q)}"

    lines = ["| batch | measured in | chosen | " + " | ".join(f"{short_label(x)}: predicted (benchmark)" for x in labels)
             + " |" + (" a request: measured in, chose (predicted) |" if request else "")
             + (" the next request | another first request |" if again else ""),
             "|---|---|---|" + "---|" * len(labels) + ("---|" if request else "") + ("---|---|" if again else "")]
    for r in d["rows"]:
        b = str(r["batch_size"])
        cells = []
        for x in labels:
            c = r.get("candidates", {}).get(x)
            got = measured.get(b, {}).get(x)
            cells.append(("-" if c is None else f"{c['predicted_speedup']:.2f}x")
                         + (f" ({got:.2f}x)" if got is not None else ""))
        if request:
            q = r["request"]
            cells.append(f"{q['seconds']:.0f} s, {said(q)}")
        if again:
            cells.append(next_request(r["request"], r["request_next"]))
            cells.append(f"{r['request_again']['seconds']:.0f} s, {said(r['request_again'])}")
        compared = f"{r['seconds']:.0f} s | {best(r['best'])}" if "best" in r else "- | -"
        lines.append(f"| {b} | {compared} | " + " | ".join(cells) + " |")
    return lines


def first_request_table(d: dict) -> list[str]:
    """bench/choice.py first-request: a first speculative request with no tree named (its choice measured) against
    the same request with the default tree, each in a new process; the difference is what the choice adds."""
    lines = ["| batch | no tree named: the request (s) | its choice: measured in (s), chose (predicted) | "
             "`tree=\"default\"`: the request (s) | the choice added (s) |", "|---|---|---|---|---|"]
    for r in d["rows"]:
        c = r["no_tree"].get("choice") or {}
        chose = ("plain decoding" if c.get("tree") == "ar" else f"{short_head(c.get('head'))} `{c.get('tree')}`")
        lines.append(f"| {r['batch_size']} | {r['no_tree']['seconds']:.1f} | {c.get('measured_s', '-')}, {chose} "
                     f"({num(c.get('predicted_speedup'), '{:.2f}')}x) | {r['default']['seconds']:.1f} | "
                     f"{r['added_s']:.1f} |")
    return lines


def short_label(label: str) -> str:
    """A choice's candidate label (`head tree` or `tree`) as a table cell."""
    head, _, tree = label.rpartition(" ")
    return f"{short_head(head)} `{tree}`" if head else f"`{tree}`"


def rows_table(d: dict) -> list[str]:
    """bench/bench_rows.py: where a U-token verification forward and one-token decode steps round apart."""
    lines = ["Product `x [M, D] @ W [D, F]` (float32 accumulation): elements of row 0 that differ from the one-row "
             "product's.", "", "| dtype | D x F | M = 2 | M = 4 | M = 10 |", "|---|---|---|---|---|"]
    for dtype, rows in d["products"].items():
        shapes = {}
        for r in rows:
            shapes.setdefault(tuple(r["shape"]), {})[r["rows"]] = f"{r['differing']} of {r['of']}"
        for shape, by_m in shapes.items():
            lines.append(f"| {dtype} | {shape[0]} x {shape[1]} | {by_m.get(2, '-')} | {by_m.get(4, '-')} | "
                         f"{by_m.get(10, '-')} |")
    u = max(len(v) for v in d["chain"].values())
    lines += ["", f"A chain of {u} tokens: one {u}-token forward against {u} one-token decode steps over the same "
              f"cache; hidden-state elements (of {d['hidden_size']}) that differ, per token.", "",
              "| dtype, batch | " + " | ".join(f"token {i}" for i in range(u)) + " |", "|---|" + "---|" * u]
    for key, diff in d["chain"].items():
        lines.append(f"| {key} | " + " | ".join(str(x) for x in diff) + " |")
    return lines


def train_memory_table(d: dict) -> list[str]:
    """bench/bench_train_memory.py: the estimate and the compiled step's check against the measured peak, per point."""
    gib = lambda x: "-" if not x else f"{x / 1024 ** 3:.2f}"  # noqa: E731
    pct = lambda x: "-" if x is None else f"{x:+.0%}"  # noqa: E731
    bases = {"smollm2": "SmolLM2-135M", "random": "random 2-layer"}
    lines = ["| base | batch x tokens | settings | estimate (GiB) | XLA buffers (GiB) | compiled check (GiB) | "
             "measured peak (GiB) | estimate vs measured | check vs measured |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        xla = max(r.get("xla_step") or 0, r.get("xla_features") or 0)
        peak = gib(r.get("measured"))
        if r.get("note"):  # a run stopped at the limit peaked above it; a point not run has no peak
            peak = f">= {peak} ({r['note']})" if r.get("measured") else r["note"]
        settings = ", ".join(f"`{x}`" for x in r["settings"]) or "-"
        lines.append(f"| {bases.get(r['base'], r['base'])} | {r['batch']} x {r['length']:,} | {settings} | "
                     f"{gib(r.get('estimate'))} | {gib(xla)} | {gib(r.get('compiled_peak'))} | {peak} | "
                     f"{pct(r.get('error'))} | {pct(r.get('compiled_error'))} |")
    return lines


def train_step_table(d: dict) -> list[str]:
    """bench/bench_train.py: the training step's variants, each with the XLA options it compiled with."""
    first = {}
    lines = ["| variant | XLA options | step (s) | real tokens per step | tokens/s | vs XLA's defaults | compile (s) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        first.setdefault(r["variant"], {})[r.get("xla", "training")] = r["step_s"]
    for r in d["rows"]:
        default = first[r["variant"]].get("xla-default")
        vs = f"{default / r['step_s']:.2f}x" if default else "-"
        lines.append(f"| {r['variant']} | {r.get('xla', 'training')} | {r['step_s']} | {r['tokens_per_step']:.0f} | "
                     f"{r['tokens_per_s']} | {vs} | {r['compile_s']} |")
    return lines


def compare_table(d: dict) -> list[str]:
    """bench/compare_heads.py: head types trained on an equal budget, side by side on the same prompts and trees."""
    lines = ["| head | tree | tau | accept rate per depth | vs our AR | differing | params | train steps | "
             "tokens seen | train min |", "|---|---|---|---|---|---|---|---|---|---|"]
    for spec, e in d["heads"].items():
        cost = e.get("training") or {}
        minutes = f"{cost['train_time_s'] / 60:.1f}" if cost.get("train_time_s") else "-"
        seen = f"{cost['tokens_seen']:,}" if cost.get("tokens_seen") else "-"
        for tree, r in e["trees"].items():
            rates = ", ".join(f"{x:.2f}" for x in r.get("accept_rate_per_depth") or [])
            lines.append(f"| {e['type']} | `{tree}` | {num(r.get('tau'))} | {rates} | {num(r.get('speedup_vs_ar'))}x "
                         f"| {e['greedy_mismatches']} of {e['greedy_compared']} | {e['params'] / 1e6:.1f}M | "
                         f"{cost.get('final_step', '-')} | {seen} | {minutes} |")
    return lines


SET_NAMES = {"mt_bench": "MT-Bench", "spec_bench": "Spec-Bench"}
TYPE_NAMES = {"clover2": "Clover-2", "clover1": "Clover-1", "eagle": "EAGLE-1", "medusa": "Medusa-1",
              "redrafter": "ReDrafter", "block": "block (parallel)"}


def head_types_table(d: dict) -> list[str]:
    """bench/head_types.py: one row per head, every question set's tau and speed-up side by side, the acceptance per
    depth on the first set, and from bench_step the loop step and the head's draft + commit in autoregressive steps."""
    sets = list(d["sets"])
    labels = {k: f"{SET_NAMES.get(v['questions'], v['questions'])} {v['prompts']}" for k, v in d["sets"].items()}
    cols = "".join(f" {labels[k]}: tau | vs our AR |" for k in sets)
    lines = [f"| head | training | tree |{cols} accept rate per depth ({labels[sets[0]]}) | loop step "
             f"(autoregressive steps) | draft + commit (autoregressive steps) | differing |",
             "|---|---|---|" + "---|---|" * len(sets) + "---|---|---|---|"]
    for spec, h in d["heads"].items():
        first = next(iter(h["sets"].values()))
        tree = first["tree"]
        steps = f"{h['train_steps']} steps, {h['tokens_seen']:,} tokens" if h.get("tokens_seen") else \
            h.get("training", "-")
        cells = ""
        for k in sets:
            r = h["sets"].get(k)
            when = f" ({r['date']})" if r and r.get("date") else ""  # a row measured on another day (`from`)
            cells += f" {with_ci(r['tau'], r.get('tau_ci95'))} | {num(r['speedup_vs_ar'], '{:.2f}x')}{when} |" if r \
                else " - | - |"
        rates = ", ".join(f"{x:.2f}" if x == x else "-"  # NaN: no step reached that depth
                          for x in first.get("accept_rate_per_depth") or [])
        cost = d.get("draft", {}).get(f"{h['type']} {tree}")
        step = f"{cost['speculative_step_ms'] / cost['ar_step_ms']:.2f}" if cost else "-"
        drafting = f"{(cost['draft_ms'] + cost.get('commit_ms', 0.0)) / cost['ar_step_ms']:.2f}" \
            if cost and "draft_ms" in cost else "-"
        differing = sum(r["differing"] for r in h["sets"].values())
        compared = sum(r["compared"] for r in h["sets"].values())
        label = h.get("label") or TYPE_NAMES.get(h["type"], h["type"])
        lines.append(f"| {label} | {steps} | `{tree}` |{cells} {rates} | {step} | {drafting} | "
                     f"{differing} of {compared} |")
    return lines


def _gib(x) -> str:
    return "-" if x is None else f"{x / 1024 ** 3:.2f}"


def tpu_compile_table(d: dict) -> list[str]:
    """bench/tpu_compile.py: training steps and decoding loops compiled for TPU slices, per-chip memory."""
    lines = ["Training step, per chip (GiB):", "",
             "| config | slice | mesh (data x fsdp x tp) | estimate | compiled: arguments | temporaries | total | "
             "compiled / estimate | HBM | fits | compile s |", "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in d["train"]:
        if r.get("error"):
            lines.append(f"| {r['config']} | {r['slice']} | {r['error']} | - | - | - | - | - | {_gib(r['hbm'])} | - | - |")
            continue
        c, m = r["compiled"], r["mesh"]
        fits = "yes" if c["total"] <= r["hbm"] and not c.get("refused") else "**no**"
        lines.append(f"| {r['config']} | {r['slice']} | {m['data']} x {m['fsdp']} x {m['tp']} | {_gib(r['estimate'])} | "
                     f"{_gib(c['arguments'])} | {_gib(c['temporaries'])} | {_gib(c['total'])} | "
                     f"{c['total'] / r['estimate']:.2f} | {_gib(r['hbm'])} | {fits} | {c['seconds']:.0f} |")
    lines += ["", "Decoding loop (prefill and every step), per chip (GiB):", "",
              "| base | slice | batch | loop | arguments | temporaries | total | HBM | fits | compile s |",
              "|---|---|---:|---|---:|---:|---:|---:|---|---:|"]
    for r in d["decode"]:
        loop = "autoregressive" if r["mode"] == "ar" else f"{TYPE_NAMES.get(r['head'], r['head'])} `{r['tree']}`"
        if r.get("error"):
            lines.append(f"| {r['base']} | {r['slice']} | {r['batch']} | {loop} | {r['error']} | - | - | - | - | - |")
            continue
        c = r["compiled"]
        fits = "yes" if c["total"] <= r["hbm"] and not c.get("refused") else "**no**"
        lines.append(f"| {r['base']} | {r['slice']} | {r['batch']} | {loop} | {_gib(c['arguments'])} | "
                     f"{_gib(c['temporaries'])} | {_gib(c['total'])} | {_gib(r['hbm'])} | {fits} | {c['seconds']:.0f} |")
    return lines


def tpu_steps_table(d: dict) -> list[str]:
    """bench/tpu_compile.py --steps: one decoding step per head type as the TPU compiler sees it."""
    lines = ["| slice | batch | step | tokens verified | HBM traffic (GiB) | floor (GiB) | traffic / floor | "
             "vs autoregressive step | XLA bytes accessed (GiB) | TFLOP | tau (measured) | predicted speed-up |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in d["steps"]:
        c = r["compiled"]
        floor = sum(r["floor"].values())
        label = ("autoregressive" if r["tree"] is None else
                 f"{TYPE_NAMES.get(r['head'], r['head']) if r['head'] else 'no head'} `{r['tree']}`")
        tokens = r.get("verified_tokens", "-")
        lines.append(f"| {r['slice']} | {r['batch']} | {label} | {tokens} | {_gib(c['hbm_bytes'])} | {_gib(floor)} | "
                     f"{c['hbm_bytes'] / floor:.3f} | {num(r.get('hbm_vs_ar'), '{:.2f}x')} | "
                     f"{_gib(c['bytes_accessed'])} | {c['flops'] / 1e12:.3f} | {num(r.get('tau'))} | "
                     f"{num(r.get('predicted_speedup'), '{:.2f}x')} |")
    return lines


def _cell(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    if isinstance(x, (list, tuple)):
        return ", ".join(_cell(v) for v in x)
    return "-" if x is None else str(x)


def _flat(row: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in row.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def generic_table(d: dict) -> list[str]:
    """A benchmark without a table of its own: its `rows`, one row per dict (nested dicts as `key.field` columns)."""
    rows = [_flat(r) for r in d.get("rows") or []]
    if not rows:
        return ["(no rows)"]
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return lines + ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows]


def section(d: dict) -> list[str]:
    lines = [f"## {d['title']}", "",
             f"- **Date:** {d['date']}",
             f"- **Machine:** {d['machine']}"]
    if d.get("settings"):
        lines.append(f"- **Settings:** {d['settings']}")
    lines += [f"- **Source:** `results/{d['_file']}` ({d.get('source', 'recorded by the command')})", "",
              "```bash", d["command"], "```", ""]
    tables = {"bench_spec": spec_table, "bench_step": step_table, "batch_table": batch_table,
              "choice": choice_table, "bench_rows": rows_table, "train_memory": train_memory_table,
              "compare_heads": compare_table, "first_request": first_request_table,
              "head_types": head_types_table, "tpu_compile": tpu_compile_table, "tpu_steps": tpu_steps_table,
              "train_step": train_step_table}
    lines += tables.get(d["benchmark"], generic_table)(d)
    for note in d.get("notes", []):
        lines += ["", note]
    return lines + [""]


def summary(results: list[dict]) -> list[str]:
    lines = ["| benchmark | machine | tree | tau | vs our AR | vs transformers | differing |",
             "|---|---|---|---|---|---|---|"]
    for d in results:
        for key in d.get("summary", []):
            r = d["runs"][key]
            label = f"`{name(key)}`"
            if key == "chosen" and r.get("choice"):  # what a request with no tree got, and what it chose
                c = r["choice"]
                label = "no tree named: " + ("plain decoding" if c["tree"] == "ar" else
                                             f"{short_head(c['head'])} `{c['tree']}`")
            vt = vs_transformers(d, r)
            lines.append(f"| {d.get('questions') or d['title']} ({d['date']}) | {d['machine_short']} | {label} | "
                         f"{num(r.get('tau'))} | {num(r.get('speedup_vs_ar'), '{:.2f}x')} | "
                         f"{num(vt, '{:.2f}x')} | {d.get('greedy_mismatches', '-')} of {d.get('greedy_compared', '-')} |")
    return lines


def render_doc(results: list[dict]) -> str:
    lines = [HEADER, "## Summary", ""] + summary(results) + [""]
    for d in results:
        lines += section(d)
    return "\n".join(lines).rstrip() + "\n"


def render_readme(text: str, results: list[dict]) -> str:
    if BEGIN not in text or END not in text:
        return text
    pre, rest = text.split(BEGIN, 1)
    _, post = rest.split(END, 1)
    return pre + BEGIN + "\n" + "\n".join(summary(results)) + "\n" + END + post


def render_training(text: str, results: list[dict]) -> str:
    """docs/training.md with the newest training-memory table between its markers."""
    runs = [d for d in results if d["benchmark"] == "train_memory"]
    if not runs or TRAIN_BEGIN not in text or TRAIN_END not in text:
        return text
    d = runs[0]
    pre, rest = text.split(TRAIN_BEGIN, 1)
    _, post = rest.split(TRAIN_END, 1)
    body = ["```bash", d["command"], "```", "", f"{d['machine']}, {d['date']} (`results/{d['_file']}`):", ""]
    body += train_memory_table(d) + [""] + d.get("notes", [])
    return pre + TRAIN_BEGIN + "\n" + "\n".join(body).rstrip() + "\n" + TRAIN_END + post


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/results.md or README.md is stale")
    args = ap.parse_args(argv)
    results = load()
    targets = {DOC: render_doc(results)}
    if README.is_file():
        targets[README] = render_readme(README.read_text(), results)
    if TRAINING.is_file():
        targets[TRAINING] = render_training(TRAINING.read_text(), results)
    stale = [p for p, text in targets.items() if not p.is_file() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"stale: {p.relative_to(ROOT)} (run python scripts/render_results.py)", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(targets[p])
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
