"""Hostile checkpoint and plan files: every size that could drive an allocation is refused
before anything is allocated, every rejection names the file and the leaf or field, and
`python -m jaxpp_mpi.reshard` reports it on one line. The files are written here with
json and numpy alone (no JAX computation, no MPI)."""

from __future__ import annotations

import json
import os
import tracemalloc
from typing import NamedTuple

import numpy as np
import pytest

from jaxpp_mpi import checkpoint as ck
from jaxpp_mpi._src.checkpoint import format as checkpoint_format
from jaxpp_mpi._src.reshard.cli import main as reshard_main

F4 = np.zeros(2, np.float32)


def leaf(path: list, i: int, shape: list | None = None, dtype: str = "float32") -> dict:
    """A manifest entry for leaf `i` (file arrays/00000i.npy), 2 float32s by default."""
    return {
        "path": path,
        "shape": [2] if shape is None else shape,
        "dtype": dtype,
        "file": f"arrays/{i:06d}.npy",
        "placement": None,
    }


def write(tmp_path, leaves: list[dict], arrays: list | None = None, name="ckpt") -> str:
    """A checkpoint directory holding `leaves` and, per leaf, the .npy of `arrays[i]`
    (default: 2 zeros, matching `leaf`'s default), or a bare header for a shape tuple."""
    path = tmp_path / name
    (path / "arrays").mkdir(parents=True)
    for i, a in enumerate(arrays if arrays is not None else [F4] * len(leaves)):
        with open(path / "arrays" / f"{i:06d}.npy", "wb") as f:
            if isinstance(a, tuple):  # a header claiming this shape, no data
                np.lib.format.write_array_header_1_0(
                    f, {"descr": "<f4", "fortran_order": False, "shape": a}
                )
            else:
                np.lib.format.write_array(f, a)
    manifest = {
        "format": "jaxpp_mpi.checkpoint",
        "version": 1,
        "step": None,
        "mpmd_dim": None,
        "leaves": leaves,
    }
    (path / "manifest.json").write_text(json.dumps(manifest))
    return str(path)


def rejected(path: str, match: str) -> str:
    """The message `load_whole(path)` refuses `path` with; it names the manifest."""
    with pytest.raises(ck.CheckpointError, match=match) as err:
        ck.load_whole(path)
    return str(err.value)


def test_huge_sequence_index_is_refused_without_allocating(tmp_path):
    # Before: a list of 10**12 Nones (5.4 GB and 50 s before MemoryError).
    path = write(tmp_path, [leaf([["idx", 10**12]], 0)])
    tracemalloc.start()
    try:
        message = rejected(path, r"a sequence has index 1000000000000 but only 1 entries")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert message.startswith(f"{path}/manifest.json: at <root>") and "like=" in message
    assert peak < 8 << 20


def test_sequence_gaps_are_bounded_by_the_leaves(tmp_path):
    # Two leaves, one gap: allowed (an empty container between them).
    path = write(
        tmp_path,
        [leaf([["key", "s"], ["idx", 0]], 0), leaf([["key", "s"], ["idx", 2]], 1)],
        [np.arange(2, dtype=np.float32), np.ones(2, np.float32)],
    )
    got = ck.load_whole(path)
    assert list(got) == ["s"] and len(got["s"]) == 3 and got["s"][1] is None
    np.testing.assert_array_equal(got["s"][0], [0, 1])
    np.testing.assert_array_equal(got["s"][2], [1, 1])
    # Two leaves, four gaps: more than the leaves can explain.
    path = write(tmp_path, [leaf([["idx", 0]], 0), leaf([["idx", 5]], 1)], name="gappy")
    rejected(path, r"manifest.json: at <root> a sequence has index 5 but only 2 entries")


class Empty(NamedTuple):
    pass


class Adam(NamedTuple):
    mu: dict


