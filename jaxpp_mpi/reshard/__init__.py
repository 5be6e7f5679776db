"""The checkpoint reshard utility; run it as `python -m jaxpp_mpi.reshard` (see __main__)."""
