"""ReDrafter, the Recurrent Drafter (Zhang et al. 2024, arXiv 2403.09919; reference `apple/ml-recurrent-drafter`).

A small RNN conditioned on the base model's last hidden state. With h the base's last-layer hidden state after
the final norm at the last accepted token (held fixed while drafting) and e(x) the base's frozen input
embedding, the k-th draft (k = 1, 2, ...) reads

  s_0 = 0;   s_k = SiLU(W e(x_k) + U s_{k-1} + b)       (x_1 = the root, the token the base just emitted)
  z_k = R_L(... R_1([h; s_k]));   R_j(z) = z + SiLU(A_j z + c_j)                (2D wide residual blocks)
  q_k = softmax(z_k P)                                   (P [2D, V], the drafter's own vocabulary projection)

and q_k predicts x_{k+1}. Without the RNN (`rnn=False`, the reference's ablation) s_k = e(x_k) + s_{k-1}.
Parameters are initialised as torch's `nn.Linear` default (U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and
biases), as the reference's training script leaves them.

Drafting (`BeamDrafter`, a `tree.BeamTree` policy `beam-WxL`): the reference's beam search. All W beams start at
the root with log-probability 0 for beam 0 and -5e4 for the others (so the first expansion is not duplicated);
each of the L-1 steps advances every beam's RNN state by its last token, scores log q (the logits minus their
maximum, cut to their top 50 with -5e4 elsewhere, then log-softmax: the reference's `compute_logits`) plus the
beam's log-probability over W x V, and keeps the W best. The beams are then merged into one tree per row: the
node of beam w at depth j is the first beam (lowest index) with the same prefix up to j, so shared prefixes are
verified once (the reference's `docs/beam_to_prefix_tree.md`); the distinct nodes are packed in (beam, depth)
order into the policy's node budget and verified through `topology_from_parents`, like every other tree.
Greedy verification takes the longest accepted path; sampling uses the deterministic-children rule of
`clover_jax.decoding.verify` (siblings are distinct tokens after the merge), which keeps the target distribution
exactly, where the reference's own per-beam rule does not (its README says so).

Training (`loss_from_features`): the reference unrolls 5 steps at every position t (context h_t, step i reads
e(x_{t+1}) ... e(x_{t+1+i}) and predicts x_{t+2+i}) and sums the steps' cross-entropies with equal weights. We
use the same unroll with the distillation targets of the paper: the soft cross-entropy against the base's
distribution at t+1+i (`loss.decay: 1.0` for the reference's equal weights), or with `loss.hard_labels: true`
the reference code's cross-entropy against the data's tokens x_{t+2+i}; there is no regression term.

Shapes and einsum strings use the axis letters of `clover_jax.axes`. The drafter's width is I = 2D; the
M = W * (Lb - 1) candidate nodes of the beams are list entries M.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from safetensors import safe_open

from clover_jax.decoding.drafter import Proposal, TreeDrafterBase, cached_arrays, vocab_ids
from clover_jax.decoding.sampling import top_k
from clover_jax.decoding.trees.topology import topology_from_parents
from clover_jax.decoding.tree import BeamTree
from clover_jax.heads.losses import kd_loss, kd_loss_packed, next_token_labels, output_projection
from clover_jax.io.export import ExportError
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import Llama, rms_norm
from clover_jax.validation import InputError

LOG_0 = -50000.0  # the reference's log(0): masked logits and the start of beams 1..W-1
DRAFT_TOP_K = 50  # the reference's `warp_logits` top-k at drafting


@dataclasses.dataclass(frozen=True)
class ReDrafterConfig:
    num_steps: int = 5  # steps unrolled in training (the reference's drafter_predict_n_tokens)
    num_layers: int = 2  # residual blocks (num_draft_layers)
    rnn: bool = True  # False: s_k = e(x_k) + s_{k-1} (the reference's rnn=False)
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: bool = False  # unused; kept for a uniform head-config interface

    def __post_init__(self):
        if self.num_steps < 1:
            raise InputError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.num_layers < 0:
            raise InputError(f"num_layers must be >= 0, got {self.num_layers}")


def _uniform(rngs: nnx.Rngs, shape, fan_in: int, dtype) -> nnx.Param:
    bound = 1.0 / math.sqrt(fan_in)
    return nnx.Param(jax.random.uniform(rngs.params(), shape, dtype, -bound, bound))


class ReDrafterHead(nnx.Module):
    """The recurrent drafter of one base model (see the module docstring). Weights are `[in, out]`."""

    def __init__(self, base_config: LlamaConfig, cfg: ReDrafterConfig = ReDrafterConfig(), *, rngs: nnx.Rngs):
        self.base_config = base_config
        self.cfg = cfg
        d, v, layers, pd = base_config.hidden_size, base_config.vocab_size, cfg.num_layers, cfg.param_dtype
        e = 2 * d
        if cfg.rnn:
            self.rnn_w = _uniform(rngs, (d, d), d, pd)  # [D, D] W (no bias)
            self.rnn_u = _uniform(rngs, (d, d), d, pd)  # [D, D] U
            self.rnn_b = _uniform(rngs, (d,), d, pd)  # [D] b (the reference's rnn_u.bias)
        self.block_w = _uniform(rngs, (layers, e, e), e, pd)  # [L, I, I]
        self.block_b = _uniform(rngs, (layers, e), e, pd)  # [L, I]
        self.vocab_proj = _uniform(rngs, (e, v), e, pd)  # [I, V]

    def rnn_step(self, s: jax.Array, e: jax.Array) -> jax.Array:
        """`s_k [..., D]` from `s_{k-1} [..., D]` and the embedding `e(x_k) [..., D]`."""
        dt = self.cfg.dtype
        if not self.cfg.rnn:
            return (e.astype(jnp.float32) + s.astype(jnp.float32)).astype(dt)
        y = (jnp.einsum("...D,DF->...F", e.astype(dt), self.rnn_w[...].astype(dt), preferred_element_type=jnp.float32)
             + jnp.einsum("...D,DF->...F", s.astype(dt), self.rnn_u[...].astype(dt),
                          preferred_element_type=jnp.float32)
             + self.rnn_b[...].astype(jnp.float32))
        return jax.nn.silu(y).astype(dt)

    def features(self, h: jax.Array, s: jax.Array) -> jax.Array:
        """`z [..., I]`: the residual blocks over `[h; s]` (`h`, `s` `[..., D]`, broadcastable)."""
        dt = self.cfg.dtype
        h, s = jnp.broadcast_arrays(h.astype(dt), s.astype(dt))
        z = jnp.concatenate([h, s], axis=-1)  # [..., I]
        for j in range(self.cfg.num_layers):
            y = jnp.einsum("...I,IF->...F", z, self.block_w[j].astype(dt), preferred_element_type=jnp.float32)
            z = (z.astype(jnp.float32) + jax.nn.silu(y + self.block_b[j].astype(jnp.float32))).astype(dt)
        return z

    def projection(self, vocab_ids: jax.Array | None = None) -> jax.Array:
        """`P [I, V]`, or its columns `vocab_ids` `[I, Q]`."""
        p = self.vocab_proj[...]
        if vocab_ids is not None:
            p = jnp.take(p, jnp.asarray(vocab_ids, jnp.int32), axis=1)
        return p.astype(self.cfg.dtype)

    def train_outputs(self, h: jax.Array, emb: jax.Array, num: int | None = None) -> jax.Array:
        """`z [n, B, T, I]` of the unrolled steps at every position: step i (0-based) at t has read
        e(x_{t+1}) .. e(x_{t+1+i}) from `emb [B, T, D]` (zeros past the end) with context `h [B, T, D]`."""
        num = self.cfg.num_steps if num is None else num
        t = emb.shape[1]
        s = jnp.zeros(emb.shape, self.cfg.dtype)
        out = []
        for i in range(num):
            k = min(1 + i, t)
            e = jnp.pad(emb[:, k:], ((0, 0), (0, k), (0, 0)))  # e(x_{t+1+i}) [B, T, D]
            s = self.rnn_step(s, e)
            out.append(self.features(h, s))
        return jnp.stack(out)


def check_compatible(head: ReDrafterHead, base_config: LlamaConfig) -> None:
    """An `InputError` naming the dimension in which `head` does not fit `base_config`."""
    d, v = base_config.hidden_size, base_config.vocab_size
    if tuple(head.vocab_proj.shape) != (2 * d, v):
        raise InputError(f"ReDrafter head does not fit the base model: vocab_proj has shape "
                         f"{tuple(head.vocab_proj.shape)}, the base model (hidden {d}, vocab {v}) needs {(2 * d, v)}")


def init_from_base(base: Llama, cfg: ReDrafterConfig = ReDrafterConfig(), seed: int = 0) -> ReDrafterHead:
    """A fresh drafter for `base`, initialised as the reference's (torch's default `nn.Linear` init)."""
    head = jax.jit(lambda: ReDrafterHead(base.config, cfg, rngs=nnx.Rngs(params=seed)))()
    check_compatible(head, base.config)
    return head


# ------------------------------------------------------------------------------------------------ training
def loss_from_features(head: ReDrafterHead, base: Llama, f, tokens, loss_mask, valid, loss_cfg, *, index=None,
                       vocab_ids=None):
    """Distillation loss from the base's pre-norm features `f [B, T, D]`: `kd_loss`'s soft cross-entropy, step
    i at t against P_{t+1+i} = softmax(W_lm h_{t+1+i}) through the drafter's projection, weights
    `loss_cfg.decay ** i` (1.0: the reference's equal weights), no regression term."""
    f = jax.lax.stop_gradient(f)
    h = rms_norm(f, jax.lax.stop_gradient(base.final_norm[...]), base.config.rms_norm_eps)  # [B, T, D]
    emb = jax.lax.stop_gradient(base.embed_tokens(tokens))  # [B, T, D]
    z = head.train_outputs(h, emb)  # [n, B, T, I]
    student = head.projection(vocab_ids)  # [I, V or Q]
    teacher = output_projection(base, vocab_ids)  # [D, V or Q]
    cfg = dataclasses.replace(loss_cfg, v_weight=0.0)
    labels = next_token_labels(tokens, valid, vocab_ids) if cfg.hard_labels else None
    if index is not None:
        return kd_loss_packed(z, h, loss_mask, valid, teacher, index, cfg, student_proj=student, labels=labels)
    return kd_loss(z, h, tokens, loss_mask, valid, teacher, cfg, student_proj=student, labels=labels)


# ------------------------------------------------------------------------------------------------ drafting
def beam_search(head: ReDrafterHead, base, h: jax.Array, root: jax.Array, width: int, length: int,
                proj: jax.Array, vocab_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The reference's beam search: `(beams [B, W, Lb] int32 (root first), log_p [B, W])` from the context
    `h [B, D]` and the root `[B]`, over the draft vocabulary `vocab_ids [Q]` (None: all V) whose projection
    columns are `proj [I, Q]`."""
    b = root.shape[0]
    rows = jnp.arange(b)[:, None]
    log_p = jnp.broadcast_to(jnp.asarray([0.0] + [LOG_0] * (width - 1), jnp.float32), (b, width))  # [B, W]
    beams = jnp.broadcast_to(root[:, None, None].astype(jnp.int32), (b, width, 1))  # [B, W, 1]
    s = jnp.zeros((b, width, h.shape[-1]), head.cfg.dtype)  # [B, W, D]
    ctx = h[:, None, :]  # [B, 1, D]
    n = proj.shape[-1]
    k = min(DRAFT_TOP_K, n)
    for _ in range(length - 1):
        s = head.rnn_step(s, base.embed_tokens(beams[..., -1]))
        logits = jnp.einsum("BWI,IQ->BWQ", head.features(ctx, s).astype(proj.dtype), proj,
                            preferred_element_type=jnp.float32)  # [B, W, Q]
        logits = logits - jnp.max(logits, axis=-1, keepdims=True)
        kth = top_k(logits, k)[0][..., -1:]  # [B, W, 1]
        logits = jnp.where(logits < kth, LOG_0, logits)
        total = jax.nn.log_softmax(logits, axis=-1) + log_p[..., None]  # [B, W, Q]
        # the best W of all W * Q continuations are among each beam's best W (ties: the lower beam, then the lower
        # id, as one top-k over the flattened [W * Q] would take them); the vocabulary axis stays where it is
        cand_p, cand = top_k(total, width)  # [B, W, W]
        log_p, pos = jax.lax.top_k(cand_p.reshape(b, width * width), width)  # [B, W]
        src, tok = pos // width, jnp.take_along_axis(cand.reshape(b, width * width), pos, axis=1)
        tok = tok if vocab_ids is None else vocab_ids[tok]
        beams = jnp.concatenate([beams[rows, src], tok[..., None].astype(jnp.int32)], axis=-1)
        s = s[rows, src]
    return beams, log_p


def beams_to_tree(beams: jax.Array, budget: int) -> tuple[jax.Array, jax.Array]:
    """Merges beams `[B, W, Lb]` (root at position 0 of every beam) into a tree of `budget` nodes per row:
    `(tokens [B, U], parent [B, U])`, node 0 the root. The node of beam w at depth j >= 1 is that of the first
    beam with the same prefix up to j; distinct nodes get slots 1, 2, ... in (beam, depth) order, those past the
    budget are dropped (an ancestor always precedes its descendants in that order, so the kept set is a tree),
    and unused slots have parent -1. Jittable."""
    b, w, lb = beams.shape
    m = w * (lb - 1)
    same = beams[:, :, None, :] == beams[:, None, :, :]  # [B, W, W', Lb]
    prefix = jnp.cumprod(same.astype(jnp.int32), axis=-1).astype(bool)  # same prefix up to j
    first = jnp.argmax(prefix, axis=2).astype(jnp.int32)  # [B, W, Lb] the lowest beam sharing the prefix
    depth = jnp.arange(1, lb, dtype=jnp.int32)  # [Lb-1]
    own = jnp.arange(w, dtype=jnp.int32)[None, :, None]
    unique = (first[:, :, 1:] == own).reshape(b, m)  # [B, M] candidate c = w * (Lb-1) + (j-1)
    pos = jnp.cumsum(unique, axis=1) - 1
    slot = jnp.where(unique & (pos < budget - 1), pos + 1, -1).astype(jnp.int32)  # [B, M]
    canon = (first[:, :, 1:] * (lb - 1) + (depth - 1)[None, None, :]).reshape(b, m)  # candidate of the node
    node_slot = jnp.take_along_axis(slot, canon, axis=1)  # [B, M] the slot of each beam position's node
    parent_c = jnp.concatenate([jnp.full((b, w, 1), -1, jnp.int32),
                                canon.reshape(b, w, lb - 1)[:, :, :-1]], axis=2).reshape(b, m)
    parent_slot = jnp.where(parent_c < 0, 0, jnp.take_along_axis(node_slot, jnp.maximum(parent_c, 0), axis=1))
    rows = jnp.arange(b)[:, None]
    target = jnp.where(slot > 0, slot, budget)  # dropped / duplicate candidates go nowhere
    tok = beams[:, :, 1:].reshape(b, m)
    tokens = jnp.zeros((b, budget), jnp.int32).at[:, 0].set(beams[:, 0, 0])
    tokens = tokens.at[rows, target].set(tok, mode="drop")
    parent = jnp.full((b, budget), -1, jnp.int32).at[rows, target].set(parent_slot, mode="drop")
    return tokens, parent


@struct.dataclass
class ReDrafterState:
    shard_axes: ClassVar[dict[str, str]] = {"h": "B D", "beam_proj": "I Q"}
    h: jax.Array  # [B, D] the base's normed hidden state of the last accepted token (the root's predecessor)
    beam_proj: jax.Array  # [I, Q] the drafting projection (draft-vocabulary columns, or all V), Q split over tp
    vocab_ids: jax.Array | None  # [Q] int32 the draft vocabulary's ids (None: all V)


@dataclasses.dataclass(frozen=True, eq=False)
class BeamDrafter(TreeDrafterBase):
    """ReDrafter's drafting over a `BeamTree` policy (hashable by identity; build once per policy)."""

    spec: BeamTree
    draft_vocab: tuple[int, ...] | None = None  # sorted token ids the drafts are drawn from (None: all)
    sampled_drafts: bool = False  # beams are deterministic: the deterministic-children acceptance rule

    def check(self, head: ReDrafterHead, base) -> None:
        check_compatible(head, base.config)
        self.check_tree(self.max_depth, base.config.vocab_size, what="the beam search")

    def arrays(self) -> dict:
        return cached_arrays(self, lambda: {"vocab_ids": vocab_ids(self.draft_vocab)})

    def init_state(self, head: ReDrafterHead, base, batch: int, cache_size: int, arrays: dict | None = None
                   ) -> ReDrafterState:
        arrays = self.arrays() if arrays is None else arrays
        return ReDrafterState(h=jnp.zeros((batch, base.config.hidden_size), head.cfg.dtype),
                              beam_proj=head.projection(arrays["vocab_ids"]), vocab_ids=arrays["vocab_ids"])

    def _last_hidden(self, base, f, last) -> jax.Array:
        """Normed hidden `[B, D]` at index `last [B]` of pre-norm features `f [B, A, D]`."""
        x = jnp.take_along_axis(f, last[:, None, None], axis=1)[:, 0]  # [B, D]
        return rms_norm(x, base.final_norm[...], base.config.rms_norm_eps)

    def start(self, head, base, state: ReDrafterState, f_prompt, y_prompt, lengths) -> ReDrafterState:
        return state.replace(h=self._last_hidden(base, f_prompt, lengths - 1).astype(state.h.dtype))

    def commit(self, head, base, state: ReDrafterState, f_new, y_new, num_new) -> ReDrafterState:
        h = self._last_hidden(base, f_new, jnp.maximum(num_new - 1, 0)).astype(state.h.dtype)
        return state.replace(h=jnp.where((num_new > 0)[:, None], h, state.h))

    def propose(self, head: ReDrafterHead, base, state: ReDrafterState, root: jax.Array, key) -> Proposal:
        beams, _ = beam_search(head, base, state.h, root, self.spec.width, self.spec.length, state.beam_proj,
                               state.vocab_ids)
        tokens, parent = beams_to_tree(beams, self.num_nodes)
        rank = jnp.broadcast_to(jnp.arange(self.num_nodes, dtype=jnp.int32), parent.shape)  # best beams first
        topo = topology_from_parents(parent, rank, self.max_depth, self.spec.width)
        return Proposal(tokens=tokens, buffers=topo)


# ----------------------------------------------------------------------------------- export / import
def reference_names(num_layers: int, rnn: bool) -> dict[str, tuple[str, int | None]]:
    """Reference name -> (our parameter, block or None), as the reference's `Drafter` module names them:
    `lm_head.{j}.linear.weight|bias` (residual blocks), `lm_head.{L}.weight` (the vocabulary projection),
    `rnn_w.weight`, `rnn_u.weight|bias`. Torch layouts are `[out, in]`."""
    out = {}
    for j in range(num_layers):
        out[f"lm_head.{j}.linear.weight"] = ("block_w", j)
        out[f"lm_head.{j}.linear.bias"] = ("block_b", j)
    out[f"lm_head.{num_layers}.weight"] = ("vocab_proj", None)
    if rnn:
        out.update({"rnn_w.weight": ("rnn_w", None), "rnn_u.weight": ("rnn_u", None), "rnn_u.bias": ("rnn_b", None)})
    return out


_MATRICES = ("block_w", "vocab_proj", "rnn_w", "rnn_u")  # transposed between our [in, out] and torch's [out, in]


def to_reference(head: ReDrafterHead, base=None, include_frozen: bool = True, include_lm_head=None) -> dict:
    """{reference name: numpy array} (torch layouts). The drafter holds no copy of the base's weights."""
    out = {}
    for ref, (ours, j) in reference_names(head.cfg.num_layers, head.cfg.rnn).items():
        a = np.asarray(getattr(head, ours)[...], np.float32)
        a = a if j is None else a[j]
        out[ref] = np.ascontiguousarray(a.T if ours in _MATRICES else a)
    return out


def config_dict(head: ReDrafterHead, base_name=None, extra=None) -> dict:
    """config.json: the reference's `DrafterConfig` keys plus ours (head_type, num_steps, the base's config)."""
    b = head.base_config
    return {"head_type": "redrafter", "model_type": "recurrent_drafting_drafter", "architectures": ["Drafter"],
            "vocab_size": b.vocab_size, "hidden_size": b.hidden_size, "exit_dim": 2 * b.hidden_size,
            "num_draft_layers": head.cfg.num_layers, "rnn": head.cfg.rnn, "num_steps": head.cfg.num_steps,
            "base_model": {"name_or_path": base_name, **b.to_hf_dict()}, **(extra or {})}


def from_reference(folder, meta: dict, base, dtype=None) -> ReDrafterHead:
    """A drafter from a folder holding the reference's `config.json` and `model.safetensors`."""
    folder = Path(folder)
    file = folder / "model.safetensors"
    if not file.is_file():
        raise ExportError(f"{folder}: no model.safetensors")
    d, v = base.config.hidden_size, base.config.vocab_size
    try:
        layers, rnn = int(meta["num_draft_layers"]), bool(meta.get("rnn", True))
        exit_dim = int(meta.get("exit_dim", 2 * d))
    except (KeyError, TypeError, ValueError):
        raise ExportError(f"{folder}: config.json lacks a valid num_draft_layers") from None
    if exit_dim != 2 * d:
        raise ExportError(f"{folder}: exit_dim {exit_dim} != 2 x hidden_size {d}: drafters with an input "
                          "projection are not supported")
    cfg = ReDrafterConfig(num_steps=int(meta.get("num_steps", 5)), num_layers=layers, rnn=rnn,
                          **({"dtype": dtype, "param_dtype": dtype} if dtype is not None else {}))
    head = nnx.eval_shape(lambda: ReDrafterHead(base.config, cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(head)
    params: dict[str, np.ndarray] = {}
    with safe_open(str(file), framework="numpy") as fh:
        keys = set(fh.keys())
        for ref, (ours, j) in reference_names(layers, rnn).items():
            if ref not in keys:
                raise ExportError(f"{file}: missing tensor {ref!r}")
            a = np.asarray(fh.get_tensor(ref), np.float32)
            a = a.T if ours in _MATRICES else a
            want = tuple(getattr(head, ours).shape)[0 if j is None else 1:]
            if a.shape != want:
                raise ExportError(f"{file}: {ref} has shape {a.shape[::-1] if ours in _MATRICES else a.shape}, "
                                  f"the base model (hidden {d}, vocab {v}) needs "
                                  f"{want[::-1] if ours in _MATRICES else want}")
            if j is None:
                params[ours] = a
            else:
                params.setdefault(ours, np.zeros(getattr(head, ours).shape, np.float32))[j] = a
    for ours in ("block_w", "block_b"):  # zero residual blocks
        params.setdefault(ours, np.zeros(getattr(head, ours).shape, np.float32))
    nnx.replace_by_pure_dict(state, {k: jnp.asarray(a, cfg.param_dtype) for k, a in params.items()})
    return nnx.merge(graphdef, state)
