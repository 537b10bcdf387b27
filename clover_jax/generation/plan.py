"""A generation request resolved once into a `GenerationPlan`: every argument checked, the head loaded, the tree
and its drafter chosen, the cache sized, the memory checked, and the decoding loop built, before anything compiles.

`generate`, `stream_text`, `infer.py` and the benchmarks all go through `plan_generation`; `run_plan` (in
`clover_jax.generation.api`) runs what it resolved.
"""

from __future__ import annotations

import collections
import dataclasses
import numbers
import os
import weakref
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx

from clover_jax import parallel, pretrained
from clover_jax.decoding.autoregressive import check_layers, decode_layers, layer_weight_bytes
from clover_jax.decoding.lookup import NoHead
from clover_jax.decoding.memory import check_memory, check_mesh_memory, estimate_generate_memory, split_over_mesh
from clover_jax.decoding.ngram import resolve_ngram_table
from clover_jax.decoding.sampling import SamplingParams
from clover_jax.decoding.sizes import check_context, pad_prompts, plan_cache
from clover_jax.decoding.autoregressive import AutoregressiveLoop
from clover_jax.decoding.drafter import check_drafter
from clover_jax.decoding.speculative import SpeculativeLoop, head_layer_copy_bytes
from clover_jax.decoding.tree import is_lookup_only, is_table_tree
from clover_jax.generation.calibration import entry_key, hardware_key, load_entry, register_saved_trees
from clover_jax.heads import registry
from clover_jax.heads.draft_vocab import head_draft_vocab
from clover_jax.heads.registry import drafter_for
from clover_jax.io.loader import LoadedModel
from clover_jax.io.prompts import encode_prompts
from clover_jax.training.loading import load_head
from clover_jax.validation import (InputError, PromptError, check_bool, check_choice, check_draft_vocab, check_float,
                                   check_int)


_HEAD_CACHE: "collections.OrderedDict[tuple, tuple[weakref.ref, Any]]" = collections.OrderedDict()


_HEAD_CACHE_SIZE = 4


def _load_head_cached(source, model):
    """`load_head(source, model)`, reused while the folder's files are unchanged and for the same base model
    object: `generate(head="name")` in a loop loads the head once, not on every call."""

    path = pretrained.head_path(source) if isinstance(source, (str, os.PathLike)) else None
    if path is None or not path.exists():
        return load_head(source, model)  # its own clear error
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    stamp = max((p.stat().st_mtime_ns for p in files), default=0), len(files)
    key = (str(path.resolve()), stamp, id(model))
    hit = _HEAD_CACHE.get(key)
    if hit is not None and hit[0]() is model:
        _HEAD_CACHE.move_to_end(key)
        return hit[1]
    head = load_head(source, model)
    _HEAD_CACHE[key] = (weakref.ref(model), head)
    while len(_HEAD_CACHE) > _HEAD_CACHE_SIZE:
        _HEAD_CACHE.popitem(last=False)
    return head


def resolve_head(source, model, tree=None, draft_vocab=None):
    """(head module, tree, draft vocabulary) for a head given by name or path (see `generate`): the tree
    defaults to the registered head's, the draft vocabulary to the one the head was trained on."""

    head = _load_head_cached(source, model)
    tree = tree if tree is not None else pretrained.default_tree(source)
    draft_vocab = draft_vocab if draft_vocab is not None else head_draft_vocab(source)
    return head, tree, draft_vocab


# `tree="auto"` without a saved calibration runs one. The runs live a layer above (`clover_jax.tuning.calibrate`:
# they call `generate`), which installs its `resolve_auto` here when imported; `import clover_jax` imports it.
_AUTO_CALIBRATION: Callable[..., tuple[str, dict]] | None = None


def set_auto_calibration(resolve_auto: Callable[..., tuple[str, dict]]) -> None:
    """Installs what resolves `tree="auto"`: `resolve_auto(loaded, head, head_source, *, batch_size, draft_vocab,
    mesh, ngram_table) -> (tree name or "ar", calibration entry)`, calibrating when nothing is saved."""
    global _AUTO_CALIBRATION
    _AUTO_CALIBRATION = resolve_auto


def _resolve_auto(model, tokenizer, head, head_source, batch_size: int, draft_vocab, mesh, ngram_table=None) -> str:
    """`tree="auto"`: the calibrated best tree (or "ar") of this head here, calibrating if none is saved."""
    key = entry_key(hardware_key(mesh), np.dtype(model.dtype).name, batch_size)
    if load_entry(head_source, key) is None and tokenizer is None:
        raise InputError("tree='auto': this head has no calibration for this hardware, and calibrating needs a "
                         "tokenizer (pass tokenizer=..., or run python -m clover_jax.cli.calibrate first)")
    if _AUTO_CALIBRATION is None:
        raise InputError("tree='auto': no calibration runner is installed (import clover_jax.tuning.calibrate)")
    loaded = LoadedModel(model.config, model, tokenizer, "")
    best, _ = _AUTO_CALIBRATION(loaded, head, head_source, batch_size=batch_size, draft_vocab=draft_vocab,
                                mesh=mesh, ngram_table=ngram_table)
    return best


