"""Models and heads named by a Hugging Face hub repository id, resolved through huggingface_hub's own cache.

No network here: the tests fill a hub cache the way `huggingface_hub` lays it out (refs/<revision> -> commit,
snapshots/<commit>/files) and run with HF_HUB_OFFLINE, so `snapshot_download` itself resolves the names."""

import hashlib
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from clover_jax.heads.clover2.model import Clover2Config, init_from_base
from clover_jax.io import hub
from clover_jax.heads.export import export_head
from clover_jax.io.export import export_base
from clover_jax.io.loader import load_model
from clover_jax.models.llama import init_llama
from tiny_llama import TINY_LLAMA

CFG = TINY_LLAMA


@pytest.mark.parametrize("name, want", [
    ("meta-llama/Meta-Llama-3-8B-Instruct", ("meta-llama/Meta-Llama-3-8B-Instruct", None)),
    ("me/head@v1.2", ("me/head", "v1.2")),
    ("hf://me/head@refs/pr/3", ("me/head", "refs/pr/3")),
    ("  org_x/model.v2  ", ("org_x/model.v2", None)),
    ("smollm2-135m-instruct", None),  # a bare name: a registered name or a local file, never the hub
    ("/abs/path/model", None),
    ("runs/a/b", None),
    ("./runs/x", None),
    ("model.gguf", None),
])
def test_parse_repo_id(name, want):
    assert hub.parse_repo_id(name) == want


def test_hub_prefix_with_a_malformed_id_is_an_error():
    with pytest.raises(hub.HubError, match="expected hf://owner/name"):
        hub.parse_repo_id("hf://not-a-repo")


def _publish(folder, cache, repo_id, revision="main"):
    """Puts `folder` into a hub cache as `repo_id` at `revision` (what a download leaves behind)."""
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub._snapshot.cache_clear()
    hub._has_safetensors.cache_clear()
    yield cache
    hub._snapshot.cache_clear()
    hub._has_safetensors.cache_clear()


def _params(module):
    return jax.tree.leaves(nnx.to_pure_dict(nnx.state(module, nnx.Param)))


@pytest.mark.slow  # exports and loads a model and a head
def test_model_and_head_by_repo_id(tmp_path, offline_hub, monkeypatch):
    from clover_jax import generate
    from clover_jax.training.loading import load_head

    base = init_llama(CFG, seed=3)
    head = init_from_base(base, Clover2Config(num_heads=3), seed=4)
    other = init_llama(CFG, seed=9)
    export_base(base, tmp_path / "base")
    export_base(other, tmp_path / "other")
    export_head(head, tmp_path / "head", base=base)
    _publish(tmp_path / "base", offline_hub, "me/tiny-llama")
    _publish(tmp_path / "other", offline_hub, "me/tiny-llama", revision="v2")
    _publish(tmp_path / "head", offline_hub, "me/tiny-clover2")

    lm = load_model("me/tiny-llama", with_tokenizer=False)
    for a, b in zip(_params(base), _params(lm.model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    at_v2 = load_model("hf://me/tiny-llama@v2", with_tokenizer=False)
    for a, b in zip(_params(other), _params(at_v2.model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    loaded = load_head("me/tiny-clover2", lm.model)
    for a, b in zip(_params(head), _params(loaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    prompts = [[5, 9, 17, 3, 22], [7, 1, 30]]
    by_name = generate(lm, prompts, mode="speculative", head="me/tiny-clover2", tree="chain-2", max_new_tokens=12)
    by_object = generate(lm, prompts, mode="speculative", head=loaded, tree="chain-2", max_new_tokens=12)
    assert by_name.token_ids == by_object.token_ids

    # a local folder of the same name wins over the hub
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tmp_path / "other", tmp_path / "me" / "tiny-llama")
    local = load_model("me/tiny-llama", with_tokenizer=False)
    for a, b in zip(_params(other), _params(local.model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_missing_repository_is_one_clear_error(tmp_path, offline_hub):
    from clover_jax.training.loading import load_head

    with pytest.raises(hub.HubError, match=r"model 'me/absent' is not a local path, and downloading the Hugging "
                                           r"Face hub repository 'me/absent' failed .*HF_HUB_OFFLINE is set"):
        load_model("me/absent")
    (tmp_path / "any").mkdir()
    _publish(tmp_path / "any", offline_hub, "me/there")  # the repository is cached, the revision is not
    with pytest.raises(hub.HubError, match="'me/there' at revision 'v9' failed"):
        load_model("me/there@v9")
    with pytest.raises(FileNotFoundError, match="head 'me/no-head' is not a local path"):
        load_head("me/no-head", init_llama(CFG, seed=0))
    with pytest.raises(FileNotFoundError, match="neither a local folder/file, a known name"):
        load_model("no-such-model-anywhere")  # not shaped like a repository id: no hub lookup


def test_only_the_needed_files_are_downloaded(tmp_path, monkeypatch):
    """Online: a model's torch weights are fetched only when its repository has no safetensors (both kinds in
    one repository would double the download), Meta's `original/` folder never; a head takes either format."""
    import huggingface_hub
    from huggingface_hub import constants

    listing = {"org/st": ["config.json", "model-00001-of-00002.safetensors", "pytorch_model-00001-of-00002.bin",
                          "original/consolidated.00.pth"],
               "org/bin-only": ["config.json", "pytorch_model.bin", "tokenizer.json"]}
    asked = {}

    def fake_download(repo_id, revision=None, allow_patterns=None, ignore_patterns=None, **kw):
        asked[repo_id] = (allow_patterns, ignore_patterns)
        return str(tmp_path)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda self, repo_id, revision=None: listing[repo_id])
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    hub._snapshot.cache_clear()
    hub._has_safetensors.cache_clear()
    try:
        assert hub.resolve("org/st", "model") == tmp_path
        assert hub.resolve("org/bin-only", "model") == tmp_path
        assert hub.resolve("org/a-head", "head") == tmp_path
    finally:
        hub._snapshot.cache_clear()
        hub._has_safetensors.cache_clear()
    allow, skip = asked["org/st"]
    assert "*.safetensors" in allow and not any(p.endswith(".bin") for p in allow) and skip == ["original/*"]
    allow, _ = asked["org/bin-only"]
    assert "pytorch_model*.bin" in allow
    allow, _ = asked["org/a-head"]
    assert {"*.safetensors", "*.pt", "pytorch_model*.bin", "*.json"} <= set(allow)
