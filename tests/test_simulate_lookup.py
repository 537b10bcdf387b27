"""`bench/simulate_lookup.py`: the tau it predicts without running the loop. Its lookup rule must be the drafter's
(`lookup_chain`): on a tiny random model the simulated steps per row equal the loop's, exactly; on SmolLM2 with the
shipped head, the predicted tau of a static tree with and without a chain is within a few per cent of the loop's."""

import numpy as np
import pytest

from clover_jax import generate
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import init_llama
from test_bench_scripts import script

sim = script("simulate_lookup")


@pytest.mark.parametrize("k,max_ngram,with_table", [(3, 3, False), (5, 1, False), (3, 3, True)])
@pytest.mark.slow  # a speculative loop per setting
def test_simulated_steps_equal_the_loop_lookup_alone(k, max_ngram, with_table):
    from clover_jax.decoding.ngram import build_ngram_table

    cfg = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, eos_token_ids=(99,))
    base = init_llama(cfg, seed=3)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(3, 16, rng.randint(3, 12)).tolist() for _ in range(6)]
    table = None
    if with_table:  # the model's own replies to other prompts
        other = [rng.permutation(np.arange(3, 16))[:4].tolist() for _ in range(40)]
        table = build_ngram_table([p + g for p, g in zip(other, generate(base, other, max_new_tokens=16).token_ids)],
                                  vocab_size=16)
    ar = generate(base, prompts, max_new_tokens=30, cache_size=128)
    sp = generate(base, prompts, max_new_tokens=30, cache_size=128, mode="speculative", ngram_table=table,
                  tree=f"lookup-{k}" + (f"-n{max_ngram}" if max_ngram != 3 else "") + ("-table" if with_table else ""))
    assert sp.token_ids == ar.token_ids
    for p, g, steps in zip(prompts, ar.token_ids, sp.row_steps):
        toks, sim_steps = sim.simulate(p + g, len(p), None, None, k, max_ngram, table)
        assert (toks, sim_steps) == (len(g) - 1, steps)
    assert sum(sp.row_steps) < sum(len(g) - 1 for g in ar.token_ids)  # chains were accepted


@pytest.mark.slow
@pytest.mark.optimized
def test_predicted_tau_is_close_to_the_loop(capsys, smollm, tmp_path):
    from clover_jax.decoding.tree import TreeSpec, get_tree

    path = tmp_path / "fit5.json"
    TreeSpec(choices=((0,), (1,), (2,), (0, 0)), top_k=3, name="fit5").to_json(str(path))
    name = get_tree(str(path)).name  # a JSON tree is named by its file
    assert sim.main(["--questions", "mt_bench", "--limit", "4", "--max-new-tokens", "48", "--trees", str(path),
                     "--lookup", "0", "4"]) == 0
    rows = {line.split("|")[1].strip(): float(line.split("|")[2]) for line in capsys.readouterr().out.splitlines()
            if line.startswith(f"| {name}") or line.startswith("| lookup")}
    assert set(rows) == {"lookup-4", name, f"{name}+lookup-4"}
    prompts = script("toolkit").load_questions("mt_bench", 4, None)[0]
    for row, tree in ((name, str(path)), (f"{name}+lookup-4", f"{path}+lookup-4")):
        res = generate(smollm, prompts, max_new_tokens=48, mode="speculative", head="smollm2-135m-instruct-clover2",
                       tree=tree)
        assert abs(rows[row] - res.stats["tau"]) < 0.05 * res.stats["tau"], (row, rows[row], res.stats["tau"])
    assert rows[f"{name}+lookup-4"] > rows[name]


def test_anchored_chain_counts_only_under_an_accepted_head_path():
    """`--anchor-depth`: a chain under the head's top-1 path adds nothing where the head's first draft is never
    right, and adds tokens beyond the head's path where it always is (a repeating reply lookup can copy)."""
    seq = [9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7]
    tree = {(0,)}
    wrong = [[3] * 5 for _ in seq]
    right = [[0] * 5 for _ in seq]
    alone = sim.simulate(seq, 4, wrong, tree, 0, 3)
    assert sim.simulate(seq, 4, wrong, tree, 4, 3, anchor=1) == alone  # the chain's parent is never accepted
    head_only = sim.simulate(seq, 4, right, tree, 0, 3)
    toks, steps = sim.simulate(seq, 4, right, tree, 4, 3, anchor=1)
    assert toks == head_only[0] and steps < head_only[1]


def test_a_subtree_fitted_beside_a_chain_covers_what_the_chain_misses():
    """`--split`: where the chain already accepts more than a head path could, the fit spends its nodes where the
    chain fails; with no chain it builds the head's own best tree."""
    ranks = np.asarray([[0, 0, 0], [0, 0, 0], [1, 5, 5], [2, 5, 5]])  # [positions, depths]
    assert sim.fit_beside_chain(ranks, np.zeros(4, np.int32), 2, 3) == {(0,), (0, 0)}
    assert sim.fit_beside_chain(ranks, np.asarray([3, 3, 0, 0]), 2, 3) == {(1,), (2,)}
    tree = sim.fit_beside_chain(ranks, np.asarray([3, 3, 0, 0]), 9, 3)
    assert len(tree) == 9 and all(len(c) == 1 or c[:-1] in tree for c in tree)  # a tree: every parent in it


def test_chain_accepts_counts_the_matching_prefix():
    seq = [9, 1, 2, 3, 4, 1, 2, 3, 7]  # prompt [9, 1, 2, 3] and reply [4, 1, 2, 3, 7]
    acc = sim.chain_accepts(seq, 4, 3, 3)
    assert len(acc) == 5
    # after [.., 4, 1] the chain copies [2, 3, 4] after the earlier 1: the reply goes on 2, 3, 7
    assert acc[1] == 2


def test_reliability_table_and_calibration_error():
    hc = script("head_calibration")
    rng = np.random.default_rng(0)
    p = rng.uniform(0, 1, 200_000)
    calibrated = rng.uniform(0, 1, p.size) < p  # right with probability p
    rows, ece = hc.reliability(p, calibrated)
    assert ece < 0.01 and len(rows) == len(hc.BINS) - 1
    assert all(abs(mp - acc) < 0.02 for mp, acc, _ in rows)
    overconfident = rng.uniform(0, 1, p.size) < p / 2
    assert hc.reliability(p, overconfident)[1] > 0.2
    rows, _ = hc.reliability(np.array([1.0, 0.0, 0.05]), np.array([True, False, False]))  # p = 1.0 in the last bin
    assert rows[0] == (0.025, 0.0, 2) and rows[-1] == (1.0, 1.0, 1)
