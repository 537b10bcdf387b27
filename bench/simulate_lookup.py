"""tau of static trees, with and without a prompt-lookup chain, predicted from the head's teacher-forced drafts.

  python bench/simulate_lookup.py --questions mt_bench --limit 80
  python bench/simulate_lookup.py --questions spec_bench --limit 104 --trees chain-3 small-10 --lookup 0 4 6 8

No speculative loop runs. For each prompt: greedy decoding (our autoregressive loop), then one teacher-forced pass
of the base and the head over prompt + reply, which gives, at every decoding position and depth, the rank of the
reply's token among the head's top-k drafts along the reply itself (what a static tree drafts along its accepted
path). A step then accepts the longest tree path whose ranks match, or the longest prefix of the lookup chain
(`clover_jax.decoding.lookup.lookup_chain`'s rule: latest earlier occurrence of the longest suffix up to
`--max-ngram` tokens), whichever is longer, and the next step starts after it. tau = generated tokens / steps.
The loop's own tau for the same tree agrees closely (checked with the shipped head's fitted tree on MT-Bench),
so this explores tree and chain shapes in minutes; speed still has to be measured (`bench_spec.py`).
`--table` also runs each chain as `...-table` (`clover_jax.decoding.ngram`): where lookup finds no match, the head's
n-gram table (or `--ngram-table`'s; several tables compare in one run) drafts the chain (`NgramTable.chain`, the
host twin of the drafter's `ngram_chain`). `--anchor-depth D` asks a question no drafter implements: the chain hung
under the head's top-1 path of depth D (drafted after the head's D tokens) instead of under the root.

`--split N [N ...]` asks how N drafted tokens are best shared between the head's tree and the chain (`--table` for
the table's chains): for every chain length K <= 6 it fits the head's subtree of N - K nodes beside the chain
(`fit_beside_chain`: best-first, each node the one that most raises the mean accepted length over every decoding
position of the replies, where a position accepts the longer of its head path and its chain) and predicts that
merged tree's tau as above. `--out PATH` writes the results JSON.
"""

from __future__ import annotations

import argparse
import collections
import json

import numpy as np

import toolkit


