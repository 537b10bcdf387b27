"""Runs that use generation to tune it: the choice of head and tree when a request names none (`choose`), the
calibration of `tree="auto"` (`calibrate`), the public generation calls that apply them (`fastest`), the evaluation
harness and the exactness audit."""
