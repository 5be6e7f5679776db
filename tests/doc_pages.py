"""The user guide's pages as data: fenced code blocks, the programs they make, links and
headings; what tests/local/test_docs.py and tests/jobs/test_docs_mpi.py run and check.

A page's ```python blocks run in order in one namespace, as one program; a block
preceded by `<!-- not run: why -->` is skipped, and one preceded by `<!-- separate
program: why -->` starts a program of its own (a fresh process: e.g. another mesh
shape, which under MPI needs another device count per rank).
"""

from __future__ import annotations

import ast
import dataclasses
import math
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GUIDE = sorted(p for p in DOCS.glob("*.md") if p.name != "DESIGN.md")
README = ROOT / "README.md"

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)[ \t]*(?P<lang>[\w+-]*)")
_NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*\S.*-->\s*$")
_SEPARATE = re.compile(r"^\s*<!--\s*separate program:\s*\S.*-->\s*$")
_CODE_SPAN = re.compile(r"(`+).*?\1")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    lang: str
    line: int  # 1-based line of the block's first code line
    code: str
    run: bool  # False when a `<!-- not run: ... -->` comment precedes it
    separate: bool = False  # True when a `<!-- separate program: ... -->` comment precedes it


def code_blocks(text: str) -> list[Block]:
    """The fenced code blocks of a markdown text, indented ones (in list items) dedented."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        body = [line[indent:] if not line[:indent].strip() else line.lstrip()
                for line in lines[i + 1:j]]
        run = not (i > 0 and _NOT_RUN.match(lines[i - 1]))
        separate = bool(i > 0 and _SEPARATE.match(lines[i - 1]))
        blocks.append(Block(m["lang"].lower(), i + 2, "\n".join(body), run, separate))
        i = j + 1
    return blocks


def outside_fences(text: str) -> list[str]:
    """The lines of a markdown text outside its fenced blocks."""
    out, inside = [], None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if m and inside is None:
            inside = m["fence"]
        elif inside is not None and line.strip().startswith(inside):
            inside = None
        elif inside is None:
            out.append(line)
    return out


def prose(text: str) -> str:
    """The text outside fenced blocks and code spans (where links are links)."""
    return "\n".join(_CODE_SPAN.sub("", line) for line in outside_fences(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings (repeated ones numbered as GitHub does)."""
    seen: dict[str, int] = {}
    out = set()
    for line in outside_fences(path.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m[1].replace("`", ""))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def runnable(path: Path) -> list[Block]:
    return [b for b in code_blocks(path.read_text()) if b.lang == "python" and b.run]


def programs(path: Path) -> list[list[Block]]:
    """A page's runnable python blocks, split into programs (see the module docstring)."""
    out: list[list[Block]] = []
    for block in runnable(path):
        if not out or block.separate:
            out.append([])
        out[-1].append(block)
    return out


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """What a program's first `make_mpmd_mesh` asks of an MPI job."""

    ranks: int  # groups x replicas: one rank each
    devices: int  # devices per rank (one group's)


def mesh_shape(program: list[Block]) -> MeshShape | None:
    """The MPI job a program's first `make_mpmd_mesh((...), (...), "axis", ...)` call
    needs (its literal arguments), or None when it builds no mesh that way."""
    for block in program:
        for node in ast.walk(ast.parse(block.code)):
            func = getattr(node, "func", None)
            name = getattr(func, "attr", None) or getattr(func, "id", None)
            if not isinstance(node, ast.Call) or name != "make_mpmd_mesh":
                continue
            shape, names, axis = (ast.literal_eval(a) for a in node.args[:3])
            replica = next((ast.literal_eval(k.value) for k in node.keywords
                            if k.arg == "replica_axis_name"), None)
            ranks = math.prod(s for s, n in zip(shape, names) if n in (axis, replica))
            return MeshShape(ranks, math.prod(shape) // ranks)
    return None


# Runs programs (a JSON file: [[page, [[line, code], ...]], ...]) one after another, each
# in a fresh namespace, its blocks compiled under the page's name with their own line
# numbers, so a traceback points into the markdown file; prints a line per program done.
DRIVER = """
import json, sys, time
for page, blocks in json.load(open(sys.argv[1])):
    namespace, start = {"__name__": "__main__"}, time.perf_counter()
    for line, code in blocks:
        exec(compile("\\n" * (line - 1) + code + "\\n", page, "exec"), namespace)
    print(f"program done: {page}:{blocks[0][0]} in {time.perf_counter() - start:.1f} s",
          flush=True)
"""


def program_json(path: Path, program: list[Block]) -> list:
    """One program as the driver reads it."""
    return [str(path), [(b.line, b.code) for b in program]]
