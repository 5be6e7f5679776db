"""`python -m jaxpp_mpi.reshard` under MPI: whole-model -> 4 stages -> 2 stages -> whole.

The checkpoints and plans are made here in one process (local-mode meshes for the
plans); each conversion is an MPI job of `launch/jpprun`. Every result is checked
against the numpy values first saved, and the final whole-model files against the first
ones byte for byte.
"""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from job_env import job_env

import jaxpp_mpi as jp
from jaxpp_mpi import checkpoint as ck

ROOT = Path(__file__).resolve().parents[2]
JPPRUN = ROOT / "launch" / "jpprun"
LIMIT_S = 120


def _reshard(ranks: int, *args: str) -> subprocess.CompletedProcess:
    env = job_env()
    try:
        return subprocess.run(
            [str(JPPRUN), "-n", str(ranks), "python", "-m", "jaxpp_mpi.reshard", *args],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"reshard {args[0]} did not finish in {LIMIT_S} s")


def _values() -> dict:
    rng = np.random.default_rng(1)
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
    return {
        "embed": normal(8, 4),
        "blocks": [{"w": normal(4, 6), "b": normal(6).astype(ml_dtypes.bfloat16)}
                   for _ in range(4)],
        "count": np.int32(5),
    }


def _shardings(groups: int, values: dict) -> dict:
    """A placement of `values` over `groups` local groups: block i on group
    i * groups // 4, the embedding on group 0, the counter on every group."""
    data = 2 if groups == 4 else 1
    mesh = jp.MpmdMesh(jax.make_mesh((groups, data), ("stage", "data")), "stage")
    on = lambda ids, spec=None: jp.MpmdSharding(mesh, ids, spec)
    return {"embed": on(0, P("data")),
            "blocks": [{"w": on(i * groups // 4, P(None, "data")), "b": on(i * groups // 4)}
                       for i in range(4)],
            "count": on(range(groups))}


def _placements(path: str) -> list:
    return [leaf["placement"] for leaf in json.load(open(f"{path}/manifest.json"))["leaves"]]


def _expected_placements(shardings: dict) -> list:
    return [{"mesh_ids": list(s.mesh_ids), "spec": [e for e in s.spec]}
            for s in jax.tree.leaves(shardings)]


def _assert_holds(path: str, values: dict) -> None:
    got = ck.load_whole(path)
    assert jax.tree.structure(got) == jax.tree.structure(values)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(values)):
        assert a.dtype == np.asarray(b).dtype and a.shape == np.shape(b)
        np.testing.assert_array_equal(a.reshape(-1).view(np.uint8),
                                      np.asarray(b).reshape(-1).view(np.uint8))


def test_whole_to_stages_to_fewer_stages_and_back(tmp_path):
    values = _values()
    full, staged4, staged2, back = (str(tmp_path / n) for n in
                                    ("full", "staged4", "staged2", "back"))
    ck.save(full, values, step=40)
    plan4, plan2 = str(tmp_path / "plan4.json"), str(tmp_path / "plan2.json")
    sh4, sh2 = _shardings(4, values), _shardings(2, values)
    ck.save_plan(plan4, sh4, like=values)
    ck.save_plan(plan2, sh2)  # without shapes: checked against the specs alone

    # 4 groups on 2 ranks: rank r copies the leaves of groups r and r + 2 (a 4-rank job
    # would do the same work, one group each, at twice the start-up cost).
    out = _reshard(2, "to-mpmd", "--src", full, "--dst", staged4, "--plan", plan4)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "reshard: 10/10 arrays" in out.stdout and "done, 10 arrays" in out.stdout
    # rank 0: embed, count (first group 0) and blocks 0 and 2 (w, b); rank 1: blocks 1, 3
    assert "arrays per rank: 6, 4" in out.stdout
    assert _placements(staged4) == _expected_placements(sh4)
    _assert_holds(staged4, values)

    out = _reshard(2, "repartition", "--src", staged4, "--dst", staged2, "--plan", plan2)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "arrays per rank: 6, 4" in out.stdout  # group 0 now has blocks 0 and 1
    assert _placements(staged2) == _expected_placements(sh2)
    _assert_holds(staged2, values)

    out = _reshard(2, "to-spmd", "--src", staged2, "--dst", back)
    assert out.returncode == 0, out.stdout + out.stderr
    assert _placements(back) == [None] * 10
    assert ck.read_manifest(back).step == 40
    files = sorted(os.listdir(f"{full}/arrays"))
    assert files == sorted(os.listdir(f"{back}/arrays")) and len(files) == 10
    match, mismatch, errors = filecmp.cmpfiles(f"{full}/arrays", f"{back}/arrays", files,
                                               shallow=False)
    assert (mismatch, errors) == ([], [])
    _assert_holds(back, values)


def test_mismatched_plan_rejected_on_every_rank_with_nothing_written(tmp_path):
    values = _values()
    full, dst = str(tmp_path / "full"), str(tmp_path / "staged")
    ck.save(full, values)
    wrong = dict(values, embed=np.zeros((8, 5), np.float32))  # another shape
    shardings = _shardings(2, values)
    del shardings["count"]  # and a leaf the plan does not place
    plan = str(tmp_path / "plan.json")
    ck.save_plan(plan, shardings, like=wrong)
    out = _reshard(2, "to-mpmd", "--src", full, "--dst", dst, "--plan", plan)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    for rank in (0, 1):
        assert f"[rank {rank}] reshard: error: the plan does not match the checkpoint" in text
    assert "the checkpoint has ['count'], the plan does not place it" in text
    assert "['embed']: the plan has shape [8, 5], the checkpoint [8, 4]" in text
    assert "arrays," not in out.stdout  # no progress: no data moved
    assert sorted(os.listdir(tmp_path)) == ["full", "plan.json"]


def test_bad_checkpoint_is_one_clean_line_on_every_rank(tmp_path):
    # A shape numpy cannot hold, its .npy header agreeing: before, a bare numpy ValueError
    # with a traceback and MPI_Abort; now refused on the manifest, one line per rank, and
    # the agreed exit status without MPI_Abort (python -m mpi4py aborts on any non-zero
    # exit unless MPI was finalized).
    src, dst = tmp_path / "bad", tmp_path / "out"
    (src / "arrays").mkdir(parents=True)
    with open(src / "arrays" / "000000.npy", "wb") as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": "<f4", "fortran_order": False, "shape": (0, 2**62)})
    (src / "manifest.json").write_text(json.dumps({
        "format": "jaxpp_mpi.checkpoint", "version": 1, "step": None, "mpmd_dim": None,
        "leaves": [{"path": [["key", "a"]], "shape": [0, 2**62], "dtype": "float32",
                    "file": "arrays/000000.npy", "placement": None}]}))
    out = _reshard(2, "to-spmd", "--src", str(src), "--dst", str(dst))
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    for rank in (0, 1):
        assert (f"[rank {rank}] reshard: error: {src}/manifest.json: leaf 0: shape "
                f"[0, {2**62}] is too large") in text
    assert "Traceback" not in text and "MPI_ABORT" not in text
    assert not dst.exists()


def test_a_managed_step_converts_like_any_checkpoint(tmp_path):
    # CheckpointManager's steps are ordinary checkpoints (DIR/STEP): the CLI reads the
    # newest one and places it by a plan, as it does a checkpoint saved on its own.
    values = _values()
    manager = ck.CheckpointManager(str(tmp_path / "run"), max_to_keep=1)
    older = dict(values, count=np.int32(4))
    manager.save(10, older)
    manager.save(20, values)
    manager.wait()
    assert manager.all_steps() == [20]
    src, dst = manager.step_path(manager.latest_step()), str(tmp_path / "staged")
    plan = str(tmp_path / "plan.json")
    sh2 = _shardings(2, values)
    ck.save_plan(plan, sh2, like=values)
    out = _reshard(2, "to-mpmd", "--src", src, "--dst", dst, "--plan", plan)
    assert out.returncode == 0, out.stdout + out.stderr
    assert _placements(dst) == _expected_placements(sh2)
    assert ck.read_manifest(dst).step == 20
    _assert_holds(dst, values)
