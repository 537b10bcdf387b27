"""Device meshes and partition specs for training and inference (GSPMD style, `AxisType.Auto` axes).

Mesh axes:
  data   pure data parallelism (parameters replicated);
  fsdp   data parallelism whose parameters and optimizer state are sharded (ZeRO-3 style) on the model
         width D (or F where D is not present);
  tp     tensor parallelism over query/kv heads N/K, the MLP width F and the vocabulary V.

Batches are split over ("data", "fsdp"). The stacked layer axis L is never sharded. A mesh axis that does
not divide a dimension is dropped for that dimension (SmolLM2's 3 KV heads with tp=2: replicated).

Rules are keyed by the parameter's name (the last path entry) and give the spec of its trailing dims;
leading dims (the stacked L axis) are unsharded. The same rules shard any pytree whose leaves are named
like parameters: the base model state, the Clover-2 head state (its `aug` is a `DecoderStack`) and the
optimizer state (optax's mu/nu mirror the parameter tree; counts are scalars: replicated).

Decoding state (the jitted loops' carries, KV caches, the drafters' states) says itself how it splits: a state type
names the axes of the fields it wants split, in the axis alphabet, as a class attribute `shard_axes`
(`{"tokens": "B S", "lengths": "B"}`), and `STATE_SPLITS` says which mesh axes split which letter. Its other fields
(tree buffers, draft vocabularies, RNG keys) are left to XLA's propagation, and a state held in one of them is asked
in turn (the speculative carry holds the drafter's state, a lookup state the inner drafter's).

Shapes and einsum strings use the axis letters of `clover_jax.axes`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from clover_jax.axes import AXES as AXIS_LETTERS
from clover_jax.models.cache import KVCache
from clover_jax.validation import InputError

log = logging.getLogger(__name__)

AXES = ("data", "fsdp", "tp")
BATCH_AXES = ("data", "fsdp")

# name -> spec of the trailing dims (leading dims, e.g. the stacked L axis, are unsharded).
_RULES: dict[str, tuple] = {
    # base model
    "embed": ("tp", "fsdp"),  # [V, D]
    "lm_head": ("fsdp", "tp"),  # [D, V]
    "final_norm": (None,),  # [D]
    # DecoderStack (base layers and the head's Augmenting Block), each with a leading [L]
    "attn_norm": (None,),  # [D]
    "mlp_norm": (None,),  # [D]
    "wq": ("fsdp", "tp", None),  # [D, N, H]
    "wk": ("fsdp", "tp", None),  # [D, K, H]
    "wv": ("fsdp", "tp", None),  # [D, K, H]
    "wo": ("tp", None, "fsdp"),  # [N, H, D]
    "bq": ("tp", None),  # [N, H]
    "bk": ("tp", None),  # [K, H]
    "bv": ("tp", None),  # [K, H]
    "bo": (None,),  # [D]
    "q_norm": (None,),  # [H] (qk_norm)
    "k_norm": (None,),  # [H]
    "w_gate": ("fsdp", "tp"),  # [D, F]
    "w_up": ("fsdp", "tp"),  # [D, F]
    "w_down": ("tp", "fsdp"),  # [F, D]
    "b_gate": ("tp",),  # [F]
    "b_up": ("tp",),  # [F]
    "b_down": (None,),  # [D]
    # draft heads add their own rules when their type is registered (`add_rules`, `HeadType.sharding_rules`)
}

# Decoding state: the mesh axes that split each letter of a state's `shard_axes` (the other letters stay whole).
# KV heads split as the weights' rules split them (tp dropped where it does not divide K).
STATE_SPLITS: dict[str, Any] = {
    "B": BATCH_AXES,  # rows
    "K": "tp",  # KV heads
    "Q": "tp",  # the columns of a drafting projection (a draft vocabulary, or all of V)
}
# `clover_jax.models.cache.KVCache` (the base model's cache and the draft heads' own), a type of the models layer
KV_CACHE_AXES = {"k": "L B K S H", "v": "L B K S H", "lengths": "B"}  # [L, B, K, S, H] (or L arrays), [B]


def add_rules(rules: dict[str, tuple]) -> None:
    """Adds parameter rules (name -> spec of the trailing dims): a draft head type's arrive when it is registered. A
    name already taken by another spec is an error (two rules would shard one weight two ways)."""
    for name, spec in rules.items():
        spec = tuple(spec)
        if _RULES.get(name, spec) != spec:
            raise ValueError(f"sharding rule {name!r}: already {_RULES[name]}, not {spec}")
        _RULES[name] = spec


class MeshError(InputError):
    """A mesh shape that does not fit the devices; the message names the sizes."""


# --------------------------------------------------------------------------------------------------- mesh
def mesh_sizes(data: int, fsdp: int, tp: int, n: int) -> dict[str, int]:
    """{"data", "fsdp", "tp"} sizes over `n` devices; `-1` on one axis takes the remaining devices."""
    sizes = {"data": int(data), "fsdp": int(fsdp), "tp": int(tp)}
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise MeshError(f"mesh: only one axis may be -1, got {sizes}")
    for k, v in sizes.items():
        if v == 0 or v < -1:
            raise MeshError(f"mesh.{k}: must be -1 or >= 1, got {v}")
    fixed = int(np.prod([v for v in sizes.values() if v != -1]))
    if free:
        if n % fixed:
            raise MeshError(f"mesh: {n} devices cannot be split into {sizes} ({n} is not a multiple of {fixed})")
        sizes[free[0]] = n // fixed
    if int(np.prod(list(sizes.values()))) != n:
        raise MeshError(f"mesh: data*fsdp*tp = {sizes['data']}*{sizes['fsdp']}*{sizes['tp']} = "
                        f"{int(np.prod(list(sizes.values())))}, but there are {n} devices")
    return sizes


def make_mesh(data: int = -1, fsdp: int = 1, tp: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A ("data", "fsdp", "tp") mesh with `AxisType.Auto` axes; `-1` on one axis takes the remaining devices."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_sizes(data, fsdp, tp, len(devices))
    shape = tuple(sizes[a] for a in AXES)
    try:  # topology-aware device order (TPU/GPU); CPU devices keep their order
        return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)
    except Exception:  # noqa: BLE001 - fall back to a plain reshape (e.g. a subset of devices)
        return Mesh(np.asarray(devices, dtype=object).reshape(shape), AXES, axis_types=(AxisType.Auto,) * 3)


# The local launcher (`clover_jax.launch`) names each process's place in the job with these, beside JAX's own
# JAX_COORDINATOR_ADDRESS; on a TPU pod, SLURM or Open MPI, JAX finds them itself.
NUM_PROCESSES_ENV, PROCESS_ID_ENV = "CLOVER_NUM_PROCESSES", "CLOVER_PROCESS_ID"
HEARTBEAT_ENV = "CLOVER_HEARTBEAT_TIMEOUT"  # seconds before the others stop when one process dies (JAX: 100)


def _multi_host_env() -> str | None:
    """The environment variable that says this process is one of several, or None."""
    env = os.environ
    if env.get("CLOVER_MULTI_HOST", "").strip().lower() in ("1", "true", "yes"):
        return "CLOVER_MULTI_HOST"
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS"
    for key in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        try:
            if int(env.get(key, "1")) > 1:
                return key
        except ValueError:
            pass
    hosts = env.get("TPU_WORKER_HOSTNAMES") or env.get("CLOUD_TPU_TASK_HOSTNAMES") or ""
    if len([h for h in hosts.split(",") if h.strip()]) > 1:
        return "TPU_WORKER_HOSTNAMES"
    return None


def _env_int(key: str, minimum: int) -> int | None:
    raw = os.environ.get(key)
    if raw is None or not raw.strip():
        return None
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise InputError(f"{key}={raw!r}: must be an integer >= {minimum}")
    return value


def distributed_arguments() -> dict[str, Any]:
    """`jax.distributed.initialize` keyword arguments from the environment: the process's place in the job
    (`JAX_COORDINATOR_ADDRESS`, `CLOVER_NUM_PROCESSES`, `CLOVER_PROCESS_ID`, as `clover_jax.launch` sets them;
    absent on a TPU pod, where JAX detects them) and the heartbeat timeout (`CLOVER_HEARTBEAT_TIMEOUT`)."""
    kw: dict[str, Any] = {}
    count, index = _env_int(NUM_PROCESSES_ENV, 1), _env_int(PROCESS_ID_ENV, 0)
    if (count is None) != (index is None):
        raise InputError(f"{NUM_PROCESSES_ENV} and {PROCESS_ID_ENV} go together: set both or neither")
    if count is not None:
        if index >= count:
            raise InputError(f"{PROCESS_ID_ENV}={index} must be below {NUM_PROCESSES_ENV}={count}")
        if not os.environ.get("JAX_COORDINATOR_ADDRESS"):
            raise InputError(f"{NUM_PROCESSES_ENV}/{PROCESS_ID_ENV} need JAX_COORDINATOR_ADDRESS (host:port of "
                             "process 0)")
        kw.update(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"], num_processes=count, process_id=index)
    heartbeat = _env_int(HEARTBEAT_ENV, 1)
    if heartbeat is not None:
        kw["heartbeat_timeout_seconds"] = heartbeat
    return kw


def maybe_initialize_distributed(mode: bool | str = "auto") -> bool:
    """Calls `jax.distributed.initialize()` for multi-host runs; returns whether it did (or had).

    mode True: always; False: never; "auto": when the environment says this is one of several processes
    (`CLOVER_MULTI_HOST=1`, `JAX_COORDINATOR_ADDRESS`, SLURM/Open MPI with more than one task, a TPU pod
    slice with several workers). Must run before anything touches a JAX backend. CPU processes exchange
    collectives through gloo. When one process dies, JAX's coordination service stops the others after the
    heartbeat timeout (`CLOVER_HEARTBEAT_TIMEOUT`, JAX's default 100 s).
    """
    if mode not in (True, False, "auto"):
        raise InputError(f"mesh.multi_host must be true, false or 'auto', got {mode!r}")
    if mode is False:
        return False
    if jax.distributed.is_initialized():
        return True
    if mode == "auto":
        why = _multi_host_env()
        if why is None:
            return False
        log.info("multi-host environment detected (%s): jax.distributed.initialize()", why)
    kw = distributed_arguments()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices of several processes
    jax.distributed.initialize(**kw)
    log.info("process %d of %d: %d local devices of %d", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())
    return True


def to_host(x) -> np.ndarray:
    """A (global) array's full value as numpy on every process: arrays spread over several processes' devices
    are gathered (every process must call this together)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def barrier(name: str) -> None:
    """Waits until every process reaches `name` (nothing to wait for in a single process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


# ------------------------------------------------------------------------------------------------- specs
def _key_name(k) -> str | None:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return None


def leaf_name(path) -> str | None:
    """The parameter name of a pytree path: its last entry that is not `value` (nnx Variable) or an index."""
    for k in reversed(path):
        name = _key_name(k)
        if name is None or name == "value" or name.isdigit():
            continue
        return name
    return None


def spec_for(name: str | None, shape: Sequence[int], mesh: Mesh) -> P:
    """The partition spec of a leaf named `name` with `shape` on `mesh` (non-dividing axes dropped)."""
    rule = _RULES.get(name or "")
    ndim = len(shape)
    if rule is None or ndim < len(rule):
        return P()
    return _fit(rule, shape, mesh)


def _axis_size(mesh: Mesh, axis) -> int:
    names = axis if isinstance(axis, tuple) else (axis,)
    return int(np.prod([mesh.shape[a] for a in names]))


def _fit(rule: tuple, shape: Sequence[int], mesh: Mesh) -> P:
    """`rule` right-aligned to `shape`, each mesh axis (or tuple of axes) kept only where it divides the dim
    and has more than one device."""
    full = (None,) * (len(shape) - len(rule)) + tuple(rule)
    out = []
    for dim, axis in zip(shape, full):
        size = _axis_size(mesh, axis) if axis is not None else 1
        out.append(axis if axis is not None and size > 1 and dim % size == 0 else None)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def shard_axes(node) -> dict[str, str] | None:
    """The axes a decoding-state object names for its fields (its type's `shard_axes`; `KV_CACHE_AXES` for a
    `KVCache`), or None for anything that is not a decoding state."""
    if isinstance(node, KVCache):
        return KV_CACHE_AXES
    if not dataclasses.is_dataclass(node) or isinstance(node, type):
        return None
    return getattr(type(node), "shard_axes", None)


def axes_spec(axes: str, shape: Sequence[int], mesh: Mesh, what: str = "a state field") -> P:
    """The partition spec of a leaf of `shape` whose axes are `axes` (letters of `clover_jax.axes`, space-separated,
    one per dim): `STATE_SPLITS` for each letter, kept where it divides the dim. A field of stacked layers (`L ...`)
    may hold one array per layer: those have the remaining axes."""
    letters = axes.split()
    unknown = [a for a in letters if a not in AXIS_LETTERS]
    if unknown:
        raise ValueError(f"{what}: axes {axes!r} name {unknown}, not letters of clover_jax.axes")
    if letters and letters[0] == "L" and len(shape) == len(letters) - 1:
        letters = letters[1:]  # one layer's slice of a stacked [L, ...] field (a per-layer KV cache)
    if len(shape) != len(letters):
        raise ValueError(f"{what}: declared as [{', '.join(axes.split())}], but a leaf has shape {tuple(shape)}")
    return _fit(tuple(STATE_SPLITS.get(a) for a in letters), shape, mesh)


def state_shardings(tree: Any, mesh: Mesh, default: NamedSharding | None = None) -> Any:
    """A `NamedSharding` for every leaf of a decoding state (loop carry, caches, drafter state) that its state splits
    (`shard_axes`); `default` for the others (None: left to propagation; `replicated(mesh)` for abstract arguments of
    a program compiled ahead of time)."""

    def field(value, axes: str, what: str):
        def one(leaf):
            shape = _shape(leaf)
            if shape is None:
                raise ValueError(f"{what}: declared as [{', '.join(axes.split())}], but holds {type(leaf).__name__}")
            return NamedSharding(mesh, axes_spec(axes, shape, mesh, what))

        return jax.tree.map(one, value)

    def state(node):
        axes = shard_axes(node)
        if axes is None:
            return default  # a leaf no state splits
        name = type(node).__name__
        fields = {f.name: f for f in dataclasses.fields(node)}
        unknown = sorted(set(axes) - set(fields))
        if unknown:
            raise ValueError(f"{name}.shard_axes names {unknown}, which are not fields of {name}")
        out = {}
        for f in fields.values():
            if not f.metadata.get("pytree_node", True):
                continue  # static (part of the tree's structure)
            value = getattr(node, f.name)
            out[f.name] = (field(value, axes[f.name], f"{name}.{f.name}") if f.name in axes
                           else state_shardings(value, mesh, default))
        return dataclasses.replace(node, **out)

    return jax.tree.map(state, tree, is_leaf=lambda x: shard_axes(x) is not None)


def constrain_state(tree: Any, mesh: Mesh | None) -> Any:
    """`with_sharding_constraint` on the leaves of a decoding state that their state splits (identity without a
    mesh): inside the jitted loops, so caches and per-row buffers stay split over the mesh rather than being
    gathered or replicated by propagation."""
    if mesh is None:
        return tree
    shardings = state_shardings(tree, mesh)
    return jax.tree.map(lambda s, x: x if s is None else jax.lax.with_sharding_constraint(x, s), shardings, tree,
                        is_leaf=lambda s: s is None or isinstance(s, NamedSharding))


def _shape(x) -> tuple[int, ...] | None:
    shape = getattr(x, "shape", None)
    return tuple(shape) if shape is not None else None


def model_shardings(tree: Any, mesh: Mesh) -> Any:
    """A pytree of `NamedSharding` matching `tree` (same container types).

    `tree` may be an `nnx.Module` (its `nnx.state`), an `nnx.State`, a pure dict of arrays or
    `ShapeDtypeStruct`s, or an optax state; leaves without a shape (None, scalars) are replicated.
    """
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree)

    def one(path, leaf):
        shape = _shape(leaf)
        if shape is None:
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, spec_for(leaf_name(path), shape, mesh))

    return jax.tree_util.tree_map_with_path(one, tree)


def abstract_with_shardings(tree: Any, shardings: Any) -> Any:
    """`ShapeDtypeStruct`s with `sharding=` set, e.g. as an Orbax restore target."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def batch_sharding(mesh: Mesh, batch: int | None = None) -> NamedSharding:
    """Rows over ("data", "fsdp"), the rest replicated (`[B, ...]` batches); replicated when `batch` is given
    and the batch shards do not divide it."""
    if batch is not None and batch % batch_divisor(mesh):
        return NamedSharding(mesh, P())
    return NamedSharding(mesh, P(BATCH_AXES))


def place(tree: Any, mesh: Mesh | None) -> Any:
    """Puts a module state (or any parameter-named pytree) on `mesh` by the rules; arrays already there with
    the same sharding are not copied. Identity without a mesh."""
    if mesh is None:
        return tree
    return jax.device_put(tree, model_shardings(tree, mesh))


def bytes_per_device(tree: Any, mesh: Mesh) -> int:
    """Bytes of a module state on each device of `mesh` once placed by the rules (the largest shard)."""
    shardings = model_shardings(tree, mesh)
    total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings, is_leaf=lambda v: isinstance(v, NamedSharding))):
        shape = _shape(x)
        if shape is None:
            continue
        total += int(np.prod(s.shard_shape(shape))) * np.dtype(x.dtype).itemsize
    return total


