"""Orbax checkpoints of a Clover-2 training run, and loading a trained head for inference.

Layout (`<dir>/<step>/<item>`, Orbax v0 `CheckpointManager` + `ocp.args.Composite`):
  params       the head parameters (pure dict of float32 arrays)           StandardSave
  train_state  {"opt_state": optax state, "rng": raw key data uint32}      StandardSave
  meta         {"step", "data" (batcher state_dict), "head" (head metadata),
                "fingerprints" (a checksum per array)}                     JsonSave
  config       the experiment config                                      JsonSave

Saves are asynchronous (`async_save`), every `save_every` steps or on preemption (Orbax's
`PreemptionCheckpointingPolicy`, multi-host), keeping the last `keep`. A checkpoint that cannot be read,
whose arrays do not match their checksums, or that belongs to another head config / base model raises
`CheckpointError` naming the directory and the problem; nothing is deleted or overwritten then (the caller
refuses to start, so the manager never runs its clean-up).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts  # Orbax's storage layer (its OCDBT index names a corrupt file)
from flax import nnx
from jax.experimental import multihost_utils

from clover_jax.heads import registry
from clover_jax.models.config import LlamaConfig

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable, corrupt or incompatible; the message names the directory."""


# --------------------------------------------------------------------------------------------- metadata
def head_metadata(head_cfg, base_config: LlamaConfig, base_name: str) -> dict[str, Any]:
    """JSON description of a head: type, config (`HeadType.fields` + dtypes), and the base model it belongs to
    (name and dims)."""
    ht = registry.of_config(head_cfg)
    base = {k: getattr(base_config, k) for k in LlamaConfig.HEAD_FIT_FIELDS}
    base.update(num_hidden_layers=base_config.num_hidden_layers, rms_norm_eps=base_config.rms_norm_eps,
                rope_theta=base_config.rope_theta, tie_word_embeddings=base_config.tie_word_embeddings)
    return {"format_version": FORMAT_VERSION, "head_type": ht.name, "head_config": ht.config_to_meta(head_cfg),
            "base_model": str(base_name), "base_dims": base}


def _saved_base_dim(base_dims: dict[str, Any], field: str) -> Any:
    """A base dimension a head's metadata holds; a field added to `LlamaConfig.HEAD_FIT_FIELDS` after the head was
    saved had its default."""
    if field in base_dims:
        return base_dims[field]
    default = LlamaConfig.__dataclass_fields__[field].default
    return None if default is dataclasses.MISSING else default


def check_head_metadata(saved: dict[str, Any], current: dict[str, Any], where: str) -> None:
    """CheckpointError naming the first head-config field or base dimension that differs."""
    if saved.get("head_type") != current["head_type"]:
        raise CheckpointError(f"{where}: incompatible checkpoint: head type {saved.get('head_type')!r}, "
                              f"this run trains {current['head_type']!r}")
    head_type = registry.get(current["head_type"])
    for section, what in (("head_config", "head config"), ("base_dims", "base model")):
        keys = head_type.fields if section == "head_config" else LlamaConfig.HEAD_FIT_FIELDS
        s, c = saved.get(section, {}), current[section]
        if section == "head_config":  # fields added after the checkpoint was saved: the value it had
            s = {**head_type.optional_fields, **s}
        for k in keys:
            saved_value = s.get(k) if section == "head_config" else _saved_base_dim(s, k)
            if saved_value != c[k]:
                raise CheckpointError(f"{where}: incompatible checkpoint: {what} {k} is {saved_value!r} in the "
                                      f"checkpoint but {c[k]!r} in this run")


def head_config_from_metadata(meta: dict[str, Any], dtype=None, remat: bool = False):
    """The head config saved by `head_metadata` (of the head type it names)."""
    return registry.get(meta.get("head_type", "clover2")).config_from_meta(meta["head_config"], dtype=dtype,
                                                                          remat=remat)


# ------------------------------------------------------------------------------------------ fingerprints
def _fp_leaf(x: jax.Array) -> jax.Array:
    x = x.reshape(-1)
    size = x.dtype.itemsize
    if x.dtype == jnp.bool_ or size == 1:
        u = x.astype(jnp.uint32)
    elif size == 2:
        u = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    elif size == 4:
        u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    else:  # 8 bytes -> two uint32 words
        u = jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    idx = jnp.arange(u.shape[0], dtype=jnp.uint32)
    return jnp.stack([jnp.sum(u, dtype=jnp.uint32), jnp.sum(u * (idx * jnp.uint32(2654435761) + 1), dtype=jnp.uint32)])


