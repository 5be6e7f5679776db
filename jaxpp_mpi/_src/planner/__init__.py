"""The schedule planner: every schedule simulated on a traced step, ranked (`plan_schedules`).

Pure passes over plain data (candidates.py, costs.py, split.py, ranking.py) import
neither JAX nor MPI; restage.py rewrites a traced step, families.py compiles one task
of each kind per stage segment for XLA's cost and memory analyses, plan.py wires them
and cli.py is `python -m jaxpp_mpi.schedules plan`.
"""
