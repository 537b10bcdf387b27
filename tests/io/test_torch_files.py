"""PyTorch checkpoints read without torch (`clover_jax.io.torch_pickle`), and the heads and models published only
in that format: Medusa's `medusa_lm_head.pt`, EAGLE-1's `pytorch_model.bin`, transformers' `pytorch_model*.bin`.

torch writes every file here (it is only the reference, never imported by the library)."""

import dataclasses
import json
import pickle

import jax
import numpy as np
import pytest
from flax import nnx

from clover_jax.training.loading import load_head
from clover_jax.heads.export import export_head
from clover_jax.io.export import export_base
from clover_jax.io.hf import read_weights_dir
from clover_jax.io.loader import load_model
from clover_jax.io.torch_pickle import TorchFileError, read_torch_file
from clover_jax.models.llama import init_llama
from clover_jax.validation import WeightFileError
from tiny_llama import TINY_LLAMA

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

CFG = TINY_LLAMA


def _leaves(module):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(module, nnx.Param)))]


def test_state_dict_tensors_of_every_kind(tmp_path):
    grid = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    lin = torch.nn.Linear(5, 3)
    sd = {"w": torch.randn(3, 4), "transposed": grid.t(), "view": grid[1:3, 2:5], "half": torch.randn(2, 3).half(),
          "bf16": torch.randn(7).bfloat16(), "long": torch.arange(5), "bool": torch.tensor([True, False]),
          "scalar": torch.tensor(3.5), "param": lin.weight, "empty": torch.zeros(0, 4)}
    torch.save(sd, tmp_path / "sd.bin")
    got = read_torch_file(tmp_path / "sd.bin")
    assert list(got) == list(sd)
    for k, v in sd.items():
        want = v.detach().float().numpy() if v.dtype == torch.bfloat16 else v.detach().numpy()
        assert got[k].shape == want.shape and got[k].flags.c_contiguous, k
        assert str(got[k].dtype) == str(v.dtype).removeprefix("torch."), k
        np.testing.assert_array_equal(got[k].astype(np.float32) if v.dtype == torch.bfloat16 else got[k], want)


def test_files_that_are_not_plain_state_dicts_are_refused(tmp_path):
    torch.save(torch.nn.Linear(3, 2), tmp_path / "module.pt")  # a pickled module: would run code to rebuild
    with pytest.raises(TorchFileError, match="holds torch.nn.modules.linear.Linear, which a tensor checkpoint"):
        read_torch_file(tmp_path / "module.pt")
    torch.save({"w": torch.zeros(2), "step": 3}, tmp_path / "mixed.pt")
    with pytest.raises(TorchFileError, match="entry 'step' is not a tensor"):
        read_torch_file(tmp_path / "mixed.pt")
    (tmp_path / "legacy.bin").write_bytes(pickle.dumps({"w": [1.0]}))
    with pytest.raises(TorchFileError, match="not a zip-format torch checkpoint"):
        read_torch_file(tmp_path / "legacy.bin")
    torch.save({"w": torch.randn(64, 64)}, tmp_path / "pytorch_model.bin")
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "pytorch_model.bin").write_bytes((tmp_path / "pytorch_model.bin").read_bytes()[:5000])
    with pytest.raises(WeightFileError, match="pytorch_model.bin.*truncated or corrupt"):
        read_weights_dir(cut)


