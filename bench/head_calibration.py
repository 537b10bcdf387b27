"""How well a draft head's probabilities predict acceptance, per depth: a reliability table.

  python bench/head_calibration.py --questions spec_bench --limit 48
  python bench/head_calibration.py --head runs/smollm2-135m-clover2 --questions mt_bench --limit 40

A dynamic tree (`dynamic-N`, EAGLE-2's policy) ranks candidate nodes by the product of the head's probabilities
along their path, which is the expected number of accepted tokens only where the head is calibrated: where a draft
the head gives probability p is the base model's greedy token with frequency p, at every depth. This measures it
without running the loop: greedy replies from our autoregressive loop, then one teacher-forced pass of the base and
the head over prompt + reply (`simulate_lookup.top_drafts`), so each depth's drafts are made after the true tokens
before them, as on a tree path whose parents were all accepted. For every reply position and depth the head's
top-k drafts with their probabilities are scored against the reply's token.

Prints per depth: top-1/2/3 accuracy against the mean probability the head gave them, and accuracy per probability
bin (all top-k drafts pooled), with the expected calibration error (ECE, bin-weighted |mean p - accuracy|);
`--out PATH` writes the results JSON.
"""

from __future__ import annotations

import argparse

import numpy as np

import toolkit

BINS = (0.0, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0)


def reliability(p: np.ndarray, hit: np.ndarray, bins=BINS) -> tuple[list[tuple[float, float, int]], float]:
    """Per probability bin `(mean p, accuracy, count)` of drafts with probabilities `p` and outcomes `hit` (same
    shape), and the expected calibration error over the bins (empty bins skipped; the last bin includes 1.0)."""
    p, hit = np.asarray(p, np.float64).ravel(), np.asarray(hit, bool).ravel()
    if p.shape != hit.shape:
        raise ValueError(f"p {p.shape} and hit {hit.shape} differ")
    which = np.clip(np.searchsorted(bins, p, side="right") - 1, 0, len(bins) - 2)
    rows, ece = [], 0.0
    for i in range(len(bins) - 1):
        m = which == i
        if m.any():
            rows.append((float(p[m].mean()), float(hit[m].mean()), int(m.sum())))
            ece += m.sum() / max(p.size, 1) * abs(rows[-1][0] - rows[-1][1])
    return rows, float(ece)


def main(argv=None) -> int:
    import clover_jax
    from clover_jax.training.loading import open_head_or_run
    from simulate_lookup import add_reply_args, greedy_replies, padded, top_drafts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_reply_args(ap, questions="spec_bench", limit=48)
    ap.add_argument("--top-k", type=int, default=8)
    args = ap.parse_args(argv)

    loaded = clover_jax.load_model(args.model)
    bundle = open_head_or_run(args.head, loaded.model)
    head, draft_vocab = bundle.module, bundle.draft_vocab
    if not hasattr(head, "train_outputs"):
        raise SystemExit(f"{args.head}: this head type has no teacher-forced outputs to measure")
    prompts, _ = toolkit.load_questions(args.questions, args.limit, None)
    top = top_drafts(loaded.model, head, draft_vocab, args.top_k, with_logp=True)
    p_by, hit_by = {}, {}
    for prompt, reply in greedy_replies(loaded, prompts, args.max_new_tokens):
        seq = prompt + reply
        t = len(seq)
        cand, logp = (np.asarray(x) for x in top(*padded(seq)))  # [H, P, k]
        truth = np.asarray(seq + [-1] * (cand.shape[1] + cand.shape[0] + 2 - t))
        for h in range(cand.shape[0]):  # head h at position pos drafts token pos + 2 + h
            pos = np.arange(len(prompt) - 1, t - 2 - h)
            if pos.size == 0:
                continue
            p_by.setdefault(h, []).append(np.exp(logp[h, pos]))
            hit_by.setdefault(h, []).append(cand[h, pos] == truth[pos + 2 + h][:, None])
    print(f"{args.head} on {len(prompts)} {args.questions} prompts, greedy replies of {args.max_new_tokens} tokens, "
          f"top-{args.top_k} drafts teacher-forced\n")
    print("| depth | positions | top-1 acc / mean p | top-2 | top-3 | ECE "
          "| accuracy per probability bin (mean p: acc) |")
    print("|---|---|---|---|---|---|---|")
    out = []
    for h in sorted(p_by):
        p, hit = np.concatenate(p_by[h]), np.concatenate(hit_by[h])  # [N, k]
        rows, ece = reliability(p, hit)
        ranks = " | ".join(f"{hit[:, r].mean():.3f} / {p[:, r].mean():.3f}" for r in range(min(3, p.shape[1])))
        bins = ", ".join(f"{mp:.2f}: {acc:.2f}" for mp, acc, _ in rows)
        print(f"| {h + 1} | {p.shape[0]} | {ranks} | {ece:.3f} | {bins} |")
        out.append({"depth": h + 1, "positions": int(p.shape[0]), **{
            f"top{r + 1}_accuracy": round(float(hit[:, r].mean()), 4) for r in range(min(3, p.shape[1]))}, **{
            f"top{r + 1}_mean_p": round(float(p[:, r].mean()), 4) for r in range(min(3, p.shape[1]))},
            "ece": round(ece, 4), "bins": [[round(mp, 4), round(acc, 4), n] for mp, acc, n in rows]})
    toolkit.write_results(args.out, toolkit.results(
        __file__, argv, benchmark="head_calibration", title="How well a draft head's probabilities predict "
        "acceptance, per depth", settings=f"{args.head} on {len(prompts)} {args.questions} prompts, greedy replies of "
        f"{args.max_new_tokens} tokens, top-{args.top_k} drafts teacher-forced", rows=out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
