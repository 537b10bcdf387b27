"""The shipped head `smollm2-135m-instruct-clover2`: found by name everywhere, reference-format files, and an
acceptance floor on real MT-Bench prompts (a drafting bug that rejects every draft fails here, not only speed)."""

import json

import numpy as np
import pytest

from clover_jax import generate, pretrained
from clover_jax import prepare_generate
from clover_jax.decoding.acceptance_stats import tau as acceptance_tau
from clover_jax.heads.draft_vocab import head_draft_vocab
from clover_jax.training.loading import load_head
from clover_jax.io.prompts import questions_path

NAME = "smollm2-135m-instruct-clover2"
# tau of the shipped head on FLOOR_PROMPTS (greedy, chain-4, 64 new tokens, one batch) is TAU_MEASURED, as when it was
# shipped (see its model card); the floor leaves room for float noise across machines, not for a broken drafter.
TAU_MEASURED = 1.649  # hist [91, 37, 17, 7, 2] over 154 steps, on a CPU in float32
TAU_FLOOR = 1.55
FLOOR_PROMPTS = 4  # the first MT-Bench question of 4 categories

pytestmark = pytest.mark.optimized  # the real SmolLM2 and its shipped heads decode


def floor_prompts() -> list[str]:
    """The first MT-Bench question of the first FLOOR_PROMPTS categories."""
    rows = [json.loads(line) for line in questions_path("mt_bench").read_text().splitlines() if line.strip()]
    first_of = {}
    for r in rows:
        first_of.setdefault(r["category"], r["turns"][0])
    return list(first_of.values())[:FLOOR_PROMPTS]


def test_registry_resolves_names_and_paths(tmp_path):
    path = pretrained.head_path(NAME)
    assert path == pretrained.PRETRAINED_DIR / NAME and (path / "config.json").is_file()
    assert pretrained.head_path(NAME.upper()) == path
    assert pretrained.head_path(str(tmp_path)) == tmp_path  # anything else is a path
    assert pretrained.default_head("smollm2-135m-instruct") == NAME
    assert pretrained.default_head("some/other/model") is None
    assert pretrained.default_tree(NAME) == "fit-5-411aab+lookup-4-table"
    assert pretrained.default_tree(str(tmp_path)) is None


@pytest.mark.slow  # loads the real SmolLM2 weights
def test_unknown_head_is_a_clear_error(smollm):
    with pytest.raises(FileNotFoundError, match="neither a folder nor a registered head.*" + NAME):
        load_head("smollm2-135m-instruct-clover9", smollm.model)


def test_shipped_files_are_reference_format_and_small():
    from safetensors import safe_open

    path = pretrained.head_path(NAME)
    meta = json.loads((path / "config.json").read_text())
    assert meta["head_type"] == "clover2" and meta["base_model"]["name_or_path"] == "smollm2-135m-instruct"
    # the reference's Augmenting-Block RoPE, recorded explicitly
    assert meta["rope_theta"] == 10000.0 and meta["rope_follows_base"] is False and meta["rope_scaling"] is None
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size < 40 * 2**20, f"the shipped head folder is {size / 2**20:.1f} MiB"
    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        names = set(f.keys())
        assert str(f.get_slice("clover_head_mlp.weight").get_dtype()).lower() in ("f16", "float16")
    assert {"clover_head_mlp.weight", "clover_head_mlp2.weight", "layers.1.mlp.down_proj.weight"} <= names
    # the frozen copies of the base's lm_head are left out (the model card says why); export adds them back
    assert not names & {"lm_head.weight", "clover_embed_tokens.weight"}
    ids = head_draft_vocab(NAME)
    assert ids is not None and len(ids) == 8192 and np.all(np.diff(ids) > 0)
    card = (path / "README.md").read_text()
    assert "tau" in card and "rope_theta" in card and "configs/smollm2-135m-clover2.yaml" in card


@pytest.fixture(scope="module")
def floor_ar(smollm) -> list[list[int]]:
    """Autoregressive greedy tokens of the floor prompts, one batch: the reference of the floor tests."""
    return generate(smollm, floor_prompts(), max_new_tokens=64).token_ids


def floor_tau(smollm, floor_ar, head: str, **kw) -> float:
    """Speculative greedy decoding of the floor prompts in one batch (chain-4: the head's drafts alone): asserts the
    output equals autoregressive decoding and returns tau over every row's steps."""
    sp = generate(smollm, floor_prompts(), max_new_tokens=64, mode="speculative", head=head, tree="chain-4", **kw)
    assert sp.token_ids == floor_ar
    return acceptance_tau(np.asarray(sp.stats["accept_hist"]))


