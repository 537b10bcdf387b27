"""The pure pieces of training: optimizer + schedule, and the jitted train/eval steps.

Functional NNX: the head is `nnx.split` once into a graphdef (static, closed over) and a pure dict of
float32 parameters; the frozen base model likewise. A step takes
`(head_params, opt_state, base_state, batch, step)` and returns `(head_params', opt_state', metrics)`;
only the head parameters are differentiated (the base state is a non-differentiated argument, so its
forward runs in the same XLA program and no base gradient or residual exists).

Gradient accumulation (`grad_accum = A > 1`): an explicit `lax.scan` over A micro-batches inside the
one jitted step, summing gradients. The Clover-2 loss normalises each head's sum by the mask count of
the *whole batch* (`sum_t m / (count + 1)`), so averaging per-micro-batch losses (what
`optax.MultiSteps` does) would weight micro-batches unevenly. Instead each micro-batch contributes
`sum_i w_i (v_weight SV_ij + p_weight SP_ij) / (N_i + 1)` where SV/SP are its un-normalised sums and
N_i the head's count over the whole batch (computable from the masks before any forward), so the
accumulated loss and gradient equal those of one big batch up to float rounding. With the optional
label mask the counts depend on the teacher, so each micro-batch is then normalised by its own count
and the gradients are averaged (the MultiSteps semantics); logged metrics are exact either way.

Micro-batch j holds rows j, j + A, j + 2A, ... of the global batch, so each device's rows spread evenly
over micro-batches (no resharding when (B / A) is a multiple of the data*fsdp shards).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from clover_jax.heads import registry
from clover_jax.heads.losses import base_features, trained_positions
from clover_jax.parallel import BATCH_AXES
from clover_jax.training.config import LossConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# XLA:CPU's YNNPACK fusions hold buffers outside XLA's buffer assignment (which `Compiled.memory_analysis`, and so the
# memory check, cannot see) and made no training step faster where measured (docs/training.md): on CPU devices the
# training programs compile without them.
CPU_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def compiler_options(mesh=None) -> dict[str, str] | None:
    """The XLA options the training programs compile with on `mesh`'s devices (default: JAX's first device)."""
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    return dict(CPU_COMPILER_OPTIONS) if device.platform == "cpu" else None


SUM_KEYS = ("v_sum", "p_sum", "correct", "chain_correct", "count", "p_count", "chain_count")


# ------------------------------------------------------------------------------------------- config maps
def head_config(cfg):
    """The head's config (of the registered type `cfg.head.type`) from an `ExperimentConfig`: parameters in float32,
    computed in `train.compute_dtype`."""
    return cfg.head.head_config(DTYPES[cfg.train.compute_dtype], cfg.train.remat)


def make_schedule(optim_cfg, total_steps: int) -> optax.Schedule:
    """Linear warm-up from 0 to `lr` over `warmup_steps`, then linear (to 0 at `total_steps`), cosine or
    constant. Linear matches `transformers.get_linear_schedule_with_warmup` (the reference)."""
    o = optim_cfg
    warm = int(o.warmup_steps)
    rest = max(int(total_steps) - warm, 1)
    if o.schedule == "constant":
        decay = optax.constant_schedule(o.lr)
    elif o.schedule == "cosine":
        decay = optax.cosine_decay_schedule(o.lr, rest)
    else:
        decay = optax.linear_schedule(o.lr, 0.0, rest)
    if warm == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, o.lr, warm), decay], [warm])


def make_optimizer(optim_cfg, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """`chain(clip(clip_value), clip_by_global_norm(clip_norm), adamw(schedule, b1, b2, eps, weight_decay))`: clip
    *by value* (the Clover-2 reference's `clip_grad_value_`) and/or by global norm (HF Trainer's `max_grad_norm`),
    weight decay on every head parameter (torch AdamW default param group)."""
    o = optim_cfg
    schedule = make_schedule(o, total_steps)
    parts = [optax.clip(o.clip_value)] if o.clip_value else []
    if getattr(o, "clip_norm", None):
        parts.append(optax.clip_by_global_norm(o.clip_norm))
    parts.append(optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay))
    return optax.chain(*parts), schedule


# ------------------------------------------------------------------------------------------------ losses
def head_counts(batch: dict[str, jax.Array], num_heads: int) -> tuple[jax.Array, jax.Array]:
    """`[num_heads]` counts of the loss terms (without label mask), from the batch alone: N_i of the
    regression, sum_b sum_{t >= i} lm[b, t] with lm = loss_mask & valid & valid[t+1] (`kd_loss`'s
    `mask_count`), and those of the cross-entropy (`p_count`: N_i again, or the listed positions u >= i
    when the batch carries a packed `loss_index`)."""
    lm = trained_positions(batch["loss_mask"], batch["valid"])  # [B, T]
    per_t = jnp.sum(lm.astype(jnp.float32), axis=0)  # [T]
    v_counts = jnp.stack([jnp.sum(per_t[i:]) for i in range(num_heads)])
    if "loss_index" not in batch:
        return v_counts, v_counts
    index = batch["loss_index"]
    listed = (index >= 0) & jnp.take_along_axis(lm, jnp.clip(index, 0, lm.shape[1] - 1), axis=1)
    p_counts = jnp.stack([jnp.sum(listed & (index >= i)) for i in range(num_heads)]).astype(jnp.float32)
    return v_counts, p_counts


def _sums(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Per-head un-normalised sums `[num_heads]` from `kd_loss` metrics (vloss = SV / (count + 1))."""
    c = jax.lax.stop_gradient(metrics["mask_count"])
    pc = jax.lax.stop_gradient(metrics["p_count"])
    return {"v_sum": metrics["vloss"] * (c + 1), "p_sum": metrics["ploss"] * (pc + 1),
            "correct": metrics["correct"], "chain_correct": metrics["chain_correct"], "count": c,
            "p_count": pc, "chain_count": jax.lax.stop_gradient(metrics["chain_count"])}