_fp_jit = jax.jit(lambda tree: jax.tree.map(_fp_leaf, tree))


def _nbytes(tree: Any) -> int:
    """Bytes of a pytree of arrays (all shards)."""
    return sum(int(np.prod(np.shape(x), dtype=np.int64)) * np.dtype(getattr(x, "dtype", np.float32)).itemsize
               if not jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key) else 8
               for x in jax.tree.leaves(tree))


def _path_str(path) -> str:
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
    return "/".join(out)


def fingerprints(tree: Any) -> dict[str, list[int]]:
    """{path: [sum, position-weighted sum]} of each array's bits (mod 2**32): cheap, exact on any sharding."""
    fps = _fp_jit(tree)

    def host(x):
        if not x.is_fully_addressable:  # multi-host: the 2-word result is tiny, gather it
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))[:2]
        return np.asarray(jax.device_get(x))

    return {_path_str(p): [int(v) for v in host(x)] for p, x in jax.tree_util.tree_leaves_with_path(fps)}


def _check_fingerprints(tree: Any, saved: dict[str, list[int]], what: str, where: str) -> None:
    got = fingerprints(tree)
    for k, v in got.items():
        if saved.get(k) != v:
            raise CheckpointError(f"{where}: corrupt checkpoint: the data of {what} '{k}' does not match the "
                                  "checksum written when it was saved")


def _is_read_noise(exc: BaseException | None) -> bool:
    """An error Orbax's read coroutines or TensorStore's callbacks raise after a read failed (and its event loop
    closed): the failure itself is reported once, as a CheckpointError."""
    text = str(exc)
    return ((isinstance(exc, RuntimeError) and "Event loop is closed" in text)
            or text.startswith("Encountered error while reading array index")
            or (isinstance(exc, ValueError) and "in OCDBT database at" in text))


class _ReadNoiseFilter(logging.Filter):
    """Drops `_is_read_noise` errors from sys.excepthook, threading.excepthook, sys.unraisablehook and the
    `asyncio` logger ("Task exception was never retrieved", logged when the failed read's futures are freed).

    Installed for a restore; left in place once a restore failed, since the failed read's pending callbacks,
    coroutines and futures keep raising until they are freed, often at the process's end."""

    def __init__(self):
        super().__init__()
        self.saved = (sys.excepthook, threading.excepthook, sys.unraisablehook)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and _is_read_noise(record.exc_info[1]))

    def __enter__(self):
        excepthook, thread_hook, unraisable = self.saved
        sys.excepthook = lambda t, v, tb: None if _is_read_noise(v) else excepthook(t, v, tb)
        threading.excepthook = lambda a: None if _is_read_noise(a.exc_value) else thread_hook(a)
        sys.unraisablehook = lambda u: None if _is_read_noise(u.exc_value) else unraisable(u)
        logging.getLogger("asyncio").addFilter(self)
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None:
            sys.excepthook, threading.excepthook, sys.unraisablehook = self.saved
            logging.getLogger("asyncio").removeFilter(self)
        return False


_REPR = re.compile(r"<[^<>]*(?: object at 0x[0-9a-fA-F]+|bound method)[^>]*>?|See full TensorStore details:.*",
                   re.S)
# TensorStore's read error: the key of the array chunk and the item folder (OCDBT database) it lives in
_OCDBT_READ = re.compile(r'Error reading "(?P<key>[^"]+)" in OCDBT database at local file "(?P<dir>[^"]+)"'
                         r':?\s*(?P<why>.*)', re.S)
_JSON_FILES = ("_CHECKPOINT_METADATA", "*/_CHECKPOINT_METADATA", "*/_METADATA", "*/_sharding",
               "*/array_metadatas/*", "*/metadata", "*/manifest.ocdbt")


