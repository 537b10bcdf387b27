"""Export to Hugging Face folders and import back: base models (checked with transformers) and heads."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax.heads.clover2.model import Clover2Config, init_from_base
from clover_jax.heads.export import export_head, import_head
from clover_jax.io.export import ExportError, export_base
from clover_jax.io.hf import load_hf_dir
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import init_llama

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8)


def _reference_table(h, v, i_dim, n_layers, kv_dim):
    """The reference Clover-2 names and torch shapes (`Clover2Model` of XiaoBin1992/clover), written out by hand;
    the frozen `lm_head.weight` and `clover_embed_tokens.weight` included, as the reference module registers them."""
    t = {"lm_head.weight": (v, h), "clover_embed_tokens.weight": (v, h), "clover_norm.weight": (h,), "clover_head_norm.weight": (h,),
         "clover_head_mlp.weight": (h, h), "clover_head_mlp.bias": (h,),
         "clover_head_mlp2.weight": (h, 2 * h), "clover_head_mlp2.bias": (h,)}
    for ad in ("clover_head_mlp_rnn", "clover_head_mlp_rnn2"):
        t[f"{ad}.input_layernorm.weight"] = (h,)
        for x in "qkv":
            t[f"{ad}.{x}.weight"] = (h, h)
            t[f"{ad}.{x}.bias"] = (h,)
    for i in range(n_layers):
        p = f"layers.{i}"
        t.update({f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
                  f"{p}.self_attn.q_proj.weight": (h, h), f"{p}.self_attn.k_proj.weight": (kv_dim, h),
                  f"{p}.self_attn.v_proj.weight": (kv_dim, h), f"{p}.self_attn.o_proj.weight": (h, h),
                  f"{p}.mlp.gate_proj.weight": (i_dim, h), f"{p}.mlp.up_proj.weight": (i_dim, h),
                  f"{p}.mlp.down_proj.weight": (h, i_dim)})
    return t


@pytest.fixture(scope="module")
def base_and_head():
    base = init_llama(CFG, seed=0)
    head = init_from_base(base, Clover2Config(), seed=1)
    # make every parameter distinct from its init so the round trip really checks the mapping
    state = nnx.state(head, nnx.Param)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    nnx.update(head, jax.tree.unflatten(tree, [x + 0.01 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]))
    return base, head


@pytest.mark.slow  # builds the torch reference
def test_head_names_and_shapes_equal_reference(tmp_path, base_and_head):
    from safetensors import safe_open

    base, head = base_and_head
    out = export_head(head, tmp_path / "head", base=base, base_name="tiny")
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        assert f.metadata() == {"format": "pt"}
    assert got == _reference_table(32, 64, 48, 2, 16)
    meta = json.loads((out / "config.json").read_text())
    assert meta["head_type"] == "clover2" and meta["num_heads"] == 5 and meta["base_model"]["name_or_path"] == "tiny"
    assert "Clover-2" in (out / "README.md").read_text()


def test_head_round_trip_identical(tmp_path, base_and_head):
    base, head = base_and_head
    export_head(head, tmp_path / "h", base=base, max_shard_bytes=20_000)  # forces several shards + index
    assert (tmp_path / "h" / "model.safetensors.index.json").is_file()
    back = import_head(tmp_path / "h", base)
    a = nnx.to_pure_dict(nnx.state(head, nnx.Param))
    b = nnx.to_pure_dict(nnx.state(back, nnx.Param))
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
    f = jax.random.normal(jax.random.key(0), (2, 7, 32))
    toks = jax.random.randint(jax.random.key(1), (2, 7), 0, 64)
    valid = jnp.ones((2, 7), bool)
    np.testing.assert_array_equal(np.asarray(head.train_outputs(base, f, toks, valid)),
                                  np.asarray(back.train_outputs(base, f, toks, valid)))


def test_head_import_errors(tmp_path, base_and_head):
    base, head = base_and_head
    with pytest.raises(ExportError, match="no config.json"):
        import_head(tmp_path, base)
    export_base(base, tmp_path / "base")
    with pytest.raises(ExportError, match="no head_type and the folder is not a published head of a known type"):
        import_head(tmp_path / "base", base)
    export_head(head, tmp_path / "h", base=base)
    other = init_llama(LlamaConfig(**{**CFG.__dict__, "hidden_size": 48, "head_dim": 12}), seed=0)
    with pytest.raises(ExportError, match="hidden_size=32 does not match the base model's 48"):
        import_head(tmp_path / "h", other)
    with pytest.raises(ExportError, match="already exists"):
        export_head(head, tmp_path / "h", base=base)
    # a failing export leaves nothing behind
    with pytest.raises(ExportError):
        export_head(head, tmp_path / "partial")  # no base for the embedding copy
    assert not any(p.name.startswith(".partial") or p.name == "partial" for p in tmp_path.iterdir())


def test_base_round_trip_ours(tmp_path):
    base = init_llama(CFG, seed=5)
    export_base(base, tmp_path / "b", max_shard_bytes=50_000)
    assert (tmp_path / "b" / "model.safetensors.index.json").is_file()
    _, back = load_hf_dir(tmp_path / "b")
    a = nnx.to_pure_dict(nnx.state(base, nnx.Param))
    b = nnx.to_pure_dict(nnx.state(back, nnx.Param))
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


@pytest.mark.torch
@pytest.mark.parametrize("tied", [False, True])
def test_base_export_loads_in_transformers(tmp_path, tied):
    torch = pytest.importorskip("torch")
    import transformers

    base = init_llama(LlamaConfig(**{**CFG.__dict__, "tie_word_embeddings": tied}), seed=2)
    export_base(base, tmp_path / "b", max_shard_bytes=50_000)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "b"), dtype=torch.float32).eval()
    ids = np.random.RandomState(0).randint(0, 64, (2, 11))
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    got, *_ = base(jnp.asarray(ids))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.optimized
def test_exported_smollm2_generates_same_text_in_transformers(tmp_path, smollm):
    torch = pytest.importorskip("torch")
    import transformers

    from clover_jax import generate
    from clover_jax.io.prompts import encode_prompts

    out = export_base(smollm.model, tmp_path / "smol", tokenizer=smollm.tokenizer)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ids = encode_prompts(tok, ["Name three colors."])[0]
    assert ids == encode_prompts(smollm.tokenizer, ["Name three colors."])[0]
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=2)[0, len(ids):]
    ours = generate(smollm, [ids], max_new_tokens=32).token_ids[0]
    assert ours == want.tolist()[: len(ours)] and len(ours) >= min(32, len(want))


def test_push_without_network_fails_fast_and_keeps_folder(tmp_path, base_and_head):
    import time

    from clover_jax.cli.export import main

    base, head = base_and_head
    out = export_head(head, tmp_path / "h", base=base)
    before = sorted(p.name for p in out.iterdir())
    from clover_jax.cli.export import push_to_hub

    t0 = time.time()
    with pytest.raises(ExportError, match="nothing was uploaded.*intact"):
        push_to_hub(out, "someone/clover2-test", timeout=2.0)
    assert time.time() - t0 < 30
    assert sorted(p.name for p in out.iterdir()) == before
    assert main(["head", "--checkpoint", str(tmp_path / "no-run"), "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


def test_a_head_given_by_path_is_loaded_once_per_base_and_version(tmp_path, base_and_head):
    """`generate(head=folder)` in a loop reuses the loaded head; a changed folder or another base reloads it."""
    import os

    from clover_jax.heads.bundle import open_head

    def resolve_head(source, base):
        return (open_head(source, base).module,)

    base, head = base_and_head
    export_head(head, tmp_path / "h", base=base)
    first = resolve_head(tmp_path / "h", base)[0]
    assert resolve_head(str(tmp_path / "h"), base)[0] is first
    cfg = tmp_path / "h" / "config.json"
    st = cfg.stat()
    os.utime(cfg, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the folder changed: load it again
    assert resolve_head(tmp_path / "h", base)[0] is not first
    other = init_llama(CFG, seed=0)  # another base object (same weights)
    assert resolve_head(tmp_path / "h", other)[0] is not resolve_head(tmp_path / "h", base)[0]
