"""The user-facing generation call: prompts in, text and statistics out.

`generate(model, prompts, tokenizer=...)` handles chat templating, validation, length buckets and
batching; the jitted loops live in `clover_jax.decoding`.
"""

from __future__ import annotations

import collections
import dataclasses
import numbers
import os
import time
import weakref
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from flax import nnx

from clover_jax.decoding.autoregressive import ar_generate, check_layers, decode_layers, layer_weight_bytes
from clover_jax.decoding.sizes import bucket_length, check_context, plan_cache, round_up  # noqa: F401 (re-exported)
from clover_jax.decoding.sampling import SamplingParams
from clover_jax.decoding.streaming import streaming_to
from clover_jax import parallel
from clover_jax.validation import PromptError  # noqa: F401 (re-exported: clover_jax.api.PromptError)
from clover_jax.validation import (InputError, check_bool, check_choice, check_float, check_int, check_memory,
                                   check_mesh_memory, check_token_ids, estimate_generate_memory, split_over_mesh)


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[list[int]]  # generated tokens per prompt (EOS included when emitted)
    texts: list[str] | None
    prompt_lengths: list[int]
    steps: int  # decode-phase base forwards for the whole batch
    row_steps: list[int]  # decode-phase base forwards per row
    seconds: float  # wall time of the jitted call (compile excluded if warmed up)
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated / self.seconds if self.seconds > 0 else float("nan")


