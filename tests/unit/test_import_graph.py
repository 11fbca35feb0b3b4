"""The package's modules import one way: no module imports another that imports it back
(directly or through others, function-level imports included), and no module imports a
private (underscore) name from another. Read from the sources with ast, so it checks
what the files say, not what happened to be imported first."""
import ast
from pathlib import Path

import megatron_fsdp_ext

PACKAGE = Path(megatron_fsdp_ext.__file__).resolve().parent
SOURCES = Path(__file__).resolve().parents[2] / "src" / "megatron_fsdp_ext"


def _package_dir() -> Path:
    # The checkout's sources when the tests run from one; else the installed package.
    return SOURCES if SOURCES.is_dir() else PACKAGE


def import_graph(root: Path):
    modules = {p.stem: p for p in root.glob("*.py")}
    edges = {m: set() for m in modules}
    private = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ImportFrom) or node.level != 1:
                continue
            if node.module is None:  # from . import a, b
                edges[name].update(a.name for a in node.names if a.name in modules)
                continue
            target = node.module.split(".")[0]
            if target not in modules:
                continue
            edges[name].add(target)
            private += [f"{name}.py imports {target}.{a.name} (line {node.lineno})" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    return edges, private


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


def test_only_the_state_writes_param_init():
    """A unit's ParamInit has one writer (FSDPState: construction and mark_loaded); the
    loaders call mark_loaded instead of assigning it."""
    writers = []
    for path in _package_dir().glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            writers += [f"{path.name}:{node.lineno}" for t in targets
                        if isinstance(t, ast.Attribute) and t.attr == "param_init"]
    assert writers and all(w.startswith("hooks.py:") for w in writers), writers
