"""Training data facade: chat conversations -> token ids + assistant loss masks -> length-bucketed batches.

    convs = load_conversations(cfg.data)                              # [Conversation]
    train, heldout = build_datasets(cfg.data, tokenizer, convs)       # TokenizedDataset x 2
    batcher = BucketedBatcher(train, cfg.data.batch_size, cfg.data.bucket_boundaries, seed=cfg.data.seed)
    batch = next(batcher)   # {"tokens": [B,T] int32, "loss_mask": [B,T] int32, "valid": [B,T] bool}

Re-exports the pipeline's public names from the modules that hold them, one job each:
`sources` (conversations and their readers), `chat_masks` (chat template -> token ids + loss mask),
`dataset` (the tokenized train / held-out datasets), `batching` (length-bucketed batches) and
`distill_cache` (the self-distillation reply cache).
"""

from clover_jax.training.batching import BucketedBatcher, auto_boundaries
from clover_jax.training.chat_masks import assistant_spans, tokenize_conversation
from clover_jax.training.dataset import Example, TokenizedDataset, build_datasets, pad_token_id, split_conversations
from clover_jax.training.distill_cache import SelfDistillCache, build_self_distill, first_turn_prompt, prompt_key
from clover_jax.training.sources import (
    READERS,
    ROLES,
    SHAREGPT_DIST,
    SHAREGPT_FILE,
    Conversation,
    DataError,
    iter_json_array,
    load_conversations,
    normalise_messages,
    read_chat_file,
    read_hf_dataset,
    read_questions,
    read_sharegpt,
    sharegpt_path,
    with_system_prompt,
)

__all__ = [
    "READERS", "ROLES", "SHAREGPT_DIST", "SHAREGPT_FILE", "Conversation", "DataError", "iter_json_array",
    "load_conversations", "normalise_messages", "read_chat_file", "read_hf_dataset", "read_questions",
    "read_sharegpt", "sharegpt_path", "with_system_prompt",
    "assistant_spans", "tokenize_conversation",
    "Example", "TokenizedDataset", "build_datasets", "pad_token_id", "split_conversations",
    "BucketedBatcher", "auto_boundaries",
    "SelfDistillCache", "build_self_distill", "first_turn_prompt", "prompt_key",
]
