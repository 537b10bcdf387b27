"""Every bench script runs on a tiny model and writes a results JSON that `scripts/render_results.py` renders.

The scripts run in this process (`main(argv)`), on a tiny random Llama with SmolLM2's tokenizer exported to a model
folder and a random Clover-2 head exported beside it (or `--shape tiny`); the one script whose point is a child
process (`bench_train_memory.py`: the child's peak memory) starts one. The scripts that measure in new processes
(`choice.py`) run their children's work in this process here. Each output must carry the header of a results file
and its benchmark's own keys, and render.
"""

import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import jax
import pytest
from flax import nnx

from clover_jax.heads.clover2.model import Clover2Config, Clover2Head
from clover_jax.heads.export import export_head
from clover_jax.io.export import export_base
from clover_jax.io.loader import load_tokenizer
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import init_llama

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
HEADER = ("title", "date", "machine", "machine_short", "settings", "command", "source", "benchmark")


def script(name: str):
    """A bench script as a module; its siblings (`toolkit`, ...) import by their plain names, as when it runs."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def render(d: dict, path: Path) -> str:
    """`d`'s section of docs/results.md, as `scripts/render_results.py` renders a file of results/."""
    spec = importlib.util.spec_from_file_location("render_results", ROOT / "scripts" / "render_results.py")
    renderer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(renderer)
    return "\n".join(renderer.section(dict(d, _file=path.name)))


def results(path: Path, benchmark: str, *keys: str) -> dict:
    """The results file at `path`: its header, its benchmark, `keys`, and a section that renders."""
    d = json.loads(path.read_text())
    assert set(HEADER) <= set(d), sorted(set(HEADER) - set(d))
    assert d["benchmark"] == benchmark and d["command"].startswith("python bench/")
    assert set(keys) <= set(d), sorted(set(keys) - set(d))
    assert d["title"] in render(d, path)
    return d


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model folder (SmolLM2's tokenizer and chat template) and a Clover-2 head folder for it (five heads:
    its type's default tree, which a request with no tree measures, fits)."""
    d = tmp_path_factory.mktemp("bench_tiny")
    tok = load_tokenizer("smollm2-135m-instruct")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
                         eos_token_ids=(tok.eos_token_id,), bos_token_id=tok.bos_token_id,
                         pad_token_id=tok.pad_token_id)
    base = init_llama(config, seed=0)
    export_base(base, d / "model", tokenizer=tok)
    head = Clover2Head(config, Clover2Config(num_heads=5, num_aug_layers=1), rngs=nnx.Rngs(0))
    export_head(head, d / "head", base=base, base_name=str(d / "model"))
    return {"dir": d, "model": str(d / "model"), "head": str(d / "head")}


