"""The MPI layer at the bottom: the only modules importing mpi4py and mpi4jax."""
