"""One training step of a whole-vocabulary cross-entropy in a fresh process: prints XLA's temporaries of the
compiled step and how far the process's peak resident memory rose while it ran (bytes, as JSON).

    python step_memory_run.py LENGTH
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from clover_jax import parallel  # noqa: E402
from clover_jax.training.memory import peak_resident_bytes, resident_bytes  # noqa: E402
from clover_jax.training.trainer import Trainer  # noqa: E402
from training_helpers import WIDE_VOCAB, make_cfg, tiny_base  # noqa: E402

t = int(sys.argv[1])
cfg = make_cfg("data.batch_size=1", f"data.max_length={t}", "loss.vocab_chunk=0")
trainer = Trainer(cfg, tiny_base(WIDE_VOCAB), mesh=parallel.make_mesh(1, 1, 1, devices=jax.devices("cpu")[:1]))
compiled, _ = trainer.compile_step(t)
before = resident_bytes()
rows = {"tokens": np.ones((1, t), np.int32), "loss_mask": np.ones((1, t), np.int32), "valid": np.ones((1, t), bool)}
jax.block_until_ready(trainer.train_step(rows))
print(json.dumps({"temporaries": compiled.memory_analysis().temp_size_in_bytes,
                  "rise": peak_resident_bytes() - before}))
