"""Llama-family model configuration, read from a Hugging Face `config.json` or a GGUF header.

Shapes and einsum strings use the axis letters of `clover_jax.axes`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from clover_jax.validation import ConfigError, InputError  # noqa: F401 (ConfigError re-exported)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_SCALING_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as in Hugging Face `rope_scaling` (the types Llama 3.x uses)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, dynamic

    def __post_init__(self):
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ConfigError(
                f"rope_scaling.rope_type={self.rope_type!r} is not supported; use one of {ROPE_SCALING_TYPES}"
            )
        if self.factor <= 0:
            raise ConfigError(f"rope_scaling.factor must be > 0, got {self.factor}")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-family decoder (Llama 2/3, Vicuna, Mistral-style, SmolLM2, Qwen2 bias, Qwen3
    q/k norms)."""

    # the fields that fix a draft head's parameter shapes (or its token space): a head fits a base model that agrees
    # with the one it was made for on each of them (checked on load, saved in checkpoints; a field a checkpoint does
    # not hold had its default here). Heads that copy the base's decoder layer copy its q/k norms too.
    HEAD_FIT_FIELDS: ClassVar[tuple[str, ...]] = (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "attention_bias", "attention_out_bias", "mlp_bias", "qk_norm")

    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F
    num_hidden_layers: int  # L
    num_attention_heads: int  # N
    num_key_value_heads: int  # K
    head_dim: int  # H
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v projections
    attention_out_bias: bool = False  # bias on o_proj (Llama's attention_bias sets it; Qwen2 does not)
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before RoPE (Qwen3's q_norm / k_norm)
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    pad_token_id: int | None = None
    model_type: str = "llama"

    def check_head_fits(self, base: "LlamaConfig", head_name: str) -> None:
        """An `InputError` naming the first `HEAD_FIT_FIELDS` field in which a head made for this base (`self`) does
        not fit `base`."""
        for name in self.HEAD_FIT_FIELDS:
            mine, theirs = getattr(self, name), getattr(base, name)
            if mine != theirs:
                raise InputError(f"{head_name} head does not fit the base model: {name} is {mine} in the head but "
                                 f"{theirs} in the base model")

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config field {name!r} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def num_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def num_params(self) -> int:
        d, f, n, k, h = (self.hidden_size, self.intermediate_size, self.num_attention_heads,
                         self.num_key_value_heads, self.head_dim)
        attn = d * n * h * 2 + d * k * h * 2 + (n * h + 2 * k * h if self.attention_bias else 0)
        attn += d if self.attention_out_bias else 0
        attn += 2 * h if self.qk_norm else 0
        layer = attn + 3 * d * f + 2 * d + (2 * f + d if self.mlp_bias else 0)
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_hidden_layers * layer + d + head

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> "LlamaConfig":
        """Builds a config from a transformers `config.json` dict; errors name the missing/bad field."""
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ConfigError(
                f"{source}: unsupported architecture (model_type={model_type!r}, architectures={archs}); "
                f"clover_jax supports model_type in {SUPPORTED_MODEL_TYPES}"
            )

        def need(key: str):
            if key not in cfg or cfg[key] is None:
                raise ConfigError(f"{source}: missing required field {key!r}")
            return cfg[key]

        n_heads = need("num_attention_heads")
        hidden = need("hidden_size")
        head_dim = cfg.get("head_dim") or hidden // n_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        rs = cfg.get("rope_scaling") or {}
        # transformers 5 folds rope_theta into `rope_parameters`; accept both spellings.
        rp = cfg.get("rope_parameters") or {}
        if rp and not rs and rp.get("rope_type", "default") != "default":
            rs = rp
        rope_theta = cfg.get("rope_theta", rp.get("rope_theta", 10000.0))
        scaling = RopeScaling()
        if rs:
            rtype = rs.get("rope_type", rs.get("type", "default"))
            scaling = RopeScaling(
                rope_type=rtype,
                factor=float(rs.get("factor", 1.0)),
                low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(
                    rs.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
                ),
            )
        attention_bias = bool(cfg.get("attention_bias", model_type == "qwen2"))
        qk_norm = model_type == "qwen3" or "Qwen3ForCausalLM" in archs
        if qk_norm:
            sliding = _sliding_layers(cfg)
            if sliding:
                raise ConfigError(
                    f"{source}: sliding-window attention (use_sliding_window=true, sliding_window="
                    f"{cfg.get('sliding_window')}, layers {sliding}) is not supported: clover_jax attends over the "
                    "whole sequence in every layer")
        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=n_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            attention_out_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=qk_norm,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=cfg.get("pad_token_id"),
            model_type=model_type or "llama",
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> "LlamaConfig":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"model config not found: {path}")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(cfg, source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers `config.json` fields for this model (LlamaForCausalLM; Qwen3ForCausalLM with
        `qk_norm`)."""
        if self.attention_bias != self.attention_out_bias:
            raise ConfigError("a Llama config.json cannot express q/k/v biases without an o_proj bias "
                              "(Qwen2-style); export this model with its own model_type")
        rs = None
        if self.rope_scaling.rope_type != "default":
            rs = {"rope_type": self.rope_scaling.rope_type, "factor": self.rope_scaling.factor}
            if self.rope_scaling.rope_type == "llama3":
                rs.update(low_freq_factor=self.rope_scaling.low_freq_factor,
                          high_freq_factor=self.rope_scaling.high_freq_factor,
                          original_max_position_embeddings=self.rope_scaling.original_max_position_embeddings)
        eos = list(self.eos_token_ids)
        arch = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
        if self.qk_norm:
            arch = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "use_sliding_window": False}
        return {
            **arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rs,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "pad_token_id": self.pad_token_id,
        }


def _sliding_layers(cfg: dict[str, Any]) -> list[int]:
    """The layers a Qwen-style `config.json` gives sliding-window attention, by transformers' rule: none unless
    `use_sliding_window` and a `sliding_window` are set; then those `layer_types` names so, else every layer from
    `max_window_layers` on."""
    if not cfg.get("use_sliding_window") or cfg.get("sliding_window") is None:
        return []
    types = cfg.get("layer_types")
    if types:
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    return list(range(int(cfg.get("max_window_layers", 28)), int(cfg.get("num_hidden_layers") or 0)))


def rope_inv_freq(config: LlamaConfig, seq_len_hint: int | None = None):
    """Inverse RoPE frequencies `[H/2]` in float64 numpy, with the config's scaling applied.

    `dynamic` (NTK) scaling depends on the sequence length; like transformers, the base is only
    enlarged once the length passes `max_position_embeddings`. clover_jax uses static
    cache sizes, so the length used is the cache size (`seq_len_hint`).
    """
    h = config.head_dim
    base = config.rope_theta
    rs = config.rope_scaling
    if rs.rope_type == "dynamic" and seq_len_hint is not None and seq_len_hint > config.max_position_embeddings:
        # transformers (`_compute_dynamic_ntk_parameters`) scales against max_position_embeddings.
        mpe = config.max_position_embeddings
        base = base * ((rs.factor * seq_len_hint / mpe) - (rs.factor - 1)) ** (h / (h - 2))
    inv = 1.0 / (base ** (np.arange(0, h, 2, dtype=np.float64) / h))
    if rs.rope_type == "linear":
        inv = inv / rs.factor
    elif rs.rope_type == "llama3":
        old = rs.original_max_position_embeddings
        low_wl = old / rs.low_freq_factor
        high_wl = old / rs.high_freq_factor
        wl = 2 * math.pi / inv
        scaled = np.where(wl > low_wl, inv / rs.factor, inv)
        smooth = (old / wl - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        mid = (1 - smooth) * scaled / rs.factor + smooth * scaled
        is_mid = (wl >= high_wl) & (wl <= low_wl)
        inv = np.where(is_mid, mid, scaled)
    return inv
