"""Self-distillation data: the base model's own replies to the first user turn of each conversation.

Heads trained on text the base model did not write accept fewer drafts (Medusa/EAGLE users report
this); regenerating the replies with the base model matches the training data to what the head will
have to predict at inference time. Replies are generated with our batched greedy loop and cached on
disk (JSONL, resumable), so a killed run continues where it stopped.

The base model is loaded and decodes on the config's mesh (`mesh.data/fsdp/tp`, as training uses it): a model
that does not fit one chip (Llama-3-8B in bf16 on TPU v5e) generates tensor-parallel over `tp`, its rows split
over the batch axes. One process only: multi-host generation is not supported (each host would decode alone).

  python -m clover_jax.cli.self_distill --config configs/smollm2-135m-clover2.yaml
  python -m clover_jax.cli.self_distill --config configs/llama3-8b-instruct-clover2.yaml --set mesh.tp=8
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import jax

from clover_jax.io.prompts import encode_prompts, questions_path
from clover_jax.training.distill_cache import SelfDistillCache, build_self_distill, first_turn_prompt, prompt_key
from clover_jax.training.sources import Conversation, DataError, load_conversations


def short_prompts(conversations, tokenizer, max_prompt_tokens: int) -> list[Conversation]:
    """Conversations whose first-turn prompt (chat template applied) fits in `max_prompt_tokens`."""
    keep = []
    for c in conversations:
        prompt = list(first_turn_prompt(c))
        if len(encode_prompts(tokenizer, [prompt])[0]) <= max_prompt_tokens:
            keep.append(c)
    return keep


def self_distilled_conversations(cfg, loaded, make_generate_fn, convs=None, progress: bool = True,
                                 mesh=None) -> list[Conversation]:
    """The configured conversations (or `convs`) with the base model's replies, generated once (on `mesh`, by
    `make_generate_fn(loaded, temperature=, seed=, mesh=)`: `clover_jax.generation.replies.make_generate_fn`) and cached in `<self_distill_dir>/replies.jsonl`; prompts longer than
    `data.self_distill_max_prompt_tokens` are skipped. Greedy unless `data.self_distill_temperature` > 0."""
    if jax.process_count() > 1:
        raise DataError(f"self-distillation runs in one process, not {jax.process_count()}: generate the replies "
                        "on one host (python -m clover_jax.cli.self_distill --config ... --export-chat "
                        "replies.jsonl.gz) and train with data.self_distill: false, data.source: that file")
    convs = load_conversations(cfg.data) if convs is None else convs
    convs = short_prompts(convs, loaded.tokenizer, cfg.data.self_distill_max_prompt_tokens)
    out = Path(cfg.self_distill_dir) / "replies.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    gen = make_generate_fn(loaded, temperature=cfg.data.self_distill_temperature, seed=cfg.data.seed, mesh=mesh)
    return build_self_distill(convs, gen, out,
                              batch_size=cfg.data.self_distill_batch_size,
                              max_new_tokens=cfg.data.self_distill_max_new_tokens, progress=progress,
                              seed=cfg.data.seed)


def export_chat_file(cache_path, out_path, id_suffix: str = "") -> int:
    """Writes the cached replies as a chat JSONL file (`{"id", "messages"}` per line); returns the count.
    `id_suffix` (e.g. "/t0.7") is appended to every id: a second reply to the same conversations (sampled) can then
    be trained beside the first (`data.source` refuses an id listed twice), and `data.heldout_split: id_hash`
    keeps `X/t0.7` on the side of `X`.

    Lets a run train on whatever part of the cache is done (e.g. after stopping a long generation). A name
    ending in `.gz` is written gzip-compressed (`data.source` reads `.jsonl.gz`), small enough to keep the
    replies in a repository so they are generated once.
    """
    cache = SelfDistillCache(cache_path)
    gz = str(out_path).endswith(".gz")
    with (gzip.open(out_path, "wt", encoding="utf-8") if gz else open(out_path, "w", encoding="utf-8")) as f:
        for rec in cache.records.values():
            msgs = list(rec["prompt"]) + [{"role": "assistant", "content": rec["response"]}]
            rid = rec["id"] if rec["id"].endswith(id_suffix) else rec["id"] + id_suffix  # (imported: already has it)
            f.write(json.dumps({"id": rid, "messages": msgs}) + "\n")
    return len(cache)


def import_chat_file(chat_path, cache_path, max_new_tokens: int | None = None) -> int:
    """Adds the replies of a chat JSONL file (`export_chat_file`'s format, `.gz` or not) to the resumable cache,
    so a generation on a fresh machine continues after the replies kept in the repository instead of making them
    again. Each line's last message must be the assistant's reply; returns the number of replies added."""
    cache = SelfDistillCache(cache_path)
    opener = gzip.open if str(chat_path).endswith(".gz") else open
    items = []
    with opener(chat_path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            rec = json.loads(line)
            msgs = rec["messages"]
            if not msgs or msgs[-1]["role"] != "assistant":
                raise DataError(f"{chat_path}, line {i + 1}: the last message is not an assistant reply")
            prompt = tuple(msgs[:-1])
            if prompt not in cache:
                items.append((rec.get("id", str(i)), prompt, msgs[-1]["content"]))
    if items:
        cache.append(items, max_new_tokens)
    return len(items)


def _chat_prompts(path) -> set[str]:
    """The prompts (every message but the last) of a chat JSONL file, as `prompt_key`s."""
    with (gzip.open if str(path).endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
        return {prompt_key(json.loads(line)["messages"][:-1]) for line in f if line.strip()}


def evaluation_exclusions() -> tuple[set[str], set[str]]:
    """(original conversation ids, question texts) that training prompts must not share with the library's
    evaluation questions: the ShareGPT held-out questions (`sharegpt_heldout`; a ShareGPT V3 id `X_n` is part n of
    conversation X, so every part of X is excluded) and MT-Bench's first turns."""
    ids, texts = set(), set()
    for name in ("sharegpt_heldout", "mt_bench"):
        for line in Path(questions_path(name)).read_text(encoding="utf-8").splitlines():
            q = json.loads(line)
            texts.add(q["turns"][0].strip())
            if q.get("category") == "sharegpt":
                ids.add(str(q["question_id"]).rsplit("_", 1)[0])
    return ids, texts


def export_prompts_file(convs, tokenizer, max_prompt_tokens: int, out_path, skip_answered=()) -> int:
    """Writes the distinct first-turn prompts of `convs` that fit in `max_prompt_tokens` as a chat JSONL file
    (`.gz`: compressed), each with a one-character stand-in reply (a chat file needs an assistant turn; the reply is
    replaced when self-distilling). Left out: prompts of conversations that share an original ShareGPT conversation
    or a question text with the library's evaluation questions (`evaluation_exclusions`), and prompts that a chat
    file of `skip_answered` already answers. The file is a few MB where the ShareGPT JSON is 125 MB: what a
    generation run on another machine needs (`data.source`). Returns the count."""
    held_ids, held_texts = evaluation_exclusions()
    answered = set().union(*(_chat_prompts(p) for p in skip_answered)) if skip_answered else set()
    seen = set(answered)  # prompt keys already answered or already written
    cand = []
    for c in convs:
        prompt = first_turn_prompt(c)
        if c.id.rsplit("_", 1)[0] in held_ids or prompt[-1]["content"].strip() in held_texts:
            continue
        if (key := prompt_key(prompt)) not in seen:
            seen.add(key)
            cand.append(c)
    keep = short_prompts(cand, tokenizer, max_prompt_tokens)
    gz = str(out_path).endswith(".gz")
    with (gzip.open(out_path, "wt", encoding="utf-8") if gz else open(out_path, "w", encoding="utf-8")) as f:
        for c in keep:
            prompt = list(first_turn_prompt(c))
            f.write(json.dumps({"id": c.id, "messages": prompt + [{"role": "assistant", "content": "-"}]},
                               ensure_ascii=False) + "\n")
    return len(keep)