def encode_prompts(tokenizer, prompts: Sequence[Any], chat: bool = True, system: str | None = None,
                   vocab_size: int | None = None) -> list[list[int]]:
    """Strings (chat-templated when `chat`), message lists, or token-id lists -> token-id lists.

    Token ids, given or from the tokenizer, are checked against `vocab_size` when it is given."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p.strip():
                raise PromptError(f"prompts[{i}]: prompt {i} is empty")
            if tokenizer is None:
                raise PromptError(f"prompts[{i}]: text prompts need a tokenizer (pass tokenizer=...)")
            if chat and getattr(tokenizer, "chat_template", None):
                msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": p}]
                ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            else:
                ids = tokenizer.encode(p, add_special_tokens=True)
            where = f"prompts[{i}] (as tokenized)"
        elif isinstance(p, (list, tuple)) and p and isinstance(p[0], dict):
            if tokenizer is None:
                raise PromptError(f"prompts[{i}]: message lists need a tokenizer (pass tokenizer=...)")
            bad = [m for m in p if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m]
            if bad:
                raise PromptError(f"prompts[{i}]: every message must be a dict with 'role' and a string 'content', "
                                  f"got {bad[0]!r}")
            ids = tokenizer.apply_chat_template(list(p), add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            where = f"prompts[{i}] (as tokenized)"
        elif isinstance(p, (list, tuple, np.ndarray)) or hasattr(p, "__array__"):
            ids = check_token_ids(f"prompts[{i}]", p if isinstance(p, (list, tuple)) else np.asarray(p),
                                  vocab_size if vocab_size is not None else 2 ** 31)
            where = f"prompts[{i}]"
        else:
            raise PromptError(f"prompts[{i}]: expected a string, a list of messages or a list of token ids, got "
                              f"{type(p).__name__} {p!r:.80}")
        if len(ids) == 0:
            raise PromptError(f"prompts[{i}]: prompt {i} is empty after tokenization")
        if vocab_size is not None:
            check_token_ids(where, list(ids), vocab_size)
        out.append(list(ids))
    return out


def pad_prompts(ids: list[list[int]], pad_id: int, bucket: int | None = None):
    lens = np.array([len(x) for x in ids], np.int32)
    t = bucket or bucket_length(int(lens.max()))
    arr = np.full((len(ids), t), pad_id, np.int32)
    for i, x in enumerate(ids):
        arr[i, : len(x)] = x
    return arr, lens


_HEAD_CACHE: "collections.OrderedDict[tuple, tuple[weakref.ref, Any]]" = collections.OrderedDict()
_HEAD_CACHE_SIZE = 4


def _load_head_cached(source, model):
    """`load_head(source, model)`, reused while the folder's files are unchanged and for the same base model
    object: `generate(head="name")` in a loop loads the head once, not on every call."""
    from clover_jax import pretrained
    from clover_jax.heads.loading import load_head

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
    from clover_jax import pretrained
    from clover_jax.heads.draft_vocab import head_draft_vocab

    head = _load_head_cached(source, model)
    tree = tree if tree is not None else pretrained.default_tree(source)
    draft_vocab = draft_vocab if draft_vocab is not None else head_draft_vocab(source)
    return head, tree, draft_vocab


def _resolve_auto(model, tokenizer, head, head_source, batch_size: int, draft_vocab, mesh, ngram_table=None) -> str:
    """`tree="auto"`: the calibrated best tree (or "ar") of `clover_jax.calibrate`, calibrating if needed."""
    from clover_jax import calibrate
    from clover_jax.io.loader import LoadedModel

    key = calibrate.entry_key(calibrate.hardware_key(mesh), np.dtype(model.dtype).name, batch_size)
    if calibrate.load_entry(head_source, key) is None and tokenizer is None:
        raise InputError("tree='auto': this head has no calibration for this hardware, and calibrating needs a "
                         "tokenizer (pass tokenizer=..., or run python -m clover_jax.calibrate first)")
    loaded = LoadedModel(model.config, model, tokenizer, "")
    best, _ = calibrate.resolve_auto(loaded, head, head_source, batch_size=batch_size, draft_vocab=draft_vocab,
                                     mesh=mesh, ngram_table=ngram_table)
    return best


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


def _lookup_only_head(tree):
    """The parameter-free head of a prompt-lookup-only tree (`lookup-K`), or an error: other trees need a head."""
    from clover_jax.decoding.lookup import NoHead
    from clover_jax.decoding.tree import is_lookup_only

    if is_lookup_only(tree):
        return NoHead()
    raise InputError("head: mode='speculative' needs a draft head (head=...), or a prompt-lookup tree that needs "
                     "none (tree='lookup-4')")


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
    if hasattr(model, "tokenizer") and hasattr(model, "model"):
        tokenizer = tokenizer or model.tokenizer
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
    if mode == "speculative" and head is None:
        head = _lookup_only_head(tree)
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
    drafter = auto_choice = None
    if mode == "speculative":
        from clover_jax.heads.registry import drafter_for

        head_source = head if isinstance(head, (str, os.PathLike)) else None
        if head_source is not None:
            from clover_jax.calibrate import register_saved_trees

            head, tree, draft_vocab = resolve_head(head, model, tree, draft_vocab)
            register_saved_trees(head_source, tree)  # a calibration's fitted tree by name (fit-N-<hash>)
        from clover_jax.decoding.ngram import resolve_ngram_table

        ngram_table = resolve_ngram_table(ngram_table, head_source)
        if draft_vocab is not None:
            from clover_jax.validation import check_draft_vocab

            draft_vocab = check_draft_vocab(draft_vocab, config.vocab_size)
        if isinstance(tree, str) and tree.strip().lower() == "auto":
            tree = auto_choice = _resolve_auto(model, tokenizer, head, head_source, len(lens), draft_vocab, mesh,
                                               ngram_table)
        if tree == "ar":  # the calibration found no tree that beats autoregressive decoding here
            mode = "ar"
        else:
            from clover_jax.heads import registry

            drafter = drafter_for(type(head), tree or registry.of_head(head).default_tree, draft_vocab, ngram_table)
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
    from clover_jax.decoding.speculative import head_layer_copy_bytes

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
    return GenerationPlan(model=model, tokenizer=tokenizer, ids=ids, prompt=arr, prompt_lengths=lens,
                          max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, cache_size=cache_size,
                          mode=mode, head=head, drafter=drafter, memory=memory, mesh=mesh, auto_choice=auto_choice,
                          layers=layers, stream=stream)


def generate(model, prompts: Sequence[Any], *, tokenizer=None, max_new_tokens: int = 128, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, chat: bool = True, system: str | None = None,
             cache_size: int | None = None, mode: str = "ar", head=None, tree=None, draft_vocab=None,
             decode_text: bool = True, mesh=None, layers: str = "auto", ngram_table=None,
             stream=None) -> GenerationResult:
    """Generates for a batch of prompts.

    Args:
      model: a `Llama` or the `LoadedModel` returned by `load_model` (then its tokenizer is used).
      prompts: strings (chat template applied when `chat`), message lists, or token-id lists.
      mode: "ar" (plain autoregressive) or "speculative" (needs `head`, optionally `tree`).
      head: a draft head module, or where to load one: a registered name (`clover_jax.pretrained`, e.g.
        "smollm2-135m-instruct-clover2"), an exported head folder or a training run directory.
      tree: a tree name or JSON file; None: the registered head's default tree, else "clover2-26"; "auto":
        the tree a calibration of this head on this hardware found fastest (`clover_jax.calibrate`; runs one
        and saves it when none is saved), or plain autoregressive decoding when no tree pays.
      draft_vocab: token ids the drafts are drawn from (`clover_jax.heads.draft_vocab`); None: all, or, for
        a head given by name or path, the vocabulary it was trained on (if any).
      ngram_table: for trees named `...lookup-K-table`: an n-gram table (`clover_jax.decoding.ngram`) or its
        path; None: the one shipped beside a head given by name or path (`ngram_table.npz`), if any.
      mesh: decode on several devices: a `jax.sharding.Mesh` of `clover_jax.parallel.make_mesh`, or a string
        like "data=2,tp=4" (`parallel.parse_mesh`). The base model is tensor-parallel over `tp` (attention
        heads, MLP, vocabulary), rows split over `data`; the head's weights and both KV caches are sharded to
        match. The batch is padded to a multiple of the batch shards. Load the model onto the mesh
        (`load_model(..., mesh=mesh)`) to avoid a copy of the weights per call.
      layers: how the loop runs the base model's layers: "unrolled" (fastest for one-token steps; holds a
        second copy of the layer weights during the call), "scan" (no copy), or "auto" (measured choice per
        backend, dtype and free memory: `clover_jax.decoding.autoregressive.decode_layers`).
      stream: a callable `sink(row, token_ids)`, called while the loop runs with each prompt's new tokens in order
        (row = the prompt's index; the first token, then what every step accepts), or None. One device only;
        `stream_text` yields a single prompt's text this way.

    Every argument is checked before anything compiles (`prepare_generate`); a bad one raises an
    `InputError` naming it, its value and the limit.
    """
    plan = prepare_generate(model, prompts, tokenizer=tokenizer, max_new_tokens=max_new_tokens,
                            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, chat=chat, system=system,
                            cache_size=cache_size, mode=mode, head=head, tree=tree, draft_vocab=draft_vocab,
                            decode_text=decode_text, mesh=mesh, layers=layers, ngram_table=ngram_table,
                            stream=stream)
    return run_plan(plan, decode_text=decode_text)


def run_plan(plan: GenerationPlan, decode_text: bool = True) -> GenerationResult:
    """Runs a checked `GenerationPlan` (the jitted loop compiles on its first shapes)."""
    model, lens, tokenizer = plan.model, plan.prompt_lengths, plan.tokenizer
    key = jax.random.key(plan.seed)
    stream = plan.stream is not None
    with streaming_to(plan.stream):
        if plan.mode == "ar":
            t0 = time.perf_counter()
            out = ar_generate(model, plan.prompt, lens, max_new_tokens=plan.row_new_tokens,
                              cache_size=plan.cache_size, sampling=plan.sampling, key=key, mesh=plan.mesh,
                              layers=plan.layers, stream=stream)
            out = jax.block_until_ready(out)
            seconds = time.perf_counter() - t0
            stats = {}
        else:
            from clover_jax.decoding.speculative import spec_generate

            out, stats, seconds = spec_generate(model, plan.head, plan.prompt, lens,
                                                max_new_tokens=plan.row_new_tokens, cache_size=plan.cache_size,
                                                sampling=plan.sampling, key=key, drafter=plan.drafter,
                                                mesh=plan.mesh, stat_rows=len(plan.ids), layers=plan.layers,
                                                stream=stream)
    tokens = np.asarray(out.tokens)
    lengths = np.asarray(out.lengths)
    gen = [tokens[i, lens[i]: lengths[i]].tolist() for i in range(len(plan.ids))]
    texts = [tokenizer.decode(g, skip_special_tokens=True) for g in gen] if (decode_text and tokenizer) else None
    rows = len(plan.ids)
    if plan.auto_choice is not None:
        stats = {**stats, "tree": plan.auto_choice}
    return GenerationResult(token_ids=gen, texts=texts, prompt_lengths=lens[:rows].tolist(), steps=int(out.steps),
                            row_steps=np.asarray(out.row_steps)[:rows].tolist(), seconds=seconds, stats=stats)


def stream_text(model, prompt, *, tokenizer=None, **kwargs) -> Iterator[str]:
    """Generates for one prompt and yields its text piece by piece as the loop accepts tokens (`generate`'s
    other keyword arguments apply; `stream` and `decode_text` are set here). The generator's return value (the
    `value` of its `StopIteration`) is the `GenerationResult`. Every check runs before the first piece.

        for piece in clover_jax.stream_text(lm, "Tell me a story.", mode="speculative",
                                            head="smollm2-135m-instruct-clover2"):
            print(piece, end="", flush=True)

    The pieces joined are the result's text: each is the newly decodable end of the text so far (a token that
    ends inside a multi-byte character waits for the next one), decoded over the last few tokens only, so a long
    reply costs no more per piece than a short one. The loop runs in a thread of its own; a caller
    that stops iterating early leaves it running to its end (another streaming call waits for no one: it fails).
    """
    import queue
    import threading

    if "stream" in kwargs or "decode_text" in kwargs:
        raise InputError("stream_text: stream and decode_text are set by stream_text itself")
    if hasattr(model, "tokenizer") and hasattr(model, "model"):
        tokenizer = tokenizer or model.tokenizer
    if tokenizer is None:
        raise InputError("stream_text: text needs a tokenizer (pass a LoadedModel or tokenizer=...)")
    if isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], (numbers.Integral, dict)):
        raise InputError(f"stream_text: one prompt at a time (got {len(prompt)}); generate(..., stream=sink) "
                         f"streams a batch")
    pieces: queue.Queue = queue.Queue()
    done = object()
    plan = prepare_generate(model, [prompt], tokenizer=tokenizer, stream=lambda row, ids: pieces.put(ids), **kwargs)
    outcome: dict = {}

    def run():
        try:
            outcome["result"] = run_plan(plan)
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            outcome["error"] = e
        finally:
            pieces.put(done)

    thread = threading.Thread(target=run, name="clover_jax.stream_text", daemon=True)
    thread.start()
    ids: list[int] = []
    start = shown_to = 0  # ids[start:shown_to]: tokens already shown, decoded again only as context for spacing
    sent = ""
    while (item := pieces.get()) is not done:
        ids += item
        shown = tokenizer.decode(ids[start:shown_to], skip_special_tokens=True)
        text = tokenizer.decode(ids[start:], skip_special_tokens=True)
        if text.endswith("\ufffd") or len(text) <= len(shown) or not text.startswith(shown):
            continue  # a character still incomplete, or nothing new: wait for the next tokens
        yield text[len(shown):]
        sent += text[len(shown):]
        start, shown_to = shown_to, len(ids)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    result = outcome["result"]
    text = result.texts[0]
    if text.startswith(sent) and len(text) > len(sent):
        yield text[len(sent):]
    return result
