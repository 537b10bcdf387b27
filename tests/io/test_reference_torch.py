"""An exported Clover-2 head loads, with strict key matching, into a torch re-implementation of the reference
`Clover2Model` (XiaoBin1992/clover: clover/model/clover2.py) and computes the same head outputs and logits.

The torch module registers exactly the reference's submodules (`lm_head`, `clover_embed_tokens`,
`clover_head_mlp_rnn{,2}`, `layers`, `clover_norm`, `clover_head_mlp{,2}`, `clover_head_norm`), uses
transformers' `LlamaDecoderLayer` / `LlamaRMSNorm` for the Augmenting Block, and the reference's RoPE: plain
RoPE with base 10000 whatever the base model's `rope_theta` (the tiny base here uses 500000 + llama3 scaling,
so a head following the base's RoPE must not match).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax.heads.clover2.model import REFERENCE_ROPE_THETA, Clover2Config, init_from_base
from clover_jax.heads.export import export_head, import_head
from clover_jax.models.config import LlamaConfig, RopeScaling
from clover_jax.models.llama import init_llama

V, D, F_DIM, N_HEADS, N_KV, HD = 64, 32, 48, 4, 2, 8
BASE_THETA = 500000.0
CFG = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=F_DIM, num_hidden_layers=3,
                  num_attention_heads=N_HEADS, num_key_value_heads=N_KV, head_dim=HD, rope_theta=BASE_THETA,
                  rope_scaling=RopeScaling(rope_type="llama3", factor=8.0, original_max_position_embeddings=8192))
B, T = 2, 7


def _perturbed_head(base, cfg: Clover2Config, seed: int = 1):
    """A head whose every parameter differs from its init (so the name mapping is really checked), with
    Augmenting-Block q/k large enough that the attention pattern, and so the RoPE, matters."""
    head = init_from_base(base, cfg, seed=seed)
    state = nnx.state(head, nnx.Param)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    nnx.update(head, jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape)
                                               for x, k in zip(leaves, keys)]))
    kq, kk = jax.random.split(jax.random.key(4))
    head.aug.wq[...] = head.aug.wq[...] + 0.5 * jax.random.normal(kq, head.aug.wq.shape)
    head.aug.wk[...] = head.aug.wk[...] + 0.5 * jax.random.normal(kk, head.aug.wk.shape)
    return head


@pytest.fixture(scope="module")
def base():
    return init_llama(CFG, seed=0)


@pytest.fixture(scope="module")
def head(base):
    return _perturbed_head(base, Clover2Config())  # default: the reference's RoPE, base 10000


@pytest.fixture(scope="module")
def head_follows_base(base):
    # same parameters as `head` (same seeds), only the Augmenting Block's RoPE differs
    return _perturbed_head(base, Clover2Config(rope_theta=None))


@pytest.fixture(scope="module")
def inputs():
    f = jax.random.normal(jax.random.key(0), (B, T, D))
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, V)
    valid = jnp.ones((B, T), bool)
    return f, tokens, valid


# ----------------------------------------------------------------------------- the torch reference
def _reference_model(torch, base_config: LlamaConfig, num_heads: int, num_layers: int):
    """The reference `Clover2Model`'s parameters and teacher-forced forward, in torch."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

    nn = torch.nn
    c = base_config
    eps = c.rms_norm_eps
    # the layers get the base model's dims; their RoPE is the reference's (plain, base 10000)
    layer_cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=eps,
        max_position_embeddings=c.max_position_embeddings, attention_bias=False, mlp_bias=False,
        hidden_act="silu", rope_parameters={"rope_type": "default", "rope_theta": REFERENCE_ROPE_THETA})
    layer_cfg._attn_implementation = "eager"

    class ResAttentionBlock(nn.Module):
        def __init__(self, hidden_size, head_size, rms_norm_eps):
            super().__init__()
            self.head_size = head_size
            self.head_dim = hidden_size // head_size
            self.input_layernorm = LlamaRMSNorm(hidden_size, rms_norm_eps)
            self.q = nn.Linear(hidden_size, hidden_size)
            self.k = nn.Linear(hidden_size, hidden_size)
            self.v = nn.Linear(hidden_size, hidden_size)
            self.rms_norm_eps = rms_norm_eps

        def forward(self, x, y):  # as the reference (x_replica=None)
            res = x
            x_q = self.q(self.input_layernorm(x))
            y_k = self.k(y)
            att = nn.functional.cosine_similarity(x_q.reshape(-1, self.head_dim), y_k.reshape(-1, self.head_dim),
                                                  eps=self.rms_norm_eps)
            v = self.v(y).reshape(-1, self.head_size, self.head_dim) * att.view(-1, self.head_size, 1)
            return res + v.view(x_q.size())

    class Clover2Model(nn.Module):
        def __init__(self):
            super().__init__()
            h = c.hidden_size
            self.lm_head = nn.Linear(h, c.vocab_size, bias=False)
            for p in self.lm_head.parameters():
                p.requires_grad = False
            self.clover_embed_tokens = nn.Embedding(c.vocab_size, h, c.pad_token_id)
            for p in self.clover_embed_tokens.parameters():
                p.requires_grad = False
            self.layers = nn.ModuleList([LlamaDecoderLayer(layer_cfg, i) for i in range(num_layers)])
            self.clover_norm = LlamaRMSNorm(h, eps=eps)
            self.clover_head_norm = LlamaRMSNorm(h, eps=eps)
            self.clover_head_mlp = nn.Linear(h, h)
            self.clover_head_mlp2 = nn.Linear(2 * h, h)
            self.clover_head_mlp_rnn = ResAttentionBlock(h, c.num_attention_heads, eps)
            self.clover_head_mlp_rnn2 = ResAttentionBlock(h, c.num_attention_heads, eps)
            # non-persistent buffers only: not part of the state dict (as the reference's per-layer rotary_emb)
            self.rotary_emb = LlamaRotaryEmbedding(config=layer_cfg)

        def forward_clover_h(self, hidden_states, input_ids, attention_mask):
            token_emb = self.clover_embed_tokens(input_ids)
            hs = self.clover_head_mlp_rnn(hidden_states, token_emb)
            b, t, _ = hs.shape
            position_ids = torch.arange(t, dtype=torch.long)[None].expand(b, t)
            # the reference's _prepare_decoder_attention_mask_clover: causal + key padding, float32 min
            neg = torch.finfo(torch.float32).min
            causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
            keep = causal[None, None] & attention_mask.bool()[:, None, None, :]
            mask = torch.zeros(b, 1, t, t).masked_fill(~keep, neg)
            pos_emb = self.rotary_emb(hs, position_ids)
            for layer in self.layers:
                hs = layer(hs, attention_mask=mask, position_ids=position_ids, position_embeddings=pos_emb)
            return self.clover_norm(hs), token_emb

        def forward_rnn(self, hidden_states, head_idx, token_emb):
            if head_idx > 0:
                hidden_states = self.clover_head_mlp_rnn2(hidden_states, token_emb)
                o = self.clover_head_norm(self.clover_head_mlp2(torch.concat([hidden_states, token_emb], dim=-1)))
                return o, hidden_states
            return self.clover_head_norm(self.clover_head_mlp(hidden_states)), hidden_states

        def forward(self, hidden_states, input_ids, attention_mask):
            """`[num_heads, B, T, D]` head outputs (before lm_head), zero-padded as the reference's get_all_head."""
            hs, token_emb = self.forward_clover_h(hidden_states, input_ids, attention_mask)
            seq = []
            for i in range(num_heads):
                hs = hs[:, : token_emb.size(1) - i].contiguous()
                o, hs = self.forward_rnn(hs, i, token_emb[:, i:])
                pad = torch.zeros_like(token_emb)
                pad[:, : token_emb.size(1) - i] = o
                seq.append(pad)
            return torch.stack(seq)

    return Clover2Model().eval()


