"""What one training step holds per device, estimated from the config before anything compiles, and checked
against what the devices have.

    est = estimate_training_memory(cfg, base_config, {"data": 2, "fsdp": 4, "tp": 1})
    est.items   # {"frozen base": ..., "head": ..., "optimizer": ..., "gradients": ..., ...} bytes per device
    check_training_memory(cfg, base_config, mesh)   # InsufficientMemoryError naming the settings to change

    mem = compiled_training_memory(cfg, base_config, mesh, *trainer.compile_step(length))  # XLA's own figures
    check_compiled_training_memory(cfg, base_config, mesh, mem)   # the second check, before step 1

The estimate is the quick first answer, before the data set-up and any compile (and `clover-memory-plan`'s figure);
the trainer then compiles the step for the longest bucket holding rows and checks XLA's buffer assignment of it
(`Trainer.check_step_memory`), which is what a step holds: on a CPU its peak resident memory is the process's
resident memory before the step plus XLA's temporaries (the training programs compile without XLA:CPU's YNNPACK
fusions, whose buffers sat outside that assignment: `clover_jax.training.steps.CPU_COMPILER_OPTIONS`).

The items, per device (B rows per device in a micro-batch: `data.batch_size / optim.grad_accum / (data * fsdp)`,
T = `data.max_length`, the longest bucket):
  frozen base      the base weights in `model.param_dtype`, sharded by `clover_jax.parallel`'s rules;
  head             the head parameters (float32), sharded the same way;
  optimizer        AdamW's two moments (float32, as the parameters);
  gradients        the gradients and the update computed from them (2 x the parameters);
  gathered weights with fsdp or tp > 1: a layer's weights and the `[D, V]` output projection gathered whole
                   while they are used;
  head activations what the head's backward keeps: per Augmenting-Block layer its residuals, MLP and two float32
                   `[B, N, T, T]` attention arrays (one layer's input only with `train.remat`), per drafted depth
                   its float32 states and outputs `[B, T, D]`; and what the backward through those layers makes
                   beyond the logits' memory, which it reuses (3 attention arrays; 4 for one layer or with
                   remat);
  base forward     the online base forward: its `[B, T, D]` features, and its working set (one layer at a time,
                   no gradient: residuals, MLP, three `[B, N, T, T]` float32 attention arrays) where the head's
                   does not cover it; with `train.cache_features` the base's pass over the data before training
                   (`feature_rows` rows at a time), where it needs more than the step;
  logits           the vocabulary-sized float32 terms: teacher `[B, C + n, V]` and student `[n, B, C, V]`
                   logits, probabilities and their gradient, C = `loss.vocab_chunk` positions (T without
                   chunking, `loss.vocab_positions_per_row` with packing) and V the draft vocabulary with
                   `loss.draft_vocab`;
  runtime          (CPU) the process itself: Python, JAX, XLA's compiler (measured, not derived).

What grows with T (the `[B, N, T, T]` arrays) is counted as XLA's buffer assignment of the compiled step holds it
(`Compiled.memory_analysis`, 1-3 head layers, 1,024-4,096 tokens); the rest, the logits' copies and the CPU terms are
fitted to the peak resident memory (ru_maxrss) of real runs of `run_experiment` on a 2-core CPU host:
`bench/bench_train_memory.py`, whose table (SmolLM2-135M and a random 2-layer base, rows of 128 to 9,000 tokens,
batch 1 to 32) is in docs/training.md. The logits dominate short rows with the whole
vocabulary, the attention arrays long rows (at 9,000 tokens, 9 heads: 2.7 GiB each). On an accelerator, whose
allocator holds just XLA's buffers, the CPU terms are not counted. Host-side data (the tokenized data set, cached
features with `train.cache_features`) is not counted.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh

from clover_jax import parallel
from clover_jax.decoding.memory import GIB, available_memory, fmt_bytes
from clover_jax.heads import registry
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import Llama
from clover_jax.training import steps as steps_lib
from clover_jax.training.features import feature_rows
from clover_jax.validation import ConfigError, InputError, InsufficientMemoryError

SAFETY = 0.9  # the share of the free memory an estimate may use (the estimate is not exact)
RUNTIME_BYTES = int(1.1 * GIB)  # a CPU training process besides its arrays: Python, JAX, XLA compiling (measured)
# live float32 arrays of a logits chunk at the step's peak (fitted to the measured runs, see the module docstring):
# the student's [n, B, C, V] logits, log-probabilities, the teacher's probabilities at the n depths and the
# gradient; the teacher's [B, C + n, V] logits and probabilities
STUDENT_COPIES = 3.5
CHUNKED_STUDENT_COPIES = 2.5  # the same with `loss.vocab_chunk` below T: a chunk's copies inside the chunks' loop
TEACHER_COPIES = 2
RNN_STATE_COPIES = 12  # float32 [B, T, D] arrays a drafted depth keeps for its backward (attention decoder, FC)
# float32 [B, N, T, T] attention arrays (what grows with T^2) live at once, counted in XLA's buffer assignment of
# the compiled step (`Compiled.memory_analysis`, bench/bench_train_memory.py) at 1,024-4,096 tokens, 1-3 layers:
ATTENTION_KEPT = 2  # per head decoder layer, kept for the backward (stacked by the layers' scan)
ATTENTION_BACKWARD = 3.0  # besides those, in the backward through two or more layers
ONE_LAYER_ATTENTION = 4.0  # one layer's, kept or recomputed (one layer, or train.remat), with its backward
BASE_ATTENTION = 3  # one layer of the base's forward (no gradient): scores, masked scores, probabilities
ONLINE_ATTENTION = 0.75  # of the base's forward in the step, still live at the peak of a backward through layers
SETTINGS = "lower data.batch_size, data.max_length or loss.vocab_chunk, or raise mesh.fsdp"


@dataclasses.dataclass(frozen=True)
class TrainingMemory:
    """An estimate of one training step's memory: `items` in bytes per device, on a mesh of `sizes`."""

    items: dict[str, int]
    sizes: dict[str, int]  # {"data", "fsdp", "tp"}
    rows: int  # rows per device in a micro-batch
    seq_len: int  # T

    @property
    def total(self) -> int:
        return int(sum(self.items.values()))

    @property
    def devices(self) -> int:
        return int(np.prod(list(self.sizes.values())))

    def biggest(self, n: int = 3) -> list[tuple[str, int]]:
        return sorted(((k, v) for k, v in self.items.items() if v), key=lambda kv: -kv[1])[:n]

    def describe(self, n: int = 3) -> str:
        return ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.biggest(n))


