"""`python -m clover_jax.cli.ngram`: builds the n-gram draft table (`clover_jax.decoding.ngram`) of a base model's
replies, read from chat files (ideally its own replies: self-distillation data).

    python -m clover_jax.cli.ngram --model smollm2-135m-instruct --data data/self_distill/*.jsonl.gz --out HEAD_DIR
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Iterable, Sequence

from clover_jax.decoding.ngram import (
    MAX_ORDER,
    MIN_COUNT,
    build_ngram_table,
    save_ngram_table,
)
from clover_jax.io.loader import load_model
from clover_jax.training.sources import read_chat_file


def _reply_tokens(tokenizer, path, header: Sequence[int]) -> Iterable[list[int]]:
    """Each assistant turn of a chat file, tokenised, after the chat template's last tokens before a reply."""
    for conv in read_chat_file(path):
        for msg in conv.messages:
            if msg["role"] == "assistant" and msg["content"]:
                yield list(header) + tokenizer.encode(msg["content"], add_special_tokens=False)


def reply_header(tokenizer, size: int = MAX_ORDER) -> list[int]:
    """The chat template's last `size` tokens before an assistant reply ("<|im_start|>assistant\\n", say): the
    context a reply's first tokens are drafted after."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                        tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # a BatchEncoding in recent transformers
    return [int(i) for i in ids[-size:]]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Build the n-gram draft table of a base model's replies.")
    ap.add_argument("--model", required=True, help="the base model whose tokenizer reads the replies")
    ap.add_argument("--data", nargs="+", required=True, help="chat files (.jsonl, .jsonl.gz, .json): their "
                    "assistant turns, ideally the base model's own replies (self-distillation data)")
    ap.add_argument("--out", required=True, help="a folder (a head's, say) or a .npz path")
    ap.add_argument("--max-order", type=int, default=MAX_ORDER)
    ap.add_argument("--min-count", type=int, default=MIN_COUNT)
    args = ap.parse_args(argv)
    t0 = time.time()
    loaded = load_model(args.model)
    tok = loaded.tokenizer
    header = reply_header(tok, args.max_order)
    seqs = [s for path in args.data for s in _reply_tokens(tok, path, header)]
    vocab = int(loaded.config.vocab_size)
    table = build_ngram_table(seqs, vocab, args.max_order, args.min_count,
                              source=", ".join(Path(p).name for p in args.data))
    out = save_ngram_table(table, args.out)
    print(f"{len(seqs)} replies, {sum(map(len, seqs)) - len(seqs) * len(header)} tokens -> {table.size} entries "
          f"(orders 1-{args.max_order}, contexts seen >= {args.min_count} times) in {time.time() - t0:.0f} s: {out} "
          f"({out.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
