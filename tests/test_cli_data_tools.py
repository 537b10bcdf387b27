"""The command lines that build training and drafting data from chat files (`clover_jax.cli.draft_vocab`,
`clover_jax.cli.ngram`, `clover_jax.cli.self_distill --export-chat`) and the replies self-distillation asks the base
model for (`clover_jax.generation.replies`), on a word tokenizer and a tiny model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clover_jax import generate
from clover_jax.cli import draft_vocab as draft_vocab_cli
from clover_jax.cli import ngram as ngram_cli
from clover_jax.cli import self_distill as self_distill_cli
from clover_jax.decoding.ngram import load_ngram_table
from clover_jax.generation.replies import make_generate_fn
from clover_jax.heads.draft_vocab import load_draft_vocab
from clover_jax.io.loader import LoadedModel
from clover_jax.models.llama import init_llama
from clover_jax.training.self_distill import import_chat_file
from tiny_llama import TINY_LLAMA
from word_tokenizer import WordTokenizer

EOS = 2
REPLIES = ["the cat sat on the mat", "the dog sat on the log", "a bird sat on the cat"]


class ChatWords(WordTokenizer):
    """The word tokenizer with a chat template: `1 role words... 2` per message, then `1 assistant` to reply."""

    eos_token_id = EOS

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        ids = []
        for m in messages:
            ids += [1, *self.encode(m["role"]), *self.encode(m["content"]), EOS]
        return ids + ([1, *self.encode("assistant")] if add_generation_prompt else [])


def _chat_file(path, replies=REPLIES):
    with open(path, "w") as f:
        for i, reply in enumerate(replies):
            msgs = [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": reply}]
            f.write(json.dumps({"id": f"c{i}", "messages": msgs}) + "\n")
    return path


def test_draft_vocab_keeps_the_most_frequent_reply_tokens_and_eos(tmp_path, monkeypatch, capsys):
    tok = ChatWords()
    monkeypatch.setattr(draft_vocab_cli, "load_tokenizer", lambda name: tok)
    out = tmp_path / "dv.json"
    draft_vocab_cli.main(["--data", str(_chat_file(tmp_path / "chat.jsonl")), "--size", "4", "--out", str(out)])
    # "the" 5 times, "sat" and "on" 3 times each: with EOS, the 4 ids; no word of the user turns
    want = sorted({EOS, *tok.encode("the sat on")})
    assert load_draft_vocab(out).tolist() == want
    assert json.loads(out.read_text())["replies"] == 3
    assert "4 ids from 3 replies" in capsys.readouterr().out


def test_ngram_table_drafts_a_reply_after_the_chat_templates_reply_header(tmp_path, monkeypatch, capsys):
    tok = ChatWords()
    monkeypatch.setattr(ngram_cli, "load_model", lambda name: LoadedModel(TINY_LLAMA, None, tok, "tiny"))
    header = ngram_cli.reply_header(tok, 4)
    assert header == tok.apply_chat_template([{"role": "user", "content": "x"}])[-4:]
    out = ngram_cli.main(["--model", "tiny", "--data", str(_chat_file(tmp_path / "chat.jsonl")), "--out",
                          str(tmp_path / "head"), "--min-count", "1"])
    assert out is None and "3 replies" in capsys.readouterr().out
    table = load_ngram_table(tmp_path / "head")
    assert table.vocab_size == TINY_LLAMA.vocab_size and table.max_order == 4
    dog = tok.encode("the dog")
    assert table.chain(header + dog, 4) == (tok.encode("sat on the log"), True)  # the one reply after "the dog"
    assert table.chain(header + tok.encode("a"), 2) == (tok.encode("bird sat"), True)


def test_self_distill_exports_the_cached_replies_as_a_chat_file(tmp_path, capsys):
    cache = tmp_path / "sd"
    cache.mkdir()
    src = _chat_file(tmp_path / "chat.jsonl")
    assert import_chat_file(src, cache / "replies.jsonl") == 3
    out = tmp_path / "out.jsonl"
    assert self_distill_cli.main(["--set", f"data.self_distill_dir={cache}", "--export-chat", str(out),
                                  "--id-suffix", "/t0"]) is None
    assert "3 conversations written" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    want = [json.loads(line) for line in src.read_text().splitlines()]
    assert [r["messages"] for r in rows] == [w["messages"] for w in want]
    assert [r["id"] for r in rows] == [w["id"] + "/t0" for w in want]


def test_replies_are_the_greedy_replies_to_the_chat_template():
    tok = ChatWords()
    base = init_llama(TINY_LLAMA, seed=3)
    msgs = [[{"role": "user", "content": "what sat on the mat"}], [{"role": "user", "content": "a dog"}]]
    replies = make_generate_fn(LoadedModel(TINY_LLAMA, base, tok, "tiny"))(msgs, 6)
    ids = [tok.apply_chat_template(m) for m in msgs]
    want = generate(base, ids, max_new_tokens=6).token_ids
    assert replies == [tok.decode(t) for t in want]
    assert all(np.size(t) > 0 for t in want)


if __name__ == "__main__":
    pytest.main([__file__])