def test_empty_containers_of_a_saved_tree_still_load(tmp_path):
    # Like optax.chain(clip, adam).init(...): (EmptyState(), (ScaleByAdamState, EmptyState()))
    # stores paths [1][0].mu['w'] only; the sequences have gaps and must still load.
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    tree = (Empty(), (Adam(mu={"w": w}), Empty()))
    path = str(tmp_path / "opt")
    ck.save(path, tree)
    assert [leaf.path for leaf in ck.read_manifest(path).leaves] == [
        (("idx", 1), ("idx", 0), ("attr", "mu"), ("key", "w"))
    ]
    got = ck.load_whole(path)
    assert got[0] is None and len(got) == 2 and len(got[1]) == 1
    np.testing.assert_array_equal(got[1][0]["mu"]["w"], w)


@pytest.mark.parametrize("shape", [[0, 2**62], [2**40, 2**40], [2**61, 0, 2]])
def test_shape_beyond_any_array_is_refused_on_the_manifest(tmp_path, shape):
    # The .npy header agrees with the manifest, so only the manifest check stands
    # between this file and numpy's bare "array is too big".
    path = write(tmp_path, [leaf([["key", "a"]], 0, shape)], [tuple(shape)])
    with pytest.raises(ck.CheckpointError) as err:
        ck.read_manifest(path)
    assert str(err.value).startswith(f"{path}/manifest.json: leaf 0: shape {shape} is too large")
    rejected(path, "is too large")


def test_the_largest_empty_shape_numpy_allows_still_loads(tmp_path):
    shape = [0, 2**60]  # 2**62 bytes of non-zero dimensions: numpy accepts it
    path = write(tmp_path, [leaf([["key", "a"]], 0, shape)], [tuple(shape)])
    assert ck.load_whole(path)["a"].shape == tuple(shape)


def test_negative_dimension_is_refused(tmp_path):
    path = write(tmp_path, [leaf([["key", "a"]], 0, [2, -1])])
    rejected(path, r"manifest.json: leaf 0: shape \[2, -1\] has a negative dimension")


def test_npy_file_disagreeing_with_the_manifest_names_file_and_leaf(tmp_path):
    path = write(tmp_path, [leaf([["key", "a"], ["idx", 0]], 0, [3])])  # the file holds 2
    rejected(
        path,
        r"arrays/000000.npy \(leaf \['a'\]\[0\]\): holds <f4\[2\], the manifest's "
        r"dtype and shape say float32\[3\]",
    )
    path = write(tmp_path, [leaf([["key", "a"]], 0, [3])], [(3,)], name="headless")
    rejected(path, r"arrays/000000.npy \(leaf \['a'\]\): \d+ bytes, expected \d+ for float32\[3\]")


@pytest.mark.parametrize(
    "first, second",
    [
        ([["key", "a"]], [["key", "a"], ["key", "b"]]),
        ([["key", "a"], ["idx", 0]], [["key", "a"]]),
        ([], [["key", "a"]]),
    ],
)
def test_a_leaf_inside_another_leaf_is_refused(tmp_path, first, second):
    # Before: IndexError from load_whole.
    path = write(tmp_path, [leaf(first, 0), leaf(second, 1)])
    inner, outer = (1, 0) if len(second) > len(first) else (0, 1)
    message = rejected(path, rf"manifest.json: leaf {inner}: path .* lies inside leaf {outer}'s")
    assert "a leaf cannot also hold other leaves" in message


def test_repeated_path_or_file_is_refused(tmp_path):
    path = write(tmp_path, [leaf([["key", "a"]], 0), leaf([["key", "a"]], 1)])
    rejected(path, r"manifest.json: leaf 1: path \['a'\] repeats leaf 0's")
    second = dict(leaf([["key", "b"]], 1), file="arrays/000000.npy")
    path = write(tmp_path, [leaf([["key", "a"]], 0), second], name="same_file")
    rejected(path, r"manifest.json: leaf 1: file 'arrays/000000.npy' repeats leaf 0's")


