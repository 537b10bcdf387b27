"""Compiling for TPU slices on this CPU with the real TPU compiler (libtpu, installed beside the environment by
scripts/env.sh): slice names, the training step and the decoding loops of a small model on data x tp meshes of two
TPU generations and a multi-host slice, the compiled memory against the memory plan's estimate, the command lines'
`--compile-only`, and a default run that never starts libtpu."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from clover_jax import parallel, tpu
from clover_jax.cli import infer as infer_cli
from clover_jax.cli import train as train_cli
from clover_jax.decoding.sampling import top_k_ids, vocab_split_over
from clover_jax.generation.compiled import abstract_base, compile_decoding, compile_steps
from clover_jax.models.config import LlamaConfig
from clover_jax.training.compiled import compile_training_step
from clover_jax.training.config import load_config
from clover_jax.training.memory import estimate_training_memory
from clover_jax.validation import InputError, InsufficientMemoryError

pytestmark = pytest.mark.optimized  # the TPU executables, as users compile them

# big enough that weights, activations and logits outweigh the programs' code, small enough to compile in seconds
SMALL = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=32, eos_token_ids=(2,),
                    max_position_embeddings=8192)
TINY = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, eos_token_ids=(2,))


# ------------------------------------------------------------------------------------------------ slice names
@pytest.mark.parametrize("name, topology, chips, slices, hbm_gib", [
    ("v5e-8", "v5e:2x4", 8, 1, 16), ("v5e-16", "v5e:4x4", 16, 1, 16), ("v6e-8", "v6e:2x4", 8, 1, 32),
    ("v4-8", "v4:2x2x1", 4, 1, 32), ("v5p-8", "v5:2x2x1", 4, 1, 95), ("v5p-16", "v5:2x2x2", 8, 1, 95),
    ("2xv5e-16", "v5e:4x4", 16, 2, 16), ("V5E:2x2", "v5e:2x2", 4, 1, 16), ("v5p:2x2x2", "v5:2x2x2", 8, 1, 95),
])
def test_slice_names(name, topology, chips, slices, hbm_gib):
    sl = tpu.parse_slice(name)
    assert (sl.topology, sl.chips, sl.num_slices, sl.hbm) == (topology, chips, slices, hbm_gib * tpu.GIB)
    assert sl.devices == chips * slices


@pytest.mark.parametrize("name, says", [("v5e-12", "known sizes: 1, 4, 8, 16"), ("v4-6", "known sizes: 8, 16"),
                                        ("v7-8", "unknown generation 'v7'"), ("", "generation>-<size>"),
                                        ("v5e:2x2x2", "has 2 dimensions"), ("tpu", "generation>-<size>")])
def test_bad_slice_names_are_named(name, says):
    with pytest.raises(InputError, match=says):
        tpu.parse_slice(name)


def test_missing_libtpu_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv(tpu.LIBTPU_ENV, str(tmp_path))
    with pytest.raises(tpu.LibtpuMissingError, match=r"pip install --no-deps --target .*libtpu==") as e:
        tpu.find_libtpu()
    assert str(tmp_path) in str(e.value)


def test_libtpu_is_the_version_jax_pins():
    lib = tpu.find_libtpu()  # the suite's set-up installs it (scripts/env.sh): missing is a failure, not a skip
    assert lib.name == "libtpu.so"
    assert tpu.libtpu_requirement().startswith("libtpu==")


def test_default_run_prints_nothing_of_tpus():
    """A plain run of the default set-up neither finds libtpu as a package nor prints TPU start-up warnings."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_LIBRARY_PATH", tpu.LIBTPU_ENV)}
    code = ("import importlib.util, clover_jax, jax; print(importlib.util.find_spec('libtpu') is None, "
            "jax.default_backend())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "cpu"]
    assert "TPU" not in out.stderr and "tpu" not in out.stderr.lower(), out.stderr


# ------------------------------------------------------------------------------------------------ training step
def _cfg(data: int, tp: int, *extra: str):
    return load_config(None, ["head.type=clover2", "head.num_heads=3", "head.num_aug_layers=1", "data.batch_size=8",
                              "data.max_length=512", "data.bucket_boundaries=[512]", "train.cache_features=false",
                              f"mesh.data={data}", "mesh.fsdp=1", f"mesh.tp={tp}", "model.dtype=bfloat16",
                              "model.param_dtype=bfloat16", "train.compute_dtype=bfloat16", *extra])


@pytest.mark.parametrize("name, data, tp, hosts", [("v6e-8", 4, 2, 2), ("v5e-16", 8, 2, 4)])
@pytest.mark.slow  # compiles training steps for a TPU
def test_training_step_compiles_within_the_estimate(name, data, tp, hosts):
    """The training step on a data x tp mesh of a 2-host v6e slice and a 4-host v5e slice (v5e-4 below, through the
    command line). What it holds per chip as arguments is what the memory plan counts for the frozen base, the head,
    its optimizer state and the batch (within 1%), and its whole per-chip memory stays within the plan's estimate
    plus 10%: the plan never lets through a step the chip cannot hold. (The estimate's activation and logits terms
    are fitted to a CPU's peak memory; the TPU compiler needs several times less for these small steps.)"""
    sl = tpu.parse_slice(name)
    assert tpu.slice_hosts(sl) == hosts
    cfg = _cfg(data, tp)
    mesh = tpu.slice_mesh(sl, cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tp)
    assert dict(mesh.shape) == {"data": data, "fsdp": 1, "tp": tp}
    assert {d.platform for d in mesh.devices.flat} == {"tpu"}
    prog = compile_training_step(cfg, SMALL, mesh)
    est = estimate_training_memory(cfg, SMALL, mesh, platform="tpu")
    held = sum(est.items[k] for k in ("frozen base", "head", "optimizer", "batch"))
    assert prog.arguments == pytest.approx(held, rel=0.01)
    assert prog.total <= 1.1 * est.total, (tpu.fmt(prog.total), tpu.fmt(est.total))
    assert prog.flops > 0 and prog.bytes_accessed > 0 and not prog.refused


# ------------------------------------------------------------------------------------------------ decoding loops
@pytest.mark.parametrize("name, mesh_sizes, mode, head_type, tree", [
    ("v5e-4", dict(data=2, tp=2), "ar", None, None),
    *(pytest.param(*p, marks=pytest.mark.slow) for p in (  # a TPU compile of a speculative loop each
        ("v5e-4", dict(data=2, tp=2), "speculative", None, "lookup-4"),  # head-less
        ("v6e-8", dict(data=2, tp=4), "speculative", "clover2", "clover2-26"),  # a static tree
        ("v6e-8", dict(data=2, tp=4), "speculative", "eagle", "dynamic-10"),  # a per-step (EAGLE-2) tree
        ("v6e-8", dict(data=2, tp=4), "speculative", "redrafter", "beam-4x5"),  # beams
    )),
])
def test_decoding_loops_compile(name, mesh_sizes, mode, head_type, tree):
    """Each drafter family's loop compiles for a TPU slice; the weights the caller holds per chip are what the
    program reads (the loop reads every weight), and split over tp."""
    sl = tpu.parse_slice(name)
    mesh = tpu.slice_mesh(sl, **mesh_sizes)
    (prog,) = compile_decoding(TINY, mesh, mode=mode, head_type=head_type, tree=tree, batch=4, prompt_length=40,
                               max_new_tokens=24, dtype="bfloat16")
    assert prog.arguments >= prog.read_arguments > 0
    state = nnx.state(abstract_base(TINY, jnp.bfloat16))
    weights = tpu.held_bytes(tpu.abstract(state, parallel.model_shardings(state, mesh)))
    assert weights < tpu.held_bytes(tpu.abstract(state, parallel.replicated(mesh)))  # tp splits the weights
    if mode == "ar":
        assert prog.read_arguments >= weights  # it reads every weight, as placed
    assert prog.flops > 0 and prog.total < sl.hbm and not prog.refused


# ------------------------------------------------------------------------------------------------ one step's bytes
def test_draft_top_k_keeps_a_split_output_projection_in_place():
    """Drafting takes the top k of logits whose vocabulary tp splits (1,000 ids per chip here, not a whole number of
    the 128-id blocks `top_k_ids` works in). Compiled for a TPU inside `vocab_split_over`, the program reads about
    its own share of the output projection once (HBM traffic read off the compiled program), gathers no weights and
    computes its ids (the TPU compiler turns an index-only `lax.top_k` over a split axis into zeros)."""
    sl = tpu.parse_slice("v5e-8")
    mesh = tpu.slice_mesh(sl, data=2, tp=4)
    d, v, rows, k = 512, 8000, 4, 4
    w = jax.ShapeDtypeStruct((d, v), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "tp")))
    h = jax.ShapeDtypeStruct((rows, d), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))

    def draft(h, w):
        with vocab_split_over(mesh):
            return top_k_ids(h @ w, k)

    hlo = jax.jit(draft).lower(h, w).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    share = d * v // 4 * 2
    assert share <= tpu.hbm_traffic(hlo)[0] < 1.1 * share
    assert "ROOT %broadcast" not in entry and "bf16[512,8000]" not in entry  # ids computed; no gathered weights


