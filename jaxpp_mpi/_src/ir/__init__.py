"""The program IR: instructions, lowering passes, rendezvous simulation (no JAX, no MPI)."""
