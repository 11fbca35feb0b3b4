"""The package's modules import one way: no module imports another that imports it back
(directly or through others, function-level imports included), no module imports a
private (underscore) name from another, and the layers import downward only: the core
imports nothing from the layers above it. Read from the sources with ast, so it checks
what the files say, not what happened to be imported first."""
import ast
from pathlib import Path

import megatron_fsdp_ext

PACKAGE = Path(megatron_fsdp_ext.__file__).resolve().parent
SOURCES = Path(__file__).resolve().parents[2] / "src" / "megatron_fsdp_ext"

# What each layer (subpackage) may import besides itself and the package root's
# extension (_C, _build_info). The root __init__ (the public API) may import them all.
LAYERS_BELOW = {
    "core": set(),
    "checkpoint": {"core"},
    "parallel": {"core"},
    "precision": {"core"},
    "optim": {"core"},
    "tools": {"core", "checkpoint", "parallel", "precision", "optim"},
    "models": set(),
}


def _package_dir() -> Path:
    # The checkout's sources when the tests run from one; else the installed package.
    return SOURCES if SOURCES.is_dir() else PACKAGE


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] or ["__init__"]
    return ".".join(parts)


def import_graph(root: Path):
    """Edges between the package's modules (dotted names under the package: core.api,
    checkpoint.dcp; a subpackage's __init__ by the subpackage's name, the root's as
    __init__), and the private names imported across them."""
    paths = {_module_name(root, p): p for p in root.rglob("*.py")}
    edges = {m: set() for m in paths}
    private = []
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" and name != "__init__" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue
            base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
            stem = base + (node.module.split(".") if node.module else [])
            target = ".".join(stem)
            for a in node.names:
                submodule = ".".join(stem + [a.name])
                if submodule in paths:  # from ..core import api: the module core.api
                    edges[name].add(submodule)
                elif target in paths:  # a name defined in module (or package __init__) `target`
                    edges[name].add(target)
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        private.append(f"{path.relative_to(root)} imports {target}.{a.name} (line {node.lineno})")
    for name in edges:
        edges[name].discard(name)
    return edges, private


def layer_of(module: str) -> str:
    return module.split(".")[0]


def upward_imports(edges):
    """Imports that go from a layer to one not below it."""
    found = []
    for name, targets in edges.items():
        layer = layer_of(name)
        if layer not in LAYERS_BELOW:  # the root: the public API and the extension
            continue
        for target in sorted(targets):
            other = layer_of(target)
            if other != layer and other in LAYERS_BELOW and other not in LAYERS_BELOW[layer]:
                found.append(f"{name} imports {target} ({layer} may import only "
                             f"{sorted(LAYERS_BELOW[layer]) or 'itself'})")
    return found


def find_cycle(edges):
    """One import cycle as a list of modules, or None."""
    state, stack = {}, []

    def visit(u):
        state[u] = "open"
        stack.append(u)
        for v in sorted(edges[u]):
            if state.get(v) == "open":
                return stack[stack.index(v):] + [v]
            if v not in state:
                found = visit(v)
                if found:
                    return found
        stack.pop()
        state[u] = "done"
        return None

    for u in sorted(edges):
        if u not in state:
            found = visit(u)
            if found:
                return found
    return None


def test_package_imports_one_way():
    edges, _ = import_graph(_package_dir())
    assert len(edges) > 20, f"found only {sorted(edges)} under {_package_dir()}"
    assert {"core.api", "checkpoint.dcp", "parallel.layerwise"} <= set(edges), sorted(edges)
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_private_names_cross_modules():
    _, private = import_graph(_package_dir())
    assert not private, "private names imported across modules:\n" + "\n".join(private)


def test_the_checks_see_a_cycle_and_a_private_import(tmp_path):
    (tmp_path / "a.py").write_text("from .b import thing\n")
    (tmp_path / "b.py").write_text("def f():\n    from .a import _hidden\n")
    edges, private = import_graph(tmp_path)
    assert find_cycle(edges) in (["a", "b", "a"], ["b", "a", "b"])
    assert private == ["b.py imports a._hidden (line 2)"]


def test_layers_import_downward_only():
    edges, _ = import_graph(_package_dir())
    assert not set(LAYERS_BELOW) - {layer_of(m) for m in edges}, "a layer has no modules"
    found = upward_imports(edges)
    assert not found, "imports against the layering:\n" + "\n".join(found)


def test_the_layer_check_sees_an_upward_import(tmp_path):
    for layer in ("core", "checkpoint"):
        (tmp_path / layer).mkdir()
        (tmp_path / layer / "__init__.py").write_text("")
    (tmp_path / "checkpoint" / "dcp.py").write_text("from ..core import api\n")
    (tmp_path / "core" / "api.py").write_text("def f():\n    from ..checkpoint.dcp import save\n")
    edges, _ = import_graph(tmp_path)
    assert edges["checkpoint.dcp"] == {"core.api"} and edges["core.api"] == {"checkpoint.dcp"}
    assert upward_imports(edges) == ["core.api imports checkpoint.dcp (core may import only itself)"]


def test_only_the_state_writes_param_init():
    """A unit's ParamInit has one writer (FSDPState: construction and mark_loaded); the
    loaders call mark_loaded instead of assigning it."""
    writers = []
    for path in _package_dir().rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            writers += [f"{path.name}:{node.lineno}" for t in targets
                        if isinstance(t, ast.Attribute) and t.attr == "param_init"]
    assert writers and all(w.startswith("hooks.py:") for w in writers), writers


def test_public_namespace_is_the_api_and_its_modules():
    """`dir(megatron_fsdp_ext)` without underscores is `__all__` plus the package's own
    modules: nothing leaks from its imports (`torch`, `annotations`, `sys`) for a user's
    `from megatron_fsdp_ext import *` or tab completion to pick up."""
    import types

    leaked = []
    for name in dir(megatron_fsdp_ext):
        if name.startswith("_") or name in megatron_fsdp_ext.__all__:
            continue
        value = getattr(megatron_fsdp_ext, name)
        if isinstance(value, types.ModuleType) and value.__name__.startswith("megatron_fsdp_ext."):
            continue
        leaked.append(name)
    assert not leaked, f"names that are neither the API nor the package's modules: {leaked}"
    for name in megatron_fsdp_ext.__all__:
        assert hasattr(megatron_fsdp_ext, name), f"__all__ names {name!r}, which the package lacks"
