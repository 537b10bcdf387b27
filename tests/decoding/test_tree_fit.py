"""Trees fitted to a head (`clover_jax.decoding.trees.fit`): the greedy expansion is the optimum (exhaustive search),
per-rank acceptance is recovered from the loop's per-node counts, and a head that accepts known ranks gets the tree
that holds exactly those ranks."""

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

from clover_jax.decoding.tree import TreeSpec, TreeSpecError, get_tree
from clover_jax.decoding.trees.fit import (best_tree, expected_tau, fit_step_cost, fitted_candidates, path_scores,
                                          probe_tree, rank_acceptance, smooth_acceptance)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "heads"))  # spec_helpers
from spec_helpers import NO_EOS, prompts, ranked_medusa, same_as_greedy, spec  # noqa: E402


def _all_trees(depth, width):
    """Every ancestor-closed set of paths of the complete tree of `depth` levels and `width` ranks."""
    nodes = [p for d in range(1, depth + 1) for p in itertools.product(range(width), repeat=d)]
    for mask in range(1, 1 << len(nodes)):
        chosen = {nodes[i] for i in range(len(nodes)) if mask >> i & 1}
        if all(len(p) == 1 or p[:-1] in chosen for p in chosen):
            yield chosen


@pytest.mark.parametrize("seed", range(4))
def test_best_tree_is_the_exhaustive_optimum(seed):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(3), size=3)[:, :2] * rng.uniform(0.5, 1.0, (3, 1))  # [3 depths, 2 ranks], rows <= 1
    best = {}  # (size, depth limit) -> best expected tau by exhaustive search
    for chosen in _all_trees(3, 2):
        spec = TreeSpec(sorted(chosen), top_k=2)
        tau = expected_tau(spec, p)
        for limit in range(spec.max_depth, 4):
            key = (len(chosen) + 1, limit)
            best[key] = max(best.get(key, 0.0), tau)
    for (size, limit), tau in best.items():
        got = best_tree(p, size, limit)
        assert got.num_nodes <= size and got.max_depth <= limit
        assert expected_tau(got, p) == pytest.approx(tau, abs=1e-12), (size, limit)


def test_expected_tau_and_zero_scores():
    p = np.array([[0.5, 0.2], [0.4, 0.1]])
    chain = get_tree("chain-2")
    assert expected_tau(chain, p) == pytest.approx(1 + 0.5 + 0.5 * 0.4)
    np.testing.assert_allclose(path_scores(TreeSpec([[0], [1], [1, 1]], top_k=2), p), [1, 0.5, 0.2, 0.02])
    assert path_scores(TreeSpec([[0], [2]], top_k=3), p)[2] == 0  # a rank the measurement never saw scores 0
    only = best_tree(np.array([[0.3, 0.0], [0.0, 0.0]]), 10)
    assert only.choices == ((0,),)  # nodes that can never be accepted are left out
    assert best_tree(p, 3).choices == ((0,), (1,))  # 0.5 * 0.4 = 0.2 ties rank 1's 0.2: the shallower node wins
    with pytest.raises(TreeSpecError, match="at least 2 nodes"):
        best_tree(p, 1)
    with pytest.raises(ValueError, match="probabilities"):
        best_tree(p * 3, 4)


def test_rank_acceptance_recovers_the_rates_it_was_made_from():
    p = np.array([[0.5, 0.2, 0.1], [0.4, 0.15, 0.0], [0.3, 0.1, 0.05]])
    trees = [probe_tree((3, 3, 3)), get_tree("clover2-26")]
    runs = [(t, np.round(1e6 * path_scores(t, p))) for t in trees]  # the counts a million steps would give
    est, parents = rank_acceptance(runs, max_depth=3, max_rank=3)
    np.testing.assert_allclose(est, p, atol=1e-5)
    assert parents[0, 0] == 2e6  # both trees' roots, every step
    est, parents = rank_acceptance(runs[:1], max_depth=4, max_rank=4)
    assert parents[3].sum() == 0 and parents[0, 3] == 0 and est[0, 3] == 0  # never measured: 0, not a guess
    with pytest.raises(ValueError, match="nodes"):
        rank_acceptance([(trees[0], [1, 2])], 3, 3)