def is_placed(tree: Any, mesh: Mesh) -> bool:
    """Whether every array of a module state already sits on `mesh` as the rules place it."""
    shardings = model_shardings(tree, mesh)
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings, is_leaf=lambda v: isinstance(v, NamedSharding))):
        have = getattr(x, "sharding", None)
        if have is None or not have.is_equivalent_to(s, len(x.shape)):
            return False
    return True


def place_rows(mesh: Mesh | None, *arrays):
    """Puts `[B, ...]` arrays on `mesh` with rows over the batch axes (replicated when they do not divide B)."""
    if mesh is None:
        return arrays
    return tuple(jax.device_put(a, batch_sharding(mesh, a.shape[0])) for a in arrays)


def parse_mesh_sizes(value: Any) -> dict[str, int]:
    """{"data", "fsdp", "tp"} sizes from a dict or a string like `"data=2,tp=4"` (unnamed axes 1; one may be -1)."""
    if isinstance(value, str):
        sizes = {}
        for part in (p.strip() for p in value.split(",") if p.strip()):
            name, eq, num = part.partition("=")
            name = name.strip()
            if not eq or name not in AXES:
                raise MeshError(f"mesh: expected 'axis=size' pairs over {AXES} (e.g. 'data=2,tp=4'), got {value!r}")
            try:
                sizes[name] = int(num)
            except ValueError:
                raise MeshError(f"mesh: {name}={num.strip()!r} is not an integer (in {value!r})") from None
        value = sizes
    if not isinstance(value, dict):
        raise MeshError(f"mesh: expected a Mesh, a dict or a string like 'data=2,tp=4', got {type(value).__name__}")
    unknown = sorted(set(value) - set(AXES))
    if unknown:
        raise MeshError(f"mesh: unknown axes {unknown}; the axes are {AXES}")
    return {a: int(value.get(a, 1)) for a in AXES}