def test_autoregressive_step_reads_its_floor():
    """One autoregressive step of SMALL (bfloat16, tp=4 on v5e-4, layers unrolled) moves about the bytes it must
    read: its weights and its KV cache, within 5% (a prefetch into on-chip memory counted once, an in-place cache
    write as the row it writes)."""
    mesh = tpu.slice_mesh(tpu.parse_slice("v5e-4"), data=1, tp=4)
    big = dataclasses.replace(SMALL, hidden_size=1024, intermediate_size=2816, num_attention_heads=8, head_dim=128,
                              num_key_value_heads=4, vocab_size=32768)
    ((prog, floor),) = compile_steps(big, mesh, batch=1, cache_size=1024)
    assert "autoregressive" in prog.name
    assert 0.99 * sum(floor.values()) <= prog.hbm_bytes <= 1.05 * sum(floor.values()), (prog.hbm_bytes, floor)


# ------------------------------------------------------------------------------------------------ command lines
@pytest.fixture(scope="module")
def small_config(tmp_path_factory):
    """A training config whose base is a local folder holding SMALL's config.json (no weights: none are read)."""
    folder = tmp_path_factory.mktemp("small-llama")
    (folder / "config.json").write_text(json.dumps(SMALL.to_hf_dict()))
    path = folder / "small.yaml"
    path.write_text("\n".join([
        f"model: {{name_or_path: {folder}, dtype: bfloat16, param_dtype: bfloat16}}",
        "head: {type: clover2, num_heads: 3, num_aug_layers: 1}",
        "data: {batch_size: 8, max_length: 512, bucket_boundaries: [512]}",
        "train: {compute_dtype: bfloat16, cache_features: false}",
        "mesh: {data: -1, fsdp: 1, tp: 2}", ""]))
    return path


