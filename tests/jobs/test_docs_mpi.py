"""The user guide's programs under MPI: each docs/ page's python (and README's) runs under
`launch/jpprun -n G`, G the ranks its mesh asks for (groups x replicas), one group per
rank, as tests/local/test_docs.py runs it in one process.

Programs that ask for the same job (ranks, devices per rank) share one launch: each in a
fresh namespace, one after another (tests/doc_pages.py's driver); a failing block aborts
the job, its traceback naming the page and line.
"""

from __future__ import annotations

import json
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
from doc_pages import DRIVER, GUIDE, README, ROOT, MeshShape, mesh_shape, program_json, programs
from job_env import job_env

LIMIT_S = 400


def _jobs() -> dict[MeshShape, list[tuple[Path, list]]]:
    jobs: dict[MeshShape, list] = defaultdict(list)
    for page in [README, *GUIDE]:
        for program in programs(page):
            shape = mesh_shape(program)
            assert shape is not None, f"{page.name}:{program[0].line} builds no mesh"
            jobs[shape].append((page, program))
    return dict(sorted(jobs.items(), key=lambda kv: (kv[0].ranks, kv[0].devices)))


JOBS = _jobs()


def test_every_program_is_in_a_job():
    count = sum(len(programs(p)) for p in [README, *GUIDE])
    assert sum(len(v) for v in JOBS.values()) == count and count >= 10


@pytest.mark.parametrize("shape", list(JOBS), ids=lambda s: f"{s.ranks}ranks-{s.devices}dev")
def test_docs_programs_under_mpi(shape: MeshShape, tmp_path: Path):
    listed = [program_json(page, program) for page, program in JOBS[shape]]
    (tmp_path / "driver.py").write_text(DRIVER)
    (tmp_path / "programs.json").write_text(json.dumps(listed))
    flags = f"--xla_force_host_platform_device_count={shape.devices}"
    env = job_env(JAX_PLATFORMS="cpu", MPLBACKEND="Agg", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
    cmd = [str(ROOT / "launch" / "jpprun"), "-n", str(shape.ranks), "python",
           str(tmp_path / "driver.py"), str(tmp_path / "programs.json")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=LIMIT_S)
    done = [line for line in proc.stdout.splitlines() if line.startswith("program done: ")]
    print("\n".join(sorted(set(done))))
    assert proc.returncode == 0 and len(done) == shape.ranks * len(listed), (
        f"{len(done)} of {shape.ranks} x {len(listed)} programs done\n"
        f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
