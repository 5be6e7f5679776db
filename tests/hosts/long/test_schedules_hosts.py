"""The long matrix across hosts (`make test-hosts-long`): every schedule of the example on
2 hosts x 2 ranks, a pipeline replica per host, hosts given 1, 2 and 1 ranks, and groups
of several devices split over hosts, each run matching `jax.jit` (the example's own
check: loss and final parameters)."""

from __future__ import annotations

import pytest
from train_jobs import matched_jax_jit, run_train

from jaxpp_mpi.schedules import SCHEDULE_NAMES

TOL = (1e-4, 1e-3)
pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_every_schedule_on_2_hosts_x_2_ranks(module_hosts, host_env, schedule):
    proc = run_train(module_hosts(3), [2, 2, 0], ["--schedule", schedule, "--steps", "2",
                                                  "--microbatches", "8"], env=host_env)
    loss, param = matched_jax_jit(proc, steps=2)
    assert loss <= TOL[0] and param <= TOL[1]
    assert f"{schedule}: " in proc.stdout and " on 4 groups of 1 device(s)" in proc.stdout


def test_a_replica_per_host(module_hosts, host_env):
    """Replica r on host r: pipeline messages stay on a host, the reduction crosses."""
    proc = run_train(module_hosts(3), [2, 2, 0], ["--replicas", "2", "--steps", "2",
                                                  "--microbatches", "4"], env=host_env)
    loss, param = matched_jax_jit(proc, steps=2)
    assert loss <= TOL[0] and param <= TOL[1]
    assert "x 2 replicas" in proc.stdout


def test_hosts_with_1_2_and_1_ranks_under_a_plain_mpirun(module_hosts, host_env):
    proc = run_train(module_hosts(3), [1, 2, 1], ["--schedule", "eager1f1b", "--steps", "2",
                                                  "--microbatches", "4"], env=host_env,
                     launcher="mpirun")
    loss, param = matched_jax_jit(proc, steps=2)
    assert loss <= TOL[0] and param <= TOL[1]


def test_groups_of_4_devices_on_2_hosts(module_hosts, host_env):
    """One rank per host, each group 2 x 2 devices (batch rows over "data", weights
    Megatron-split over "model"): every stage boundary crosses hosts shard by shard."""
    proc = run_train(module_hosts(3), [1, 1, 0], ["--data-axis", "2", "--model-axis", "2",
                                                  "--steps", "2", "--microbatches", "4"],
                     env=host_env)
    loss, param = matched_jax_jit(proc, steps=2)
    assert loss <= TOL[0] and param <= TOL[1]
    assert "2 groups of 4 device(s) (data=2, model=2)" in proc.stdout
