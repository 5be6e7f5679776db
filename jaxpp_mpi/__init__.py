"""jaxpp_mpi: MPMD pipeline parallelism for JAX, launched and connected by MPI.

The public names are re-exported lazily (PEP 562): `import jaxpp_mpi.schedules` and the
schedule CLI stay free of JAX and MPI, and `jaxpp_mpi.X` imports X's module on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from jaxpp_mpi._src.launch.auto import apply_auto_settings as _apply_auto_settings

# This rank's CPU settings under any MPI launcher, before anything can create JAX's
# backends (Note: Settings at import in _src/launch/auto.py; JAXPP_MPI_AUTO_SETTINGS=0: off).
_apply_auto_settings()

# public name -> private module under jaxpp_mpi._src
_EXPORTS = {
    "MpmdCompiled": "driver.compiled",
    "process_allgather": "driver.fetch",
    "MpmdFunction": "frontend.api",
    "mpmd_jit_with_loop": "frontend.api",
    "mpmd_jit_by_yield": "frontend.by_yield",
    "cross_mpmd_all_reduce": "primitives.cross_mpmd",
    "cross_mpmd_stack": "primitives.cross_mpmd",
    "place_with": "primitives.cross_mpmd",
    "MpmdArray": "arrays.array",
    "MpmdSharding": "arrays.sharding",
    "CompileError": "base.errors",
    "MpmdMesh": "arrays.mesh",
    "make_mpmd_mesh": "arrays.make_mesh",
    "collect_task_times_ms": "timeline.timing",
    "PreemptionGuard": "runtime.preemption",
    "Plan": "planner.ranking",
    "format_plans": "planner.ranking",
    "plan_schedules": "planner.plan",
    "RuntimeCost": "planner.runtime_cost",
    "mpmd_init": "reshard.init",
    "mark_stage_end": "primitives.stage_marks",
    "pipeline_enter_stage": "primitives.stage_marks",
    "mpmd_to_spmd_reshard": "reshard.reshard",
    "spmd_to_mpmd_reshard": "reshard.reshard",
    "ScheduleError": "schedules.check",
    "CustomSchedule": "schedules.custom",
    "BaseSchedule": "schedules.library",
    "DualPipeV": "schedules.library",
    "Eager1F1B": "schedules.library",
    "GPipe": "schedules.library",
    "Interleaved1F1B": "schedules.library",
    "InterleavedBaseSchedule": "schedules.library",
    "KimiK2": "schedules.library",
    "Std1F1B": "schedules.library",
    "ZeroBubble": "schedules.library",
    "Add": "primitives.treduce",
    "Concat": "primitives.treduce",
    "Max": "primitives.treduce",
    "Op": "primitives.treduce",
    "treduce": "primitives.treduce",
    "treduce_i": "primitives.treduce",
}

__all__ = sorted(_EXPORTS)


# public submodules, imported on first attribute access too (`jaxpp_mpi.checkpoint.save`)
_SUBMODULES = frozenset({"api", "checkpoint", "launch", "mesh", "schedules", "trace"})


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"jaxpp_mpi.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxpp_mpi' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"jaxpp_mpi._src.{module}"), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what static tools see; the same names as _EXPORTS
    from jaxpp_mpi._src.arrays.array import MpmdArray as MpmdArray
    from jaxpp_mpi._src.arrays.make_mesh import make_mpmd_mesh as make_mpmd_mesh
    from jaxpp_mpi._src.arrays.mesh import MpmdMesh as MpmdMesh
    from jaxpp_mpi._src.arrays.sharding import MpmdSharding as MpmdSharding
    from jaxpp_mpi._src.base.errors import CompileError as CompileError
    from jaxpp_mpi._src.driver.compiled import MpmdCompiled as MpmdCompiled
    from jaxpp_mpi._src.driver.fetch import process_allgather as process_allgather
    from jaxpp_mpi._src.frontend.api import MpmdFunction as MpmdFunction
    from jaxpp_mpi._src.frontend.api import mpmd_jit_with_loop as mpmd_jit_with_loop
    from jaxpp_mpi._src.frontend.by_yield import mpmd_jit_by_yield as mpmd_jit_by_yield
    from jaxpp_mpi._src.planner.plan import plan_schedules as plan_schedules
    from jaxpp_mpi._src.planner.ranking import Plan as Plan
    from jaxpp_mpi._src.planner.ranking import format_plans as format_plans
    from jaxpp_mpi._src.planner.runtime_cost import RuntimeCost as RuntimeCost
    from jaxpp_mpi._src.primitives.cross_mpmd import cross_mpmd_all_reduce as cross_mpmd_all_reduce
    from jaxpp_mpi._src.primitives.cross_mpmd import cross_mpmd_stack as cross_mpmd_stack
    from jaxpp_mpi._src.primitives.cross_mpmd import place_with as place_with
    from jaxpp_mpi._src.primitives.stage_marks import mark_stage_end as mark_stage_end
    from jaxpp_mpi._src.primitives.stage_marks import pipeline_enter_stage as pipeline_enter_stage
    from jaxpp_mpi._src.primitives.treduce import Add as Add
    from jaxpp_mpi._src.primitives.treduce import Concat as Concat
    from jaxpp_mpi._src.primitives.treduce import Max as Max
    from jaxpp_mpi._src.primitives.treduce import Op as Op
    from jaxpp_mpi._src.primitives.treduce import treduce as treduce
    from jaxpp_mpi._src.primitives.treduce import treduce_i as treduce_i
    from jaxpp_mpi._src.reshard.init import mpmd_init as mpmd_init
    from jaxpp_mpi._src.reshard.reshard import mpmd_to_spmd_reshard as mpmd_to_spmd_reshard
    from jaxpp_mpi._src.reshard.reshard import spmd_to_mpmd_reshard as spmd_to_mpmd_reshard
    from jaxpp_mpi._src.runtime.preemption import PreemptionGuard as PreemptionGuard
    from jaxpp_mpi._src.schedules.check import ScheduleError as ScheduleError
    from jaxpp_mpi._src.schedules.custom import CustomSchedule as CustomSchedule
    from jaxpp_mpi._src.schedules.library import BaseSchedule as BaseSchedule
    from jaxpp_mpi._src.schedules.library import DualPipeV as DualPipeV
    from jaxpp_mpi._src.schedules.library import Eager1F1B as Eager1F1B
    from jaxpp_mpi._src.schedules.library import GPipe as GPipe
    from jaxpp_mpi._src.schedules.library import Interleaved1F1B as Interleaved1F1B
    from jaxpp_mpi._src.schedules.library import (
        InterleavedBaseSchedule as InterleavedBaseSchedule,
    )
    from jaxpp_mpi._src.schedules.library import KimiK2 as KimiK2
    from jaxpp_mpi._src.schedules.library import Std1F1B as Std1F1B
    from jaxpp_mpi._src.schedules.library import ZeroBubble as ZeroBubble
    from jaxpp_mpi._src.timeline.timing import collect_task_times_ms as collect_task_times_ms
