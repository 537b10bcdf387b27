"""A generation request, checked: `Request`, a frozen record of what the caller asked for, every argument validated
and put in one form (prompts as token ids padded to their bucket, the mesh parsed, the tree's kind of choice
named), before any head is read or anything compiles. `check_request` takes `generate`'s arguments.

What the request does not say (the head, the tree, the draft vocabulary, the n-gram table, the cache size) is
resolved afterwards, once: the draft by `clover_jax.generation.draft`, the sizes and the loop by
`clover_jax.generation.plan`.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from typing import Any, Sequence

import numpy as np
from flax import nnx

from clover_jax import parallel
from clover_jax.decoding.autoregressive import check_layers
from clover_jax.decoding.lookup import NoHead
from clover_jax.decoding.sampling import SamplingParams
from clover_jax.decoding.tree import TreePolicy, TreeSpec
from clover_jax.heads.bundle import HeadBundle
from clover_jax.io.prompts import encode_prompts
from clover_jax.validation import (InputError, PromptError, check_bool, check_choice, check_draft_vocab, check_float,
                                   check_int)

# How the tree of a speculative request is decided (`Request.tree_rule`)
NAMED = "named"  # the request names it (a name, a JSON file, a policy, a list of paths)
DEFAULT = "default"  # tree="default": the head's registered default tree, else its type's
FASTEST = "fastest"  # no tree named: what is fastest here (`clover_jax.tuning.choose`; below that layer: the default)
AUTO = "auto"  # tree="auto": the tree a calibration of the head found fastest (`clover_jax.tuning.calibrate`)


@dataclasses.dataclass(frozen=True, eq=False)
class Request:
    """`generate`'s arguments, checked (see `check_request`)."""

    model: Any  # the base Llama
    tokenizer: Any  # or None (token-id prompts only)
    model_source: str | None  # the name or path the model was loaded from (a LoadedModel knows it)
    ids: tuple[tuple[int, ...], ...]  # the prompts' token ids
    max_new_tokens: int
    sampling: SamplingParams
    seed: int
    cache_size: int | None  # asked for, else None (the plan sizes it)
    prompt_bucket: int | None  # every prompt padded to this length, asked for, else None (each batch's own bucket)
    speculative: bool  # mode == "speculative": draft (with `head` and `tree`), else plain decoding
    head: Any = None  # a head source (registered name, folder, hub id), a head module, a HeadBundle, or None
    tree: str | os.PathLike | TreePolicy | None = None  # with tree_rule NAMED
    tree_rule: str = FASTEST
    draft_vocab: np.ndarray | None = None  # [V'] token ids drafts are drawn from, asked for; None: the head's or all
    ngram_table: Any = None  # an NgramTable or its path, asked for; None: the head's
    mesh: Any = None  # jax.sharding.Mesh or None
    layers: str = "auto"
    stream: Any = None  # sink(row, token_ids) or None
    decode_text: bool = True
    check_free_memory: bool = True

    @property
    def batch_size(self) -> int:
        """Rows the loop runs: the prompts, plus copies of prompt 0 up to a multiple of the mesh's batch shards."""
        n = len(self.ids)
        return n + ((-n) % parallel.batch_divisor(self.mesh) if self.mesh is not None else 0)

    @property
    def head_source(self) -> str | os.PathLike | None:
        """The head as a name or path, when the request gave it so."""
        return self.head if isinstance(self.head, (str, os.PathLike)) else None

    def replace(self, **changes) -> "Request":
        return dataclasses.replace(self, **changes)


def _is_model(model) -> bool:
    return hasattr(model, "config") and hasattr(model, "forward_hidden")


def _check_tree(tree) -> tuple[Any, str]:
    """(tree, tree_rule): a name, a JSON path, a policy or a list of paths (made a `TreeSpec`); "default", "auto",
    None."""
    if tree is None:
        return None, FASTEST
    if isinstance(tree, str):
        key = tree.strip()
        if not key:
            raise InputError("tree: an empty name; give a tree name (chain-4, clover2-26, ...), a JSON file, or None")
        if key.lower() in (DEFAULT, AUTO):
            return None, key.lower()
        return key, NAMED
    if isinstance(tree, (os.PathLike, TreePolicy)):
        return tree, NAMED
    if isinstance(tree, (list, tuple)) and tree and all(isinstance(p, (list, tuple)) for p in tree):
        return TreeSpec(tuple(tuple(p) for p in tree)), NAMED  # its own errors name the bad path
    raise InputError(f"tree: expected a tree name (chain-4, clover2-26, lookup-4, ...), a JSON file, a tree policy "
                     f"or a list of paths of child ranks ([[0], [0, 0], [1]]), got {type(tree).__name__} "
                     f"{tree!r}"[:300])


