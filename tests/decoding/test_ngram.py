"""The n-gram draft table (`clover_jax.decoding.ngram`): the table and its jitted chain against a plain-Python
back-off model, the file round trip, errors, and the table beside prompt lookup: exact, and accepted where lookup
has nothing (a tiny model, and SmolLM2 with its shipped table)."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax import generate
from clover_jax.decoding.ngram import (NgramTable, build_ngram_table, context_hash, load_ngram_table, ngram_chain,
                                       save_ngram_table)
from clover_jax.heads.folder import open_folder
from clover_jax.heads.registry import drafter_for
from clover_jax.decoding.tree import get_tree
from clover_jax.heads.clover2.model import Clover2Head
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import init_llama
from clover_jax.validation import InputError
from tiny_llama import TINY_LLAMA

CFG = TINY_LLAMA


class _Oracle:
    """Counts of the next token after every context of 1..max_order tokens (within a sequence); drafting takes the
    longest context seen at least min_count times and its most frequent next token (ties: the smaller id)."""

    def __init__(self, seqs, max_order, min_count):
        self.max_order, self.min_count = max_order, min_count
        self.counts = collections.defaultdict(collections.Counter)
        for s in seqs:
            for i in range(1, len(s)):
                for n in range(1, min(i, max_order) + 1):
                    self.counts[tuple(s[i - n:i])][s[i]] += 1

    def next(self, ctx):
        for n in range(min(self.max_order, len(ctx)), 0, -1):
            c = self.counts.get(tuple(ctx[-n:]))
            if c and sum(c.values()) >= self.min_count:
                return min(c, key=lambda t: (-c[t], t))
        return None

    def chain(self, ctx, k):
        """k tokens, the root (ctx's last) repeated from the first step with no context found."""
        root, ctx, out = ctx[-1], list(ctx), []
        for _ in range(k):
            t = self.next(ctx)
            if t is None:
                break
            out.append(t)
            ctx.append(t)
        return out + [root] * (k - len(out)), bool(out)


def test_context_hash_is_the_same_in_numpy_and_jax():
    ctx = np.random.default_rng(0).integers(0, 200_000, (50, 4))
    for n in (1, 2, 4):
        a = context_hash(np, ctx[:, -n:].astype(np.uint32), n)
        b = jax.jit(lambda c: context_hash(jnp, c, n))(jnp.asarray(ctx[:, -n:], jnp.uint32))
        np.testing.assert_array_equal(a, np.asarray(b))
    assert len(set(context_hash(np, ctx[:, -2:].astype(np.uint32), 2).tolist())) == 50
    # the order salts the hash: the same last token as a 1-gram and inside a 2-gram differ
    assert context_hash(np, np.array([[5]], np.uint32), 1)[0] != context_hash(np, np.array([[0, 5]], np.uint32), 2)[0]


@pytest.mark.parametrize("vocab,max_order,min_count,k", [(5, 4, 2, 4), (12, 3, 1, 3), (30, 2, 3, 5), (8, 1, 1, 2)])
def test_chain_matches_a_python_back_off_model(vocab, max_order, min_count, k):
    rng = np.random.default_rng(vocab * 7 + k)
    motifs = [rng.integers(0, vocab, 6).tolist() for _ in range(4)]  # repeated phrases, so counts differ
    seqs = []
    for _ in range(60):
        s = []
        while len(s) < 30:
            s += motifs[rng.integers(4)] if rng.random() < 0.6 else rng.integers(0, vocab, 3).tolist()
        seqs.append(s)
    table = build_ngram_table(seqs, vocab_size=vocab + 1, max_order=max_order, min_count=min_count)
    oracle = _Oracle(seqs, max_order, min_count)
    b, s = 48, 24
    history = rng.integers(0, vocab + 1, (b, s)).astype(np.int32)  # token `vocab` never occurs in the data
    history[::3, :12] = np.asarray([sq[:12] for sq in seqs[:16]])
    length = rng.integers(1, s + 1, b).astype(np.int32)
    length[:2] = (1, s)
    chain, found = jax.jit(ngram_chain, static_argnums=(4, 5))(
        jnp.asarray(table.keys), jnp.asarray(table.tokens), jnp.asarray(history), jnp.asarray(length), k, max_order)
    hits = 0
    for r in range(b):
        want, ok = oracle.chain(history[r, :length[r]].tolist(), k)
        assert np.asarray(chain[r]).tolist() == want, f"row {r}: {history[r, :length[r]].tolist()}"
        assert bool(found[r]) == ok, f"row {r}"
        assert table.chain(history[r, :length[r]].tolist(), k) == (want, ok)  # the host twin
        hits += ok
    assert 0 < hits < b  # both cases were exercised


def test_redundant_contexts_are_pruned():
    """A context whose next token its shorter suffix already predicts is left out; the chain is unchanged (the
    oracle test above) but the table is smaller than one entry per context."""
    seqs = [[1, 2, 3, 4, 5] * 4] * 3
    table = build_ngram_table(seqs, vocab_size=8, max_order=4, min_count=1)
    assert table.size == 5  # after any token the next is fixed: only the 1-token contexts remain


def test_file_round_trip_and_errors(tmp_path):
    table = build_ngram_table([[1, 2, 3, 1, 2, 4]] * 2, vocab_size=10, source="x.jsonl")
    path = save_ngram_table(table, tmp_path)
    assert path.name == "ngram_table.npz"
    again = load_ngram_table(tmp_path)
    np.testing.assert_array_equal(again.keys, table.keys)
    np.testing.assert_array_equal(again.tokens, table.tokens)
    assert (again.max_order, again.vocab_size, again.source) == (4, 10, "x.jsonl")
    assert load_ngram_table(path) is again  # cached: one drafter (and one compiled loop) per table
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(InputError, match="unreadable, not a whole table"):
        load_ngram_table(tmp_path / "bad.npz")
    with pytest.raises(InputError, match="no file"):
        load_ngram_table(tmp_path / "missing.npz")
    with pytest.raises(InputError, match="outside the vocabulary"):
        build_ngram_table([[1, 12]], vocab_size=10)
    with pytest.raises(InputError, match="token id -1 outside"):
        build_ngram_table([[1, -1]], vocab_size=10)
    with pytest.raises(InputError, match="no pair of consecutive tokens"):
        build_ngram_table([[], [3]], vocab_size=10)
    with pytest.raises(InputError, match="no context occurs"):
        build_ngram_table([[1, 2, 3]], vocab_size=10, min_count=5)


def test_tree_names_and_missing_table():
    spec = get_tree("chain-2+lookup-3-table")
    assert spec.table and spec.length == 3 and spec.name == "chain-2+lookup-3-table"
    assert get_tree("lookup-4-n2-table").max_ngram == 2 and not get_tree("lookup-4").table
    with pytest.raises(InputError, match="n-gram table"):
        drafter_for(Clover2Head, "chain-2+lookup-3-table")
    table = build_ngram_table([[1, 2, 3, 1, 2, 4]] * 2, vocab_size=10)
    assert drafter_for(Clover2Head, "chain-2+lookup-3", None, table).table is None  # ignored without '-table'
    base = init_llama(CFG, seed=0)
    with pytest.raises(InputError, match="10-token vocabulary"):
        generate(base, [[3, 4, 5]], max_new_tokens=4, mode="speculative", tree="lookup-3-table", ngram_table=table)


@pytest.mark.slow  # generates 200 replies to build its table
def test_greedy_equals_autoregressive_and_the_table_is_accepted_tiny():
    """A table of the tiny model's own greedy replies drafts its replies to new prompts where lookup has nothing
    (each prompt ends in a token it holds once): exact, and fewer steps than lookup alone."""
    base = init_llama(CFG, seed=0)
    rng = np.random.RandomState(3)
    train = [rng.permutation(np.arange(3, 64))[:6].tolist() for _ in range(200)]
    replies = generate(base, train, max_new_tokens=24, cache_size=64).token_ids
    table = build_ngram_table([p[-4:] + r for p, r in zip(train, replies)], vocab_size=64)
    prompts = [rng.permutation(np.arange(3, 64))[:6].tolist() for _ in range(6)]
    ar = generate(base, prompts, max_new_tokens=24, cache_size=96)
    plain = generate(base, prompts, max_new_tokens=24, cache_size=96, mode="speculative", tree="lookup-3")
    with_table = generate(base, prompts, max_new_tokens=24, cache_size=96, mode="speculative",
                          tree="lookup-3-table", ngram_table=table)
    assert with_table.token_ids == ar.token_ids == plain.token_ids
    assert with_table.steps < plain.steps, (with_table.steps, plain.steps)


def test_shipped_table():
    table = open_folder("smollm2-135m-instruct-clover2").ngram_table
    assert isinstance(table, NgramTable) and table.vocab_size == 49152 and table.max_order == 4
    assert 100_000 < table.size < 1_000_000 and np.all(np.diff(table.keys.astype(np.int64)) > 0)
    assert open_folder("no-such-head").ngram_table is None


@pytest.mark.slow
@pytest.mark.optimized
def test_smollm_table_beside_the_shipped_head(smollm):
    """SmolLM2, greedy, MT-Bench prompts: the shipped table's chain keeps the output exact and raises tau over
    prompt lookup alone beside the same head tree (measured on these 4 prompts: see the assertion message)."""
    from clover_jax.io.prompts import read_prompts

    prompts = read_prompts("mt_bench", limit=4)
    kw = dict(max_new_tokens=64, mode="speculative", head="smollm2-135m-instruct-clover2")
    ar = generate(smollm, prompts, max_new_tokens=64)
    plain = generate(smollm, prompts, tree="chain-3+lookup-4", **kw)
    table = generate(smollm, prompts, tree="chain-3+lookup-4-table", **kw)
    assert table.token_ids == ar.token_ids == plain.token_ids
    tau = lambda r: r.num_generated / sum(r.row_steps)
    assert tau(table) >= tau(plain) + 0.05, (tau(table), tau(plain))


@pytest.mark.slow  # sampling loops over 3,000 rows
def test_sampling_with_the_table_is_lossless():
    """Tokens 2..4 sampled at temperature 1.0 with a table chain (each prompt's last token is new to it, so the
    first steps draft from the table) against plain sampling: chi-square homogeneity over many rows."""
    from homogeneity import chi2_homogeneity

    cfg = LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, eos_token_ids=(99,))
    base = init_llama(cfg, seed=1)
    base.embed[...] = base.embed[...] * 40  # a peaked but not degenerate distribution
    rows = 3000
    prompts = [[3, 5, 3, 5, 7]] * rows
    kw = dict(max_new_tokens=4, cache_size=64, temperature=1.0)
    fit = generate(base, prompts[:300], seed=10, **kw).token_ids  # the table: the model's own samples
    table = build_ngram_table([[3, 5, 7] + t for t in fit], vocab_size=8)
    ar = np.array([t[:4] for t in generate(base, prompts, seed=11, **kw).token_ids])
    res = generate(base, prompts, seed=12, mode="speculative", tree="lookup-2-table", ngram_table=table, **kw)
    sp = np.array([t[:4] for t in res.token_ids])
    assert sum(res.stats["accept_hist"][1:]) > rows // 10, "too few drafts accepted"
    for pos in (1, 2, 3):
        chi2, _, pval, a, s = chi2_homogeneity(ar[:, pos], sp[:, pos], 8)
        assert pval > 1e-3, f"position {pos}: chi2={chi2:.1f} p={pval:.2e}\nar={a}\nsp={s}"