def top_drafts(base, head, draft_vocab, top_k: int, with_logp: bool = False):
    """A jitted `(tokens [1, T], valid [1, T]) -> [H, T, top_k]`: each head's top-k draft token ids at every
    position, teacher-forced along the sequence (compiled once per padded length); with `with_logp`, also their
    log-probabilities under the head (over the draft vocabulary when there is one), as a pair."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from clover_jax.heads.losses import base_features

    ids = jnp.asarray(draft_vocab, jnp.int32) if draft_vocab is not None else None
    (bg, bs), (hg, hs) = nnx.split(base), nnx.split(head)

    @jax.jit
    def top(bs, hs, tokens, valid):  # the weights are arguments, not constants baked into the program
        base_, head_ = nnx.merge(bg, bs), nnx.merge(hg, hs)
        f = base_features(base_, tokens, valid)
        o = head_.train_outputs(base_, f, tokens, valid)[:, 0]  # [H, T, D]
        rows = base_.lm_head_rows(ids) if ids is not None else base_.embed[...]  # [N, D]
        logits = jnp.einsum("htd,nd->htn", o, rows, preferred_element_type=jnp.float32)  # [H, T, N]
        logp, idx = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), top_k)
        tok = ids[idx] if ids is not None else idx  # [H, T, k] token ids
        return (tok, logp) if with_logp else tok

    return lambda tokens, valid: top(bs, hs, tokens, valid)


def padded(seq: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """`(tokens [1, P], valid [1, P])` for one sequence, right-padded to the next power of two (one compile of
    `top_drafts` per padded length)."""
    t = len(seq)
    pad = 1 << (t - 1).bit_length()
    tokens = np.zeros((1, pad), np.int32)
    tokens[0, :t] = seq
    valid = np.zeros((1, pad), bool)
    valid[0, :t] = True
    return tokens, valid


def draft_ranks(top, seq: list[int], prompt_len: int, top_k: int) -> list[list[int]]:
    """`ranks[i][h]`: rank of seq's token among head h's top-k drafts (`top`, from `top_drafts`) at decoding step
    position `prompt_len - 1 + i` (the state after committing up to there, the root being the next token); top_k
    when not among them."""
    t = len(seq)
    cand = np.asarray(top(*padded(seq)))
    out = []
    for pos in range(prompt_len - 1, t - 1):
        row = []
        for h in range(cand.shape[0]):
            j = pos + 2 + h  # head h at position pos drafts token pos + 2 + h
            hit = np.nonzero(cand[h, pos] == seq[j])[0] if j < t else []
            row.append(int(hit[0]) if len(hit) else top_k)
        out.append(row)
    return out


def lookup(ctx: list[int], max_ngram: int, k: int, table=None) -> list[int]:
    """The chain `lookup_chain` proposes: the k tokens after the latest earlier occurrence of the longest suffix
    of ctx (ctx[-1] is the root), cut at the root and padded with it; without a match, the n-gram `table`'s chain
    if one is given, else the root k times."""
    for n in range(max_ngram, 0, -1):
        if len(ctx) <= n:
            continue
        suffix = ctx[-n:]
        for j in range(len(ctx) - 1, n - 1, -1):
            if ctx[j - n:j] == suffix:
                chain = ctx[j:j + k]
                return chain + [ctx[-1]] * (k - len(chain))
    return table.chain(ctx, k)[0] if table is not None else [ctx[-1]] * k


def matched(chain: list[int], rest: list[int]) -> int:
    """How many of `chain`'s tokens match `rest` before the first difference (a chain's accepted drafts)."""
    n = 0
    for a, b in zip(chain, rest):
        if a != b:
            break
        n += 1
    return n


def simulate(seq: list[int], prompt_len: int, ranks, tree: set | None, k: int, max_ngram: int,
             table=None, anchor: int = 0) -> tuple[int, int]:
    """(tokens, steps) of speculative decoding along `seq`'s reply with tree `tree` (a set of rank paths) and a
    lookup chain of k tokens (falling back to the n-gram `table`, if given), under the root, or with `anchor` > 0
    under the head's top-1 path of that depth (then counted only where that path was accepted)."""
    c, steps, toks, t = prompt_len + 1, 0, 0, len(seq)  # the root (the first reply token) is committed
    while c < t:
        ah = 0
        if tree:
            r = ranks[c - prompt_len - 1]
            while ah < len(r) and tuple(r[:ah + 1]) in tree:
                ah += 1
        ap = 0
        on_path = anchor == 0 or (tree and list(ranks[c - prompt_len - 1][:anchor]) == [0] * anchor)
        if k and on_path and c + anchor < t:
            # the head's top-1 path below the chain (seq[0] is not in the drafter's history)
            ap = anchor + matched(lookup(seq[1:c + anchor], max_ngram, k, table), seq[c + anchor:])
        n = min(max(ah, ap) + 1, t - c)
        c, steps, toks = c + n, steps + 1, toks + n
    return toks, steps


def chain_accepts(seq: list[int], prompt_len: int, k: int, max_ngram: int, table=None) -> np.ndarray:
    """`[positions]`: how many of the k-token lookup chain's tokens (`lookup`) match the reply at every decoding
    position (indexed as `draft_ranks`' rows)."""
    return np.asarray([matched(lookup(seq[1:c], max_ngram, k, table), seq[c:])
                       for c in range(prompt_len + 1, len(seq) + 1)], np.int32)


def fit_beside_chain(ranks: np.ndarray, chain: np.ndarray, nodes: int, top_k: int) -> set:
    """The head's static subtree of `nodes` rank paths (depths up to `ranks.shape[1]`, ranks below `top_k`) that
    most raises the mean over positions of max(head path accepted, `chain` accepted), added best-first.

    `ranks`: `[positions, depths]` each depth's rank of the reply's token (`draft_ranks`); `chain`: `[positions]`
    the chain's accepted tokens there (`chain_accepts`, capped at its length)."""
    tree: set = set()
    best = chain.astype(np.float64)  # [positions] accepted drafts with the tree so far
    for _ in range(nodes):
        frontier = [p + (r,) for p in [()] + sorted(tree) if len(p) < ranks.shape[1] for r in range(top_k)
                    if p + (r,) not in tree]
        if not frontier:
            break
        # [positions] drafts accepted with each frontier node added (the reply follows its path: its length)
        with_node = [np.maximum(best, np.where(np.all(ranks[:, :len(c)] == np.asarray(c), axis=1), len(c), 0))
                     for c in frontier]
        i = int(np.argmax([w.sum() for w in with_node]))
        tree.add(frontier[i])
        best = with_node[i]
    return tree


