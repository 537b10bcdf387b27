"""Draft vocabulary: the drafts come from the listed ids only, and the output is unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax import generate
from clover_jax.decoding.tree import get_tree
from clover_jax.heads.clover2.model import Clover2Config, init_from_base
from clover_jax.heads.recurrent.drafter import RecurrentDrafter
from clover_jax.heads.draft_vocab import (check_draft_vocab, coverage, frequent_tokens, load_draft_vocab,
                                          save_draft_vocab)
from clover_jax.models.llama import init_llama
from tiny_llama import TINY_LLAMA

CFG = TINY_LLAMA
SUBSET = np.arange(3, 64, 3, dtype=np.int32)  # 21 of the 64 ids


@pytest.fixture(scope="module")
def tiny():
    base = init_llama(CFG, seed=0)
    return base, init_from_base(base, Clover2Config())


def _prompts(n, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(3, 64, rng.randint(2, 20)).tolist() for _ in range(n)]


def test_frequent_tokens_and_file_round_trip(tmp_path):
    seqs = [[5, 5, 5, 7, 7, 9], [7, 1, 5, 9, 9]]  # counts: 5 x4, 7 x3, 9 x3, 1 x1
    np.testing.assert_array_equal(frequent_tokens(seqs, 2), [5, 7])  # tie 7/9: smaller id first
    np.testing.assert_array_equal(frequent_tokens(seqs, 3, always=[2]), [2, 5, 7])
    ids = frequent_tokens(seqs, 3)
    assert coverage(ids, seqs) == pytest.approx(10 / 11)
    path = save_draft_vocab(tmp_path / "dv.json", ids, source="test")
    np.testing.assert_array_equal(load_draft_vocab(path), ids)
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a draft vocabulary file"):
        load_draft_vocab(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="outside"):
        check_draft_vocab([3, 64], 64)
    with pytest.raises(ValueError, match="duplicate"):
        check_draft_vocab([3, 3], 64)


@pytest.mark.slow  # compiles drafters with a draft vocabulary
def test_drafts_come_from_the_draft_vocabulary(tiny):
    base, head = tiny
    drafter = RecurrentDrafter(get_tree("clover2-26"), draft_vocab=tuple(SUBSET.tolist()))
    full = RecurrentDrafter(get_tree("clover2-26"))
    s0 = jax.random.normal(jax.random.key(0), (3, CFG.hidden_size))
    root = jnp.array([4, 5, 6])
    props = []
    for d in (drafter, full):
        state = d.init_state(head, base, 3, 32).replace(s0=s0)
        props.append(np.asarray(d.propose(head, base, state, root, jax.random.key(1)).tokens))
    sub, everything = props
    assert np.isin(sub[:, 1:], SUBSET).all()
    assert not np.isin(everything[:, 1:], SUBSET).all()  # without it the head does draft other ids
    # the head's first choice, when it is in the subset, is drafted either way
    both = np.isin(everything[:, 1], SUBSET)
    np.testing.assert_array_equal(sub[both, 1], everything[both, 1])


@pytest.mark.parametrize("tree", ["clover2-26", "chain-3"])
@pytest.mark.slow  # speculative loops with and without the vocabulary
def test_greedy_output_unchanged_with_a_draft_vocabulary(tiny, tree):
    base, head = tiny
    prompts = _prompts(4)
    ar = generate(base, prompts, max_new_tokens=32, cache_size=128)
    sp = generate(base, prompts, max_new_tokens=32, cache_size=128, mode="speculative", head=head, tree=tree,
                  draft_vocab=SUBSET)
    assert sp.token_ids == ar.token_ids
    every = generate(base, prompts, max_new_tokens=32, cache_size=128, mode="speculative", head=head, tree=tree,
                     draft_vocab=np.arange(64))
    plain = generate(base, prompts, max_new_tokens=32, cache_size=128, mode="speculative", head=head, tree=tree)
    assert every.stats["accept_hist"] == plain.stats["accept_hist"]  # the whole vocabulary: the same drafts


def test_bad_draft_vocabulary(tiny):
    base, head = tiny
    with pytest.raises(ValueError, match="outside"):
        generate(base, [[5, 6]], max_new_tokens=4, mode="speculative", head=head, draft_vocab=[1, 99])
    with pytest.raises(ValueError, match="exceeds the draft vocabulary"):
        generate(base, [[5, 6]], max_new_tokens=4, mode="speculative", head=head, tree="clover2-26",
                 draft_vocab=[1, 2])
