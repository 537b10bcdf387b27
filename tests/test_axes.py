"""The axis alphabet is declared once (`clover_jax.axes`) and every shape comment and einsum string of the package
uses only its letters."""

import re
from pathlib import Path

import clover_jax
from clover_jax.axes import AXES

PACKAGE = Path(clover_jax.__file__).parent
SHAPE_COMMENT = re.compile(r"#.*?\[([^\[\]]+)\]")  # `# ... [B, T, D] ...`
EINSUM = re.compile(r"(?:einsum|_dot)\(\s*\"([^\"]+)\"")  # jnp.einsum("BTD,DF->BTF", ...) and llama's _dot
AXIS_LIKE = re.compile(r"^(?:[A-Z]|[A-Z][a-z]{1,3}|n|k)$")  # a letter, or Dmax / Cmax / Lb


def _sources():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 40  # the scan sees the package
    return [(f.relative_to(PACKAGE.parent), f.read_text()) for f in files]


def test_shape_comments_and_einsums_use_the_declared_letters():
    undeclared = []
    for path, text in _sources():
        for i, line in enumerate(text.splitlines(), 1):
            for m in SHAPE_COMMENT.finditer(line):
                for part in re.split(r"[,+*/()\s]+", m.group(1)):
                    if AXIS_LIKE.match(part) and part not in AXES:
                        undeclared.append(f"{path}:{i}: {part!r} in [{m.group(1)}]")
            for m in EINSUM.finditer(line):
                for ch in re.sub(r"\.\.\.|,|->", "", m.group(1)):
                    if ch not in AXES:
                        undeclared.append(f"{path}:{i}: {ch!r} in einsum {m.group(1)!r}")
    assert not undeclared, "axes not in clover_jax.axes.AXES:\n" + "\n".join(undeclared)


def test_the_alphabet_is_declared_once():
    """No module keeps its own 'Axis alphabet: ...' list (they drift apart: N meant query heads in one file and the
    draft vocabulary in another); they refer to `clover_jax.axes`."""
    own = [str(p) for p, text in _sources() if re.search(r"axis alphabet\s*:", text, re.IGNORECASE)
           and p.name != "axes.py"]
    assert not own, own
    assert len(set(AXES)) == len(AXES) and all(AXES.values())


def test_the_checks_catch_an_undeclared_letter():
    """The patterns above do find axes: a comment and an einsum with a letter that is not declared."""
    assert "X" not in AXES and "Y" not in AXES
    line = 'y = jnp.einsum("BXD,DF->BXF", a, w)  # [B, X, F]'
    assert [p for m in SHAPE_COMMENT.finditer(line) for p in re.split(r"[,+*/()\s]+", m.group(1))
            if AXIS_LIKE.match(p) and p not in AXES] == ["X"]
    letters = [c for m in EINSUM.finditer(line) for c in re.sub(r"\.\.\.|,|->", "", m.group(1))]
    assert [c for c in letters if c not in AXES] == ["X", "X"]
