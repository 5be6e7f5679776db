"""8 and 16 ranks across hosts (`make test-hosts-long`): one step of the tiny example,
matching `jax.jit`: 8 stages on 4 hosts x 2, 4 stages x 2 replicas on 2 hosts x 4, and
8 stages x 2 replicas on 4 hosts x 4 (16 ranks on this machine's cores: slow, one step)."""

from __future__ import annotations

import pytest
from train_jobs import matched_jax_jit, run_train

TOL = (1e-4, 1e-3)


@pytest.mark.timeout(900)  # 16 ranks on 2 cores: minutes
@pytest.mark.parametrize("per_host, replicas, stages", [
    ([2, 2, 2, 2], 1, 8),
    ([4, 4, 0, 0], 2, 4),
    ([4, 4, 4, 4], 2, 8),
], ids=["8_stages", "4_stages_x_2", "8_stages_x_2"])
def test_more_ranks_match_jax_jit(module_hosts, host_env, per_host, replicas, stages):
    proc = run_train(module_hosts(4), per_host,
                     ["--replicas", str(replicas), "--steps", "1",
                      "--microbatches", str(stages * replicas)], env=host_env, timeout=600)
    loss, param = matched_jax_jit(proc, steps=1)
    assert loss <= TOL[0] and param <= TOL[1]
    assert f"{stages} stages on {stages} groups" in proc.stdout
