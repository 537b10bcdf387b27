"""The public generation calls: `generate`, `prepare_generate`, `stream_text` and `warmup` (`clover_jax.<name>`).

    result = clover_jax.generate(lm, ["Hello!"], mode="speculative")   # the tree fastest here (or plain decoding)
    plan = clover_jax.prepare_generate(lm, prompts, mode="speculative", tree="chain-4")   # checked, nothing compiled
    for piece in clover_jax.stream_text(lm, "Tell me a story.", mode="speculative"): print(piece, end="")
    clover_jax.warmup(lm, prompt_lengths=[40, 210], max_new_tokens=256, mode="speculative")

Each call takes the same request, checked once into a frozen `Request` (`clover_jax.generation.request.check_request`,
whose parameters these functions show), its open tree settled (`clover_jax.tuning.decide.decide`: what is fastest
here, or the head's calibration for `tree="auto"`), its draft resolved once (`clover_jax.generation.draft`: the head
folder read once, the tree parsed once) and its frozen `GenerationPlan` built (`clover_jax.generation.plan`), then
run (`clover_jax.generation.api`).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import numbers
import queue
import time
from typing import Any, Callable, Iterator, ParamSpec, TypeVar

from clover_jax.generation.api import GenerationResult, run_plan, stream_pieces
from clover_jax.generation.draft import resolve_draft
from clover_jax.generation.plan import GenerationPlan, build_plan
from clover_jax.generation.request import Request, check_request
from clover_jax.generation.warmup import warm_shapes, workload_lengths
from clover_jax.tuning.decide import decide
from clover_jax.validation import InputError, check_int

P = ParamSpec("P")
R = TypeVar("R")


def _signature(source: Callable[..., Any], fn: Callable[..., Any], *, drop: tuple[str, ...] = (),
               rename: dict[str, str] | None = None, add: tuple[inspect.Parameter, ...] = ()) -> inspect.Signature:
    """`source`'s signature less `drop`, with `fn`'s own positional parameters in place of `source`'s (`rename`
    maps the names), keyword parameters `add`ed before `source`'s keyword parameters, and `fn`'s return
    annotation."""
    own = inspect.signature(fn).parameters
    params = []
    for p in inspect.signature(source).parameters.values():
        if p.name in drop:
            continue
        name = (rename or {}).get(p.name, p.name)
        params.append(own[name] if p.kind is not p.KEYWORD_ONLY and name in own else p.replace(name=name))
    first_keyword = next(i for i, p in enumerate(params) if p.kind is p.KEYWORD_ONLY)
    params[first_keyword:first_keyword] = list(add)
    return inspect.Signature(params, return_annotation=inspect.signature(fn).return_annotation)


def _public(fn: Callable[..., R], signature: inspect.Signature) -> Callable[..., R]:
    """`fn` with `signature` for `help()` and editors, and a keyword argument that neither it nor `check_request`
    takes a `TypeError` that names the call and the closest parameter (not the internal function the options go
    on to; a request parameter the call sets itself is the call's own `InputError`)."""
    known = set(signature.parameters) | set(inspect.signature(check_request).parameters)

    @functools.wraps(fn)
    def call(*args, **options):
        for key in options:
            if key not in known:
                close = difflib.get_close_matches(key, list(signature.parameters), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"{fn.__name__}() got an unexpected keyword argument {key!r}{hint}")
        return fn(*args, **options)

    call.__signature__ = signature  # type: ignore[attr-defined]
    return call


def _parameters_of(source: Callable[P, Any]) -> Callable[[Callable[..., R]], Callable[P, R]]:
    """Gives a public call `source`'s parameters: `help()` shows them (`__signature__`), and editors too (the
    decorated function is typed with `source`'s parameter specification)."""

    def apply(fn: Callable[..., R]) -> Callable[P, R]:
        return _public(fn, _signature(source, fn))

    return apply


def _request_parameters(**changes) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Gives a public call `check_request`'s parameters with `changes` (see `_signature`), for `help()`."""

    def apply(fn: Callable[..., R]) -> Callable[..., R]:
        return _public(fn, _signature(check_request, fn, **changes))

    return apply


def _plan(request: Request) -> GenerationPlan:
    request, notes, choice = decide(request)
    return build_plan(request, resolve_draft(request), notes=notes, choice=choice)


@_parameters_of(check_request)
def prepare_generate(model, prompts, **options) -> GenerationPlan:
    """`generate`'s request checked, its tree decided, its draft resolved and its plan built, nothing compiled: a
    frozen `GenerationPlan` (`clover_jax.generation.api.run_plan` runs it). Parameters: as for `generate`."""
    return _plan(check_request(model, prompts, **options))


@_parameters_of(check_request)
def generate(model, prompts, **options) -> GenerationResult:
    """Generates for a batch of prompts.

    Args:
      model: a `Llama` or the `LoadedModel` returned by `load_model` (then its tokenizer is used).
      prompts: strings (chat template applied when `chat`), message lists, or token-id lists.
      tokenizer: for string and message prompts with a bare `Llama`.
      max_new_tokens, temperature, top_k, top_p, seed: the reply's length and sampling (temperature 0: greedy,
        where speculative decoding returns exactly plain decoding's tokens).
      chat, system: apply the chat template to string prompts, with this system prompt.
      cache_size: the KV cache's slots (None: sized to the request, `clover_jax.decoding.sizes`).
      mode: "ar" (plain autoregressive) or "speculative".
      head: a draft head module, or where to load one: a registered name (`clover_jax.pretrained`, e.g.
        "smollm2-135m-instruct-clover2"), an exported head folder, a published EAGLE / EAGLE-3 / Medusa folder,
        a hub id, or a training run directory (its latest Orbax checkpoint); None: the model's shipped head, or
        none for a prompt-lookup tree.
      tree: None: the head and tree fastest on this machine, dtype and batch size, or plain decoding where no tree
        pays (`clover_jax.tuning.choose`: measured on first use and kept; `stats["choice"]` says what was compared
        and predicted). "auto": the tree a calibration of this head on this hardware found fastest
        (`clover_jax.tuning.calibrate`; runs one and saves it when none is saved). "default": the head's
        registered default tree, else its type's. A name (`chain-4`, `clover2-26`, `dynamic-26`, `lookup-4`, a
        head's fitted `fit-5-411aab`), a JSON file, a tree policy or a list of paths ([[0], [0, 0], [1]]): that
        tree, nothing measured.
      draft_vocab: token ids the drafts are drawn from (`clover_jax.heads.draft_vocab`); None: the vocabulary the
        head was trained on (if its folder has one), else all.
      decode_text: decode the replies to text (`GenerationResult.texts`).
      check_free_memory: refuse a request whose estimated memory exceeds what the device has free.
      mesh: decode on several devices: a `jax.sharding.Mesh` of `clover_jax.parallel.make_mesh`, or a string
        like "data=2,tp=4". The base model is tensor-parallel over `tp`, rows split over `data`; the head and both
        KV caches are sharded to match. Load the model onto the mesh (`load_model(..., mesh=mesh)`) to avoid a
        copy of the weights per call.
      layers: how the loop runs the base model's layers: "unrolled", "scan", or "auto" (measured choice per
        backend, dtype and free memory: `clover_jax.decoding.autoregressive.decode_layers`).
      ngram_table: for trees named `...lookup-K-table`: an n-gram table (`clover_jax.decoding.ngram`) or its path;
        None: the one shipped beside the head, if any.
      stream: a callable `sink(row, token_ids)` called while the loop runs with each prompt's new tokens in order
        (one device only; `stream_text` yields a single prompt's text this way).
      prompt_bucket: pad every prompt to this many tokens, so a workload of prompts up to that length runs one
        compiled program per loop; None: each batch's own bucket.

    Every argument is checked before anything compiles; a bad one raises an `InputError` naming it, its value and
    the limit. Returns a `GenerationResult` (token ids, texts, steps, seconds, `stats`: acceptance, the tree, the
    choice and notes on what was taken that the request did not name).
    """
    return run_plan(_plan(check_request(model, prompts, **options)))


@_request_parameters(drop=("stream", "decode_text"), rename={"prompts": "prompt"})
def stream_text(model, prompt, **options) -> Iterator[str]:
    """Generates for one prompt and yields its text piece by piece as the loop accepts tokens (`generate`'s
    parameters, less `stream` and `decode_text`, which it sets). Every check runs before the first piece; the
    generator's return value (the `value` of its `StopIteration`) is the `GenerationResult`.

        for piece in clover_jax.stream_text(lm, "Tell me a story.", mode="speculative",
                                            head="smollm2-135m-instruct-clover2"):
            print(piece, end="", flush=True)
    """
    for key in ("stream", "decode_text"):
        if key in options:
            raise InputError(f"stream_text: {key} is set by stream_text itself")
    if hasattr(model, "tokenizer") and hasattr(model, "model"):
        options["tokenizer"] = options.get("tokenizer") or model.tokenizer
    if options.get("tokenizer") is None:
        raise InputError("stream_text: text needs a tokenizer (pass a LoadedModel or tokenizer=...)")
    if isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], (numbers.Integral, dict)):
        raise InputError(f"stream_text: one prompt at a time (got {len(prompt)}); generate(..., stream=sink) "
                         f"streams a batch")
    pieces: queue.Queue = queue.Queue()
    plan = _plan(check_request(model, [prompt], stream=lambda row, ids: pieces.put(ids), **options))
    return stream_pieces(plan, pieces)


