"""Not a test: a 2-rank script whose rank 1 raises while rank 0 waits in a receive."""

from mpi4py import MPI

comm = MPI.COMM_WORLD
if comm.rank == 1:
    raise RuntimeError("deliberate uncaught exception on rank 1")
comm.recv(source=1)