def greedy_replies(loaded, prompts, max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """`(prompt ids, greedy reply ids)` per prompt (chat template applied), from our autoregressive loop."""
    import clover_jax
    from clover_jax.io.prompts import encode_prompts

    ids = encode_prompts(loaded.tokenizer, prompts)
    seqs = []
    for i in range(0, len(prompts), 8):
        res = clover_jax.generate(loaded, prompts[i:i + 8], max_new_tokens=max_new_tokens, decode_text=False)
        seqs += [(list(p), list(g)) for p, g in zip(ids[i:i + 8], res.token_ids)]
    return seqs


def add_reply_args(ap: argparse.ArgumentParser, *, questions: str, limit: int) -> None:
    """The options of the scripts that score a head on greedy replies: model, head, question set, reply length."""
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--head", default="smollm2-135m-instruct-clover2")
    ap.add_argument("--questions", default=questions)
    ap.add_argument("--limit", type=int, default=limit)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    toolkit.add_out_argument(ap)


def main(argv=None) -> int:
    import clover_jax
    from clover_jax.decoding.tree import TreeSpec, get_tree
    from clover_jax.training.loading import open_head_or_run

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_reply_args(ap, questions="mt_bench", limit=80)
    ap.add_argument("--trees", nargs="+", default=["chain-3", "small-10"], help="static trees (names or JSON)")
    ap.add_argument("--lookup", nargs="+", type=int, default=[0, 4, 6], help="lookup chain lengths (0: none)")
    ap.add_argument("--max-ngram", type=int, default=3)
    ap.add_argument("--table", action="store_true", help="also run each chain with the head's n-gram table "
                    "(`TREE+lookup-K-table`)")
    ap.add_argument("--ngram-table", nargs="+", help="with --table: these tables (.npz files or folders) instead "
                    "of the head's; with several, each run's name ends in `-table[N]`, N its position here")
    ap.add_argument("--split", nargs="+", type=int, default=[], help="drafted tokens N: fit the head's subtree of "
                    "N - K nodes beside each chain of K <= 6 tokens and predict each merged tree's tau")
    ap.add_argument("--anchor-depth", type=int, default=0, help="hang the chain beside a tree under the head's "
                    "top-1 path of this depth instead of under the root (simulated only; no drafter does this)")
    args = ap.parse_args(argv)

    loaded = clover_jax.load_model(args.model)
    bundle = open_head_or_run(args.head, loaded.model)
    head, draft_vocab = bundle.module, bundle.draft_vocab
    trees = {}
    for name in args.trees:
        spec = get_tree(name)
        if not isinstance(spec, TreeSpec):
            raise SystemExit(f"{name}: only static trees can be simulated")
        trees[spec.name] = set(spec.choices)
        if args.anchor_depth and (0,) * args.anchor_depth not in trees[spec.name]:
            raise SystemExit(f"--anchor-depth {args.anchor_depth}: tree {name} has no top-1 path that deep")
    top_k = max([max(max(c) for c in t) + 1 for t in trees.values()] + [SPLIT_TOP_K if args.split else 1])
    prompts, cats = toolkit.load_questions(args.questions, args.limit, None)
    seqs = greedy_replies(loaded, prompts, args.max_new_tokens)
    from clover_jax.decoding.ngram import load_ngram_table

    if args.anchor_depth < 0:
        raise SystemExit(f"--anchor-depth must be >= 0, got {args.anchor_depth}")
    tables = ([load_ngram_table(t) for t in args.ngram_table] if args.ngram_table else [bundle.ngram_table]) \
        if args.table else []
    if args.table and tables[0] is None:
        raise SystemExit(f"--table: the head {args.head} ships no n-gram table (python -m clover_jax.cli.ngram)")
    table = tables[0] if tables else None  # the one --split uses
    ends = [("", None)] + [(f"-table[{i}]" if len(tables) > 1 else "-table", t) for i, t in enumerate(tables)]
    at = f"@d{args.anchor_depth}" if args.anchor_depth else ""
    runs = [(f"lookup-{k}{e}", None, k, t) for k in args.lookup if k for e, t in ends] + [
        (name + (f"+lookup-{k}{e}{at}" if k else ""), tree, k, t) for name, tree in trees.items() for k in args.lookup
        for e, t in (ends if k else ends[:1])]
    totals = collections.defaultdict(lambda: np.zeros(2))  # (run, category) -> tokens, steps
    top = top_drafts(loaded.model, head, draft_vocab, top_k) if trees or args.split else None
    all_ranks = []  # per prompt: [positions][depths] ranks
    for (p, g), cat in zip(seqs, cats):
        seq = p + g
        ranks = draft_ranks(top, seq, len(p), top_k) if top is not None else None
        all_ranks.append(ranks)
        for name, tree, k, tab in runs:
            toks, steps = simulate(seq, len(p), ranks, tree, k, args.max_ngram, tab, args.anchor_depth if tree else 0)
            totals[name, cat] += (toks, steps)
            totals[name, "all"] += (toks, steps)
    categories = ["all"] + sorted(set(cats))
    print(f"{len(seqs)} prompts ({args.questions}), greedy, {args.max_new_tokens} new tokens; predicted tau")
    print("\n| run | " + " | ".join(categories) + " |")
    print("|---" * (len(categories) + 1) + "|")
    rows = []
    for name, *_ in runs:
        taus = {c: totals[name, c][0] / max(totals[name, c][1], 1) for c in categories}
        rows.append({"run": name, **{c: round(tau, 4) for c, tau in taus.items()}})
        print(f"| {name} | " + " | ".join(f"{tau:.3f}" for tau in taus.values()) + " |")
    split = split_table(args, seqs, all_ranks, table, top_k) if args.split else []
    toolkit.write_results(args.out, toolkit.results(
        __file__, argv, benchmark="simulate_lookup", title="tau of static trees and lookup chains, predicted from "
        "teacher-forced drafts", settings=f"{args.head} on {len(seqs)} {args.questions} prompts, greedy replies of "
        f"{args.max_new_tokens} tokens", rows=rows, split=split))
    return 0


SPLIT_TOP_K = 8  # ranks a fitted subtree may use
SPLIT_MAX_CHAIN = 6


def split_table(args, seqs, all_ranks, table, top_k: int) -> list[dict]:
    """Prints (and returns as rows), for each drafted-token budget in `args.split` and chain length K, the head's
    subtree fitted beside the chain (`fit_beside_chain`) and the merged tree's predicted tau (`simulate`)."""
    kept = [i for i, r in enumerate(all_ranks) if r]  # replies with a decoding position
    ranks = np.concatenate([np.asarray(all_ranks[i], np.int32) for i in kept])  # [positions, depths]
    accepted = np.concatenate([chain_accepts(seqs[i][0] + seqs[i][1], len(seqs[i][0]), SPLIT_MAX_CHAIN,
                                             args.max_ngram, table) for i in kept])  # [positions]
    end = "-table" if table is not None else ""
    print(f"\nhead subtree fitted beside a chain (ranks < {top_k}; chains{' with the table' if end else ''})")
    print("\n| drafted tokens | chain K | head subtree | predicted tau |\n|---|---|---|---|")
    rows = []
    for total in args.split:
        for k in range(0, min(SPLIT_MAX_CHAIN, total) + 1):
            tree = fit_beside_chain(ranks, np.minimum(accepted, k), total - k, top_k)
            toks = steps = 0
            for (p, g), r in zip(seqs, all_ranks):
                t, s = simulate(p + g, len(p), r, tree, k, args.max_ngram, table)
                toks, steps = toks + t, steps + s
            shape = json.dumps([list(c) for c in sorted(tree, key=lambda c: (len(c), c))])
            print(f"| {total} | {k}{end if k else ''} | `{shape}` | {toks / max(steps, 1):.3f} |", flush=True)
            rows.append({"drafted_tokens": total, "chain": f"{k}{end if k else ''}", "head_subtree": shape,
                         "predicted_tau": round(toks / max(steps, 1), 4)})
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
