"""Tree specs, buffers and presets: hand-checked values and brute-force invariants."""

import json

import numpy as np
import pytest

from clover_jax.decoding import tree as T


def _check_invariants(spec: T.TreeSpec, b: T.TreeBuffers) -> None:
    """Every buffer recomputed from the sorted choices by brute force."""
    nodes = [()] + list(spec.choices)
    u, k = len(nodes), spec.top_k
    assert b.mask.shape == (u, u) and b.mask.dtype == bool
    for i, ci in enumerate(nodes):
        assert b.depth[i] == len(ci)
        for j, cj in enumerate(nodes):
            assert b.mask[i, j] == (ci[:len(cj)] == cj), (i, j)
        if i:
            assert nodes[b.parent[i]] == ci[:-1] and b.rank[i] == ci[-1]
        kids = [j for j, cj in enumerate(nodes) if len(cj) == len(ci) + 1 and cj[:-1] == ci]
        assert b.num_children[i] == len(kids)
        assert list(b.children[i, :len(kids)]) == kids and np.all(b.children[i, len(kids):] == -1)
    assert b.parent[0] == -1 and b.mask[:, 0].all()
    leaves = [i for i in range(1, u) if b.num_children[i] == 0]
    assert sorted(b.paths[:, :].max(-1).tolist()) == leaves  # one path per leaf
    for p in range(b.paths.shape[0]):
        row = b.paths[p, :b.path_len[p]]
        assert row[0] == 0 and np.all(b.paths[p, b.path_len[p]:] == -1)
        assert all(b.parent[row[d]] == row[d - 1] for d in range(1, len(row)))
    # per-parent drafting: simulate a drafter whose candidates encode (step, slot, rank)
    dmax, e = b.expand_nodes.shape
    topk = np.array([[[1000 * s + 10 * slot + r for r in range(k)] for slot in range(e)] for s in range(dmax)])
    cand = [-1]
    for s in range(dmax):
        cand += topk[s, :b.num_expand[s]].reshape(-1).tolist()
    assert len(cand) == 1 + k * b.num_expand.sum()
    tokens = np.array(cand)[b.cand_index]
    assert np.array_equal(np.concatenate([[-1], topk.reshape(-1)])[b.draft_index], tokens)
    for i in range(1, u):
        s = b.depth[i] - 1
        assert tokens[i] == 1000 * s + 10 * b.parent_slot[i] + b.rank[i]
        assert b.expand_nodes[s, b.parent_slot[i]] == b.parent[i]
    for s in range(dmax):
        ex = [i for i in range(u) if b.depth[i] == s and b.num_children[i] > 0]
        assert list(b.expand_nodes[s, :b.num_expand[s]]) == ex
        assert list(b.expand_parent_slot[s, :len(ex)]) == [b.parent_slot[i] for i in ex]
        assert list(b.expand_rank[s, :len(ex)]) == [b.rank[i] for i in ex]


def test_clover2_26():
    spec = T.clover2_26()
    b = T.build_buffers(spec)
    assert (spec.num_nodes, spec.max_depth, spec.num_paths, spec.top_k) == (26, 5, 15, 10)
    assert spec.depth_counts == [4, 8, 8, 3, 2]
    assert b.cand_index.tolist() == [0, 1, 2, 3, 4, 11, 12, 13, 21, 22, 31, 32, 41, 51, 52, 53, 61, 62,
                                     71, 72, 81, 91, 92, 93, 101, 102]
    assert b.depth.tolist() == [0] + [1] * 4 + [2] * 8 + [3] * 8 + [4] * 3 + [5] * 2
    assert b.num_expand.tolist() == [1, 4, 4, 1, 1]
    assert b.expand_nodes.tolist() == [[0, -1, -1, -1], [1, 2, 3, 4], [5, 6, 7, 8], [13, -1, -1, -1],
                                       [21, -1, -1, -1]]
    assert b.paths.shape == (15, 6) and b.children.shape == (26, 4)
    assert b.paths[0].tolist() == [0, 1, 5, 13, 21, 25]  # Medusa order: deepest leaf first
    assert b.paths[-1].tolist() == [0, 2, 9, -1, -1, -1]
    assert sorted(b.path_len.tolist()) == [3] * 4 + [4] * 7 + [5] * 2 + [6] * 2
    assert np.nonzero(b.mask[25])[0].tolist() == [0, 1, 5, 13, 21, 25]  # [0,0,0,0,1]
    assert np.nonzero(b.mask[20])[0].tolist() == [0, 2, 8, 20]  # [1,0,0]
    assert np.nonzero(b.mask[4])[0].tolist() == [0, 4]  # [3]
    assert b.mask[0].tolist() == [True] + [False] * 25
    assert b.parent[[5, 8, 20, 25]].tolist() == [1, 2, 8, 21]
    assert b.parent_slot[[5, 8, 12, 20, 25]].tolist() == [0, 1, 3, 3, 0]
    assert spec.ranks_contiguous and not T.TreeSpec([[0], [2]], top_k=3).ranks_contiguous
    _check_invariants(spec, b)


def test_medusa_63():
    spec = T.medusa_63()
    b = T.build_buffers(spec)
    assert len(T.MEDUSA_63) == 63 and spec.num_nodes == 64  # 63 drafts + the root
    assert spec.depth_counts == [10, 28, 23, 2] and spec.num_paths == 42 and spec.max_depth == 4
    assert b.paths.shape == (42, 5) and b.children.shape == (64, 10)
    assert b.num_expand.tolist() == [1, 10, 10, 1]
    assert b.cand_index[1:11].tolist() == list(range(1, 11))
    assert spec.choices[:3] == ((0,), (1,), (2,)) and spec.choices[-1] == (0, 0, 0, 1)
    _check_invariants(spec, b)


