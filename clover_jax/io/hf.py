"""Hugging Face <-> clover_jax Llama weights, torch-free.

One mapping table serves import and export. HF stores `nn.Linear.weight` as `[out, in]`; clover_jax
stores `[in, ...]` kernels split by head (`wq [D, N, H]`), stacked over layers (`[L, ...]`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from clover_jax.io.torch_pickle import open_torch_file
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import Llama
from clover_jax.parallel import model_shardings
from clover_jax.validation import InputError, WeightFileError

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _layer_table(c: LlamaConfig):
    """HF per-layer suffix -> (our name, to_ours(np [out,in]) , to_hf(np ours))."""
    D, N, K, H = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    t = {
        "input_layernorm.weight": ("attn_norm", lambda w: w, lambda w: w),
        "post_attention_layernorm.weight": ("mlp_norm", lambda w: w, lambda w: w),
        "self_attn.q_proj.weight": ("wq", lambda w: w.T.reshape(D, N, H), lambda w: w.reshape(D, N * H).T),
        "self_attn.k_proj.weight": ("wk", lambda w: w.T.reshape(D, K, H), lambda w: w.reshape(D, K * H).T),
        "self_attn.v_proj.weight": ("wv", lambda w: w.T.reshape(D, K, H), lambda w: w.reshape(D, K * H).T),
        "self_attn.o_proj.weight": ("wo", lambda w: w.T.reshape(N, H, D), lambda w: w.reshape(N * H, D).T),
        "mlp.gate_proj.weight": ("w_gate", lambda w: w.T, lambda w: w.T),
        "mlp.up_proj.weight": ("w_up", lambda w: w.T, lambda w: w.T),
        "mlp.down_proj.weight": ("w_down", lambda w: w.T, lambda w: w.T),
    }
    if c.attention_bias:
        t["self_attn.q_proj.bias"] = ("bq", lambda b: b.reshape(N, H), lambda b: b.reshape(-1))
        t["self_attn.k_proj.bias"] = ("bk", lambda b: b.reshape(K, H), lambda b: b.reshape(-1))
        t["self_attn.v_proj.bias"] = ("bv", lambda b: b.reshape(K, H), lambda b: b.reshape(-1))
    if c.attention_out_bias:
        t["self_attn.o_proj.bias"] = ("bo", lambda b: b, lambda b: b)
    if c.qk_norm:  # Qwen3: one [H] RMSNorm weight for every query head, one for every key head
        t["self_attn.q_norm.weight"] = ("q_norm", lambda w: w, lambda w: w)
        t["self_attn.k_norm.weight"] = ("k_norm", lambda w: w, lambda w: w)
    if c.mlp_bias:
        for hf_name, ours in (("gate_proj", "b_gate"), ("up_proj", "b_up"), ("down_proj", "b_down")):
            t[f"mlp.{hf_name}.bias"] = (ours, lambda b: b, lambda b: b)
    return t


def hf_to_params(config: LlamaConfig, tensors: Callable[[str], np.ndarray], keys: Iterable[str],
                 source: str = "checkpoint") -> dict:
    """Builds our nested param dict (numpy) from HF-named tensors, returned lazily by `tensors(name)`."""
    keys = set(keys)
    table = _layer_table(config)
    L = config.num_hidden_layers

    def need(name):
        if name not in keys:
            raise KeyError(f"{source}: missing tensor {name!r}")
        return np.asarray(tensors(name))

    layers = {}
    for suffix, (ours, to_ours, _) in table.items():
        stacked = [to_ours(need(f"model.layers.{i}.{suffix}")) for i in range(L)]
        layers[ours] = np.stack(stacked)
    params = {
        "embed": need("model.embed_tokens.weight"),
        "final_norm": need("model.norm.weight"),
        "layers": layers,
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = need("lm_head.weight").T
    expected = {params["embed"].shape == (config.vocab_size, config.hidden_size)}
    if not all(expected):
        raise InputError(f"{source}: embed_tokens has shape {params['embed'].shape}, config says "
                         f"({config.vocab_size}, {config.hidden_size})")
    return params


def params_to_hf(config: LlamaConfig, params: dict) -> dict[str, np.ndarray]:
    """Our nested param dict (arrays) -> HF-named numpy tensors (torch layouts)."""
    out = {"model.embed_tokens.weight": np.asarray(params["embed"]),
           "model.norm.weight": np.asarray(params["final_norm"])}
    for suffix, (ours, _, to_hf) in _layer_table(config).items():
        stacked = np.asarray(params["layers"][ours])
        for i in range(config.num_hidden_layers):
            out[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(to_hf(stacked[i]))
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["lm_head"]).T)
    return out


def model_from_params(config: LlamaConfig, params: dict, *, param_dtype=jnp.float32, dtype=jnp.float32,
                      shardings=None, remat: bool = False, mesh=None) -> Llama:
    """Creates a Llama from a nested numpy param dict without materialising random weights.

    `shardings`, if given, is a pytree matching the model state of `NamedSharding`s: each array is
    placed on its target sharding as it is converted. `mesh` instead: the shardings of
    `clover_jax.parallel`'s rules on that mesh.
    """
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0), param_dtype=param_dtype,
                                            dtype=dtype, remat=remat))
    graphdef, state = nnx.split(abstract)
    if shardings is None and mesh is not None:
        shardings = model_shardings(state, mesh)
    flat = dict(nnx.to_flat_state(state))
    shard_flat = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
    new_leaves = {}
    for path, var in flat.items():
        node = params
        for p in path:
            if p not in node:
                raise KeyError(f"weights have no entry for {'.'.join(map(str, path))}")
            node = node[p]
        arr = np.asarray(node)
        if arr.shape != var.shape:
            raise InputError(f"{'.'.join(map(str, path))}: weight shape {arr.shape} != model shape {var.shape}")
        arr = arr.astype(jnp.dtype(param_dtype))
        sh = shard_flat.get(path)
        sh = sh.get_value() if isinstance(sh, nnx.Variable) else sh
        value = jax.device_put(arr, sh) if sh is not None else jnp.asarray(arr)
        new_leaves[path] = var.replace(value)
    state = nnx.from_flat_state(new_leaves)
    return nnx.merge(graphdef, state)


def model_params(model: Llama) -> dict:
    """The model's params as a nested dict of arrays (`embed`, `layers.wq`, ...)."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


