"""`python infer.py` (or `clover-infer`): generate with a Llama-family model, plainly or with speculative decoding,
and report speed.

  python infer.py --model smollm2-135m-instruct --prompt "What is the capital of France?"
  python infer.py --model smollm2-135m-instruct --prompts-file mt_bench --limit 8
  python infer.py --mode speculative --prompt "..."     # SmolLM2 with its shipped head, smollm2-135m-instruct-clover2
  python infer.py --mode speculative --stream --prompt "Tell me a story."   # print the reply as it is generated
  python infer.py --model smollm2-135m-instruct --head runs/smollm2-clover2 --mode speculative --prompt "..."
  python infer.py --model path/to/any-llama --mode speculative --tree lookup-4 --prompt "..."   # no head: prompt lookup
  python infer.py --model configs/llama3-8b-instruct-clover2.yaml --mode speculative --tree clover2-26 \
      --compile-only --topology v6e-8 --batch-size 8      # compiled for a TPU slice on this machine: does it fit?
"""

from __future__ import annotations

import argparse
import sys

import jax.numpy as jnp

from clover_jax import pretrained, tpu
from clover_jax.api import prepare_generate, stream_text, warmup
from clover_jax.cli import add_debug_argument, run_cli
from clover_jax.cli.compile_only import add_topology_arguments, check_topology_arguments, compile_only_process, finish
from clover_jax.decoding import acceptance_stats
from clover_jax.decoding.sizes import bucket_length
from clover_jax.decoding.tree import TreeSpecError, get_tree, is_lookup_only
from clover_jax.generation import compiled
from clover_jax.generation.api import run_plan
from clover_jax.heads.draft_vocab import load_draft_vocab
from clover_jax.heads import registry
from clover_jax.io.loader import load_model
from clover_jax.io.shapes import plan_base_config
from clover_jax.io.prompts import encode_prompts, read_prompts
from clover_jax.parallel import parse_mesh, parse_mesh_sizes
from clover_jax.training.config import load_config
from clover_jax.validation import InputError, check_float, check_int


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="HF folder, .gguf file or known name (with "
                   "--compile-only also a training config, whose base and head it takes, or a model whose shapes are "
                   "known: meta-llama/Meta-Llama-3-8B-Instruct, lmsys/vicuna-7b-v1.5)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="mt_bench | spec_bench | sharegpt_heldout (shipped), or a JSONL file of questions ('turns') or {'prompt': ...} lines")
    p.add_argument("--category", help="only questions of this category (with --prompts-file)")
    p.add_argument("--limit", type=int, default=0, help="at most this many prompts from the file")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="the model's dtype (default float32; with --compile-only bfloat16)")
    p.add_argument("--cache-size", type=int, default=None, help="KV cache slots (default: from the prompts)")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--system", default=None, help="system prompt for the chat template")
    p.add_argument("--mode", choices=["ar", "speculative"], default="ar")
    p.add_argument("--head", help="draft head: a registered name (smollm2-135m-instruct-clover2), a training run dir "
                   "(Orbax) or an exported head folder; default: the model's shipped head, if it has one")
    p.add_argument("--tree", default=None, help="clover2-26 | small-10 | medusa-63 | chain-N | dynamic-N | auto "
                   "(calibrated for this head and hardware, see python -m clover_jax.cli.calibrate) | tree.json | "
                   "TREE+lookup-K (a prompt-lookup chain of K tokens beside the head's tree) | lookup-K (prompt lookup "
                   "alone, no head) | TREE+lookup-K-table, lookup-K-table (where lookup finds no match, an n-gram "
                   "table's chain: --ngram-table) | default (the head's registered tree) (no --tree: the head and tree "
                   "fastest on this machine, or plain decoding where none pays, measured on first use and printed)")
    p.add_argument("--ngram-table", help="n-gram table for trees named ...-table (python -m "
                   "clover_jax.cli.ngram); default: the one shipped beside the head, if any")
    p.add_argument("--draft-vocab", help="draft only from these token ids (JSON from python -m "
                   "clover_jax.cli.draft_vocab); output is unchanged, drafting is cheaper")
    p.add_argument("--mesh", default=None, help="decode on several devices: 'data=D,tp=T' (tensor parallel over T "
                   "devices, rows over D; unnamed axes are 1). On CPU, XLA_FLAGS="
                   "--xla_force_host_platform_device_count=8 simulates 8 devices")
    p.add_argument("--layers", default="auto", choices=["auto", "unrolled", "scan"],
                   help="how the decoding loop runs the base model's layers: unrolled (fastest one-token steps, "
                   "a second copy of the layer weights), scan (no copy), auto (by backend, dtype and free memory)")
    p.add_argument("--stream", action="store_true", help="print each reply as it is generated (prompts one at a "
                   "time: --batch-size 1; one device)")
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    p.add_argument("--warmup", action="store_true", help="compile every program the prompts need before the first "
                   "one (in parallel threads; the time is printed); otherwise each new prompt bucket compiles on "
                   "first use")
    p.add_argument("--head-type", default=None, help=f"with --compile-only: the head type to compile a fresh head of "
                   f"({', '.join(registry.names())}; default: the --model config's head, else clover2)")
    p.add_argument("--prompt-length", type=int, default=512,
                   help="with --compile-only: the prompt tokens per row (its bucket is compiled)")
    add_topology_arguments(p, what="the decoding loop of --mode, --tree, --batch-size, --prompt-length and "
                           "--max-new-tokens")
    add_debug_argument(p)
    return p.parse_args(argv)


