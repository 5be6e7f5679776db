"""Hello across hosts: each rank prints where it runs, then a ring of messages and an
allreduce prove every rank reaches every other (tests/hosts/test_hosts.py)."""

import socket

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
node = comm.Split_type(MPI.COMM_TYPE_SHARED)
got = comm.sendrecv(rank, dest=(rank + 1) % size, source=(rank - 1) % size)
assert got == (rank - 1) % size, got
total = comm.allreduce(rank)
names = comm.allgather(socket.gethostname())
print(f"hello rank={rank} size={size} host={socket.gethostname()} "
      f"local={node.Get_rank()}/{node.Get_size()} ring_from={got} sum={total} "
      f"hosts={','.join(names)}", flush=True)