@pytest.mark.slow  # compiles a training step for a TPU in a process
def test_train_compile_only(small_config, capsys):
    assert train_cli.main(["--config", str(small_config), "--compile-only", "--topology", "v5e-4"]) == 0
    out = capsys.readouterr().out
    assert "v5e-4 (v5e:2x2: 4 chips of v5e, 1 host, 16.00 GiB HBM per chip), mesh data=2 fsdp=1 tp=2" in out
    assert "| training step |" in out and "the memory plan's estimate" in out
    assert "fits: every program fits one v5e chip" in out


def test_train_compile_only_that_cannot_fit_exits_2(small_config, capsys):
    """64 rows of 8,192 tokens: the attention arrays alone overflow a v5e chip; the table, then the named error."""
    argv = ["--config", str(small_config), "--set", "data.batch_size=64", "--set", "data.max_length=8192",
            "--set", "data.bucket_boundaries=[8192]", "--compile-only", "--topology", "v5e-4"]
    assert train_cli.main(argv) == 2
    captured = capsys.readouterr()
    assert "| training step |" in captured.out and "**no**" in captured.out
    assert captured.err.startswith("error: training step does not fit a v5e chip")
    assert "data.batch_size" in captured.err and "mesh.fsdp" in captured.err and "remat" in captured.err


@pytest.mark.slow  # compiles decoding loops for a TPU
def test_infer_compile_only(small_config, capsys):
    argv = ["--model", str(small_config), "--mode", "speculative", "--tree", "chain-3", "--compile-only",
            "--topology", "v6e-8", "--batch-size", "2", "--prompt-length", "100", "--max-new-tokens", "20"]
    assert infer_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "mesh data=1 fsdp=1 tp=8" in out
    assert "speculative loop, clover2 chain-3 (batch 2, prompt 128, cache 256)" in out and "fits:" in out


@pytest.mark.parametrize("argv, says", [
    (["--compile-only"], "--compile-only: give the TPU slice"),
    (["--topology", "v5e-8"], "--topology v5e-8: compiles only with --compile-only"),
    (["--compile-only", "--topology", "v5e-9"], "no v5e slice of 9"),
    (["--compile-only", "--topology", "v5e-8", "--prompt", "hi"], "--prompt: --compile-only compiles the loop"),
    (["--compile-only", "--topology", "v5e-8", "--mode", "speculative"], "name the tree"),
])
def test_infer_compile_only_bad_input(argv, says, capsys):
    assert infer_cli.main(["--model", "meta-llama/Meta-Llama-3-8B-Instruct", *argv]) == 2
    assert says in capsys.readouterr().err


def test_slice_that_cannot_take_the_mesh():
    with pytest.raises(parallel.MeshError, match="data.*fsdp.*tp"):
        tpu.slice_mesh(tpu.parse_slice("v5e-4"), data=1, fsdp=1, tp=8)


def test_too_little_memory_is_an_input_error():
    prog = tpu.CompiledProgram("x", 0.0, 20 * tpu.GIB, 20 * tpu.GIB, 0, 0, 0, 0, 0.0, 0.0, 0.0)
    with pytest.raises(InsufficientMemoryError, match="x does not fit a v5e chip: 20.00 GiB"):
        tpu.check_fits(tpu.parse_slice("v5e-8"), [prog], "lower something")
