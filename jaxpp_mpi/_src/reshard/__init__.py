"""Layout changes between whole-model (SPMD) and per-group (MPMD) arrays."""
