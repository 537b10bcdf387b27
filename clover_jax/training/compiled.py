"""A config's training step lowered and compiled on abstract weights: nothing loaded, nothing allocated.

    step = lower_training_step(cfg, base_config, mesh)      # jax `Lowered` of the step on the config's shapes
    prog = compile_training_step(cfg, base_config, mesh)    # `clover_jax.tpu.CompiledProgram`: per-device memory

The step is the one `Trainer` runs (`clover_jax.training.steps.build_steps`, the same shardings): the frozen base
and the head as `ShapeDtypeStruct`s placed by `clover_jax.parallel`'s rules, a batch of `data.batch_size` rows of
`data.max_length` tokens (the longest bucket), with the config's remat, gradient accumulation, loss and draft
vocabulary. On a mesh of compile-only TPU devices (`clover_jax.tpu.slice_mesh`) the TPU compiler says what a step
holds per chip before any TPU is rented.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from clover_jax import parallel, tpu
from clover_jax.heads import registry
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import Llama
from clover_jax.training import steps as steps_lib
from clover_jax.training.config import ConfigError
from clover_jax.training.memory import check_sequence_length

SETTINGS = ("lower data.batch_size or data.max_length, raise mesh.fsdp (or mesh.tp), set train.remat=true or "
            "optim.grad_accum, or choose a larger slice")


def _graph_and_state(make) -> tuple[Any, Any]:
    graphdef, state = nnx.split(nnx.eval_shape(make))
    return graphdef, nnx.to_pure_dict(state)


def abstract_training(cfg, base_config: LlamaConfig, mesh) -> tuple[Any, tuple[Any, ...]]:
    """(the jitted train step, its abstract arguments on `mesh`) for `cfg` on a base of `base_config`."""
    check_sequence_length(cfg, base_config)
    shards = parallel.batch_divisor(mesh)
    if cfg.data.batch_size % shards or (cfg.data.batch_size // cfg.optim.grad_accum) % shards:
        raise ConfigError(f"data.batch_size: {cfg.data.batch_size} rows (micro-batches of "
                          f"{cfg.data.batch_size // cfg.optim.grad_accum}) cannot be split over the mesh's "
                          f"data*fsdp = {shards} batch shards; use a multiple")
    dtype, param_dtype = steps_lib.DTYPES[cfg.model.dtype], steps_lib.DTYPES[cfg.model.param_dtype]
    head_type = registry.get(cfg.head.type)
    head_cfg = steps_lib.head_config(cfg)
    base_graph, base_state = _graph_and_state(
        lambda: Llama(base_config, rngs=nnx.Rngs(0), param_dtype=param_dtype, dtype=dtype))
    head_graph, params = _graph_and_state(lambda: head_type.module_cls(base_config, head_cfg, rngs=nnx.Rngs(0)))
    tx, schedule = steps_lib.make_optimizer(cfg.optim, cfg.total_steps)
    opt_state = jax.eval_shape(tx.init, params)
    param_sh, opt_sh = parallel.model_shardings(params, mesh), parallel.model_shardings(opt_state, mesh)
    base_sh = parallel.model_shardings(base_state, mesh)
    vocab_ids = None
    if cfg.loss.draft_vocab:  # the ids' values do not change the program, only their count
        vocab_ids = jnp.arange(cfg.train.draft_vocab_size or base_config.vocab_size, dtype=jnp.int32)
    taps = head_type.base_feature_layers(head_cfg)
    train_step, _ = steps_lib.build_steps(
        head_graph, base_graph, tx, cfg.loss, cfg.head.num_heads, grad_accum=cfg.optim.grad_accum,
        schedule=schedule, mesh=mesh, param_shardings=param_sh, opt_shardings=opt_sh, base_shardings=base_sh,
        vocab_ids=vocab_ids, noise_seed=cfg.train.seed, taps=taps)
    batch = abstract_batch(cfg, base_config, parallel.batch_sharding(mesh), len(taps))
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=parallel.replicated(mesh))
    args = (tpu.abstract(params, param_sh), tpu.abstract(opt_state, opt_sh), tpu.abstract(base_state, base_sh),
            batch, step)
    return train_step, args


def abstract_batch(cfg, base_config: LlamaConfig, rows: NamedSharding, taps: int,
                   length: int | None = None) -> dict[str, Any]:
    """The step's batch of `data.batch_size` rows of `length` tokens (default `data.max_length`, the longest
    bucket) as `ShapeDtypeStruct`s on the batch sharding `rows`, as `Trainer.device_batch` makes it from the data's
    rows. `taps`: the base layers whose features the head reads (for `train.cache_features`)."""
    b, t = cfg.data.batch_size, length or cfg.data.max_length
    batch = {"tokens": jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rows),  # [B, T]
             "loss_mask": jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rows),  # [B, T]
             "valid": jax.ShapeDtypeStruct((b, t), jnp.bool_, sharding=rows)}  # [B, T]
    if cfg.loss.vocab_positions_per_row:  # [B, K]
        batch["loss_index"] = jax.ShapeDtypeStruct((b, cfg.loss.vocab_positions_per_row), jnp.int32, sharding=rows)
    if cfg.train.cache_features:  # the base's cached features, stored in bfloat16: [B, T, (n + 1) D]
        width = (taps + 1) * base_config.hidden_size
        batch["features"] = jax.ShapeDtypeStruct((b, t, width), jnp.bfloat16, sharding=rows)
    return batch


def lower_training_step(cfg, base_config: LlamaConfig, mesh):
    """The training step of `cfg` lowered on abstract arguments (a jax `Lowered`)."""
    train_step, args = abstract_training(cfg, base_config, mesh)
    return train_step.lower(*args)


def compile_training_step(cfg, base_config: LlamaConfig, mesh) -> tpu.CompiledProgram:
    """The training step of `cfg` compiled for `mesh`'s devices (compile-only TPU devices, or the devices of this
    machine), with what the compiler reports per device."""
    train_step, args = abstract_training(cfg, base_config, mesh)
    return tpu.compile_program("training step", train_step, *args)


__all__ = ["SETTINGS", "abstract_batch", "abstract_training", "compile_training_step", "lower_training_step"]