@pytest.fixture(scope="module")
def step_report(tmp_path_factory):
    """`bench_step.py time` on tiny shapes: every part of a step timed, the loop's ms per step."""
    out = tmp_path_factory.mktemp("bench_step") / "step.json"
    assert script("bench_step").main(["time", "--shape", "tiny", "--trees", "chain-2", "--draft-vocab", "64",
                                      "--context", "12", "--cache-size", "128", "--repeat", "1", "--loop-tokens",
                                      "2", "6", "--loop-repeat", "1", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def compare_report(tiny):
    out = tiny["dir"] / "compare" / "compare.json"
    assert script("compare_heads").main([f"{tiny['head']}@chain-2", "--model", tiny["model"], "--limit", "2",
                                         "--max-new-tokens", "4", "--out", str(out)]) == 0
    return out


@pytest.mark.slow  # runs a bench script
def test_bench_step_time(step_report):
    d = results(step_report, "bench_step", "trees", "steps", "summary")
    step = d["steps"]["chain-2"]
    assert step["verified_tokens"] == 3 and step["depth"] == 2 and step["head"] == "clover2"
    for part in ("spec: draft", "spec: verify forward + KV write", "spec: logits", "spec: acceptance",
                 "spec: KV compaction", "spec: head commit", "ar: forward + KV append"):
        assert d["trees"]["chain-2"][part] > 0, part
    assert step["draft_ms"] > 0 and d["summary"]["chain-2"]["U"] == 3


@pytest.mark.slow  # runs a bench script
def test_bench_step_bytes(tmp_path):
    out = tmp_path / "bytes.json"
    assert script("bench_step").main(["bytes", "--shape", "tiny", "--trees", "chain-2", "--draft-vocab", "64",
                                      "--context", "12", "--cache-size", "128", "--layers", "unrolled",
                                      "--loop-tokens", "2", "6", "--loop-repeat", "1", "--time", "--out",
                                      str(out)]) == 0
    d = results(out, "step_bytes", "rows", "programs_compiled")
    assert [r["loop"] for r in d["rows"]] == ["autoregressive", "chain-2"]
    for r in d["rows"]:
        assert r["step"]["bytes_accessed"] > 0 and r["floor_bytes"] > 0 and "ms_per_step" in r
    assert d["rows"][1]["floor"]["draft head"] > 0 and "draft head" not in d["rows"][0]["floor"]


@pytest.mark.parametrize("tree", ["chain-2", "ar"])
@pytest.mark.slow  # traces a step
def test_bench_step_trace(tree, tmp_path):
    """The loop's ops per step from two traced calls; the environment is left as it was."""
    import os

    flags = os.environ.get("XLA_FLAGS")
    out = tmp_path / "trace.json"
    assert script("bench_step").main(["trace", "--shape", "tiny", "--tree", tree, "--context", "12", "--cache-size",
                                      "128", "--new-tokens", "40", "--top", "5", "--out", str(out)]) == 0
    assert os.environ.get("XLA_FLAGS") == flags
    d = results(out, "step_trace", "rows", "all_ops_ms_per_step")
    assert 1 <= len(d["rows"]) <= 5 and all({"op", "ms_per_step", "calls_per_step"} <= set(r) for r in d["rows"])


@pytest.mark.slow  # runs a bench script on a mesh
def test_bench_step_on_a_mesh_times_the_loops(tmp_path):
    """`time --mesh tp=2` (2 of the 8 simulated CPU devices): the loops run sharded, no parts."""
    out = tmp_path / "mesh.json"
    assert script("bench_step").main(["time", "--shape", "tiny", "--trees", "chain-2", "--draft-vocab", "64",
                                      "--context", "12", "--cache-size", "128", "--loop-tokens", "2", "6",
                                      "--loop-repeat", "1", "--mesh", "tp=2", "--out", str(out)]) == 0
    d = results(out, "bench_step", "trees")
    assert d["mesh"] == "tp=2" and set(d["trees"]["chain-2"]) == {"loop: AR step", "loop: speculative step"}


@pytest.mark.slow  # runs a bench script
def test_bench_spec_and_its_batch_table(tiny):
    out = tiny["dir"] / "spec" / "b1" / "results.json"
    assert script("bench_spec").main(["--model", tiny["model"], "--head", tiny["head"], "--questions", "mt_bench",
                                      "--limit", "2", "--max-new-tokens", "4", "--trees", "chain-2",
                                      "--prompt-bucket", "256", "--out", str(out)]) == 0
    d = results(out, "bench_spec", "runs", "greedy_compared", "greedy_mismatches", "per_batch")
    assert set(d["runs"]) == {"ar", "chain-2"} and d["greedy_mismatches"] == 0 and d["greedy_compared"] == 2
    assert (out.parent / "results.md").is_file() and (out.parent / "accept_hist.png").is_file()
    merged = tiny["dir"] / "spec" / "results.json"  # the batch sizes' runs merged (here the one run above)
    assert script("bench_spec").main(["--merge-only", "--batch-sizes", "1", "--trees", "chain-2", "--out",
                                      str(merged)]) == 0
    table = results(merged, "batch_table", "rows")
    assert table["rows"][0]["batch_size"] == 1 and set(table["rows"][0]["runs"]) == {"chain-2"}
    # a batch size's own process gets the command line less the sweep's options, and its batch size and file
    assert script("bench_spec").strip_batch_options(["--limit", "2", "--batch-sizes", "1", "2", "--out", "x.json",
                                                     "--merge-only", "--trees", "a", "b"]) == [
        "--limit", "2", "--trees", "a", "b"]


@pytest.mark.slow  # runs bench scripts
def test_compare_heads_and_head_types(compare_report, step_report, tmp_path):
    d = results(compare_report, "compare_heads", "heads", "prompts")
    (entry,) = d["heads"].values()
    assert entry["type"] == "clover2" and set(entry["trees"]) == {"chain-2"} and entry["greedy_mismatches"] == 0
    out = tmp_path / "types.json"
    assert script("head_types").main(["--compare", f"mt_bench={compare_report}", "--steps", str(step_report),
                                      "--out", str(out), "--title", "t", "--machine", "m"]) == 0
    table = results(out, "head_types", "heads", "sets", "draft")
    assert table["draft"]["clover2 chain-2"]["draft_ms"] > 0


@pytest.mark.slow  # runs bench scripts
def test_choice_by_batch_and_first_request(tiny, tmp_path, monkeypatch):
    """Each measurement's child work runs here, in this process, under the environment the child would get."""
    choice, toolkit = script("choice"), script("toolkit")

    caches = []  # the choices folder of each measurement

    def in_process(path, spec, env=None, **kw):
        caches.append(env["CLOVER_JAX_CACHE"])
        with monkeypatch.context() as m:
            for k, v in (env or {}).items():
                m.setenv(k, v)
            return toolkit.Child(choice.child(spec), 0, "", "")

    monkeypatch.setattr(toolkit, "run_child", in_process)
    common = ["--model", tiny["model"], "--head", tiny["head"], "--batch-sizes", "1", "--prompt-bucket", "64",
              "--reply-tokens", "4"]
    out = tmp_path / "choice.json"
    assert choice.main(["by-batch", *common, "--scopes", "request", "--out", str(out)]) == 0
    d = results(out, "choice", "rows")
    row = d["rows"][0]
    assert {"request", "request_next", "request_again"} <= set(row)
    # the next request reads the first's folder, the second new one its own; none is left behind
    assert len(caches) == 3 and caches[1] == caches[0] != caches[2]
    assert not any(os.path.exists(c) for c in caches)
    out = tmp_path / "first.json"
    assert choice.main(["first-request", *common, "--repeats", "1", "--out", str(out)]) == 0
    d = results(out, "first_request", "rows")
    assert d["rows"][0]["no_tree"]["choice"] and d["rows"][0]["default"]["tokens"] > 0


@pytest.mark.slow  # runs a bench script against transformers
def test_bench_ar_against_transformers(tiny, tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "ar.json"
    assert script("bench_ar").main(["--model", tiny["model"], "--limit", "2", "--max-new-tokens", "4",
                                    "--batch-sizes", "2", "--threads", "1", "--out", str(out)]) == 0
    d = results(out, "bench_ar", "rows")
    assert d["rows"][0]["ours"]["tokens"] > 0 and d["rows"][0]["transformers"]["tokens"] > 0


@pytest.mark.slow  # runs a bench script
def test_bench_context(tiny, tmp_path):
    out = tmp_path / "context.json"
    assert script("bench_context").main(["--model", tiny["model"], "--max-new-tokens", "4", "--repeat", "1",
                                         "--cache-sizes", "2304", "--no-peer", "--out", str(out)]) == 0
    d = results(out, "bench_context", "rows", "by_cache")
    assert len(d["rows"]) == 4 and all(r["ours_1_token_s"] > 0 for r in d["rows"]) and len(d["by_cache"]) == 1


@pytest.mark.slow  # runs a bench script
def test_bench_compile(tmp_path):
    out = tmp_path / "compile.json"
    assert script("bench_compile").main(["--shape", "tiny", "--batch-size", "1", "--prompt-len", "16",
                                         "--cache-size", "64", "--tree", "chain-2", "--draft-vocab", "0", "--out",
                                         str(out)]) == 0
    d = results(out, "bench_compile", "rows")
    assert d["rows"][0]["compile_s"] > 0


@pytest.mark.slow  # runs a bench script on a mesh
def test_bench_mesh(tiny, tmp_path):
    out = tmp_path / "mesh.json"
    assert script("bench_mesh").main(["--model", tiny["model"], "--head", tiny["head"], "--tree", "chain-2",
                                      "--limit", "2", "--batch-size", "2", "--max-new-tokens", "4", "--meshes",
                                      "tp=2", "--out", str(out)]) == 0
    d = results(out, "bench_mesh", "rows")
    assert [(r["mode"], r["mesh"]) for r in d["rows"]] == [("ar", "one device"), ("ar", "tp=2"),
                                                          ("speculative", "one device"), ("speculative", "tp=2")]
    assert all(r["identical"].startswith("2/2") for r in d["rows"])


@pytest.mark.slow  # runs a bench script
def test_bench_precision(tiny, tmp_path):
    """Float32 products asked against the backend's default: on a CPU both are float32, so the outputs agree, and
    the caller's precision is as it was afterwards."""
    out = tmp_path / "precision.json"
    assert script("bench_precision").main(["--model", tiny["model"], "--head", tiny["head"], "--tree", "chain-2",
                                           "--limit", "1", "--max-new-tokens", "4", "--repeat", "1", "--out",
                                           str(out)]) == 0
    d = results(out, "bench_precision", "rows")
    assert [r["loop"] for r in d["rows"]] == ["ar", "speculative"] and all(r["identical"] == "1/1" for r in d["rows"])
    from clover_jax.decoding import autoregressive

    assert jax.config.jax_default_matmul_precision is None
    assert autoregressive.products_precision("float32") == "highest"


def test_bench_products(tmp_path):
    out = tmp_path / "products.json"
    assert script("bench_products").main(["--shape", "tiny", "--rows", "1", "3", "--repeat", "2", "--out",
                                          str(out)]) == 0
    d = results(out, "bench_products", "rows")
    assert [r["rows"] for r in d["rows"]] == [1, 3] and all(r["logits_ms"] > 0 for r in d["rows"])


@pytest.mark.slow  # runs a bench script
def test_bench_rows(tiny, tmp_path):
    out = tmp_path / "rows.json"
    assert script("bench_rows").main(["--model", tiny["model"], "--dtypes", "float32", "--batch-sizes", "1",
                                      "--out", str(out)]) == 0
    d = results(out, "bench_rows", "products", "chain", "hidden_size")
    assert set(d["chain"]) == {"float32 batch 1"} and len(d["chain"]["float32 batch 1"]) == 4


@pytest.mark.slow  # runs a training bench
def test_bench_train(tiny, tmp_path):
    out = tmp_path / "train.json"
    assert script("bench_train").main(["--set", f"model.name_or_path={tiny['model']}", "--steps", "1", "--length",
                                       "64", "--positions", "8", "--draft-vocab", "64", "--variants", "online",
                                       "packed+dv", "--out", str(out)]) == 0
    d = results(out, "train_step", "rows", "feature_seconds")
    assert [r["variant"] for r in d["rows"]] == ["online", "packed+dv"] and all(r["step_s"] > 0 for r in d["rows"])


@pytest.mark.slow  # starts a process
def test_bench_train_memory_measures_a_child(tmp_path):
    """The one script whose point is a child process: its peak resident memory against the estimate."""
    out = tmp_path / "memory.json"
    assert script("bench_train_memory").main(["--points", "tiny", "--steps", "1", "--no-compile", "--out",
                                              str(out)]) == 0
    d = results(out, "train_memory", "rows", "steps")
    (row,) = d["rows"]
    assert row["measured"] > 0 and row["estimate"] > 0 and not row.get("note")


@pytest.mark.slow  # runs a bench script
def test_count_compiles(tiny, tmp_path):
    out = tmp_path / "compiles.json"
    assert script("count_compiles").main(["--model", tiny["model"], "--head", tiny["head"], "--limit", "2",
                                          "--trees", "chain-2", "--max-new-tokens", "4", "--out", str(out)]) == 0
    d = results(out, "count_compiles", "rows")
    assert [r["loop"] for r in d["rows"]] == ["ar", "chain-2"]
    assert all(0 < r["compiled"] <= r["programs"] for r in d["rows"])


@pytest.mark.slow  # runs bench scripts
def test_simulate_lookup_and_head_calibration(tiny, tmp_path):
    out = tmp_path / "sim.json"
    assert script("simulate_lookup").main(["--model", tiny["model"], "--head", tiny["head"], "--limit", "2",
                                           "--max-new-tokens", "8", "--trees", "chain-2", "--lookup", "0", "2",
                                           "--out", str(out)]) == 0
    d = results(out, "simulate_lookup", "rows")
    assert {r["run"] for r in d["rows"]} == {"lookup-2", "chain-2", "chain-2+lookup-2"}
    assert all(r["all"] >= 1.0 for r in d["rows"])
    out = tmp_path / "calibration.json"
    assert script("head_calibration").main(["--model", tiny["model"], "--head", tiny["head"], "--limit", "2",
                                            "--max-new-tokens", "8", "--top-k", "2", "--out", str(out)]) == 0
    d = results(out, "head_calibration", "rows")
    assert [r["depth"] for r in d["rows"]] == [1, 2, 3, 4, 5] and all(0 <= r["ece"] <= 1 for r in d["rows"])


@pytest.mark.slow  # compiles for a TPU
@pytest.mark.optimized
def test_tpu_compile(tiny, tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text("\n".join([
        f"model: {{name_or_path: {tiny['model']}, dtype: bfloat16, param_dtype: bfloat16}}",
        "head: {type: clover2, num_heads: 3, num_aug_layers: 1}",
        "data: {batch_size: 4, max_length: 64, bucket_boundaries: [64]}",
        "train: {compute_dtype: bfloat16, cache_features: false}", "mesh: {data: -1, fsdp: 1, tp: 2}", ""]))
    out = tmp_path / "tpu.json"
    assert script("tpu_compile").main(["--configs", str(config), "--train-slices", "v5e-4", "--decode-slices",
                                       "v5e-4", "--batch-sizes", "1", "--prompt-length", "16", "--max-new-tokens",
                                       "8", "--out", str(out)]) == 0
    d = results(out, "tpu_compile", "train", "decode")
    assert d["train"][0]["compiled"]["total"] > 0 and [r["mode"] for r in d["decode"]] == ["ar", "speculative"]


@pytest.mark.slow  # reads the ShareGPT data
def test_make_sharegpt_questions(tmp_path):
    """Not a benchmark: it writes a question set (JSON lines, the shipped sets' format)."""
    out = tmp_path / "questions.jsonl"
    assert script("make_sharegpt_questions").main(["--n", "2", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(set(r) == {"question_id", "category", "turns"} for r in rows)


def test_every_script_is_run_here():
    """A new script in bench/ gets its run above."""
    ran = {"bench_step", "bench_spec", "compare_heads", "head_types", "choice", "bench_ar", "bench_context",
           "bench_compile", "bench_mesh", "bench_precision", "bench_products", "bench_rows", "bench_train",
           "bench_train_memory", "count_compiles", "simulate_lookup", "head_calibration", "tpu_compile",
           "make_sharegpt_questions"}
    assert {p.stem for p in BENCH.glob("*.py")} - {"toolkit"} == ran
