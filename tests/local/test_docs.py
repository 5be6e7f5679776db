"""The user guide holds: its code runs, its links resolve, its pages stay short.

Every ```python block of docs/*.md (DESIGN.md aside) and of README.md runs: a page's
blocks in order, in one namespace, in a fresh Python process of its own (the test
session's environment: 8 CPU devices, so the snippets' meshes run in local mode); a
block preceded by `<!-- separate program: why -->` starts a fresh process, and one
preceded by `<!-- not run: why -->` is skipped (tests/doc_pages.py); ```bash and
```text blocks are never run. A failing block's traceback names the page and its line.
The same programs run under MPI in tests/jobs/test_docs_mpi.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from doc_pages import (
    DOCS,
    DRIVER,
    GUIDE,
    README,
    ROOT,
    anchors,
    code_blocks,
    program_json,
    programs,
    prose,
    runnable,
)

BENCH_README = ROOT / "bench" / "README.md"
_LINK = re.compile(r"\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")


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
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    for k, program in enumerate(programs(page)):
        listed = tmp_path / f"program{k}.json"
        listed.write_text(json.dumps([program_json(page, program)]))
        proc = subprocess.run([sys.executable, str(driver), str(listed)],
                              capture_output=True, text=True, cwd=tmp_path,
                              env=_page_env(), timeout=600)
        assert proc.returncode == 0, (
            f"{page.relative_to(ROOT)}: a python block of the program from line "
            f"{program[0].line} failed\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


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


READING_RESULTS = "pipelined-step.md#reading-results"


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: p.name)
def test_pages_that_read_results_link_to_reading_results(page: Path):
    """A page whose code reads a step's result (where held, or on every rank) points to
    the one section that says how (docs/pipelined-step.md, "Reading results")."""
    code = "\n".join(b.code for b in runnable(page))
    reads = re.search(r"process_allgather|is_partially_addressable|to_mpmd_local_array", code)
    text = page.read_text()
    linked = READING_RESULTS in text or (page.name == "pipelined-step.md"
                                         and "(#reading-results)" in text)
    assert not reads or linked, f"{page.name} reads results but does not link {READING_RESULTS}"


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
