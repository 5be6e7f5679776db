"""``python -m jaxpp_mpi.schedules``: the schedule viewer (`jaxpp_mpi._src.schedules.cli`)."""

import sys

from jaxpp_mpi._src.schedules.cli import main as main

if __name__ == "__main__":
    sys.exit(main())
