"""The package's layers import downwards only: the model and the decoding loops never import the API, the
evaluation harness or the calibration (anywhere, function-local imports included), so `clover_jax.api` and
`clover_jax.decoding.speculative` do not import each other; the sizes both plan with live below both. The loop
takes a drafter and never imports a head: the head registry (`clover_jax.heads.registry.drafter_for`) is what
turns a head type and a tree into a drafter."""

import ast
from pathlib import Path

import clover_jax
from clover_jax import api
from clover_jax.decoding import sizes

PACKAGE = Path(clover_jax.__file__).parent
LOWER = ("models", "decoding")  # the model and the decoding loops
UPPER = ("clover_jax.api", "clover_jax.evaluation", "clover_jax.calibrate", "clover_jax.cli")


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def test_models_and_decoding_never_import_the_layers_above():
    files = [f for layer in LOWER for f in sorted((PACKAGE / layer).glob("*.py"))]
    assert len(files) > 10
    upward = [f"{f.relative_to(PACKAGE.parent)}:{line}: {name}" for f in files for line, name in _imported_modules(f)
              if any(name == u or name.startswith(u + ".") for u in UPPER)]
    assert not upward, "imports from a layer above:\n" + "\n".join(upward)


def test_models_and_decoding_never_import_a_head():
    files = [f for layer in LOWER for f in sorted((PACKAGE / layer).glob("*.py"))]
    found = [f"{f.relative_to(PACKAGE.parent)}:{line}: {name}" for f in files for line, name in _imported_modules(f)
             if name == "clover_jax.heads" or name.startswith("clover_jax.heads.")]
    assert not found, "imports of the heads from the model or the loop:\n" + "\n".join(found)


def test_the_scan_sees_a_function_local_import(tmp_path):
    """The scan also finds imports inside functions (the kind that hid the old api <-> speculative cycle)."""
    f = tmp_path / "m.py"
    f.write_text("import numpy\n\n\ndef f():\n    from clover_jax import api\n    return api\n")
    assert _imported_modules(f) == [(1, "numpy"), (5, "clover_jax"), (5, "clover_jax.api")]


def test_the_api_still_offers_the_sizes():
    """`clover_jax.api.bucket_length` and friends are the sizes module's functions (re-exported, not copies)."""
    for name in ("bucket_length", "round_up", "plan_cache", "check_context"):
        assert getattr(api, name) is getattr(sizes, name)
    assert api.PromptError is clover_jax.validation.PromptError