def _load_reference(torch, folder, head):
    from safetensors.torch import load_file

    model = _reference_model(torch, head.base_config, head.cfg.num_heads, head.cfg.num_aug_layers)
    tensors = load_file(str(folder / "model.safetensors"))
    assert set(tensors) == set(model.state_dict())  # the same statement as strict=True, with a readable diff
    result = model.load_state_dict(tensors, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return model


def _torch_outputs(torch, model, inputs):
    f, tokens, valid = (np.asarray(x) for x in inputs)
    y = np.concatenate([tokens[:, 1:], np.zeros((tokens.shape[0], 1), tokens.dtype)], axis=1)  # y_t = x_{t+1}
    with torch.no_grad():
        o = model(torch.tensor(f), torch.tensor(y, dtype=torch.long), torch.tensor(valid))
        logits = model.lm_head(o)
    return o.numpy(), logits.numpy()


# ----------------------------------------------------------------------------- tests
@pytest.mark.torch
@pytest.mark.slow  # builds the torch reference
def test_export_loads_strictly_and_matches_reference_forward(tmp_path, base, head, inputs):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    out = export_head(head, tmp_path / "head", base=base)
    model = _load_reference(torch, out, head)
    assert not model.lm_head.weight.requires_grad and not model.clover_embed_tokens.weight.requires_grad
    np.testing.assert_array_equal(model.lm_head.weight.numpy(), np.asarray(base.lm_head_matrix()).T)

    want_o, want_logits = _torch_outputs(torch, model, inputs)
    got_o = head.train_outputs(base, *inputs)
    assert got_o.shape == want_o.shape == (head.cfg.num_heads, B, T, D)
    np.testing.assert_allclose(np.asarray(got_o), want_o, atol=1e-4, rtol=0)
    got_logits = head.logits(base, got_o)
    np.testing.assert_allclose(np.asarray(got_logits), want_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.torch
def test_rope_following_base_does_not_match_reference(tmp_path, base, head, head_follows_base, inputs):
    """The check above can fail: the same parameters under the base's RoPE (500000, llama3) give other outputs."""
    torch = pytest.importorskip("torch")
    out = export_head(head_follows_base, tmp_path / "follows", base=base)
    model = _load_reference(torch, out, head_follows_base)  # same names: the RoPE is not a tensor
    want_o, _ = _torch_outputs(torch, model, inputs)
    got = np.asarray(head_follows_base.train_outputs(base, *inputs))
    assert np.max(np.abs(got - want_o)) > 1e-3
    # head 0 onwards all depend on the Augmenting Block, so every head differs
    assert all(np.max(np.abs(got[i] - want_o[i])) > 1e-3 for i in range(got.shape[0]))
    # ... while the default head (same parameters) matches
    np.testing.assert_allclose(np.asarray(head.train_outputs(base, *inputs)), want_o, atol=1e-4, rtol=0)


def test_rope_recorded_in_config_and_imported_back(tmp_path, base, head, head_follows_base, inputs):
    for h, name, theta, follows, scaling in [
        (head, "ref", REFERENCE_ROPE_THETA, False, None),
        (head_follows_base, "follows", BASE_THETA, True, CFG.to_hf_dict()["rope_scaling"]),
    ]:
        out = export_head(h, tmp_path / name, base=base)
        meta = json.loads((out / "config.json").read_text())
        assert meta["rope_theta"] == theta and isinstance(meta["rope_theta"], float)
        assert meta["rope_follows_base"] is follows
        assert meta["rope_scaling"] == scaling
        assert meta["base_model"]["rope_theta"] == BASE_THETA
        back = import_head(out, base)
        assert back.cfg.rope_theta == h.cfg.rope_theta
        assert back.aug.config.rope_theta == theta and back.aug.config.rope_scaling == h.aug.config.rope_scaling
        np.testing.assert_array_equal(np.asarray(back.train_outputs(base, *inputs)),
                                      np.asarray(h.train_outputs(base, *inputs)))
    assert head.cfg.rope_theta == 10000.0 and head_follows_base.cfg.rope_theta is None


def test_export_without_embedding(tmp_path, base, head, inputs):
    from safetensors import safe_open

    out = export_head(head, tmp_path / "noemb", base=base, include_embedding=False)
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "clover_embed_tokens.weight" not in keys
    assert "clover_head_mlp.weight" in keys and "layers.1.mlp.down_proj.weight" in keys
    back = import_head(out, base)
    a = nnx.to_pure_dict(nnx.state(head, nnx.Param))
    b = nnx.to_pure_dict(nnx.state(back, nnx.Param))
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
    np.testing.assert_array_equal(np.asarray(back.train_outputs(base, *inputs)),
                                  np.asarray(head.train_outputs(base, *inputs)))
