"""EAGLE-3 against the reference code itself: SafeAILab/EAGLE's `eagle/model/cnets.py` `Model`, imported from a
checkout named by `CLOVER_JAX_EAGLE_SOURCE` (the repository's root; its code is never copied here).

  * our export loads into the reference module with `load_state_dict(strict=True)`, and both compute the same draft
    logits (float32 rounding) from the same base features;
  * the reference's EAGLE-2 tree drafting (`topK_genrate`) and our dynamic-tree drafter give the same tree (the same
    token paths) over two rounds: the prompt, then a few accepted tokens;
  * a folder of the reference module's own state dict (`pytorch_model.bin`, as its heads are published) and config
    imports into ours and computes the same.

Without the checkout these tests are skipped (the reference is not installable from a package index); the checks
that need no reference code run in tests/heads/test_eagle3.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.heads.eagle3 import Eagle3Config, Eagle3Head, init_from_base
from clover_jax.heads.export import export_head, import_head
from clover_jax.heads.losses import base_features
from clover_jax.heads.registry import drafter_for
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import init_llama

SOURCE = os.environ.get("CLOVER_JAX_EAGLE_SOURCE")
pytestmark = [pytest.mark.torch, pytest.mark.skipif(
    not SOURCE or not (Path(SOURCE) / "eagle" / "model" / "cnets.py").is_file(),
    reason="set CLOVER_JAX_EAGLE_SOURCE to a checkout of SafeAILab/EAGLE (with eagle/model/cnets.py)")]

CFG = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, rope_theta=500000.0, eos_token_ids=(2,))
TAPS = (1, 3, 4)
VOCAB = np.asarray(sorted({0, 1, 2, *range(5, 96, 3)}), np.int32)  # 34 of 96 tokens
THETA = 10000.0  # the reference's draft RoPE base (it reads rope_theta from its config; 10000 when absent)


def _reference(torch):
    sys.path.insert(0, SOURCE)
    from eagle.model.cnets import Model
    from eagle.model.configs import EConfig
    return torch, Model, EConfig


def _econfig(EConfig, q, b: LlamaConfig = CFG):
    c = EConfig(vocab_size=b.vocab_size, hidden_size=b.hidden_size, intermediate_size=b.intermediate_size,
                num_hidden_layers=1, num_attention_heads=b.num_attention_heads,
                num_key_value_heads=b.num_key_value_heads, draft_vocab_size=q, rms_norm_eps=b.rms_norm_eps,
                max_position_embeddings=512, pad_token_id=0, hidden_act="silu")
    c.rope_scaling = None  # plain RoPE (the reference reads rope_scaling["type"] otherwise)
    c.rope_theta = THETA
    return c


def _head(base, q, seed=1, taps=TAPS):
    head = init_from_base(base, Eagle3Config(feature_layers=taps, draft_vocab_size=q, rope_theta=THETA), seed)
    keys = jax.random.split(jax.random.key(seed + 7), 3)
    head.wq[...] = head.wq[...] + 0.6 * jax.random.normal(keys[0], head.wq.shape)  # attention that matters
    head.wk[...] = head.wk[...] + 0.6 * jax.random.normal(keys[1], head.wk.shape)
    head.out_norm[...] = 1 + 0.3 * jax.random.normal(keys[2], head.out_norm.shape)
    head.head_w[...] = head.head_w[...] * 6  # confident drafts: the kept tree reaches the deepest level
    return head


@pytest.fixture(scope="module")
def base():
    return init_llama(CFG, seed=0)


def _tree_paths(tokens, ancestors) -> set[tuple[int, ...]]:
    """Every node's root-to-node token path, from tokens `[U]` and `ancestors(i)` (the node indices above i, root
    first)."""
    return {tuple(int(tokens[j]) for j in ancestors(i)) + (int(tokens[i]),) for i in range(len(tokens))}


@pytest.mark.parametrize("q", [len(VOCAB), CFG.vocab_size])
def test_export_loads_strictly_and_drafts_the_references_trees(base, tmp_path, q):
    vocab = VOCAB if q < CFG.vocab_size else None
    seq = np.random.default_rng(5).integers(3, CFG.vocab_size, (1, 16)).astype(np.int32)  # x_0 .. x_15
    _compare_with_reference(base, _head(base, 0 if vocab is None else q), vocab, seq, tmp_path)


@pytest.mark.slow
def test_on_smollm2_features(smollm, tmp_path):
    """The same comparison on SmolLM2-135M-Instruct's own features of a chat prompt (EAGLE-3's default layers)."""
    from clover_jax.heads.eagle3 import default_feature_layers
    from clover_jax.io.prompts import encode_prompts

    base = smollm.model
    taps = default_feature_layers(base.config.num_hidden_layers)
    seq = np.asarray([encode_prompts(smollm.tokenizer, ["Name three primary colours."])[0][:16]], np.int32)
    vocab = np.unique(np.concatenate([np.arange(3), seq[0], np.arange(100, 4100)])).astype(np.int32)
    _compare_with_reference(base, _head(base, len(vocab), taps=taps), vocab, seq, tmp_path)


def _compare_with_reference(base, head, vocab, seq, tmp_path):
    """Strict load of `head`'s export into the reference, the same draft logits over `seq [1, 16]`'s first 10
    pairs, and the same EAGLE-2 trees over two rounds (root x_10, then x_13 after 3 accepted tokens)."""
    torch, Model, EConfig = _reference(pytest.importorskip("torch"))
    from safetensors.torch import load_file

    c = base.config
    out = export_head(head, tmp_path / "ours", base=base, draft_vocab=vocab)
    depth, top_k, total = 4, 2, 16  # the reference's depth counts the levels below the first
    ref = Model(_econfig(EConfig, head.vocab_size, c), load_emb=False, total_tokens=total, depth=depth,
                top_k=top_k).eval()
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == set(ref.state_dict())
    ref.load_state_dict(tensors, strict=True)
    ref.init_tree()

    valid = jnp.ones(seq.shape, bool)
    f = base_features(base, jnp.asarray(seq), valid, taps=head.cfg.feature_layers)  # [1, 16, 4D]
    g = np.asarray(f)[..., :3 * c.hidden_size]

    # the draft logits of one pass over the pairs (g_t, x_{t+1})
    t = 10
    with torch.no_grad():
        hid = ref(torch.tensor(g[:, :t]), input_ids=torch.tensor(seq[:, 1:t + 1], dtype=torch.long))
        want = ref.lm_head(ref.norm(hid)).numpy()
    o0 = head.train_outputs(base, f[:, :t + 1], jnp.asarray(seq[:, :t + 1]), valid[:, :t + 1])[0][:, :t]
    got = np.asarray(jnp.einsum("BTD,DQ->BTQ", o0, head.head_w[...]))
    np.testing.assert_allclose(got, want, atol=5e-4 * max(1.0, float(np.abs(want).max()) / 10), rtol=0)

    # two rounds of tree drafting: the prompt x_0..x_10 (root x_10), then 3 accepted tokens (root x_13)
    d = drafter_for(Eagle3Head, f"dynamic-{total}-d{depth + 1}-k{top_k}", vocab)
    state = d.init_state(head, base, 1, 64)
    ref.reset_kv()
    deepest = 0
    for end, new in ((t, None), (t + 3, 3)):
        with torch.no_grad():
            hs = g[:, :end] if new is None else g[:, end - new:end]
            tokens, _, mask, _ = ref.topK_genrate(torch.tensor(hs), torch.tensor(seq[:, :end + 1], dtype=torch.long),
                                                   None, None)
        tokens, mask = tokens[0].numpy(), mask[0, 0].numpy().astype(bool)
        want_paths = _tree_paths(tokens, lambda i, mask=mask: [j for j in np.nonzero(mask[i])[0] if j != i])
        y = jnp.asarray(seq[:, 1:end + 1])
        if new is None:
            state = d.start(head, base, state, f[:, :end], y, jnp.array([end]))
        else:
            state = d.commit(head, base, state, f[:, end - new:end], y[:, end - new:], jnp.array([new]))
        prop = d.propose(head, base, state, jnp.asarray(seq[:, end]), jax.random.key(0))
        ours, parent = np.asarray(prop.tokens[0]), np.asarray(prop.buffers.parent[0])

        def up(i, parent=parent):
            chain = []
            while parent[i] >= 0:
                i = int(parent[i])
                chain.append(i)
            return chain[::-1]

        assert _tree_paths(ours, up) == want_paths, (end, sorted(want_paths))
        deepest = max(deepest, max(len(p) for p in want_paths))
    assert deepest == depth + 2  # the root and all depth + 1 drafted levels were compared


def test_a_folder_the_reference_writes_imports(base, tmp_path):
    torch, Model, EConfig = _reference(pytest.importorskip("torch"))
    q = len(VOCAB)
    torch.manual_seed(0)
    ref = Model(_econfig(EConfig, q), load_emb=False).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.add_(0.2 * torch.randn_like(p))
        ref.embed_tokens.weight.copy_(torch.tensor(np.asarray(base.embed[...])))
        ref.d2t.copy_(torch.tensor(VOCAB - np.arange(q)))
        ref.t2d.zero_()
        ref.t2d[torch.tensor(VOCAB, dtype=torch.long)] = True
    folder = tmp_path / "reference"
    folder.mkdir()
    torch.save(ref.state_dict(), folder / "pytorch_model.bin")  # as the reference's published heads ship
    meta = {**ref.config.to_dict(), "architectures": ["LlamaForCausalLMEagle3"],
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in TAPS]}}
    (folder / "config.json").write_text(json.dumps(meta))

    head = import_head(folder, base)
    assert head.vocab_size == q and head.cfg.feature_layers == TAPS and head.cfg.rope_theta == THETA
    seq = np.random.default_rng(2).integers(3, CFG.vocab_size, (1, 9)).astype(np.int32)
    f = base_features(base, jnp.asarray(seq), jnp.ones(seq.shape, bool), taps=TAPS)
    g = np.asarray(f)[..., :3 * CFG.hidden_size]
    with torch.no_grad():
        want = ref.lm_head(ref.norm(ref(torch.tensor(g[:, :8]), input_ids=torch.tensor(seq[:, 1:9],
                                                                                       dtype=torch.long)))).numpy()
    o0 = head.train_outputs(base, f, jnp.asarray(seq), jnp.ones(seq.shape, bool))[0][:, :8]
    np.testing.assert_allclose(np.asarray(jnp.einsum("BTD,DQ->BTQ", o0, head.head_w[...])), want, atol=2e-4, rtol=0)
