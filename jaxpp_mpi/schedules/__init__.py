"""Pipeline schedules, their checker and analysis (pure Python: no JAX, no MPI)."""

from jaxpp_mpi._src.schedule_check import ScheduleAnalysis as ScheduleAnalysis
from jaxpp_mpi._src.schedule_check import ScheduleError as ScheduleError
from jaxpp_mpi._src.schedule_check import TimelineEntry as TimelineEntry
from jaxpp_mpi._src.schedule_check import analyze_schedule as analyze_schedule
from jaxpp_mpi._src.schedule_check import check_schedule as check_schedule
from jaxpp_mpi._src.schedule_csv import CustomSchedule as CustomSchedule
from jaxpp_mpi._src.schedule_csv import schedule_to_csv as schedule_to_csv
from jaxpp_mpi._src.schedules import SCHEDULE_NAMES as SCHEDULE_NAMES
from jaxpp_mpi._src.schedules import BaseSchedule as BaseSchedule
from jaxpp_mpi._src.schedules import DualPipeV as DualPipeV
from jaxpp_mpi._src.schedules import Eager1F1B as Eager1F1B
from jaxpp_mpi._src.schedules import GPipe as GPipe
from jaxpp_mpi._src.schedules import Interleaved1F1B as Interleaved1F1B
from jaxpp_mpi._src.schedules import KimiK2 as KimiK2
from jaxpp_mpi._src.schedules import Std1F1B as Std1F1B
from jaxpp_mpi._src.schedules import Task as Task
from jaxpp_mpi._src.schedules import TaskType as TaskType
from jaxpp_mpi._src.schedules import ZeroBubble as ZeroBubble
from jaxpp_mpi._src.schedules import schedule_by_name as schedule_by_name

__all__ = [
    "BaseSchedule",
    "CustomSchedule",
    "DualPipeV",
    "Eager1F1B",
    "GPipe",
    "Interleaved1F1B",
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
