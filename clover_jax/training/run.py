"""The training pipeline from an `ExperimentConfig`: mesh, base model, data, trainer, checkpoints.

    summary = run_experiment(load_config("configs/x.yaml"), resume=True)

Every piece can be passed in instead (tests use a tiny random base and synthetic batches).
"""

from __future__ import annotations

import itertools
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable

import jax

from clover_jax import parallel
from clover_jax.heads import registry
from clover_jax.heads.draft_vocab import (coverage, frequent_tokens, head_draft_vocab, load_draft_vocab,
                                         pad_draft_vocab, save_draft_vocab)
from clover_jax.io.loader import base_config_of, load_model_on_mesh
from clover_jax.training import data as data_lib
from clover_jax.training import steps as steps_lib
from clover_jax.training.checkpoint import Checkpointer, CheckpointError, head_metadata
from clover_jax.training.config import ConfigError, ExperimentConfig, config_to_dict, save_config
from clover_jax.training.features import attach_features
from clover_jax.training.memory import abstract_head_state, check_training_memory
from clover_jax.training.run_lock import take_run_lock
from clover_jax.training.self_distill import self_distilled_conversations
from clover_jax.training.trainer import Trainer, checkpoint_targets

log = logging.getLogger(__name__)


def load_base(cfg: ExperimentConfig, mesh) -> Any:
    """The config's base model (`LoadedModel`) in its dtypes, the weights placed on `mesh` as they are read."""
    return load_model_on_mesh(cfg.model.name_or_path, mesh, dtype=steps_lib.DTYPES[cfg.model.dtype],
                              param_dtype=steps_lib.DTYPES[cfg.model.param_dtype])


def build_data(cfg: ExperimentConfig, loaded, mesh=None, make_generate_fn=None) -> tuple[Any, list[dict[str, Any]]]:
    """(train batcher, held-out batches for evaluation) from `cfg.data` (see `clover_jax.training.data`).
    `data.self_distill` generates the base model's replies with `make_generate_fn` (see
    `clover_jax.training.self_distill.self_distilled_conversations`)."""
    if cfg.data.self_distill:  # the base model's own first-turn replies, generated once and cached on disk
        if make_generate_fn is None:
            raise ConfigError("data.self_distill: generating the base model's replies needs make_generate_fn= "
                              "(clover_jax.generation.replies.make_generate_fn; train.py passes it)")
        convs = self_distilled_conversations(cfg, loaded, make_generate_fn, progress=jax.process_index() == 0,
                                             mesh=mesh)
    else:
        convs = data_lib.load_conversations(cfg.data)
    train, held = data_lib.build_datasets(cfg.data, loaded.tokenizer, convs, progress=jax.process_index() == 0)
    _warn_small_data(cfg, train)
    kw = dict(process_index=jax.process_index(), process_count=jax.process_count())
    batcher = data_lib.BucketedBatcher(train, cfg.data.batch_size, cfg.data.bucket_boundaries, seed=cfg.data.seed,
                                       shuffle=cfg.data.shuffle, **kw)
    # the base layers the head reads besides the last: the cached features hold their outputs too
    taps = registry.get(cfg.head.type).base_feature_layers(steps_lib.head_config(cfg))
    if cfg.train.cache_features:
        attach_features(batcher, loaded.model, progress=jax.process_index() == 0,
                        cache_dir=cfg.train.feature_cache_dir, taps=taps)
    eval_batches: list[dict[str, Any]] = []
    if cfg.train.eval_every and len(held):
        held_batcher = data_lib.BucketedBatcher(held, cfg.data.batch_size, cfg.data.bucket_boundaries,
                                                seed=cfg.data.seed, shuffle=True, **kw)  # seeded: every evaluation
        # sees the same batches, drawn from all length buckets (unshuffled, the first ones are the shortest)
        if cfg.train.cache_features:
            attach_features(held_batcher, loaded.model, progress=False, cache_dir=cfg.train.feature_cache_dir,
                            taps=taps)
        limit = cfg.train.eval_batches or None
        eval_batches = list(itertools.islice(held_batcher.epoch_batches(0), limit))
    log.info("data: %d train / %d held-out examples, %d batches per epoch", len(train), len(held),
             batcher.batches_per_epoch)
    return batcher, eval_batches