def _first_line(e: BaseException) -> str:
    """The exception's first line, without the repr of any internal object (`<... object at 0x...>`)."""
    text = _REPR.sub("", str(e)).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300].rstrip(' .:') if text else ''}"


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _ocdbt_file(item_dir: Path, key: str) -> Path | None:
    """The data file of the OCDBT database `item_dir` that holds `key` (read from its B-tree), None if unknown."""
    try:
        kv = ts.KvStore.open(f"file://{item_dir}/").result()
        nodes = [v["root"]["location"] for v in ts.ocdbt.dump(kv).result()["versions"][-1:]]
        while nodes:
            for entry in ts.ocdbt.dump(kv, nodes.pop()).result().get("entries", []):
                if "node" in entry:  # an interior node: look below it
                    nodes.append(entry["node"])
                elif entry.get("key") == key.encode() and "indirect_value" in entry:
                    _, prefix, rel = entry["indirect_value"].split(":")[:3]  # value:<dir>/:<file>:<offset>:<len>
                    return item_dir / prefix / rel
    except Exception:  # noqa: BLE001 - only a better message is at stake
        return None
    return None


def _failure(step_dir: Path, e: BaseException) -> str:
    """Where a failed read went wrong: the file (relative to the checkpoint's step folder), the item and
    parameter when the error names them, and the reason, with no internal object's repr."""
    for link in _chain(e):
        m = _OCDBT_READ.search(str(link))
        if m:
            item_dir = Path(m["dir"])
            key = m["key"]
            name = key.rsplit("/", 1)[0]  # "aug.wq/0.0.0.0": parameter aug.wq, chunk 0.0.0.0
            where = _ocdbt_file(item_dir, key) or item_dir
            why = _REPR.sub("", m["why"]).strip().splitlines()
            return (f"{_rel(where, step_dir)}: {item_dir.name} '{name}' cannot be read"
                    + (f" ({why[0][:200]})" if why else ""))
    for pattern in _JSON_FILES:  # a metadata file cut short or overwritten
        for path in sorted(step_dir.glob(pattern)):
            if path.is_file() and path.name != "manifest.ocdbt":
                try:
                    json.loads(path.read_bytes())
                except (ValueError, UnicodeDecodeError) as bad:
                    return f"{_rel(path, step_dir)}: not valid JSON ({_first_line(bad)})"
    return _first_line(e)


def _rel(path: Path, step_dir: Path) -> str:
    try:
        return str(Path(path).relative_to(step_dir))
    except ValueError:
        return str(path)


def _orbax_record_kept(record: logging.LogRecord) -> bool:
    """Drops Orbax's own error records (a failed save's tracebacks, logged from its writer threads: the save's
    `CheckpointError` reports the failure in one line) and its warnings that a folder opened read-only (to export
    or warm-start from it) will not be saved to."""
    if "orbax" not in record.pathname.replace("\\", "/"):
        return True
    if record.levelno >= logging.ERROR:
        return False
    message = record.getMessage()
    return not (record.levelno == logging.WARNING and ("read_only=True" in message or "is read only" in message))


