"""Writing Hugging Face folders: safetensors shards, the base model (transformers' LlamaForCausalLM layout), and the
checked merge of read tensors into a module (each head type's import uses it; `clover_jax.heads.export` writes and
reads head folders).

Folders are written to a temporary sibling and renamed into place, so a failure never leaves a
partial folder behind, and an existing folder is only replaced when `overwrite=True`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from clover_jax.io.hf import params_to_hf
from clover_jax.validation import InputError

DEFAULT_SHARD_BYTES = 2 * 1024**3


class ExportError(InputError):
    """A folder or checkpoint that cannot be exported or imported; the message names it."""


# --------------------------------------------------------------------------- writing safetensors
def write_safetensors(tensors: dict[str, np.ndarray], out_dir: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                      filename: str = "model.safetensors"):
    """`filename` (model.safetensors), or `model-0000i-of-0000n.safetensors` + index above `max_shard_bytes`."""
    names = sorted(tensors)
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        nbytes = tensors[n].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file({n: np.ascontiguousarray(tensors[n]) for n in names}, str(out_dir / filename), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: np.ascontiguousarray(tensors[n]) for n in shard}, str(out_dir / fname), metadata=meta)
        weight_map.update({n: fname for n in shard})
    total = int(sum(t.nbytes for t in tensors.values()))
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish_permissions(folder: Path, umask: int | None = None) -> None:
    """Folders 0755 and files 0644 (less what the umask removes), as a plain `mkdir` / `open` would give:
    `tempfile.mkdtemp` makes the folder 0700 and a rename keeps that."""
    umask = _current_umask() if umask is None else umask
    for root, dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~umask)
        for name in files:
            p = os.path.join(root, name)
            if not os.path.islink(p):
                os.chmod(p, 0o666 & ~umask)


class AtomicDir:
    """Context manager: yields a temp dir next to `out`, renamed to `out` on success, removed on error.
    The result has ordinary permissions (`publish_permissions`); a place that cannot be written is an
    ExportError naming `out`."""

    def __init__(self, out: str | os.PathLike, overwrite: bool):
        self.out = Path(out)
        self.overwrite = overwrite

    def __enter__(self) -> Path:
        if self.out.exists() and not self.overwrite:
            raise ExportError(f"out: {self.out} already exists (pass overwrite=True / --overwrite to replace it)")
        if self.out.exists() and not self.out.is_dir():
            raise ExportError(f"out: {self.out} is a file, not a folder")
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp", dir=self.out.parent))
        except OSError as e:
            raise ExportError(f"out: cannot write the folder {self.out}: {e.strerror or e}") from None
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if isinstance(exc, OSError) and not isinstance(exc, ExportError):  # e.g. a full disk while writing
                raise ExportError(f"out: writing {self.out} failed: {exc.strerror or exc}; nothing was "
                                  "written") from None
            return False
        try:
            publish_permissions(self.tmp)
            if self.out.exists():
                old = self.out.with_name(f".{self.out.name}.old{os.getpid()}")
                self.out.rename(old)
                self.tmp.rename(self.out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                self.tmp.rename(self.out)
        except OSError as e:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise ExportError(f"out: cannot write the folder {self.out}: {e.strerror or e}") from None
        return False


def to_numpy(x) -> np.ndarray:
    return np.asarray(jax.device_get(x), dtype=np.float32) if jnp.issubdtype(x.dtype, jnp.floating) else np.asarray(x)


# --------------------------------------------------------------------------- base model
def export_base(model, out_dir, *, tokenizer=None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                overwrite: bool = False, dtype=np.float32) -> Path:
    """Writes a transformers `LlamaForCausalLM` folder: safetensors (+ index), config, generation config, tokenizer."""
    config = model.config  # a LlamaConfig
    params = jax.tree.map(to_numpy, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    tensors = {k: v.astype(dtype) for k, v in params_to_hf(config, params).items()}
    with AtomicDir(out_dir, overwrite) as tmp:
        write_safetensors(tensors, tmp, max_shard_bytes)
        hf = config.to_hf_dict()
        hf["torch_dtype"] = np.dtype(dtype).name
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        eos = list(config.eos_token_ids)
        gen = {"bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
               "pad_token_id": config.pad_token_id}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return Path(out_dir)


def merge_checked(graphdef, state, pure: dict, where) -> Any:
    """The module `graphdef` with `state`'s leaves replaced by the arrays of `pure` (same tree), each checked
    against the abstract leaf's shape (an `ExportError` naming `where` otherwise) and cast to its dtype."""
    def place(abs_leaf, arr):
        arr = np.asarray(arr)
        if arr.shape != abs_leaf.shape:
            raise ExportError(f"{where}: tensor shape {arr.shape} != expected {abs_leaf.shape}")
        return jnp.asarray(arr, abs_leaf.dtype)

    nnx.replace_by_pure_dict(state, jax.tree.map(place, nnx.to_pure_dict(state), pure))
    return nnx.merge(graphdef, state)
