"""The layer rules of docs/architecture.md, read from the source: the runtime's modules import each other
without a circle (every import counts, also one inside a function)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _imports(path: pathlib.Path, package: str) -> set:
    """The modules of ``package`` that ``path`` imports, anywhere in the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package):
            rest = node.module[len(package):].lstrip(".")
            if rest:
                out.add(rest.split(".")[0])
            else:       # from autoshard.runtime import training
                out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name[len(package) + 1:].split(".")[0] for a in node.names if a.name.startswith(package + "."))
    return out


def test_no_import_circle_in_the_runtime():
    folder = ROOT / "autoshard" / "runtime"
    graph = {p.stem: _imports(p, "autoshard.runtime") - {p.stem} for p in folder.glob("*.py") if p.stem != "__init__"}
    graph = {m: {d for d in deps if d in graph} for m, deps in graph.items()}
    state = {}

    def visit(m, path):
        if state.get(m) == "done":
            return
        assert state.get(m) != "active", f"import circle in autoshard/runtime: {' -> '.join(path + [m])}"
        state[m] = "active"
        for d in sorted(graph[m]):
            visit(d, path + [m])
        state[m] = "done"
    for m in sorted(graph):
        visit(m, [])


def test_the_compiler_never_imports_the_runtime():
    """``ir/``, ``passes/`` and ``kernels/`` hold data and the passes that make it: a plan may not depend on
    an answer the runtime gets from a live process (docs/architecture.md, "Layers")."""
    for folder in (ROOT / "autoshard" / "ir", ROOT / "passes", ROOT / "kernels"):
        for path in folder.glob("*.py"):
            wrong = _imports(path, "autoshard.runtime") | (_imports(path, "autoshard") & {"runtime", "api"})
            assert not wrong, f"{path.relative_to(ROOT)} imports the runtime: {sorted(wrong)}"
