"""Medusa-1 draft heads (Cai et al. 2024, arXiv 2401.10774; reference `FasterDecoding/Medusa`), a baseline.

Head i (0-based) reads the base model's last-layer hidden state after the final norm, h_t (the reference feeds
`base_model.model(...)[0]`), and predicts x_{t+2+i} (the base itself predicts x_{t+1}):

  x^i_0 = h_t;   x^i_{j+1} = x^i_j + SiLU(W_ij x^i_j + b_ij)   (j < num_layers: residual blocks)
  logits^i = x^i_L @ P_i                                        (P_i [D, V] trainable, initialised = W_lm)

The reference initialises W_ij = 0 (so each head starts as the base's own next-token head) and b_ij with
torch's default Linear init, U(-1/sqrt(D), 1/sqrt(D)). Its `[ResBlock(D)] * num_layers` repeats one block
object, so with num_layers > 1 the reference's blocks share weights; ours are separate (a superset: an
import of a reference folder copies the shared block into each slot and computes the same function).

Drafting (`MedusaDrafter`) is one pass: every head reads the hidden state of the last accepted token, and a
tree node at depth d with child rank r takes head d-1's r-th most likely token (the reference's
`generate_medusa_buffers` indexing), whatever its parent. Training (`loss_from_features`) is distillation:
the soft cross-entropy of Clover-2's loss against the base's distribution at the same target position, with
per-head weights decay^i (the paper's 0.8^i when `loss.decay` is 0.8) and no regression term.

Shapes and einsum strings use the axis letters of `clover_jax.axes`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from clover_jax.decoding.sampling import top_k_ids
from clover_jax.decoding.trees.topology import TreeTopology
from clover_jax.heads.losses import kd_loss, kd_loss_packed, next_token_labels, output_projection
from clover_jax.heads.per_depth import PerDepthDrafter
from clover_jax.io.export import ExportError
from clover_jax.io.hf import read_weights_file
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import Llama, rms_norm
from clover_jax.validation import InputError

log = logging.getLogger(__name__)

WEIGHTS_FILE = "medusa_lm_head.safetensors"  # the reference's file name for the heads


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
    num_heads: int = 5  # the reference's medusa_num_heads (its published Vicuna heads: 5)
    num_layers: int = 1  # residual blocks per head (medusa_num_layers)
    dtype: Any = jnp.float32  # compute dtype (logits accumulate in float32)
    param_dtype: Any = jnp.float32
    remat: bool = False  # unused (nothing to rematerialise); kept for a uniform head-config interface

    def __post_init__(self):
        if self.num_heads < 1:
            raise InputError(f"num_heads must be >= 1, got {self.num_heads}")
        if self.num_layers < 1:
            raise InputError(f"num_layers must be >= 1, got {self.num_layers}")


class MedusaHead(nnx.Module):
    """`num_heads` Medusa heads for one base model (see the module docstring)."""

    def __init__(self, base_config: LlamaConfig, cfg: MedusaConfig = MedusaConfig(), *, rngs: nnx.Rngs):
        self.base_config = base_config
        self.cfg = cfg
        n, layers, d, v = cfg.num_heads, cfg.num_layers, base_config.hidden_size, base_config.vocab_size
        pd = cfg.param_dtype
        bound = 1.0 / math.sqrt(d)
        self.res_w = nnx.Param(jnp.zeros((n, layers, d, d), pd))  # [n, L, D_in, D_out], reference init 0
        self.res_b = nnx.Param(jax.random.uniform(rngs.params(), (n, layers, d), pd, -bound, bound))  # [n, L, D]
        self.proj = nnx.Param(0.02 * jax.random.normal(rngs.params(), (n, d, v), pd))  # [n, D, V]

    def features(self, h: jax.Array, num: int | None = None) -> jax.Array:
        """`x^i_L [num, ..., D]` of heads 0..num-1 (default all) from normed base hidden states `h [..., D]`."""
        dt = self.cfg.dtype
        num = self.cfg.num_heads if num is None else num
        w, b = self.res_w[:num].astype(dt), self.res_b[:num].astype(dt)  # [n, L, D, D], [n, L, D]
        x = jnp.broadcast_to(h.astype(dt), (num, *h.shape))  # [n, ..., D]
        lead = (slice(None),) + (None,) * (h.ndim - 1)
        for j in range(self.cfg.num_layers):
            y = jnp.einsum("n...D,nDF->n...F", x, w[:, j], preferred_element_type=jnp.float32)
            x = x + jax.nn.silu(y + b[:, j][lead].astype(jnp.float32)).astype(dt)
        return x

    def projection(self, vocab_ids: jax.Array | None = None, num: int | None = None) -> jax.Array:
        """The heads' output projections `[n, D, V]`, or their columns `vocab_ids` `[n, D, Q]`."""
        p = self.proj[...] if num is None else self.proj[:num]
        if vocab_ids is None:
            return p.astype(self.cfg.dtype)
        return jnp.take(p, jnp.asarray(vocab_ids, jnp.int32), axis=2).astype(self.cfg.dtype)


