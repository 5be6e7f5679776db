"""Device binding for scripts started by any MPI launcher (mpirun, srun, mpiexec.hydra).

    import jaxpp_mpi.launch
    jaxpp_mpi.launch.bind_local_devices()   # before JAX creates its backends
    import jax

or, without touching the script, on every rank:
`srun python -m jaxpp_mpi.launch --gpus-per-rank 1 -- python train.py`.

`deadline(label)` puts the script's own MPI calls between steps under the deadline of
jaxpp_mpi's collectives: a rank that never joins one ends the job, every waiting rank
naming the label (docs/reliability.md):

    with jaxpp_mpi.launch.deadline("loss broadcast"):
        loss = comm.bcast(loss, root=last)

Importing this module does not import JAX.
"""

from __future__ import annotations

import sys

from jaxpp_mpi._src.launch.bind import Binding as Binding
from jaxpp_mpi._src.launch.bind import bind_local_devices as bind_local_devices
from jaxpp_mpi._src.launch.bind import main as _main
from jaxpp_mpi._src.launch.bind import plan_binding as plan_binding
from jaxpp_mpi._src.launch.env import BindError as BindError
from jaxpp_mpi._src.launch.env import LocalRank as LocalRank
from jaxpp_mpi._src.launch.env import detect_local_rank as detect_local_rank
from jaxpp_mpi._src.launch.env import launcher_world_size as launcher_world_size
from jaxpp_mpi._src.runtime.failure import deadline as deadline

__all__ = ["BindError", "Binding", "LocalRank", "bind_local_devices", "deadline",
           "detect_local_rank", "launcher_world_size", "plan_binding"]

if __name__ == "__main__":
    sys.exit(_main())
