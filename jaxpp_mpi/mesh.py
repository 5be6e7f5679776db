"""JaxPP's `jaxpp.mesh` path: `from jaxpp_mpi.mesh import MpmdMesh` as a port writes it."""

from jaxpp_mpi._src.arrays.make_mesh import make_mpmd_mesh as make_mpmd_mesh
from jaxpp_mpi._src.arrays.mesh import MpmdMesh as MpmdMesh

__all__ = ["MpmdMesh", "make_mpmd_mesh"]
