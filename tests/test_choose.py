"""A speculative request that names no tree: the choice of head and tree (or plain decoding) made for this machine,
dtype and batch size (`clover_jax.tuning.choose`), kept and reused, and followed by the plan.

The timed measurement is replaced here by stated numbers so the rule is checked exactly; the real measurement on
SmolLM2 runs in `tests/test_cli.py` (`--mode speculative` with no tree), where its output is compared with plain
decoding."""

import json

import pytest

from clover_jax import pretrained
from clover_jax.decoding.autoregressive import AutoregressiveLoop
from clover_jax.decoding.lookup import NoHead
from clover_jax import prepare_generate
from clover_jax.heads.clover2 import Clover2Head
from clover_jax.heads.bundle import HeadBundle
from clover_jax.heads.eagle import EagleHead
from clover_jax.tuning import choose as choose_mod

CLOVER = "smollm2-135m-instruct-clover2"
EAGLE = "smollm2-135m-instruct-eagle"


@pytest.fixture
def fake_measure(monkeypatch, tmp_path):
    """Replaces the timed measurement with `predicted` speed-ups per candidate label; records the calls (pairs,
    batch size, the other arguments)."""
    monkeypatch.setenv("CLOVER_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(choose_mod, "_MEMO", {})
    calls = []
    predicted = {}

    def measure(loaded, pairs, *, batch_size=1, compare=choose_mod.ALL, **kw):
        # the candidates arrive opened (a head's bundle, read once): recorded by name
        assert all(h is None or isinstance(h, HeadBundle) for h, _ in pairs), pairs
        pairs = [(choose_mod._name(h), t) for h, t in pairs]
        calls.append((list(pairs), batch_size, dict(kw, compare=compare)))
        table = {choose_mod._label(h, t): {"head": h, "tree": t, "measured_speedup": predicted.get(
            choose_mod._label(h, t), 0.5), "tau_measured": 2.0, "tau_batch": 2.0, "tau_source": "reference",
            "step_cost": 1.0, "predicted_speedup": predicted.get(choose_mod._label(h, t), 0.5)} for h, t in pairs}
        return {"best": choose_mod.decide(table, choose_mod._label(*pairs[0])), "candidates": table,
                "new_tokens": 48, "batch_size": batch_size, "seconds": 1.0, "compared": compare, "rounds": 3,
                "programs_reused": compare == choose_mod.REQUEST, "version": choose_mod.VERSION}

    monkeypatch.setattr(choose_mod, "measure", measure)
    return calls, predicted


ALL_PAIRS = [(CLOVER, "fit-5-411aab+lookup-4-table"), (EAGLE, "fit-5-36f662+lookup-4-table"), (None, "lookup-4-table"),
             (None, "lookup-2-table")]


@pytest.mark.slow  # times two loops
def test_a_request_measures_the_default_tree_against_plain_decoding_and_keeps_the_choice(smollm, fake_measure,
                                                                                        capsys):
    calls, predicted = fake_measure
    predicted[f"{CLOVER} fit-5-411aab+lookup-4-table"] = 1.2
    predicted[f"{EAGLE} {pretrained.default_tree(EAGLE)}"] = 1.5  # not measured by a request
    plan = prepare_generate(smollm, ["hi"], mode="speculative", max_new_tokens=40)
    (pairs, batch, kw), = calls
    # the default head's tree alone, on the request's shapes: its prompt bucket and new tokens
    assert batch == 1 and pairs == ALL_PAIRS[:1] and kw["compare"] == "request"
    assert kw["prompt_bucket"] == 32 and kw["reply_tokens"] == 40 and kw["layers"] == "auto"
    assert kw["cache_size"] is None
    # within a time budget, 16 new tokens a call at this batch size
    assert kw["budget_s"] == choose_mod.REQUEST_BUDGET_S and kw["new_tokens"] == choose_mod.NEW_TOKENS == 16
    assert isinstance(plan.head, Clover2Head) and plan.drafter.spec.name == "fit-5-411aab+lookup-4-table"
    assert plan.choice == {"head": CLOVER, "tree": "fit-5-411aab+lookup-4-table", "predicted_speedup": 1.2,
                           "compared": "request", "rounds": 3, "measurements": 1, "settled": True,
                           "programs_reused": True, "measured_s": 1.0, "announced": True,
                           "note": plan.notes[0]}
    assert plan.notes[0].startswith(f"chose {CLOVER} fit-5-411aab+lookup-4-table: predicted 1.2x")
    assert any(n.startswith(f"chose {CLOVER} fit-5-411aab") and "calibrate --quick compares every shipped head" in n
               for n in plan.notes)
    err = capsys.readouterr().err
    assert "choosing the draft tree for cpu" in err and "2 runs compiled" in err and "chose " in err  # once
    # reused: in this process, then from the saved file in a new one (the memo cleared)
    prepare_generate(smollm, ["hello there"], mode="speculative")
    choose_mod._MEMO.clear()
    again = prepare_generate(smollm, ["hello there"], mode="speculative")
    assert len(calls) == 1 and again.choice["head"] == CLOVER and capsys.readouterr().err == ""
    saved = json.loads((choose_mod.cache_dir() / choose_mod.CHOICES_FILE).read_text())
    (key, entry), = saved.items()
    assert "model smollm2-135m-instruct" in key and "| float32 | batch 1" in key and entry["best"].startswith(CLOVER)
    # another batch size is another choice: above batch 1, with the shortest head-less chain too (verifying gets
    # dearer with the batch)
    prepare_generate(smollm, ["a", "b"], mode="speculative")
    assert len(calls) == 2 and calls[1][1] == 2 and calls[1][0] == [ALL_PAIRS[0], ALL_PAIRS[-1]]
    # above batch 4, shorter calls (each decodes every row)
    prepare_generate(smollm, ["a"] * 8, mode="speculative")
    assert calls[2][1] == 8 and calls[2][2]["new_tokens"] == choose_mod.LARGE_BATCH_NEW_TOKENS == 8


@pytest.mark.slow  # loads the real SmolLM2 weights
def test_a_close_departure_from_the_default_is_measured_again_and_merged(smollm, monkeypatch, tmp_path):
    """A request's measurement that departs from the default tree by a margin under `CLEAR_MARGIN` (or has fewer
    than `ROUNDS` rounds) is not settled: the next request measures again, and each run's iteration time is the
    faster of the two measurements; a clear one is kept at once."""
    monkeypatch.setenv("CLOVER_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(choose_mod, "_MEMO", {})
    tree = f"{CLOVER} fit-5-411aab+lookup-4-table"
    measured = [{"ar": 10.0, tree: 31.0}, {"ar": 10.5, tree: 22.0}]  # a slow first process: 3.1 decode steps, then 2.1

    def measure(loaded, pairs, *, batch_size=1, compare=choose_mod.ALL, **kw):
        it = measured.pop(0)
        row = {"head": CLOVER, "tree": "fit-5-411aab+lookup-4-table", "tau_batch": 2.5, "step_cost": it[tree] / it["ar"],
               "predicted_speedup": round(2.5 * it["ar"] / it[tree], 3)}
        return {"best": choose_mod.decide({tree: row}, tree), "default": tree, "candidates": {tree: row},
                "iteration_ms": it, "rounds": 3, "compared": compare, "prompt_bucket": 32, "cache_size": {},
                "batch_size": batch_size, "new_tokens": 16, "seconds": 10.0, "version": choose_mod.VERSION}

    monkeypatch.setattr(choose_mod, "measure", measure)
    first = prepare_generate(smollm, ["hi"], mode="speculative")
    assert first.mode == "ar" and first.choice["settled"] is False  # 0.806x: plain decoding 1.24x faster, not clear
    choose_mod._MEMO.clear()  # a new process
    second = prepare_generate(smollm, ["hi"], mode="speculative")
    # the tree's fastest 22.0 ms over plain decoding's fastest 10.0: cost 2.2, 2.5 / 2.2 = 1.136x: the default tree
    assert not measured and second.choice["tree"] == "fit-5-411aab+lookup-4-table"
    assert second.choice["predicted_speedup"] == 1.136 and second.choice["measurements"] == 2
    assert second.choice["settled"] is True
    saved = json.loads((choose_mod.cache_dir() / choose_mod.CHOICES_FILE).read_text())
    (entry,) = saved.values()
    assert entry["iteration_ms"] == {"ar": 10.0, tree: 22.0} and entry["rounds_total"] == 6 and entry["merged"]
    prepare_generate(smollm, ["hi"], mode="speculative")  # settled: nothing measured (measure would fail: none left)
    # a clear decision is settled at once; one of fewer rounds than `ROUNDS` is not
    clear = {"best": "ar", "default": tree, "candidates": {tree: {"predicted_speedup": 0.5}}, "rounds": 1,
             "compared": "request"}
    assert choose_mod.settled(clear) and not choose_mod.settled(dict(clear, candidates={tree: {
        "predicted_speedup": 0.9}}))
    assert not choose_mod.settled(dict(clear, best=tree, candidates={tree: {"predicted_speedup": 1.1}}))
    assert choose_mod.settled(dict(clear, best=tree, rounds=3, candidates={tree: {"predicted_speedup": 1.1}}))
    assert choose_mod.settled(dict(clear, measurements=3, candidates={tree: {"predicted_speedup": 0.9}}))
    assert choose_mod.settled(dict(clear, compared="all", candidates={tree: {"predicted_speedup": 0.9}}))


@pytest.mark.slow  # loads the real SmolLM2 weights
def test_a_comparison_of_every_candidate_is_kept_for_requests(smollm, fake_measure):
    """`calibrate --quick` (`choose(compare="all")`) measures every shipped head's tree and the head-less chains;
    requests use what it chose. A choice that compared the default tree only does not answer for all."""
    calls, predicted = fake_measure
    prepare_generate(smollm, ["hi"], mode="speculative")  # a request's: the default tree only
    predicted[f"{EAGLE} {pretrained.default_tree(EAGLE)}"] = 1.3
    predicted["lookup-4-table"] = 1.2
    choice = choose_mod.choose(smollm, model_source="smollm2-135m-instruct", quiet=True, compare="all")
    assert len(calls) == 2 and calls[1][0] == ALL_PAIRS and calls[1][2]["compare"] == "all"
    assert choice.head == EAGLE and "not compared" not in choice.note
    plan = prepare_generate(smollm, ["hi"], mode="speculative")
    assert len(calls) == 2  # the saved comparison of all answers the request
    assert isinstance(plan.head, EagleHead) and plan.drafter.spec.name == pretrained.default_tree(EAGLE)
    assert plan.choice["head"] == EAGLE and plan.choice["predicted_speedup"] == 1.3 and plan.choice["compared"] == "all"


@pytest.mark.slow  # loads the real SmolLM2 weights
def test_plain_decoding_when_no_tree_pays(smollm, fake_measure):
    _, predicted = fake_measure  # the default tree 0.5x: plain decoding is faster
    plan = prepare_generate(smollm, ["hi"], mode="speculative")
    assert plan.mode == "ar" and isinstance(plan.loop, AutoregressiveLoop) and plan.drafter is None
    assert plan.choice["tree"] == "ar"
    assert any("plain autoregressive decoding" in n and f"{CLOVER} fit-5-411aab+lookup-4-table at 0.5x" in n
               for n in plan.notes)
    predicted["lookup-4-table"] = 0.8  # of all candidates, none pays either
    choose_mod.choose(smollm, model_source="smollm2-135m-instruct", quiet=True, compare="all", refresh=True)
    plan = prepare_generate(smollm, ["hi"], mode="speculative")
    assert plan.mode == "ar" and any("lookup-4-table at 0.8x" in n for n in plan.notes)


@pytest.mark.slow  # loads the real SmolLM2 weights
def test_the_default_tree_is_kept_within_the_tolerance(smollm, fake_measure):
    _, predicted = fake_measure
    predicted[f"{CLOVER} fit-5-411aab+lookup-4-table"] = 0.95  # plain decoding predicted 5% faster
    plan = prepare_generate(smollm, ["hi"], mode="speculative")
    assert isinstance(plan.head, Clover2Head) and plan.drafter.spec.name == "fit-5-411aab+lookup-4-table"
    assert any("plain decoding predicted 1.0x, less than 10% faster: the default kept" in n for n in plan.notes)


@pytest.mark.slow  # loads the real SmolLM2 weights
def test_a_head_less_chain_can_win(smollm, fake_measure):
    _, predicted = fake_measure
    predicted["lookup-2-table"] = 1.5
    choose_mod.choose(smollm, model_source="smollm2-135m-instruct", quiet=True, compare="all")
    plan = prepare_generate(smollm, ["hi"], mode="speculative")
    assert isinstance(plan.head, NoHead) and plan.drafter.spec.name == "lookup-2-table"
    assert plan.ngram_table is not None  # the shipped heads' n-gram table


@pytest.mark.slow  # loads the real SmolLM2 weights
def test_a_named_head_chooses_between_its_tree_and_plain_decoding(smollm, fake_measure):
    calls, predicted = fake_measure
    predicted[f"{CLOVER} fit-5-411aab+lookup-4-table"] = 1.2
    plan = prepare_generate(smollm, ["hi"], mode="speculative", head=CLOVER)
    assert calls[0][0] == [(CLOVER, "fit-5-411aab+lookup-4-table")]
    assert calls[0][2]["compare"] == "all"  # a named head has one tree: the comparison is complete
    assert isinstance(plan.head, Clover2Head) and plan.drafter.spec.name == "fit-5-411aab+lookup-4-table"


@pytest.mark.slow  # loads the real SmolLM2 weights
def test_named_trees_default_and_in_memory_heads_measure_nothing(smollm, fake_measure):
    calls, _ = fake_measure
    plan = prepare_generate(smollm, ["hi"], mode="speculative", tree="default")
    assert plan.drafter.spec.name == pretrained.default_tree(CLOVER)
    plan = prepare_generate(smollm, ["hi"], mode="speculative", head=EAGLE, tree="default")
    assert plan.drafter.spec.name == pretrained.default_tree(EAGLE)
    prepare_generate(smollm, ["hi"], mode="speculative", tree="chain-2+lookup-4-table")
    prepare_generate(smollm, ["hi"], mode="speculative", head=plan.head)  # a module: its type's default tree
    prepare_generate(smollm, ["hi"], mode="speculative", draft_vocab=list(range(100, 8292)))  # drafting asked for
    assert calls == []


@pytest.mark.slow  # loads the real SmolLM2 weights
def test_measure_predicts_tokens_per_iteration_over_an_iteration_cost(smollm, monkeypatch):
    """predicted = tau_B / cost: cost, the tree's fastest decode time per loop iteration over plain decoding's (each
    program timed once a round, `ROUNDS` rounds); on a CPU every loop on the full model, on a GPU an unrolled loop on
    the model's first 2 and 8 layers, extrapolated to its 30; tau_B from the reference's per-prompt counts
    (`batch_tau`), else from the measured iterations."""
    layers = smollm.model.config.num_hidden_layers
    assert choose_mod.PROBE_DEPTHS == (2, 8) and layers == 30 and choose_mod.ROUNDS == 3
    seconds, iterations, seen = {}, {("ar", 30): 20, ("ar", 2): 100, ("ar", 8): 100, ("lookup-4-table", 30): 40}, []

    def decode(loaded, units, new_tokens, *, mode="ar", tree=None, **kw):
        key = (tree or "ar", loaded.model.config.num_hidden_layers)
        seen.append(key)
        toks = [[1, 2, 3]]
        short, long = seconds[key].pop(0)
        return short, long, iterations[key], [toks] * len(units), [[0, 1, 1]] * len(units), 100  # tau 2.5

    monkeypatch.setattr(choose_mod, "side_by_side", lambda *a, **kw: None)  # the warm-up calls
    monkeypatch.setattr(choose_mod, "_decode", decode)
    monkeypatch.setattr(choose_mod, "reference", lambda head, tree, model_source=None: None)
    # (short call, long call) per round: an iteration is the fastest long call less the fastest short call, over the
    # iterations between them: AR (0.25 - 0.05) / 20 = 10 ms, the tree (0.9 - 0.1) / 40 = 20 ms: cost 2.0
    seconds.update({("ar", 30): [(0.10, 0.32), (0.05, 0.30), (0.08, 0.25)],
                    ("lookup-4-table", 30): [(0.2, 1.2), (0.1, 1.0), (0.3, 0.9)]})
    entry = choose_mod.measure(smollm, [(None, "lookup-4-table")], prompts=["x"])
    assert seen == [("ar", 30), ("lookup-4-table", 30), ("lookup-4-table", 30), ("ar", 30), ("ar", 30),
                    ("lookup-4-table", 30)]  # the order turned by one each round
    assert entry["ar_iteration_ms"] == pytest.approx(10.0) and entry["iteration_ms"]["lookup-4-table"] == 20.0
    assert entry["round_costs"]["lookup-4-table"] == [2.273, 1.8, 1.765]  # 25 / 11 ms, 22.5 / 12.5, 15 / 8.5
    row = entry["candidates"]["lookup-4-table"]
    # no reference: tau_B = the longest reply's 100 tokens over the tree's 40 iterations
    assert row["step_cost"] == 2.0 and row["tau_measured"] == 2.5
    assert row["tau_batch"] == 2.5 and row["tau_source"] == "measured" and row["predicted_speedup"] == 1.25
    # both on the full model: the speed-up seen (10 ms x 20 iterations against 20 ms x 40) and the outputs compared
    assert row["measured_speedup"] == 0.25 and row["differing_outputs"] == 0
    assert entry["best"] == "lookup-4-table" and entry["default"] == "lookup-4-table" and entry["rounds"] == 3
    # a request's time budget: no round starts that would end past it, one round at least
    seen.clear()
    seconds.update({("ar", 30): [(0.05, 0.25)], ("lookup-4-table", 30): [(0.1, 0.9)]})
    entry = choose_mod.measure(smollm, [(None, "lookup-4-table")], prompts=["x"], budget_s=0.0)
    assert entry["rounds"] == 1 and len(seen) == 2 and entry["candidates"]["lookup-4-table"]["step_cost"] == 2.0
    # on a backend whose unrolled loops are timed on parts of the model: AR (unrolled) at 2 and 8 layers, three
    # calls a round each; 2 ms on 2 layers, 5 ms on 8 -> 16 ms on 30; the tree (scanned) on the full model
    monkeypatch.setattr(choose_mod, "PROBE_BACKENDS", (choose_mod.jax.default_backend(),))
    seen.clear()
    seconds.update({("ar", 2): [(0.0, 0.2)] * 9, ("ar", 8): [(0.0, 0.5)] * 9, ("lookup-4-table", 30): [(0.0, 0.8)] * 3})
    monkeypatch.setattr(choose_mod, "reference", lambda head, tree, model_source=None: {
        "tau": 3.0, "per_prompt": [[30, 10], [30, 10]]})
    entry = choose_mod.measure(smollm, [(None, "lookup-4-table")], prompts=["x"])
    assert seen.count(("ar", 2)) == 9 and seen.count(("ar", 8)) == 9 and seen.count(("lookup-4-table", 30)) == 3
    assert entry["ar_iteration_ms"] == pytest.approx(16.0)
    row = entry["candidates"]["lookup-4-table"]
    assert row["predicted_speedup"] == pytest.approx(3.0 / 1.25) and row["tau_source"] == "reference"
    assert "measured_speedup" not in row  # plain decoding ran on parts of the model only: no speed-up seen


def test_the_default_is_kept_unless_another_is_clearly_faster():
    def table(**speedups):
        return {k: {"predicted_speedup": v} for k, v in speedups.items()}

    assert choose_mod.TOLERANCE == 0.10
    assert choose_mod.decide(table(a=1.30, b=1.40), "a") == "a"  # 7.7% faster: within the tolerance
    assert choose_mod.decide(table(a=1.30, b=1.45), "a") == "b"  # 11.5% faster
    assert choose_mod.decide(table(a=0.95, b=0.90), "a") == "a"  # plain decoding 5% faster: within it
    assert choose_mod.decide(table(a=0.85, b=0.90), "a") == "ar"  # plain decoding 17.6% faster
    assert choose_mod.decide(table(a=0.85, b=1.02), "a") == "b"  # the fastest, plain decoding second
    assert choose_mod.decide(table(a=1.30, b=1.40), None) == "b"  # no default among them
    assert choose_mod.decide({}, None) == "ar"


@pytest.mark.slow  # loads the real SmolLM2 weights
def test_first_layers_shares_the_weights_and_keeps_the_shapes(smollm):
    from clover_jax.models.llama import first_layers

    model = smollm.model
    part = first_layers(model, 2, eos_token_ids=())
    assert part.config.num_hidden_layers == 2 and part.config.eos_token_ids == ()
    assert part.config.hidden_size == model.config.hidden_size and part.dtype == model.dtype
    assert part.layers.wq[...].shape == (2, *model.layers.wq[...].shape[1:])
    assert (part.layers.w_down[...] == model.layers.w_down[...][:2]).all()
    # the layers' weights are the first two slices of the full model's, not a copy (on this CPU)
    assert part.layers.w_down[...].unsafe_buffer_pointer() == model.layers.w_down[...].unsafe_buffer_pointer()
    assert part.embed[...] is model.embed[...] or (part.embed[...] == model.embed[...]).all()
    with pytest.raises(ValueError, match="31.*30 layers"):
        first_layers(model, 31)


def test_batch_tau_is_set_by_the_slowest_row():
    """Two prompts: 100 tokens in 25 steps (tau 4) and 100 tokens in 100 steps (tau 1). Alone, tau over both is 200 /
    125 = 1.6; a batch of both iterates 100 times for 100 tokens of its longest reply: 1.0."""
    per_prompt = [[100, 25], [100, 100]]
    assert choose_mod.batch_tau(per_prompt, 1) == pytest.approx(1.6)
    assert choose_mod.batch_tau(per_prompt, 2) == pytest.approx(1.0)
    ref = json.loads((pretrained.head_path(CLOVER) / "calibration.json").read_text())["reference"]
    taus = [choose_mod.batch_tau(ref["per_prompt"]["lookup-4-table"], b) for b in (1, 2, 4, 8, 16)]
    assert taus[0] == pytest.approx(ref["tau"]["lookup-4-table"], abs=0.01)
    assert all(a > b for a, b in zip(taus, taus[1:])) and taus[-1] > 1.0  # shrinks with the batch, never below 1


def test_reference_tau_is_read_from_the_head_folder():
    ref = json.loads((pretrained.head_path(CLOVER) / "calibration.json").read_text())["reference"]
    tree = pretrained.default_tree(CLOVER)
    assert choose_mod.reference_tau(CLOVER, tree) == ref["tau"][tree]
    shipped = choose_mod.shipped_folders("smollm2-135m-instruct")
    assert choose_mod.reference_tau(None, "lookup-4-table", shipped) == ref["tau"]["lookup-4-table"]
    assert choose_mod.reference_tau(CLOVER, "chain-9") is None


@pytest.mark.slow  # loads the real SmolLM2 weights
def test_on_a_mesh_a_saved_choice_is_used_and_none_is_measured(smollm, fake_measure):
    """Measuring on a mesh compiles every candidate's sharded loop (minutes): the default tree, said in the notes,
    with the command that measures one; a saved choice for the mesh is used."""
    calls, predicted = fake_measure
    plan = prepare_generate(smollm, ["hi", "there"], mode="speculative", mesh="data=2", check_free_memory=False)
    assert calls == [] and plan.drafter.spec.name == pretrained.default_tree(CLOVER)
    assert any("no choice is saved for mesh data=2" in n and "calibrate --quick --mesh data=2" in n
               for n in plan.notes)
    predicted["lookup-4-table"] = 1.4
    choose_mod.choose(smollm, batch_size=2, mesh=plan.mesh, model_source="smollm2-135m-instruct", quiet=True)
    again = prepare_generate(smollm, ["hi", "there"], mode="speculative", mesh="data=2", check_free_memory=False)
    assert len(calls) == 1 and again.choice["tree"] == "lookup-4-table"


@pytest.mark.slow  # loads the real SmolLM2 weights
def test_measure_times_the_programs_of_the_request(smollm, monkeypatch):
    """With a request's prompt bucket and new tokens, every run is timed on that request's shapes: the prompts cut to
    the bucket, the cache the request gets with that run's tree (so the tree chosen runs the program timed); a
    request that cannot fit the model falls back to one chat request's shapes."""
    seen = {}

    def decode(loaded, units, new_tokens, *, mode="ar", tree=None, **kw):
        seen[tree or "ar"] = (units, kw)
        return 0.0, 0.1, 10, [[[1, 2, 3]]] * len(units), [[0, 1]] * len(units), 10

    monkeypatch.setattr(choose_mod, "side_by_side", lambda *a, **kw: None)
    monkeypatch.setattr(choose_mod, "_decode", decode)
    long_prompt = "Tell me about the history of the printing press in Europe and its effects on literacy. " * 2
    entry = choose_mod.measure(smollm, [(None, "lookup-4-table")], prompts=[long_prompt], prompt_bucket=32,
                               reply_tokens=736)
    for tree, mode in (("ar", "ar"), ("lookup-4-table", "speculative")):
        units, kw = seen[tree]
        request = prepare_generate(smollm, ["hi"], mode=mode, max_new_tokens=736, tree=tree if
                                   mode == "speculative" else None, head=NoHead() if mode == "speculative" else None)
        assert request.prompt.shape[1] == 32 and kw["cache_size"] == request.cache_size == entry["cache_size"][tree]
        assert kw["prompt_bucket"] == 32 and len(units[0][0]) == 32  # the prompt's token ids, cut to the bucket
    assert entry["programs_reused"] is True
    # 32 + 736 tokens fill 768 slots, not the tree's too
    assert entry["cache_size"]["ar"] < entry["cache_size"]["lookup-4-table"]
    # a request that names its cache size: that size for every run
    entry = choose_mod.measure(smollm, [(None, "lookup-4-table")], prompts=[long_prompt], prompt_bucket=32,
                               reply_tokens=100, cache_size=1024)
    assert entry["cache_size"] == {"ar": 1024, "lookup-4-table": 1024} and seen["ar"][1]["cache_size"] == 1024
    # a batch whose prompt tokens pass `REUSE_TOKENS` (8 x 128): the prompts cut to the smallest bucket, their end
    # kept (the question and the assistant's turn), the request's cache sizes kept
    entry = choose_mod.measure(smollm, [(None, "lookup-4-table")], prompts=[long_prompt], prompt_bucket=128,
                               reply_tokens=100, batch_size=8)
    units, kw = seen["ar"]
    ids = choose_mod.check_request(smollm, [long_prompt]).ids[0]
    assert len(ids) > 32 and units[0][0] == ids[-32:] and len(units[0]) == 8
    assert kw["prompt_bucket"] == entry["prompt_bucket"] == 32 and entry["programs_reused"] is False
    ar = prepare_generate(smollm, [ids], mode="ar", max_new_tokens=100, prompt_bucket=128)
    assert kw["cache_size"] == entry["cache_size"]["ar"] == ar.cache_size
    # a request past the model's context: the chat request's shapes
    entry = choose_mod.measure(smollm, [(None, "lookup-4-table")], prompts=[long_prompt], prompt_bucket=32,
                               reply_tokens=10 ** 6)
    assert entry["prompt_bucket"] is None and set(entry["cache_size"].values()) == {choose_mod.CACHE_SIZE}
    assert seen["ar"][1]["cache_size"] == choose_mod.CACHE_SIZE and "prompt_bucket" not in seen["ar"][1]
