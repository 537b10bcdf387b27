"""Clover-2's training loss: the knowledge-distillation loss of `clover_jax.heads.losses` on the head's outputs
for every drafted depth, from the base model's precomputed features."""

from __future__ import annotations

from clover_jax.heads.losses import clover2_loss_from_features


def loss_from_features(head, base, f, tokens, loss_mask, valid, loss_cfg, *, index=None, vocab_ids=None):
    """(loss, metrics) of the head on features `f [B, T, D]` (the base's pre-norm hidden states) of `tokens [B, T]`."""
    return clover2_loss_from_features(head, base, f, tokens, loss_mask, valid, loss_cfg, index=index,
                                      vocab_ids=vocab_ids)
