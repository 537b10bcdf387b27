"""The evaluation harness on a tiny model: same-run AR vs speculative statistics, zero greedy mismatches."""

import numpy as np
import pytest

from clover_jax.tuning.evaluation import bootstrap_ci, evaluate
from clover_jax.heads.clover2.model import Clover2Config, init_from_base
from clover_jax.io.loader import LoadedModel
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import init_llama
from clover_jax.validation import InputError
from word_tokenizer import WordTokenizer




@pytest.mark.slow  # evaluates heads on prompts
def test_evaluate_reports_tau_speed_and_no_mismatch():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, eos_token_ids=(2,))
    base = init_llama(cfg, seed=0)
    head = init_from_base(base, Clover2Config())
    loaded = LoadedModel(cfg, base, WordTokenizer(), "tiny")
    prompts = ["a b c", "hello there world", "x y", "one two three four five"]
    res = evaluate(loaded, head, prompts, trees=["clover2-26", "chain-3"], batch_size=2, max_new_tokens=16,
                   categories=["w", "w", "m", "m"], progress=False, replay=True)
    assert res["greedy_mismatches"] == 0 and res["greedy_compared"] == 8
    assert res["greedy_differing_prompts"] == {"clover2-26": [], "chain-3": []}
    assert res["divergences"] == [] and res["greedy_unexplained"] == 0
    for t in ("clover2-26", "chain-3"):  # the replay certifies every emitted token on its own
        rep = res["replay"][t]
        assert rep["outputs"] == 4 and rep["tokens"] == res["runs"][t]["tokens"] and rep["violations"] == 0
    for t in ("clover2-26", "chain-3"):
        r = res["runs"][t]
        assert r["tau"] >= 1.0 and r["tokens"] == res["runs"]["ar"]["tokens"]
        hist = np.asarray(r["accept_hist"])
        assert hist.sum() > 0 and len(r["accept_rate_per_depth"]) == len(hist) - 1
        assert r["speedup_vs_ar"] > 0
        # two batches: the intervals span the two batches' own values, the overall value inside
        lo, hi = r["speedup_ci95"]
        assert 0 < lo <= r["speedup_vs_ar"] <= hi
        lo, hi = r["tau_ci95"]
        assert 1.0 <= lo <= r["tau"] <= hi
        assert len(res["per_batch"][t]) == 2 and sum(b[0] for b in res["per_batch"][t]) == r["tokens"]
    assert {p["category"] for p in res["per_prompt"]["chain-3"]} == {"w", "m"}


@pytest.mark.slow  # evaluates heads on prompts
def test_a_fixed_prompt_bucket_compiles_one_program_per_run_ahead_of_timing():
    """`prompt_bucket` pads prompts of several buckets to one; `warmup_threads` compiles every run's programs before
    the first timed call, side by side: each loop compiles once, and the outputs are still exact."""
    from clover_jax.compile_cache import CompileCounter

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, eos_token_ids=(2,))
    base = init_llama(cfg, seed=1)
    head = init_from_base(base, Clover2Config())
    loaded = LoadedModel(cfg, base, WordTokenizer(), "tiny")
    prompts = ["a b c", " ".join(["w"] * 40), "x y"]  # buckets 32 and 64 on their own
    with CompileCounter() as count:
        res = evaluate(loaded, head, prompts, trees=["chain-3"], max_new_tokens=8, progress=False, prompt_bucket=64,
                       warmup_threads=2)
    assert count.compiled["autoregressive_loop"] == 1 and count.compiled["speculative_loop"] == 1
    assert res["greedy_mismatches"] == 0 and res["greedy_compared"] == 3
    assert res["runs"]["chain-3"]["compile_seconds"] > 0


@pytest.mark.slow  # evaluates heads on prompts
def test_a_second_head_is_compared_with_the_first_evaluations_autoregressive_run():
    """`keep_reference` / `reference`: the second evaluation does not run plain decoding again (no autoregressive
    program is built), reports the first one's run, and still compares every output with it; a reference made on
    other settings is refused by name."""
    from clover_jax.compile_cache import CompileCounter
    from clover_jax.tuning.evaluation import Reference
    from clover_jax.validation import InputError

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, eos_token_ids=(2,))
    base = init_llama(cfg, seed=2)
    loaded = LoadedModel(cfg, base, WordTokenizer(), "tiny")
    prompts = ["a b c", "hello there world", "x y"]
    first = evaluate(loaded, init_from_base(base, Clover2Config()), prompts, trees=["chain-3"], max_new_tokens=8,
                     progress=False, keep_reference=True)
    ref = first.pop("reference")
    assert isinstance(ref, Reference) and len(ref.outputs) == 3 and all(len(o) == 8 for o in ref.outputs)
    other = init_from_base(base, Clover2Config(), seed=5)  # another head
    with CompileCounter() as count:
        second = evaluate(loaded, other, prompts, trees=["chain-3"], max_new_tokens=8, progress=False,
                          reference=ref)
    assert count.compiled.get("autoregressive_loop", 0) == 0
    assert second["runs"]["ar"]["reused"] and second["runs"]["ar"]["seconds"] == first["runs"]["ar"]["seconds"]
    assert second["greedy_mismatches"] == 0 and second["greedy_compared"] == 3
    assert len(second["per_batch"]["ar"]) == 3  # not run again beside the second head
    expect = second["runs"]["chain-3"]["tokens_per_second"] / first["runs"]["ar"]["tokens_per_second"]
    assert second["runs"]["chain-3"]["speedup_vs_ar"] == pytest.approx(expect, abs=1e-3)
    with pytest.raises(InputError, match="other prompts or settings"):
        evaluate(loaded, other, prompts, trees=["chain-3"], max_new_tokens=4, progress=False, reference=ref)


