"""A head type defined outside the library (`tests/toy_head.py`, registered when imported) goes through training,
checkpoints, export, import and speculative generation with no library file changed: the registry is the only
place the rest of the library learns about a head type."""

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "training"))

import toy_head  # noqa: E402  (registers the head type "toy")
from training_helpers import SyntheticBatcher, make_cfg, tiny_base  # noqa: E402

import clover_jax  # noqa: E402
from clover_jax import parallel  # noqa: E402
from clover_jax.heads import registry  # noqa: E402
from clover_jax.heads.export import export_head, import_head  # noqa: E402
from clover_jax.training.config import ConfigError  # noqa: E402
from clover_jax.training.loading import load_head  # noqa: E402
from clover_jax.training.run import run_experiment  # noqa: E402
from clover_jax.validation import InputError  # noqa: E402


def test_the_toy_head_is_a_registered_type_with_its_own_config_section():
    assert "toy" in registry.names() and registry.get("toy") is toy_head.TOY
    cfg = make_cfg("head.type=toy", "head.num_heads=2")
    assert isinstance(cfg.head, toy_head.ToyOptions) and cfg.head.num_heads == 2
    assert cfg.head.head_config().num_heads == 2
    with pytest.raises(ConfigError, match=r"unknown key 'head.num_aug_layers' for a toy head"):
        make_cfg("head.type=toy", "head.num_aug_layers=2")
    with pytest.raises(InputError, match="'dynamic-10' is a dynamic tree policy.*toy heads draft a static tree"):
        registry.drafter_for(toy_head.ToyHead, "dynamic-10")


@pytest.mark.slow  # trains, exports and drafts
def test_toy_head_trains_exports_imports_and_drafts_exactly(tmp_path):
    base = tiny_base()
    base.lm_head[...] = base.lm_head[...] * 40  # a peaked teacher (a random tiny base is near-uniform)
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices("cpu")[:1])
    run = tmp_path / "run"
    cfg = make_cfg("head.type=toy", "head.num_heads=2", "train.steps=6", "optim.warmup_steps=0",
                   output_dir=str(run))
    summary = run_experiment(cfg, progress=False, mesh=mesh, loaded=base, batcher=SyntheticBatcher(seed=1),
                             eval_batches=[])
    assert summary["final_step"] == 6

    trained = load_head(run, base)  # from the run's Orbax checkpoint
    assert isinstance(trained, toy_head.ToyHead) and trained.cfg.num_heads == 2
    start = toy_head.init_from_base(base, toy_head.ToyConfig(num_heads=2))
    assert not np.allclose(np.asarray(trained.proj[...]), np.asarray(start.proj[...]))  # training moved it

    folder = export_head(trained, tmp_path / "head", base=base, base_name="tiny")
    meta = json.loads((folder / "config.json").read_text())
    assert meta["head_type"] == "toy" and meta["num_heads"] == 2
    back = import_head(folder, base)
    np.testing.assert_array_equal(np.asarray(back.proj[...]), np.asarray(trained.proj[...]))

    prompts = [[3, 5, 7, 9, 11, 3, 5, 7], [2, 4, 6, 8, 2, 4]]
    ar = clover_jax.generate(base, prompts, max_new_tokens=24, cache_size=128)
    spec = clover_jax.generate(base, prompts, max_new_tokens=24, cache_size=128, mode="speculative",
                               head=str(folder), tree="chain-2")
    assert spec.token_ids == ar.token_ids  # greedy speculative decoding is exact with any head
    assert spec.stats["tau"] >= 1.0 and len(spec.stats["accept_hist"]) == 3  # drafted 2 deep