# A speculative request that names no tree drafts with what is fastest here (`clover_jax.tuning.choose`, a layer
# above: it measures through `generate`), installed here when imported; `import clover_jax` imports it.
_AUTO_CHOICE: Callable[..., Any] | None = None

DEFAULT = "default"  # tree="default": the head's registered default tree, chosen without measuring


def set_auto_choice(choose: Callable[..., Any]) -> None:
    """Installs what chooses head and tree for a speculative request with no tree: `choose(loaded, head_source,
    head_tree, *, batch_size, mesh, model_source) -> Choice(head, tree, predicted, note)` (tree "ar": plain
    decoding)."""
    global _AUTO_CHOICE
    _AUTO_CHOICE = choose


def _choose(model, tokenizer, model_source, head, batch_size: int, mesh, notes: list[str], drafting_asked: bool):
    """(head, tree, choice) for a speculative request with no tree: `tuning.choose`'s answer, or (head, None,
    None) (the head's default tree) where nothing can be measured (no tokenizer, a head given as a module)."""
    if isinstance(head, nnx.Module):
        return head, None, None  # an in-memory head has no folder to keep a choice in: its default tree
    if drafting_asked:
        notes.append("the head's default tree (the request names a draft vocabulary or n-gram table)")
        return head, None, None
    if tokenizer is None or _AUTO_CHOICE is None:
        notes.append("the head's default tree (no tokenizer to measure a choice with)" if tokenizer is None else
                     "the head's default tree (import clover_jax.tuning.choose to choose by measuring)")
        return head, None, None
    if head is None and not (model_source and pretrained.heads_for(model_source)):
        return head, None, None  # no shipped head to choose among: `_default_head` says what to pass
    head_tree = None
    if head is not None:
        loaded_head = _load_head_cached(head, model)
        head_tree = pretrained.default_tree(head) or registry.of_head(loaded_head).default_tree
    loaded = LoadedModel(model.config, model, tokenizer, model_source or "")
    choice = _AUTO_CHOICE(loaded, head, head_tree, batch_size=batch_size, mesh=mesh, model_source=model_source)
    if choice is None:  # no candidate passes the request's checks: the default tree's path reports why
        return head, None, None
    notes.append(choice.note)
    if choice.tree == "ar":
        return head, "ar", choice
    return (choice.head if choice.head is not None else NoHead()), choice.tree, choice


@dataclasses.dataclass
class GenerationPlan:
    """Everything `generate` checked and resolved before compiling: see `prepare_generate`."""

    model: Any  # the Llama
    tokenizer: Any
    ids: list[list[int]]  # the prompts' token ids (the rows of `prompt` past these pad the batch)
    prompt: np.ndarray  # [B, T] right-padded to the length bucket
    prompt_lengths: np.ndarray  # [B]
    max_new_tokens: int
    sampling: SamplingParams
    seed: int
    cache_size: int
    mode: str
    head: Any = None
    drafter: Any = None
    memory: dict[str, int] = dataclasses.field(default_factory=dict)  # estimated bytes per part (per device)
    mesh: Any = None  # jax.sharding.Mesh the loop runs on (None: one device)
    auto_choice: str | None = None  # what tree="auto" resolved to (a tree name, or "ar"), else None
    choice: Any = None  # what was chosen for a speculative request with no tree (`tuning.choose.Choice`), else None
    tree: Any = None  # the tree drafted (a name, a JSON path or a policy object), None for plain decoding
    draft_vocab: Any = None  # the token ids drafts are drawn from (None: all)
    ngram_table: Any = None  # the n-gram table of `...-table` trees (None: none)
    notes: list[str] = dataclasses.field(default_factory=list)  # what was chosen that the request did not name
    loop: Any = None  # the decoding loop (`AutoregressiveLoop` or `SpeculativeLoop`), built once for this plan
    layers: str = "scan"  # how the decoding loop runs the base model's layers ("unrolled" or "scan")
    stream: Any = None  # sink(row, token_ids) called as each row's tokens are accepted, or None

    @property
    def row_new_tokens(self) -> np.ndarray:
        """`[B]` new-token budget per row: `max_new_tokens` for the prompts, 1 for the rows that only pad the
        batch to a multiple of the mesh's batch shards (they stop after the prefill)."""
        out = np.ones(len(self.prompt_lengths), np.int32)
        out[: len(self.ids)] = self.max_new_tokens
        return out