# ------------------------------------------------------------------- weight folders (safetensors or torch)
def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors"))
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{path}: index names {f.name}, which does not exist")
    return files


def _torch_files(path: Path) -> list[Path]:
    """A folder's `torch.save` weight files: the shards of `pytorch_model.bin.index.json`, `pytorch_model.bin`,
    else its `pytorch_model*.bin` / `*.pt` files (Medusa's `medusa_lm_head.pt`); never `training_args.bin`."""
    index = path / "pytorch_model.bin.index.json"
    if index.is_file():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{path}: index names {f.name}, which does not exist")
        return files
    if (path / "pytorch_model.bin").is_file():
        return [path / "pytorch_model.bin"]
    return sorted([*path.glob("pytorch_model*.bin"), *path.glob("*.pt")])


def read_weights_dir(path: str | Path):
    """Returns `(getter(name) -> np.ndarray, keys)` over the weight files of a model or head folder: its
    safetensors files, or else its `torch.save` files (`pytorch_model.bin`, shards, `*.pt`), read without torch
    (`clover_jax.io.torch_pickle`), as many published models and heads only ship those.

    A file that cannot be read (truncated, corrupt, not what its name says) raises `WeightFileError` naming it."""
    path = Path(path)
    files = _safetensors_files(path) or _torch_files(path)
    if not files:
        raise FileNotFoundError(f"{path}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin "
                                "found")
    where = {}
    getters = {}
    for f in files:
        getters[f], names = read_weights_file(f)
        for k in names:
            where[k] = f

    def get(name):
        return getters[where[name]](name)

    return get, list(where)


def read_weights_file(file: str | Path):
    """`(getter(name) -> np.ndarray, keys)` of one weight file: safetensors, or a `torch.save` zip archive
    (`.bin`, `.pt`, `.pth`) read without torch. An unreadable file raises `WeightFileError` naming it."""
    file = Path(file)
    try:
        if file.suffix == ".safetensors":
            h = safe_open(str(file), framework="numpy")
            raw_get, names = h.get_tensor, list(h.keys())
        else:
            raw_get, names = open_torch_file(file)
    except Exception as e:  # noqa: BLE001 - SafetensorError, TorchFileError, OSError: not what it claims
        raise _weight_file_error(file, e) from None

    def get(name):
        try:
            return raw_get(name)
        except Exception as e:  # noqa: BLE001
            raise _weight_file_error(file, e, name) from None

    return get, names


def _weight_file_error(file: Path, e: BaseException, tensor: str | None = None) -> WeightFileError:
    what = f"tensor {tensor!r} of {file}" if tensor else str(file)
    size = file.stat().st_size if file.is_file() else 0
    return WeightFileError(f"{what} cannot be read ({type(e).__name__}: {str(e).strip()[:200]}); the file "
                           f"({size} bytes) is truncated or corrupt: download or export it again")


def load_hf_dir(path: str | Path, *, param_dtype=jnp.float32, dtype=jnp.float32, shardings=None, mesh=None):
    """Loads `config.json` + weights (safetensors, or `pytorch_model*.bin`) from a transformers model folder, no
    torch needed."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder not found: {path}")
    config = LlamaConfig.from_json_file(path / "config.json")
    get, keys = read_weights_dir(path)
    params = hf_to_params(config, get, keys, source=str(path))
    return config, model_from_params(config, params, param_dtype=param_dtype, dtype=dtype, shardings=shardings,
                                     mesh=mesh)
