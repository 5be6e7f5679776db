"""Checkpoints in local mode (one process, 4 groups of 2 CPU devices): round trips against
the numpy values saved, atomic replacement under simulated failures, and untrusted
manifests and files rejected before any data is read."""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpp_mpi as jp
from jaxpp_mpi import checkpoint as ck
from jaxpp_mpi._src.arrays.array import mpmd_array_from_local
from jaxpp_mpi._src.checkpoint import leaf_files
from jaxpp_mpi._src.reshard.cli import destination_manifest

MESH = jp.MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
W = 3  # the manifest position of params[0] (leaves in key order: ints, opt, params, plain)


def sharding(ids, spec=None) -> jp.MpmdSharding:
    return jp.MpmdSharding(MESH, ids, spec)


class Pair(NamedTuple):
    mu: object
    nu: object


def reference_values() -> dict:
    """The numpy values a test saves (the reference restores are compared with)."""
    rng = np.random.default_rng(0)
    bf16 = rng.normal(size=(4, 6)).astype(ml_dtypes.bfloat16)
    bits = bf16.view(np.uint16)
    bits[0, :3] = [0x7FC1, 0x8000, 0xFF80]  # a NaN payload, -0.0, -inf: bits must survive
    return {"w": rng.normal(size=(8, 4)).astype(np.float32), "bf16": bf16,
            "ids": rng.integers(-5, 5, size=(3, 2)).astype(np.int32),
            "rep": rng.normal(size=(6,)).astype(np.float32),
            "plain": rng.normal(size=(2, 2)).astype(np.float32), "count": np.int32(7)}


def make_tree(v: dict, place=True) -> dict:
    put = (lambda x, s: mpmd_array_from_local(MESH, x, s)) if place else (lambda x, s: x)
    return {
        "params": [put(v["w"], sharding(1, P("data"))),
                   put(v["bf16"], sharding((0, 2), P(None, "data")))],
        "opt": Pair(mu=put(v["ids"], sharding(3)), nu=put(v["rep"], sharding((0, 1, 2, 3)))),
        "plain": {"x": jnp.asarray(v["plain"]) if place else v["plain"], "n": v["count"]},
        "ints": {4: 2.5},
    }


def flat_expected(v: dict) -> list:
    """The saved numpy values in the tree's leaf order (2.5 as numpy stores a float)."""
    return [np.float64(x) if isinstance(x, float) else x
            for x in jax.tree.leaves(make_tree(v, place=False))]


def assert_bits_equal(got, want) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.reshape(-1).view(np.uint8),
                                  want.reshape(-1).view(np.uint8))


def replicas(x) -> list:
    return list(x.local_arrays.values()) if isinstance(x, jp.MpmdArray) else [x]


@pytest.fixture
def saved(tmp_path):
    v = reference_values()
    tree = make_tree(v)
    path = str(tmp_path / "ckpt")
    ck.save(path, tree, step=12)
    return path, tree, v


def test_round_trip_every_dtype_and_placement(saved):
    path, tree, v = saved
    restored = ck.restore(path, tree)
    want = flat_expected(v)
    leaves = jax.tree.leaves(restored)
    assert jax.tree.structure(restored) == jax.tree.structure(tree)
    assert len(leaves) == len(want)
    for got, ref, like in zip(leaves, want, jax.tree.leaves(tree)):
        assert type(got) is type(like)
        if isinstance(got, jp.MpmdArray):
            assert got.mpmd_sharding == like.mpmd_sharding
            assert len(replicas(got)) == len(got.mpmd_sharding.mesh_ids)
        for r in replicas(got):  # every group's replica holds the saved bits
            assert_bits_equal(r, ref)
    assert restored["ints"][4] == 2.5 and isinstance(restored["ints"][4], float)
    assert ck.read_manifest(path).step == 12


def test_files_are_plain_npy_and_load_whole_needs_no_mesh(saved):
    path, _, v = saved
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    by_name = {str(leaf["path"][-1][1]): leaf for leaf in manifest["leaves"]}
    raw = np.load(os.path.join(path, by_name["1"]["file"]), allow_pickle=False)
    assert raw.dtype == np.dtype("<u2") and by_name["1"]["dtype"] == "bfloat16"
    np.testing.assert_array_equal(raw, v["bf16"].view(np.uint16))
    assert by_name["1"]["placement"] == {"mesh_ids": [0, 2], "spec": [None, "data"]}
    assert by_name["x"]["placement"] is None
    whole = ck.load_whole(path)
    assert sorted(whole) == ["ints", "opt", "params", "plain"]
    assert_bits_equal(whole["params"][1], v["bf16"])
    assert_bits_equal(whole["opt"]["mu"], v["ids"])
    assert_bits_equal(whole["ints"][4], np.float64(2.5))


