"""The primitives a step is written with: stage marks, treduce, and the
cross-group reductions and stacks."""
