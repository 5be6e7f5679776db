"""jaxpp_mpi: MPMD pipeline parallelism for JAX, launched and connected by MPI."""

from jaxpp_mpi._src.primitives import mark_stage_end as mark_stage_end
from jaxpp_mpi._src.primitives import pipeline_enter_stage as pipeline_enter_stage
from jaxpp_mpi._src.schedule_check import ScheduleError as ScheduleError
from jaxpp_mpi._src.schedule_csv import CustomSchedule as CustomSchedule
from jaxpp_mpi._src.schedules import BaseSchedule as BaseSchedule
from jaxpp_mpi._src.schedules import DualPipeV as DualPipeV
from jaxpp_mpi._src.schedules import Eager1F1B as Eager1F1B
from jaxpp_mpi._src.schedules import GPipe as GPipe
from jaxpp_mpi._src.schedules import Interleaved1F1B as Interleaved1F1B
from jaxpp_mpi._src.schedules import KimiK2 as KimiK2
from jaxpp_mpi._src.schedules import Std1F1B as Std1F1B
from jaxpp_mpi._src.schedules import ZeroBubble as ZeroBubble
from jaxpp_mpi._src.treduce import Add as Add
from jaxpp_mpi._src.treduce import Concat as Concat
from jaxpp_mpi._src.treduce import Max as Max
from jaxpp_mpi._src.treduce import Op as Op
from jaxpp_mpi._src.treduce import treduce as treduce
from jaxpp_mpi._src.treduce import treduce_i as treduce_i

__all__ = [
    "Add",
    "BaseSchedule",
    "Concat",
    "CustomSchedule",
    "DualPipeV",
    "Eager1F1B",
    "GPipe",
    "Interleaved1F1B",
    "KimiK2",
    "Max",
    "Op",
    "ScheduleError",
    "Std1F1B",
    "ZeroBubble",
    "mark_stage_end",
    "pipeline_enter_stage",
    "treduce",
    "treduce_i",
]
