"""Runs that use generation to tune it: calibration of `tree="auto"` and the evaluation harness."""

from clover_jax.tuning import calibrate  # noqa: F401 (installs the runner of generate(tree="auto"))