def head_weights(loss_cfg: LossConfig, num_heads: int) -> jax.Array:
    return loss_cfg.head_weight * loss_cfg.decay ** jnp.arange(num_heads, dtype=jnp.float32)


def metrics_from_sums(sums: dict[str, jax.Array], loss_cfg: LossConfig) -> dict[str, jax.Array]:
    """Batch-level loss/metrics from summed per-head sums (the big-batch formula of `kd_loss`)."""
    n, pn = sums["count"], sums["p_count"]
    vloss, ploss = sums["v_sum"] / (n + 1), sums["p_sum"] / (pn + 1)
    w = head_weights(loss_cfg, n.shape[0])
    return {"loss": jnp.sum(w * (loss_cfg.v_weight * vloss + loss_cfg.p_weight * ploss)),
            "vloss": vloss, "ploss": ploss, "acc": sums["correct"] / jnp.maximum(pn, 1),
            "chain_acc": sums["chain_correct"] / jnp.maximum(sums["chain_count"], 1), "count": n, "p_count": pn}


def _split_micro(batch: dict[str, jax.Array], accum: int, mesh=None) -> dict[str, jax.Array]:
    """`[B, T]` -> `[accum, B / accum, T]`, micro-batch j = rows j, j + accum, ... (batch axis kept sharded)."""
    def split(x):
        b = x.shape[0]
        y = jnp.swapaxes(x.reshape(b // accum, accum, *x.shape[1:]), 0, 1)  # [accum, B / accum, T]
        if mesh is None:
            return y
        return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, BATCH_AXES)))
    return {k: split(v) for k, v in batch.items()}


# ------------------------------------------------------------------------------------------------- steps
def make_loss_fn(head_graphdef, base_graphdef, loss_cfg: LossConfig, vocab_ids=None,
                 taps: tuple[int, ...] = ()) -> Callable:
    """(params, base_state, batch, rng=None) -> (loss, kd_loss metrics): the head type's loss
    (`HeadType.loss_from_features`), with the base run online or, when the batch carries `features` (the base's
    cached pre-norm hidden states), from those. `vocab_ids` (a draft vocabulary, or None for the full one)
    restricts the cross-entropy; `rng` draws `loss_cfg.feature_noise` (training steps only). `taps`: the base
    layers the head reads besides the last (`HeadType.base_feature_layers`): features `[B, T, (n + 1) D]`."""
    def forward(params, base_state, batch, rng=None):
        head = nnx.merge(head_graphdef, params)
        base = nnx.merge(base_graphdef, base_state)
        if "features" in batch:
            f = batch["features"].astype(base.dtype)  # stored in bfloat16; the online path's dtype
            width = (len(taps) + 1) * base.config.hidden_size
            if f.shape[-1] != width:  # trace time
                raise ValueError(f"the batch's cached base features are {f.shape[-1]} wide; the head reads "
                                 f"{width} (base layers {taps} and the last)")
        else:
            f = base_features(base, batch["tokens"], batch["valid"], taps)
        noise = {"rng": rng} if rng is not None and loss_cfg.feature_noise else {}  # training only
        return registry.of_head(head).loss_from_features(
            head, base, f, batch["tokens"], batch["loss_mask"], batch["valid"], loss_cfg,
            index=batch.get("loss_index"), vocab_ids=vocab_ids, **noise)
    return forward


