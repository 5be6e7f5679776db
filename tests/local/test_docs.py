"""The user guide holds: its code runs, its links resolve, its pages stay short.

Every ```python block of docs/*.md (DESIGN.md aside) and of README.md runs: a page's
blocks in order, in one namespace, in a fresh Python process of its own (the test
session's environment: 8 CPU devices, so the snippets' meshes run in local mode). A
block preceded by `<!-- not run: why -->` is skipped (it needs MPI ranks, or changes the
process); ```bash and ```text blocks are never run. A failing block's traceback names
the page and its line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
GUIDE = sorted(p for p in DOCS.glob("*.md") if p.name != "DESIGN.md")
README = ROOT / "README.md"
BENCH_README = ROOT / "bench" / "README.md"

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)[ \t]*(?P<lang>[\w+-]*)")
_NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*\S.*-->\s*$")
_LINK = re.compile(r"\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"(`+).*?\1")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    lang: str
    line: int  # 1-based line of the block's first code line
    code: str
    run: bool  # False when a `<!-- not run: ... -->` comment precedes it


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
        blocks.append(Block(m["lang"].lower(), i + 2, "\n".join(body), run))
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


# Executes a page's blocks in one namespace, each compiled under the page's name with its
# own line numbers, so a traceback points into the markdown file.
_DRIVER = """
import json, sys
page, blocks = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
for line, code in blocks:
    exec(compile("\\n" * (line - 1) + code + "\\n", page, "exec"), namespace)
"""


def _page_env() -> dict[str, str]:
    env = dict(os.environ)
    flag = "--xla_force_host_platform_device_count"
    if flag not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}=8".strip()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("MPLBACKEND", "Agg")
    env.setdefault("JAX_PLATFORMS", "cpu")  # the snippets' meshes are CPU devices
    return env


PAGES_WITH_CODE = [p for p in [README, *GUIDE] if runnable(p)]


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: p.name)
def test_python_blocks_run(page: Path, tmp_path: Path):
    blocks = [(b.line, b.code) for b in runnable(page)]
    proc = subprocess.run([sys.executable, "-c", _DRIVER],
                          input=json.dumps([str(page), blocks]), capture_output=True,
                          text=True, cwd=tmp_path, env=_page_env(), timeout=600)
    assert proc.returncode == 0, (f"{page.relative_to(ROOT)}: a python block failed\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


@pytest.mark.parametrize("page", GUIDE, ids=lambda p: p.name)
def test_each_guide_page_starts_with_a_runnable_snippet(page: Path):
    blocks = code_blocks(page.read_text())
    assert blocks, f"{page.name} has no code"
    first = blocks[0]
    assert first.lang == "python" and first.run, (
        f"{page.name}: its first code block (line {first.line}) should be python that runs")


def test_not_run_blocks_are_rare():
    skipped = [(p.name, b.line) for p in [README, *GUIDE] for b in code_blocks(p.read_text())
               if b.lang == "python" and not b.run]
    assert len(skipped) <= 3, f"python blocks marked 'not run': {skipped}"


LINKED_PAGES = [README, BENCH_README, *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in _LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_readme_starts_with_the_commands_a_new_user_runs():
    first = code_blocks(README.read_text())[0]
    assert first.line <= 6, "README's first lines are the commands (CI runs them)"
    assert "make example" in first.code and "make test" in first.code


def test_landing_pages_stay_short():
    assert len(README.read_text().splitlines()) <= 250
    assert len(BENCH_README.read_text().splitlines()) <= 400


def _variables_in_code() -> set[str]:
    sources = [*ROOT.glob("jaxpp_mpi/**/*.py"), *ROOT.glob("launch/**/*"), ROOT / "Makefile",
               *ROOT.glob("tools/**/*"), *ROOT.glob("bench/*.py"), *ROOT.glob("examples/*.py"),
               *ROOT.glob("tests/**/*.py")]
    found = set()
    for path in sources:
        if path.is_file() and path != Path(__file__).resolve():
            found |= set(re.findall(r"JAXPP_MPI_[A-Z0-9_]*[A-Z0-9]",
                                    path.read_text(errors="replace")))
    return found


def test_every_environment_variable_is_documented():
    text = (DOCS / "reliability.md").read_text()
    table = text[text.index("## Environment variables"):]
    missing = sorted(v for v in _variables_in_code() if f"`{v}`" not in table)
    assert not missing, f"docs/reliability.md's variable table lacks {missing}"
