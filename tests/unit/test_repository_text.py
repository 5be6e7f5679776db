"""The repository's text names no internal work period and no tracker number.

Code, docs and scripts describe what the code does and why, for a reader who never saw
how the work was organised: a work period's name with its number, or an issue or pull
request number, means nothing to that reader and goes stale (git's history keeps them).
Checked over every text file git tracks or would track (*.py, *.md, *.sh, *.cfg, *.toml,
Makefiles and launch/): say what changed or what was measured instead, and cite results
by their file and date.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = {".py", ".md", ".sh", ".cfg", ".toml"}
SKIP_DIRS = {".git", ".venv", ".cache", "build", "dist", "__pycache__", ".pytest_cache",
             ".hypothesis"}

# A work period with its number (and the plural form over a range), an issue or pull
# request number, and the run-file names built from them ("s<N>_run<M>", "_s<N>.json").
FORBIDDEN = re.compile(
    r"\bsessions? \d+"
    r"|\bissue #?\d+"
    r"|\b(?:issues|PR|pull request) #\d+"
    r"|(?<![A-Za-z0-9])s\d+_run\d+"
    r"|_s\d+(?:_run\d+)?\.json"
    r"|\bs\d+ runs? \d+",
    re.IGNORECASE,
)


def _is_text_file(rel: str) -> bool:
    path = Path(rel)
    return (path.suffix in SUFFIXES or path.name == "Makefile"
            or (path.parts and path.parts[0] == "launch"))


def repository_files() -> list[str]:
    """Paths (relative to the root) of the files git tracks or would track."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
        files = [f for f in out.decode().split("\0") if f]
    except (OSError, subprocess.SubprocessError):  # no git: walk the tree instead
        files = []
        for top, dirs, names in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".venv")]
            files += [os.path.relpath(os.path.join(top, n), ROOT) for n in names]
    return sorted(f for f in files if _is_text_file(f) and (ROOT / f).is_file())


def offending_lines() -> list[str]:
    hits = []
    for rel in repository_files():
        text = (ROOT / rel).read_text(errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            if FORBIDDEN.search(line):
                hits.append(f"{rel}:{number}: {line.strip()[:120]}")
    return hits


def test_the_pattern_catches_work_periods_and_issue_numbers_only():
    # Numbered at run time, so this file's own text names none (and is checked too).
    caught = [c.format(n=12) for c in [
        "in session {n}'s run", "Sessions {n}-13", "(issue {n})", "issue #{n}'s targets",
        "see PR #{n}", "compile_s{n}_run1.json", "s{n}_run2.json", "schedules_s{n}.json",
        "s{n} run 1"]]
    kept = ["the test session's cache", "task=F0s1", "F3s5", "stage s1", "issues 4 sends",
            "issue the sends", "schedules_2026-11-26.json", "pytest -s", "Ts1 run"]
    assert [c for c in caught if not FORBIDDEN.search(c)] == []
    assert [k for k in kept if FORBIDDEN.search(k)] == []


def test_no_line_names_a_work_period_or_an_issue_number():
    hits = offending_lines()
    assert not hits, ("name what changed or what was measured instead of a work period or "
                      "an issue number:\n" + "\n".join(hits))
