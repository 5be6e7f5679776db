"""Checkpoints: atomic per-group saves, asynchronous saves, a directory of steps, checked
restores, whole-model loads, placement plans."""

from jaxpp_mpi._src.checkpoint.async_save import AsyncSave as AsyncSave
from jaxpp_mpi._src.checkpoint.async_save import save_async as save_async
from jaxpp_mpi._src.checkpoint.async_save import wait_for_saves as wait_for_saves
from jaxpp_mpi._src.checkpoint.format import CheckpointError as CheckpointError
from jaxpp_mpi._src.checkpoint.format import LeafEntry as LeafEntry
from jaxpp_mpi._src.checkpoint.format import Manifest as Manifest
from jaxpp_mpi._src.checkpoint.format import Placement as Placement
from jaxpp_mpi._src.checkpoint.manager import CheckpointManager as CheckpointManager
from jaxpp_mpi._src.checkpoint.plan import Plan as Plan
from jaxpp_mpi._src.checkpoint.plan import PlanEntry as PlanEntry
from jaxpp_mpi._src.checkpoint.store import find as find
from jaxpp_mpi._src.checkpoint.store import load_plan as load_plan
from jaxpp_mpi._src.checkpoint.store import load_whole as load_whole
from jaxpp_mpi._src.checkpoint.store import read_manifest as read_manifest
from jaxpp_mpi._src.checkpoint.store import restore as restore
from jaxpp_mpi._src.checkpoint.store import save as save
from jaxpp_mpi._src.checkpoint.store import save_plan as save_plan

__all__ = ["AsyncSave", "CheckpointError", "CheckpointManager", "LeafEntry", "Manifest",
           "Placement", "Plan", "PlanEntry", "find", "load_plan", "load_whole",
           "read_manifest", "restore", "save", "save_async", "save_plan", "wait_for_saves"]
