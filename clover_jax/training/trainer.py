"""Training a Clover-2 head by knowledge distillation from a frozen base model (Clover-2, arXiv 2408.00264; reference `XiaoBin1992/clover`, `clover/train/main_clover2.py`).

    trainer = Trainer(cfg, base_model, base_name="smollm2-135m-instruct")   # head = init_from_base(base)
    summary = trainer.fit(batcher, eval_batches=held_out, checkpointer=ckpt)

`Trainer` holds the functional training state (`TrainState`: step, head params as a pure dict, optax
state, RNG key data), the frozen base state and the jitted steps (`steps.build_steps`), all placed on a
("data", "fsdp", "tp") mesh by `clover_jax.parallel`'s rules. `fit` runs the loop: a tqdm bar (loss, head
accuracies, tokens/s, ETA), metrics to `<run_dir>/metrics.jsonl` and TensorBoard (`<run_dir>/tb`) every
`train.log_every` steps, held-out evaluation every `train.eval_every`, checkpoints through a
`Checkpointer`, and a clean stop on SIGTERM (save at the next step boundary, wait, return).

The whole pipeline from a config (model, data, trainer, checkpoints) is `clover_jax.training.run`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from clover_jax import parallel
from clover_jax.decoding.memory import fmt_bytes
from clover_jax.heads import registry
from clover_jax.heads.losses import pack_positions
from clover_jax.training import steps as steps_lib
from clover_jax.training.checkpoint import Checkpointer, CheckpointError, head_metadata, to_jsonable
from clover_jax.training.compiled import abstract_batch
from clover_jax.training.config import ConfigError, config_to_dict
from clover_jax.training.loading import load_head
from clover_jax.training.memory import CompiledTrainingMemory, check_compiled_training_memory, compiled_training_memory
from tqdm import tqdm

# Steps the host may dispatch ahead of the device: enough to keep it busy, few enough that a stop signal is
# answered within a couple of steps and queued batches do not pile up in host memory.
STEPS_IN_FLIGHT = 2

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainState:
    step: int  # optimizer steps done
    params: Any  # head parameters, pure dict of float32 arrays
    opt_state: Any  # optax state
    rng: jax.Array  # raw key data (uint32 [2]); per-step randomness = fold_in(key, step) (none used today)


# ------------------------------------------------------------------------------------------------ logging
class MetricsLogger:
    """JSON lines (`metrics.jsonl`) and TensorBoard scalars (`tb/`) in the run directory."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, start_step: int = 0):
        """`start_step`: the step training (re)starts from; records of later steps, left by a run that was
        stopped after its last checkpoint, are dropped (from metrics.jsonl, and from TensorBoard's view through
        its `purge_step`), so each step keeps one record."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        drop_records_after(self.run_dir / "metrics.jsonl", start_step)
        self._jsonl = (self.run_dir / "metrics.jsonl").open("a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter  # optional: TensorBoard logging only where installed

                # purge_step: TensorBoard discards the earlier events of steps >= it (a re-run's duplicates)
                self._tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=int(start_step) + 1)
            except ImportError:  # pragma: no cover - tensorboardX is a dependency
                log.warning("tensorboardX is not installed: TensorBoard logging is off")

    def log(self, record: dict[str, Any]) -> None:
        record = to_jsonable(record)
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            split, step = record.get("split", "train"), int(record["step"])
            for k, v in record.items():
                if k in ("split", "step"):
                    continue
                if isinstance(v, list):
                    for i, x in enumerate(v):
                        self._tb.add_scalar(f"{split}/{k}_head{i}", x, step)
                elif isinstance(v, (int, float)):
                    self._tb.add_scalar(f"{split}/{k}", v, step)
            self._tb.flush()

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def drop_records_after(path: Path, step: int) -> int:
    """Rewrites the JSON-lines file `path` without the records of steps > `step` (and unreadable lines, such as
    one cut short by a kill); returns how many were dropped."""
    if not path.is_file():
        return 0
    keep, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
            ok = int(rec["step"]) <= step
        except (ValueError, KeyError, TypeError):
            ok = False
        if ok:
            keep.append(line)
        elif line.strip():
            dropped += 1
    if dropped:
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text("".join(x + "\n" for x in keep), encoding="utf-8")
        tmp.replace(path)
        log.info("%s: dropped %d records of steps after %d (re-run after the resume)", path, dropped, step)
    return dropped


@contextlib.contextmanager
def stop_on_signals(enabled: bool = True, signals=(signal.SIGTERM,)) -> Iterator[threading.Event]:
    """An Event set by SIGTERM while inside the block (previous handlers restored on exit).

    Not installed off the main thread, or on multi-host runs, where JAX's preemption service owns SIGTERM
    and `Checkpointer.reached_preemption` syncs the stop step across hosts.
    """
    event = threading.Event()
    if not enabled or threading.current_thread() is not threading.main_thread() or jax.process_count() > 1:
        yield event
        return

    def handler(signum, frame):  # noqa: ARG001
        log.warning("received signal %d: saving a checkpoint at the next step boundary and stopping", signum)
        event.set()

    old = {s: signal.signal(s, handler) for s in signals}
    try:
        yield event
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _window_record(window: list[dict[str, Any]]) -> dict[str, Any]:
    """Averages of a window of step metrics (accuracies weighted by mask counts)."""
    count = np.sum([m["count"] for m in window], axis=0)
    acc = np.sum([m["acc"] * m["count"] for m in window], axis=0) / np.maximum(count, 1)
    chain = np.sum([m["chain_acc"] * m["count"] for m in window], axis=0) / np.maximum(count, 1)
    return {"loss": float(np.mean([m["loss"] for m in window])),
            "vloss": np.mean([m["vloss"] for m in window], axis=0).tolist(),
            "ploss": np.mean([m["ploss"] for m in window], axis=0).tolist(),
            "acc": acc.tolist(), "chain_acc": chain.tolist(),
            "grad_norm": float(np.mean([m["grad_norm"] for m in window])),
            "lr": float(window[-1]["lr"]), "loss_tokens": float(np.sum(count[0]))}


def _same_sharding(x, sharding) -> bool:
    """`x` is placed as `sharding` says, on the same mesh: an array on one device equivalent to a one-device mesh's
    sharding is not, since its type has no mesh and the step's outputs do (the step would compile twice)."""
    current = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and not (isinstance(current, NamedSharding)
                                                    and current.mesh == sharding.mesh):
        return False
    try:
        return current is not None and current.is_equivalent_to(sharding, x.ndim)
    except Exception:  # noqa: BLE001 - shardings of different kinds that cannot be compared
        return False


