"""Prompts of different lengths inside one bucket run one compiled loop (autoregressive and speculative), counted
with `compile_cache.CompileCounter`; a new bucket compiles once more."""

import pytest

from clover_jax.compile_cache import CompileCounter
from clover_jax.decoding.sizes import bucket_length, loop_shapes
from clover_jax.decoding.tree import get_tree
from clover_jax import generate
from tiny_llama import random_prompt, tiny_base_and_clover2

LOOP = {"ar": "autoregressive_loop", "speculative": "speculative_loop"}
NEW = 230  # with these, 5 and 30 prompt tokens (bucket 32) got caches of 256 and 512 slots from their own lengths


@pytest.fixture(scope="module")
def tiny():
    return tiny_base_and_clover2()


_prompt = random_prompt


@pytest.mark.parametrize("mode,tree", [("ar", None), pytest.param("speculative", "chain-4", marks=pytest.mark.slow)])
def test_one_program_per_bucket(tiny, mode, tree):
    base, head = tiny
    kw = dict(mode=mode, head=head if mode == "speculative" else None, tree=tree)
    lengths = [5, 30, 17]  # one bucket
    assert {bucket_length(n) for n in lengths} == {32}
    counts = []
    for i, n in enumerate(lengths):
        with CompileCounter() as count:
            out = generate(base, [_prompt(n, i)], max_new_tokens=NEW + 10 * i, **kw)  # traced: any number
        assert out.num_generated >= 1
        counts.append(count.compiled[LOOP[mode]])
    assert counts == [1, 0, 0]
    # the one program loop_shapes lists for the workload (the tree's nodes as the extra slots)
    nodes = 0 if tree is None else get_tree(tree).num_nodes
    assert len({s[1:] for s in loop_shapes(lengths, NEW, nodes)}) == 1


def test_a_new_bucket_compiles_once_more(tiny):
    base, _ = tiny
    generate(base, [_prompt(20, 0)], max_new_tokens=NEW)
    with CompileCounter() as count:
        generate(base, [_prompt(40, 1)], max_new_tokens=NEW)  # bucket 64
        generate(base, [_prompt(50, 2)], max_new_tokens=NEW)
    assert count.compiled[LOOP["ar"]] == 1 and not count.loaded
