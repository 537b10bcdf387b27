"""Qwen3 as a base model: tiny random Qwen3ForCausalLM folders written by transformers load with the same logits and
greedy tokens, decode speculatively as they do autoregressively, export back to folders transformers reads, and a
sliding-window config is a named error."""

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from clover_jax import generate  # noqa: E402
from clover_jax.heads.clover2.model import Clover2Config, init_from_base  # noqa: E402
from clover_jax.heads.export import export_head, import_head  # noqa: E402
from clover_jax.io.export import export_base  # noqa: E402
from clover_jax.io.hf import load_hf_dir  # noqa: E402
from clover_jax.models.config import ConfigError, LlamaConfig  # noqa: E402
from clover_jax.models.llama import count_params  # noqa: E402

# head_dim 16, not hidden / heads = 8; GQA 4 / 2
BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=None, eos_token_id=2)
EOS = 2

pytestmark = pytest.mark.torch


def _hf_qwen3(path, tied: bool, **overrides):
    """A random float32 Qwen3ForCausalLM saved to `path`, its norms (q_norm and k_norm among them) away from 1."""
    cfg = transformers.Qwen3Config(**{**BASE, "tie_word_embeddings": tied, **overrides})
    torch.manual_seed(1 if tied else 0)
    m = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.5 + 1.0)
    m.save_pretrained(path)
    return m


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """`models(tied)`: (transformers model, our config, our model) of one saved folder, made once per module."""
    made = {}

    def get(tied: bool):
        if tied not in made:
            path = tmp_path_factory.mktemp("qwen3")
            made[tied] = (_hf_qwen3(path, tied), *load_hf_dir(path))
        return made[tied]

    return get


TIED = pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])


def _hf_greedy(hf, prompt, n):
    """transformers' greedy continuation (full forwards, no cache), cut after the first EOS."""
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(hf(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            out.append(nxt)
            if nxt == EOS:
                break
    return out


def _prompts(n, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(3, 12, rng.randint(4, 14)).tolist() for _ in range(n)]  # a small alphabet: repeats


@TIED
def test_config_reads_the_qwen3_switches(models, tied):
    hf, config, model = models(tied)
    assert config.qk_norm and config.model_type == "qwen3" and config.head_dim == 16
    assert not config.attention_bias and not config.attention_out_bias
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert model.layers.q_norm.shape == (3, 16) and model.layers.k_norm.shape == (3, 16)
    assert config.num_params() == count_params(model)
    np.testing.assert_array_equal(np.asarray(model.layers.k_norm[...][1]),
                                  hf.model.layers[1].self_attn.k_norm.weight.detach().numpy())


@TIED
def test_logits_match_transformers(models, tied):
    hf, _, model = models(tied)
    ids = np.random.RandomState(1).randint(0, BASE["vocab_size"], (2, 19))
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    got, *_ = model(jnp.asarray(ids))
    assert np.abs(np.asarray(got) - want).max() < 1e-4


@TIED
@pytest.mark.slow  # transformers' generate for each prompt
def test_greedy_tokens_match_transformers(models, tied):
    hf, _, model = models(tied)
    prompts = _prompts(3, seed=2)
    ours = generate(model, prompts, max_new_tokens=16, cache_size=64)
    assert ours.token_ids == [_hf_greedy(hf, p, 16) for p in prompts]


@pytest.mark.slow  # a speculative loop per tree
def test_speculative_equals_autoregressive(models):
    """Prompt lookup alone (no head), and beside a fresh Clover-2 head whose Augmenting Block carries q/k norms."""
    _, _, model = models(False)
    prompts = _prompts(4)
    ar = generate(model, prompts, max_new_tokens=24, cache_size=96)
    sp = generate(model, prompts, max_new_tokens=24, cache_size=96, mode="speculative", tree="lookup-4")
    assert sp.token_ids == ar.token_ids
    assert sp.steps < ar.steps  # lookup chains were accepted
    head = init_from_base(model, Clover2Config(num_heads=3, num_aug_layers=1))
    assert head.aug.q_norm.shape == (1, 16)
    sp = generate(model, prompts, max_new_tokens=24, cache_size=96, mode="speculative", head=head,
                  tree="chain-3+lookup-3")
    assert sp.token_ids == ar.token_ids


def _same_params(a, b):
    a, b = nnx.to_pure_dict(nnx.state(a, nnx.Param)), nnx.to_pure_dict(nnx.state(b, nnx.Param))
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


@TIED
def test_export_round_trips_through_transformers(models, tied, tmp_path):
    _, config, model = models(tied)
    assert LlamaConfig.from_hf_dict(config.to_hf_dict()) == config
    out = export_base(model, tmp_path / "b", max_shard_bytes=50_000)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "qwen3" and written["architectures"] == ["Qwen3ForCausalLM"]
    back_config, back = load_hf_dir(out)
    assert back_config == config
    _same_params(model, back)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(ref).__name__ == "Qwen3ForCausalLM"
    ids = np.random.RandomState(3).randint(0, BASE["vocab_size"], (2, 11))
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    got, *_ = model(jnp.asarray(ids))
    assert np.abs(np.asarray(got) - want).max() < 1e-4


def test_a_head_on_a_qwen3_base_exports_and_imports(models, tmp_path):
    _, _, model = models(False)
    head = init_from_base(model, Clover2Config(num_heads=2, num_aug_layers=1), seed=1)
    head.aug.q_norm[...] = head.aug.q_norm[...] + 0.25  # away from its init, so the round trip checks the mapping
    out = export_head(head, tmp_path / "h", base=model)
    back = import_head(out, model)
    _same_params(head, back)


def test_sliding_window_is_a_named_error(tmp_path):
    on = transformers.Qwen3Config(**{**BASE, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1})
    on.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"use_sliding_window=true, sliding_window=8, layers \[1, 2\]"):
        LlamaConfig.from_json_file(tmp_path / "config.json")
    off = json.loads((tmp_path / "config.json").read_text()) | {"use_sliding_window": False}
    assert LlamaConfig.from_hf_dict(off).qk_norm
