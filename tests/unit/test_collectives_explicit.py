"""Collectives are explicit (STYLE.md): a public function that can talk to other ranks
says so in its name or its docstring's summary ("collective", "every rank"), is listed
in docs/reliability.md's "Collective calls" table, and no dunder of `MpmdArray` can
reach MPI.

How a function is found to talk to other ranks: from this package's source, without
running it. Each function's calls are resolved to the package's functions (same
module, imported names and modules, `self`/`cls` methods, classes to their
`__init__`; a call on any other object to every method of that name in the modules
its module imports, at any level and through them, except the methods of Python's and
numpy's own types), and a function *reaches MPI* when a chain of such
calls ends in a communicator's or mpi4jax's message method (`allgather`, `Bcast`,
`Allgatherv`, `Dup`, `Split`, `send`, ...). The walk over-approximates (any method of
the same name it can see counts), and a communicator handed in is caught by its method
names wherever it goes, so a dunder that reaches MPI fails here even if no test ever
calls it.
"""

from __future__ import annotations

import ast
import inspect
import re
from functools import cache
from pathlib import Path

import jaxpp_mpi

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "jaxpp_mpi"

# mpi4py's communicator methods (and mpi4jax's functions) that exchange messages.
MESSAGE_METHODS = frozenset({
    "allgather", "allreduce", "alltoall", "barrier", "bcast", "gather", "irecv", "isend",
    "recv", "reduce", "scatter", "send", "sendrecv", "Allgather", "Allgatherv", "Allreduce",
    "Alltoall", "Alltoallv", "Barrier", "Bcast", "Gather", "Gatherv", "Ibarrier", "Irecv",
    "Isend", "Recv", "Reduce", "Scatter", "Scatterv", "Send", "Sendrecv", "Dup", "Split",
    "Create_group", "Create",
})
# Methods of Python's and numpy's own types (str, list, dict, set, ndarray, threading):
# a call of one of these names on another object is not taken for a package method.
COMMON = frozenset({
    "append", "add", "clear", "copy", "count", "discard", "extend", "format", "get",
    "index", "insert", "items", "join", "keys", "pop", "remove", "replace", "setdefault",
    "sort", "split", "startswith", "endswith", "strip", "update", "values", "encode",
    "decode", "read", "write", "close", "flush", "lower", "upper", "is_set", "acquire",
    "release", "reshape", "astype", "view", "tolist", "item", "sum", "max", "min", "mean",
})

def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