@pytest.mark.parametrize(
    "paths, match",
    [
        ([[["idx", 0]], [["key", "a"]]], "mix sequence indexes with dict keys"),
        ([[["idx", 0]], [["flat", 1]]], 'mix "idx" and "flat" indexes'),
        (
            [[["key", "a"], ["key", "x"]], [["attr", "a"], ["key", "y"]]],
            "both a dict key and an attribute are named 'a'",
        ),
    ],
)
def test_paths_no_dict_or_list_can_hold_are_refused_without_like(tmp_path, paths, match):
    # Before: a silent merge, or IndexError when two such leaves met at one key.
    path = write(tmp_path, [leaf(p, i) for i, p in enumerate(paths)])
    assert "like=" in rejected(path, match)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda e: e.update(path=[[["key"], "a"]]), r"leaf 0: bad path entry"),
        (lambda e: e.update(path=[["idx", -1]]), r"leaf 0: bad path entry \['idx', -1\]"),
        (lambda e: e.update(path=[["key", "a"]] * 65), "at most 64"),
        (lambda e: e.update(dtype="object"), r"leaf 0: dtype: unsupported dtype 'object'"),
        (lambda e: e.update(dtype="x" * 10_000), r"unsupported dtype 'xxx.*\.\.\. \(supported"),
        (lambda e: e.update(shape=[2.0]), r"leaf 0: shape must be a list of at most 64 ints"),
        (lambda e: e.update(shape=[1] * 65), r"leaf 0: shape must be a list of at most 64 ints"),
    ],
)
def test_every_field_error_names_manifest_leaf_and_field(tmp_path, edit, match):
    entry = leaf([["key", "a"]], 0)
    edit(entry)
    path = write(tmp_path, [entry])
    message = rejected(path, match)
    assert message.startswith(f"{path}/manifest.json: leaf 0") and len(message) < 400


def test_plan_dtype_error_names_the_plan_file_and_entry(tmp_path):
    plan = {
        "format": "jaxpp_mpi.plan",
        "version": 1,
        "mpmd_axis_name": "stage",
        "mpmd_dim": 2,
        "group_shape": [],
        "entries": [
            {"path": [["key", "a"]], "mesh_ids": [0], "spec": [], "shape": [2], "dtype": "object"}
        ],
    }
    file = tmp_path / "plan.json"
    file.write_text(json.dumps(plan))
    with pytest.raises(ck.CheckpointError, match=rf"^{file}: entry 0: dtype: unsupported"):
        ck.load_plan(str(file))


def test_unreadable_json_files_name_the_file(tmp_path, monkeypatch):
    path = write(tmp_path, [leaf([["key", "a"]], 0)])
    with open(f"{path}/manifest.json", "r+b") as f:
        f.seek(40)
        f.write(b"\xe9")
    with pytest.raises(
        ck.CheckpointError,
        match=rf"^manifest {path}/manifest.json is not UTF-8 text \(byte 0xe9 at "
        r"offset 40\)",
    ):
        ck.read_manifest(path)
    with pytest.raises(ck.CheckpointError, match=rf"^cannot read plan {tmp_path}: Is a directory"):
        ck.load_plan(str(tmp_path))
    # A device reports size 0 but never ends: the read stops at the limit all the same.
    monkeypatch.setattr(checkpoint_format, "MAX_JSON_BYTES", 1000)
    with pytest.raises(ck.CheckpointError, match="^plan /dev/zero is larger than 1000 bytes"):
        ck.load_plan("/dev/zero")


def test_reshard_reports_a_bad_checkpoint_on_one_line(tmp_path, capsys):
    src = write(tmp_path, [leaf([["key", "a"]], 0, [0, 2**62])], [(0, 2**62)])
    dst = str(tmp_path / "dst")
    assert reshard_main(["to-spmd", "--src", src, "--dst", dst]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"[rank 0] reshard: error: {src}/manifest.json: leaf 0: shape ")
    assert err.count("\n") == 1 and not os.path.exists(dst)
    assert reshard_main(["to-mpmd", "--src", src]) == 2  # argparse's error, on one line
    err = capsys.readouterr().err
    assert err == (
        "python -m jaxpp_mpi.reshard: error: the following arguments are required: "
        "--dst, --plan (see python -m jaxpp_mpi.reshard to-mpmd --help)\n"
    )
