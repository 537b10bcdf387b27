"""How the command-line tools report errors: user errors as one line, internal errors with a traceback.

    def main(argv=None) -> int:
        return run_cli(_main, argv)

A user error (bad argument, missing or corrupt file, bad config, incompatible checkpoint, too little memory:
`clover_jax.validation.InputError` and the error classes of the modules listed in `_USER_ERRORS`, plus
`OSError`s such as a missing file or a full disk) prints `error: <message>` on stderr and exits with status 2.
Anything else is a bug and propagates with its traceback. `--debug` (every tool takes it) or `CLOVER_DEBUG=1`
prints the traceback of user errors too.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Callable, Sequence

from clover_jax.compile_cache import COMPILE_CACHE_ENV, enable_compile_cache  # noqa: F401 (names of this module)
from clover_jax.validation import InputError

# (module, class) of user-facing error types that are not InputErrors; a module that was never imported
# cannot have raised its error, so none is imported here
_USER_ERRORS = (
    ("clover_jax.training.checkpoint", "CheckpointError"),
    ("clover_jax.training.sources", "DataError"),
    ("clover_jax.parallel", "MeshError"),
    ("clover_jax.models.config", "ConfigError"),
    ("clover_jax.models.cache", "CacheOverflowError"),
    ("clover_jax.decoding.tree", "TreeSpecError"),
    ("clover_jax.io.export", "ExportError"),
    ("clover_jax.validation", "PromptError"),
)


def user_error_types() -> tuple[type[BaseException], ...]:
    out: list[type[BaseException]] = [InputError, OSError]
    for module, name in _USER_ERRORS:
        mod = sys.modules.get(module)
        if mod is not None and isinstance(getattr(mod, name, None), type):
            out.append(getattr(mod, name))
    return tuple(out)


def debug_requested(argv: Sequence[str] | None = None) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    return "--debug" in argv or os.environ.get("CLOVER_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def add_debug_argument(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--debug", action="store_true",
                        help="show the Python traceback of errors in your input too (also: CLOVER_DEBUG=1)")
    return parser


def run_cli(main: Callable[[list[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Runs `main(argv)` with the persistent compilation cache on (`clover_jax.compile_cache`: `import clover_jax`
    turned it on already; this call changes nothing then); a user error prints `error: ...` and returns 2 (see the
    module docstring)."""
    enable_compile_cache()
    try:
        return main(None if argv is None else list(argv))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - classified below, re-raised when not a user error
        if not isinstance(e, user_error_types()):
            raise
        if debug_requested(argv):
            traceback.print_exc()
        print(f"error: {user_message(e)}", file=sys.stderr)
        return 2


def user_message(e: BaseException) -> str:
    """The message of a user error; an OSError raised by the system ('[Errno 13] ...') is shown as
    '<file>: <reason>'."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return str(e)


__all__ = ["add_debug_argument", "debug_requested", "run_cli", "user_error_types", "user_message"]
