"""The package's import graph, read from the source with `ast`: no cycle, and the runtime
imports neither the compiler nor the passes.

Every `import` counts, at module level, inside functions and under TYPE_CHECKING alike;
a pass module the registry imports by name from its table is no edge (that is the point of
the table). Run as a script to print the graph's cycles.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "llmopt"


def package_dirs() -> dict[str, Path]:
    """Package name -> its folder, from pyproject.toml's package-dir (subfolders follow)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = config["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in mapping.items()
            if name == PACKAGE or name.startswith(PACKAGE + ".")}


def modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    found: dict[str, Path] = {}
    for package, folder in package_dirs().items():
        for file in sorted(folder.rglob("*.py")):
            parts = file.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if not all(p.isidentifier() for p in parts):
                continue
            found.setdefault(".".join((package, *parts)), file)
    return found


def imported_modules(tree: ast.AST, module: str, is_package: bool,
                     known: set[str]) -> set[str]:
    """The package's modules that `module`'s import statements load: `from a import b` is
    a.b where that is a module, else a; a name outside the package is left out."""
    found: set[str | None] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(resolve(alias.name, known) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, `level - 1` up
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(filter(None, (*anchor, base)))
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.add(name if name in known else resolve(base, known))
    return {m for m in found if m is not None and m != module}


def resolve(name: str, known: set[str]) -> str | None:
    """The most specific known module a dotted name lies in (None: outside the package)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in known:
            return ".".join(parts[:end])
    return None


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    files = modules()
    known = set(files)
    return {module: imported_modules(ast.parse(file.read_text(), str(file)), module,
                                     file.name == "__init__.py", known)
            for module, file in files.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module (each is at least one cycle), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, for the message."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph[node] & members):
                if successor == start:
                    return [*paths[node], start]
                if successor not in paths:
                    paths[successor] = [*paths[node], successor]
                    following.append(successor)
        frontier = following
    return component


def describe(graph: dict[str, set[str]]) -> list[str]:
    return [" -> ".join(one_cycle(graph, c)) + f"  ({len(c)} modules)"
            for c in strongly_connected(graph)]


def reaches(graph: dict[str, set[str]], start: str, prefix: str) -> bool:
    """Whether `start` imports, directly or through others, a module under `prefix`."""
    seen, todo = {start}, [start]
    while todo:
        for successor in graph[todo.pop()]:
            if successor.startswith(prefix):
                return True
            if successor not in seen:
                seen.add(successor)
                todo.append(successor)
    return False


def test_the_package_is_found():
    names = set(modules())
    assert {f"{PACKAGE}.compiler", f"{PACKAGE}.passes", f"{PACKAGE}.runtime"} <= names
    assert len(names) > 50


def test_no_import_cycle():
    assert describe(import_graph()) == []


def test_the_runtime_imports_neither_the_compiler_nor_the_passes():
    graph = import_graph()
    runtime = f"{PACKAGE}.runtime"
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items()
                    if m == runtime or m.startswith(runtime + ".")
                    for t in targets
                    if t.startswith((f"{PACKAGE}.compiler", f"{PACKAGE}.passes")))
    assert upward == []


def test_no_pass_imports_a_compiler_module_that_imports_the_passes():
    """The compiler calls the passes (through the registry's table and the draft phase);
    a pass may use the compiler's libraries, never what drives the passes."""
    graph = import_graph()
    passes, compiler = f"{PACKAGE}.passes", f"{PACKAGE}.compiler"
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith(passes)
                    for t in targets if t.startswith(compiler) and reaches(graph, t, passes))
    assert upward == []


def test_the_user_tools_sit_above_compiler_passes_and_runtime():
    """`llmopt.tools` (bench, evaluate, inspect) and the CLI use the rest; nothing below
    them imports them."""
    graph = import_graph()
    rooms = tuple(f"{PACKAGE}.{room}" for room in ("compiler", "passes", "runtime"))
    tools = (f"{PACKAGE}.tools", f"{PACKAGE}.cli")
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith(rooms)
                    for t in targets if t.startswith(tools))
    assert upward == []


if __name__ == "__main__":
    graph = import_graph()
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports")
    lines = describe(graph)
    print(f"{len(lines)} cycle(s) (strongly connected components)")
    print("\n".join(lines))
    sys.exit(1 if lines else 0)
