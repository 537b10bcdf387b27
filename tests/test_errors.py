"""Bad input gets a clear error naming the problem."""

import json

import numpy as np
import pytest

from clover_jax import generate
from clover_jax.validation import PromptError
from clover_jax.io.hf import load_hf_dir
from clover_jax.io.loader import load_model
from clover_jax.models.cache import CacheOverflowError
from clover_jax.models.config import ConfigError, LlamaConfig
from clover_jax.models.llama import init_llama

GOOD = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64, hidden_size=32,
            intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**GOOD, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="unsupported architecture.*gpt2"):
        load_hf_dir(tmp_path)


def test_missing_config_field(tmp_path):
    cfg = dict(GOOD)
    del cfg["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="missing required field 'intermediate_size'"):
        load_hf_dir(tmp_path)


def test_bad_head_counts():
    with pytest.raises(ConfigError, match="num_attention_heads=6 is not a multiple of num_key_value_heads=4"):
        LlamaConfig.from_hf_dict({**GOOD, "num_attention_heads": 6, "num_key_value_heads": 4, "hidden_size": 48})


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        load_hf_dir(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps(GOOD))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_hf_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="neither a local folder/file, a known name"):
        load_model("no-such-model-anywhere")


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model(bad)


@pytest.fixture(scope="module")
def tiny():
    return init_llama(LlamaConfig.from_hf_dict(GOOD), seed=0)


def test_empty_prompt(tiny):
    with pytest.raises(PromptError, match="prompt 1 is empty"):
        generate(tiny, [[1, 2], []], max_new_tokens=4)


def test_prompt_longer_than_cache(tiny):
    with pytest.raises(CacheOverflowError, match="prompt 0 has 40 tokens; with max_new_tokens=30 it needs 70"):
        generate(tiny, [list(np.arange(40) % 60)], max_new_tokens=30, cache_size=64)


def test_bad_sampling_args(tiny):
    with pytest.raises(ValueError, match=r"top_p: expected a number > 0.0 and <= 1.0, got 0.0"):
        generate(tiny, [[1, 2]], max_new_tokens=4, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens: expected an integer >= 1, got 0"):
        generate(tiny, [[1, 2]], max_new_tokens=0)
