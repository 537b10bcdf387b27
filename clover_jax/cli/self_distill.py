"""`python -m clover_jax.cli.self_distill`: generates (and caches) the base model's own replies to the first user
turn of the configured conversations, the training data of self-distillation (`clover_jax.training.self_distill`);
or moves cached replies and prompts to and from chat files.

  python -m clover_jax.cli.self_distill --config configs/smollm2-135m-clover2.yaml
  python -m clover_jax.cli.self_distill --config configs/llama3-8b-instruct-clover2.yaml --set mesh.tp=8
"""

from __future__ import annotations

import argparse
from pathlib import Path

from clover_jax import parallel
from clover_jax.generation.replies import make_generate_fn
from clover_jax.io.loader import load_tokenizer
from clover_jax.training.config import add_config_arguments, config_from_args
from clover_jax.training.run import load_base
from clover_jax.training.self_distill import (
    export_chat_file,
    export_prompts_file,
    import_chat_file,
    self_distilled_conversations,
)
from clover_jax.training.sources import load_conversations


def main(argv=None):

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(ap)
    ap.add_argument("--export-chat", metavar="PATH", help="only write the cached replies as a chat JSONL file")
    ap.add_argument("--import-chat", metavar="PATH",
                    help="first add the replies of a chat JSONL file (e.g. data/self_distill/*.jsonl.gz) to the "
                         "cache, then generate the rest")
    ap.add_argument("--export-prompts", metavar="PATH",
                    help="only write the configured conversations' short first-turn prompts as a chat JSONL file "
                         "(less the library's evaluation questions)")
    ap.add_argument("--skip-answered", metavar="FILE", nargs="+", default=(),
                    help="with --export-prompts: leave out the prompts these chat JSONL files already answer")
    ap.add_argument("--id-suffix", default="",
                    help="with --export-chat: appended to every conversation id (e.g. /t0.7 for sampled replies "
                         "trained beside greedy ones)")
    args = ap.parse_args(argv)
    cfg = config_from_args(args)
    if args.export_chat:
        n = export_chat_file(Path(cfg.self_distill_dir) / "replies.jsonl", args.export_chat, args.id_suffix)
        print(f"{n} conversations written to {args.export_chat}")
        return
    if args.export_prompts:

        n = export_prompts_file(load_conversations(cfg.data), load_tokenizer(cfg.model.name_or_path),
                                cfg.data.self_distill_max_prompt_tokens, args.export_prompts, args.skip_answered)
        print(f"{n} prompts written to {args.export_prompts}")
        return
    if args.import_chat:
        n = import_chat_file(args.import_chat, Path(cfg.self_distill_dir) / "replies.jsonl",
                             cfg.data.self_distill_max_new_tokens)
        print(f"{n} replies imported from {args.import_chat}")
    mesh = parallel.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tp)
    loaded = load_base(cfg, mesh)  # the config's dtypes, the weights placed on the mesh as they are read
    convs = self_distilled_conversations(cfg, loaded, make_generate_fn, mesh=mesh)
    print(f"{len(convs)} self-distilled conversations in {cfg.self_distill_dir}")


if __name__ == "__main__":
    main()
