"""base/variables.py, the one definition of every JAXPP_MPI_* variable: it names every
variable the repository reads, docs/reliability.md's table is what it generates, and the
variables that the shell and the tests read take what their readers take."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxpp_mpi._src.base import variables

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "reliability.md"
COMMAND = "python -m jaxpp_mpi._src.base.cli --update"


def _names_in_repository() -> set[str]:
    sources = [*ROOT.glob("jaxpp_mpi/**/*.py"), *ROOT.glob("launch/**/*"), ROOT / "Makefile",
               *ROOT.glob("tools/**/*"), *ROOT.glob("bench/*.py"), *ROOT.glob("examples/*.py"),
               *ROOT.glob("tests/**/*.py"), *ROOT.glob("docs/*.md"), ROOT / "README.md"]
    found: set[str] = set()
    for path in sources:
        if path.is_file() and path != Path(__file__).resolve():
            found |= set(re.findall(r"JAXPP_MPI_[A-Z0-9_]*[A-Z0-9]",
                                    path.read_text(errors="replace")))
    return found


def test_every_variable_the_repository_names_is_defined_once():
    names = [v.name for v in variables.VARIABLES]
    assert len(names) == len(set(names))
    assert _names_in_repository() == set(names)


def test_every_definition_is_complete():
    for v in variables.VARIABLES:
        assert v.read_by in (variables.RANKS, variables.LAUNCH, variables.SHELL,
                             variables.INSTALL, variables.TESTS), v.name
        assert v.default and v.meaning and v.takes, v.name
        assert "\n" not in v.meaning and "|" not in v.meaning, v.name


def test_the_docs_table_is_the_generated_one():
    text = DOC.read_text()
    start, end = variables.table_span(text)
    assert text[start:end] == variables.markdown_table(), (
        f"docs/reliability.md's variable table differs from base/variables.py's "
        f"definitions: run `{COMMAND}`")
    assert COMMAND in text[:start], "the doc names the command that regenerates its table"


def test_the_table_has_a_row_per_variable_with_its_values():
    rows = variables.markdown_table().splitlines()[2:]
    assert [row.split(" | ")[0] for row in rows] == [f"| `{v.name}`" for v in variables.VARIABLES]
    step = rows[0].split(" | ")
    assert step[1:4] == ["every rank", "`auto`",
                         "a number of seconds from 0 to 2592000 (30 days), `auto` or `off`"]


def test_update_rewrites_the_table_and_nothing_else(tmp_path):
    text = DOC.read_text()
    start, end = variables.table_span(text)
    old_row = "| `" + "JAXPP_MPI" + "_GONE` | 1 |\n"  # spelt so no scan finds the name
    stale = text[:start] + "| variable | old |\n|---|---|\n" + old_row + text[end:]
    doc = tmp_path / "reliability.md"
    doc.write_text(stale)
    subprocess.run([sys.executable, "-W", "error", "-m", "jaxpp_mpi._src.base.cli", "--update",
                    str(doc)], check=True, cwd=ROOT, timeout=60)
    assert doc.read_text() == text[:start] + variables.markdown_table() + text[end:]


def test_table_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "jaxpp_mpi._src.base.cli", "--table"],
                         check=True, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout == variables.markdown_table()


def _install_choices(variable: str) -> set[str]:
    """The words tools/install.sh's `case` on `variable` takes (its `*)` arm aside)."""
    script = (ROOT / "tools" / "install.sh").read_text()
    choice = re.search(rf"^(\w+)=\$\{{{variable}:-(\w+)\}}$", script, re.M)
    assert choice is not None
    body = script[script.index(f'case "${choice[1]}" in'):]
    body = body[:body.index("esac")]
    words = set(re.findall(r"^\s*(\w+)\)", body, re.M))
    return words | {choice[2]}


@pytest.mark.parametrize("name", ["JAXPP_MPI_MPI", "JAXPP_MPI_CUDA"])
def test_the_install_variables_take_what_install_sh_takes(name):
    v = variables.variable(name)
    assert set(v.words) == _install_choices(name)
    assert f"`{sorted(_install_choices(name) & {'wheel', 'auto'})[0]}`" == v.default
    assert bool(v.path) == (name == "JAXPP_MPI_CUDA")  # its `*)` arm takes a toolkit's path


@pytest.mark.parametrize("name, good, bad", [
    ("JAXPP_MPI_PYTHON", [sys.executable, "sh"], ["/no/such/python", "", "no-such-program-x"]),
    ("JAXPP_MPI_MPI", ["wheel", " System "], ["openmpi", ""]),
    ("JAXPP_MPI_CUDA", ["auto", "off", "on", "/usr/local/cuda"], ["yes", "cuda12", ""]),
    ("JAXPP_MPI_UPDATE_GOLDEN", ["1", "0"], ["yes please", "2", ""]),
    ("JAXPP_MPI_FAULT_STAMP", ["1"], ["0", "stamp", ""]),
])
def test_the_shell_and_test_variables_are_checked_too(name, good, bad):
    v = variables.variable(name)
    for raw in good:
        v.parse({name: raw})
    for raw in bad:
        with pytest.raises(variables.VariableError, match=rf"^{name}=.*use "):
            v.parse({name: raw})


def test_this_test_run_has_a_well_formed_environment():
    """The variables of the shell and of the tests (`make` sets JAXPP_MPI_PYTHON) are read
    where no parser of ours runs: checked here, so a typo fails by name."""
    readers = (variables.SHELL, variables.INSTALL, variables.TESTS, *variables.PYTHON_READERS)
    variables.parse_all(os.environ, readers)
