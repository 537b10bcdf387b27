"""Runs that use generation to tune it: the choice of head and tree when a request names none, the calibration of
`tree="auto"`, the evaluation harness and the exactness audit."""

from clover_jax.tuning import calibrate, choose  # noqa: F401 (install what generate() calls for tree=None / "auto")
