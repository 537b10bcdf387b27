"""Logits and hidden-state parity with transformers (torch CPU) on tiny random configs saved to disk."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from clover_jax.io.hf import load_hf_dir  # noqa: E402
from clover_jax.models.llama import rms_norm  # noqa: E402

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)

CASES = {
    "gqa": {},
    "mha": dict(num_key_value_heads=4),
    "mqa": dict(num_key_value_heads=1),
    "tied": dict(tie_word_embeddings=True),
    "attention_bias": dict(attention_bias=True),
    "mlp_bias": dict(mlp_bias=True),
    "head_dim_override": dict(head_dim=16),
    "rope_llama3": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8}),
    "rope_linear": dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    # max_position_embeddings below the sequence length, so the NTK base really changes
    "rope_dynamic": dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
                         max_position_embeddings=8),
}


def _hf_model(tmp_path, overrides):
    cfg = transformers.LlamaConfig(**{**BASE, **overrides})
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # random biases and norms, so they are really exercised
        for name, p in m.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
    m.save_pretrained(tmp_path)
    return m


@pytest.mark.torch
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_hidden_match_transformers(tmp_path, case):
    hf = _hf_model(tmp_path, CASES[case])
    config, model = load_hf_dir(tmp_path)
    ids = np.random.RandomState(1).randint(0, BASE["vocab_size"], (2, 19))
    captured = {}
    hook = hf.model.norm.register_forward_pre_hook(lambda mod, args: captured.setdefault("pre", args[0]))
    with torch.no_grad():
        ref = hf(torch.tensor(ids), output_hidden_states=True)
    hook.remove()
    logits, hidden, _, _ = model(jnp.asarray(ids))
    np.testing.assert_allclose(np.asarray(logits), ref.logits.numpy(), atol=1e-4, rtol=0)
    # pre-norm last-layer hidden state (what Clover-2 consumes) and its post-norm version
    np.testing.assert_allclose(np.asarray(hidden), captured["pre"].numpy(), atol=1e-4, rtol=0)
    post = rms_norm(hidden, model.final_norm[...], config.rms_norm_eps)
    np.testing.assert_allclose(np.asarray(post), ref.hidden_states[-1].numpy(), atol=1e-4, rtol=0)
