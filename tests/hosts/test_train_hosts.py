"""The transformer example across hosts, one run feeding the next, each matching `jax.jit`:

1. 2 hosts x 2 ranks under jpprun, 2 pipeline replicas (1F1B) with ranks alternating
   hosts (so every pipeline message crosses hosts), saving a checkpoint from both hosts;
2. a plain mpirun on 4 hosts x 1 rank restores it (2 replicas -> 1, 2 stages -> 8 of
   Interleaved1F1B), trains on and is preempted the way SLURM does it, SIGTERM to every
   rank: all of them stop after the same step, save and exit 0;
3. jpprun on 1 host x 4 ranks resumes from that save (ZeroBubble, 4 stages) and
   finishes; its check against
   `jax.jit` covers every step of the three runs (the losses travel in the checkpoint)
   and the final parameters;
The first three run in this order, each needing the one before (one module-scoped run
of the hosts). Last, the reshard CLI converts a whole-model checkpoint to 4 groups and
back in jobs across 2 hosts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import ml_dtypes
import netns
import numpy as np
import pytest
import train_jobs
from train_jobs import matched_jax_jit, run_train

STEPS = 12  # in all; the first run trains 2, the preempted one stops early
TOL = (1e-4, 1e-3)  # the example's own float32 tolerances


def _manifest_step(path: Path) -> int:
    """The step of the newest step directory of the example's CheckpointManager."""
    newest = max((p for p in path.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    return json.loads((newest / "manifest.json").read_text())["step"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("train_hosts")


def test_replicas_alternating_hosts_save_a_checkpoint(module_hosts, host_env, work):
    hosts = module_hosts(4)
    proc = run_train(hosts, [2, 2, 0, 0], ["--replicas", "2", "--microbatches", "4",
                                           "--steps", "2", "--ckpt-dir", str(work)],
                     env=host_env, map_by="node")
    loss, param = matched_jax_jit(proc, steps=2)
    assert loss <= TOL[0] and param <= TOL[1]
    assert "2 stages on 2 groups of 1 device(s) x 2 replicas" in proc.stdout
    assert "4 ranks on 2 host(s): h1 2, h2 2" in proc.stderr
    assert _manifest_step(work / "ckpt") == 2


def test_restored_on_4_hosts_and_preempted_by_a_signal_to_every_rank(
        module_hosts, host_env, work):
    hosts = module_hosts(4)
    assert _manifest_step(work / "ckpt") == 2, "needs the previous test's checkpoint"
    argv = train_jobs.train_argv(hosts, 1, ["--microbatches", "4", "--steps", str(STEPS),
                                            "--schedule", "interleaved",
                                            "--ckpt-dir", str(work)],
                                 launcher="mpirun", env=host_env)
    proc = hosts.popen(argv, env=host_env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    lines, signalled = [], None
    deadline = time.monotonic() + train_jobs.LIMIT_S
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line)
        words = line.split()
        if signalled is None and words[:1] == ["3"] and len(words) >= 3:  # step 3 done
            pids = train_jobs.rank_pids(hosts)
            assert sorted(pids) == ["h1", "h2", "h3", "h4"], pids
            for host_pids in pids.values():
                for pid in host_pids:
                    os.kill(pid, signal.SIGTERM)
            signalled = time.monotonic()
        if time.monotonic() > deadline:
            break
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        hosts.kill_all()
        pytest.fail("the preempted job did not end:\n" + "".join(lines))
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert f"resumed from {work / 'ckpt'} at step 2" in out
    assert "interleaved: 8 stages on 4 groups" in out
    assert signalled is not None, out
    stopped = [line for line in lines if line.startswith("stopping after step ")]
    assert len(stopped) == 1 and "SIGTERM" in stopped[0], out
    step = int(stopped[0].split()[3])
    assert 3 <= step < STEPS - 1, out
    assert _manifest_step(work / "ckpt") == step + 1
    assert "jax.jit" not in out  # stopped before the end: no check yet


def test_resumed_on_1_host_of_4_ranks_matches_jax_jit_over_every_step(
        module_hosts, host_env, work):
    hosts = module_hosts(4)
    first = _manifest_step(work / "ckpt")
    assert 3 < first < STEPS, "needs the preempted run's checkpoint"
    proc = run_train(hosts, [4, 0, 0, 0], ["--microbatches", "4", "--steps", str(STEPS),
                                           "--schedule", "zerobubble",
                                           "--ckpt-dir", str(work)], env=host_env)
    loss, param = matched_jax_jit(proc, steps=STEPS)
    assert loss <= TOL[0] and param <= TOL[1]
    assert f"resumed from {work / 'ckpt'} at step {first}" in proc.stdout
    assert "zerobubble: 4 stages on 4 groups" in proc.stdout
    assert _manifest_step(work / "ckpt") == STEPS


def _values() -> dict:
    rng = np.random.default_rng(7)
    return {"embed": rng.normal(size=(8, 4)).astype(np.float32),
            "blocks": [{"w": rng.normal(size=(4, 6)).astype(np.float32),
                        "b": rng.normal(size=6).astype(ml_dtypes.bfloat16)}
                       for _ in range(4)],
            "step": np.int32(12)}


def test_reshard_cli_across_hosts_places_and_gathers_every_leaf(module_hosts, host_env,
                                                                 tmp_path):
    """Whole -> 4 groups (block i on group i, one rank each, 2 per host) -> whole again,
    each conversion a job on 2 hosts; the files end byte for byte as numpy wrote them."""
    import jax
    from jax.sharding import PartitionSpec as P

    import jaxpp_mpi as jp
    from jaxpp_mpi import checkpoint as ck

    hosts = module_hosts(4)
    values = _values()
    full, staged, back = (str(tmp_path / n) for n in ("full", "staged", "back"))
    ck.save(full, values, step=12)
    mesh = jp.MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
    on = lambda ids, spec=None: jp.MpmdSharding(mesh, ids, spec)  # noqa: E731
    plan = str(tmp_path / "plan.json")
    ck.save_plan(plan, {"embed": on(0, P("data")),
                        "blocks": [{"w": on(i, P(None, "data")), "b": on(i)}
                                   for i in range(4)],
                        "step": on(range(4))}, like=values)

    def reshard(*args: str) -> str:
        proc = hosts.run(hosts.jpprun_argv([2, 2, 0, 0], [
            "python", "-m", "jaxpp_mpi.reshard", *args]), env=host_env,
            timeout=train_jobs.LIMIT_S)
        assert proc.returncode == 0, netns.describe(proc)
        return proc.stdout

    out = reshard("to-mpmd", "--src", full, "--dst", staged, "--plan", plan)
    assert "arrays per rank: 4, 2, 2, 2" in out, out  # rank g holds group g's leaves
    reshard("to-spmd", "--src", staged, "--dst", back)
    files = sorted(os.listdir(f"{full}/arrays"))
    assert len(files) == 10 and files == sorted(os.listdir(f"{back}/arrays"))
    for name in files:
        assert Path(f"{full}/arrays/{name}").read_bytes() == \
            Path(f"{back}/arrays/{name}").read_bytes(), name
    got = ck.load_whole(staged)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(values)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a.reshape(-1).view(np.uint8),
                                      b.reshape(-1).view(np.uint8))
