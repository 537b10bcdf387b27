"""The real SmolLM2-135M-Instruct: our GGUF loader and generation vs transformers' own GGUF loader."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402

from clover_jax import generate  # noqa: E402
from clover_jax.io.prompts import encode_prompts

pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.optimized]


def test_config_and_tokenizer(smollm):
    c = smollm.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (30, 576, 9, 3)
    assert c.vocab_size == 49152 and c.tie_word_embeddings and c.rope_theta == 100000.0
    tok = smollm.tokenizer
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|endoftext|>"]) == [1, 2, 0]
    assert tok.eos_token_id == 2


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm):
    import transformers

    from clover_jax.io.loader import resolve_model_path

    path = resolve_model_path("smollm2-135m-instruct")
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = ["Hello world!", "  leading spaces and\ttabs\n\nnewlines", "naïve café – 東京 🙂", "x=1; y = [2,3]",
             "<|im_start|>user\nhi<|im_end|>"]
    for t in texts:
        assert smollm.tokenizer.encode(t) == ref.encode(t), t
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert encode_prompts(smollm.tokenizer, ["What is 2+2?"]) == [
        list(ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])]


def test_logits_match_transformers(smollm, smollm_torch, chat_prompts):
    ids = encode_prompts(smollm.tokenizer, chat_prompts[:2])
    for p in ids:
        with torch.no_grad():
            ref = smollm_torch(torch.tensor([p])).logits[0].numpy()
        logits, *_ = smollm.model(jnp.asarray([p]))
        np.testing.assert_allclose(np.asarray(logits[0]), ref, atol=1e-3, rtol=0)
        assert (np.asarray(logits[0]).argmax(-1) == ref.argmax(-1)).all()


def test_greedy_generation_matches_transformers(smollm, smollm_torch, chat_prompts):
    """Our jitted greedy loop emits exactly transformers' greedy `generate` tokens (64 new tokens)."""
    ids = encode_prompts(smollm.tokenizer, chat_prompts)
    ours = generate(smollm, ids, max_new_tokens=64)  # one batch, different prompt lengths
    for i, p in enumerate(ids):
        with torch.no_grad():
            ref = smollm_torch.generate(torch.tensor([p]), max_new_tokens=64, do_sample=False,
                                        eos_token_id=2, pad_token_id=2)[0, len(p):].tolist()
        assert ours.token_ids[i] == ref, f"prompt {i}: {smollm.tokenizer.decode(ours.token_ids[i])!r}"
    assert "Paris" in ours.texts[0]


def test_speculative_greedy_equals_autoregressive_random_head(smollm, chat_prompts):
    """Real model, randomly initialised Clover-2 head (most drafts rejected): identical tokens,
    batch 1 and a batch of 4 prompts of different lengths."""
    from clover_jax.heads.clover2.model import Clover2Config, init_from_base

    head = init_from_base(smollm.model, Clover2Config(), seed=0)
    ids = encode_prompts(smollm.tokenizer, chat_prompts)
    ar = generate(smollm, ids, max_new_tokens=32)
    sp = generate(smollm, ids, max_new_tokens=32, mode="speculative", head=head)
    assert sp.token_ids == ar.token_ids
    one = generate(smollm, ids[:1], max_new_tokens=32, mode="speculative", head=head)
    assert one.token_ids[0] == ar.token_ids[0]


def test_long_prompts_match_transformers_and_speculative(smollm, smollm_torch):
    """A Spec-Bench RAG prompt (over 600 tokens: prefilled in blocks against the cache) in one batch with a short
    one: our greedy tokens equal transformers' `generate`, and speculative decoding with the shipped head equals our
    autoregressive output."""
    from clover_jax.decoding.autoregressive import PREFILL_CHUNK
    from clover_jax.io.prompts import read_prompts

    ids = encode_prompts(smollm.tokenizer, read_prompts("spec_bench", category="rag", limit=1)
                         + ["What is the capital of France?"])
    assert len(ids[0]) > 2 * PREFILL_CHUNK and len(ids[1]) < PREFILL_CHUNK
    ours = generate(smollm, ids, max_new_tokens=24)
    for i, p in enumerate(ids):
        with torch.no_grad():
            ref = smollm_torch.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                                        eos_token_id=2, pad_token_id=2)[0, len(p):].tolist()
        assert ours.token_ids[i] == ref, f"prompt {i} ({len(p)} tokens)"
    spec = generate(smollm, ids, max_new_tokens=24, mode="speculative", head="smollm2-135m-instruct-clover2",
                    tree="default")
    assert spec.token_ids == ours.token_ids