# ----------------------------------------------------------------------------------------------- manager
class Checkpointer:
    """An Orbax `CheckpointManager` for (params, optimizer state, RNG, data position, config, head metadata)."""

    def __init__(self, directory: str | Path, *, save_every: int = 1000, keep: int = 3, async_save: bool = True,
                 save_on_preemption: bool = True, read_only: bool = False):
        self.directory = Path(directory).absolute()
        self.save_every = int(save_every)
        policies = []
        if self.save_every > 0:
            policies.append(ocp.checkpoint_managers.FixedIntervalPolicy(self.save_every))
        if save_on_preemption:
            policies.append(ocp.checkpoint_managers.PreemptionCheckpointingPolicy())
        decision = (ocp.checkpoint_managers.AnySavePolicy(policies) if policies
                    else ocp.checkpoint_managers.SpecificStepsPolicy(()))
        absl_log = logging.getLogger("absl")  # before the options: they warn of read-only use
        if _orbax_record_kept not in absl_log.filters:
            absl_log.addFilter(_orbax_record_kept)
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=async_save, create=not read_only, read_only=read_only,
            save_decision_policy=decision,
            preservation_policy=ocp.checkpoint_managers.LatestN(int(keep)),
            cleanup_tmp_directories=False,  # never delete what we did not write in this run
        )
        if read_only and not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: checkpoint directory not found")
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("params", "train_state", "meta", "config"))

    # ---- steps
    def all_steps(self) -> list[int]:
        return sorted(int(s) for s in self.manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def reload(self) -> None:
        """Re-reads the steps on disk (after checkpoints were moved)."""
        self.manager.reload()

    def _need_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(f"{self.directory}: no checkpoint found")
            return steps[-1]
        if int(step) not in steps:
            raise CheckpointError(f"{self.directory}: step: no checkpoint for step {step} (available steps: "
                                  f"{steps or 'none'})")
        return int(step)

    def reached_preemption(self, step: int) -> bool:
        return bool(self.manager.reached_preemption(step))

    # ---- save
    def save(self, step: int, *, params, opt_state, rng, data_state: dict[str, Any], config: dict[str, Any],
             head_meta: dict[str, Any], force: bool = False) -> bool:
        """Saves (asynchronously) when the policy says so or `force`; returns whether a save started."""
        step = int(step)
        if step in self.all_steps():
            return False
        if not force and not self.manager.should_save(step):
            return False
        train_state = {"opt_state": opt_state, "rng": rng}
        self._check_room(step, _nbytes((params, train_state)))
        meta = {"step": step, "data": data_state, "head": head_meta,
                "fingerprints": {"params": fingerprints(params), "train_state": fingerprints(train_state)}}
        self._pending = step
        try:
            return bool(self.manager.save(step, force=True, args=ocp.args.Composite(
                params=ocp.args.StandardSave(params), train_state=ocp.args.StandardSave(train_state),
                meta=ocp.args.JsonSave(meta), config=ocp.args.JsonSave(config))))
        except Exception as e:  # noqa: BLE001 - a failed earlier (asynchronous) save surfaces here too
            raise self._save_failed(e) from None

    def _last_good(self) -> str:
        try:  # on disk: a step folder is renamed into place whole when its save commits
            steps = sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and p.is_dir())
        except OSError:
            steps = []
        return (f"the last good checkpoint is {self.step_dir(steps[-1])}" if steps
                else "no checkpoint of this run was saved")

    def _check_room(self, step: int, nbytes: int) -> None:
        """Before a save (process 0): the folder takes a new file, and its filesystem has room for the
        checkpoint (its arrays plus a tenth); else a `CheckpointError` naming the folder and the cause, before
        Orbax's writer starts."""
        if jax.process_index() != 0:
            return
        probe = self.directory / f".write-probe.{os.getpid()}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
            free = shutil.disk_usage(self.directory).free
        except OSError as e:
            raise CheckpointError(f"{self.directory}: cannot save checkpoint {step}: {e.strerror or e}; "
                                  f"{self._last_good()}") from None
        need = int(nbytes * 1.1) + (1 << 20)
        if free < need:
            raise CheckpointError(f"{self.directory}: cannot save checkpoint {step}: {free / 2 ** 20:.1f} MiB free "
                                  f"on its filesystem, a checkpoint takes about {need / 2 ** 20:.1f} MiB; free space "
                                  f"or point checkpoint.dir elsewhere; {self._last_good()}")

    def _save_failed(self, e: BaseException) -> CheckpointError:
        if isinstance(e, CheckpointError):
            return e
        step = getattr(self, "_pending", None)
        cause = next((x for x in _chain(e) if isinstance(x, OSError)), e)
        why = (f"{cause.filename}: {cause.strerror}" if isinstance(cause, OSError) and cause.strerror
               else _first_line(cause))
        m = re.search(r"(\d+)\.orbax-checkpoint-tmp", why)  # the step whose folder failed, maybe an earlier one
        return CheckpointError(f"{self.directory}: saving checkpoint {m.group(1) if m else step} failed: {why}; "
                               f"{self._last_good()}")

    def wait_until_finished(self) -> None:
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - the asynchronous save's own error
            raise self._save_failed(e) from None

    def close(self) -> None:
        try:
            self.manager.close()
        except Exception as e:  # noqa: BLE001 - the asynchronous save's own error
            raise self._save_failed(e) from None

    # ---- restore
    def _restore(self, step: int, what: str, **items) -> Any:
        """`manager.restore` of some items; any failure is reported as a corrupt checkpoint."""
        try:
            with _ReadNoiseFilter():
                return self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # noqa: BLE001 - any read failure means the files are not what we wrote
            raise CheckpointError(f"{self.step_dir(step)}: corrupt checkpoint: {what}: "
                                  f"{_failure(self.step_dir(step), e)}") from None

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        step = self._need_step(step)
        where = self.step_dir(step)
        meta = self._restore(step, "cannot read its metadata", meta=ocp.args.JsonRestore())["meta"]
        if not isinstance(meta, dict) or "head" not in meta or "fingerprints" not in meta:
            raise CheckpointError(f"{where}: corrupt checkpoint: its metadata is incomplete")
        return meta

    def check_all(self, head_meta: dict[str, Any]) -> None:
        """Every step's metadata is readable and compatible (so LatestN never deletes a bad one unseen)."""
        for s in self.all_steps():
            check_head_metadata(self.read_meta(s)["head"], head_meta, str(self.step_dir(s)))

    def restore(self, step: int | None, *, abstract_params, abstract_opt_state, abstract_rng,
                head_meta: dict[str, Any]) -> dict[str, Any]:
        """Restores one step onto the shardings of the abstract targets (ShapeDtypeStruct with sharding).

        Returns {"step", "params", "opt_state", "rng", "data", "config"}.
        """
        step = self._need_step(step)
        where = str(self.step_dir(step))
        meta = self.read_meta(step)
        check_head_metadata(meta["head"], head_meta, where)
        target_ts = {"opt_state": abstract_opt_state, "rng": abstract_rng}
        out = self._restore(step, "cannot restore its arrays", params=ocp.args.StandardRestore(abstract_params),
                            train_state=ocp.args.StandardRestore(target_ts), config=ocp.args.JsonRestore())
        _check_fingerprints(out["params"], meta["fingerprints"]["params"], "params", where)
        _check_fingerprints(out["train_state"], meta["fingerprints"]["train_state"], "train_state", where)
        return {"step": int(meta["step"]), "params": out["params"], "opt_state": out["train_state"]["opt_state"],
                "rng": out["train_state"]["rng"], "data": meta["data"], "config": out["config"]}

    def restore_params(self, step: int | None, abstract_params) -> tuple[int, Any, dict[str, Any]]:
        """(step, params, meta) of one step: the head only (inference)."""
        step = self._need_step(step)
        where = str(self.step_dir(step))
        meta = self.read_meta(step)
        out = self._restore(step, "cannot restore its arrays", params=ocp.args.StandardRestore(abstract_params))
        _check_fingerprints(out["params"], meta["fingerprints"]["params"], "params", where)
        return step, out["params"], meta


