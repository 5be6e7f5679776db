"""jaxpp_mpi: MPMD pipeline parallelism for JAX over MPI."""
