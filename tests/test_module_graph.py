"""The module graph of ``ucm``: no import circle (late, function-level imports included: they
are how a circle hides), and no private (``_name``) name imported from another module."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ucm"


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every ucm import the module runs (not ``TYPE_CHECKING`` ones)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, list[str]]] = []

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if _is_type_checking(node.test):
                for child in node.orelse:
                    self.visit(child)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.extend((alias.name, []) for alias in node.names if alias.name in modules)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module in modules:
                found.append((module, [alias.name for alias in node.names]))

    Visitor().visit(ast.parse(path.read_text()))
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for module, names in _imports(name, path, modules):
            submodules = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules]
            edges.update(submodules)
            # `from . import x` of submodules only needs the package already being imported.
            if len(submodules) < len(names) or not names:
                edges.add(module)
        graph[name] = edges - {name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            advanced = False
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    advanced = True
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [["a", "b", "c"]]


def test_no_import_circle_among_ucm_modules() -> None:
    graph = _graph()
    assert {"ucm.config", "ucm.stack", "ucm.plugins", "ucm.store"} <= set(graph)
    assert _circles(graph) == []
    # config is a leaf below the plugins (of ucm it needs the sizes, the settings' number
    # types, the codecs' models and the generated ABI's limits only); the stack sits above
    # them. The codecs import only the number types, which import no ucm.
    assert graph["ucm.config"] <= {
        "ucm.sizes",
        "ucm.fieldtypes",
        "ucm.codecs",
        "ucm.native._abi",
    }
    assert graph["ucm.codecs"] <= {"ucm.fieldtypes"}
    assert graph["ucm.fieldtypes"] == set()
    assert "ucm.plugins" in graph["ucm.stack"]


def test_no_private_name_is_imported_from_another_module() -> None:
    modules = _modules()
    crossing = [
        f"{name} imports {imported} from {module}"
        for name, path in modules.items()
        for module, names in _imports(name, path, modules)
        for imported in names
        # A name defined in a module (a class, a function, a constant), not a submodule such
        # as the generated ``ucm.native._abi``.
        if imported.startswith("_")
        and not imported.startswith("__")
        and f"{module}.{imported}" not in modules
    ]
    assert crossing == []
