"""A checked request built into a `GenerationPlan`: the prompt bucket and the cache sized, the memory checked, the
decoding loop built, before anything compiles.

    request = check_request(model, prompts, ...)          # clover_jax.generation.request: every argument checked
    draft = resolve_draft(request)                        # clover_jax.generation.draft: head and tree, read once
    plan = build_plan(request, draft)                     # here: sizes, memory, the loop
    result = run_plan(plan)                               # clover_jax.generation.api

`plan_request` is the middle two for a request whose tree is named or the head's default; the public
`clover_jax.prepare_generate` (`clover_jax.api`) puts the choice of a tree (`clover_jax.tuning`) between the first two.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import numpy as np
from flax import nnx

from clover_jax import parallel
from clover_jax.decoding.autoregressive import AutoregressiveLoop, decode_layers, layer_copy_bytes
from clover_jax.decoding.memory import check_memory, check_mesh_memory, estimate_generate_memory, split_over_mesh
from clover_jax.decoding.sampling import SamplingParams
from clover_jax.decoding.sizes import bucket_length, cache_for_bucket, check_context, pad_prompts, plan_cache
from clover_jax.decoding.speculative import SpeculativeLoop, head_layer_copy_bytes
from clover_jax.generation.draft import Draft, resolve_draft
from clover_jax.generation.request import Request
from clover_jax.validation import PromptError


@dataclasses.dataclass(frozen=True, eq=False)
class GenerationPlan:
    """Everything `generate` checked and resolved before compiling (see the module docstring): the request's rows
    padded, the cache sized, the memory estimated, the loop built, and the resolved `Draft` (None: plain decoding).
    `mode` follows from the draft: "speculative" with one, "ar" without."""

    model: Any  # the Llama
    tokenizer: Any
    ids: tuple[tuple[int, ...], ...]  # the prompts' token ids (the rows of `prompt` past these pad the batch)
    prompt: np.ndarray  # [B, T] right-padded to the length bucket
    prompt_lengths: np.ndarray  # [B]
    max_new_tokens: int
    sampling: SamplingParams
    seed: int
    cache_size: int
    loop: Any  # the decoding loop (`AutoregressiveLoop` or `SpeculativeLoop`), built once for this plan
    layers: str  # how the decoding loop runs the base model's layers ("unrolled" or "scan")
    draft: Draft | None = None  # the head, tree, drafter, draft vocabulary and n-gram table; None: plain decoding
    memory: Mapping[str, int] = dataclasses.field(default_factory=dict)  # estimated bytes per part (per device)
    mesh: Any = None  # jax.sharding.Mesh the loop runs on (None: one device)
    choice: Mapping[str, Any] | None = None  # how the tree was chosen where the request named none
    notes: tuple[str, ...] = ()  # what was chosen that the request did not name
    stream: Any = None  # sink(row, token_ids) called as each row's tokens are accepted, or None
    decode_text: bool = True  # the replies decoded to text

    @property
    def mode(self) -> str:
        return "ar" if self.draft is None else "speculative"

    @property
    def head(self):
        """The draft head module (None: plain decoding)."""
        return self.draft.head if self.draft is not None else None

    @property
    def drafter(self):
        return self.draft.drafter if self.draft is not None else None

    @property
    def tree(self):
        """The tree policy drafted (None: plain decoding)."""
        return self.draft.policy if self.draft is not None else None

    @property
    def draft_vocab(self):
        """`[V']` token ids drafts are drawn from (None: all)."""
        return self.draft.draft_vocab if self.draft is not None else None

    @property
    def ngram_table(self):
        return self.draft.ngram_table if self.draft is not None else None

    @property
    def row_new_tokens(self) -> np.ndarray:
        """`[B]` new-token budget per row: `max_new_tokens` for the prompts, 1 for the rows that only pad the
        batch to a multiple of the mesh's batch shards (they stop after the prefill)."""
        out = np.ones(len(self.prompt_lengths), np.int32)
        out[: len(self.ids)] = self.max_new_tokens
        return out


def prompt_bucket(prompt_lengths: np.ndarray, cache_size: int, fixed: int | None = None) -> int:
    """The prompt's padded length: its bucket (`bucket_length`; `fixed`, where the request fixes one), or the cache
    size where the bucket would not fit in an asked-for cache that holds the request (the prefill writes the whole
    padded prompt into the cache)."""
    return min(fixed or bucket_length(int(np.max(prompt_lengths))), int(cache_size))


