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

Axis alphabet: B batch, T tokens, D model width, N query heads, K kv heads, H head dim, F MLP width,
V vocab, L layers.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

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
    "w_gate": ("fsdp", "tp"),  # [D, F]
    "w_up": ("fsdp", "tp"),  # [D, F]
    "w_down": ("tp", "fsdp"),  # [F, D]
    "b_gate": ("tp",),  # [F]
    "b_up": ("tp",),  # [F]
    "b_down": (None,),  # [D]
    # draft heads add their own rules through the head registry (`HeadType.sharding_rules`)
}


class MeshError(InputError):
    """A mesh shape that does not fit the devices; the message names the sizes."""


# --------------------------------------------------------------------------------------------------- mesh
def make_mesh(data: int = -1, fsdp: int = 1, tp: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A ("data", "fsdp", "tp") mesh with `AxisType.Auto` axes; `-1` on one axis takes the remaining devices."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
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
    shape = tuple(sizes[a] for a in AXES)
    try:  # topology-aware device order (TPU/GPU); CPU devices keep their order
        return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)
    except Exception:  # noqa: BLE001 - fall back to a plain reshape (e.g. a subset of devices)
        return Mesh(np.asarray(devices, dtype=object).reshape(shape), AXES, axis_types=(AxisType.Auto,) * 3)


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


def maybe_initialize_distributed(mode: bool | str = "auto") -> bool:
    """Calls `jax.distributed.initialize()` for multi-host runs; returns whether it did (or had).

    mode True: always; False: never; "auto": when the environment says this is one of several processes
    (`CLOVER_MULTI_HOST=1`, `JAX_COORDINATOR_ADDRESS`, SLURM/Open MPI with more than one task, a TPU pod
    slice with several workers). Must run before anything touches a JAX backend.
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
    jax.distributed.initialize()
    return True


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
    if rule is None:
        from clover_jax.heads.registry import sharding_rules

        rule = sharding_rules().get(name or "")
    ndim = len(shape)
    if rule is None or ndim < len(rule):
        return P()
    full = (None,) * (ndim - len(rule)) + tuple(rule)
    out = []
    for dim, axis in zip(shape, full):
        size = mesh.shape[axis] if axis is not None else 1
        out.append(axis if axis is not None and size > 1 and dim % size == 0 else None)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


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


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows over ("data", "fsdp"), the rest replicated (`[B, T]` batches)."""
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_divisor(mesh: Mesh) -> int:
    """The number of batch shards: a global batch size must be a multiple of it."""
    return int(mesh.shape["data"] * mesh.shape["fsdp"])


def describe(tree: Any) -> dict[str, str]:
    """{'path': 'PartitionSpec'} for logging and tests."""
    flat = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(x, NamedSharding))
    return {"/".join(n for n in (_key_name(k) for k in p) if n and n != "value"): str(s.spec) for p, s in flat}