class _Module:
    """One module's definitions and names, from its source."""

    def __init__(self, path: Path):
        self.name = _module_name(path)
        self.package = self.name if path.name == "__init__.py" else self.name.rpartition(".")[0]
        self.tree = ast.parse(path.read_text())
        self.modules: dict[str, str] = {}  # local alias -> module name
        self.names: dict[str, tuple[str, str]] = {}  # local name -> (module, name)
        self.functions: dict[str, ast.AST] = {}  # qualname -> def
        self.classes: dict[str, ast.ClassDef] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.modules[a.asname or a.name.split(".")[0]] = (
                        a.name if a.asname else a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = self.package.split(".")
                    up = up[:len(up) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for a in node.names:
                    self.names[a.asname or a.name] = (base, a.name)
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        self.functions[f"{node.name}.{item.name}"] = item


@cache
def _modules() -> dict[str, _Module]:
    return {m.name: m for m in map(_Module, sorted(PACKAGE.rglob("*.py")))}


@cache
def _methods_named() -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    for m in _modules().values():
        for q in m.functions:
            if "." in q:
                out.setdefault(q.split(".")[-1], []).append((m.name, q))
    return out


@cache
def _sees(module: str) -> frozenset[str]:
    """The package modules `module` imports, directly or not, at any level (itself too)."""
    seen, todo = set(), [module]
    while todo:
        m = _modules().get(todo.pop())
        if m is None or m.name in seen:
            continue
        seen.add(m.name)
        for target in [*m.modules.values(), *(f"{a}.{b}" for a, b in m.names.values()),
                       *(a for a, _ in m.names.values())]:
            while target and target not in _modules():
                target = target.rpartition(".")[0]
            if target:
                todo.append(target)
    return frozenset(seen)


def _resolve_name(module: str, name: str, depth: int = 0) -> list[tuple[str, str]]:
    """The package functions a bare name of `module` stands for (re-exports followed)."""
    m = _modules().get(module)
    if m is None or depth > 8:
        return []
    if name in m.functions:
        return [(module, name)]
    if name in m.classes:
        return [(module, q) for q in m.functions if q.split(".")[0] == name
                and q.split(".")[-1] in ("__init__", "__post_init__", "__new__")]
    if name in m.names:
        src, attr = m.names[name]
        if f"{src}.{attr}" in _modules():
            return []
        return _resolve_name(src, attr, depth + 1)
    return []


def _calls(module: _Module, qualname: str) -> tuple[bool, list[tuple[str, str]]]:
    """(whether the function calls a message method itself, the package functions it calls)."""
    node = module.functions[qualname]
    cls = qualname.split(".")[0] if "." in qualname else None
    direct, callees = False, []
    for call in ast.walk(node):
        if not isinstance(call, ast.Call):
            continue
        f = call.func
        if isinstance(f, ast.Name):
            callees += _resolve_name(module.name, f.id)
        elif isinstance(f, ast.Attribute):
            value = f.value
            named = module.modules.get(value.id) if isinstance(value, ast.Name) else None
            if f.attr in MESSAGE_METHODS and (named is None or named.startswith("mpi4")):
                direct = True  # a communicator's method, or mpi4jax's
            if f.attr.startswith("__"):
                continue  # super().__init__(...) and the like
            if isinstance(value, ast.Name) and value.id in ("self", "cls") and cls:
                key = f"{cls}.{f.attr}"
                if key in module.functions:
                    callees.append((module.name, key))
                    continue
            if isinstance(value, ast.Name):
                target = module.modules.get(value.id)
                if target is None and value.id in module.names:
                    src, attr = module.names[value.id]
                    target = f"{src}.{attr}" if f"{src}.{attr}" in _modules() else None
                if target is not None:
                    callees += _resolve_name(target, f.attr)
                    continue
            if f.attr not in COMMON:
                sees = _sees(module.name)
                callees += [c for c in _methods_named().get(f.attr, []) if c[0] in sees]
    return direct, callees


@cache
def _reaching_mpi() -> frozenset[tuple[str, str]]:
    """Every package function from which a chain of calls reaches a message method."""
    graph, reached = {}, set()
    for m in _modules().values():
        for q in m.functions:
            direct, callees = _calls(m, q)
            graph[(m.name, q)] = callees
            if direct:
                reached.add((m.name, q))
    changed = True
    while changed:
        changed = False
        for key, callees in graph.items():
            if key not in reached and any(c in reached for c in callees):
                reached.add(key)
                changed = True
    return frozenset(reached)


def _where(obj) -> tuple[str, str] | None:
    fn = inspect.unwrap(obj)
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or not module.startswith("jaxpp_mpi"):
        return None
    return module, qualname


EXPLICIT_WORDS = re.compile(r"\bcollective\b|\bevery rank\b|\ball ranks\b", re.I)


def _summary(obj) -> str:
    """A docstring's summary: its first paragraph (Google style's first line, wrapped)."""
    return (inspect.getdoc(obj) or "").strip().split("\n\n")[0]


def _explicit(name: str, obj, owner=None) -> bool:
    """Whether `name` says it is collective: in its name, or in its docstring's summary
    (a constructor's: its class's summary)."""
    if re.search(r"allgather|collective", name.rsplit(".", 1)[-1]):
        return True
    if name.endswith(".__init__") and owner is not None:
        obj = owner
    return bool(EXPLICIT_WORDS.search(_summary(obj)))


def _public_callables():
    """(public name, object, its class or None): the package's public functions, and the
    public methods and dunders of its public classes."""
    spaces = {"jaxpp_mpi": jaxpp_mpi}
    for sub in ("checkpoint", "launch", "trace", "mesh", "api", "schedules"):
        spaces[f"jaxpp_mpi.{sub}"] = getattr(jaxpp_mpi, sub)
    seen = set()
    for space, module in spaces.items():
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if attr.startswith("_") and not (attr.startswith("__") and
                                                     attr.endswith("__")):
                        continue
                    member = getattr(member, "fget", member)
                    member = getattr(member, "__func__", member)
                    if callable(member) and id(member) not in seen:
                        seen.add(id(member))
                        yield f"{space}.{name}.{attr}", member, obj
            elif callable(obj) and id(obj) not in seen:
                seen.add(id(obj))
                yield f"{space}.{name}", obj, None


def _reaches(obj) -> bool:
    where = _where(obj)
    return where is not None and where in _reaching_mpi()


def test_the_walk_finds_known_collectives_and_clears_local_code():
    """The walk itself: it finds what talks to other ranks, and not what cannot."""
    assert _reaches(jaxpp_mpi.process_allgather)
    assert _reaches(jaxpp_mpi.checkpoint.save) and _reaches(jaxpp_mpi.make_mpmd_mesh)
    assert not _reaches(jaxpp_mpi.schedules.Std1F1B.__init__)
    assert not _reaches(jaxpp_mpi.MpmdArray.__float__)


def test_no_mpmd_array_method_or_dunder_reaches_mpi():
    members = {name: m for name, m, _ in _public_callables() if ".MpmdArray." in name}
    assert "jaxpp_mpi.MpmdArray.__array__" in members and len(members) > 20
    reaching = sorted(name for name, m in members.items() if _reaches(m))
    assert not reaching, f"MpmdArray members that can reach MPI: {reaching}"


def test_every_public_dunder_that_reaches_mpi_is_a_call():
    """No dunder sends a message, except calling a compiled step, which is the step."""
    reaching = sorted(name for name, m, _ in _public_callables()
                      if name.rsplit(".", 1)[1].startswith("__") and _reaches(m)
                      and not name.endswith(".__call__") and not name.endswith(".__init__"))
    assert not reaching, f"dunders that can reach MPI: {reaching}"


def _collective_table() -> str:
    text = (ROOT / "docs" / "reliability.md").read_text()
    start = text.index("## Collective calls")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_every_public_collective_is_explicit_and_listed():
    table = _collective_table()
    silent, unlisted = [], []
    for name, obj, owner in _public_callables():
        if not _reaches(obj):
            continue
        if not _explicit(name, obj, owner):
            silent.append(name)
        short = name.removeprefix("jaxpp_mpi.")
        if f"`{short}`" not in table and f"`{short.rsplit('.', 1)[0]}`" not in table:
            unlisted.append(short)
    assert not silent, ("public functions that can talk to other ranks without saying so "
                        f"in their name or docstring summary: {silent}")
    assert not unlisted, f"docs/reliability.md's 'Collective calls' table lacks {unlisted}"
