"""`tree="auto"` and `python -m clover_jax.cli.calibrate`: candidates measured against autoregressive decoding in
one run, the choice saved beside the head and reused, "ar" when no tree pays, and what generate does with it."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import clover_jax
from clover_jax.generation import calibration
from clover_jax.heads import bundle as bundle_mod
from clover_jax.heads.folder import open_folder
from clover_jax.tuning import calibrate
from clover_jax.heads.clover2.model import Clover2Config, init_from_base
from clover_jax.heads.medusa.head import MedusaConfig, init_from_base as medusa_from_base
from clover_jax.io.loader import LoadedModel
from clover_jax.models.llama import init_llama
from word_tokenizer import WordTokenizer
from clover_jax.validation import InputError
from tiny_llama import TINY_LLAMA

sys.path.insert(0, str(Path(__file__).resolve().parent / "heads"))  # spec_helpers
from spec_helpers import ranked_medusa  # noqa: E402

CFG = TINY_LLAMA




@pytest.fixture(scope="module")
def tiny():
    base = init_llama(CFG, seed=0)
    return LoadedModel(CFG, base, WordTokenizer(), "tiny"), init_from_base(base, Clover2Config())


PROMPTS = ["a b c d", "hello there world", "x y z w v"]


@pytest.mark.slow  # times each candidate tree
def test_measure_tries_each_candidate_against_ar(tiny):
    loaded, head = tiny
    entry = calibrate.measure(loaded, head, prompts=PROMPTS, candidates=["chain-2", "dynamic-4", "clover2-26"],
                              max_new_tokens=8, fit=False)
    lookups = {t for t, r in entry["candidates"].items() if r.get("lookup")}
    assert set(entry["candidates"]) - lookups == {"chain-2", "dynamic-4", "clover2-26"}
    # the final round: the two fastest again, and the faster static one with a prompt-lookup chain beside it
    finalists = {t for t, r in entry["candidates"].items() if "final_speedup" in r}
    assert len(finalists) == calibrate.FINALISTS and len(lookups) == 1
    assert lookups <= {f"{t}+lookup-{calibrate.LOOKUP_LENGTH}" for t in finalists - {"dynamic-4"}}
    assert entry["greedy_mismatches"] == 0 and entry["version"] == calibration.VERSION
    for r in entry["candidates"].values():
        assert r["tau"] >= 1.0 and r["speedup"] > 0 and r["tokens_per_second"] > 0
    final = {t: entry["candidates"][t].get("final_speedup", entry["candidates"][t]["speedup"])
             for t in finalists | lookups}
    best = max(final, key=final.get)
    assert entry["best"] == (best if final[best] > 1.0 else "ar")


def test_candidates_fit_the_head(tiny):
    loaded, _ = tiny
    medusa = medusa_from_base(loaded.model, MedusaConfig(num_heads=3))
    names = calibrate.candidate_trees(medusa, loaded.model)
    assert "chain-3" in names and "chain-4" not in names  # deeper than its 3 heads
    assert not any(n.startswith("dynamic") for n in names)  # Medusa drafts static trees only
    with pytest.raises(calibration.CalibrationError, match="no candidate tree"):
        calibrate.measure(loaded, medusa, prompts=PROMPTS, candidates=["chain-4"], max_new_tokens=4)


def _entry(best, version=calibration.VERSION):
    return {"best": best, "ar_tokens_per_second": 1.0, "candidates": {}, "prompts": 1} | (
        {"version": version} if version else {})


def test_saved_beside_the_head_and_reused(tmp_path, monkeypatch):
    folder = tmp_path / "head"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"0")
    monkeypatch.setenv("CLOVER_JAX_CACHE", str(tmp_path / "cache"))
    key = calibration.entry_key("cpu: test x2", "float32", 1)
    assert calibration.load_entry(str(folder), key) is None
    assert calibration.save_entry(str(folder), key, _entry("chain-3")) == folder / "calibration.json"
    assert calibration.load_entry(str(folder), key)["best"] == "chain-3"
    # another batch size on the same hardware: the nearest saved one
    assert calibration.load_entry(str(folder), calibration.entry_key("cpu: test x2", "float32", 8))["best"] == "chain-3"
    # other hardware or dtype: none
    assert calibration.load_entry(str(folder), calibration.entry_key("gpu: H100", "float32", 1)) is None
    assert calibration.load_entry(str(folder), calibration.entry_key("cpu: test x2", "bfloat16", 1)) is None
    data = json.loads((folder / "calibration.json").read_text())
    assert list(data["entries"]) == [key]
    # new weights in the same folder (a head replaced in place): the old measurement is not theirs
    (folder / "model.safetensors").write_bytes(b"1")
    assert calibration.load_entry(str(folder), key) is None
    (folder / "model.safetensors").write_bytes(b"0")  # the same contents again (dates differ, as after a clone)
    assert calibration.load_entry(str(folder), key)["best"] == "chain-3"
    # an entry of an older calibration (it never tried some of today's candidates) is not used, and is reported
    for old in (None, calibration.VERSION - 1):
        calibration.save_entry(str(folder), key, _entry("chain-2", version=old))
        stale = []
        assert calibration.load_entry(str(folder), key, stale) is None and stale == [key]
        assert calibration.load_entry(str(folder), calibration.entry_key("cpu: test x2", "float32", 8)) is None


def test_a_new_calibration_keeps_the_fitted_trees_it_replaces(tmp_path, monkeypatch):
    """A registered head's default tree names a fitted tree of its calibration; calibrating again on the same
    machine replaces that entry and may fit other shapes, and the old name must still resolve."""
    from clover_jax.decoding import tree as tree_mod

    folder = tmp_path / "head"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"0")
    monkeypatch.setenv("CLOVER_JAX_CACHE", str(tmp_path / "cache"))
    key = calibration.entry_key("cpu: test x2", "float32", 1)
    old = {"fit-3-aaaaaa": {"choices": [[0], [1]], "top_k": 2}}
    new = {"fit-3-bbbbbb": {"choices": [[0], [0, 0]], "top_k": 1}}
    calibration.save_entry(str(folder), key, _entry("fit-3-aaaaaa") | {"trees": old})
    calibration.save_entry(str(folder), key, _entry("fit-3-bbbbbb") | {"trees": new})
    calibration.save_entry(str(folder), key, _entry("chain-2") | {"trees": {}})
    data = json.loads((folder / "calibration.json").read_text())
    assert list(data["entries"]) == [key] and data["entries"][key]["best"] == "chain-2"
    assert data[calibration.KEPT_TREES] == old | new
    trees = open_folder(str(folder)).trees  # what a head read from this folder knows by name
    assert tree_mod.get_tree("fit-3-aaaaaa+lookup-4", trees).inner.choices == ((0,), (1,))
    assert tree_mod.get_tree("fit-3-bbbbbb", trees).choices == ((0,), (0, 0))


@pytest.mark.slow  # times candidate trees
def test_generate_auto_uses_the_saved_choice(tiny, tmp_path, monkeypatch, capsys):
    """A saved choice of "ar" runs autoregressive decoding; a tree name runs that tree; both exact."""
    loaded, head = tiny
    folder = tmp_path / "head"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"0")
    monkeypatch.setenv("CLOVER_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bundle_mod, "_load_module", lambda folder, base, step, run_loader: head)
    key = calibration.entry_key(calibration.hardware_key(), "float32", 2)
    ids = [[5, 6, 7], [9, 10, 11, 12]]
    ar = clover_jax.generate(loaded.model, ids, max_new_tokens=10)
    calibration.save_entry(str(folder), key, _entry("ar"))
    res = clover_jax.generate(loaded.model, ids, max_new_tokens=10, mode="speculative", head=str(folder), tree="auto")
    assert res.stats["choice"]["tree"] == "ar" and res.stats["mode"] == "ar" and res.token_ids == ar.token_ids
    assert res.stats["notes"] == ["tree auto -> ar (autoregressive: no tree beats it on this hardware)"]
    assert set(res.stats) == {"mode", "layers", "choice", "notes"}  # plain decoding: no acceptance statistics
    calibrate._MEMO.clear()
    calibration.save_entry(str(folder), key, _entry("chain-2"))
    res = clover_jax.generate(loaded.model, ids, max_new_tokens=10, mode="speculative", head=str(folder), tree="auto")
    assert res.stats["tree"] == "chain-2" and res.token_ids == ar.token_ids
    assert len(res.stats["accept_hist"]) == 3  # a chain-2 tree: 0, 1 or 2 drafts accepted
    # a stale entry (an older calibration's) is measured again, and the reason is printed
    calibrate._MEMO.clear()
    calibration.save_entry(str(folder), key, _entry("chain-2", version=None))
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: _entry("chain-3"))
    res = clover_jax.generate(loaded, ids, max_new_tokens=10, mode="speculative", head=str(folder), tree="auto")
    assert res.stats["tree"] == "chain-3" and res.token_ids == ar.token_ids
    assert "predates candidates this version tries" in capsys.readouterr().err
    assert calibration.load_entry(str(folder), key)["best"] == "chain-3"  # saved over the stale one


@pytest.mark.slow  # times candidate trees
def test_generate_auto_calibrates_when_nothing_is_saved(tiny, capsys, monkeypatch):
    loaded, head = tiny
    calibrate._MEMO.clear()
    monkeypatch.setattr(calibrate, "DEFAULT_PROMPTS", (("spec_bench", "qa", 2),))  # a small calibration
    monkeypatch.setattr(calibrate, "STATIC_CANDIDATES", ("chain-2",))
    monkeypatch.setattr(calibrate, "DYNAMIC_CANDIDATES", ("dynamic-4",))
    monkeypatch.setattr(calibrate, "PROBE_WIDTHS", (2, 2))
    with pytest.raises(InputError, match="needs a tokenizer"):
        clover_jax.generate(loaded.model, [[5, 6, 7]], max_new_tokens=4, mode="speculative", head=head, tree="auto")
    res = clover_jax.generate(loaded, [[5, 6, 7]], max_new_tokens=4, mode="speculative", head=head, tree="auto")
    err = capsys.readouterr().err
    assert "no calibration of this head" in err and "tree='auto' ->" in err
    tree = res.stats["choice"]["tree"].removesuffix(f"+lookup-{calibrate.LOOKUP_LENGTH}")
    assert tree in ("chain-2", "dynamic-4", "probe-2-2", "ar") or tree.startswith("fit-")
    # remembered for this head object in this process: no second calibration
    clover_jax.generate(loaded, [[5, 6, 7]], max_new_tokens=4, mode="speculative", head=head, tree="auto")
    assert "no calibration" not in capsys.readouterr().err


@pytest.mark.slow  # measures acceptance, then times trees
def test_calibration_fits_the_tree_the_head_accepts(tmp_path, monkeypatch):
    """A head that always accepts child ranks (0, 0, 3) and nothing else: the probe measures that, a fitted tree
    holds that path, it is measured (tau 4), stored in the calibration, and reached by name in a later
    process through `auto`, with output equal to autoregressive decoding."""
    from clover_jax.decoding import tree as tree_mod

    base, head = ranked_medusa((0, 0, 3))
    loaded = LoadedModel(CFG, base, WordTokenizer(), "tiny")
    entry = calibrate.measure(loaded, head, prompts=PROMPTS, candidates=["chain-2", "clover2-26"],
                              max_new_tokens=12)
    assert entry["greedy_mismatches"] == 0 and entry["version"] == calibration.VERSION
    assert entry["rank_acceptance"][2][3] == 1.0 and sum(map(sum, entry["rank_acceptance"])) == 3.0
    fitted = {t: r for t, r in entry["candidates"].items() if r.get("fitted")}
    target = [[0], [0, 0], [0, 0, 3]]
    path = [t for t in fitted if all(c in entry["trees"][t]["choices"] for c in target)]  # holds the path
    assert path, entry["trees"]
    # measured: every step accepts the path; predicted from the smoothed estimate (its prior pulls the few
    # observations of each rank toward the other depths' rates), a little less. Which trees the fit picks
    # depends on this machine's measured step costs, so the bound below is the prediction for the smallest tree
    # holding the path (a tree with more nodes can only be predicted more): about 2.98 from these few steps.
    from clover_jax.decoding.trees.fit import expected_tau, smooth_acceptance

    smoothed = smooth_acceptance(np.array(entry["rank_acceptance"]), np.array(entry["rank_parents"]))
    minimal = expected_tau(tree_mod.TreeSpec(tuple(map(tuple, target)), top_k=4, name="path"), smoothed)
    assert 2.5 < minimal < 4.0
    assert fitted[path[0]]["tau"] == 4.0 and minimal - 1e-3 <= fitted[path[0]]["predicted_tau"] <= 4.0
    assert "probe-8-6-4" in entry["candidates"]  # the probe as deep as the head's three heads
    # the final round: the first round's two fastest measured again beside the fitted trees; `best` is that
    # round's fastest (all of them against the same autoregressive runs)
    first = {t: r for t, r in entry["candidates"].items() if not r.get("fitted") and not r.get("lookup")}
    finalists = sorted(first, key=lambda t: -first[t]["speedup"])[:calibrate.FINALISTS]
    assert {t for t, r in first.items() if "final_speedup" in r} == set(finalists)
    final = {t: r.get("final_speedup", r["speedup"]) for t, r in entry["candidates"].items()
             if r.get("fitted") or r.get("lookup") or t in finalists}
    assert any(r.get("lookup") for r in entry["candidates"].values())  # merged with a prompt-lookup chain
    top = max(final, key=final.get)
    assert entry["best"] == (top if final[top] > 1.0 else "ar")

    folder = tmp_path / "head"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"0")
    monkeypatch.setenv("CLOVER_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bundle_mod, "_load_module", lambda folder, base, step, run_loader: head)
    entry["best"] = path[0]
    calibration.save_entry(str(folder), calibration.entry_key(calibration.hardware_key(), "float32", 1), entry)
    calibrate._MEMO.clear()
    ids = [[5, 6, 7]]
    ar = clover_jax.generate(base, ids, max_new_tokens=13)
    res = clover_jax.generate(base, ids, max_new_tokens=13, mode="speculative", head=str(folder), tree="auto")
    assert res.stats["tree"] == path[0] and res.token_ids == ar.token_ids
    assert res.stats["tau"] == 4.0
    # ... and by its own name, read from the head's folder (the grammar alone does not know it)
    with pytest.raises(InputError, match="fitted tree"):
        tree_mod.get_tree(path[0])
    res = clover_jax.generate(base, ids, max_new_tokens=13, mode="speculative", head=str(folder), tree=path[0])
    assert res.token_ids == ar.token_ids and res.stats["tau"] == 4.0


def test_the_command_prints_the_trees_its_calibration_fitted(tiny, monkeypatch, capsys):
    """`python -m clover_jax.cli.calibrate --head RUN`: the table names the trees the calibration fitted just now
    (which no folder held before it), with their sizes, beside a lookup chain merged with one."""
    from clover_jax.cli import calibrate as calibrate_cli

    loaded, head = tiny
    fit = {"choices": [[0], [1], [0, 0]], "top_k": 2}
    row = {"tau": 1.5, "speedup": 1.1, "tokens_per_second": 10.0}
    entry = {"prompts": 3, "ar_tokens_per_second": 9.0, "greedy_mismatches": 0, "trees": {"fit-4-abc123": fit},
             "candidates": {"chain-2": row, "fit-4-abc123": dict(row, fitted=True, predicted_tau=1.4,
                                                                  predicted_speedup=1.0),
                            "fit-4-abc123+lookup-4": dict(row, lookup=True)}}
    monkeypatch.setattr(calibrate_cli, "load_model", lambda *a, **k: loaded)
    monkeypatch.setattr(calibrate_cli, "load_head", lambda *a, **k: head)
    monkeypatch.setattr(calibrate_cli, "head_draft_vocab", lambda *a, **k: None)
    monkeypatch.setattr(calibrate_cli, "resolve_auto", lambda *a, **k: ("fit-4-abc123+lookup-4", entry))
    assert calibrate_cli.main(["--model", "tiny", "--head", "runs/some-run"]) == 0
    out = capsys.readouterr().out
    assert "| fit-4-abc123 | 4 |" in out and "| fit-4-abc123+lookup-4 | 8 |" in out and "| chain-2 | 3 |" in out
    assert "auto -> fit-4-abc123+lookup-4" in out
