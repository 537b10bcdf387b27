"""Clover-2 knowledge-distillation loss (reference `XiaoBin1992/clover`, `clover/train/main_clover2.py`).

For head i (0-based) at start position t (t <= T-1-i), with o^i_t the head output (predicts x_{t+2+i}),
h_t the base post-final-norm hidden state and W_lm the frozen lm_head:

  m^i_t    = lm[t+i]                          lm = loss_mask & valid & valid[t+1] (the reference's
                                              per-sequence loss_mask[-1] = 0), times the optional
                                              cumulative label mask
  vloss_i  = sum_t m^i_t mean_D SmoothL1_{beta=1}(o^i_t, h_{t+1+i})            / (sum_t m^i_t + 1)
  ploss_i  = -sum_t m^i_t sum_V P_{t+i} log_softmax(W_lm o^i_t)                  / (sum_t m^i_t + 1)
  P_{t+i}  = softmax(W_lm h_{t+1+i})          (teacher; no temperature, full vocabulary, no gradient)
  L        = sum_i head_weight * decay^i * (v_weight vloss_i + p_weight ploss_i)

Sums run over the whole batch (one normaliser per head, as the reference). Everything V-sized
(teacher softmax, student log_softmax, argmaxes, label mask) is computed in chunks of
`vocab_chunk` positions under `lax.map` + `jax.checkpoint`, so peak memory is
O(B * chunk * num_heads * V) in the forward and the backward.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.models.cache import causal_mask
from clover_jax.models.llama import Llama
from clover_jax.sections import Section


@dataclasses.dataclass(frozen=True)
class LossConfig(Section):
    """L = sum_i decay^i (v_weight * vloss_i + p_weight * ploss_i), as the Clover-2 reference."""

    _name = "loss"
    decay: float = 0.7
    v_weight: float = 10.0  # SmoothL1 regression to the base post-norm hidden state
    p_weight: float = 1.0  # soft-label cross-entropy against the base distribution
    head_weight: float = 1.0  # the reference's heads_coefficient: every head's term scaled by it
    vocab_chunk: int = 0  # positions per chunk when computing [.., V] logits; 0 = no chunking
    # the reference's --label_mask (get_id_mask, off there and here): a position trains head i only where the
    # base ranks each of the i + 1 true next tokens among its top `label_mask_topk` (0: all V) tokens, stopping
    # once `label_mask_topp` (0: 1.0) of its mass is seen; on when either is set
    label_mask_topk: int = 0
    label_mask_topp: float = 0.0
    # Cross-entropy positions per row: 0 = every trained position (the reference); K > 0 computes the
    # vocabulary-sized terms only at (up to) K trained positions per row, a random subset where a row has
    # more, so prompt and padding positions cost nothing (the regression term still sees every position).
    vocab_positions_per_row: int = 0
    # Cross-entropy over the draft vocabulary (the train.draft_vocab_size most frequent trained tokens, the
    # ids written to draft_vocab.json) instead of all V: teacher and student distributions both restricted
    # to it, as the head drafts with `draft_vocab=` at inference. Costs Q/V of the vocabulary terms.
    draft_vocab: bool = False
    # cross-entropy against the data's next tokens instead of the base's soft labels (the ReDrafter reference's
    # public training code trains so); the regression term, where a head has one, is unchanged
    hard_labels: bool = False
    # EAGLE's training noise on the head's input features (SafeAILab/EAGLE v1 `AddUniformNoise`, std 0.2 in its
    # recipe): uniform, amplitude feature_noise * 512 / (the row's length), on inputs only; 0 = off. Only head
    # types that read the base's features as inputs support it (HeadType.feature_noise)
    feature_noise: float = 0.0

    def _validate(self):
        self._need(0 < self.decay <= 1, "decay", "must be in (0, 1]")
        self._need(self.feature_noise >= 0, "feature_noise", "must be >= 0 (0 = off)")
        self._need(self.v_weight >= 0, "v_weight", "must be >= 0")
        self._need(self.p_weight >= 0, "p_weight", "must be >= 0")
        self._need(self.head_weight > 0, "head_weight", "must be > 0")
        self._need(self.v_weight + self.p_weight > 0, "p_weight", "v_weight and p_weight cannot both be 0")
        self._need(self.vocab_chunk >= 0, "vocab_chunk", "must be >= 0")
        self._need(self.label_mask_topk >= 0, "label_mask_topk", "must be >= 0")
        self._need(0 <= self.label_mask_topp <= 1, "label_mask_topp", "must be in [0, 1]")
        self._need(self.vocab_positions_per_row >= 0, "vocab_positions_per_row", "must be >= 0 (0 = all)")
        self._need(not (self.vocab_positions_per_row and (self.label_mask_topk or self.label_mask_topp)),
                   "vocab_positions_per_row", "cannot be combined with the label mask (it needs the teacher "
                   "at every position); set it to 0")

    @property
    def label_mask(self) -> bool:
        """Whether the reference's label mask is on (`label_mask_topk` or `label_mask_topp` set)."""
        return self.label_mask_topk > 0 or self.label_mask_topp > 0