def parse_mesh(value: Any, devices: Sequence[Any] | None = None) -> Mesh | None:
    """A decoding mesh from `None` (no mesh), a `Mesh`, a dict or a string like `"data=2,tp=4"`.

    Axes not named have size 1 and the mesh takes the first data*fsdp*tp devices (so `"tp=1"` is one
    device); one axis may be -1 to take all the remaining devices."""
    if value is None or isinstance(value, Mesh):
        return value
    sizes = parse_mesh_sizes(value)
    devices = list(jax.devices() if devices is None else devices)
    if -1 not in sizes.values():
        n = int(np.prod(list(sizes.values())))
        if any(v < 1 for v in sizes.values()):
            raise MeshError(f"mesh: sizes must be >= 1 (or one -1), got {sizes}")
        if n > len(devices):
            hint = ("; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N (set before JAX starts) "
                    "simulates N devices" if devices[0].platform == "cpu" else "")
            raise MeshError(f"mesh: data*fsdp*tp = {n} devices asked for ({value}), but only {len(devices)} "
                            f"{devices[0].platform} devices exist{hint}")
        devices = devices[:n]
    return make_mesh(sizes["data"], sizes["fsdp"], sizes["tp"], devices=devices)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_divisor(mesh: Mesh) -> int:
    """The number of batch shards: a global batch size must be a multiple of it."""
    return int(mesh.shape["data"] * mesh.shape["fsdp"])


def describe(tree: Any) -> dict[str, str]:
    """{'path': 'PartitionSpec'} for logging and tests."""
    flat = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(x, NamedSharding))
    return {"/".join(n for n in (_key_name(k) for k in p) if n and n != "value"): str(s.spec) for p, s in flat}