# ------------------------------------------------------------------------------------------------ shapes
def _sizes_of(mesh: Any, mesh_cfg) -> dict[str, int]:
    """Axis sizes from a `Mesh`, a {"data", "fsdp", "tp"} mapping or a device count."""
    if isinstance(mesh, Mapping):
        return {a: int(mesh.get(a, 1)) for a in parallel.AXES}
    if isinstance(mesh, int):
        return parallel.mesh_sizes(mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tp, mesh)
    return {a: int(mesh.shape[a]) for a in parallel.AXES}


def base_state_shapes(base_config: LlamaConfig, param_dtype) -> dict[str, Any]:
    """The frozen base's state as a pure dict of `ShapeDtypeStruct`s (nothing allocated)."""
    abstract = nnx.eval_shape(lambda: Llama(base_config, rngs=nnx.Rngs(0), param_dtype=param_dtype,
                                            dtype=param_dtype))
    return nnx.to_pure_dict(nnx.state(abstract))


def abstract_head_state(cfg, base_config: LlamaConfig) -> tuple[Any, Any]:
    """(head parameters, optimizer state) of `cfg`'s head on a base of `base_config`, as pure pytrees of
    `ShapeDtypeStruct`s (nothing allocated): what the trainer holds and a checkpoint stores."""
    return _head_state(cfg.head, cfg.optim, cfg.total_steps, cfg.train.compute_dtype, cfg.train.remat, base_config)


