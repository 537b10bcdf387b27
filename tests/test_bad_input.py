"""Bad input never crashes: every entry point reports it in one line naming the argument, value and limit.

The command-line tools run in-process on a tiny random Llama (SmolLM2's vocabulary and tokenizer) exported to a
Hugging Face folder: exit status 2, an `error: ...` line, no traceback, nothing left behind.
"""

import json
import math
import os
import stat
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from clover_jax.decoding.ngram import build_ngram_table, save_ngram_table
from clover_jax import generate
from clover_jax import prepare_generate
from clover_jax.validation import PromptError
from clover_jax.heads.clover2.model import Clover2Config, Clover2Head
from clover_jax.heads.export import export_head
from clover_jax.io.export import ExportError, export_base
from clover_jax.io.loader import load_model, load_tokenizer, resolve_model_path
from clover_jax.models.config import LlamaConfig
from clover_jax.models.llama import init_llama
from clover_jax.validation import InputError, InsufficientMemoryError, WeightFileError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import infer  # noqa: E402
from clover_jax.cli import export as export_cli  # noqa: E402

CONTEXT = 256


def tiny_config(tokenizer, hidden=32) -> LlamaConfig:
    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                       max_position_embeddings=CONTEXT, eos_token_ids=(tokenizer.eos_token_id,),
                       bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny model folder, a head for it, a head for another model, and bad files of every kind."""
    d = tmp_path_factory.mktemp("bad_input")
    tok = load_tokenizer("smollm2-135m-instruct")
    base = init_llama(tiny_config(tok), seed=0)
    export_base(base, d / "model", tokenizer=tok)
    head = Clover2Head(base.config, Clover2Config(num_heads=3, num_aug_layers=1), rngs=nnx.Rngs(0))
    export_head(head, d / "head", base=base, base_name=str(d / "model"))
    other = init_llama(tiny_config(tok, hidden=48), seed=1)
    export_head(Clover2Head(other.config, Clover2Config(num_heads=3, num_aug_layers=1), rngs=nnx.Rngs(0)),
                d / "other_head", base=other)
    # a model folder whose weights are cut in half
    (d / "truncated").mkdir()
    for f in (d / "model").iterdir():
        data = f.read_bytes()
        (d / "truncated" / f.name).write_bytes(data[: len(data) // 2] if f.name == "model.safetensors" else data)
    with open(resolve_model_path("smollm2-135m-instruct"), "rb") as f:  # a GGUF cut short: header, no weights
        (d / "truncated.gguf").write_bytes(f.read(4 * 1024 ** 2))
    (d / "broken_tree.json").write_text('{"choices": [[0], [1]')
    (d / "bad_prompts.jsonl").write_text('{"prompt": "hi"}\n{not json\n')
    (d / "bad_vocab.json").write_text(json.dumps({"ids": [1, 2, 10 ** 6]}))
    (d / "latin1_prompts.jsonl").write_bytes('{"prompt": "hi"}\n{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    (d / "binary_prompts.jsonl").write_bytes(bytes(np.random.default_rng(0).integers(128, 256, 400, dtype=np.uint8)))
    (d / "list_prompts.jsonl").write_text('{"prompt": "hi"}\n[1, 2, 3]\n')
    (d / "number_prompts.jsonl").write_text('5\n')
    (d / "string_turns.jsonl").write_text('{"turns": "abc"}\n')
    # a head folder whose n-gram table is cut short, and one without its config.json
    import shutil
    shutil.copytree(d / "head", d / "head_cut_table")
    save_ngram_table(build_ngram_table([list(range(2, 60)) * 3], vocab_size=base.config.vocab_size),
                     d / "head_cut_table")
    table = d / "head_cut_table" / "ngram_table.npz"
    table.write_bytes(table.read_bytes()[: table.stat().st_size // 2])
    shutil.copytree(d / "head", d / "head_no_config")
    (d / "head_no_config" / "config.json").unlink()
    return {"dir": d, "model": d / "model", "head": d / "head", "other_head": d / "other_head",
            "base": base, "head_module": head, "tokenizer": tok}


def _listing(d: Path):
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def _run(main, args, capsys, files):
    before = _listing(files["dir"])
    code = main(args)
    err = capsys.readouterr().err
    assert _listing(files["dir"]) == before, "left files behind"
    return code, err


INFER_CASES = [  # (args, what the error names); {model} {head} ... are filled from the fixture
    (["--prompt", ""], "--prompt"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["--prompt", "hi", "--temperature", "-0.5"], "--temperature"),
    (["--prompt", "hi", "--temperature", "nan"], "--temperature"),
    (["--prompt", "hi", "--temperature", "inf"], "--temperature"),
    (["--prompt", "hi", "--top-p", "1.5"], "--top-p"),
    (["--prompt", "hi", "--top-p", "0"], "--top-p"),
    (["--prompt", "hi", "--top-k", "-3"], "--top-k"),
    (["--prompt", "hi", "--batch-size", "0"], "--batch-size"),
    (["--prompt", "hi", "--batch-size", "-1"], "--batch-size"),
    (["--prompts-file", "mt_bench", "--limit", "-1"], "--limit"),
    (["--prompt", "hi", "--cache-size", "0"], "--cache-size"),
    (["--prompt", "hi", "--model", "{dir}/no-such-model"], "no-such-model"),
    (["--prompts-file", "{dir}/missing.jsonl"], "prompts file not found"),
    (["--prompts-file", "{dir}/bad_prompts.jsonl"], "bad_prompts.jsonl:2"),
    (["--prompts-file", "{dir}/latin1_prompts.jsonl"], "latin1_prompts.jsonl:2: not UTF-8"),
    (["--prompts-file", "{dir}/binary_prompts.jsonl"], "binary_prompts.jsonl:1: not UTF-8"),
    (["--prompts-file", "{dir}/list_prompts.jsonl"], "list_prompts.jsonl:2: expected a JSON object"),
    (["--prompts-file", "{dir}/number_prompts.jsonl"], "number_prompts.jsonl:1: expected a JSON object"),
    (["--prompts-file", "{dir}/string_turns.jsonl"], "string_turns.jsonl:1: 'turns' must be a list of strings"),
    (["--prompt", "hi", "--mode", "speculative", "--head", "{dir}/head_cut_table", "--tree", "chain-3+lookup-4-table"],
     "ngram_table.npz: unreadable"),
    (["--prompt", "hi", "--mode", "speculative", "--head", "{dir}/head_no_config"], "has no config.json"),
    (["--prompt", "hi", "--model", "{dir}/truncated"], "model.safetensors"),
    (["--prompt", "hi", "--model", "{dir}/truncated.gguf"], "truncated.gguf"),
    (["--prompt", "hi", "--mode", "speculative", "--head", "{dir}/no-such-head"], "--head"),
    (["--prompt", "hi", "--mode", "speculative", "--head", "{other_head}"], "hidden_size"),
    (["--prompt", "hi", "--mode", "speculative", "--head", "{head}", "--tree", "{dir}/broken_tree.json"],
     "broken_tree.json"),
    (["--prompt", "hi", "--mode", "speculative", "--head", "{head}", "--tree", "no-such-tree"], "tree"),
    (["--prompt", "hi", "--mode", "speculative", "--head", "{head}", "--tree", "chain-7"], "drafts deep"),
    (["--prompt", "hi", "--mode", "speculative", "--head", "{head}", "--draft-vocab", "{dir}/bad_vocab.json"],
     "draft vocabulary"),
    (["--prompt", "hi", "--mode", "speculative", "--head", "{head}", "--draft-vocab", "{dir}/none.json"],
     "draft vocabulary file not found"),
    (["--prompt", "hi", "--max-new-tokens", "1000"], "max_position_embeddings=256"),
    (["--prompt", "hi", "--mode", "speculative", "--head", "{head}", "--tree", "chain-3", "--max-new-tokens", "1000"],
     "max_position_embeddings=256"),
    (["--prompt", "hi", "--cache-size", "40", "--max-new-tokens", "30"], "max_new_tokens=30"),
    (["--prompt", "word " * 300], "max_position_embeddings=256"),
]


@pytest.mark.parametrize("args,names", INFER_CASES, ids=[" ".join(a)[:60] for a, _ in INFER_CASES])
def test_infer_bad_input(args, names, files, capsys):
    fill = {k: str(v) for k, v in files.items() if isinstance(v, Path)}
    args = [a.format(**fill) for a in args]
    if "--model" not in args:
        args += ["--model", str(files["model"])]
    code, err = _run(infer.main, args, capsys, files)
    assert code == 2, err
    assert err.startswith("error: ") or "\nerror: " in err, err
    assert names in err, err
    assert "Traceback" not in err


@pytest.mark.slow  # infer.py loads a model folder and plans the request
def test_infer_cache_error_reports_the_value_asked_for(files, capsys):
    code, err = _run(infer.main, ["--prompt", "hi", "--model", str(files["model"]), "--cache-size", "40",
                                  "--max-new-tokens", "30"], capsys, files)
    assert code == 2 and "max_new_tokens=30" in err and "cache_size=40" in err and "max_new_tokens=1 " not in err


def test_debug_shows_the_traceback(files, capsys, monkeypatch):
    code, err = _run(infer.main, ["--prompt", "hi", "--top-p", "2", "--debug"], capsys, files)
    assert code == 2 and "Traceback" in err and "error: --top-p" in err
    monkeypatch.setenv("CLOVER_DEBUG", "1")
    code, err = _run(infer.main, ["--prompt", "hi", "--top-p", "2"], capsys, files)
    assert code == 2 and "Traceback" in err


def test_internal_errors_keep_their_traceback():
    from clover_jax.cli import run_cli

    def broken(argv):
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        run_cli(broken, [])
    assert run_cli(lambda argv: (_ for _ in ()).throw(InputError("x: bad")), []) == 2


EXPORT_CASES = [
    (["base", "--model", "{dir}/truncated", "--out", "{dir}/out"], "model.safetensors"),
    (["base", "--model", "{dir}/no-such", "--out", "{dir}/out"], "no-such"),
    (["base", "--model", "{model}", "--out", "{dir}/out", "--max-shard-gb", "0"], "--max-shard-gb"),
    (["head", "--checkpoint", "{dir}/no-run", "--out", "{dir}/out"], "no-run"),
    (["head", "--checkpoint", "{head}", "--out", "{dir}/out", "--step", "-1"], "--step"),
    (["base", "--model", "{model}", "--out", "{model}"], "already exists"),
]


@pytest.mark.parametrize("args,names", EXPORT_CASES, ids=[" ".join(a)[:60] for a, _ in EXPORT_CASES])
def test_export_bad_input(args, names, files, capsys):
    fill = {k: str(v) for k, v in files.items() if isinstance(v, Path)}
    code, err = _run(export_cli.main, [a.format(**fill) for a in args], capsys, files)
    assert code == 2 and names in err and "Traceback" not in err, err


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_export_to_an_unwritable_place_names_out(files, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        code = export_cli.main(["base", "--model", str(files["model"]), "--out", str(locked / "x")])
        err = capsys.readouterr().err
        assert code == 2 and str(locked / "x") in err and ".tmp" not in err
    finally:
        locked.chmod(0o755)


def test_unwritable_out_names_out_not_the_temp_dir(files, tmp_path, monkeypatch):
    import tempfile

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied", str(tmp_path / ".x.tmpabc"))

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    with pytest.raises(ExportError, match=r"out: cannot write the folder .*/x: Permission denied") as e:
        export_base(files["base"], tmp_path / "x")
    assert ".tmp" not in str(e.value)


def test_exported_folders_are_readable_by_all(files, tmp_path):
    old = os.umask(0o022)
    try:
        out = export_base(files["base"], tmp_path / "base")
        head = export_head(files["head_module"], tmp_path / "head", base=files["base"])
    finally:
        os.umask(old)
    for folder in (out, head):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755
        for f in folder.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o644, f
    os.umask(0o027)
    try:
        out = export_base(files["base"], tmp_path / "base2")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o640


# ------------------------------------------------------------------------------------------------ the API
API_CASES = [  # (keyword arguments of generate, what the error names)
    (dict(prompts=[[1, 2, 10 ** 6]]), "prompts[0][2]"),
    (dict(prompts=[[1, -4]]), "prompts[0][1]"),
    (dict(prompts=[[1, float("nan")]]), "prompts[0][1]"),
    (dict(prompts=[[1, 2.5]]), "prompts[0][1]"),
    (dict(prompts=[[1, True]]), "prompts[0][1]"),
    (dict(prompts=[]), "prompts"),
    (dict(prompts=[None]), "prompts[0]"),
    (dict(prompts=["  "]), "prompts[0]"),
    (dict(prompts=[[1, 2]], max_new_tokens=2.5), "max_new_tokens"),
    (dict(prompts=[[1, 2]], max_new_tokens=0), "max_new_tokens"),
    (dict(prompts=[[1, 2]], top_k=2.5), "top_k"),
    (dict(prompts=[[1, 2]], top_k=-1), "top_k"),
    (dict(prompts=[[1, 2]], temperature=float("nan")), "temperature"),
    (dict(prompts=[[1, 2]], temperature=-1.0), "temperature"),
    (dict(prompts=[[1, 2]], temperature="hot"), "temperature"),
    (dict(prompts=[[1, 2]], top_p=1.5), "top_p"),
    (dict(prompts=[[1, 2]], top_p=float("inf")), "top_p"),
    (dict(prompts=[[1, 2]], seed=1.5), "seed"),
    (dict(prompts=[[1, 2]], cache_size=0), "cache_size"),
    (dict(prompts=[[1, 2]], cache_size=8.0), "cache_size"),
    (dict(prompts=[[1, 2]], mode="fast"), "mode"),
    (dict(prompts=[[1, 2]], mode="speculative"), "head"),
    (dict(prompts=[[1, 2]], max_new_tokens=CONTEXT), "max_position_embeddings"),
    (dict(prompts=[[1] * (CONTEXT + 1)], max_new_tokens=1), "max_position_embeddings"),
    # 200 + 55 = 255 fits the context, but the 3-deep drafts of the last step reach position 257
    (dict(prompts=[[1] * 200], max_new_tokens=55, mode="speculative", head="{head}", tree="chain-3"),
     "drafts 3 deep"),
    (dict(prompts=[[1, 2]], max_new_tokens=10, cache_size=8), "cache_size=8"),
    (dict(prompts=[[1, 2]], mode="speculative", head="{head}", tree="chain-3", draft_vocab=[1, 1, 2]), "duplicate"),
    (dict(prompts=[[1, 2]], mode="speculative", head="{head}", tree="chain-9"), "drafts deep"),
    (dict(prompts=[[1, 2]], layers="unroll"), "layers"),
    (dict(prompts=[[1, 2]], layers="unrolled", mesh="data=1"), "layers: 'unrolled' is not supported with a mesh"),
]


@pytest.mark.parametrize("kw,names", API_CASES, ids=[str(i) for i in range(len(API_CASES))])
def test_generate_bad_input(kw, names, files):
    kw = dict(kw)
    if kw.get("head") == "{head}":
        kw["head"] = str(files["head"])
    prompts = kw.pop("prompts")
    with pytest.raises(InputError) as e:
        prepare_generate(files["base"], prompts, tokenizer=files["tokenizer"], **kw)
    assert names in str(e.value)


def test_generate_checks_memory_before_compiling(files, monkeypatch):
    from clover_jax.decoding import memory

    monkeypatch.setattr(memory, "available_memory", lambda device=None: (1024 ** 2, "a test device"))
    with pytest.raises(InsufficientMemoryError, match=r"batch=8 prompts, cache_size=4096.*KV cache.*1.0 MiB are "
                                                      r"free on a test device"):
        generate(files["base"], [[1, 2, 3]] * 8, max_new_tokens=8, cache_size=4096)
    parts = memory.estimate_generate_memory(files["base"].config, batch=8, cache_size=4096, prompt_len=32,
                                                dtype_bytes=4)
    c = files["base"].config
    assert parts["KV cache"] == 2 * 2 * c.num_hidden_layers * 8 * 4096 * c.num_key_value_heads * c.head_dim * 4
    free, where = memory.available_memory()
    assert free is None or (free > 0 and where)
    # a long prompt's attention is planned per prefill block, for the draft head's prompt pass too (it runs in
    # blocks, `commit_prompt`): Llama-3-8B's 32 heads over an 8,192-token prompt, not [T, T] scores (17 GB)
    from clover_jax.models.config import LlamaConfig

    big = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    for nodes in (0, 26):
        parts = memory.estimate_generate_memory(big, batch=1, cache_size=8448, prompt_len=8192, dtype_bytes=2,
                                                    tree_nodes=nodes, head_layers=2, draft_rows=32000)
        assert parts["prefill attention"] == 2 * 32 * 256 * (256 + 256) * 4  # 33.6 MB


def test_good_input_still_generates(files):
    out = generate(files["base"], [[1, 2, 3], np.array([4, 5])], max_new_tokens=3, cache_size=64)
    assert all(1 <= len(t) <= 3 for t in out.token_ids)
    with pytest.raises(PromptError):
        generate(files["base"], "text without a tokenizer", max_new_tokens=3)


def test_load_model_and_load_head_bad_input(files):
    from clover_jax.training.loading import load_head

    with pytest.raises(WeightFileError, match=r"truncated.*model\.safetensors"):
        load_model(files["dir"] / "truncated")
    with pytest.raises(WeightFileError, match="truncated.gguf"):
        load_model(files["dir"] / "truncated.gguf")
    with pytest.raises(InputError, match="name_or_path"):
        load_model(None)
    with pytest.raises(InputError, match="dtype"):
        load_model(files["model"], dtype="int8")
    with pytest.raises(InputError, match="step"):
        load_head(files["head"], files["base"], step=-2)
    with pytest.raises(InputError, match="base"):
        load_head(files["head"], "not a model")


def test_validation_helpers():
    from clover_jax.validation import check_float, check_int, check_token_ids

    assert check_int("n", np.int64(3), minimum=1) == 3
    for bad in (2.0, "3", True, None):
        with pytest.raises(InputError, match="n: expected an integer"):
            check_int("n", bad)
    with pytest.raises(InputError, match=r"n: expected an integer in \[1, 4\], got 5"):
        check_int("n", 5, minimum=1, maximum=4)
    with pytest.raises(InputError, match="x: expected a finite number, got nan"):
        check_float("x", math.nan)
    assert check_token_ids("p", np.array([0, 5]), 6) == [0, 5]
    with pytest.raises(InputError, match=r"p\[1\]: token id 6 is outside the model's vocabulary \[0, 6\)"):
        check_token_ids("p", [0, 6], 6)
