"""Launching: device binding per rank and the jpprun command line (stdlib only)."""