def test_restore_onto_another_placement(saved):
    path, tree, v = saved
    new = jax.tree.map(lambda x: None, tree)
    new["params"][0] = sharding((1, 3), P(None, "data"))
    new["opt"] = Pair(mu=sharding(0, P(None, "data")), nu=sharding(2))
    restored = ck.restore(path, tree, shardings=new)
    w = restored["params"][0]
    assert w.mpmd_sharding == new["params"][0]
    for r in replicas(w):
        assert_bits_equal(r, v["w"])
    assert restored["opt"].mu.mpmd_idxs == {0}
    assert_bits_equal(restored["opt"].mu.first_mpmd_replica, v["ids"])
    assert isinstance(restored["params"][1], np.ndarray)  # no placement given: plain
    assert_bits_equal(restored["params"][1], v["bf16"])


def test_restore_checks_like_before_reading_any_file(saved):
    path, tree, _ = saved
    for name in os.listdir(os.path.join(path, "arrays")):
        os.remove(os.path.join(path, "arrays", name))
    bad = dict(tree, plain={"x": jnp.zeros((2, 3)), "n": np.int32(0)})
    with pytest.raises(ck.CheckpointError, match=r"\['plain'\]\['x'\]: checkpoint has "
                       r"float32\[2, 2\], `like` float32\[2, 3\]"):
        ck.restore(path, bad)
    missing = {k: tree[k] for k in ("params", "opt")}
    with pytest.raises(ck.CheckpointError, match=r"the checkpoint has \['plain'\]\['x'\]"):
        ck.restore(path, missing)
    as_f16 = dict(tree, opt=Pair(mu=np.zeros((3, 2), np.float16), nu=tree["opt"].nu))
    with pytest.raises(ck.CheckpointError, match="int32.*float16"):
        ck.restore(path, as_f16)


class _Crash(BaseException):
    """A simulated process death: no cleanup code runs past it."""


_REAL_WRITE = leaf_files.write_npy


def _failing_writes(monkeypatch, after: int, exc: BaseException) -> None:
    """The checkpoint writer's .npy writes succeed `after` times, then raise `exc`."""
    calls = []

    def write(file, value):
        calls.append(file)
        if len(calls) > after:
            raise exc
        return _REAL_WRITE(file, value)

    monkeypatch.setattr(leaf_files, "write_npy", write)


def _siblings(path: str) -> list[str]:
    parent, name = os.path.split(path)
    return sorted(n for n in os.listdir(parent) if n != name)


def _assert_holds(path: str, tree, v: dict) -> None:
    for got, ref in zip(jax.tree.leaves(ck.restore(path, tree)), flat_expected(v)):
        for r in replicas(got):
            assert_bits_equal(r, ref)


def test_failed_or_crashed_save_keeps_previous_checkpoint(saved, monkeypatch):
    path, tree, v = saved
    v2 = {k: (x + 1).astype(x.dtype) for k, x in v.items()}
    tree2 = make_tree(v2)
    with pytest.raises(ck.CheckpointError, match="exists; pass overwrite=True"):
        ck.save(path, tree2)
    _failing_writes(monkeypatch, 2, OSError("disk full"))  # an error: cleaned up
    with pytest.raises(OSError, match="disk full"):
        ck.save(path, tree2, overwrite=True)
    assert _siblings(path) == []
    _assert_holds(path, tree, v)
    _failing_writes(monkeypatch, 3, _Crash())  # a crash mid-save: the temp dir stays
    with pytest.raises(_Crash):
        ck.save(path, tree2, overwrite=True)
    assert [n.startswith(".ckpt.tmp-") for n in _siblings(path)] == [True]
    _assert_holds(path, tree, v)
    # A crash between the commit's two renames leaves the old checkpoint aside: restore
    # says where, and the next save puts it back before writing.
    old = os.path.join(os.path.dirname(path), ".ckpt.old-123456")
    os.rename(path, old)
    with pytest.raises(ck.CheckpointError, match=r"\.ckpt\.old-123456"):
        ck.restore(path, tree)
    _failing_writes(monkeypatch, 0, OSError("still full"))
    with pytest.raises(OSError, match="still full"):
        ck.save(path, tree2, overwrite=True)
    assert _siblings(path) == []  # stale temp dir removed, old checkpoint renamed back
    _assert_holds(path, tree, v)
    monkeypatch.undo()
    ck.save(path, tree2, step=13, overwrite=True)
    _assert_holds(path, tree, v2)
    assert ck.read_manifest(path).step == 13 and _siblings(path) == []


def test_never_replaces_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("precious")
    with pytest.raises(ck.CheckpointError, match="not a checkpoint"):
        ck.save(str(tmp_path / "data"), {"a": np.ones(2)}, overwrite=True)
    assert (tmp_path / "data" / "keep.txt").read_text() == "precious"


