"""`python -m jaxpp_mpi.reshard {to-mpmd,to-spmd,repartition} --src ... --dst ... [--plan ...]`.

Run under MPI (`launch/jpprun -n N python -m jaxpp_mpi.reshard ...`) or in one process.
"""

import sys

from jaxpp_mpi._src.reshard.cli import main

if __name__ == "__main__":
    sys.exit(main())
