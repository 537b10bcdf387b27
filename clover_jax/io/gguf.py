"""GGUF (llama.cpp) Llama files: config from the header, dequantised weights in HF layout, tokenizer.

GGUF stores Q and K projections with the rotary halves interleaved (llama.cpp's permutation);
they are un-permuted here to the HF rotate-half layout that clover_jax uses.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from clover_jax.models.config import ConfigError, LlamaConfig
from clover_jax.validation import InputError, WeightFileError
import gguf
from gguf.quants import dequantize

_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TO_HF = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _reader(path: str | Path):
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - gguf raises plain ValueError/struct errors
        raise WeightFileError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); the file is truncated, "
                              "corrupt or not GGUF: download or convert it again") from None


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_config(reader, source: str = "gguf") -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ConfigError(f"{source}: unsupported GGUF architecture {arch!r}; clover_jax reads 'llama'")

    def need(key):
        v = _field(reader, f"llama.{key}")
        if v is None:
            raise ConfigError(f"{source}: GGUF header lacks 'llama.{key}'")
        return v

    n_heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, "llama.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eps = float(f"{float(need('attention.layer_norm_rms_epsilon')):.7g}")  # stored as float32
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv", n_heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // n_heads)),
        rms_norm_eps=eps,
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, "llama.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of q/k rows: `[out, in]` -> HF rotate-half layout."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(reader, config: LlamaConfig) -> dict[str, np.ndarray]:
    """Every tensor dequantised to float32 and renamed/un-permuted to HF names and layouts."""
    out = {}
    for t in reader.tensors:
        try:
            arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            arr = arr.reshape(tuple(reversed([int(s) for s in t.shape])))
        except Exception as e:  # noqa: BLE001 - a short or damaged tensor fails in numpy or gguf in many ways
            source = getattr(getattr(reader, "data", None), "filename", None) or "GGUF file"
            raise WeightFileError(f"{source}: tensor {t.name!r} cannot be read ({type(e).__name__}: {e}); the file is "
                                  "truncated or corrupt: download or convert it again") from None
        name = t.name
        if name in _GGUF_TO_HF:
            out[_GGUF_TO_HF[name]] = arr
            continue
        parts = name.split(".")  # blk.N.kind.weight
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK_TO_HF:
            if parts[2] == "attn_q":
                arr = _unpermute(arr, config.num_attention_heads)
            elif parts[2] == "attn_k":
                arr = _unpermute(arr, config.num_key_value_heads)
            out[f"model.layers.{parts[1]}.{_BLOCK_TO_HF[parts[2]]}.{parts[3]}"] = arr
        # other tensors (e.g. rope_freqs) are not needed: RoPE is computed from the config
    return out


def gguf_tokenizer(reader, source: str = "gguf"):
    """A transformers `PreTrainedTokenizerFast` built from the GGUF vocabulary (byte-level BPE), no torch."""
    from transformers import PreTrainedTokenizerFast  # optional heavy import (seconds): only when a tokenizer is built

    model_kind = _field(reader, "tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise InputError(f"{source}: tokenizer model {model_kind!r} is not supported (byte-level BPE 'gpt2' only)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = _field(reader, "tokenizer.ggml.merges")
    types = _field(reader, "tokenizer.ggml.token_type")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False,
                     byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [AddedToken(tokens[i], special=True, normalized=False) for i, ty in enumerate(types) if ty == 3]
    tok.add_special_tokens(specials)

    def tok_name(key):
        i = _field(reader, key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=tok_name("tokenizer.ggml.bos_token_id"),
        eos_token=tok_name("tokenizer.ggml.eos_token_id"),
        unk_token=tok_name("tokenizer.ggml.unknown_token_id"),
        pad_token=tok_name("tokenizer.ggml.padding_token_id"),
        chat_template=_field(reader, "tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