def build_plan(request: Request, draft: Draft | None, *, notes: tuple[str, ...] = (),
               choice: Mapping[str, Any] | None = None) -> GenerationPlan:
    """The plan of a checked request and its resolved draft (None: plain decoding): the context and cache checked
    (prompt + new tokens + the draft tree's slots), the cache sized, the estimated memory within what the device
    has free (`request.check_free_memory`), the decoding loop built. Nothing compiles."""
    model, mesh = request.model, request.mesh
    config = model.config
    ids = [list(row) for row in request.ids]
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    rows = ids + [ids[0]] * (request.batch_size - len(ids))  # on a mesh: copies of prompt 0 fill the batch shards
    lens = np.array([len(r) for r in rows], np.int32)  # [B]
    drafter = draft.drafter if draft is not None else None
    head = draft.head if draft is not None else None
    nodes = drafter.num_nodes if drafter is not None else 0
    check_context(lens, request.max_new_tokens, getattr(config, "max_position_embeddings", None),
                  drafter.max_depth if drafter is not None else 0)
    cache_size = request.cache_size
    if request.prompt_bucket is not None:  # one program for every prompt up to the bucket
        row = int(lens.argmax())
        if lens[row] > request.prompt_bucket:
            raise PromptError(f"prompt_bucket: prompt {row} has {int(lens[row])} tokens, more than "
                              f"prompt_bucket={request.prompt_bucket}")
        if cache_size is None:
            cache_size = cache_for_bucket(request.prompt_bucket, request.max_new_tokens, nodes)
    cache_size = plan_cache(lens, request.max_new_tokens, nodes, cache_size, None)
    arr, lens = pad_prompts(rows, pad_id, prompt_bucket(lens, cache_size, request.prompt_bucket))  # [B, T], [B]
    memory = estimate_generate_memory(
        config, batch=len(lens), cache_size=cache_size, prompt_len=arr.shape[1],
        dtype_bytes=np.dtype(model.dtype).itemsize, tree_nodes=nodes,
        head_layers=getattr(getattr(head, "cfg", None), "num_aug_layers", 0),
        draft_rows=len(draft.draft_vocab) if draft is not None and draft.draft_vocab is not None
        else config.vocab_size)
    layers = decode_layers(request.layers, mesh, tokens_per_step=max(nodes, 1), model=model)
    layer_copy = layer_copy_bytes(model, layers, mesh)  # 0 where the loop reads slices of the stacked weights
    if layer_copy:
        memory["per-layer copy of the layer weights"] = layer_copy
    head_copy = head_layer_copy_bytes(drafter, head, mesh)
    if head_copy:
        memory["per-layer copy of the draft head's layers"] = head_copy
    what = (f"generate(batch={len(ids)} prompts, cache_size={cache_size}, "
            f"mode={'speculative' if drafter is not None else 'ar'!r})")
    if mesh is not None:
        memory = split_over_mesh(memory, config, dict(mesh.shape))
        if request.check_free_memory:
            states = [nnx.state(model)] + ([nnx.state(head)] if head is not None else [])
            per_device = [(parallel.bytes_per_device(st, mesh), parallel.is_placed(st, mesh)) for st in states]
            check_mesh_memory(memory, weights_bytes=sum(n for n, _ in per_device),
                              weights_to_place=sum(n for n, placed in per_device if not placed),
                              what=f"{what} on mesh {dict(mesh.shape)}", devices=mesh.devices.flat)
    elif request.check_free_memory:
        weights = sum(int(x.nbytes) for x in jax.tree.leaves(nnx.state(model)))
        check_memory(memory, weights_bytes=weights, what=what)
    greedy, stream = request.sampling.greedy, request.stream is not None
    if drafter is None:
        loop = AutoregressiveLoop.build(model, cache_size=cache_size, greedy=greedy, mesh=mesh, layers=layers,
                                        stream=stream)
    else:
        loop = SpeculativeLoop.build(model, drafter, cache_size=cache_size, greedy=greedy, mesh=mesh, layers=layers,
                                     stream=stream)
    return GenerationPlan(
        model=model, tokenizer=request.tokenizer, ids=request.ids, prompt=arr, prompt_lengths=lens,
        max_new_tokens=request.max_new_tokens, sampling=request.sampling, seed=request.seed, cache_size=cache_size,
        loop=loop, layers=layers, draft=draft, memory=memory, mesh=mesh, choice=choice, stream=request.stream,
        decode_text=request.decode_text,
        notes=tuple(notes) + (draft.notes if draft is not None else ()))


def plan_request(request: Request, *, notes: tuple[str, ...] = (), choice: Mapping[str, Any] | None = None
                 ) -> GenerationPlan:
    """The plan of a checked request whose tree is named or the head's default: its draft resolved
    (`resolve_draft`: the head opened once, the tree parsed once) and the plan built (`build_plan`); nothing
    compiled. `notes` and `choice`: how the layer above settled what the request left open."""
    return build_plan(request, resolve_draft(request), notes=notes, choice=choice)


__all__ = ["GenerationPlan", "SamplingParams", "build_plan", "plan_request", "prompt_bucket"]
