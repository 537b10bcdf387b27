"""A drafter that breaks the loop's contract (`clover_jax.decoding.drafter`) gets a `DrafterError` naming the
drafter, the method and what is wrong, while the loop is traced, instead of an error from deep inside
`lax.while_loop` or, worse, a loop that runs on a wrong tree; a drafter that keeps it runs unchanged."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, struct

from clover_jax.decoding.autoregressive import ar_generate
from clover_jax.decoding.drafter import DrafterError, Proposal, TreeDrafterBase
from clover_jax.decoding.sampling import SamplingParams
from clover_jax.decoding.speculative import spec_generate
from clover_jax.decoding.tree import TreeSpec, build_buffers, get_tree
from clover_jax.models.llama import init_llama
from tiny_llama import TINY_LLAMA

CFG = TINY_LLAMA
PROMPT = np.array([[5, 6, 7, 8], [9, 10, 11, 0]], np.int32)  # [B, T], the second row 3 tokens long
LENGTHS = np.array([4, 3], np.int32)


class NoHead(nnx.Module):
    """The loop splits and merges a head module; this drafter reads none."""


@struct.dataclass
class CountState:
    pos: jax.Array  # [B] tokens committed so far


@dataclasses.dataclass(frozen=True, eq=False)
class ChainDrafter(TreeDrafterBase):
    """Drafts token 3 at every node of a chain; `breaks` names the one rule of the contract it breaks."""

    spec: TreeSpec
    breaks: str = ""
    sampled_drafts: bool = False

    def check(self, head, base) -> None:
        pass

    def init_state(self, head, base, batch: int, cache_size: int, arrays=None) -> CountState:
        return CountState(pos=jnp.zeros((batch,), jnp.int32))

    def start(self, head, base, state, f_prompt, y_prompt, lengths) -> CountState:
        return CountState(pos=lengths.astype(jnp.int32))

    def commit(self, head, base, state, f_new, y_new, num_new) -> CountState:
        pos = state.pos + num_new  # [B]
        if self.breaks == "state dtype":
            return CountState(pos=pos.astype(jnp.float32))
        if self.breaks == "state shape":
            return CountState(pos=jnp.stack([pos, num_new], axis=1))
        return CountState(pos=pos)

    def propose(self, head, base, state, root, key) -> Proposal:
        buf = jax.tree.map(jnp.asarray, build_buffers(self.spec))
        tokens = jnp.full((root.shape[0], self.spec.num_nodes), 3, jnp.int32).at[:, 0].set(root)  # [B, U]
        if self.breaks == "tokens shape":
            tokens = tokens[:, :-1]
        if self.breaks == "tokens dtype":
            tokens = tokens.astype(jnp.float32)
        if self.breaks == "mask dtype":
            buf = buf.replace(mask=buf.mask.astype(jnp.int32))
        probs = None
        if self.sampled_drafts and self.breaks != "no probs":  # token 3 drawn from a point mass on it
            width = 5 if self.breaks == "probs width" else base.config.vocab_size
            probs = jnp.broadcast_to(jax.nn.one_hot(3, width), (*tokens.shape, width))  # [B, U, V]
        return Proposal(tokens=tokens, buffers=buf, draft_probs=probs)


@pytest.fixture(scope="module")
def base():
    return init_llama(CFG, seed=0)


def _run(base, drafter):
    out, stats, _ = spec_generate(base, NoHead(), PROMPT, LENGTHS, max_new_tokens=8, cache_size=32,
                                  sampling=SamplingParams(), key=jax.random.key(0), drafter=drafter)
    return out, stats


@pytest.mark.slow  # compiles speculative loops of a test drafter
def test_a_drafter_that_keeps_the_contract_runs(base):
    out, stats = _run(base, ChainDrafter(get_tree("chain-3")))
    ref = ar_generate(base, PROMPT, LENGTHS, max_new_tokens=8, cache_size=32)
    assert np.array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert sum(stats["accept_hist"]) == int(np.asarray(out.row_steps).sum()) > 0


@pytest.mark.parametrize("breaks, says", [
    ("tokens shape", r"ChainDrafter\.propose: Proposal\.tokens must be \[B, U\] int with B = 2 rows, "
                     r"U = num_nodes = 4, V = 64: .*\(2, 3\)"),
    ("tokens dtype", r"ChainDrafter\.propose: Proposal\.tokens must be \[B, U\] int.*float32"),
    ("mask dtype", r"ChainDrafter\.propose: Proposal\.buffers\.mask must be \[U, U\] bool.*int32"),
    ("state dtype", r"ChainDrafter\.commit must return its state .*float32"),
    ("state shape", r"ChainDrafter\.commit must return its state .*\(2, 2\)"),
])
def test_a_broken_drafter_is_named_before_anything_runs(base, breaks, says):
    with pytest.raises(DrafterError, match=says):
        _run(base, ChainDrafter(get_tree("chain-3"), breaks=breaks))


@pytest.mark.parametrize("breaks, says", [("no probs", "it is None"), ("probs width", r"\(2, 4, 5\)")])
def test_sampled_drafts_need_their_distribution_over_the_vocabulary(base, breaks, says):
    """A drafter that says its drafts are sampled must hand the loop their distribution over the whole vocabulary
    (lossless acceptance rule (a) reads it): missing, or over 5 tokens of 64 (which would broadcast silently
    where it has one column), the error says so; a point mass on the drafted token passes."""
    kw = dict(max_new_tokens=8, cache_size=32, sampling=SamplingParams(temperature=1.0), key=jax.random.key(0))
    out, _, _ = spec_generate(base, NoHead(), PROMPT, LENGTHS, drafter=ChainDrafter(get_tree("chain-3"),
                                                                                     sampled_drafts=True), **kw)
    assert (np.asarray(out.num_generated) >= 1).all()  # it ran: the checks let a correct sampled drafter through
    with pytest.raises(DrafterError, match=r"Proposal\.draft_probs \(sampled_drafts=True\) must be \[B, U, V\] "
                                           r"float .*V = 64: .*" + says):
        spec_generate(base, NoHead(), PROMPT, LENGTHS, drafter=ChainDrafter(get_tree("chain-3"), breaks=breaks,
                                                                            sampled_drafts=True), **kw)