def _is_model(model) -> bool:
    return hasattr(model, "config") and hasattr(model, "forward_hidden")


def _default_head(tree, model_source: str | None, notes: list[str]):
    """The head of a speculative request that names none: the parameter-free head of a prompt-lookup-only tree
    (`lookup-K`), else the model's shipped head (`clover_jax.pretrained`), else an error."""
    if is_lookup_only(tree):
        return NoHead()
    shipped = pretrained.default_head(model_source) if model_source else None
    if shipped is None:
        raise InputError("head: mode='speculative' needs a draft head (head=...; shipped heads: "
                         f"{', '.join(pretrained.HEADS)}), or a prompt-lookup tree that needs none (tree='lookup-4')")
    notes.append(f"drafting with the shipped head {shipped}")
    return shipped


def prepare_generate(model, prompts: Sequence[Any], *, tokenizer=None, max_new_tokens: int = 128,
                     temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, chat: bool = True,
                     system: str | None = None, cache_size: int | None = None, mode: str = "ar", head=None,
                     tree=None, draft_vocab=None, decode_text: bool = True, check_free_memory: bool = True,
                     mesh=None, layers: str = "auto", ngram_table=None, stream=None) -> GenerationPlan:
    """Checks every argument of `generate` (same signature) and resolves the head, tree and cache, without
    compiling anything. Errors (`clover_jax.validation.InputError`) name the argument, the value and the
    limit: types and ranges, finite sampling parameters, token ids within the vocabulary, prompt + new tokens
    (+ the draft tree) within the model's context and the cache, and the estimated memory of the call
    within what the device has free (`check_free_memory`)."""
    model_source = None  # the name or path the model was loaded from (a LoadedModel knows it)
    if hasattr(model, "tokenizer") and hasattr(model, "model"):
        tokenizer = tokenizer or model.tokenizer
        model_source = getattr(model, "name", None) or None
        model = model.model
    if not _is_model(model):
        raise InputError(f"model: expected a Llama or the LoadedModel of load_model, got {type(model).__name__}")
    config = model.config
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
    temperature = check_float("temperature", temperature, minimum=0.0)
    top_k = check_int("top_k", top_k, minimum=0)
    top_p = check_float("top_p", top_p, above=0.0, maximum=1.0)
    seed = check_int("seed", seed, minimum=-(2 ** 63), maximum=2 ** 63 - 1)
    check_bool("chat", chat)
    check_bool("decode_text", decode_text)
    if system is not None and not isinstance(system, str):
        raise InputError(f"system: expected a string or None, got {type(system).__name__}")
    cache_size = check_int("cache_size", cache_size, minimum=1, allow_none=True)
    check_choice("mode", mode, ("ar", "speculative"))
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and isinstance(prompts[0], (numbers.Integral, float))):
        prompts = [prompts]
    if isinstance(prompts, np.ndarray) and prompts.ndim == 1:
        prompts = [prompts]
    if prompts is None or (not isinstance(prompts, np.ndarray) and not isinstance(prompts, Sequence)):
        raise PromptError(f"prompts: expected a list of prompts, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise PromptError("prompts: no prompts given (an empty list)")
    notes: list[str] = []  # what was chosen for the request that it did not name, and why
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    mesh = parallel.parse_mesh(mesh)
    check_layers(layers, mesh)
    if stream is not None and not callable(stream):
        raise InputError(f"stream: expected a callable sink(row, token_ids) or None, got {type(stream).__name__}")
    if stream is not None and mesh is not None:
        raise InputError(f"stream: streaming runs on one device; drop mesh={dict(mesh.shape)} or stream")
    ids = encode_prompts(tokenizer, prompts, chat=chat, system=system, vocab_size=config.vocab_size)
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    # on a mesh the rows split over its batch shards: pad the batch to a multiple with copies of prompt 0
    extra_rows = (-len(ids)) % parallel.batch_divisor(mesh) if mesh is not None else 0
    arr, lens = pad_prompts(ids + [ids[0]] * extra_rows, pad_id)
    drafter = auto_choice = drafter_tree = choice = None
    if mode == "speculative" and isinstance(tree, str) and tree.strip().lower() == DEFAULT:
        tree = None  # the head's registered default tree, not measured
    elif mode == "speculative" and tree is None:
        head, tree, choice = _choose(model, tokenizer, model_source, head, len(lens), mesh, notes,
                                     drafting_asked=draft_vocab is not None or ngram_table is not None)
    if mode == "speculative" and tree == "ar":  # nothing beats plain decoding here (a choice found so)
        mode, tree = "ar", None
    if mode == "speculative" and head is None:
        head = _default_head(tree, model_source, notes)
    if mode == "speculative":
        head_source = head if isinstance(head, (str, os.PathLike)) else None
        if head_source is not None:
            asked_vocab = draft_vocab
            head, tree, draft_vocab = resolve_head(head, model, tree, draft_vocab)
            if asked_vocab is None and draft_vocab is not None:
                notes.append(f"drafting from the head's {len(draft_vocab)}-token training vocabulary")
            register_saved_trees(head_source, tree)  # a calibration's fitted tree by name (fit-N-<hash>)
        table_of = head_source
        if ngram_table is None and isinstance(head, NoHead) and is_table_tree(tree) and model_source:
            table_of = pretrained.default_head(model_source)  # a lookup-K-table tree: the shipped head's table
            if table_of:
                notes.append(f"n-gram table of the shipped head {table_of}")
        ngram_table = resolve_ngram_table(ngram_table, table_of)
        if draft_vocab is not None:
            draft_vocab = check_draft_vocab(draft_vocab, config.vocab_size)
        if isinstance(tree, str) and tree.strip().lower() == "auto":
            tree = auto_choice = _resolve_auto(model, tokenizer, head, head_source, len(lens), draft_vocab, mesh,
                                               ngram_table)
            notes.append(f"tree auto -> {auto_choice}" + (" (autoregressive: no tree beats it on this hardware)"
                                                          if auto_choice == "ar" else ""))
        if tree == "ar":  # the calibration found no tree that beats autoregressive decoding here
            mode = "ar"
        else:
            drafter_tree = tree or registry.of_head(head).default_tree  # a name, a JSON path or a policy
            drafter = drafter_for(type(head), drafter_tree, draft_vocab, ngram_table)
            check_drafter(drafter)
            drafter.check(head, model)
    depth = drafter.max_depth if drafter is not None else 0
    check_context(lens, max_new_tokens, getattr(config, "max_position_embeddings", None), depth)
    cache_size = plan_cache(lens, max_new_tokens, drafter.num_nodes if drafter is not None else 0, cache_size, None)
    dtype_bytes = np.dtype(model.dtype).itemsize
    memory = estimate_generate_memory(
        config, batch=len(lens), cache_size=cache_size, prompt_len=arr.shape[1], dtype_bytes=dtype_bytes,
        tree_nodes=drafter.num_nodes if drafter is not None else 0,
        head_layers=getattr(getattr(head, "cfg", None), "num_aug_layers", 0),
        draft_rows=len(draft_vocab) if draft_vocab is not None else config.vocab_size)
    tokens_per_step = drafter.num_nodes if drafter is not None else 1
    layers = decode_layers(layers, mesh, tokens_per_step=tokens_per_step, model=model)
    if layers == "unrolled":
        memory["per-layer copy of the layer weights"] = layer_weight_bytes(model)
    head_copy = head_layer_copy_bytes(drafter, head, mesh)
    if head_copy:
        memory["per-layer copy of the draft head's layers"] = head_copy
    what = f"generate(batch={len(ids)} prompts, cache_size={cache_size}, mode={mode!r})"
    if mesh is not None:
        memory = split_over_mesh(memory, config, dict(mesh.shape))
        if check_free_memory:
            states = [nnx.state(model)] + ([nnx.state(head)] if head is not None else [])
            per_device = [(parallel.bytes_per_device(st, mesh), parallel.is_placed(st, mesh)) for st in states]
            weights = sum(n for n, _ in per_device)
            to_place = sum(n for n, placed in per_device if not placed)
            check_mesh_memory(memory, weights_bytes=weights, weights_to_place=to_place,
                              what=f"{what} on mesh {dict(mesh.shape)}", devices=mesh.devices.flat)
    elif check_free_memory:
        weights = sum(int(x.nbytes) for x in jax.tree.leaves(nnx.state(model)))
        check_memory(memory, weights_bytes=weights, what=what)
    if mode == "ar":
        loop = AutoregressiveLoop.build(model, cache_size=cache_size, greedy=sampling.greedy, mesh=mesh,
                                        layers=layers, stream=stream is not None)
    else:
        loop = SpeculativeLoop.build(model, head, drafter, prompt_lengths=lens, max_new_tokens=max_new_tokens,
                                     cache_size=cache_size, greedy=sampling.greedy, mesh=mesh, layers=layers,
                                     stream=stream is not None, checked=True)
    return GenerationPlan(model=model, tokenizer=tokenizer, ids=ids, prompt=arr, prompt_lengths=lens,
                          max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, cache_size=cache_size,
                          mode=mode, head=head, drafter=drafter, memory=memory, mesh=mesh, auto_choice=auto_choice,
                          layers=layers, stream=stream, tree=None if drafter is None else drafter_tree, choice=choice,
                          draft_vocab=draft_vocab, ngram_table=ngram_table, notes=notes, loop=loop)