@functools.lru_cache(maxsize=16)
def _head_state(head, optim, total_steps: int, compute_dtype: str, remat: bool, base_config: LlamaConfig):
    """`abstract_head_state` by the settings it depends on (cached: `suggestions` re-estimates many times)."""
    ht = registry.get(head.type)
    module = nnx.eval_shape(lambda: ht.module_cls(base_config, head.head_config(steps_lib.DTYPES[compute_dtype], remat),
                                                  rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(nnx.state(module))
    tx, _ = steps_lib.make_optimizer(optim, total_steps)
    return params, jax.eval_shape(tx.init, params)


def bytes_per_device(tree: Any, sizes: dict[str, int]) -> int:
    """Bytes of a pytree of arrays (or `ShapeDtypeStruct`s) on each device once sharded by `clover_jax.parallel`'s
    rules over a mesh of axis `sizes` (no devices needed)."""
    mesh = AbstractMesh(tuple(sizes[a] for a in parallel.AXES), parallel.AXES)
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = tuple(getattr(leaf, "shape", ()))
        spec = parallel.spec_for(parallel.leaf_name(path), shape, mesh)
        shard = list(shape)
        for i, axis in enumerate(spec):
            if axis is not None:
                shard[i] //= int(np.prod([sizes[a] for a in (axis if isinstance(axis, tuple) else (axis,))]))
        total += int(np.prod(shard)) * np.dtype(leaf.dtype).itemsize
    return total


def _layers(params: Any) -> int:
    """Decoder layers in a head's parameters (the leading L of its `wq` leaves: an Augmenting Block, EAGLE's
    layer)."""
    out = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if parallel.leaf_name(path) == "wq" and len(leaf.shape) == 4:
            out += int(leaf.shape[0])
    return out


@functools.lru_cache(maxsize=64)
def _base_bytes(base_config: LlamaConfig, param_dtype: str, sizes: tuple[tuple[str, int], ...]) -> tuple[int, int]:
    """(the frozen base's bytes per device, one whole layer's weights: what FSDP gathers at a time)."""
    state = base_state_shapes(base_config, steps_lib.DTYPES[param_dtype])
    layer = sum(int(np.prod(x.shape[1:])) * np.dtype(x.dtype).itemsize
                for x in jax.tree.leaves(state["layers"]) if len(x.shape) >= 2)  # stacked [L, ...] leaves
    return bytes_per_device(state, dict(sizes)), layer


def _div(n: int, by: int) -> int:
    """`n` split `by` ways where `by` divides it (the sharding rules drop an axis that does not)."""
    return n // by if by > 1 and n % by == 0 else n


# ---------------------------------------------------------------------------------------------- estimate
def check_sequence_length(cfg, base_config: LlamaConfig) -> None:
    """A `ConfigError` naming `data.max_length` and the base's context when rows would be longer than the base
    model was trained for (`max_position_embeddings`): its positions past the context are untrained, and a row's
    memory grows with its length squared."""
    context = getattr(base_config, "max_position_embeddings", None)
    if context and cfg.data.max_length > context:
        raise ConfigError(f"data.max_length: {cfg.data.max_length} tokens is longer than the base model's context "
                          f"(max_position_embeddings={context}); set data.max_length={context} or less")


def estimate_training_memory(cfg, base_config: LlamaConfig, mesh: Any, *, platform: str = "cpu",
                             vocab_size: int | None = None) -> TrainingMemory:
    """Bytes per device of one training step of `cfg` on `mesh` (a `Mesh`, a {"data", "fsdp", "tp"} mapping or
    a device count the `mesh:` section is laid over), by item (see the module docstring). `platform` "cpu" adds
    the process's own runtime; `vocab_size` overrides the cross-entropy's vocabulary (the draft vocabulary's size
    with `loss.draft_vocab`, default `train.draft_vocab_size`, else the base's)."""
    check_sequence_length(cfg, base_config)
    sizes = _sizes_of(mesh, cfg.mesh)
    c, loss = base_config, cfg.loss
    shards = sizes["data"] * sizes["fsdp"]
    tp = sizes["tp"]
    b = math.ceil(cfg.data.batch_size / cfg.optim.grad_accum / shards)  # rows per device per micro-batch
    t = int(cfg.data.max_length)
    d, f_dim = c.hidden_size, _div(c.intermediate_size, tp)
    n_heads = _div(c.num_attention_heads, tp)
    nh = cfg.head.num_heads
    base_bytes = jnp.dtype(steps_lib.DTYPES[cfg.model.param_dtype]).itemsize
    act = jnp.dtype(steps_lib.DTYPES[cfg.model.dtype]).itemsize
    head_act = jnp.dtype(steps_lib.DTYPES[cfg.train.compute_dtype]).itemsize

    base_total, base_layer = _base_bytes(c, cfg.model.param_dtype, tuple(sizes.items()))
    params, opt_state = _head_state(cfg.head, cfg.optim, cfg.total_steps, cfg.train.compute_dtype, cfg.train.remat, c)
    items = {
        "frozen base": base_total,
        "head": bytes_per_device(params, sizes),
        "optimizer": bytes_per_device(opt_state, sizes),
    }
    items["gradients"] = 2 * items["head"]

    v = vocab_size or (cfg.train.draft_vocab_size if loss.draft_vocab and cfg.train.draft_vocab_size else
                       c.vocab_size)
    v = _div(v, tp)
    gathered = 0
    if sizes["fsdp"] > 1 or tp > 1:  # a layer's weights and the output projection, gathered while used
        gathered = 2 * base_layer + d * v * base_bytes
    items["gathered weights"] = gathered

    attention = b * n_heads * t * t * 4  # one float32 [B, N, T, T] array
    aug = _layers(params)
    through = aug > 1 and not cfg.train.remat  # a backward through several layers' kept activations
    if cfg.train.remat:  # each layer's input kept, one layer recomputed at a time
        kept = aug * b * t * d * head_act + b * t * (6 * d + 3 * f_dim) * head_act
    else:
        kept = aug * b * t * (6 * d + 3 * f_dim) * head_act
    kept += nh * RNN_STATE_COPIES * b * t * d * 4 + (ATTENTION_KEPT * aug * attention if through else 0)
    backward = (ATTENTION_BACKWARD if through else ONE_LAYER_ATTENTION) * attention if aug else 0

    if loss.vocab_positions_per_row:  # packed: one pass over K positions per row, no chunking
        positions, halo = min(loss.vocab_positions_per_row, t), 0
    else:
        positions, halo = min(loss.vocab_chunk or t, t), nh
    student = nh * b * positions * v * 4
    teacher = b * (positions + halo) * v * 4
    chunked = not loss.vocab_positions_per_row and positions < t
    logits = (CHUNKED_STUDENT_COPIES if chunked else STUDENT_COPIES) * student + TEACHER_COPIES * teacher
    head = kept + max(0.0, backward - logits)  # the layers' backward runs after the cross-entropy's, in its memory

    def base_pass(rows: int) -> float:  # one base layer's forward working set (freed before the next layer)
        return rows * t * (4 * d + 3 * f_dim) * act + BASE_ATTENTION * rows * n_heads * t * t * 4

    if cfg.train.cache_features:
        # the base's pass over the data runs before training, `feature_rows` rows at a time: it adds only where
        # it needs more than the step's activations
        items["base forward"] = max(0.0, base_pass(feature_rows(t)) - head - logits)
    else:  # in the step: its features, and its working set where the head's does not cover it
        overlap = ONLINE_ATTENTION * attention if through else 0
        items["base forward"] = b * t * d * act + max(overlap, base_pass(b) - head - logits)
    items["head activations"] = head
    items["logits"] = logits
    items["batch"] = b * t * (4 * 3 + (2 * d if cfg.train.cache_features else 0))
    items["runtime"] = RUNTIME_BYTES if platform == "cpu" else 0
    return TrainingMemory({k: int(x) for k, x in items.items()}, sizes, b, t)


# ------------------------------------------------------------------------------------------------- check
def _with(cfg, **changes: Any):
    """`cfg` with `section.key` changes (by keyword `section__key`)."""
    return cfg.replace(*(f"{k.replace('__', '.')}={v}" for k, v in changes.items()))


def suggestions(cfg, base_config: LlamaConfig, est: TrainingMemory, budget: float, platform: str) -> list[str]:
    """Settings that bring the estimate under `budget` bytes per device, each with its new estimate: one setting
    where one does, else pairs. Those that keep the recipe come first (gradient accumulation, a wider FSDP axis,
    a smaller logits chunk, rematerialisation), then a smaller batch or shorter sequences."""
    out = []
    tries: list[dict[str, Any]] = []
    b, accum = cfg.data.batch_size, cfg.optim.grad_accum
    shards = est.sizes["data"] * est.sizes["fsdp"]
    tries += [{"optim__grad_accum": a} for a in (2, 4, 8, 16) if a > accum and b % a == 0 and (b // a) % shards == 0]
    devices = est.devices
    tries += [{"mesh__fsdp": f, "mesh__data": devices // (f * cfg.mesh.tp)} for f in (2, 4, 8, 16, 32)
              if f > cfg.mesh.fsdp and devices % (f * cfg.mesh.tp) == 0]
    if not cfg.loss.vocab_positions_per_row:
        tries += [{"loss__vocab_chunk": c} for c in (512, 256, 128, 64, 32) if c < (cfg.loss.vocab_chunk or est.seq_len)]
    if not cfg.train.remat:
        tries.append({"train__remat": "true"})
    tries += [{"data__batch_size": x} for x in (b // 2, b // 4, b // 8) if x >= shards * accum and x % (shards * accum) == 0]
    tries += [{"data__max_length": x} for x in (cfg.data.max_length // 2, cfg.data.max_length // 4) if x >= 64]
    seen: set[str] = set()
    fits = []
    for change in tries:  # one setting
        what = change_text(change).split("=")[0]
        total = _total_with(cfg, base_config, est.devices, platform, change)
        if total is not None and total <= budget and what not in seen:
            out.append(f"{change_text(change)} brings it to {fmt_bytes(total)}")
            seen.add(what)
            fits.append(change)
    if out:
        return out
    for i, first in enumerate(tries):  # no one setting does: two of them together
        for second in tries[i + 1:]:
            if set(first) & set(second):
                continue
            change = {**first, **second}
            total = _total_with(cfg, base_config, est.devices, platform, change)
            if total is not None and total <= budget:
                out.append(f"{change_text(change)} brings it to {fmt_bytes(total)}")
                if len(out) == 3:
                    return out
    return out


def _total_with(cfg, base_config, devices: int, platform: str, change: dict[str, Any]) -> int | None:
    """The estimate's total with `change` applied, None when the config or the mesh refuses the change."""
    try:
        return estimate_training_memory(_with(cfg, **change), base_config, devices, platform=platform).total
    except (InputError, ValueError):
        return None


def change_text(change: dict[str, Any]) -> str:
    return " ".join(f"{k.replace('__', '.')}={v}" for k, v in change.items())


def resident_bytes() -> int:
    """This process's resident memory now (/proc/self/statm), 0 where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return 0


def _devices_text(platform: str, share: int) -> str:
    """Where a step's memory is asked for, in an error: an accelerator's own, or the host's shared by its devices."""
    return (f"each {platform} device" if platform != "cpu" else
            f"the host's {share} CPU devices" if share > 1 else "the host")


def check_training_memory(cfg, base_config: LlamaConfig, mesh, *, base_loaded: bool = True,
                          available: tuple[int | None, str] | None = None) -> TrainingMemory | None:
    """Stops a run whose step cannot fit: an `InsufficientMemoryError` naming the estimate, what the device has,
    the biggest items and the settings that would fit (`suggestions`). Skipped with `train.check_memory: false`.

    An accelerator is checked against its own free memory (`clover_jax.decoding.memory.available_memory`), less
    the frozen base when `base_loaded` (it is in use already). CPU devices share the host: their needs add up
    (the runtime once), and what this process holds already (its resident memory: the loaded base, the
    libraries) is not asked for again. Returns the estimate (None when skipped). A `data.max_length` past the base's
    context is a `ConfigError` either way (`check_sequence_length`)."""
    check_sequence_length(cfg, base_config)
    if not cfg.train.check_memory:
        return None
    devices = list(mesh.local_devices) if hasattr(mesh, "local_devices") else jax.local_devices()
    platform = devices[0].platform
    est = estimate_training_memory(cfg, base_config, mesh, platform=platform)
    free, where = available if available is not None else available_memory(devices[0])
    if free is None:
        return est
    if platform == "cpu":
        share = len(devices)
        need = (est.total - est.items["runtime"]) * share + est.items["runtime"] - resident_bytes()
    else:
        share = 1
        need = est.total - (est.items["frozen base"] if base_loaded else 0)
    budget = free * SAFETY
    if need <= budget:
        return est
    fixes = suggestions(cfg, base_config, est, est.total - (need - budget) / share, platform)
    on = _devices_text(platform, share)
    raise InsufficientMemoryError(
        f"training memory: a step of data.batch_size={cfg.data.batch_size} x data.max_length={est.seq_len} tokens "
        f"(loss.vocab_chunk={cfg.loss.vocab_chunk}, mesh data={est.sizes['data']} fsdp={est.sizes['fsdp']} "
        f"tp={est.sizes['tp']}) needs about {fmt_bytes(need)} more on {on}, but {where} has {fmt_bytes(free)} free "
        f"({SAFETY:.0%} of it: {fmt_bytes(budget)}); {fmt_bytes(est.total)} per device, the most: {est.describe()}; "
        f"{SETTINGS}" + (f" ({'; '.join(fixes)})" if fixes else "")
        + ", or set train.check_memory=false to skip this check")


# ---------------------------------------------------------------------------------------- the compiled step
@dataclasses.dataclass(frozen=True)
class CompiledTrainingMemory:
    """One training step's memory as XLA's buffer assignment of the compiled step says it (bytes per device), and
    what running it adds to what the process holds already (the base, the head, its optimizer state)."""

    arguments: int  # everything the step reads: the frozen base, the head, its optimizer state, the batch
    outputs: int  # the new head and optimizer state, the metrics
    aliased: int  # outputs written over donated arguments (the head, the optimizer state)
    temporaries: int  # the step's working set: activations, logits, gradients
    batch: int  # the batch's arguments (made for each step; the other arguments are held already)
    devices: int  # devices sharing this memory (a host's CPU devices share its memory; an accelerator has its own)
    resident: int  # this process's resident memory when the step was compiled (0 on an accelerator)
    peak_so_far: int  # this process's peak resident memory then (the base's pass over the data included)

    @property
    def step(self) -> int:
        """Bytes per device while the step runs: arguments + outputs not aliased to them + temporaries."""
        return self.arguments + self.outputs - self.aliased + self.temporaries

    @property
    def added(self) -> int:
        """What running the step adds, on all `devices`: the batch, new outputs, temporaries."""
        return self.devices * (self.batch + self.outputs - self.aliased + self.temporaries)

    @property
    def peak(self) -> int:
        """The process's predicted peak resident memory (CPU): what it holds now plus what the step adds, or its
        peak so far where that was higher."""
        return max(self.peak_so_far, self.resident + self.added)

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "step": self.step, "added": self.added, "peak": self.peak}


def peak_resident_bytes() -> int:
    """This process's peak resident memory so far (VmHWM of /proc/self/status), 0 where unknown."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), 0)
    except (OSError, ValueError, IndexError):
        return 0


def compiled_training_memory(cfg, base_config: LlamaConfig, mesh, compiled, batch: Any) -> CompiledTrainingMemory:
    """`CompiledTrainingMemory` of the train step `compiled` (a jax `Compiled`, `Trainer.compile_step`) of `cfg` on
    `mesh`, whose `batch` arguments (arrays or `ShapeDtypeStruct`s) are made for each step. On CPU devices, which
    share the host, the devices add up and this process's resident memory is counted."""
    m = compiled.memory_analysis()
    devices = list(mesh.local_devices) if hasattr(mesh, "local_devices") else jax.local_devices()
    cpu = devices[0].platform == "cpu"
    batch_bytes = 0
    for x in jax.tree.leaves(batch):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        batch_bytes += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return CompiledTrainingMemory(
        arguments=int(m.argument_size_in_bytes), outputs=int(m.output_size_in_bytes),
        aliased=int(m.alias_size_in_bytes), temporaries=int(m.temp_size_in_bytes), batch=batch_bytes,
        devices=len(devices) if cpu else 1, resident=resident_bytes() if cpu else 0,
        peak_so_far=peak_resident_bytes() if cpu else 0)


def check_compiled_training_memory(cfg, base_config: LlamaConfig, mesh, mem: CompiledTrainingMemory, *,
                                   length: int | None = None,
                                   available: tuple[int | None, str] | None = None) -> None:
    """Stops a run whose compiled step cannot fit in what the devices have free now (the head, its optimizer
    state and the base are placed already, so only what the step adds is asked for): an `InsufficientMemoryError`
    with XLA's figures and the settings the estimate says would fit; `length`: the tokens per row the step was
    compiled for (default `data.max_length`). Skipped with `train.check_memory: false`."""
    if not cfg.train.check_memory:
        return
    devices = list(mesh.local_devices) if hasattr(mesh, "local_devices") else jax.local_devices()
    free, where = available if available is not None else available_memory(devices[0])
    if free is None:
        return
    budget = free * SAFETY
    if mem.added <= budget:
        return
    platform = devices[0].platform
    est = estimate_training_memory(cfg, base_config, mesh, platform=platform)
    share = mem.devices
    fixes = suggestions(cfg, base_config, est, est.total * budget / mem.added, platform)
    on = _devices_text(platform, share)
    raise InsufficientMemoryError(
        f"training memory: the compiled step of data.batch_size={cfg.data.batch_size} x data.max_length="
        f"{length or cfg.data.max_length} tokens (loss.vocab_chunk={cfg.loss.vocab_chunk}, mesh data={est.sizes['data']} "
        f"fsdp={est.sizes['fsdp']} tp={est.sizes['tp']}) needs {fmt_bytes(mem.added)} more on {on} (XLA: "
        f"{fmt_bytes(mem.temporaries)} of temporaries per device), but {where} has {fmt_bytes(free)} free "
        f"({SAFETY:.0%} of it: {fmt_bytes(budget)}); {SETTINGS}"
        + (f" (by the estimate: {'; '.join(fixes)})" if fixes else "")
        + ", or set train.check_memory=false to skip this check")


__all__ = ["CompiledTrainingMemory", "TrainingMemory", "abstract_head_state", "base_state_shapes", "bytes_per_device",
           "check_compiled_training_memory", "check_sequence_length", "check_training_memory",
           "compiled_training_memory", "estimate_training_memory", "peak_resident_bytes", "resident_bytes", "suggestions"]
