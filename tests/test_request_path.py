"""One request, resolved once: `clover_jax.generate` checks the request, reads the head's folder once, parses the
tree once, builds the plan and runs it; bad requests are named errors; the cache holds exactly what it must."""

import dataclasses
import inspect
import json
import pathlib
import pydoc

import numpy as np
import pytest

import clover_jax
from clover_jax import pretrained
from clover_jax.decoding.trees import names as tree_names
from clover_jax import api
from clover_jax.generation.plan import plan_request
from clover_jax.generation.request import check_request
from clover_jax.heads.clover2.model import Clover2Config, init_from_base
from clover_jax.heads.export import export_head
from clover_jax.io.loader import LoadedModel
from clover_jax.models.cache import CacheOverflowError
from clover_jax.models.config import LlamaConfig
from clover_jax.training.checkpoint import CheckpointError
from clover_jax.tuning import choose
from word_tokenizer import WordTokenizer
from clover_jax.models.llama import init_llama
from clover_jax.validation import InputError

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=512, eos_token_ids=())
FITTED = "fit-3-c0ffee"


@pytest.fixture(scope="module")
def base_and_folder(tmp_path_factory):
    base = init_llama(CFG, seed=0)
    head = init_from_base(base, Clover2Config(), seed=1)
    folder = tmp_path_factory.mktemp("head") / "clover2"
    export_head(head, folder, base=base)
    # a calibration's fitted tree, known by name only to this head
    (folder / "calibration.json").write_text(json.dumps(
        {"kept_trees": {FITTED: {"choices": [[0], [0, 0]], "top_k": 1}}, "entries": {}}))
    return base, folder


@pytest.fixture
def counted(monkeypatch):
    """Counts the head sources turned into folders and the tree names parsed by the grammar."""
    calls = {"folders": 0, "parses": 0, "configs": 0}  # head sources resolved, tree names parsed, config.json reads
    head_path = pretrained.head_path
    read_text = pathlib.Path.read_text

    def counting_read_text(self, *args, **kwargs):
        calls["configs"] += self.name == "config.json"
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", counting_read_text)

    def counting_head_path(source):
        calls["folders"] += 1
        return head_path(source)

    first = tree_names.GRAMMAR[0]

    def counting_parse(name, resolve):
        calls["parses"] += 1
        return first.parse(name, resolve)

    monkeypatch.setattr(pretrained, "head_path", counting_head_path)
    monkeypatch.setattr(tree_names, "GRAMMAR", [tree_names.NameForm(counting_parse, first.listed)]
                        + tree_names.GRAMMAR[1:])
    return calls


PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.mark.parametrize("tree", ["chain-2", f"{FITTED}+lookup-2", "default"])
@pytest.mark.slow  # generates per tree
def test_one_generate_call_reads_the_head_folder_once_and_parses_the_tree_once(base_and_folder, counted, tree):
    base, folder = base_and_folder
    ar = clover_jax.generate(base, PROMPTS, max_new_tokens=8)
    clover_jax.heads.bundle._CACHE.clear()  # the head not loaded yet
    counted.update(folders=0, parses=0, configs=0)
    res = clover_jax.generate(base, PROMPTS, max_new_tokens=8, mode="speculative", head=str(folder), tree=tree)
    assert counted == {"folders": 1, "parses": 1, "configs": 1}, counted
    assert res.token_ids == ar.token_ids and res.stats["mode"] == "speculative"
    assert res.stats["tree"] == {"default": "clover2-26"}.get(tree, tree)