def _check_head(head):
    if head is None or isinstance(head, (nnx.Module, NoHead, HeadBundle)):
        return head
    if isinstance(head, (str, os.PathLike)) and str(head).strip():
        return head
    raise InputError(f"head: expected a registered head name, a head folder, a run directory or a head module, got "
                     f"{type(head).__name__} {head!r}"[:300])


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and isinstance(prompts[0], (numbers.Integral, float))):
        prompts = [prompts]
    if isinstance(prompts, np.ndarray) and prompts.ndim == 1:
        prompts = [prompts]
    if prompts is None or (not isinstance(prompts, np.ndarray) and not isinstance(prompts, Sequence)):
        raise PromptError(f"prompts: expected a list of prompts, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise PromptError("prompts: no prompts given (an empty list)")
    return list(prompts)


def check_request(model, prompts: Sequence[Any], *, tokenizer=None, max_new_tokens: int = 128,
                  temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, chat: bool = True,
                  system: str | None = None, cache_size: int | None = None, mode: str = "ar", head=None, tree=None,
                  draft_vocab=None, decode_text: bool = True, check_free_memory: bool = True, mesh=None,
                  layers: str = "auto", ngram_table=None, stream=None, prompt_bucket: int | None = None) -> Request:
    """`generate`'s arguments checked into a `Request`. Errors (`clover_jax.validation.InputError`) name the
    argument, the value and the limit: types and ranges, finite sampling parameters, token ids within the
    vocabulary, the tree's type, the head's."""
    model_source = None
    if hasattr(model, "tokenizer") and hasattr(model, "model"):
        tokenizer = tokenizer or model.tokenizer
        model_source = getattr(model, "name", None) or None
        model = model.model
    if not _is_model(model):
        raise InputError(f"model: expected a Llama or the LoadedModel of load_model, got {type(model).__name__}")
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
    temperature = check_float("temperature", temperature, minimum=0.0)
    top_k = check_int("top_k", top_k, minimum=0)
    top_p = check_float("top_p", top_p, above=0.0, maximum=1.0)
    seed = check_int("seed", seed, minimum=-(2 ** 63), maximum=2 ** 63 - 1)
    check_bool("chat", chat)
    check_bool("decode_text", decode_text)
    check_bool("check_free_memory", check_free_memory)
    if system is not None and not isinstance(system, str):
        raise InputError(f"system: expected a string or None, got {type(system).__name__}")
    cache_size = check_int("cache_size", cache_size, minimum=1, allow_none=True)
    prompt_bucket = check_int("prompt_bucket", prompt_bucket, minimum=1, allow_none=True)
    check_choice("mode", mode, ("ar", "speculative"))
    prompts = _as_prompt_list(prompts)
    mesh = parallel.parse_mesh(mesh)
    check_layers(layers, mesh)
    if stream is not None and not callable(stream):
        raise InputError(f"stream: expected a callable sink(row, token_ids) or None, got {type(stream).__name__}")
    if stream is not None and mesh is not None:
        raise InputError(f"stream: streaming runs on one device; drop mesh={dict(mesh.shape)} or stream")
    tree, tree_rule = _check_tree(tree)
    head = _check_head(head)
    if draft_vocab is not None:
        draft_vocab = check_draft_vocab(draft_vocab, model.config.vocab_size)
    ids = encode_prompts(tokenizer, prompts, chat=chat, system=system, vocab_size=model.config.vocab_size)
    return Request(model=model, tokenizer=tokenizer, model_source=model_source,
                   ids=tuple(tuple(int(t) for t in row) for row in ids), max_new_tokens=max_new_tokens,
                   sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), seed=seed,
                   cache_size=cache_size, prompt_bucket=prompt_bucket, speculative=mode == "speculative", head=head, tree=tree, tree_rule=tree_rule,
                   draft_vocab=draft_vocab, ngram_table=ngram_table, mesh=mesh, layers=layers, stream=stream,
                   decode_text=decode_text, check_free_memory=check_free_memory)


__all__ = ["AUTO", "DEFAULT", "FASTEST", "NAMED", "Request", "check_request"]