def make_grad_fn(head_graphdef, base_graphdef, loss_cfg: LossConfig, num_heads: int,
                 grad_accum: int = 1, mesh=None, vocab_ids=None, taps: tuple[int, ...] = ()) -> Callable:
    """(params, base_state, batch, rng=None) -> (grads, sums): gradients of the big-batch loss w.r.t. the head
    params, accumulated over `grad_accum` micro-batches (see the module docstring), and per-head sums."""
    accum = int(grad_accum)
    exact = not loss_cfg.label_mask
    forward = make_loss_fn(head_graphdef, base_graphdef, loss_cfg, vocab_ids, taps)

    def micro_objective(params, base_state, mb, totals, rng):
        loss, m = forward(params, base_state, mb, rng)
        s = _sums(m)
        if exact:  # this micro-batch's share of the big-batch loss
            w = head_weights(loss_cfg, num_heads)
            v_tot, p_tot = totals
            loss = jnp.sum(w * (loss_cfg.v_weight * s["v_sum"] / (v_tot + 1)
                                + loss_cfg.p_weight * s["p_sum"] / (p_tot + 1)))
        else:
            loss = loss / accum
        return loss, s

    def grad_fn(params, base_state, batch, rng=None):
        if accum == 1:
            (_, m), grads = jax.value_and_grad(forward, has_aux=True)(params, base_state, batch, rng)
            return grads, _sums(m)
        totals = head_counts(batch, num_heads)
        vg = jax.value_and_grad(micro_objective, has_aux=True)

        def body(carry, xs):
            mb, i = xs
            g_acc, s_acc = carry
            (_, s), g = vg(params, base_state, mb, totals, None if rng is None else jax.random.fold_in(rng, i))
            return (jax.tree.map(jnp.add, g_acc, g), jax.tree.map(jnp.add, s_acc, s)), None

        zeros_g = jax.tree.map(jnp.zeros_like, params)
        zeros_s = {k: jnp.zeros((num_heads,), jnp.float32) for k in SUM_KEYS}
        xs = (_split_micro(batch, accum, mesh), jnp.arange(accum))
        (grads, sums), _ = jax.lax.scan(body, (zeros_g, zeros_s), xs)
        return grads, sums

    return grad_fn


def build_steps(head_graphdef, base_graphdef, tx: optax.GradientTransformation, loss_cfg: LossConfig,
                num_heads: int, *, grad_accum: int = 1, schedule: optax.Schedule | None = None,
                mesh=None, param_shardings=None, opt_shardings=None, base_shardings=None,
                donate: bool = True, return_grads: bool = False, vocab_ids=None,
                noise_seed: int = 0, taps: tuple[int, ...] = ()) -> tuple[Callable, Callable]:
    """(train_step, eval_step), jitted with explicit shardings when `mesh` is given.

    train_step(params, opt_state, base_state, batch, step) -> (params', opt_state', metrics)
      (+ the gradients as a 4th output with `return_grads`, for tests and debugging)
    eval_step(params, base_state, batch) -> per-head sums (v_sum, p_sum, correct, chain_correct, count) + tokens
    metrics: loss, vloss/ploss/acc/chain_acc/count `[num_heads]`, lr, grad_norm, tokens.
    """
    forward = make_loss_fn(head_graphdef, base_graphdef, loss_cfg, vocab_ids, taps)
    grad_fn = make_grad_fn(head_graphdef, base_graphdef, loss_cfg, num_heads, grad_accum, mesh, vocab_ids, taps)

    def train_step(params, opt_state, base_state, batch, step):
        # the feature noise of step `step`: the same on a resumed run as on an uninterrupted one
        rng = jax.random.fold_in(jax.random.key(noise_seed), step) if loss_cfg.feature_noise else None
        grads, sums = grad_fn(params, base_state, batch, rng)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = metrics_from_sums(sums, loss_cfg)
        metrics["grad_norm"] = optax.tree.norm(grads)
        metrics["lr"] = jnp.asarray(schedule(step) if schedule is not None else 0.0, jnp.float32)
        metrics["tokens"] = jnp.sum(batch["valid"].astype(jnp.float32))
        return (params, opt_state, metrics, grads) if return_grads else (params, opt_state, metrics)

    def eval_step(params, base_state, batch):
        _, m = forward(params, base_state, batch)
        sums = jax.lax.stop_gradient(_sums(m))
        sums["tokens"] = jnp.sum(batch["valid"].astype(jnp.float32))
        return sums

    options = compiler_options(mesh)
    if mesh is None:
        return (jax.jit(train_step, donate_argnums=(0, 1) if donate else (), compiler_options=options),
                jax.jit(eval_step, compiler_options=options))
    rep = NamedSharding(mesh, P())
    bsh = NamedSharding(mesh, P(BATCH_AXES))
    batch_sh = bsh  # a prefix: every batch array (tokens, masks, an optional loss_index) is split by rows
    train_jit = jax.jit(train_step, in_shardings=(param_shardings, opt_shardings, base_shardings, batch_sh, rep),
                        out_shardings=(param_shardings, opt_shardings, rep) + ((param_shardings,) if return_grads else ()),
                        donate_argnums=(0, 1) if donate else (), compiler_options=options)
    eval_jit = jax.jit(eval_step, in_shardings=(param_shardings, base_shardings, batch_sh), out_shardings=rep,
                       compiler_options=options)
    return train_jit, eval_jit


def summarize_eval(sums: list[dict[str, Any]], loss_cfg: LossConfig) -> dict[str, Any]:
    """Host-side aggregation of eval_step sums over batches -> exact held-out metrics (python floats)."""
    tot = {k: np.sum([np.asarray(s[k], np.float64) for s in sums], axis=0) for k in (*SUM_KEYS, "tokens")}
    m = metrics_from_sums({k: jnp.asarray(tot[k]) for k in SUM_KEYS}, loss_cfg)
    out = {k: np.asarray(v).tolist() for k, v in m.items()}
    out["tokens"] = float(tot["tokens"])
    out["batches"] = len(sums)
    return out
