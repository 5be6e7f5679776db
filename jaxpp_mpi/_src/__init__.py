"""Private implementation of jaxpp_mpi; import the public names from `jaxpp_mpi`."""