def test_a_transformers_checkpoint_in_pytorch_format_loads_without_torch(tmp_path):
    """A base model as transformers 4 wrote it with `safe_serialization=False` (lmsys/vicuna-7b-v1.5 ships so):
    `pytorch_model-0000i-of-00002.bin` shards and `pytorch_model.bin.index.json`; transformers reads it back
    identically, and so does `load_model`."""
    import shutil

    import transformers

    from clover_jax.io.hf import read_weights_file

    base = init_llama(CFG, seed=4)
    st = export_base(base, tmp_path / "st")
    tensors = {}
    for f in sorted(st.glob("*.safetensors")):
        get, keys = read_weights_file(f)
        tensors.update({k: torch.from_numpy(np.array(get(k))) for k in keys})
    pt = tmp_path / "pt"
    pt.mkdir()
    shutil.copy(st / "config.json", pt / "config.json")
    names = sorted(tensors)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file, keys in shards.items():
        torch.save({k: tensors[k] for k in keys}, pt / file)
    (pt / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(pt), dtype=torch.float32)
    assert torch.equal(ref.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    back = load_model(pt, with_tokenizer=False).model
    for a, b in zip(_leaves(base), _leaves(back)):
        np.testing.assert_array_equal(a, b)


def _medusa_module(d, v, n):
    class ResBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(d, d)
            self.act = torch.nn.SiLU()

        def forward(self, x):
            return x + self.act(self.linear(x))

    return torch.nn.ModuleList([torch.nn.Sequential(ResBlock(), torch.nn.Linear(d, v, bias=False))
                                for _ in range(n)])


def test_a_published_medusa_head_loads_and_computes_the_reference(tmp_path):
    """As FasterDecoding publishes its heads: `torch.save(medusa_head.state_dict())` as medusa_lm_head.pt and a
    config.json that understates the number of heads (its Vicuna heads say 2 and hold 5)."""
    import jax.numpy as jnp

    base = init_llama(CFG, seed=1)
    torch.manual_seed(0)
    ref = _medusa_module(CFG.hidden_size, CFG.vocab_size, 3)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    folder = tmp_path / "medusa-published"
    folder.mkdir()
    torch.save(ref.state_dict(), folder / "medusa_lm_head.pt")
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1,
                                                    "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}))
    head = load_head(folder, base)
    assert type(head).__name__ == "MedusaHead" and head.cfg.num_heads == 3 and head.cfg.num_layers == 1
    h = np.random.default_rng(1).normal(size=(4, CFG.hidden_size)).astype(np.float32)
    with torch.no_grad():
        want = np.stack([m(torch.from_numpy(h)).numpy() for m in ref])  # [n, 4, V]
    got = np.einsum("nbd,ndv->nbv", np.asarray(head.features(jnp.asarray(h))), np.asarray(head.proj[...]))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # builds and loads a published head
def test_a_published_eagle_head_loads(tmp_path):
    """As SafeAILab publishes EAGLE-1 heads: the draft module's state dict as pytorch_model.bin (with the
    frozen embedding and the unused `layers.0.input_layernorm`), config.json a Llama config with one layer."""
    from clover_jax.heads.eagle.head import EagleConfig, init_from_base
    from clover_jax.io.hf import read_weights_file

    base = init_llama(CFG, seed=2)
    head = init_from_base(base, EagleConfig(), seed=3)
    nnx.update(head, jax.tree.map(lambda x: x + 0.05, nnx.state(head, nnx.Param)))
    ours = export_head(head, tmp_path / "ours", base=base)
    get, keys = read_weights_file(ours / "model.safetensors")
    sd = {k: torch.from_numpy(np.array(get(k))) for k in keys}
    sd["layers.0.input_layernorm.weight"] = torch.ones(CFG.hidden_size)
    folder = tmp_path / "eagle-published"
    folder.mkdir()
    torch.save(sd, folder / "pytorch_model.bin")
    meta = json.loads((ours / "config.json").read_text())
    published = {k: v for k, v in meta.items() if k not in ("head_type", "architectures", "base_model",
                                                             "rope_follows_base")}
    (folder / "config.json").write_text(json.dumps({**published, "architectures": ["LlamaForCausalLM"]}))
    back = load_head(folder, base)
    assert type(back).__name__ == "EagleHead"
    for a, b in zip(_leaves(head), _leaves(back)):
        np.testing.assert_array_equal(a, b)
    # Vicuna's config.json names no rope_theta: the reference's layer then uses 10000, not the base's own base
    del published["rope_theta"]
    (folder / "config.json").write_text(json.dumps({**published, "architectures": ["LlamaForCausalLM"]}))
    base_1e5 = init_llama(dataclasses.replace(CFG, rope_theta=100000.0), seed=2)
    assert load_head(folder, base_1e5).cfg.rope_theta == 10000.0


def test_a_folder_of_no_known_head_is_a_clear_error(tmp_path):
    base = init_llama(CFG, seed=0)
    export_base(base, tmp_path / "a-base")
    with pytest.raises(Exception, match="no head_type and the folder is not a published head of a known type"):
        load_head(tmp_path / "a-base", base)