def check_compatible(head: MedusaHead, base_config: LlamaConfig) -> None:
    """An `InputError` naming the dimension in which `head` does not fit `base_config`."""
    d, v = base_config.hidden_size, base_config.vocab_size
    n, layers = head.cfg.num_heads, head.cfg.num_layers
    for what, got, want in (("hidden_size (res_w)", head.res_w.shape, (n, layers, d, d)),
                            ("vocab_size (proj)", head.proj.shape, (n, d, v))):
        if tuple(got) != tuple(want):
            raise InputError(f"Medusa head does not fit the base model: {what} has shape {tuple(got)}, the base "
                             f"model needs {tuple(want)}")


def init_from_base(base: Llama, cfg: MedusaConfig = MedusaConfig(), seed: int = 0) -> MedusaHead:
    """The reference's initialisation: residual weights 0, biases U(-1/sqrt(D), 1/sqrt(D)), every head's
    projection a copy of the base's lm_head (so each head starts as the base's next-token predictor)."""
    def build(base: Llama) -> MedusaHead:
        head = MedusaHead(base.config, cfg, rngs=nnx.Rngs(params=seed))
        w = jax.lax.stop_gradient(base.lm_head_matrix()).astype(cfg.param_dtype)  # [D, V]
        head.proj[...] = jnp.broadcast_to(w, head.proj.shape)
        return head

    head = jax.jit(build)(base)
    check_compatible(head, base.config)
    return head


# ------------------------------------------------------------------------------------------------ training
def loss_from_features(head: MedusaHead, base: Llama, f, tokens, loss_mask, valid, loss_cfg, *, index=None,
                       vocab_ids=None):
    """Distillation loss of the heads from the base's pre-norm features `f [B, T, D]`: `kd_loss`'s soft
    cross-entropy (teacher P_{t+1+i} = softmax(W_lm h_{t+1+i}) for head i at t) through each head's own
    projection, weights `loss_cfg.decay ** i`, no regression term (its metrics are reported as 0)."""
    f = jax.lax.stop_gradient(f)
    h = rms_norm(f, jax.lax.stop_gradient(base.final_norm[...]), base.config.rms_norm_eps)  # [B, T, D]
    x = head.features(h)  # [n, B, T, D]
    student = head.projection(vocab_ids)  # [n, D, V or Q]
    teacher = output_projection(base, vocab_ids)  # [D, V or Q]
    cfg = dataclasses.replace(loss_cfg, v_weight=0.0)
    labels = next_token_labels(tokens, valid, vocab_ids) if cfg.hard_labels else None
    if index is not None:
        loss, m = kd_loss_packed(x, h, loss_mask, valid, teacher, index, cfg, student_proj=student, labels=labels)
    else:
        loss, m = kd_loss(x, h, tokens, loss_mask, valid, teacher, cfg, student_proj=student, labels=labels)
    m["vloss"] = jnp.zeros_like(m["vloss"])
    return loss, m


# ------------------------------------------------------------------------------------------------ drafting
@struct.dataclass
class MedusaState:
    shard_axes: ClassVar[dict[str, str]] = {"h": "B D", "heads_proj": "n D Q"}
    h: jax.Array  # [B, D] normed base hidden state of the last accepted token (the root's predecessor)
    heads_proj: jax.Array  # [n, D, Q] the drafting heads' projections (draft-vocabulary columns, or all V)
    vocab_ids: jax.Array | None  # [Q] int32 the draft vocabulary's ids (None: all V)
    buffers: TreeTopology  # the tree's topology (Medusa needs no per-parent expansion plan)
    node_index: jax.Array  # [U] int32 index of each node's token in cat([root], top-k of heads 0.. flat)