def smooth_l1(x: jax.Array, y: jax.Array, beta: float = 1.0) -> jax.Array:
    """`torch.nn.SmoothL1Loss(reduction='none', beta=1)`."""
    d = jnp.abs(x - y)
    return jnp.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta)


def _shift(x: jax.Array, k: int, axis: int = 1) -> jax.Array:
    """`x[t + k]` along `axis`, zero (False) past the end."""
    if k == 0:
        return x
    n = x.shape[axis]
    body = jax.lax.slice_in_dim(x, min(k, n), n, axis=axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, min(k, n))
    return jnp.pad(body, pad)


def _logits(x: jax.Array, lm_head: jax.Array) -> jax.Array:
    """float32 logits `[..., V]` from `x [..., D]` and `lm_head [D, V]`."""
    return jnp.einsum("...D,DV->...V", x.astype(lm_head.dtype), lm_head, preferred_element_type=jnp.float32)


def _student_logits(o: jax.Array, lm_head: jax.Array, student_proj: jax.Array | None) -> jax.Array:
    """float32 student logits `[nh, ..., V]` of head outputs `o [nh, ..., D]`: through the shared frozen
    `lm_head [D, V]` (Clover-2), or through each head's own trainable projection `student_proj [nh, D, V]`
    (Medusa), or one `[D', V]` projection shared by all steps (ReDrafter, whose outputs are D' = 2D wide)."""
    if student_proj is None:
        return _logits(o, lm_head)
    if student_proj.ndim == 2:  # one projection shared by every step (ReDrafter)
        return _logits(o, student_proj)
    return jnp.einsum("n...D,nDV->n...V", o.astype(student_proj.dtype), student_proj,
                      preferred_element_type=jnp.float32)


