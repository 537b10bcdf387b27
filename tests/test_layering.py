"""The package's import graph: layers import downwards only, no module imports itself back through others, and
the package's own modules are imported at the top of each file, where a reader sees them.

Layers, lowest first (a module may import its own layer and the ones below):

  base        clover_jax.validation, .axes, .sections       input checks and errors, the axis alphabet, configs
  models      clover_jax.models, clover_jax.parallel,       the base model, meshes, weight files and assets,
              clover_jax.io, clover_jax.pretrained,         compiling for TPU slices
              clover_jax.tpu
  decoding    clover_jax.decoding                           trees, drafter contract, verification, the loops
  heads       clover_jax.heads                              one package per draft-head type + the registry
  training    clover_jax.training                           configs, data, losses' driver, trainer, checkpoints
  generation  clover_jax.generation                         the user API: a request resolved into a plan, run
  tuning      clover_jax.tuning                             calibration runs, evaluation harness
  cli         clover_jax.cli, clover_jax (the package)      command-line mains; the package's public names
"""

import ast
import functools
import sys
from pathlib import Path

import clover_jax

PACKAGE = Path(clover_jax.__file__).parent
LAYERS = (
    ("base", ("clover_jax.validation", "clover_jax.axes", "clover_jax.sections")),
    ("models", ("clover_jax.models", "clover_jax.parallel", "clover_jax.io", "clover_jax.pretrained",
                "clover_jax.compile_cache", "clover_jax.tpu")),
    ("decoding", ("clover_jax.decoding",)),
    ("heads", ("clover_jax.heads",)),
    ("training", ("clover_jax.training",)),
    ("generation", ("clover_jax.generation",)),
    ("tuning", ("clover_jax.tuning",)),
    ("cli", ("clover_jax.cli", "clover_jax")),
)
# third-party modules a function may import where it needs them (heavy or optional), each with a comment there
OPTIONAL = ("torch", "transformers", "accelerate", "matplotlib", "tensorboardX", "datasets")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=None)
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(name: str) -> int:
    best = (-1, -1)  # (length of the matching prefix, layer index)
    for i, (_, prefixes) in enumerate(LAYERS):
        for pre in prefixes:
            if (name == pre or name.startswith(pre + ".")) and len(pre) > best[0]:
                best = (len(pre), i)
    assert best[1] >= 0, f"{name} belongs to no layer: add it to LAYERS"
    return best[1]


def imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported module, inside a function) for every import statement of a file: `from a import b` counts
    as importing `a.b` where that is a module of the package, else `a`."""
    tree = ast.parse(path.read_text())
    in_function = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function |= {id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, id(node) in in_function) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            local = id(node) in in_function
            known = modules()
            for a in node.names:
                out.append((node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in known else base, local))
    return out


def internal_edges() -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for _, target, _ in imports(path):
            if target in mods and target != m:
                edges[m].add(target)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (found := visit(t)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_every_module_has_a_layer_and_the_graph_is_not_trivial():
    mods = modules()
    assert len(mods) > 60
    for m in mods:
        layer_of(m)
    assert sum(len(v) for v in internal_edges().values()) > 150


def test_no_import_cycle():
    cycle = find_cycle(internal_edges())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_layers_import_downwards_only():
    upward = []
    for m, path in modules().items():
        for line, target, _ in imports(path):
            if target.startswith("clover_jax") and target in modules() and layer_of(target) > layer_of(m):
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {LAYERS[layer_of(m)][0]} imports "
                              f"{target} ({LAYERS[layer_of(target)][0]})")
    assert not upward, "imports from a layer above:\n" + "\n".join(sorted(set(upward)))


def test_the_package_is_imported_at_the_top_of_each_file():
    hidden = [f"{p.relative_to(PACKAGE.parent)}:{line}: {target}" for m, p in modules().items()
              for line, target, local in imports(p) if local and target.split(".")[0] == "clover_jax"]
    assert not hidden, "function-local imports of the package's own modules:\n" + "\n".join(sorted(set(hidden)))


def test_function_local_imports_are_optional_dependencies_with_a_reason():
    bad = []
    for m, p in modules().items():
        lines = p.read_text().splitlines()
        for line, target, local in imports(p):
            if not local or target.split(".")[0] == "clover_jax":
                continue
            top = target.split(".")[0]
            reason = "#" in lines[line - 1] or lines[line - 2].strip().startswith("#")
            if top not in OPTIONAL or not reason:
                bad.append(f"{p.relative_to(PACKAGE.parent)}:{line}: {target}")
    assert not bad, ("function-local imports that are not an optional heavy dependency with a comment saying "
                     "why:\n" + "\n".join(sorted(set(bad))))


def test_the_loop_never_imports_a_head():
    for m, p in modules().items():
        if layer_of(m) <= layer_of("clover_jax.decoding"):
            heads = [t for _, t, _ in imports(p) if t.startswith("clover_jax.heads")]
            assert not heads, f"{m} imports {heads}"


def test_the_scan_sees_function_local_and_relative_imports(tmp_path, monkeypatch):
    """The scan finds imports inside functions and resolves relative ones (the kinds that hide a cycle)."""
    pkg = tmp_path / "clover_jax" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "clover_jax" / "__init__.py").write_text("")
    f = pkg / "m.py"
    f.write_text("import numpy\nfrom . import other\n\n\ndef f():\n    from clover_jax import api\n    return api\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "clover_jax")
    (pkg / "other.py").write_text("")
    (tmp_path / "clover_jax" / "api.py").write_text("")
    modules.cache_clear()
    try:
        got = imports(f)
    finally:
        monkeypatch.undo()
        modules.cache_clear()
    assert (1, "numpy", False) in got and (2, "clover_jax.sub.other", False) in got
    assert (6, "clover_jax.api", True) in got


def test_a_planted_cycle_is_found():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# module-level calls that add to a registry another module declares for that purpose: a head package's entry in the
# head registry (its parameters' sharding rules arrive with it)
DECLARED_REGISTRIES = {"registry.register"}
INSTALLING = ("set_", "install", "register", "add_", "patch")


def installs_at_import(path: Path) -> list[str]:
    """Module-level statements of a file that put behaviour into another module: an assignment to an attribute
    (or item) of an imported name, or a call of an imported function named like an installer (`set_*`,
    `install*`, `register*`, `add_*`, `patch*`), outside `DECLARED_REGISTRIES`."""
    tree = ast.parse(path.read_text())
    imported = {(a.asname or a.name).split(".")[0] for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names}

    def root(node):
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    out = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        out += [f"{node.lineno}: {ast.unparse(t)} = ..." for t in targets
                if isinstance(t, (ast.Attribute, ast.Subscript)) and root(t) in imported]
        value = node.value if isinstance(node, (ast.Expr, ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Call) and root(value.func) in imported:
            name = ast.unparse(value.func)
            if name.rsplit(".", 1)[-1].startswith(INSTALLING) and name not in DECLARED_REGISTRIES:
                out.append(f"{node.lineno}: {name}(...)")
    return out


def test_nothing_at_import_installs_behaviour_into_another_module():
    found = [f"{p.relative_to(PACKAGE.parent)}:{line}" for m, p in modules().items() for line in installs_at_import(p)]
    assert not found, "module-level statements installing behaviour elsewhere:\n" + "\n".join(found)


def test_the_install_scan_sees_a_callback_installed_at_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from clover_jax.generation import plan\nfrom clover_jax.generation.plan import set_auto_choice\n"
                 "def choose():\n    pass\nset_auto_choice(choose)\nplan._AUTO = choose\n"
                 "from clover_jax.heads import registry\nT = registry.register(object())\n")
    assert installs_at_import(f) == ["5: set_auto_choice(...)", "6: plan._AUTO = ..."]