def checkpoint_targets(params, opt_state, mesh):
    """(params, opt_state, rng) as `ShapeDtypeStruct`s on their shardings over `mesh`: what a checkpoint restores
    into. `params` / `opt_state`: arrays or `ShapeDtypeStruct`s."""
    on = lambda tree: parallel.abstract_with_shardings(tree, parallel.model_shardings(tree, mesh))  # noqa: E731
    rng = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))  # [2] uint32
    return on(params), on(opt_state), jax.ShapeDtypeStruct(rng.shape, rng.dtype, sharding=parallel.replicated(mesh))


# ------------------------------------------------------------------------------------------------ trainer
def warm_start(head, source: str, base):
    """`head` with the parameters of the head at `source` (a registered name, an exported folder or a run dir,
    see `load_head`); the two must be of the same type and architecture (`HeadType.fields`)."""
    try:
        other = load_head(source, base)
    except FileNotFoundError as e:
        raise ConfigError(f"train.init_head_from: {e}") from None
    mine_t, theirs_t = registry.of_head(head), registry.of_head(other)
    if mine_t is not theirs_t:
        raise ConfigError(f"train.init_head_from: {source} is a {theirs_t.name} head, this config trains "
                          f"head.type = {mine_t.name!r}")
    theirs_t.check_compatible(other, base.config)
    mine, theirs = head.cfg, other.cfg
    for name in mine_t.fields:
        if getattr(mine, name) != getattr(theirs, name):
            raise ConfigError(f"train.init_head_from: {source} has head.{name} = {getattr(theirs, name)!r}, "
                              f"this config has {getattr(mine, name)!r}")
    params = jax.tree.map(lambda x, y: jnp.asarray(y, x.dtype), nnx.state(head, nnx.Param),
                          nnx.state(other, nnx.Param))
    nnx.update(head, params)
    return head


