"""Export trained heads and base models as Hugging Face folders, optionally pushing them to the hub.

  python -m clover_jax.cli.export head --checkpoint runs/smollm2-135m-clover2 [--step N] --out exported/head
  python -m clover_jax.cli.export head --checkpoint smollm2-135m-instruct-clover2 --out exported/head  # shipped head
  python -m clover_jax.cli.export base --model smollm2-135m-instruct --out exported/smollm2
  ... --push-to-hub USER/REPO   (needs network and a token; fails fast without, the local folder stays)
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from huggingface_hub import HfApi

from clover_jax import pretrained
from clover_jax.cli import add_debug_argument, run_cli
from clover_jax.decoding.ngram import NGRAM_FILE
from clover_jax.heads.draft_vocab import DRAFT_VOCAB_FILE, folder_draft_vocab
from clover_jax.heads import registry
from clover_jax.heads.export import default_model_card, export_head, import_head
from clover_jax.io.export import ExportError, export_base
from clover_jax.io.loader import load_model
from clover_jax.training.checkpoint import (
    Checkpointer,
    checkpoint_dir_of,
    load_head_from_run,
)
from clover_jax.validation import check_float, check_int


def push_to_hub(folder: Path, repo_id: str, private: bool = False, timeout: float = 5.0) -> str:
    """Uploads `folder` to `repo_id`; a clear ExportError when the hub cannot be reached (folder untouched)."""
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
    except OSError as e:
        raise ExportError(f"cannot reach huggingface.co ({e}); nothing was uploaded, the exported folder "
                          f"{folder} is intact: push it later with this command or `huggingface-cli upload`") from None
    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo_id)
    except Exception as e:  # noqa: BLE001 - hub errors come in many types; report them in one line
        raise ExportError(f"upload of {folder} to {repo_id} failed: {type(e).__name__}: {e}; "
                          f"the local folder is intact") from None
    return f"https://huggingface.co/{repo_id}"


def export_head_from_folder(folder, out, *, model=None, include_embedding=True, overwrite=False,
                            dtype="float32") -> Path:
    """Re-exports an exported head folder or a registered head (`clover_jax.pretrained`), e.g. to add the frozen
    tensors a shipped head leaves out; its model card, training config and draft vocabulary come along."""

    src = pretrained.head_path(folder)
    meta = json.loads((src / "config.json").read_text())
    base_name = model or (meta.get("base_model") or {}).get("name_or_path")
    if not base_name:
        raise ExportError(f"{src}: config.json names no base model; pass --model")
    loaded = load_model(base_name, with_tokenizer=False)
    head = import_head(src, loaded.model)
    card = (src / "README.md").read_text() if (src / "README.md").is_file() else None
    written = registry.of_head(head).config_dict(head, base_name)  # what the export writes itself
    extra = {k: v for k, v in meta.items() if k not in written}
    out = export_head(head, out, base=loaded.model, base_name=base_name, include_embedding=include_embedding,
                      model_card=card, extra_config=extra, overwrite=overwrite, dtype=_np_dtype(dtype),
                      draft_vocab=folder_draft_vocab(src))
    for name in ("training_config.json", "training_config.yaml", DRAFT_VOCAB_FILE):
        if (src / name).is_file():
            (out / name).write_text((src / name).read_text())
    if (src / NGRAM_FILE).is_file():  # the n-gram draft table travels with the head (`clover_jax.decoding.ngram`)
        (out / NGRAM_FILE).write_bytes((src / NGRAM_FILE).read_bytes())
    return out


def _np_dtype(name: str):
    if name == "bfloat16":
        return ml_dtypes.bfloat16
    return np.dtype(name)


def export_head_from_run(run_dir, out, *, step=None, model=None, include_embedding=True, overwrite=False,
                         dtype="float32") -> Path:

    if (pretrained.head_path(run_dir) / "config.json").is_file() and not (Path(run_dir) / "checkpoints").exists():
        return export_head_from_folder(run_dir, out, model=model, include_embedding=include_embedding,
                                       overwrite=overwrite, dtype=dtype)

    ckpt = Checkpointer(checkpoint_dir_of(run_dir), read_only=True, async_save=False, save_on_preemption=False)
    try:
        step = ckpt._need_step(step)
        meta = ckpt.read_meta(step)
    finally:
        ckpt.close()
    base_name = model or meta["head"]["base_model"]
    loaded = load_model(base_name, with_tokenizer=False)
    head = load_head_from_run(run_dir, loaded.model, step=step)
    card = default_model_card(head, base_name) + (
        f"\n## Training\n\nDistilled from `{base_name}` with clover_jax for {step} steps (the head type's loss: "
        f"soft cross-entropy to the base distribution, plus for Clover-2 a SmoothL1 regression to its hidden state).\n")
    out = export_head(head, out, base=loaded.model, base_name=base_name, include_embedding=include_embedding,
                      model_card=card, extra_config={"training_step": step}, overwrite=overwrite,
                      dtype=_np_dtype(dtype), draft_vocab=folder_draft_vocab(Path(run_dir)))
    run_config = Path(run_dir) / "config.yaml"  # the resolved experiment config the run wrote at its start
    if run_config.is_file():
        (out / "training_config.yaml").write_text(run_config.read_text())
    vocab = Path(run_dir) / DRAFT_VOCAB_FILE
    if vocab.is_file():  # the head's draft vocabulary travels with it (the one it was trained on, if any)
        (out / DRAFT_VOCAB_FILE).write_text(vocab.read_text())
    return out


def main(argv=None) -> int:
    return run_cli(_main, argv)


def _main(argv=None) -> int:

    ap = argparse.ArgumentParser(prog="python -m clover_jax.cli.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    h = sub.add_parser("head", help="export a trained draft head from a training run")
    h.add_argument("--checkpoint", required=True, help="training run dir (or its checkpoints dir), an exported "
                   "head folder or a registered head name (smollm2-135m-instruct-clover2)")
    h.add_argument("--step", type=int, default=None)
    h.add_argument("--model", default=None, help="base model (default: the one the head was trained on)")
    h.add_argument("--no-embedding", action="store_true",
                   help="omit the frozen tensors (clover_embed_tokens.weight and lm_head.weight, copies of the base "
                   "model's, read from it on load); by default both are written, so the folder loads with strict "
                   "key matching into the reference Clover-2 module")
    h.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                   help="storage type of the tensors")
    b = sub.add_parser("base", help="export a base model as a transformers LlamaForCausalLM folder")
    b.add_argument("--model", required=True)
    b.add_argument("--max-shard-gb", type=float, default=2.0)
    for p in (h, b):
        p.add_argument("--out", required=True)
        p.add_argument("--overwrite", action="store_true")
        p.add_argument("--push-to-hub", metavar="REPO_ID")
        p.add_argument("--private", action="store_true")
        add_debug_argument(p)
    args = ap.parse_args(argv)
    if args.what == "head":
        check_int("--step", args.step, minimum=0, allow_none=True)
    else:
        check_float("--max-shard-gb", args.max_shard_gb, above=0.0)
    if args.what == "head":
        out = export_head_from_run(args.checkpoint, args.out, step=args.step, model=args.model,
                                   include_embedding=not args.no_embedding, overwrite=args.overwrite,
                                   dtype=args.dtype)
    else:
        loaded = load_model(args.model)
        out = export_base(loaded.model, args.out, tokenizer=loaded.tokenizer,
                          max_shard_bytes=int(args.max_shard_gb * 1024**3), overwrite=args.overwrite)
    print(f"exported to {out}")
    if args.push_to_hub:
        print(f"pushed to {push_to_hub(Path(out), args.push_to_hub, args.private)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
