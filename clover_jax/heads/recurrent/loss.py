"""The recurrent family's training loss (Clover-2, Clover-1, EAGLE-1): the head's teacher-forced outputs for every
drafted depth (`RecurrentHead.train_outputs`) distilled from the frozen base (`clover_jax.heads.losses.kd_loss`)."""

from __future__ import annotations

import jax

from clover_jax.heads.losses import (LossConfig, base_features, kd_loss, kd_loss_packed, next_token_labels,
                                     output_projection)
from clover_jax.models.llama import Llama, rms_norm


def loss_from_features(head, base: Llama, f: jax.Array, tokens: jax.Array, loss_mask: jax.Array,
                       valid: jax.Array, cfg: LossConfig = LossConfig(),
                       teacher_hidden: jax.Array | None = None, index: jax.Array | None = None,
                       vocab_ids: jax.Array | None = None, **outputs_kw):
    """The loss from precomputed base features (the reference's stored `hidden_state_onnorm` f and,
    optionally, `hidden_state` h; h defaults to RMSNorm_final(f)). With `index` (see `pack_positions`)
    the vocabulary terms are packed (`kd_loss_packed`); with `vocab_ids` they run over that draft
    vocabulary only (`output_projection`). `outputs_kw` go to the head's `train_outputs`."""
    f = jax.lax.stop_gradient(f)
    if teacher_hidden is None:
        teacher_hidden = rms_norm(f, jax.lax.stop_gradient(base.final_norm[...]), base.config.rms_norm_eps)
    outputs = head.train_outputs(base, f, tokens, valid, **outputs_kw)
    lm_head = output_projection(base, vocab_ids)
    labels = next_token_labels(tokens, valid, vocab_ids) if cfg.hard_labels else None
    if index is not None:
        return kd_loss_packed(outputs, teacher_hidden, loss_mask, valid, lm_head, index, cfg, labels=labels)
    return kd_loss(outputs, teacher_hidden, tokens, loss_mask, valid, lm_head, cfg, labels=labels)


def loss(head, base: Llama, tokens: jax.Array, loss_mask: jax.Array, valid: jax.Array,
         cfg: LossConfig = LossConfig(), index: jax.Array | None = None, vocab_ids: jax.Array | None = None):
    """Online self-distillation: runs the frozen base on `tokens [B, T]` (right padded by `valid`),
    then the head with teacher forcing, and returns `(loss, metrics)` (see `kd_loss`; `kd_loss_packed`
    when `index` is given)."""
    f = base_features(base, tokens, valid)
    return loss_from_features(head, base, f, tokens, loss_mask, valid, cfg, index=index, vocab_ids=vocab_ids)
