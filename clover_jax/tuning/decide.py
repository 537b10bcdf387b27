"""What settles the tree of a speculative request that names none: `decide`, between checking a request and resolving
its draft (`clover_jax.api`).

    clover_jax.generate(lm, prompts, mode="speculative")              # what is fastest here (`tuning.choose`)
    clover_jax.generate(lm, prompts, mode="speculative", tree="auto")  # the head's calibration (`tuning.calibrate`)
"""

from __future__ import annotations

from clover_jax.generation.request import AUTO, Request
from clover_jax.tuning.calibrate import decide_auto
from clover_jax.tuning.choose import decide_fastest


def decide(request: Request) -> tuple[Request, tuple[str, ...], dict | None]:
    """(the request with its tree decided, notes, choice): `tree="auto"` by the head's calibration (`decide_auto`),
    no tree by what is fastest here (`decide_fastest`); a named tree or "default" as it is."""
    if request.tree_rule == AUTO:
        return decide_auto(request)
    return decide_fastest(request)


__all__ = ["decide"]