@pytest.mark.slow  # times candidate trees
def test_a_first_request_with_no_tree_reads_the_head_folder_once(base_and_folder, counted, monkeypatch, tmp_path):
    """No tree named: the choice compiles and times the head's default tree against plain decoding (on this tiny
    model), keeps its answer, and the request then drafts what it chose; the head's folder is read once for all of
    it, and the output is plain decoding's."""
    monkeypatch.setenv("CLOVER_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(choose, "_MEMO", {})
    base, folder = base_and_folder
    lm = LoadedModel(base.config, base, WordTokenizer(), "")
    ar = clover_jax.generate(lm, ["a b c d e"], max_new_tokens=8, chat=False)
    clover_jax.heads.bundle._CACHE.clear()  # the head not loaded yet: its config.json is read, once
    counted.update(folders=0, parses=0, configs=0)
    res = clover_jax.generate(lm, ["a b c d e"], max_new_tokens=8, chat=False, mode="speculative", head=str(folder))
    assert counted["folders"] == 1 and counted["configs"] == 1, counted
    assert res.stats["choice"]["measured_s"] > 0  # measured here, not read from a saved choice
    assert res.stats["mode"] == ("ar" if res.stats["choice"]["tree"] == "ar" else "speculative")
    assert res.token_ids == ar.token_ids
    counted.update(folders=0)
    again = clover_jax.generate(lm, ["a b c d e"], max_new_tokens=8, chat=False, mode="speculative", head=str(folder))
    assert counted["folders"] == 1
    # the saved choice answers the second request; only the first printed its note
    assert res.stats["choice"].pop("announced") and not again.stats["choice"].pop("announced")
    assert again.stats["choice"] == res.stats["choice"]


@pytest.mark.slow  # generates three times
def test_a_head_folder_is_loaded_once_across_calls(base_and_folder):
    base, folder = base_and_folder
    first = clover_jax.prepare_generate(base, PROMPTS, mode="speculative", head=str(folder), tree="chain-2")
    again = clover_jax.prepare_generate(base, PROMPTS, mode="speculative", head=folder, tree="chain-3")
    assert again.head is first.head and again.tree.name == "chain-3"


def test_mode_follows_from_the_draft(base_and_folder):
    base, folder = base_and_folder
    assert clover_jax.prepare_generate(base, PROMPTS).mode == "ar"
    plan = clover_jax.prepare_generate(base, PROMPTS, mode="speculative", head=str(folder), tree="chain-2")
    assert plan.mode == "speculative" and plan.drafter is not None and plan.tree.name == "chain-2"


@pytest.mark.slow  # a speculative loop
def test_a_tree_may_be_a_list_of_paths(base_and_folder):
    base, folder = base_and_folder
    ar = clover_jax.generate(base, PROMPTS, max_new_tokens=8)
    res = clover_jax.generate(base, PROMPTS, max_new_tokens=8, mode="speculative", head=str(folder),
                              tree=[[0], [0, 0], [1]])
    assert res.token_ids == ar.token_ids and len(res.stats["accept_hist"]) == 3


@pytest.mark.parametrize("tree, match", [(5, "tree: expected a tree name.*got int 5"),
                                         (3.5, "tree: expected a tree name.*got float"),
                                         ([[0], [2, 0]], "parent"),
                                         ("", "tree: an empty name"),
                                         ("fit-3-abcdef", "fitted tree")])
def test_a_bad_tree_is_a_named_error_before_anything_compiles(base_and_folder, tree, match):
    base, folder = base_and_folder
    with pytest.raises(InputError, match=match):
        clover_jax.prepare_generate(base, PROMPTS, mode="speculative", head=str(folder), tree=tree)


def test_a_bad_head_is_a_named_error(base_and_folder):
    base, _ = base_and_folder
    with pytest.raises(InputError, match="head: expected a registered head name.*got int"):
        clover_jax.prepare_generate(base, PROMPTS, mode="speculative", head=5, tree="chain-2")


def test_tree_auto_is_settled_before_the_draft_is_resolved(base_and_folder):
    base, folder = base_and_folder
    request = check_request(base, PROMPTS, mode="speculative", head=str(folder), tree="auto")
    with pytest.raises(InputError, match="tree='auto' is resolved by a calibration"):
        plan_request(request)


def test_a_run_directory_without_checkpoints_is_a_named_error(base_and_folder, tmp_path):
    base, _ = base_and_folder
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="run/checkpoints: no checkpoint found"):
        clover_jax.prepare_generate(base, PROMPTS, mode="speculative", head=str(run), tree="chain-2")