def label_in_top(probs: jax.Array, labels: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Reference `get_id_mask`: is `labels [...]` among the top-k of `probs [..., V]`, keeping the
    sorted entries whose cumulative mass *before* them is <= top_p (so the first always stays)."""
    vals, idx = jax.lax.top_k(probs, top_k)  # [..., k] descending
    keep = (jnp.cumsum(vals, axis=-1) - vals) <= top_p
    return jnp.any(keep & (idx == labels[..., None]), axis=-1)


def next_token_labels(tokens: jax.Array, valid: jax.Array, vocab_ids: jax.Array | None = None) -> jax.Array:
    """`[B, T]` int32: at t the index of x_{t+1} among the student's vocabulary columns (`vocab_ids`, sorted;
    None: the token id itself), -1 where x_{t+1} is padding (`valid [B, T]`) or past the end, or outside the
    draft vocabulary. The targets of the hard-label cross-entropy (`LossConfig.hard_labels`): the teacher
    position t predicts x_{t+1}."""
    b = tokens.shape[0]
    y = jnp.concatenate([tokens[:, 1:], jnp.full((b, 1), -1, tokens.dtype)], axis=1).astype(jnp.int32)
    valid_next = jnp.concatenate([valid[:, 1:].astype(bool), jnp.zeros((b, 1), bool)], axis=1)
    y = jnp.where(valid_next, y, -1)
    if vocab_ids is None:
        return y
    ids = jnp.asarray(vocab_ids, jnp.int32)
    pos = jnp.clip(jnp.searchsorted(ids, y), 0, ids.shape[0] - 1).astype(jnp.int32)
    return jnp.where((y >= 0) & (ids[pos] == y), pos, -1)


def _hard_ce(s_logp: jax.Array, labels: jax.Array) -> jax.Array:
    """`-log q(label)` `[...]` from `s_logp [..., V]` and `labels [...]` (-1: 0)."""
    picked = jnp.take_along_axis(s_logp, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(labels >= 0, -picked, 0.0)


def _vocab_terms(outputs, h, y, lm_head, cfg: LossConfig, student_proj=None, labels=None):
    """V-sized per-position terms, chunked over positions.

    Returns (ce [nh, B, T] float32, match [nh, B, T] bool (student argmax == teacher argmax, or == the label),
    cor [B, T] bool (label mask before accumulation over heads), has [nh, B, T] bool (a target exists: always
    with soft targets, where the label is >= 0 with `labels`)).
    """
    nh, b, t, _ = outputs.shape
    c = t if not cfg.vocab_chunk else min(cfg.vocab_chunk, t)
    n_chunks = math.ceil(t / c)
    t_pad = n_chunks * c
    o_pad = jnp.pad(outputs, ((0, 0), (0, 0), (0, t_pad - t), (0, 0)))  # [nh, B, T_pad, D]
    h_pad = jnp.pad(h, ((0, 0), (0, t_pad + nh - t), (0, 0)))  # [B, T_pad + nh, D]
    y_pad = jnp.pad(y, ((0, 0), (0, t_pad - t)))  # [B, T_pad]
    l_pad = None if labels is None else jnp.pad(labels, ((0, 0), (0, t_pad + nh - t)), constant_values=-1)
    lm_head = jax.lax.stop_gradient(lm_head)

    def chunk(start):
        # teacher logits at positions start .. start + c + nh - 1 (a halo of nh for heads 0..nh-1)
        hw = jax.lax.dynamic_slice_in_dim(h_pad, start, c + nh, axis=1)  # [B, C+nh, D]
        t_logits = jax.lax.stop_gradient(_logits(hw, lm_head))  # [B, C+nh, V]
        t_prob = jax.nn.softmax(t_logits, axis=-1)
        t_arg = jnp.argmax(t_logits, axis=-1)  # [B, C+nh]
        ow = jax.lax.dynamic_slice_in_dim(o_pad, start, c, axis=2)  # [nh, B, C, D]
        s_logp = jax.nn.log_softmax(_student_logits(ow, lm_head, student_proj), axis=-1)  # [nh, B, C, V]
        p_tgt = jnp.stack([t_prob[:, 1 + i:1 + i + c] for i in range(nh)])  # P_{t+i}: [nh, B, C, V]
        if l_pad is None:
            ce = -jnp.sum(p_tgt * s_logp, axis=-1)  # [nh, B, C]
            tgt_arg = jnp.stack([t_arg[:, 1 + i:1 + i + c] for i in range(nh)])  # [nh, B, C]
            has = jnp.ones(tgt_arg.shape, bool)
        else:  # the data's token x_{t+2+i} (the label of teacher position t+1+i)
            lw = jax.lax.dynamic_slice_in_dim(l_pad, start, c + nh, axis=1)  # [B, C+nh]
            tgt_arg = jnp.stack([lw[:, 1 + i:1 + i + c] for i in range(nh)])  # [nh, B, C]
            ce, has = _hard_ce(s_logp, tgt_arg), tgt_arg >= 0
        match = jnp.argmax(s_logp, axis=-1) == tgt_arg
        if cfg.label_mask:
            yw = jax.lax.dynamic_slice_in_dim(y_pad, start, c, axis=1)  # x_{t+1}: [B, C]
            cor = label_in_top(t_prob[:, :c], yw, cfg.label_mask_topk or t_prob.shape[-1], cfg.label_mask_topp or 1.0)
        else:
            cor = jnp.ones((b, c), bool)
        return ce, match, cor, has

    if n_chunks == 1:
        ce, match, cor, has = chunk(0)
        return ce[:, :, :t], match[:, :, :t], cor[:, :t], has[:, :, :t]
    starts = jnp.arange(n_chunks, dtype=jnp.int32) * c
    ce, match, cor, has = jax.lax.map(jax.checkpoint(chunk), starts)  # leading [n_chunks]
    merge = lambda x: jnp.moveaxis(x, 0, -2).reshape(*x.shape[1:-1], t_pad)[..., :t]  # noqa: E731
    return merge(ce), merge(match), merge(cor), merge(has)


def _regression(outputs: jax.Array, h: jax.Array) -> jax.Array:
    """`[nh, B, T]` SmoothL1 of head i's output at t to h_{t+1+i}, averaged over D; zeros when the outputs do
    not live in the base's hidden space (a ReDrafter head's 2D-wide outputs: its loss has no regression term)."""
    nh = outputs.shape[0]
    if outputs.shape[-1] != h.shape[-1]:
        return jnp.zeros(outputs.shape[:-1], jnp.float32)
    targets = jnp.stack([_shift(h, 1 + i) for i in range(nh)]).astype(jnp.float32)  # h_{t+1+i}
    return jnp.mean(smooth_l1(outputs.astype(jnp.float32), targets), axis=-1)


def kd_loss(outputs: jax.Array, teacher_hidden: jax.Array, tokens: jax.Array, loss_mask: jax.Array,
            valid: jax.Array, lm_head: jax.Array, cfg: LossConfig = LossConfig(), student_proj=None, labels=None):
    """The Clover-2 loss from head outputs and base outputs (no model needed).

    Args:
      outputs: `[num_heads, B, T, D]` head outputs o^i_t (after head_norm), as
        `Clover2Head.train_outputs` returns them (entries with t >= T - i are ignored).
      teacher_hidden: `[B, T, D]` the base's post-final-norm hidden states h_t (aligned with tokens).
      tokens: `[B, T]` the sequence x (used by the label mask only).
      loss_mask: `[B, T]` 1 on trained (assistant) positions; valid: `[B, T]` right-padding mask.
      lm_head: `[D, V]` frozen output projection (the teacher's; the student's too unless `student_proj`).
      student_proj: optional `[num_heads, D, V]` per-head trainable output projections (Medusa), or one
        `[D', V]` shared by every head (ReDrafter).
      labels: with `cfg.hard_labels`, `next_token_labels(tokens, valid, vocab_ids)` `[B, T]` (default: over all V):
        the cross-entropy and accuracy are then against the data's tokens, positions without a label skipped.

    Returns:
      `(loss, metrics)`; metrics hold per-head arrays `[num_heads]`: vloss, ploss, acc (top-1 vs the
      teacher argmax under the mask), chain_acc (head k counted only when heads 0..k are all right
      at the same start position), correct, chain_correct, mask_count (after the label mask) and
      loss_mask_count (before it); plus the scalar loss.
    """
    nh, b, t, _ = outputs.shape
    valid = valid.astype(bool)
    h = jax.lax.stop_gradient(teacher_hidden)
    y = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)  # x_{t+1}
    lm = trained_positions(loss_mask, valid)  # [B, T]; the target h_{t+1} exists

    if cfg.hard_labels and labels is None:
        labels = next_token_labels(tokens, valid)
    ce, match, cor, has = _vocab_terms(outputs, h, y, lm_head, cfg, student_proj,
                                       labels if cfg.hard_labels else None)
    base_masks = [_shift(lm, i) for i in range(nh)]  # m^i_t = lm[t+i]
    masks, lbl = [], cor
    for i in range(nh):
        if i > 0:
            lbl = lbl & _shift(cor, i)  # prod_{j<=i} cor[t+j]
        masks.append(base_masks[i] & lbl if cfg.label_mask else base_masks[i])
    m = jnp.stack(masks) & has  # [nh, B, T]

    vl = _regression(outputs, h)  # [nh, B, T]
    count = jnp.sum(m, axis=(1, 2)).astype(jnp.float32)  # [nh]
    vloss = jnp.sum(jnp.where(m, vl, 0.0), axis=(1, 2)) / (count + 1)
    ploss = jnp.sum(jnp.where(m, ce, 0.0), axis=(1, 2)) / (count + 1)
    weights = cfg.head_weight * cfg.decay ** jnp.arange(nh, dtype=jnp.float32)
    loss = jnp.sum(weights * (cfg.v_weight * vloss + cfg.p_weight * ploss))

    chain = jnp.cumprod(match.astype(jnp.int32), axis=0).astype(bool)  # heads 0..k all right
    correct = jnp.sum(m & match, axis=(1, 2)).astype(jnp.float32)
    chain_correct = jnp.sum(m & chain, axis=(1, 2)).astype(jnp.float32)
    metrics = {
        "loss": loss,
        "vloss": vloss,
        "ploss": ploss,
        "acc": correct / jnp.maximum(count, 1),
        "chain_acc": chain_correct / jnp.maximum(count, 1),
        "correct": correct,
        "chain_correct": chain_correct,
        "mask_count": count,
        "loss_mask_count": jnp.stack([jnp.sum(x) for x in base_masks]).astype(jnp.float32),
        "p_count": count,
        "chain_count": count,
    }
    return loss, metrics


def trained_positions(loss_mask, valid):
    """`lm [B, T]` bool: positions whose next position exists and is trained (`kd_loss`'s base mask)."""
    valid = valid.astype(bool)
    valid_next = jnp.concatenate([valid[:, 1:], jnp.zeros((valid.shape[0], 1), bool)], axis=1)
    return loss_mask.astype(bool) & valid & valid_next


def kd_loss_packed(outputs: jax.Array, teacher_hidden: jax.Array, loss_mask: jax.Array, valid: jax.Array,
                   lm_head: jax.Array, index: jax.Array, cfg: LossConfig = LossConfig(), student_proj=None,
                   labels=None):
    """`kd_loss` with the V-sized terms computed only at listed positions (vocabulary packing); `student_proj`
    as in `kd_loss`.

    The regression term runs over every trained position as in `kd_loss`. The soft cross-entropy and the
    accuracies run over `index [B, M]`: per row, M trained positions u (`lm[u]`, -1 = empty slot). Head i
    is scored at start t = u - i against the teacher P_u = softmax(W_lm h_{u+1}), so one teacher
    softmax serves every head and the cost is M (not T) positions per row: on chat data most positions
    are prompt or padding, which the dense path computes and masks out. With every trained position
    listed the loss equals `kd_loss`'s; with a random subset of them (`pack_positions`) the
    cross-entropy is the same objective estimated on that subset, normalised by its own count.

    Returns `(loss, metrics)` as `kd_loss`, plus `p_count [num_heads]` (the cross-entropy's count).
    The label mask is not supported here (it needs the teacher at every position). `cfg.hard_labels` needs
    `labels` (`next_token_labels`), as `kd_loss`.
    """
    if cfg.hard_labels and labels is None:
        raise ValueError("hard_labels: pass labels=next_token_labels(tokens, valid, vocab_ids)")
    if cfg.label_mask:
        raise ValueError("the label mask needs the teacher at every position; use the dense loss "
                         "(loss.vocab_positions_per_row = 0) with it")
    nh, b, t, _ = outputs.shape
    h = jax.lax.stop_gradient(teacher_hidden)
    lm = trained_positions(loss_mask, valid)
    m = jnp.stack([_shift(lm, i) for i in range(nh)])  # m^i_t = lm[t+i]
    vl = _regression(outputs, h)  # [nh, B, T]
    count = jnp.sum(m, axis=(1, 2)).astype(jnp.float32)
    vloss = jnp.sum(jnp.where(m, vl, 0.0), axis=(1, 2)) / (count + 1)

    lm_head = jax.lax.stop_gradient(lm_head)
    index = index.astype(jnp.int32)
    u = jnp.clip(index, 0, t - 1)
    listed = (index >= 0) & jnp.take_along_axis(lm, u, axis=1)  # [B, M]
    take = lambda x, pos: jnp.take_along_axis(x, pos[..., None], axis=1)  # noqa: E731  [B, M, D]
    t_logits = jax.lax.stop_gradient(_logits(take(h, jnp.minimum(u + 1, t - 1)), lm_head))  # [B, M, V]
    t_prob = jax.nn.softmax(t_logits, axis=-1)
    t_arg = jnp.argmax(t_logits, axis=-1)  # [B, M]
    starts = jnp.stack([u - i for i in range(nh)])  # [nh, B, M]
    pm = listed[None] & (starts >= 0)  # head i at t = u - i inside the row
    o = jnp.stack([take(outputs[i], jnp.maximum(starts[i], 0)) for i in range(nh)])  # [nh, B, M, D]
    s_logp = jax.nn.log_softmax(_student_logits(o, lm_head, student_proj), axis=-1)  # [nh, B, M, V]
    if cfg.hard_labels:  # the data's token after the teacher position u + 1
        t_arg = jnp.take_along_axis(labels.astype(jnp.int32), jnp.minimum(u + 1, t - 1), axis=1)  # [B, M]
        t_arg = jnp.where(u + 1 < t, t_arg, -1)
        ce = _hard_ce(s_logp, jnp.broadcast_to(t_arg[None], s_logp.shape[:-1]))
        pm = pm & (t_arg >= 0)[None]
    else:
        ce = -jnp.sum(t_prob[None] * s_logp, axis=-1)  # [nh, B, M]
    match = pm & (jnp.argmax(s_logp, axis=-1) == t_arg[None])
    p_count = jnp.sum(pm, axis=(1, 2)).astype(jnp.float32)
    ploss = jnp.sum(jnp.where(pm, ce, 0.0), axis=(1, 2)) / (p_count + 1)
    weights = cfg.head_weight * cfg.decay ** jnp.arange(nh, dtype=jnp.float32)
    loss = jnp.sum(weights * (cfg.v_weight * vloss + cfg.p_weight * ploss))

    # chained accuracy needs every head at the same start t: scatter the scores back to [nh, B, T]
    rows = jnp.arange(b)[:, None]
    dense = lambda x: jnp.stack([jnp.zeros((b, t), bool).at[rows, jnp.where(pm[i], starts[i], t)].set(  # noqa: E731
        x[i], mode="drop") for i in range(nh)])
    scored, right = dense(pm), dense(match)
    chain_scored = jnp.cumprod(scored.astype(jnp.int32), axis=0)
    chain_right = jnp.cumprod(right.astype(jnp.int32), axis=0)
    correct = jnp.sum(match, axis=(1, 2)).astype(jnp.float32)
    chain_correct = jnp.sum(chain_right, axis=(1, 2)).astype(jnp.float32)
    chain_count = jnp.sum(chain_scored, axis=(1, 2)).astype(jnp.float32)
    metrics = {
        "loss": loss,
        "vloss": vloss,
        "ploss": ploss,
        "acc": correct / jnp.maximum(p_count, 1),
        "chain_acc": chain_correct / jnp.maximum(chain_count, 1),
        "correct": correct,
        "chain_correct": chain_correct,
        "mask_count": count,
        "p_count": p_count,
        "chain_count": chain_count,
        "loss_mask_count": count,
    }
    return loss, metrics


def anchored_kd_loss(outputs: jax.Array, teacher_hidden: jax.Array, loss_mask: jax.Array, valid: jax.Array,
                     lm_head: jax.Array, anchors: jax.Array, cfg: LossConfig = LossConfig(), labels=None):
    """The distillation loss of a head that drafts a whole block from one anchor, computed at sampled anchors only:
    `outputs [C, B, M, D]` are the head's outputs at the anchors `anchors [B, M]` (trained positions s, -1 = empty
    slot: `pack_positions`), and output k at anchor s is scored, as head k at start s in `kd_loss`, against the
    teacher softmax(W_lm h_{s+1+k}) where position s + k is trained. So the terms are `kd_loss`'s at the anchors'
    starts; a block is computed per anchor, not per position (`kd_loss_packed` samples the scored positions u and
    needs every start u - k). Starts that are not themselves trained positions (the last prompt positions, whose
    blocks reach into the reply) are not anchors. With gradient accumulation the big-batch normaliser is
    `kd_loss_packed`'s count, which differs from this loss's by those starts.

    Returns `(loss, metrics)` with `kd_loss_packed`'s keys; the regression term is 0 (`vloss`)."""
    if cfg.label_mask:
        raise ValueError("the label mask needs the teacher at every position; use the dense loss "
                         "(loss.vocab_positions_per_row = 0) with it")
    if cfg.hard_labels and labels is None:
        raise ValueError("hard_labels: pass labels=next_token_labels(tokens, valid, vocab_ids)")
    c, b, m, _ = outputs.shape
    t = teacher_hidden.shape[1]
    h = jax.lax.stop_gradient(teacher_hidden)
    lm = trained_positions(loss_mask, valid)  # [B, T]
    lm_head = jax.lax.stop_gradient(lm_head)
    anchors = anchors.astype(jnp.int32)
    a = jnp.clip(anchors, 0, t - 1)
    listed = (anchors >= 0) & jnp.take_along_axis(lm, a, axis=1)  # [B, M]
    pos = a[None] + jnp.arange(c, dtype=jnp.int32)[:, None, None]  # [C, B, M]: s + k, the position scored
    at = jnp.clip(pos, 0, t - 1)
    row_take = jax.vmap(lambda x, p: jnp.take_along_axis(x, p, axis=1), in_axes=(None, 0))  # over C
    pm = listed[None] & (pos + 1 < t) & row_take(lm, at)  # [C, B, M]
    teacher = jax.vmap(lambda p: jnp.take_along_axis(h, jnp.minimum(p + 1, t - 1)[..., None], axis=1))(at)
    t_logits = jax.lax.stop_gradient(_logits(teacher, lm_head))  # [C, B, M, V]
    t_arg = jnp.argmax(t_logits, axis=-1)  # [C, B, M]
    s_logp = jax.nn.log_softmax(_logits(outputs, lm_head), axis=-1)  # [C, B, M, V]
    if cfg.hard_labels:  # the data's token after the teacher position s + k + 1
        t_arg = jnp.where(pos + 1 < t, row_take(labels.astype(jnp.int32), jnp.minimum(at + 1, t - 1)), -1)
        ce = _hard_ce(s_logp, t_arg)
        pm = pm & (t_arg >= 0)
    else:
        ce = -jnp.sum(jax.nn.softmax(t_logits, axis=-1) * s_logp, axis=-1)  # [C, B, M]
    right = pm & (jnp.argmax(s_logp, axis=-1) == t_arg)
    p_count = jnp.sum(pm, axis=(1, 2)).astype(jnp.float32)  # [C]
    ploss = jnp.sum(jnp.where(pm, ce, 0.0), axis=(1, 2)) / (p_count + 1)
    weights = cfg.head_weight * cfg.decay ** jnp.arange(c, dtype=jnp.float32)
    loss = jnp.sum(weights * cfg.p_weight * ploss)
    # chained accuracy: outputs 0..k all right at the same anchor
    chain_scored = jnp.cumprod(pm.astype(jnp.int32), axis=0)
    chain_right = jnp.cumprod(right.astype(jnp.int32), axis=0)
    correct = jnp.sum(right, axis=(1, 2)).astype(jnp.float32)
    chain_correct = jnp.sum(chain_right, axis=(1, 2)).astype(jnp.float32)
    chain_count = jnp.sum(chain_scored, axis=(1, 2)).astype(jnp.float32)
    zero = jnp.zeros((c,), jnp.float32)
    metrics = {"loss": loss, "vloss": zero, "ploss": ploss, "acc": correct / jnp.maximum(p_count, 1),
               "chain_acc": chain_correct / jnp.maximum(chain_count, 1), "correct": correct,
               "chain_correct": chain_correct, "mask_count": p_count, "p_count": p_count, "chain_count": chain_count,
               "loss_mask_count": p_count}
    return loss, metrics


def pack_positions(loss_mask, valid, per_row: int, rng=None):
    """Host side: `index [B, per_row]` int32 of trained positions per row (`trained_positions`), for
    `kd_loss_packed`. Rows with more than `per_row` of them keep a uniformly random subset (sorted) drawn
    from `rng` (a `numpy.random.Generator`, or a list of one per row; None keeps the first ones); -1 fills the
    rest."""

    loss_mask, valid = np.asarray(loss_mask, bool), np.asarray(valid, bool)
    valid_next = np.pad(valid[:, 1:], ((0, 0), (0, 1)))
    lm = loss_mask & valid & valid_next
    out = np.full((lm.shape[0], per_row), -1, np.int32)
    for r, row in enumerate(lm):
        pos = np.flatnonzero(row)
        if len(pos) > per_row:
            gen = rng[r] if isinstance(rng, (list, tuple)) else rng
            pos = np.sort(gen.choice(pos, per_row, replace=False)) if gen is not None else pos[:per_row]
        out[r, :len(pos)] = pos
    return out


def output_projection(base: Llama, vocab_ids: jax.Array | None = None) -> jax.Array:
    """The frozen `[D, V]` lm_head, or its `[D, Q]` columns `vocab_ids` (a draft vocabulary).

    With a draft vocabulary both distributions of the cross-entropy live on those Q tokens: the teacher's
    is P restricted to them and renormalised, the student's a softmax over Q logits, which is what the
    head is asked for when it drafts from that vocabulary (`draft_vocab=` at inference). Every draft
    depth's vocabulary projection then costs Q/V of the full one in training as in drafting."""
    if vocab_ids is None:
        return base.lm_head_matrix()
    return base.lm_head_rows(jnp.asarray(vocab_ids, jnp.int32)).T


def uniform_feature_noise(rng: jax.Array, valid: jax.Array, dim: int, std: float) -> jax.Array:
    """`[B, T, D]` EAGLE's training noise on input features (SafeAILab/EAGLE v1 `AddUniformNoise`): uniform in
    `(-a/2, a/2)` with `a = std * 512 / length`, `length` each row's number of valid positions (the reference
    scales by the example's sequence length); 0 on padding."""
    length = jnp.maximum(valid.sum(axis=1), 1).astype(jnp.float32)  # [B]
    u = jax.random.uniform(rng, valid.shape + (dim,), jnp.float32) - 0.5  # [B, T, D]
    return jnp.where(valid[..., None], u * (std * 512.0 / length)[:, None, None], 0.0)


def base_features(base: Llama, tokens: jax.Array, valid: jax.Array, taps: tuple[int, ...] = ()) -> jax.Array:
    """The frozen base's pre-final-norm last-layer hidden states f `[B, T, D]` of right-padded `tokens`; with
    `taps` `[B, T, (n + 1) D]`: those layers' outputs, then the last layer's (`Llama.forward_hidden`)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    f, _, _ = base.forward_hidden(tokens, positions, causal_mask(valid.astype(bool)), taps=taps)
    return f