def _warn_small_data(cfg: ExperimentConfig, train) -> None:
    """A warning naming both numbers when the batch is larger than the training set (batches are padded)."""
    if len(train) < cfg.data.batch_size:
        log.warning("data.batch_size=%d is larger than the %d training examples: every batch is padded with %d "
                    "empty rows; lower data.batch_size to at most %d or add data", cfg.data.batch_size, len(train),
                    cfg.data.batch_size - len(train), len(train))


def draft_vocab_of(dataset, size: int, eos_ids) -> tuple[Any, float]:
    """(ids, coverage): the `size` most frequent trained (loss-mask) tokens of `dataset` plus the EOS ids, and
    the share of the trained tokens they cover."""
    seqs = [ex.tokens[ex.loss_mask.astype(bool)] for ex in (dataset[i] for i in range(len(dataset)))]
    ids = frequent_tokens(seqs, size, always=list(eos_ids or ()))
    return ids, coverage(ids, seqs)


def run_draft_vocab(cfg, dataset, eos_ids) -> tuple[Any, float, str]:
    """(ids, coverage of the trained tokens, source) of a run's draft vocabulary: the one `train.draft_vocab_from`
    names (a draft_vocab.json file, or a head whose training vocabulary it keeps, e.g. the head a warm start
    continues), else the `train.draft_vocab_size` most frequent trained tokens of `dataset`."""
    src = cfg.train.draft_vocab_from
    if not src:
        ids, cov = draft_vocab_of(dataset, cfg.train.draft_vocab_size, eos_ids)
        return ids, cov, "trained tokens of the training set"
    ids = load_draft_vocab(src) if str(src).endswith(".json") else head_draft_vocab(src)
    if ids is None:
        raise ConfigError(f"train.draft_vocab_from: {src} holds no draft vocabulary a head was trained on "
                          "(draft_vocab.json with head_trained_on_it); give a draft_vocab.json file instead")
    seqs = [ex.tokens[ex.loss_mask.astype(bool)] for ex in (dataset[i] for i in range(len(dataset)))]
    return ids, coverage(ids, seqs), f"train.draft_vocab_from={src}"


def write_draft_vocab(dataset, size: int, eos_ids, path: Path, head_trained_on_it: bool = False, *,
                      ids=None, cov: float | None = None, source: str = "trained tokens of the training set") -> Path:
    """A draft vocabulary file: `ids` (with their coverage `cov`), by default `draft_vocab_of(dataset, size,
    eos_ids)`; `head_trained_on_it` marks the vocabulary of a head trained with `loss.draft_vocab` (which then
    drafts from it by default)."""
    if ids is None:
        ids, cov = draft_vocab_of(dataset, size, eos_ids)
    log.info("draft vocabulary: %d ids covering %.4f of the trained tokens -> %s", len(ids), cov, path)
    return save_draft_vocab(path, ids, source=source, coverage_of_source=round(cov, 5),
                            head_trained_on_it=bool(head_trained_on_it))


