"""Acceptance is exercised, not just exactness: an ORACLE drafter that knows the base model's own greedy
continuation must get a full path accepted at every step (tau == depth + 1), and an ANTI-oracle whose
drafts are all wrong must get nothing accepted (tau == 1), both with output equal to plain greedy decoding.
Exactness alone cannot catch a loop that silently rejects every draft; these tests can.

Accounting of the loop (`speculative._spec_generate`), asserted exactly below:
  * the first new token comes from the prefill, not from a decode step;
  * a step adds the accepted drafts plus the bonus token, cut at the first EOS and at `max_new_tokens`;
  * `accept_hist` counts the drafts the verifier accepted, before that cut: the final step of a row that
    hits the length limit (or an EOS inside the accepted path) still counts as a full-depth step.
So with the oracle and no EOS a row takes ceil((max_new_tokens - 1) / (depth + 1)) steps, all in
`accept_hist[depth]`, and tau is depth + 1 even when the last step emits fewer tokens.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, struct

from clover_jax.decoding.sizes import pad_prompts
from clover_jax import generate
from clover_jax.io.prompts import encode_prompts
from clover_jax.decoding.autoregressive import ar_generate
from clover_jax.decoding.sampling import SamplingParams
from clover_jax.decoding.speculative import spec_generate
from clover_jax.decoding.tree import TreeSpec, build_buffers, get_tree
from clover_jax.decoding.drafter import Proposal, TreeDrafterBase
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import init_llama
from tiny_llama import TINY_LLAMA

CFG = TINY_LLAMA
EXTRA = 8  # reference tokens beyond max_new_tokens, so drafts never run past the oracle's sequence
NO_EOS = ()  # spec_generate / ar_generate: no EOS at all (becomes [-1], same shape as one EOS id)


class NoHead(nnx.Module):
    """The loop needs a head module to split and merge; the oracle drafter ignores it."""


@struct.dataclass
class OracleState:
    pos: jax.Array  # [B] index of the current root in the reference sequence (= number of committed tokens)


@dataclasses.dataclass(frozen=True, eq=False)
class OracleDrafter(TreeDrafterBase):
    """Drafts from a known sequence `seq [B, S]` (prompt + the base model's greedy continuation, laid out
    like the loop's token buffer). The first path of the tree (rank 0 at every depth) gets the true next
    tokens, every other node a wrong one, distinct among siblings: (true + 1 + rank) % V. With
    `anti=True` every node is wrong. Hashable by identity, like `RecurrentDrafter`."""

    spec: TreeSpec
    seq: np.ndarray
    anti: bool = False
    sampled_drafts: bool = False

    def __post_init__(self):
        buf = build_buffers(self.spec)
        object.__setattr__(self, "buffers", buf)
        on_path = np.array([True] + [all(r == 0 for r in c) for c in self.spec.choices])
        object.__setattr__(self, "on_path", on_path & (not self.anti))

    def check(self, head, base) -> None:
        assert self.seq.ndim == 2 and self.seq.max() < base.config.vocab_size

    def init_state(self, head, base, batch: int, cache_size: int, arrays=None) -> OracleState:
        assert batch == self.seq.shape[0]
        return OracleState(pos=jnp.zeros((batch,), jnp.int32))

    def start(self, head, base, state, f_prompt, y_prompt, lengths) -> OracleState:
        # the prompt occupies seq[:, :length]; the root (first generated token) is seq[:, length]
        return OracleState(pos=lengths.astype(jnp.int32))

    def commit(self, head, base, state, f_new, y_new, num_new) -> OracleState:
        # num_new = root + accepted drafts (0 for finished rows); the bonus token is the next root
        return OracleState(pos=state.pos + num_new)

    def propose(self, head, base, state, root, key) -> Proposal:
        buf = self.buffers
        seq = jnp.asarray(self.seq, jnp.int32)
        idx = jnp.minimum(state.pos[:, None] + jnp.asarray(buf.depth)[None, :], seq.shape[1] - 1)
        true = jnp.take_along_axis(seq, idx, axis=1)  # [B, U]: true token at each node's depth
        wrong = (true + 1 + jnp.asarray(buf.rank)[None, :]) % base.config.vocab_size
        tokens = jnp.where(jnp.asarray(self.on_path)[None, :], true, wrong).at[:, 0].set(root)
        return Proposal(tokens=tokens, buffers=jax.tree.map(jnp.asarray, buf))


def expected_run(gen, max_new: int, accepted: int, eos) -> tuple[int, int]:
    """(tokens generated, decode steps) of one row, replaying the loop's bookkeeping on the reference
    continuation `gen` when every step accepts `accepted` drafts."""
    eos = set(eos)
    count, steps = 1, 0  # the prefill's token
    done = gen[0] in eos or count >= max_new
    while not done:
        new = list(gen[count:count + accepted + 1])
        eos_at = next((i for i, t in enumerate(new) if t in eos), accepted + 1)
        count += min(accepted + 1, eos_at + 1, max_new - count)
        steps += 1
        done = eos_at <= accepted or count >= max_new
    return count, steps


class Setup:
    """Prompts, the oracle's reference sequences and the drafters (built once: one compile per drafter)."""

    def __init__(self, base, ids, max_new: int, cache_size: int):
        self.base, self.ids, self.max_new, self.cache_size = base, ids, max_new, cache_size
        self.head = NoHead()
        self.arr, self.lens = pad_prompts(ids, 0)
        ref = ar_generate(base, self.arr, self.lens, max_new_tokens=max_new + EXTRA, cache_size=cache_size,
                          eos_ids=NO_EOS)
        self.seq = np.asarray(ref.tokens)
        assert (np.asarray(ref.num_generated) == max_new + EXTRA).all()
        self.gen = [self.seq[b, n:n + max_new + EXTRA].tolist() for b, n in enumerate(self.lens)]
        self._drafters = {}

    def drafter(self, tree: str, anti: bool = False) -> OracleDrafter:
        if (tree, anti) not in self._drafters:
            spec = get_tree(tree)
            assert spec.max_depth < EXTRA
            self._drafters[tree, anti] = OracleDrafter(spec, self.seq, anti=anti)
        return self._drafters[tree, anti]

    def run(self, tree: str, *, anti=False, eos=NO_EOS, sampling=SamplingParams(), seed=0, max_new=None):
        max_new = max_new or self.max_new
        assert max_new <= self.max_new
        out, stats, _ = spec_generate(self.base, self.head, self.arr, self.lens, max_new_tokens=max_new,
                                      cache_size=self.cache_size, sampling=sampling, key=jax.random.key(seed),
                                      eos_ids=eos, drafter=self.drafter(tree, anti))
        tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
        gen = [tokens[b, n:lengths[b]].tolist() for b, n in enumerate(self.lens)]
        return gen, out, stats

    def check_run(self, tree: str, *, anti=False, eos=NO_EOS, max_new=None):
        """Runs greedy speculative decoding and asserts the exact acceptance bookkeeping."""
        max_new = max_new or self.max_new
        depth = get_tree(tree).max_depth
        accepted = 0 if anti else depth
        gen, out, stats = self.run(tree, anti=anti, eos=eos, max_new=max_new)
        want = [expected_run(g, max_new, accepted, eos) for g in self.gen]
        assert gen == [g[:n] for g, (n, _) in zip(self.gen, want)], "output differs from greedy decoding"
        row_steps = np.asarray(out.row_steps).tolist()
        assert row_steps == [s for _, s in want]
        assert int(out.steps) == max(row_steps)
        hist = [0] * (depth + 1)
        hist[accepted] = sum(row_steps)
        assert stats["accept_hist"] == hist, f"every step should accept {accepted} drafts"
        assert stats["tau"] == accepted + 1
        assert stats["row_tau"] == [float(accepted + 1)] * len(row_steps)
        if anti:  # no step reaches depth 1; deeper rates are 0 / 0
            assert stats["accept_rate_per_depth"][0] == 0.0
            assert all(math.isnan(a) for a in stats["accept_rate_per_depth"][1:])
        else:
            assert stats["accept_rate_per_depth"] == [1.0] * depth
        return gen, row_steps


# --------------------------------------------------------------------------------------------------
# tiny random Llama

TINY_NEW = 40
TINY_TREES = ["chain-4", "small-10"]


def host_llama(config: LlamaConfig, seed: int):
    """`init_llama`'s weight distribution (normal std 0.02, unit norms) drawn on the host: no XLA compile
    per parameter, which costs several seconds of CPU with `init_llama`."""
    rng = np.random.RandomState(seed)

    def fill(path, x):
        norm = "norm" in jax.tree_util.keystr(path)
        return jnp.asarray(np.ones(x.shape) if norm else 0.02 * rng.randn(*x.shape), x.dtype)

    return jax.tree_util.tree_map_with_path(fill, nnx.eval_shape(lambda: init_llama(config)))


@pytest.fixture(scope="module")
def tiny():
    rng = np.random.RandomState(3)
    ids = [rng.randint(3, 64, n).tolist() for n in (5, 17, 11)]
    setup = Setup(host_llama(CFG, 4), ids, TINY_NEW, cache_size=96)
    # no token repeats its predecessor, so an oracle (or a loop) off by one position would be rejected
    assert all(a != b for g in setup.gen for a, b in zip(g, g[1:]))
    assert not any(set(CFG.eos_token_ids) & set(g) for g in setup.gen), "EOS in the reference"
    return setup


@pytest.fixture(scope="module")
def tiny_ar(tiny):
    """Plain greedy decoding through the user API."""
    return generate(tiny.base, tiny.ids, max_new_tokens=TINY_NEW, cache_size=tiny.cache_size).token_ids


@pytest.mark.parametrize("tree", TINY_TREES)
@pytest.mark.slow  # a speculative loop per tree
def test_oracle_accepts_full_paths_tiny(tiny, tiny_ar, tree):
    gen, row_steps = tiny.check_run(tree, eos=CFG.eos_token_ids)
    assert gen == tiny_ar
    depth = get_tree(tree).max_depth
    assert row_steps == [math.ceil((TINY_NEW - 1) / (depth + 1))] * len(gen)  # the prefill makes token 1
    assert (TINY_NEW - 1) % (depth + 1) != 0, "the last step should be cut by the length limit"


@pytest.mark.slow  # a speculative loop per tree
def test_anti_oracle_accepts_nothing_tiny(tiny, tiny_ar):
    gen, row_steps = tiny.check_run("small-10", anti=True, eos=CFG.eos_token_ids)
    assert gen == tiny_ar
    assert row_steps == [TINY_NEW - 1] * len(gen)


@pytest.mark.parametrize("tree", TINY_TREES)
@pytest.mark.slow  # a speculative loop per tree
def test_oracle_eos_inside_accepted_path_tiny(tiny, tree):
    """An EOS that is an accepted draft (not the bonus token) ends the row there, output cut after it,
    yet the step counts as a full-depth acceptance. EOS id: row 0's 4th generated token."""
    eos = tiny.gen[0][3]
    assert eos not in tiny.gen[0][:3]
    gen, row_steps = tiny.check_run(tree, eos=(eos,))  # the replay covers the other rows, wherever they stop
    assert gen[0] == tiny.gen[0][:4] and row_steps[0] == 1
    ar = ar_generate(tiny.base, tiny.arr, tiny.lens, max_new_tokens=TINY_NEW, cache_size=tiny.cache_size,
                     eos_ids=(eos,))
    assert gen == [np.asarray(ar.tokens)[b, n:int(ar.lengths[b])].tolist() for b, n in enumerate(tiny.lens)]


@pytest.mark.slow  # sampling loops over many rows
def test_oracle_sampling_tiny(tiny):
    tree, depth = "small-10", get_tree("small-10").max_depth
    # temperature 1: the output leaves the greedy reference at the first sampled deviation, after which the
    # oracle drafts for the wrong context; only that the sampling acceptor runs and counts sanely is checked
    gen, out, stats = tiny.run(tree, sampling=SamplingParams(temperature=1.0), seed=1)
    assert all(1 <= len(g) <= TINY_NEW for g in gen)
    assert sum(stats["accept_hist"]) == sum(np.asarray(out.row_steps).tolist())
    assert 1.0 <= stats["tau"] <= depth + 1
    # top_k=1 makes the warped distribution one-hot at the argmax: sampling is greedy, the oracle exact
    gen, out, stats = tiny.run(tree, sampling=SamplingParams(temperature=1.0, top_k=1), seed=2)
    assert gen == [g[:TINY_NEW] for g in tiny.gen]
    assert stats["tau"] == depth + 1
    assert stats["accept_hist"] == [0] * depth + [int(np.asarray(out.row_steps).sum())]


# --------------------------------------------------------------------------------------------------
# the real SmolLM2-135M-Instruct

SMOL_NEW = 48
SMOL_TREE = "small-10"


@pytest.fixture(scope="module")
def smol(smollm):
    # two prompts of different lengths whose greedy answers run past SMOL_NEW + EXTRA tokens without EOS
    prompts = ["Explain in two sentences why the sky is blue.",
               "List three prime numbers and explain what makes a number prime."]
    ids = encode_prompts(smollm.tokenizer, prompts)
    assert len(ids[0]) != len(ids[1])
    setup = Setup(smollm.model, ids, SMOL_NEW, cache_size=128)
    eos = set(smollm.config.eos_token_ids)
    assert not any(eos & set(g) for g in setup.gen), "EOS inside the reference: pick other prompts"
    return setup


@pytest.mark.slow
@pytest.mark.optimized
def test_oracle_accepts_full_paths_smollm(smol, smollm):
    gen, row_steps = smol.check_run(SMOL_TREE, eos=smollm.config.eos_token_ids)
    assert gen == [g[:SMOL_NEW] for g in smol.gen]  # the plain greedy output (EOS-free, see the fixture)
    depth = get_tree(SMOL_TREE).max_depth
    assert row_steps == [math.ceil((SMOL_NEW - 1) / (depth + 1))] * 2


@pytest.mark.slow
@pytest.mark.optimized
def test_anti_oracle_accepts_nothing_smollm(smol, smollm):
    # fewer new tokens (traced: no recompile): every step costs a full tree verification here
    gen, row_steps = smol.check_run(SMOL_TREE, anti=True, eos=smollm.config.eos_token_ids, max_new=16)
    assert gen == [g[:16] for g in smol.gen]
    assert row_steps == [15] * 2