@pytest.mark.parametrize("call", ["generate", "prepare_generate", "stream_text", "warmup"])
def test_each_public_call_is_defined_once_and_shows_its_parameters(call):
    fn = getattr(clover_jax, call)
    assert fn is getattr(api, call) and fn.__module__ == "clover_jax.api"
    params = inspect.signature(fn).parameters
    for name in ("max_new_tokens", "temperature", "mode", "head", "tree", "mesh", "prompt_bucket"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, (call, name)
    assert not {"decide", "run_loader", "kwargs", "options"} & set(params), (call, list(params))
    assert ("stream" in params) == (call in ("generate", "prepare_generate"))
    assert "max_new_tokens" in pydoc.render_doc(fn)


def test_a_public_call_rejects_an_unknown_parameter_by_name(base_and_folder):
    base, _ = base_and_folder
    with pytest.raises(TypeError, match=r"^generate\(\) got an unexpected keyword argument 'max_new_token'; did you "
                                        r"mean 'max_new_tokens'\?$"):
        clover_jax.generate(base, PROMPTS, max_new_token=8)
    with pytest.raises(TypeError, match=r"^stream_text\(\) got an unexpected keyword argument 'hed'; did you mean "
                                        r"'head'\?$"):
        clover_jax.stream_text(base, PROMPTS[0], hed="x")
    with pytest.raises(TypeError, match=r"^warmup\(\) got an unexpected keyword argument 'colour'$"):
        clover_jax.warmup(base, PROMPTS, colour=1)


def test_a_plan_is_frozen_and_holds_its_draft(base_and_folder):
    base, folder = base_and_folder
    plan = clover_jax.prepare_generate(base, PROMPTS, mode="speculative", head=str(folder), tree="chain-2")
    assert plan.draft.policy is plan.tree and plan.draft.drafter is plan.drafter and plan.head is plan.draft.head
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.cache_size = 1


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.slow  # generates per setting
def test_the_cache_holds_exactly_what_the_request_needs(base_and_folder, speculative):
    """A 100-token prompt pads to a 128-token bucket: a cache of any size from what the request needs (prompt + new
    tokens + the tree's slots) up to the bucket runs and returns plain decoding's tokens; one slot less is an
    error naming the sizes."""
    base, folder = base_and_folder
    prompt = [list(np.random.default_rng(0).integers(3, 60, size=100))]
    kw = dict(mode="speculative", head=str(folder), tree="chain-2") if speculative else {}
    need = 100 + 20 + (3 if speculative else 0)
    ar = clover_jax.generate(base, prompt, max_new_tokens=20)
    for size in (need, 127):
        res = clover_jax.generate(base, prompt, max_new_tokens=20, cache_size=size, **kw)
        assert res.token_ids == ar.token_ids, size
    with pytest.raises(CacheOverflowError, match=f"needs {need} cache slots but cache_size={need - 1}"):
        clover_jax.prepare_generate(base, prompt, max_new_tokens=20, cache_size=need - 1, **kw)


def test_a_fixed_prompt_bucket_pads_every_prompt_to_it(base_and_folder):
    base, _ = base_and_folder
    plan = clover_jax.prepare_generate(base, [[5] * 3, [6] * 40], max_new_tokens=8, prompt_bucket=128)
    assert plan.prompt.shape == (2, 128) and plan.cache_size == 256
    with pytest.raises(InputError, match="prompt_bucket: prompt 1 has 40 tokens, more than prompt_bucket=32"):
        clover_jax.prepare_generate(base, [[5] * 3, [6] * 40], prompt_bucket=32)