def test_bootstrap_ci_of_a_ratio_of_sums():
    """The interval of sum(num) / sum(den) (and of a product of such ratios) resamples rows: it collapses to the
    value where every row has the same ratio, holds the overall value, narrows with more rows, and is reproducible."""
    rng = np.random.default_rng(0)
    den = rng.uniform(1, 3, 40)
    assert bootstrap_ci(2.5 * den, den) == pytest.approx((2.5, 2.5))
    assert bootstrap_ci([1.0], [1.0]) is None  # one row: nothing to resample
    num = den * rng.normal(2.0, 0.3, 40)
    lo, hi = bootstrap_ci(num, den)
    assert lo < num.sum() / den.sum() < hi and hi - lo < 0.5
    assert bootstrap_ci(num, den) == (lo, hi)  # deterministic for a seed
    many = np.tile(num, 10), np.tile(den, 10)
    lo10, hi10 = bootstrap_ci(*many)
    assert hi10 - lo10 < (hi - lo) / 2  # ten times the rows: about a third of the width
    # two columns: the product of two rates resampled on the same rows (a speed-up of paired timings)
    t_tok, t_sec, a_tok, a_sec = den * 10, den * 2, den * 10, den * 3  # every batch 1.5x faster
    assert bootstrap_ci(np.stack([t_tok, a_sec], 1), np.stack([t_sec, a_tok], 1)) == pytest.approx((1.5, 1.5))


@pytest.mark.slow  # evaluates on an 8-device mesh
def test_evaluate_on_a_mesh_matches_one_device():
    """`evaluate(..., mesh=)` (8 simulated devices, data=2, tp=2 on 4 of them): the same per-prompt tau and
    tokens as on one device, still 0 greedy mismatches."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, eos_token_ids=(2,))
    base = init_llama(cfg, seed=0)
    head = init_from_base(base, Clover2Config())
    loaded = LoadedModel(cfg, base, WordTokenizer(), "tiny")
    prompts = ["a b c", "hello there world", "x y"]
    kw = dict(trees=["chain-3"], batch_size=3, max_new_tokens=12, progress=False)
    one = evaluate(loaded, head, prompts, **kw)
    sharded = evaluate(loaded, head, prompts, mesh="data=2,tp=2", **kw)
    assert sharded["greedy_mismatches"] == 0
    assert sharded["per_prompt"] == one["per_prompt"]
    assert sharded["runs"]["chain-3"]["accept_hist"] == one["runs"]["chain-3"]["accept_hist"]


@pytest.mark.slow  # evaluates heads on prompts
def test_an_opened_head_brings_its_draft_vocabulary_and_table(tmp_path, monkeypatch):
    """`evaluate(loaded, bundle, ...)` with the `HeadBundle` of a head folder: a `+dv` run drafts from the vocabulary
    the head was trained on and a `...-table` tree from the folder's n-gram table, neither passed again; the folder
    is read through the bundle only (no other reader of its files is called), and the outputs stay exact."""
    from clover_jax.decoding import ngram
    from clover_jax.decoding.ngram import build_ngram_table, save_ngram_table
    from clover_jax.heads import bundle as bundle_mod
    from clover_jax.heads import draft_vocab as draft_vocab_mod
    from clover_jax.heads import folder as folder_mod
    from clover_jax.heads.bundle import open_head
    from clover_jax.heads.draft_vocab import DRAFT_VOCAB_FILE, save_draft_vocab
    from clover_jax.heads.export import export_head

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, eos_token_ids=(2,))
    base = init_llama(cfg, seed=3)
    loaded = LoadedModel(cfg, base, WordTokenizer(), "tiny")
    folder = export_head(init_from_base(base, Clover2Config()), tmp_path / "head", base=base)
    save_draft_vocab(folder / DRAFT_VOCAB_FILE, np.arange(3, 40), head_trained_on_it=True)
    save_ngram_table(build_ngram_table([list(range(3, 60)) * 2], vocab_size=64), folder)
    bundle = open_head(folder, base)
    for mod, name in ((bundle_mod, "open_folder"), (folder_mod, "open_folder"), (draft_vocab_mod, "head_draft_vocab"),
                      (ngram, "load_ngram_table")):  # what opens a head folder (or its table) by its path
        monkeypatch.setattr(mod, name, lambda *a, **k: pytest.fail("the head folder was opened again"))
    prompts = ["a b c", "hello there world"]
    res = evaluate(loaded, bundle, prompts, trees=["chain-3+dv", "chain-2+lookup-2-table"], max_new_tokens=8,
                   progress=False)
    assert res["greedy_mismatches"] == 0 and res["greedy_compared"] == 4
    assert res["runs"]["chain-3+dv"]["tau"] >= 1.0 and res["runs"]["chain-2+lookup-2-table"]["tau"] >= 1.0
    module_only = evaluate(loaded, bundle.module, prompts, trees=["chain-3"], max_new_tokens=8, progress=False)
    with pytest.raises(InputError, match="draft vocabulary"):  # a module alone brings none
        evaluate(loaded, bundle.module, prompts, trees=["chain-3+dv"], max_new_tokens=8, progress=False)
    assert module_only["greedy_mismatches"] == 0
