"""Pipeline schedules, their checker and analysis (pure Python: no JAX, no MPI)."""

from jaxpp_mpi._src.schedules.check import ScheduleAnalysis as ScheduleAnalysis
from jaxpp_mpi._src.schedules.check import ScheduleError as ScheduleError
from jaxpp_mpi._src.schedules.check import TimelineEntry as TimelineEntry
from jaxpp_mpi._src.schedules.check import analyze_schedule as analyze_schedule
from jaxpp_mpi._src.schedules.check import check_schedule as check_schedule
from jaxpp_mpi._src.schedules.custom import CustomSchedule as CustomSchedule
from jaxpp_mpi._src.schedules.custom import schedule_to_csv as schedule_to_csv
from jaxpp_mpi._src.schedules.library import SCHEDULE_NAMES as SCHEDULE_NAMES
from jaxpp_mpi._src.schedules.library import BaseSchedule as BaseSchedule
from jaxpp_mpi._src.schedules.library import DualPipeV as DualPipeV
from jaxpp_mpi._src.schedules.library import Eager1F1B as Eager1F1B
from jaxpp_mpi._src.schedules.library import GPipe as GPipe
from jaxpp_mpi._src.schedules.library import Interleaved1F1B as Interleaved1F1B
from jaxpp_mpi._src.schedules.library import InterleavedBaseSchedule as InterleavedBaseSchedule
from jaxpp_mpi._src.schedules.library import KimiK2 as KimiK2
from jaxpp_mpi._src.schedules.library import Std1F1B as Std1F1B
from jaxpp_mpi._src.schedules.library import ZeroBubble as ZeroBubble
from jaxpp_mpi._src.schedules.library import schedule_by_name as schedule_by_name
from jaxpp_mpi._src.schedules.tasks import Task as Task
from jaxpp_mpi._src.schedules.tasks import TaskType as TaskType

__all__ = [
    "BaseSchedule",
    "CustomSchedule",
    "DualPipeV",
    "Eager1F1B",
    "GPipe",
    "Interleaved1F1B",
    "InterleavedBaseSchedule",
    "KimiK2",
    "SCHEDULE_NAMES",
    "ScheduleAnalysis",
    "ScheduleError",
    "Std1F1B",
    "Task",
    "TaskType",
    "TimelineEntry",
    "ZeroBubble",
    "analyze_schedule",
    "check_schedule",
    "schedule_by_name",
    "schedule_to_csv",
]