def check_args(args) -> None:
    """The numeric arguments' ranges, before anything is loaded (errors name the flag, value and limit)."""
    check_int("--batch-size", args.batch_size, minimum=1)
    check_int("--limit", args.limit, minimum=0)
    check_int("--max-new-tokens", args.max_new_tokens, minimum=1)
    check_float("--temperature", args.temperature, minimum=0.0)
    check_int("--top-k", args.top_k, minimum=0)
    check_float("--top-p", args.top_p, above=0.0, maximum=1.0)
    check_int("--cache-size", args.cache_size, minimum=1, allow_none=True)
    for i, text in enumerate(args.prompt):
        if not text.strip():
            raise InputError(f"--prompt: prompt {i} is empty")
    if args.stream and args.batch_size != 1:
        raise InputError(f"--stream: prints one reply at a time; use --batch-size 1 (got {args.batch_size})")
    if args.stream and args.quiet:
        raise InputError("--stream: prints the replies, --quiet does not: give one of them")
    if args.limit and not args.prompts_file:
        raise InputError(f"--limit: {args.limit} applies to --prompts-file, which is not given")
    # the head, before the model is loaded (the plan resolves it again, as for `generate`)
    if args.mode == "speculative" and not args.head and not _lookup_only(args.tree) \
            and pretrained.default_head(args.model) is None:
        raise InputError(f"--mode speculative needs --head (no head is shipped for {args.model!r}; shipped: "
                         f"{', '.join(pretrained.HEADS)}), or a prompt-lookup tree that needs none (--tree lookup-4)")
    if args.mode == "speculative" and args.head and not pretrained.head_path(args.head).exists():
        raise InputError(f"--head: draft head {args.head!r} not found: neither a folder nor a registered head "
                         f"({', '.join(pretrained.HEADS)})")


def _lookup_only(tree: str | None) -> bool:
    """Whether --tree names a prompt-lookup chain alone (it drafts without a head)."""
    try:
        return tree is not None and is_lookup_only(get_tree(tree))
    except TreeSpecError:
        return False


def _print_stream(pieces):
    """Prints a `stream_text` generator's pieces as they come; returns its `GenerationResult`."""
    while True:
        try:
            piece = next(pieces)
        except StopIteration as stop:
            print(flush=True)
            return stop.value
        print(piece, end="", flush=True)


