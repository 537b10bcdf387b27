"""The public generation calls: `generate`, `stream_text` and `prepare_generate` of `clover_jax`, which settle the tree
of a speculative request that names none before generating.

    clover_jax.generate(lm, prompts, mode="speculative")              # what is fastest here (`tuning.choose`)
    clover_jax.generate(lm, prompts, mode="speculative", tree="auto")  # the head's calibration (`tuning.calibrate`)

A request is checked (`clover_jax.generation.request`), its open tree decided here (`decide`), its draft resolved
and its plan built (`clover_jax.generation`), then run. A training run directory given as the head is read by the
training layer's `load_head_from_run`. Below this layer, `clover_jax.generation.api.generate` drafts named trees and
head defaults only, and measures nothing.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from clover_jax.generation import api, plan
from clover_jax.generation.request import AUTO, Request
from clover_jax.generation.warmup import warmup as warmup_with
from clover_jax.heads.bundle import RunLoader
from clover_jax.training.checkpoint import load_head_from_run
from clover_jax.tuning.calibrate import decide_auto
from clover_jax.tuning.choose import decide_fastest


def decide(request: Request, *, run_loader: RunLoader | None = None
           ) -> tuple[Request, tuple[str, ...], dict | None]:
    """The request with its tree decided: `tree="auto"` by the head's calibration (`decide_auto`), no tree by what
    is fastest here (`decide_fastest`); a named tree or "default" as it is."""
    if request.tree_rule == AUTO:
        return decide_auto(request, run_loader=run_loader)
    return decide_fastest(request, run_loader=run_loader)


def prepare_generate(model, prompts: Sequence[Any], **kwargs) -> plan.GenerationPlan:
    """`generate`'s arguments checked, the tree decided, the draft resolved and the plan built; nothing compiled
    (`clover_jax.generation.plan.prepare_generate` with this layer's `decide`)."""
    return plan.prepare_generate(model, prompts, decide=decide, run_loader=load_head_from_run, **kwargs)


def generate(model, prompts: Sequence[Any], **kwargs) -> api.GenerationResult:
    """Generates for a batch of prompts: `clover_jax.generation.api.generate`'s arguments, and for a speculative
    request:

      tree: None: the head and tree fastest on this machine, dtype and batch size, or plain decoding where no tree
        pays (`clover_jax.tuning.choose`: measured on first use, then reused, measured again by the next request
        where it was not clear; the choice is in `stats["choice"]`: head, tree, predicted_speedup, compared, rounds,
        measurements, settled, programs_reused, measured_s, and in `stats["notes"]`): the head's default tree
        against plain decoding (with no head named, the default head's, and above batch 1 the head-less
        `lookup-2-table` too), or what `python -m clover_jax.cli.calibrate --quick` chose among every shipped head
        and head-less prompt-lookup chain. "auto": the tree a calibration of this head on this hardware found fastest
        (`clover_jax.tuning.calibrate`; runs one and saves it when none is saved), or plain decoding when no tree
        pays. "default", a name, a JSON file, a policy or a list of paths: that tree, nothing measured.
      head: also a training run directory (its latest Orbax checkpoint).
    """
    decode_text = kwargs.get("decode_text", True)
    return api.run_plan(prepare_generate(model, prompts, **kwargs), decode_text=decode_text)


def warmup(model, prompts=None, **kwargs) -> dict[str, Any]:
    """Compiles every decoding program `generate(model, ...)` will run for these prompts (or `prompt_lengths=`),
    the tree decided first as `generate` would (`clover_jax.generation.warmup.warmup`); returns the programs built
    and the seconds it took."""
    return warmup_with(prepare_generate, model, prompts, **kwargs)


def stream_text(model, prompt, *, tokenizer=None, **kwargs) -> Iterator[str]:
    """Generates for one prompt and yields its text piece by piece as the loop accepts tokens, the tree decided as
    for `generate` (`clover_jax.generation.api.stream_with`)."""
    return api.stream_with(prepare_generate, model, prompt, tokenizer=tokenizer, **kwargs)


__all__ = ["decide", "generate", "prepare_generate", "stream_text", "warmup"]
