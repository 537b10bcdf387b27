"""Generate with a Llama-family model, plainly or with speculative decoding, and report speed: `python infer.py
--mode speculative --prompt "..."`. The command line is `clover_jax.cli.infer` (also installed as `clover-infer`)."""

import sys

from clover_jax.cli.infer import main, parse_args  # noqa: F401 (parse_args: the flags, for tests and scripts)

if __name__ == "__main__":
    sys.exit(main())
