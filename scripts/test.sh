#!/usr/bin/env bash
# The test command: sets up .venv (pinned deps, CPU torch, the PyPI model and data), then runs the suite.
#   bash scripts/test.sh                    the whole suite (what CI runs)
#   bash scripts/test.sh --fast             the fast tier: every module's unit tests, none marked slow or multihost
#   bash scripts/test.sh [--fast] tests/x   those paths only, in one process
# Other arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/env.sh
export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=8}"
# the CLI tools turn on a persistent compilation cache in ~/.cache; the suite does not write there
export CLOVER_JAX_COMPILE_CACHE="${CLOVER_JAX_COMPILE_CACHE:-off}"
# Instead, one run of the suite shares JAX's persistent compilation cache in a folder made for it and removed after
# it: a program that several test modules (or the CLI tests' subprocesses) compile is compiled once per run.
if [ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]; then
  JAX_COMPILATION_CACHE_DIR="$(mktemp -d -t clover_jax_suite_xla.XXXXXX)"
  export JAX_COMPILATION_CACHE_DIR
  trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
fi
# --fast: the markers in pyproject.toml say why a test is left out of the fast tier
ARGS=()
for arg in "$@"; do
  if [ "$arg" = --fast ]; then ARGS+=(-m "not slow and not multihost"); else ARGS+=("$arg"); fi
done
set -- ${ARGS[@]+"${ARGS[@]}"}
# test paths given (bash scripts/test.sh tests/heads): run those; otherwise the whole suite
for arg in "$@"; do
  case "$arg" in tests|tests/*) python -m pytest -q "$@"; exit $? ;; esac
done
# The whole suite runs on two worker processes (pytest-xdist), each test file on one worker so a module's fixtures
# (the loaded model, the shipped head) are made once (--dist worksteal, which splits files, measured slower).
# PYTEST_WORKERS=0 runs it in one process.
WORKERS="${PYTEST_WORKERS:-2}"
if [ "$WORKERS" = 0 ]; then python -m pytest tests -q "$@"; else
  python -m pytest tests -q -n "$WORKERS" --dist loadfile "$@"; fi
