"""The layers of jaxpp_mpi/_src (docs/DESIGN.md section 3): module-level imports point
downwards only, and no module imports itself back through others.

Read from the source with `ast`, nothing imported. Imports inside functions (the lazy
calls that DESIGN.md names) and under `TYPE_CHECKING` do not count; command-line modules
(`cli.py`) sit above every layer, since they only wire others together.
"""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[2] / "jaxpp_mpi" / "_src"

# bottom to top; a package may import its own layer and those below
LAYERS = (
    ("base",),
    ("schedules", "ir", "launch"),
    ("timeline",),
    ("mpi",),
    ("arrays", "primitives"),
    ("compiler",),
    ("runtime",),
    ("driver",),
    ("frontend",),
    ("reshard", "checkpoint", "planner"),
)
LEVEL = {package: level for level, packages in enumerate(LAYERS) for package in packages}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(SRC.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in SRC.rglob("*.py")}


def _top_level_imports(tree: ast.Module) -> set[str]:
    """Modules of ours imported when the module is: its body, and the branches of its
    top-level `if`/`try` blocks, except `if TYPE_CHECKING:`."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                visit(node.orelse)
                visit(node.finalbody)
                for handler in node.handlers:
                    visit(handler.body)

    visit(tree.body)
    return {name for name in found if name in MODULES}


GRAPH = {
    name: _top_level_imports(ast.parse(path.read_text())) - {name}
    for name, path in MODULES.items()
}


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 or (len(parts) == 3 and parts[2] in LEVEL) else None


def test_every_package_has_a_layer():
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(LEVEL), "add the package to LAYERS here and to DESIGN.md section 3"
    flat = sorted(p.name for p in SRC.glob("*.py") if p.name != "__init__.py")
    assert not flat, f"modules outside the layer packages: {flat}"


def test_imports_point_downwards():
    upward = []
    for module, imported in GRAPH.items():
        if module.endswith(".cli"):
            continue
        for target in imported:
            source_package, target_package = _package(module), _package(target)
            if source_package and target_package and LEVEL[target_package] > LEVEL[source_package]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports pointing up a layer:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                walk(target, path)
        path.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            walk(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_check_sees_imports():
    # the graph is not vacuous: a known downward import is in it
    assert "jaxpp_mpi._src.arrays.mesh" in GRAPH["jaxpp_mpi._src.arrays.array"]