@dataclasses.dataclass(frozen=True, eq=False)
class MedusaDrafter(PerDepthDrafter):
    """Static drafting plan of Medusa heads over one tree (hashable by identity; build once per tree): head d - 1
    gives depth d's candidates (`clover_jax.heads.per_depth`)."""

    def check(self, head: MedusaHead, base) -> None:
        check_compatible(head, base.config)
        self.check_depths(head.cfg.num_heads, base.config.vocab_size, what="the Medusa head")

    def init_state(self, head: MedusaHead, base, batch: int, cache_size: int, arrays: dict | None = None
                   ) -> MedusaState:
        arrays = self.arrays() if arrays is None else arrays
        return MedusaState(h=jnp.zeros((batch, base.config.hidden_size), head.cfg.dtype),
                           heads_proj=head.projection(arrays["vocab_ids"], num=self.max_depth),
                           vocab_ids=arrays["vocab_ids"], buffers=arrays["buffers"],
                           node_index=arrays["node_index"])

    def _last_hidden(self, base, f, last) -> jax.Array:
        """Normed hidden `[B, D]` at index `last [B]` of pre-norm features `f [B, A, D]`."""
        x = jnp.take_along_axis(f, last[:, None, None], axis=1)[:, 0]  # [B, D]
        return rms_norm(x, base.final_norm[...], base.config.rms_norm_eps)

    def start(self, head, base, state: MedusaState, f_prompt, y_prompt, lengths) -> MedusaState:
        return state.replace(h=self._last_hidden(base, f_prompt, lengths - 1).astype(state.h.dtype))

    def commit(self, head, base, state: MedusaState, f_new, y_new, num_new) -> MedusaState:
        h = self._last_hidden(base, f_new, jnp.maximum(num_new - 1, 0)).astype(state.h.dtype)
        return state.replace(h=jnp.where((num_new > 0)[:, None], h, state.h))

    def depth_top_k(self, head: MedusaHead, base, state: MedusaState, root: jax.Array) -> jax.Array:
        x = head.features(state.h, num=self.max_depth)  # [n, B, D]
        logits = jnp.einsum("nBD,nDQ->nBQ", x.astype(state.heads_proj.dtype), state.heads_proj,
                            preferred_element_type=jnp.float32)
        return jnp.moveaxis(top_k_ids(logits, self.spec.top_k), 0, 1)  # [B, n, k]


# ----------------------------------------------------------------------------------- export / import
def reference_names(num_heads: int, num_layers: int, prefix: str = "") -> dict[str, tuple[str, int, int | None]]:
    """Reference name -> (our parameter, head, block or None): `{i}.{j}.linear.weight|bias` for the residual
    blocks, `{i}.{num_layers}.weight` for the vocabulary projection (torch [out, in]): the keys of the reference's
    `medusa_head` ModuleList, which its training code saves (`medusa_head.state_dict()`) and its `from_pretrained`
    loads (`model.medusa_head.load_state_dict(...)`). `prefix` "medusa_head." gives the names inside a whole
    `MedusaModel`; import reads either form."""
    out = {}
    for i in range(num_heads):
        for j in range(num_layers):
            out[f"{prefix}{i}.{j}.linear.weight"] = ("res_w", i, j)
            out[f"{prefix}{i}.{j}.linear.bias"] = ("res_b", i, j)
        out[f"{prefix}{i}.{num_layers}.weight"] = ("proj", i, None)
    return out


def _heads_in(keys) -> tuple[int, int, str]:
    """(heads, residual blocks per head, key prefix) of a Medusa state dict, from its key names."""
    prefix = "medusa_head." if any(k.startswith("medusa_head.") for k in keys) else ""
    heads, blocks = set(), set()
    for k in keys:
        parts = k[len(prefix):].split(".") if k.startswith(prefix) else []
        if len(parts) >= 3 and parts[0].isdigit() and parts[1].isdigit():
            heads.add(int(parts[0]))
            if parts[2] == "linear":
                blocks.add(int(parts[1]))
    return len(heads), len(blocks), prefix


