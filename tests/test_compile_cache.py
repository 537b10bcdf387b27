"""The persistent compilation cache from the library: `import clover_jax` turns it on, so a second process running
the same workload through the API compiles nothing; `CLOVER_JAX_COMPILE_CACHE=off` leaves it off. Each run is a
fresh interpreter (the cache is process-wide configuration), in a folder of the test."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clover_jax.compile_cache import CompileCounter

TESTS = Path(__file__).resolve().parent

# a small workload through the public API: autoregressive and speculative (Clover-2 head, a static tree) decoding
# of the tiny test model, counting what XLA compiles and what it loads from the persistent cache
WORKLOAD = """
import json, sys
sys.path.insert(0, {tests!r})
import jax
import clover_jax
from clover_jax.compile_cache import CompileCounter
from clover_jax.heads.clover2.model import Clover2Config, init_from_base
from clover_jax.models.llama import init_llama
from tiny_llama import TINY_LLAMA

with CompileCounter() as count:
    base = init_llama(TINY_LLAMA, seed=0)
    head = init_from_base(base, Clover2Config())
    prompts = [[5, 9, 11, 3, 7], [4, 8, 15, 16, 23, 42]]
    ar = clover_jax.generate(base, prompts, max_new_tokens=12)
    sp = clover_jax.generate(base, prompts, max_new_tokens=12, mode="speculative", head=head, tree="chain-4")
assert sp.token_ids == ar.token_ids
print(json.dumps({{"dir": jax.config.jax_compilation_cache_dir, "compiled": dict(count.compiled),
                   "loaded": dict(count.loaded), "tokens": ar.token_ids}}))
"""


def run_workload(**env) -> dict:
    drop = ("JAX_COMPILATION_CACHE_DIR", "CLOVER_JAX_COMPILE_CACHE", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")
    full = {k: v for k, v in os.environ.items() if k not in drop} | env
    out = subprocess.run([sys.executable, "-c", WORKLOAD.format(tests=str(TESTS))], env=full, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # starts two processes
def test_a_second_process_compiles_nothing(tmp_path):
    folder = tmp_path / "xla"
    first = run_workload(CLOVER_JAX_COMPILE_CACHE=str(folder))
    assert first["dir"] == str(folder)
    assert first["compiled"].get("autoregressive_loop") == 1 and first["compiled"].get("speculative_loop") == 1
    assert any(folder.iterdir())
    second = run_workload(CLOVER_JAX_COMPILE_CACHE=str(folder))
    assert second["compiled"] == {}, f"compiled again: {second['compiled']}"
    assert second["loaded"].get("autoregressive_loop") == 1 and second["loaded"].get("speculative_loop") == 1
    assert sum(second["loaded"].values()) == sum(first["compiled"].values())  # every program, the small ones too
    assert second["tokens"] == first["tokens"]


def test_off_leaves_the_cache_off(tmp_path):
    code = ("import os, jax, clover_jax; print(jax.config.jax_compilation_cache_dir, "
            "jax.config.jax_persistent_cache_min_compile_time_secs)")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "CLOVER_JAX_COMPILE_CACHE")}
    out = subprocess.run([sys.executable, "-c", code], env=env | {"CLOVER_JAX_COMPILE_CACHE": "off",
                         "CLOVER_JAX_CACHE": str(tmp_path)}, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["None", "1.0"]  # JAX's defaults, untouched
    assert not (tmp_path / "xla").exists()


def test_the_counter_counts_what_this_process_compiles():
    import jax
    import jax.numpy as jnp

    def counted_twice(x):
        return jnp.sin(x) * 3

    with CompileCounter() as count:
        f = jax.jit(counted_twice)
        f(jnp.ones(5)).block_until_ready()
        f(jnp.ones(5)).block_until_ready()  # the jit cache: no compile
        f(jnp.ones(6)).block_until_ready()  # a new shape
    assert count.compiled["counted_twice"] == 2 and count.total >= 2