# ------------------------------------------------------------------------------------------------ loading
def checkpoint_dir_of(run_dir: str | Path) -> Path:
    """A run's checkpoint directory: `<run_dir>/checkpoints` when present, else `run_dir` itself."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir}: run directory not found")
    sub = run_dir / "checkpoints"
    return sub if sub.is_dir() else run_dir


def load_head_from_run(run_dir: str | Path, base, step: int | None = None, *, dtype=None,
                       shardings=None):
    """The draft head of a training run (latest step unless `step`), checked against `base`'s dims.

    `shardings` (optional) is a pytree of `NamedSharding` for the head's pure param dict; by default the
    parameters land on the default device. `dtype` overrides the saved compute dtype.
    """
    ckpt = Checkpointer(checkpoint_dir_of(run_dir), read_only=True, async_save=False, save_on_preemption=False)
    try:
        step = ckpt._need_step(step)
        meta = ckpt.read_meta(step)
        where = str(ckpt.step_dir(step))
        saved = meta["head"]
        if saved.get("head_type") not in registry.names():
            raise CheckpointError(f"{where}: head type {saved.get('head_type')!r} is not one of {registry.names()}")
        ht = registry.get(saved["head_type"])
        bd = saved["base_dims"]
        for k in LlamaConfig.HEAD_FIT_FIELDS:
            if _saved_base_dim(bd, k) != getattr(base.config, k):
                raise CheckpointError(f"{where}: the head was trained for a base model with "
                                      f"{k}={_saved_base_dim(bd, k)!r}, this base model has {k}={getattr(base.config, k)!r}")
        hcfg = head_config_from_metadata(saved, dtype=dtype)
        abstract = nnx.eval_shape(lambda: ht.module_cls(base.config, hcfg, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(abstract)
        pure = nnx.to_pure_dict(state)
        if shardings is None:
            dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            shardings = jax.tree.map(lambda _: dev, pure)
        target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), pure, shardings)
        _, params, _ = ckpt.restore_params(step, target)
        return nnx.merge(graphdef, params)
    finally:
        ckpt.close()


def to_jsonable(x: Any) -> Any:
    """Plain JSON types from numpy scalars/arrays and dataclasses (for data states and metrics)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return to_jsonable(dataclasses.asdict(x))
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if isinstance(x, (np.ndarray, np.generic, jax.Array)):
        return np.asarray(x).tolist()
    return x


def dumps(x: Any) -> str:
    return json.dumps(to_jsonable(x))