def test_chain():
    spec = T.chain(3)
    b = T.build_buffers(spec)
    assert spec.top_k == 1 and spec.num_nodes == 4 and spec.depth_counts == [1, 1, 1]
    assert b.mask.tolist() == np.tril(np.ones((4, 4), bool)).tolist()
    assert b.paths.tolist() == [[0, 1, 2, 3]] and b.path_len.tolist() == [4]
    assert b.cand_index.tolist() == [0, 1, 2, 3] and b.draft_index.tolist() == [0, 1, 2, 3]
    assert b.children.tolist() == [[1], [2], [3], [-1]] and b.parent.tolist() == [-1, 0, 1, 2]
    assert b.expand_nodes.tolist() == [[0], [1], [2]]
    _check_invariants(spec, b)
    with pytest.raises(T.TreeSpecError, match="chain length"):
        T.chain(0)


def test_random_trees_invariants():
    rng = np.random.default_rng(0)
    for _ in range(20):
        choices = [(0,)]
        for _ in range(rng.integers(1, 30)):
            c = choices[rng.integers(len(choices))] + (int(rng.integers(4)),)
            if c not in choices and len(c) <= 5:
                choices.append(c)
        spec = T.TreeSpec([list(choices[i]) for i in rng.permutation(len(choices))], top_k=4)
        _check_invariants(spec, T.build_buffers(spec))


@pytest.mark.parametrize("choices, top_k, message", [
    ([], 10, "empty"),
    ([[0], []], 10, "choice 1 is an empty path"),
    ([[0], [-1]], 10, r"path \[-1\].*negative rank -1"),
    ([[0], [0, 10]], 10, r"path \[0, 10\].*rank 10 >= top_k 10"),
    ([[0], [1], [0]], 10, r"path \[0\] \(choice 2\) is listed twice"),
    ([[0], [1, 0]], 10, r"path \[1, 0\] has no parent.*\[1\]"),
    ([[0], [0, 0.5]], 10, r"path \[0, 0.5\].*not an integer"),
    ([[0], [True]], 10, "not an integer"),
    ([[0], 3], 10, "not a list"),
    ([[0] * d for d in range(1, T.MAX_DEPTH + 2)], 1, "MAX_DEPTH"),
    ([[0]], 0, "top_k"),
])
def test_invalid_specs(choices, top_k, message):
    with pytest.raises(T.TreeSpecError, match=message):
        T.TreeSpec(choices, top_k=top_k)


def test_json_round_trip_and_get_tree(tmp_path):
    f = tmp_path / "tree.json"
    T.clover2_26().to_json(f)
    assert json.loads(f.read_text())["top_k"] == 10
    back = T.from_json(f)
    assert back == T.clover2_26()
    assert T.get_tree(str(f)) == back
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps([[1], [0], [0, 0]]))
    spec = T.get_tree(bare)
    assert spec.top_k == 10 and spec.choices == ((0,), (1,), (0, 0))
    assert T.get_tree("clover2-26").num_nodes == 26
    assert T.get_tree("medusa-63").num_nodes == 64
    assert T.get_tree("chain-4") == T.chain(4)
    with pytest.raises(T.TreeSpecError, match="clover2-26, medusa-63, small-10, chain-N"):
        T.get_tree("eagle-99")
    with pytest.raises(T.TreeSpecError, match="does not exist"):
        T.get_tree(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text(json.dumps({"choices": [[0]], "topk": 3}))
    with pytest.raises(T.TreeSpecError, match="unknown keys"):
        T.from_json(tmp_path / "bad.json")


def test_stack_buffers():
    a = T.build_buffers(T.TreeSpec([[0], [1], [2]], top_k=3))  # wide: P 3, Dmax 1, C 3
    b = T.build_buffers(T.TreeSpec([[0], [0, 0], [0, 0, 0]], top_k=3))  # deep: P 1, Dmax 3
    s = T.stack_buffers([a, b])
    assert s.paths.shape == (2, 3, 4) and s.children.shape == (2, 4, 3) and s.mask.shape == (2, 4, 4)
    assert s.paths[1].tolist() == [[0, 1, 2, 3], [0, -1, -1, -1], [0, -1, -1, -1]]
    assert s.path_len[1].tolist() == [4, 1, 1]
    assert s.paths[0].tolist() == [[0, 3, -1, -1], [0, 2, -1, -1], [0, 1, -1, -1]]
    assert s.expand_nodes.shape == (2, 3, 1) and s.num_expand[0].tolist() == [1, 0, 0]
    with pytest.raises(T.TreeSpecError, match="same number of nodes"):
        T.stack_buffers([a, T.build_buffers(T.chain(2))])


def test_small_10_preset():
    from clover_jax.decoding.tree import build_buffers, get_tree

    spec = get_tree("small-10")
    b = build_buffers(spec)
    assert spec.num_nodes == 10 and spec.depth_counts == [3, 3, 1, 1, 1] and spec.num_paths == 4
    assert b.paths[0].tolist() == [0, 1, 4, 7, 8, 9]  # the deepest path first
    assert b.mask[9].tolist() == [True, True, False, False, True, False, False, True, True, True]