def _edit_manifest(path: str, edit) -> None:
    file = os.path.join(path, "manifest.json")
    manifest = json.load(open(file))
    edit(manifest)
    with open(file, "w") as f:
        json.dump(manifest, f)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["leaves"][W].update(file="../../outside.npy"), "must stay inside"),
    (lambda m: m["leaves"][W].update(file="/etc/passwd"), "must stay inside"),
    (lambda m: m["leaves"][W].update(dtype="object"), "unsupported dtype 'object'"),
    (lambda m: m["leaves"][W].update(shape=[-1, 4]), "non-negative ints"),
    (lambda m: m["leaves"][1].update(file=m["leaves"][0]["file"]), "repeats"),
    (lambda m: m["leaves"][W]["placement"].update(mesh_ids=[9]), "exceed mpmd_dim"),
    (lambda m: m["leaves"][W]["path"].append(["eval", "os.system"]), "bad path entry"),
    (lambda m: m.update(format="pickle"), "not a jaxpp_mpi.checkpoint"),
])
def test_malformed_manifest_rejected(saved, edit, message):
    path, tree, _ = saved
    _edit_manifest(path, edit)
    with pytest.raises(ck.CheckpointError, match=message):
        ck.restore(path, tree)


def test_untrusted_files_rejected_before_allocation(saved, tmp_path):
    path, tree, _ = saved
    manifest = ck.read_manifest(path)
    assert manifest.leaves[W].path == (("key", "params"), ("idx", 0))
    first = os.path.join(path, manifest.leaves[W].file)
    os.remove(first)
    os.symlink(str(tmp_path), first)  # a link out of the checkpoint
    with pytest.raises(ck.CheckpointError, match="outside the checkpoint"):
        ck.load_whole(path)
    os.remove(first)
    np.save(first, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ck.CheckpointError, match=r"holds \|O\[1\]"):
        ck.load_whole(path)
    np.save(first, np.zeros((8, 4), np.float32)[:, :3])  # right dtype, wrong shape
    with pytest.raises(ck.CheckpointError, match=r"holds <f4\[8, 3\]"):
        ck.restore(path, tree)
    np.save(first, np.zeros((8, 4), np.float32))
    with open(first, "r+b") as f:
        f.truncate(os.path.getsize(first) - 4)
    with pytest.raises(ck.CheckpointError, match="bytes, expected"):
        ck.restore(path, tree)
    # A manifest claiming a 4 TiB leaf: refused on the file's header, nothing allocated.
    np.save(first, np.zeros((8, 4), np.float32))
    _edit_manifest(path, lambda m: m["leaves"][W].update(shape=[1 << 20, 1 << 20]))
    with pytest.raises(ck.CheckpointError, match=r"holds <f4\[8, 4\]"):
        ck.load_whole(path)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ck.CheckpointError, match="not valid JSON"):
        ck.read_manifest(path)


def test_plan_round_trip_and_mismatch_listing(saved, tmp_path):
    path, tree, v = saved
    shardings = jax.tree.map(lambda x: x.mpmd_sharding if isinstance(x, jp.MpmdArray) else
                             None, tree, is_leaf=lambda x: isinstance(x, jp.MpmdArray))
    plan_file = str(tmp_path / "plan.json")
    ck.save_plan(plan_file, shardings, like=tree)
    plan = ck.load_plan(plan_file)
    assert plan.mpmd_dim == 4 and plan.group_shape == (("data", 2),)
    assert plan.shardings_like(tree, MESH) == shardings
    manifest = ck.read_manifest(path)
    problems = plan.problems_with(manifest)  # the plain leaves are not placed
    assert problems == [f"the checkpoint has {p}, the plan does not place it"
                        for p in ("['ints'][4]", "['plain']['n']", "['plain']['x']")]
    small = {"params": [np.zeros((8, 5), np.float32), np.zeros((4, 6), ml_dtypes.bfloat16)],
             "opt": Pair(mu=np.zeros((3, 2), np.int32), nu=np.zeros((6,), np.float32))}
    ck.save_plan(plan_file, {"params": shardings["params"], "opt": shardings["opt"]},
                 like=small)
    whole = str(tmp_path / "whole")
    ck.save(whole, {"params": v["w"], "x": v["rep"]})
    with pytest.raises(ck.CheckpointError) as err:
        destination_manifest("to-mpmd", ck.read_manifest(whole), ck.load_plan(plan_file))
    text = str(err.value)
    assert "the checkpoint has ['x'], the plan does not place it" in text
    assert "the plan places ['opt'].mu, the checkpoint has no such leaf" in text
    sub = {k: x for k, x in small.items() if k == "params"}
    ck.save_plan(plan_file, {"params": shardings["params"]}, like=sub)
    with pytest.raises(ck.CheckpointError, match=r"\['params'\]\[0\]: the plan has shape "
                       r"\[8, 5\], the checkpoint \[8, 4\]"):
        destination_manifest("repartition", ck.read_manifest(path).__class__(
            tuple(leaf for leaf in manifest.leaves if leaf.path[0] == ("key", "params")),
            None, 4), ck.load_plan(plan_file))