class Trainer:
    """A draft head (any registered type), its optimizer and the frozen base model on a mesh, with jitted
    train/eval steps."""

    def __init__(self, cfg, base, *, base_name: str = "", mesh=None, run_dir: str | Path | None = None,
                 donate: bool = True, vocab_ids=None):
        self.cfg = cfg
        self.mesh = mesh if mesh is not None else parallel.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tp)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.base_config = base.config
        self.head_cfg = steps_lib.head_config(cfg)
        self.loss_cfg = cfg.loss
        self.head_meta = head_metadata(self.head_cfg, base.config, base_name or cfg.model.name_or_path)
        self.total_steps = cfg.total_steps
        self.restored_config: dict[str, Any] | None = None
        if cfg.loss.draft_vocab and vocab_ids is None:
            raise ValueError("loss.draft_vocab is on but no draft vocabulary was given to the Trainer (vocab_ids)")
        # the cross-entropy's vocabulary: the draft vocabulary's ids (loss.draft_vocab) or all of them
        self.vocab_ids = None if vocab_ids is None else jnp.asarray(vocab_ids, jnp.int32)

        # frozen base: graphdef (static) + state placed on its shardings
        self.base_graphdef, base_state = nnx.split(base)
        base_state = nnx.to_pure_dict(base_state)
        self.base_shardings = parallel.model_shardings(base_state, self.mesh)
        self.base_state = self._place(base_state, self.base_shardings)

        # head: reference initialisation from the base (or a warm start), fp32 master params
        head = registry.get(cfg.head.type).init_from_base(base, self.head_cfg, seed=cfg.train.seed)
        if cfg.train.init_head_from:
            head = warm_start(head, cfg.train.init_head_from, base)
        self.head_graphdef, params = nnx.split(head)
        params = nnx.to_pure_dict(params)
        self.param_shardings = parallel.model_shardings(params, self.mesh)
        params = self._place(params, self.param_shardings)
        del head

        self.tx, self.schedule = steps_lib.make_optimizer(cfg.optim, self.total_steps)
        self.opt_shardings = parallel.model_shardings(jax.eval_shape(self.tx.init, params), self.mesh)
        opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(params)
        rng = np.asarray(jax.random.key_data(jax.random.key(cfg.train.seed)))  # [2] uint32, the same everywhere
        rng = jax.make_array_from_process_local_data(parallel.replicated(self.mesh), rng)  # global: saved by all
        self.state = TrainState(0, params, opt_state, rng)
        self.batch_sharding = parallel.batch_sharding(self.mesh)
        self._build = lambda **kw: steps_lib.build_steps(  # noqa: E731
            self.head_graphdef, self.base_graphdef, self.tx, self.loss_cfg, cfg.head.num_heads,
            grad_accum=cfg.optim.grad_accum, schedule=self.schedule, mesh=self.mesh,
            param_shardings=self.param_shardings, opt_shardings=self.opt_shardings,
            base_shardings=self.base_shardings, donate=donate, vocab_ids=self.vocab_ids, noise_seed=cfg.train.seed,
            taps=registry.get(cfg.head.type).base_feature_layers(self.head_cfg), **kw)
        self._train_step, self._eval_step = self._build()
        self._train_step_grads = None

    # ---- placement
    @staticmethod
    def _place(tree, shardings):
        """`tree` on `shardings`; arrays already there are kept as they are (the base weights loaded onto
        their shardings are not copied a second time)."""
        leaves, treedef = jax.tree.flatten(tree)
        targets = treedef.flatten_up_to(shardings)
        move = [i for i, (x, s) in enumerate(zip(leaves, targets)) if not _same_sharding(x, s)]
        if move:
            moved = jax.jit(lambda xs: xs, out_shardings=[targets[i] for i in move])([leaves[i] for i in move])
            for i, x in zip(move, moved):
                leaves[i] = x
        return treedef.unflatten(leaves)

    def device_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows -> global arrays on the batch sharding."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(batch[k]))
                for k in ("tokens", "loss_mask", "valid", "loss_index", "features") if k in batch}

    def with_loss_index(self, batch: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
        """Adds the packed cross-entropy positions (`loss.vocab_positions_per_row`), drawn for each row of the
        global batch from a generator seeded by (seed, step, row), so a resumed run draws the same subsets and
        a job of several processes (each holding its own rows) the same as one process."""
        k = self.cfg.loss.vocab_positions_per_row
        if not k:
            return batch
        rows = len(batch["loss_mask"])
        first = jax.process_index() * rows  # this process's rows of the global batch (`BucketedBatcher`)
        rngs = [np.random.default_rng((self.cfg.data.seed, step, first + r)) for r in range(rows)]
        return {**batch, "loss_index": pack_positions(batch["loss_mask"], batch["valid"], k, rngs)}

    def head(self):
        """The current head as an `nnx.Module` (shares the parameter arrays)."""
        return nnx.merge(self.head_graphdef, self.state.params)

    def base(self):
        return nnx.merge(self.base_graphdef, self.base_state)

    # ---- steps
    def train_step(self, batch: dict[str, np.ndarray], return_grads: bool = False):
        """One optimizer step on a host batch; returns the step's metrics (device arrays, not synced),
        and with `return_grads` also the gradients (a separately compiled variant of the step)."""
        s = self.state
        batch = self.with_loss_index(batch, s.step)
        args = (s.params, s.opt_state, self.base_state, self.device_batch(batch), np.int32(s.step))
        if return_grads:
            if self._train_step_grads is None:
                self._train_step_grads = self._build(return_grads=True)[0]
            params, opt_state, metrics, grads = self._train_step_grads(*args)
        else:
            params, opt_state, metrics = self._train_step(*args)
        self.state = TrainState(s.step + 1, params, opt_state, s.rng)
        return (metrics, grads) if return_grads else metrics

    def compile_step(self, length: int | None = None):
        """The train step compiled for `data.batch_size` rows of `length` tokens (default `data.max_length`) on
        this trainer's state: (a jax `Compiled`, whose `memory_analysis()` is XLA's buffer assignment per device, and
        the batch's `ShapeDtypeStruct`s). It is the executable the first step of that shape runs: the arguments have
        the state's own shapes, dtypes and shardings, so the step does not compile again."""
        s = self.state
        held = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            (s.params, s.opt_state, self.base_state))
        taps = len(registry.get(self.cfg.head.type).base_feature_layers(self.head_cfg))
        batch = abstract_batch(self.cfg, self.base_config, self.batch_sharding, taps, length)
        return self._train_step.lower(*held, batch, jax.ShapeDtypeStruct((), jnp.int32)).compile(), batch

    def check_step_memory(self, batcher) -> CompiledTrainingMemory:
        """Compiles the step of the longest bucket holding rows (`batcher.longest_length()`, else `data.max_length`),
        the executable its first batch then runs, and stops training that cannot fit before its first step
        (`check_compiled_training_memory`, skipped with `train.check_memory: false`). Returns XLA's figures."""
        longest = batcher.longest_length() if hasattr(batcher, "longest_length") else self.cfg.data.max_length
        mem = compiled_training_memory(self.cfg, self.base_config, self.mesh, *self.compile_step(longest))
        log.info("training memory, the compiled step of %d x %d tokens: %s per device while it runs, %s added to the "
                 "%s this process holds", self.cfg.data.batch_size, longest, fmt_bytes(mem.step),
                 fmt_bytes(mem.added), fmt_bytes(mem.resident))
        check_compiled_training_memory(self.cfg, self.base_config, self.mesh, mem, length=longest)
        return mem

    def evaluate(self, batches: Iterable[dict[str, np.ndarray]]) -> dict[str, Any]:
        """Held-out loss, per-head accuracy and chained accuracy over `batches` (exact batch-level sums)."""
        sums = [self._eval_step(self.state.params, self.base_state, self.device_batch(b)) for b in batches]
        if not sums:
            return {}
        return steps_lib.summarize_eval(jax.device_get(sums), self.loss_cfg)

    # ---- checkpoints
    def abstract_targets(self):
        return checkpoint_targets(self.state.params, self.state.opt_state, self.mesh)

    def save(self, checkpointer: Checkpointer, data_state: dict[str, Any], force: bool = False,
             config: dict[str, Any] | None = None) -> bool:
        s = self.state
        return checkpointer.save(s.step, params=s.params, opt_state=s.opt_state, rng=s.rng,
                                 data_state=to_jsonable(data_state), head_meta=self.head_meta, force=force,
                                 config=config if config is not None else config_to_dict(self.cfg))

    def restore(self, checkpointer: Checkpointer, step: int | None = None) -> dict[str, Any]:
        """Loads a checkpoint into the trainer; returns the saved data position (batcher state_dict)."""
        params, opt_state, rng = self.abstract_targets()
        out = checkpointer.restore(step, abstract_params=params, abstract_opt_state=opt_state, abstract_rng=rng,
                                   head_meta=self.head_meta)
        self.state = TrainState(out["step"], out["params"], out["opt_state"], out["rng"])
        self.restored_config = out["config"]
        return out["data"]

    # ---- loop
    def fit(self, batcher, *, eval_batches: list[dict[str, np.ndarray]] | None = None,
            checkpointer: Checkpointer | None = None, steps: int | None = None, progress: bool = True,
            on_step: Callable[[int, "Trainer"], None] | None = None) -> dict[str, Any]:
        """Trains until `steps` (default train.steps) optimizer steps are done, or a stop signal arrives.

        `batcher` yields host batches and has `state_dict()` (saved with each checkpoint). Returns a summary.
        """
        tc = self.cfg.train
        total = int(steps or tc.steps)
        main = jax.process_index() == 0
        start = self.state.step
        logger = MetricsLogger(self.run_dir, start_step=start) if (self.run_dir is not None and main) else None
        try:
            step_memory = self.check_step_memory(batcher)
        except BaseException:
            if logger:
                logger.close()
            raise
        window: list[dict[str, Any]] = []
        history: list[dict[str, Any]] = []
        evals: list[dict[str, Any]] = []
        tokens_total = 0.0
        t_start = time.perf_counter()
        t_window = t_start
        t_steady = None  # wall clock after the first step (compile excluded from the steady rate)
        eval_before_steady = 0.0
        paused = 0.0  # seconds spent in evaluation in this log window (excluded from tokens/s)
        eval_total = 0.0
        tokens_first = 0.0
        stopped = False
        bar = tqdm(total=total, initial=start, disable=not (progress and main), desc="train", unit="step",
                   dynamic_ncols=True)

        def run_eval(step: int) -> None:
            nonlocal paused, eval_total
            t0 = time.perf_counter()
            ev = {"step": step, "split": "eval", **self.evaluate(eval_batches)}
            dt = time.perf_counter() - t0
            paused += dt
            eval_total += dt
            evals.append(ev)
            if logger:
                logger.log(ev)
            bar.write(f"step {step}: eval loss {ev['loss']:.4f} acc " + " ".join(f"{a:.3f}" for a in ev["acc"]))

        if eval_batches and tc.eval_every and start == 0 and tc.init_head_from:
            run_eval(0)  # a warm start's baseline: the head it starts from, on this run's held-out set
        in_flight: collections.deque = collections.deque()  # the metrics of steps dispatched and maybe not yet run
        with stop_on_signals(self.cfg.checkpoint.save_on_preemption) as stop_event:
            while self.state.step < total:
                metrics = self.train_step(next(batcher))
                step = self.state.step
                window.append(metrics)
                in_flight.append(metrics)
                if len(in_flight) > STEPS_IN_FLIGHT:  # dispatch runs ahead of the device by this many steps at most,
                    jax.block_until_ready(in_flight.popleft())  # so a stop signal is answered within them
                if t_steady is None:
                    jax.block_until_ready(metrics)
                    t_steady = time.perf_counter()
                    eval_before_steady = eval_total  # the warm-start baseline's evaluation, if any
                    tokens_first = float(metrics["tokens"])
                if step % tc.log_every == 0 or step == total:
                    host = jax.device_get(window)
                    now = time.perf_counter()
                    tokens = float(np.sum([m["tokens"] for m in host]))
                    tokens_total += tokens
                    rec = {"step": step, "split": "train", **_window_record(host)}
                    rec["tokens_per_s"] = tokens / max(now - t_window - paused, 1e-9)
                    rec["elapsed_s"] = now - t_start
                    rec["eta_s"] = (total - step) * (now - t_window - paused) / len(host)
                    paused, t_window, window = 0.0, now, []
                    history.append(rec)
                    if logger:
                        logger.log(rec)
                    post = {"loss": f"{rec['loss']:.3f}"}
                    post.update({f"a{i}": f"{a:.2f}" for i, a in enumerate(rec["acc"])})
                    post["tok/s"] = f"{rec['tokens_per_s']:.0f}"
                    bar.set_postfix(post, refresh=False)
                bar.update(1)
                if eval_batches and tc.eval_every and (step % tc.eval_every == 0 or step == total):
                    run_eval(step)
                if on_step is not None:
                    on_step(step, self)
                preempted = stop_event.is_set() or bool(checkpointer and checkpointer.reached_preemption(step))
                if checkpointer is not None:
                    self.save(checkpointer, batcher.state_dict(), force=preempted or step == total)
                if preempted:
                    stopped = True
                    bar.write(f"stopping at step {step} (signal/preemption); checkpoint saved")
                    break
        bar.close()
        if checkpointer is not None:
            checkpointer.wait_until_finished()
        jax.block_until_ready(self.state.params)
        parallel.barrier("training done")  # every process's saves are complete before process 0 reports or exports
        t_end = time.perf_counter()
        if window:  # metrics of steps after the last log (stopped early)
            tokens_total += float(np.sum([float(m["tokens"]) for m in jax.device_get(window)]))
        train_time = t_end - t_start - eval_total
        steady_time = (t_end - t_steady - (eval_total - eval_before_steady)) if t_steady is not None else 0.0
        tokens_steady = tokens_total - tokens_first
        summary = {
            "start_step": start, "final_step": self.state.step, "steps_run": self.state.step - start,
            "stopped_early": stopped, "train_time_s": train_time, "eval_time_s": eval_total,
            "tokens": tokens_total, "tokens_per_s": tokens_total / max(train_time, 1e-9),
            "steady_tokens_per_s": tokens_steady / max(steady_time, 1e-9) if self.state.step - start > 1 else None,
            "first_log": history[0] if history else None, "last_log": history[-1] if history else None,
            "last_eval": evals[-1] if evals else None, "evals": evals,
            "checkpoint_step": checkpointer.latest_step() if checkpointer is not None else None,
            "memory": step_memory.as_dict(),
        }
        if logger:
            (self.run_dir / "summary.json").write_text(json.dumps(to_jsonable(summary), indent=1))
            logger.close()
        return summary


__all__ = ["CheckpointError", "MetricsLogger", "TrainState", "Trainer", "checkpoint_targets", "stop_on_signals"]
