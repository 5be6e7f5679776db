"""Launching (stdlib only): the launchers' environment, device binding per rank, jpprun."""