def main(argv=None) -> int:
    return run_cli(_main, argv)


def _main(argv=None) -> int:
    args = parse_args(argv)
    sl = check_topology_arguments(args)
    if sl is not None:
        return compile_decoding(args, sl)
    args.dtype = args.dtype or "float32"
    check_args(args)
    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += read_prompts(args.prompts_file, category=args.category, limit=args.limit or None)
    if not prompts:
        print("error: give --prompt or --prompts-file", file=sys.stderr)
        return 2
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    mesh = None
    if args.mesh:
        mesh = parse_mesh(args.mesh)
        print(f"decoding on a mesh {dict(mesh.shape)} of {mesh.devices.size} {mesh.devices.flat[0].platform} "
              "devices", file=sys.stderr)
    loaded = load_model(args.model, dtype=dtype, mesh=mesh)  # weights read straight onto the mesh
    draft_vocab = load_draft_vocab(args.draft_vocab) if args.draft_vocab else None
    # the head, tree, draft vocabulary and n-gram table are resolved by the plan (`prepare_generate`), as for
    # `clover_jax.generate`: a head named by a registered name or folder, the model's shipped head when none is
    # given, the tree fastest here when none is named
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              chat=not args.no_chat, system=args.system, cache_size=args.cache_size, mode=args.mode, head=args.head,
              tree=args.tree, draft_vocab=draft_vocab, mesh=mesh, layers=args.layers, ngram_table=args.ngram_table)
    total_tokens = total_seconds = 0.0
    hist = None  # speculative: steps that accepted n drafts, summed over batches
    compile_seconds = 0.0
    seen_shapes = set()
    encoded = encode_prompts(loaded.tokenizer, prompts, chat=not args.no_chat, system=args.system)
    if args.warmup:  # every (batch, bucket, cache) program of these prompts, compiled before the first is timed
        warm_kw = {k: v for k, v in kw.items() if k not in ("chat", "system")}
        report = warmup(loaded, prompt_lengths=[len(b) for b in encoded], batch_size=args.batch_size, **warm_kw)
        print(f"warm-up: {len(report['programs'])} programs compiled in {report['seconds']:.1f} s "
              f"({report['resolve_seconds']:.1f} s resolving the request)", file=sys.stderr)
        compile_seconds += report["seconds"]
        seen_shapes = {(p["batch"], p["bucket"]) for p in report["programs"]}
    for start in range(0, len(prompts), args.batch_size):
        texts = prompts[start:start + args.batch_size]
        batch = encoded[start:start + args.batch_size]
        shape_key = (len(batch), bucket_length(max(len(b) for b in batch)))
        plan = prepare_generate(loaded, batch, **{**kw, "chat": False}, seed=args.seed + start)
        if start == 0:
            if plan.mode == "speculative":  # what the plan resolved: the head loaded once, "auto" calibrated once
                kw.update(head=plan.draft.bundle, tree=plan.tree, draft_vocab=plan.draft_vocab, ngram_table=plan.ngram_table)
            kw["mode"] = plan.mode
            shown = plan.choice.get("note") if plan.choice and plan.choice.get("announced") else None
            for note in plan.notes:  # what the request did not name (the choice of a tree printed once)
                if note != shown:
                    print(note, file=sys.stderr)
        quiet_sink = {"stream": (lambda row, ids: None)} if args.stream else {}
        if shape_key not in seen_shapes:  # compile outside the timed call (max_new_tokens is traced)
            warm = run_plan(prepare_generate(loaded, batch, **{**kw, "max_new_tokens": 1, "chat": False},
                                             seed=args.seed, check_free_memory=False, **quiet_sink))
            compile_seconds += warm.seconds
            seen_shapes.add(shape_key)
        if args.stream:
            print(f"\n### prompt {start}: {texts[0][:100]!r}")
            res = _print_stream(stream_text(loaded, batch[0], **{**kw, "chat": False}, seed=args.seed + start))
        else:
            res = run_plan(plan)
        total_tokens += res.num_generated
        total_seconds += res.seconds
        if res.stats.get("accept_hist") is not None:
            h = res.stats["accept_hist"]
            hist = h if hist is None else [a + b for a, b in zip(hist, h)]
        if not args.quiet and not args.stream:
            for i, text in enumerate(res.texts):
                print(f"\n### prompt {start + i}: {texts[i][:100]!r}\n{text}")
        if res.stats.get("tau") is not None and not args.quiet:
            print(f"[tau {res.stats['tau']:.2f} tokens/step]")
    print(f"\n{kw['mode']}: {int(total_tokens)} tokens in {total_seconds:.2f} s = "
          f"{total_tokens / max(total_seconds, 1e-9):.1f} tokens/s (batch {args.batch_size}, "
          f"{args.dtype}); compile+warm-up {compile_seconds:.1f} s")
    if hist and sum(hist):
        print(f"tau = {acceptance_stats.tau(hist):.2f} tokens per base forward in the decode phase "
              "(bonus token included)")
    return 0


