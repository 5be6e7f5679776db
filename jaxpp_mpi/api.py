"""JaxPP's `jaxpp.api` names, where jaxpp_mpi has them (`jaxpp_mpi.api.X` is `jaxpp_mpi.X`).

A script written for JaxPP imports `jaxpp.api` (or `from jaxpp.api import ...`); with
`import jaxpp_mpi.api as jaxpp` it finds the same names here, plus `make_mpmd_mesh` for
the one line a port changes besides the import (the mesh line), and `process_allgather`
for a result read on every process (JaxPP's processes read their own replica).
docs/porting-from-jaxpp.md lists the names JaxPP's module has and this one does not,
and why.
"""

from jaxpp_mpi._src.arrays.array import MpmdArray as MpmdArray
from jaxpp_mpi._src.arrays.make_mesh import make_mpmd_mesh as make_mpmd_mesh
from jaxpp_mpi._src.arrays.mesh import MpmdMesh as MpmdMesh
from jaxpp_mpi._src.arrays.sharding import MpmdSharding as MpmdSharding
from jaxpp_mpi._src.driver.fetch import process_allgather as process_allgather
from jaxpp_mpi._src.frontend.api import mpmd_jit_with_loop as mpmd_jit_with_loop
from jaxpp_mpi._src.frontend.by_yield import mpmd_jit_by_yield as mpmd_jit_by_yield
from jaxpp_mpi._src.primitives.cross_mpmd import cross_mpmd_all_reduce as cross_mpmd_all_reduce
from jaxpp_mpi._src.primitives.cross_mpmd import cross_mpmd_stack as cross_mpmd_stack
from jaxpp_mpi._src.primitives.cross_mpmd import place_with as place_with
from jaxpp_mpi._src.primitives.stage_marks import mark_stage_end as mark_stage_end
from jaxpp_mpi._src.primitives.stage_marks import pipeline_enter_stage as pipeline_enter_stage
from jaxpp_mpi._src.primitives.treduce import Add as Add
from jaxpp_mpi._src.primitives.treduce import Concat as Concat
from jaxpp_mpi._src.primitives.treduce import Max as Max
from jaxpp_mpi._src.primitives.treduce import treduce as treduce
from jaxpp_mpi._src.primitives.treduce import treduce_i as treduce_i
from jaxpp_mpi._src.reshard.reshard import mpmd_to_spmd_reshard as mpmd_to_spmd_reshard
from jaxpp_mpi._src.reshard.reshard import spmd_to_mpmd_reshard as spmd_to_mpmd_reshard
from jaxpp_mpi._src.schedules.library import BaseSchedule as BaseSchedule
from jaxpp_mpi._src.schedules.library import DualPipeV as DualPipeV
from jaxpp_mpi._src.schedules.library import Eager1F1B as Eager1F1B
from jaxpp_mpi._src.schedules.library import Interleaved1F1B as Interleaved1F1B
from jaxpp_mpi._src.schedules.library import KimiK2 as KimiK2
from jaxpp_mpi._src.schedules.library import Std1F1B as Std1F1B
from jaxpp_mpi._src.schedules.library import ZeroBubble as ZeroBubble
from jaxpp_mpi._src.timeline.timing import collect_task_times_ms as collect_task_times_ms

__all__ = [
    "Add",
    "BaseSchedule",
    "Concat",
    "DualPipeV",
    "Eager1F1B",
    "Interleaved1F1B",
    "KimiK2",
    "Max",
    "MpmdArray",
    "MpmdMesh",
    "MpmdSharding",
    "Std1F1B",
    "ZeroBubble",
    "collect_task_times_ms",
    "cross_mpmd_all_reduce",
    "cross_mpmd_stack",
    "make_mpmd_mesh",
    "mark_stage_end",
    "mpmd_jit_by_yield",
    "mpmd_jit_with_loop",
    "mpmd_to_spmd_reshard",
    "pipeline_enter_stage",
    "place_with",
    "process_allgather",
    "spmd_to_mpmd_reshard",
    "treduce",
    "treduce_i",
]