@pytest.mark.slow
@pytest.mark.parametrize("layers", ["auto", "unrolled"])
def test_shipped_head_accepts_drafts_and_is_exact(smollm, floor_ar, layers):
    """Greedy, chain-4, 64 tokens, the 4 floor prompts in one batch: output == autoregressive, tau >= floor.
    `unrolled`: both loops as `layers="auto"` runs them on a GPU (where the unrolled loops' rounding may differ;
    on the CPU they agree, so both equal the scanned autoregressive loop's tokens)."""
    if layers == "unrolled":
        assert generate(smollm, floor_prompts(), max_new_tokens=64, layers=layers).token_ids == floor_ar
    tau = floor_tau(smollm, floor_ar, NAME, layers=layers)
    assert tau >= TAU_FLOOR, f"tau {tau:.3f} fell below the floor {TAU_FLOOR} (measured {TAU_MEASURED} when shipped)"


@pytest.mark.slow
def test_shipped_head_default_tree_resolves_by_name_and_is_exact(smollm):
    """`generate(..., head=NAME, tree="default")` drafts with the head's registered tree, a fitted tree known only from
    the head's calibration.json beside lookup and the head's n-gram table: exact, and accepting drafts."""
    prompts = ["List three prime numbers and explain why each is prime.", "Write a haiku about the sea."]
    ar = generate(smollm, prompts, max_new_tokens=32)
    plan = prepare_generate(smollm, prompts, max_new_tokens=32, mode="speculative", head=NAME, tree="default")
    assert plan.drafter.spec.name == pretrained.default_tree(NAME) == "fit-5-411aab+lookup-4-table"
    sp = generate(smollm, prompts, max_new_tokens=32, mode="speculative", head=NAME, tree="default")
    assert len(sp.stats["accept_hist"]) == plan.drafter.max_depth + 1 == 5
    assert sp.token_ids == ar.token_ids
    assert sp.stats["tau"] > 1.5  # MT-Bench tau: docs/results.md; a head or table that never drafted right gives ~1


# ---------------------------------------------------------------- the EAGLE head shipped beside it
EAGLE = "smollm2-135m-instruct-eagle"
# tau of the EAGLE head on FLOOR_PROMPTS (greedy, chain-4, 64 new tokens, one batch), measured on a CPU in float32
EAGLE_TAU_MEASURED = 1.797  # hist [72, 41, 21, 5, 4] over 143 steps
EAGLE_TAU_FLOOR = 1.70  # the Clover-2 head measures TAU_MEASURED on the same prompts


def test_eagle_head_is_registered_and_reference_format():
    from safetensors import safe_open

    path = pretrained.head_path(EAGLE)
    assert path == pretrained.PRETRAINED_DIR / EAGLE
    assert pretrained.heads_for("smollm2-135m-instruct") == [NAME, EAGLE]
    assert pretrained.default_tree(EAGLE) == "fit-5-36f662+lookup-4-table"
    # one n-gram table per base model: the EAGLE head drafts `-table` trees with the Clover-2 head's
    assert pretrained.ngram_table_folder(EAGLE) == pretrained.head_path(NAME)
    assert not (path / "ngram_table.npz").exists()
    assert pretrained.ngram_table_folder(str(path)) == path  # by folder: only its own table
    meta = json.loads((path / "config.json").read_text())
    assert meta["head_type"] == "eagle" and meta["base_model"]["name_or_path"] == "smollm2-135m-instruct"
    assert meta["rope_theta"] == 10000.0 and meta["rope_follows_base"] is False
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size < 12 * 2**20, f"the shipped EAGLE head folder is {size / 2**20:.1f} MiB"
    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        names = set(f.keys())
        assert str(f.get_slice("fc.weight").get_dtype()).lower() in ("f16", "float16")
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"} <= names
    assert not names & {"embed_tokens.weight", "lm_head.weight"}  # the base's frozen tensors are read from the base
    assert np.array_equal(head_draft_vocab(EAGLE), head_draft_vocab(NAME))
    card = (path / "README.md").read_text()
    assert "tau" in card and "configs/smollm2-135m-eagle.yaml" in card


@pytest.mark.slow
def test_shipped_eagle_head_accepts_drafts_and_is_exact(smollm, floor_ar):
    """As the Clover-2 head's floor test (chain-4: the head's drafts alone); its default tree, a fitted tree known
    only from its calibration.json beside lookup and the shared n-gram table, resolves by name. (Its output is
    compared with plain decoding wherever a request with no tree measures it: `tests/test_cli.py`.)"""
    tau = floor_tau(smollm, floor_ar, EAGLE)
    assert tau >= EAGLE_TAU_FLOOR, f"tau {tau:.3f} fell below {EAGLE_TAU_FLOOR} (measured {EAGLE_TAU_MEASURED})"
    plan = prepare_generate(smollm, floor_prompts()[:1], max_new_tokens=64, mode="speculative", head=EAGLE,
                            tree="default")
    assert plan.drafter.spec.name == pretrained.default_tree(EAGLE) and plan.ngram_table is not None