def compile_decoding(args, sl: tpu.Slice) -> int:
    """`--compile-only`: the decoding loop of the request's shape compiled for the slice `sl` (abstract weights)."""
    check_int("--batch-size", args.batch_size, minimum=1)
    check_int("--max-new-tokens", args.max_new_tokens, minimum=1)
    check_int("--prompt-length", args.prompt_length, minimum=1)
    for flag, given in (("--prompt", args.prompt), ("--prompts-file", args.prompts_file), ("--head", args.head),
                        ("--stream", args.stream), ("--warmup", args.warmup)):
        if given:
            raise InputError(f"{flag}: --compile-only compiles the loop of --batch-size rows of --prompt-length tokens "
                             "and reads no prompt, head folder or weights; give the head as --head-type (or a "
                             "training config as --model)")
    compile_only_process()
    head_type, options = args.head_type, None
    if str(args.model).endswith((".yaml", ".yml")):
        cfg = load_config(args.model)
        base_config = plan_base_config(cfg.model.name_or_path)
        if head_type in (None, cfg.head.type):
            head_type, options = cfg.head.type, cfg.head
    else:
        base_config = plan_base_config(args.model)
    if args.mode == "speculative" and args.tree is None:
        raise InputError("--compile-only --mode speculative: name the tree (--tree clover2-26, chain-4, dynamic-26, "
                         "beam-4x5, lookup-4, ...)")
    mesh = tpu.slice_mesh(sl, **_decode_mesh(args.mesh, sl))
    dtype = args.dtype or "bfloat16"
    print(f"{args.model}: {args.mode} decoding, {dtype}, batch {args.batch_size}, prompts of {args.prompt_length} "
          f"tokens, {args.max_new_tokens} new tokens" + (f", tree {args.tree}" if args.mode == "speculative" else ""),
          flush=True)
    draft_vocab = load_draft_vocab(args.draft_vocab) if args.draft_vocab else None
    programs = compiled.compile_decoding(
        base_config, mesh, mode=args.mode, head_type=head_type or "clover2", head_options=options, tree=args.tree,
        batch=args.batch_size, prompt_length=args.prompt_length, max_new_tokens=args.max_new_tokens, dtype=dtype,
        greedy=args.temperature == 0, draft_vocab=draft_vocab)
    return finish(sl, programs, mesh, compiled.SETTINGS)


def _decode_mesh(text: str | None, sl: tpu.Slice) -> dict[str, int]:
    """The decoding mesh's sizes: `--mesh` as given, else the weights split over a slice's chips (tensor parallel)
    and rows over the slices."""
    if text:
        return parse_mesh_sizes(text)
    return {"data": sl.num_slices, "fsdp": 1, "tp": sl.chips}


if __name__ == "__main__":
    sys.exit(main())
