"""A Qwen3 base (q/k norms, head_dim apart from hidden / heads) trains a Clover-2 head: finite, falling loss, and the
checkpoint loads back with the Augmenting Block's own q/k norms trained."""

import dataclasses
import json
import math

import jax
import numpy as np
import pytest
from flax import nnx

from clover_jax import parallel
from clover_jax.training.checkpoint import load_head_from_run
from clover_jax.training.run import run_experiment
from training_helpers import TINY, SyntheticBatcher, make_cfg, tiny_base

QWEN3 = dataclasses.replace(TINY, head_dim=16, qk_norm=True, model_type="qwen3", rope_theta=1000000.0)


@pytest.mark.slow  # trains
def test_a_qwen3_base_trains_a_head(tmp_path):
    base = tiny_base(QWEN3)
    base.layers.q_norm[...] = 1.0 + 0.5 * jax.random.normal(jax.random.key(1), base.layers.q_norm.shape)
    seen = {}
    cfg = make_cfg("train.steps=8", "train.log_every=1", "checkpoint.save_every=4", output_dir=str(tmp_path))
    summary = run_experiment(cfg, progress=False, mesh=parallel.make_mesh(1, 1, 1, devices=jax.devices("cpu")[:1]),
                             loaded=base, batcher=SyntheticBatcher(),
                             on_step=lambda step, trainer: seen.update(trainer=trainer))
    assert summary["final_step"] == 8
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r.get("split") == "train"]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]

    head = load_head_from_run(tmp_path, base)
    assert head.aug.q_norm.shape == (1, 16) and head.aug.k_norm.shape == (1, 16)
    assert not np.allclose(np.asarray(head.aug.q_norm[...]), 1.0)  # trained away from its init
    trained = jax.device_get(seen["trainer"].state.params)
    for a, b in zip(jax.tree.leaves(nnx.state(head)), jax.tree.leaves(trained)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
