"""A short real training run: SmolLM2-135M-Instruct (frozen) + ShareGPT conversations -> a Clover-2 head that
gets better on held-out data. Kept to ~2-3 minutes on 2 CPU cores: 2 heads, batch 4 x 128 tokens, 24 steps, the
cross-entropy packed to 48 trained positions per row as the CPU recipe does."""

import json

import jax
import numpy as np
import pytest

from clover_jax import parallel
from clover_jax.training.config import load_config
from clover_jax.heads.draft_vocab import coverage, load_draft_vocab
from clover_jax.training.run import build_data, write_draft_vocab
from clover_jax.training.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.optimized]

STEPS = 24


def test_short_training_run_improves_the_head(smollm, tmp_path):
    cfg = load_config(None, [
        "head.num_heads=2", "data.batch_size=4", "data.max_length=128", "data.bucket_boundaries=[128]",
        "data.num_conversations=240", "data.heldout_fraction=0.1", "optim.lr=1e-3", "optim.warmup_steps=4",
        "optim.total_steps=0", "optim.schedule=constant", f"train.steps={STEPS}", "train.log_every=4",
        "train.eval_every=1000", "train.eval_batches=3", "mesh.data=1", f"train.output_dir={tmp_path}",
        "loss.vocab_positions_per_row=48",
    ])
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices("cpu")[:1])
    batcher, held = build_data(cfg, smollm)  # held: the first train.eval_batches held-out batches
    assert len(held) == 3
    trainer = Trainer(cfg, smollm.model, base_name="smollm2-135m-instruct", mesh=mesh, run_dir=tmp_path)

    before = trainer.evaluate(held)
    summary = trainer.fit(batcher, progress=False)
    after = trainer.evaluate(held)

    assert summary["final_step"] == STEPS
    print(json.dumps({"before": before, "after": after, "steady_tokens_per_s": summary["steady_tokens_per_s"],
                      "first_log": summary["first_log"], "last_log": summary["last_log"]}))
    assert after["loss"] < 0.9 * before["loss"], (before["loss"], after["loss"])
    assert after["acc"][0] > before["acc"][0] + 0.01, (before["acc"], after["acc"])
    first, last = summary["first_log"], summary["last_log"]
    assert last["loss"] < first["loss"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(4, STEPS + 1, 4))
    assert all(np.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in rows)


    # the run's draft vocabulary: the most frequent trained tokens, EOS always in
    ids = load_draft_vocab(write_draft_vocab(batcher.dataset, 2048, smollm.config.eos_token_ids,
                                             tmp_path / "draft_vocab.json"))
    assert len(ids) == 2048 and set(smollm.config.eos_token_ids) <= set(ids.tolist())
    trained = [ex.tokens[ex.loss_mask.astype(bool)] for ex in (batcher.dataset[i] for i in range(len(batcher.dataset)))]
    assert 0.8 < coverage(ids, trained) < 1.0