_WARMUP = (inspect.Parameter("prompt_lengths", inspect.Parameter.KEYWORD_ONLY, default=None),
           inspect.Parameter("batch_size", inspect.Parameter.KEYWORD_ONLY, default=1, annotation="int"),
           inspect.Parameter("threads", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="int | None"))


@_request_parameters(drop=("stream", "decode_text", "check_free_memory"), add=_WARMUP)
def warmup(model, prompts=None, *, prompt_lengths=None, batch_size: int = 1, threads: int | None = None,
           **options) -> dict[str, Any]:
    """Compiles every decoding program `generate(model, batch, **options)` will run for these prompts (or
    `prompt_lengths`, token counts) taken `batch_size` at a time, on `threads` threads (None: one per core), the
    tree decided first as `generate` would (`clover_jax.generation.warmup`). Returns `programs` (the shapes and
    their seconds), `mode` and `tree` as resolved, `resolve_seconds` (the request's resolution, a tree choice
    included), `threads` and `seconds`."""
    t0 = time.perf_counter()
    for key in ("stream", "decode_text", "check_free_memory"):
        if key in options:
            raise InputError(f"warmup: {key} is set by warmup itself")
    text = {k: options.pop(k) for k in ("tokenizer", "chat", "system") if k in options}
    if hasattr(model, "tokenizer") and hasattr(model, "model"):
        text["tokenizer"] = text.get("tokenizer") or model.tokenizer
    lengths = workload_lengths(model, prompts, prompt_lengths, **text)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    batch = [[1] * lengths[0]] * min(batch_size, len(lengths))
    # the request resolved once, at the workload's batch size: the head, the tree (chosen or calibrated where none is
    # named), the draft vocabulary and n-gram table, then reused for every shape
    request = check_request(model, batch, chat=False, check_free_memory=False,
                            tokenizer=text.get("tokenizer"), **options)
    request, _, _ = decide(request)
    draft = resolve_draft(request)
    resolve_seconds = time.perf_counter() - t0
    report = warm_shapes(request, draft, lengths, batch_size=batch_size, threads=threads)
    return {**report, "resolve_seconds": round(resolve_seconds, 2), "seconds": round(time.perf_counter() - t0, 2)}


__all__ = ["generate", "prepare_generate", "stream_text", "warmup"]