def check_batch_layout(cfg: ExperimentConfig, mesh) -> None:
    shards = parallel.batch_divisor(mesh)
    b, a = cfg.data.batch_size, cfg.optim.grad_accum
    if b % shards:
        raise ConfigError(f"data.batch_size: {b} rows cannot be split over the mesh's data*fsdp = {shards} "
                          "batch shards; use a multiple")
    if (b // a) % shards:
        log.warning("micro-batches of %d rows (data.batch_size / optim.grad_accum) do not split evenly over %d "
                    "batch shards: XLA will reshard them", b // a, shards)


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """['optim.lr: 0.001 -> 0.0005', ...] between two `config_to_dict` dicts."""
    out = []
    for section, body in new.items():
        for key, value in body.items():
            before = (old.get(section) or {}).get(key, "<unset>")
            if before != value:
                out.append(f"{section}.{key}: {before!r} -> {value!r}")
    return out


def discard_checkpoints_after(ckpt: Checkpointer, step: int, run_dir: Path) -> list[int]:
    """Moves the checkpoints of steps after `step` to `<run_dir>/discarded_checkpoints/` (nothing is deleted),
    so a run resumed from `step` neither reads nor keeps them; returns their steps."""
    later = [s for s in ckpt.all_steps() if s > step]
    if not later:
        return []
    aside = run_dir / "discarded_checkpoints"
    aside.mkdir(parents=True, exist_ok=True)
    for s in later:
        target = aside / str(s)
        n = 1
        while target.exists():
            target, n = aside / f"{s}.{n}", n + 1
        ckpt.step_dir(s).rename(target)
    ckpt.reload()
    log.warning("--from-step %d: moved the checkpoints of steps %s to %s", step, later, aside)
    return later


def _resume_hint(e: CheckpointError, steps: list[int], bad_step: int | None) -> CheckpointError:
    """The error with the way forward: resume from an earlier, readable step."""
    earlier = [s for s in steps if bad_step is None or s < bad_step]
    if not earlier:
        return e
    return CheckpointError(f"{e}; to continue from an earlier checkpoint run again with --resume --from-step N "
                           f"(earlier steps: {earlier})")


def run_experiment(cfg: ExperimentConfig, *, resume: bool = False, progress: bool = True, mesh=None,
                   loaded=None, batcher=None, eval_batches=None,
                   on_step: Callable[[int, Trainer], None] | None = None, from_step: int | None = None,
                   make_generate_fn: Callable | None = None) -> dict[str, Any]:
    """Trains a head as `cfg` says; returns the loop's summary. With `resume`, continues from the latest
    checkpoint in `cfg.checkpoint_dir` (or starts fresh when there is none, with a warning); without it, refuses
    to start where checkpoints already exist. `from_step` (with `resume`) continues from that step instead of
    the latest, moving later checkpoints aside (`discard_checkpoints_after`). The run folder is locked while the
    run lasts (`clover_jax.training.run_lock`): a second job on it stops with a `RunLockedError`, having touched
    nothing. A run that fails before its first checkpoint leaves no empty checkpoint directory behind."""
    if from_step is not None and not resume:
        raise ConfigError(f"from_step={from_step} needs resume=True")
    parallel.maybe_initialize_distributed(cfg.mesh.multi_host)
    mesh = mesh if mesh is not None else parallel.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tp)
    check_batch_layout(cfg, mesh)
    run_dir = Path(cfg.train.output_dir)
    ckpt_dir = Path(cfg.checkpoint_dir)
    created = [d for d in (run_dir, ckpt_dir) if not d.exists()]  # removed again if the start fails
    lock = take_run_lock(run_dir)  # one job per run folder: a second one stops here, having touched nothing
    ckpt = None
    started = False
    try:
        ckpt = Checkpointer(cfg.checkpoint_dir, save_every=cfg.checkpoint.save_every, keep=cfg.checkpoint.keep,
                            async_save=cfg.checkpoint.async_save,
                            save_on_preemption=cfg.checkpoint.save_on_preemption)
        existing = ckpt.all_steps()
        if existing and not resume:
            raise CheckpointError(f"{ckpt.directory}: already holds checkpoints (steps {existing}); pass --resume "
                                  "to continue that run, or choose another --output-dir")
        if resume and not existing:
            if from_step is not None:
                raise CheckpointError(f"{ckpt.directory}: no checkpoint to resume from (--from-step {from_step}); "
                                      "check --output-dir / train.output_dir")
            log.warning("--resume: %s holds no checkpoint; starting from step 0 (is train.output_dir / "
                        "--output-dir the run's directory?)", ckpt.directory)
        if from_step is not None:
            if from_step not in existing:
                raise CheckpointError(f"{ckpt.directory}: --from-step {from_step}: no checkpoint of that step "
                                      f"(available steps: {existing})")
            discard_checkpoints_after(ckpt, from_step, run_dir)
            existing = ckpt.all_steps()
        if existing and max(existing) >= cfg.train.steps and batcher is None:
            # finished: nothing to train, so skip the data set-up (self-distillation, base features)
            base_config = base_config_of(cfg.model.name_or_path) if loaded is None else (
                loaded.model if hasattr(loaded, "model") else loaded).config
            meta = head_metadata(steps_lib.head_config(cfg), base_config, cfg.model.name_or_path)
            try:  # every step's metadata, and the last step whole (the finished head is read from it)
                ckpt.check_all(meta)
                params, opt_state, rng = checkpoint_targets(*abstract_head_state(cfg, base_config), mesh)
                ckpt.restore(max(existing), abstract_params=params, abstract_opt_state=opt_state, abstract_rng=rng,
                             head_meta=meta)  # read whole, and dropped
            except CheckpointError as e:
                bad = next((s for s in existing if str(ckpt.step_dir(s)) in str(e)), None)
                raise _resume_hint(e, existing, bad) from None
            log.info("%s: the run is finished (checkpoint at step %d >= train.steps=%d); nothing to do",
                     ckpt.directory, max(existing), cfg.train.steps)
            started = True
            return {"start_step": max(existing), "final_step": max(existing), "steps_run": 0, "stopped_early": False,
                    "checkpoint_step": max(existing), "run_dir": str(run_dir), "config": config_to_dict(cfg)}
        if loaded is None:
            loaded = load_base(cfg, mesh)
        base = loaded.model if hasattr(loaded, "model") else loaded
        check_training_memory(cfg, base.config, mesh)  # a step that cannot fit stops here, before data and compiles
        head_meta = head_metadata(steps_lib.head_config(cfg), base.config, cfg.model.name_or_path)
        if existing:
            try:
                ckpt.check_all(head_meta)  # refuse before any save could rotate a bad checkpoint away
            except CheckpointError as e:
                bad = next((s for s in existing if str(ckpt.step_dir(s)) in str(e)), None)
                raise _resume_hint(e, existing, bad) from None
        if batcher is None:
            batcher, eval_batches = build_data(cfg, loaded, mesh, make_generate_fn)
        vocab_ids = None
        run_vocab = None
        if cfg.loss.draft_vocab or cfg.train.draft_vocab_size or cfg.train.draft_vocab_from:
            run_vocab = run_draft_vocab(cfg, batcher.dataset, base.config.eos_token_ids)  # same ids on every process
            size = cfg.train.draft_vocab_size
            if registry.get(cfg.head.type).vocab_tensors is not None and len(run_vocab[0]) < size:
                # a head whose output columns are its draft vocabulary keeps all of them: unused ids fill the rest
                log.info("draft vocabulary: the trained tokens hold %d distinct ids; %d unused ids fill the head's "
                         "%d columns", len(run_vocab[0]), size - len(run_vocab[0]), size)
                run_vocab = (pad_draft_vocab(run_vocab[0], size, base.config.vocab_size), *run_vocab[1:])
        if cfg.loss.draft_vocab:
            vocab_ids = run_vocab[0]
            log.info("cross-entropy over the draft vocabulary: %d ids covering %.4f of the trained tokens (%s)",
                     len(vocab_ids), run_vocab[1], run_vocab[2])
        trainer = Trainer(cfg, base, base_name=cfg.model.name_or_path, mesh=mesh, run_dir=run_dir,
                          vocab_ids=vocab_ids)
        if existing:
            try:
                data_state = trainer.restore(ckpt)
            except CheckpointError as e:
                raise _resume_hint(e, existing, max(existing)) from None
            batcher.load_state_dict(data_state)
            log.info("resumed from %s at step %d", ckpt.step_dir(trainer.state.step), trainer.state.step)
            changed = config_changes(trainer.restored_config or {}, config_to_dict(cfg))
            if changed:
                log.warning("the config differs from the checkpoint's: %s", "; ".join(changed))
        started = True
        if jax.process_index() == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, run_dir / "config.yaml")
            (run_dir / "head.json").write_text(json.dumps(head_meta, indent=1))
            if run_vocab is not None:
                write_draft_vocab(batcher.dataset, cfg.train.draft_vocab_size, base.config.eos_token_ids,
                                  run_dir / "draft_vocab.json", head_trained_on_it=cfg.loss.draft_vocab,
                                  ids=run_vocab[0], cov=run_vocab[1], source=run_vocab[2])
        summary = trainer.fit(batcher, eval_batches=eval_batches, checkpointer=ckpt, progress=progress,
                              on_step=on_step)
        summary["run_dir"] = str(run_dir)
        summary["config"] = config_to_dict(cfg)
        return summary
    finally:
        failing = sys.exc_info()[1] is not None
        try:
            if ckpt is not None:
                try:
                    ckpt.close()  # waits for the last asynchronous save
                except CheckpointError:
                    if not failing:  # a save that failed at the end of a run; after another error, that one stands
                        raise
        finally:
            lock.release()
            if not started:
                _remove_if_empty(created)


def _remove_if_empty(dirs: list[Path]) -> None:
    """Removes the directories a failed start created, deepest first, if nothing was written into them."""
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        try:
            d.rmdir()  # only succeeds when empty
        except OSError:
            pass


__all__ = ["base_config_of", "build_data", "check_batch_layout", "load_base", "run_experiment"]
