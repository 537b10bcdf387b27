"""What the bench scripts share: the results file, the machine it was measured on, child processes, question sets, the
transformers peer and random models of real shapes.

Running a script: `python bench/<script>.py ...` (from the repository root in the docs' commands; from anywhere it
works the same). A script imports this module and the scripts beside it by their plain names (`import toolkit`,
`from simulate_lookup import top_drafts`): Python puts a script's own folder first on `sys.path`, so nothing is added to
it here. Code that imports a bench script from elsewhere (the tests: `tests/test_bench_scripts.py`) puts `bench/` on
`sys.path` first.

Results: `--out PATH` writes one JSON object (`results` + `write_results`): `title`, `date`, `machine`,
`machine_short`, `settings`, `command`, `source`, `benchmark` and the numbers. Copied into `results/`, it is what
`python scripts/render_results.py` renders into docs/results.md (a benchmark without a table of its own there renders
its `rows`, one row per dict).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax

from clover_jax.generation.calibration import hardware_key

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
GIB = 1024 ** 3


# ------------------------------------------------------------------------------------------------- results
def machine(*extra: str) -> str:
    """Where a result was measured: the hardware as the calibrations key it (`hardware_key`: on a CPU its model and
    cores), Python and jax versions, then `extra`."""
    return ", ".join([hardware_key(), f"Python {platform.python_version()}", f"jax {jax.__version__}", *extra])


def machine_short() -> str:
    """The machine in one word or two, for the summary table: "CPU", or the accelerator's device kind."""
    dev = jax.devices()[0]
    return "CPU" if dev.platform == "cpu" else getattr(dev, "device_kind", dev.platform)


def command(script: str, argv: Sequence[str] | None) -> str:
    """The command line that ran `script` (its `__file__`) with `argv` (None: this process's arguments)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python", f"bench/{Path(script).name}", *map(shlex.quote, args)])


def results(script: str, argv: Sequence[str] | None, *, benchmark: str, title: str, settings: str = "",
            source: str = "recorded by the command", **numbers: Any) -> dict[str, Any]:
    """A results object: the header `scripts/render_results.py` needs, then `numbers`."""
    return {"title": title, "date": datetime.date.today().isoformat(), "machine": machine(),
            "machine_short": machine_short(), "settings": settings, "command": command(script, argv),
            "source": source, "benchmark": benchmark, **numbers}


def write_results(path: str | os.PathLike | None, result: dict) -> None:
    """Writes `result` to `path` as JSON (its folder made where missing); nothing where `path` is None."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


def add_out_argument(ap, default: str | None = None, what: str = "the results JSON") -> None:
    ap.add_argument("--out", default=default, metavar="PATH",
                    help=f"write {what} here (scripts/render_results.py renders it from results/)")


# ------------------------------------------------------------------------------------------------ children
@dataclasses.dataclass
class Child:
    """What a child process left: its report (None where it wrote none), its peak resident bytes, "" or why it was
    stopped, and the end of its output."""
    report: dict | None
    peak_bytes: int
    stopped: str
    log: str


def run_child(script: str | os.PathLike, spec: dict, *, env: dict[str, str] | None = None,
              limit_bytes: int | None = None, timeout: float | None = None, check: bool = True,
              echo: bool = False) -> Child:
    """Runs `python SCRIPT --child SPEC --report FILE` (the script answers with `serve_child`) and waits for it: a
    new process per measurement (its own caches, its own peak memory). `env` is added to this process's environment.
    A child whose resident memory passes `limit_bytes`, or that runs past `timeout` seconds, is stopped (`stopped`
    says why). With `check`, a child that fails or is stopped raises SystemExit with the end of its output. Its
    output goes to a log (the end of it kept in `log`), or with `echo` to this process's output as it comes."""
    with tempfile.TemporaryDirectory(prefix="clover_jax_bench_child_") as tmp:
        report, log = Path(tmp) / "report.json", Path(tmp) / "log.txt"
        with log.open("w") as sink:
            proc = subprocess.Popen([sys.executable, str(script), "--child", json.dumps(spec), "--report", str(report)],
                                    env={**os.environ, **(env or {})}, stdout=None if echo else sink,
                                    stderr=None if echo else subprocess.STDOUT)
        stopped, t0 = "", time.monotonic()
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # reaps it (its rusage) once it has ended
            if pid:
                break
            if limit_bytes is not None and _rss(proc.pid) > limit_bytes:
                stopped = f"stopped at the {limit_bytes / GIB:.0f} GiB limit"
            elif timeout is not None and time.monotonic() - t0 > timeout:
                stopped = f"stopped after {timeout:.0f} s"
            if stopped:
                os.kill(proc.pid, signal.SIGKILL)
                _, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.1)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
        tail = log.read_text()[-3000:]
        if not stopped and proc.returncode != 0:
            stopped = f"failed (status {proc.returncode})"
        if check and stopped:
            raise SystemExit(f"{Path(script).name} child {json.dumps(spec)[:200]}: {stopped}\n{tail}")
        if stopped:
            print(tail, file=sys.stderr)
        found = json.loads(report.read_text()) if report.is_file() else None
        return Child(found, int(usage.ru_maxrss) * 1024, stopped, tail)  # ru_maxrss: kilobytes on Linux