def test_smoothing_keeps_well_measured_rates_and_orders_noisy_ranks():
    # the measured pattern of one calibration: rank 4 at depth 2 seen 5/49 times, rank 3 1/49
    p = np.array([[0.19, 0.08, 0.05, 0.04, 0.03, 0.01], [0.27, 0.08, 0.06, 1 / 49, 5 / 49, 4 / 49]])
    parents = np.array([[2306, 894, 894, 582, 289, 289], [433, 197, 101, 49, 49, 49]])
    q = smooth_acceptance(p, parents)
    assert (np.diff(q, axis=1) <= 1e-12).all()  # non-increasing in rank at every depth
    np.testing.assert_allclose(q[0], p[0], atol=2e-3)  # thousands of parents: the prior barely moves them
    assert q[1, 3] == pytest.approx(q[1, 4]) == pytest.approx(q[1, 5])  # the violators pooled
    assert q[1, 3] == pytest.approx((parents[1, 3:] * p[1, 3:]).sum() / parents[1, 3:].sum(), abs=0.02)
    raw, smoothed = best_tree(p, 9, 2), best_tree(q, 9, 2)
    assert (0, 4) in raw.choices  # the raw estimate builds on the noise ...
    assert (0, 4) not in smoothed.choices or (0, 3) in smoothed.choices  # ... the smoothed one keeps rank order
    # an inversion the counts make certain is kept (a head whose rank 3 is always right, ranks 0-2 never)
    q = smooth_acceptance(np.array([[1.0, 0, 0, 0], [0, 0, 0, 1.0]]), np.array([[300, 0, 0, 0], [300, 300, 300, 300]]))
    assert q[1, 3] > 0.9 and q[1, :3].max() < 0.1
    # unmeasured cells stay 0; a rate pooled over depths is the prior of a thinly measured depth
    q = smooth_acceptance(np.array([[0.5, 0.0], [0.0, 0.0]]), np.array([[1000, 0], [2, 0]]), prior_parents=10)
    assert q[0, 1] == q[1, 1] == 0
    assert q[1, 0] == pytest.approx((0 + 10 * 0.5 * 1000 / 1002) / 12)
    with pytest.raises(ValueError, match="shape"):
        smooth_acceptance(p, parents[:1])
    # at most one child of a node is accepted: a depth's smoothed rates never sum past 1, so no tree is predicted
    # more tokens than it is deep (rank 0 took every acceptance at depths 1-2, rank 3 at depth 3: the prior pulls
    # rank 0 up at depth 3 while rank 3's certain inversion is kept)
    p3 = np.array([[1.0, 0, 0, 0], [1.0, 0, 0, 0], [0, 0, 0, 1.0]])
    n3 = np.array([[100, 100, 100, 1], [100, 100, 100, 1], [12, 12, 12, 12]])  # rank 3 seen mostly at depth 3
    q = smooth_acceptance(p3, n3)
    assert (q.sum(1) <= 1 + 1e-9).all() and q[2, 3] > q[2, 0] > 0
    full = best_tree(q, 16, 3)
    assert expected_tau(full, q) <= 4 + 1e-9


def test_step_cost_model_and_candidates():
    truth = lambda n, d: 0.9 + 0.05 * n + 0.1 * d  # noqa: E731
    pts = [(n, d, truth(n, d)) for n, d in [(2, 1), (4, 3), (11, 5), (26, 5), (5, 4)]]
    cost = fit_step_cost(pts)
    assert cost(16, 3) == pytest.approx(truth(16, 3))
    assert fit_step_cost([(2, 1, 1.3)])(26, 5) == pytest.approx(1.3)
    p = np.array([[0.6, 0.2], [0.5, 0.1], [0.4, 0.05]])
    picks = fitted_candidates(p, cost, max_nodes=12, max_depth=3, count=3)
    assert len(picks) == 3 and picks[0][2] >= picks[1][2] >= picks[2][2]
    for tree, tau, speed in picks:
        assert tau == pytest.approx(expected_tau(tree, p))
        assert speed == pytest.approx(tau / cost(tree.num_nodes, tree.max_depth))
    free = fitted_candidates(p, lambda n, d: 1.0, max_nodes=12, max_depth=3, count=1)[0][0]
    assert free.num_nodes == 12  # when verifying is free, the biggest tree wins


def test_fitted_trees_are_reached_by_name():
    tree = best_tree(np.array([[0.5, 0.3], [0.2, 0.1]]), 4)
    assert tree.name.startswith("fit-4-")
    with pytest.raises(TreeSpecError, match="calibration's fitted tree"):
        get_tree(tree.name)
    known = {tree.name: tree}  # a head's fitted trees (`HeadBundle.trees`)
    assert get_tree(tree.name, known) is tree
    assert get_tree(f"{tree.name}+lookup-4", known).inner is tree  # inside a merged name too
    assert get_tree("chain-1", known).name == "chain-1"  # the grammar still answers other names


@pytest.mark.slow  # measures acceptance over many loops
def test_a_head_that_accepts_known_ranks_gets_those_ranks():
    """The base emits token 0 forever; Medusa head i ranks token 0 at RANKS[i] (tokens 1..r score above it). So
    each step accepts exactly the path RANKS: the loop's per-node counts must say so, the rates estimated from a
    probe run must be 1 at those ranks and 0 elsewhere, and the fitted tree must be that path and accept every
    draft (tau = depth + 1), with the output unchanged."""
    ranks = (0, 0, 3)  # the probe comb measures depth d under the top-1 spine, so the spine leads to the last rank
    base, head = ranked_medusa(ranks)
    prompt, lens = prompts()
    probe = probe_tree((4, 4, 4))
    n = 40
    out, stats = spec(base, head, probe, prompt, lens, n=n)
    same_as_greedy(base, out, prompt, lens, n, NO_EOS)
    hist = np.asarray(stats["node_hist"])
    steps = sum(stats["accept_hist"])
    assert hist[0] == steps
    assert hist[1:].sum() == sum(k * c for k, c in enumerate(stats["accept_hist"]))  # accepted drafts
    p, parents = rank_acceptance([(probe, hist)], max_depth=3, max_rank=4)
    np.testing.assert_array_equal(p, np.eye(4)[list(ranks)])
    assert np.all(parents == steps)
    fitted = best_tree(p, 8)
    assert fitted.choices == ((0,), (0, 0), (0, 0, 3))  # probabilities 0 elsewhere: the path alone
    out, stats = spec(base, head, fitted, prompt, lens, n=n)
    assert stats["tau"] == 4.0, stats
    same_as_greedy(base, out, prompt, lens, n, NO_EOS)
    np.testing.assert_array_equal(stats["node_hist"], [steps := sum(stats["accept_hist"])] * 4)
