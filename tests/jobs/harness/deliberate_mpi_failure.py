"""Not collected by `make test`: run by tests/unit/test_mpi_harness.py under 2 ranks.

Rank 1 fails while rank 0 waits at a barrier that rank 1 never reaches. Without the
abort-on-failure harness (tests/conftest.py), rank 0 would wait forever.
"""

import pytest
from mpi4py import MPI


@pytest.mark.mpi(min_size=2)
def test_rank1_fails_while_rank0_waits():
    comm = MPI.COMM_WORLD
    assert comm.rank != 1, "deliberate failure on rank 1"
    comm.Barrier()
