"""Launching (stdlib only): the launchers' environment, device binding per rank, the
settings `import jaxpp_mpi` applies (auto.py), jpprun."""
