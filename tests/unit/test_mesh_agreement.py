"""`make_mpmd_mesh`'s arguments compared across ranks before any communicator
(`Note: mesh agreement` in arrays/mesh_agreement.py), with stand-in communicators: no MPI."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from jaxpp_mpi._src.arrays.make_mesh import make_mpmd_mesh
from jaxpp_mpi._src.arrays.mesh_agreement import (
    MeshReport,
    differing_arguments_error,
    rank_ranges,
    spell_arguments,
)

REPLICATED = ((2, 2, 1), ("replica", "stage", "data"), "stage", "replica", None)


def report(shapes, names, mpmd, replica=None, types=None) -> MeshReport:
    return MeshReport(spell_arguments(shapes, names, mpmd, replica, types), "a mesh", 1,
                      None, types is not None)


def test_one_mesh_spelled_two_ways_compares_equal():
    a = spell_arguments((2, 4), ("stage", "data"), "stage", None, None)
    b = spell_arguments([np.int64(2), 4.0], ["stage", "data"], "stage", None,
                        [AxisType.Auto, AxisType.Auto])
    assert a == b
    assert dict(a)["axis_types"] == "('Auto', 'Auto')"
    assert a != spell_arguments((2, 4), ("stage", "data"), "data", None, None)


@pytest.mark.parametrize("bad", [None, 3, ("two", 4), object()])
def test_malformed_arguments_are_spelled_not_raised(bad):
    spelled = dict(spell_arguments(bad, bad, bad, bad, bad))
    assert spelled["axis_shapes"] == repr(bad)


@pytest.mark.parametrize("ranks, text", [
    ([3], "rank 3"), ([0, 1, 2], "ranks 0-2"), ([5, 0, 2, 6, 7], "ranks 0, 2, 5-7"),
    ([1, 3], "ranks 1, 3")])
def test_rank_ranges(ranks, text):
    assert rank_ranges(ranks) == text


def test_same_arguments_everywhere_is_no_error():
    assert differing_arguments_error([report(*REPLICATED)] * 4) is None


def test_differing_arguments_are_named_with_every_ranks_value():
    reports = [report(*REPLICATED)] * 3 + [report((4, 1), ("stage", "data"), "stage")]
    reports[3] = reports[3]._replace(mesh="another mesh")
    text = str(differing_arguments_error(reports))
    assert text.startswith("make_mpmd_mesh was called with different arguments on "
                           "different ranks:\n")
    assert "\n  axis_shapes: (2, 2, 1) on ranks 0-2; (4, 1) on rank 3\n" in text
    assert ("\n  axis_names: ('replica', 'stage', 'data') on ranks 0-2; ('stage', 'data') "
            "on rank 3\n") in text
    assert "\n  replica_axis_name: 'replica' on ranks 0-2; None on rank 3\n" in text
    assert "mpmd_axis_name" not in text.split("so the ranks")[0]
    # axis_types left to their default follow axis_names: not a difference of their own
    assert "axis_types:" not in text
    assert "different meshes: a mesh on ranks 0-2; another mesh on rank 3." in text
    assert "Every rank must pass the same arguments" in text


def test_axis_types_given_on_some_ranks_are_compared():
    auto = report((2, 1), ("stage", "data"), "stage")
    explicit = report((2, 1), ("stage", "data"), "stage",
                      types=(AxisType.Explicit, AxisType.Explicit))
    text = str(differing_arguments_error([auto, explicit]))
    assert "  axis_types: ('Auto', 'Auto') on rank 0; ('Explicit', 'Explicit') on rank 1" in text
    same = report((2, 1), ("stage", "data"), "stage", types=(AxisType.Auto,) * 2)
    assert differing_arguments_error([auto, same]) is None


class PeerComm:
    """Rank 0 of 2 whose peer reports `peer`; records the collectives asked of it."""

    def __init__(self, peer: MeshReport | None):
        self.peer, self.calls = peer, []

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's name
        return 0

    def Get_size(self) -> int:  # noqa: N802 - mpi4py's name
        return 2

    def allgather(self, obj):
        self.calls.append("allgather")
        return [obj, self.peer or obj]

    def Split(self, color, key):  # noqa: N802 - mpi4py's name
        self.calls.append("Split")
        return self

    def Dup(self):  # noqa: N802 - mpi4py's name
        self.calls.append("Dup")
        return self


def test_make_mpmd_mesh_refuses_a_peer_asking_for_another_mesh_before_any_communicator():
    peer = MeshReport(spell_arguments((2, 8), ("stage", "data"), "stage", None, None),
                      "the peer's mesh", 8, None, False)
    comm = PeerComm(peer)
    with pytest.raises(ValueError, match=r"axis_shapes: \(2, 4\) on rank 0; \(2, 8\) on "
                                         r"rank 1") as info:
        make_mpmd_mesh((2, 4), ("stage", "data"), "stage", comm,
                       devices=jax.devices()[:4])
    assert comm.calls == ["allgather"]  # one round, then nothing more
    assert ("the ranks would build different meshes: {'stage': 2, 'data': 4}, MPMD axis "
            "'stage': 1 replica(s) of 2 group(s) of 4 device(s) on rank 0; the peer's "
            "mesh on rank 1") in str(info.value)
    # every rank raises it: the abort hook lets the peers print theirs first
    assert getattr(info.value, "_jaxpp_mpi_raised_on_every_rank", False)


def test_make_mpmd_mesh_agrees_then_builds():
    comm = PeerComm(None)
    mesh = make_mpmd_mesh((2, 4), ("stage", "data"), "stage", comm, devices=jax.devices()[:4])
    assert comm.calls[0] == "allgather" and mesh.mpmd_dim == 2
    assert mesh.group_shape == {"data": 4}


def test_a_peer_with_other_devices_is_named_after_the_same_arguments():
    peer = MeshReport(spell_arguments((2, 4), ("stage", "data"), "stage", None, None),
                      "", 2, None, False)
    with pytest.raises(ValueError, match=r"each rank needs 4 devices .* \(rank\(s\) \[1\] "
                                         r"have \[2\]\)"):
        make_mpmd_mesh((2, 4), ("stage", "data"), "stage", PeerComm(peer),
                       devices=jax.devices()[:4])