def serve_child(argv: Sequence[str] | None, work: Callable[[dict], dict]) -> bool:
    """In a process `run_child` started (`--child SPEC --report FILE`): runs `work(spec)`, writes what it returns as
    the report, and returns True; else (a normal command line) False."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] != ["--child"]:
        return False
    Path(args[args.index("--report") + 1]).write_text(json.dumps(work(json.loads(args[1]))))
    return True


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# ----------------------------------------------------------------------------------------------- questions
def load_questions(which: str, limit: int | None, category=None) -> tuple[list[str], list[str]]:
    """(first turns, categories) of a question set (`mt_bench`, `spec_bench`, `sharegpt_heldout` or a .jsonl file);
    `category`: one or several; `limit`: that many, every category kept (the first `limit / categories` of each)."""
    from clover_jax.io.prompts import questions_path

    path = questions_path(which)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if category:  # one category, or several
        wanted = {category} if isinstance(category, str) else set(category)
        rows = [r for r in rows if r.get("category") in wanted]
    if limit:
        cats = sorted({r.get("category", "all") for r in rows})
        per = max(1, limit // len(cats))
        picked = []
        for c in cats:
            picked += [r for r in rows if r.get("category", "all") == c][:per]
        rows = picked[:limit]
    return [r["turns"][0] for r in rows], [r.get("category", "all") for r in rows]


# -------------------------------------------------------------------------------------------- the peer
def transformers_model(model: str, threads: int | None = None):
    """transformers' own model of the same weights in float32 (torch): a GGUF file (a known name) through its GGUF
    loader, a model folder through `from_pretrained`. `threads`: torch's (None: the machine's cores)."""
    import torch  # optional: the peer of the benchmarks that compare with it
    import transformers

    from clover_jax.io.loader import resolve_model_path

    torch.set_num_threads(threads or os.cpu_count() or 2)
    path = resolve_model_path(model)
    if path.is_dir():
        return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def transformers_generate(model, pad: int, prompt_ids: list[list[int]], batch: int, max_new: int,
                          eos: int) -> tuple[dict, list[list[int]]]:
    """Greedy `generate` of transformers over the prompts, `batch` at a time (left-padded), after one warm-up call:
    ({tokens, seconds, tok_per_s}, each prompt's new tokens up to and with the first `eos`)."""
    import torch  # optional: the peer

    total_tok = total_s = 0.0
    outputs = []
    model.generate(torch.tensor([prompt_ids[0]]), max_new_tokens=2, do_sample=False, pad_token_id=eos)  # allocates
    for i in range(0, len(prompt_ids), batch):
        chunk = prompt_ids[i:i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=eos, pad_token_id=pad)
        total_s += time.perf_counter() - t0
        for row in out[:, width:].tolist():
            n = row.index(eos) + 1 if eos in row else len(row)
            total_tok += n
            outputs.append(row[:n])
    return {"tokens": int(total_tok), "seconds": total_s, "tok_per_s": total_tok / total_s}, outputs


# ---------------------------------------------------------------------------------- random models of real shapes
SHAPES = {  # (vocab, hidden, layers, heads, kv_heads, intermediate, tied)
    "tiny": (256, 64, 2, 4, 2, 128, True),  # for a quick check that a script runs
    "smollm2-135m": (49152, 576, 30, 9, 3, 1536, True),
    "smollm2-360m": (49152, 960, 32, 15, 5, 2560, True),
    "llama3-8b": (128256, 4096, 32, 32, 8, 14336, False),
}


def random_base(shape: str, dtype, *, num_layers: int = 0, positions: int = 8192):
    """A base model of a real model's shapes (`SHAPES`) with random weights (`num_layers`: cut the stack; 0: the
    shape's), holding at least `positions` positions."""
    from clover_jax.models.config import LlamaConfig
    from clover_jax.models.llama import init_llama

    v, d, layers, heads, kv, inter, tied = SHAPES[shape]
    config = LlamaConfig(vocab_size=v, hidden_size=d, intermediate_size=inter, num_hidden_layers=num_layers or layers,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=d // heads,
                         tie_word_embeddings=tied, max_position_embeddings=max(8192, positions))
    return init_llama(config, seed=0, dtype=dtype, param_dtype=dtype)


def random_head(base, head_type: str, dtype, draft_vocab: int = 0):
    """A head of a registered type for `base`, random weights (`draft_vocab` > 0: an EAGLE-3 head's own vocabulary
    of that many tokens; its config also names the base layers it fuses)."""
    from flax import nnx

    from clover_jax.heads import registry

    ht = registry.get(head_type)
    kw = {}
    if ht.name == "eagle3":
        from clover_jax.heads.eagle3 import default_feature_layers

        v = base.config.vocab_size
        kw = {"feature_layers": default_feature_layers(base.config.num_hidden_layers),
              "draft_vocab_size": draft_vocab if 0 < draft_vocab < v else 0}
    return ht.module_cls(base.config, ht.config_cls(dtype=dtype, param_dtype=dtype, **kw), rngs=nnx.Rngs(1))


__all__ = ["BENCH", "Child", "ROOT", "SHAPES", "add_out_argument", "command", "load_questions", "machine",
           "machine_short", "random_base", "random_head", "results", "run_child", "serve_child",
           "transformers_generate", "transformers_model", "write_results"]