def to_reference(head: MedusaHead, base=None, include_frozen: bool = True, include_lm_head=None) -> dict:
    """{reference name: numpy array} (torch layouts). Medusa heads hold no frozen copies of the base."""
    params = {"res_w": np.asarray(head.res_w[...], np.float32), "res_b": np.asarray(head.res_b[...], np.float32),
              "proj": np.asarray(head.proj[...], np.float32)}
    out = {}
    for ref, (ours, i, j) in reference_names(head.cfg.num_heads, head.cfg.num_layers).items():
        a = params[ours][i] if j is None else params[ours][i, j]
        out[ref] = np.ascontiguousarray(a.T if ours in ("res_w", "proj") else a)
    return out


def config_dict(head: MedusaHead, base_name=None, extra=None) -> dict:
    """config.json: the reference's keys (medusa_num_heads, medusa_num_layers, base_model_name_or_path) plus
    ours (head_type, hidden_size, vocab_size, the base model's config)."""
    b = head.base_config
    return {"head_type": "medusa", "architectures": ["MedusaModel"], "medusa_num_heads": head.cfg.num_heads,
            "medusa_num_layers": head.cfg.num_layers, "base_model_name_or_path": base_name,
            "hidden_size": b.hidden_size, "vocab_size": b.vocab_size,
            "base_model": {"name_or_path": base_name, **b.to_hf_dict()}, **(extra or {})}


def from_reference(folder, meta: dict, base, dtype=None) -> MedusaHead:
    """A Medusa head from a folder with the reference's weights: `medusa_lm_head.safetensors` (what its training
    code writes), `medusa_lm_head.pt` (what its published heads ship, read without torch) or `model.safetensors`.

    The number of heads and blocks is read from the tensor names: the reference's published Vicuna heads hold 5
    heads under a config.json that says `medusa_num_heads: 2` (its `from_pretrained` overrides it to 5)."""

    folder = Path(folder)
    names = (WEIGHTS_FILE, "medusa_lm_head.pt", "model.safetensors")
    file = next((folder / n for n in names if (folder / n).is_file()), None)
    if file is None:
        raise ExportError(f"{folder}: no {', '.join(names)}")
    get, keys = read_weights_file(file)
    n, layers, prefix = _heads_in(keys)
    if n == 0:
        raise ExportError(f"{file}: holds no Medusa head tensors ({{i}}.{{j}}.linear.weight, {{i}}.{{L}}.weight)")
    said = meta.get("medusa_num_heads")
    if said is not None and int(said) != n:
        log.warning("%s: config.json says medusa_num_heads=%s, the weights hold %d heads: using %d", folder, said, n, n)
    cfg = MedusaConfig(num_heads=n, num_layers=layers,
                       **({"dtype": dtype, "param_dtype": dtype} if dtype is not None else {}))
    d, v = base.config.hidden_size, base.config.vocab_size
    res_w = np.zeros((n, layers, d, d), np.float32)
    res_b = np.zeros((n, layers, d), np.float32)
    proj = np.zeros((n, d, v), np.float32)
    want = {"res_w": (d, d), "res_b": (d,), "proj": (v, d)}
    keys = set(keys)
    for ref, (ours, i, j) in reference_names(n, layers, prefix).items():
        if ref not in keys:
            raise ExportError(f"{file}: missing tensor {ref!r}")
        a = np.asarray(get(ref), np.float32)
        if a.shape != want[ours]:
            raise ExportError(f"{file}: {ref} has shape {a.shape}, the base model needs {want[ours]}")
        if ours == "res_w":
            res_w[i, j] = a.T
        elif ours == "res_b":
            res_b[i, j] = a
        else:
            proj[i] = a.T
    head = nnx.eval_shape(lambda: MedusaHead(base.config, cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(head)
    pd = cfg.param_dtype
    nnx.replace_by_pure_dict(state, {"res_w": jnp.asarray(res_w, pd), "res_b": jnp.asarray(res_b, pd),
                                     "proj": jnp.asarray(proj, pd)})
    return nnx.merge(graphdef, state)


def recognizes(meta: dict, folder) -> bool:
    """A folder as the reference publishes its heads: config.json with `medusa_num_heads`, or its weight file."""
    return "medusa_num_heads" in meta or any((Path(folder) / n).is_file()
                                             for n in (WEIGHTS_FILE, "medusa_lm_head.pt"))
