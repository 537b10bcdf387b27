"""`python -m clover_jax.cli.draft_vocab`: a draft vocabulary (`clover_jax.heads.draft_vocab`) from the assistant
replies of a chat file.

    python -m clover_jax.cli.draft_vocab --data replies.jsonl --model smollm2-135m-instruct --size 8192 --out dv.json
"""

from __future__ import annotations

import argparse
import json

from clover_jax.heads.draft_vocab import coverage, frequent_tokens, save_draft_vocab
from clover_jax.io.loader import load_tokenizer


def reply_tokens(chat_path, tokenizer) -> list[list[int]]:
    """Token ids of the assistant turns of a chat JSONL file (`{"messages": [...]}` per line)."""
    out = []
    with open(chat_path) as fh:
        for line in fh:
            if line.strip():
                for m in json.loads(line)["messages"]:
                    if m["role"] == "assistant":
                        out.append(tokenizer.encode(m["content"], add_special_tokens=False))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Build a draft vocabulary from the assistant replies of a chat file.")
    ap.add_argument("--data", required=True, help="chat JSONL file ({'messages': [...]} per line)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="whose tokenizer (name or path)")
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    tok = load_tokenizer(args.model)
    seqs = reply_tokens(args.data, tok)
    eos = [t for t in (tok.eos_token_id,) if t is not None]
    ids = frequent_tokens(seqs, args.size, always=eos)
    save_draft_vocab(args.out, ids, source=str(args.data), model=args.model, replies=len(seqs))
    print(f"{len(ids)} ids from {len(seqs)} replies; coverage of those replies {coverage(ids, seqs):.4f}; "
          f"written to {args.out}")


if __name__ == "__main__":
    main()
