"""Resuming loses nothing (`Note: Atomic commit` in checkpoint/commit.py): `find` takes
up a save interrupted between its two renames, and a save never replaces a newer step
with an older one. One process, plain numpy trees (no mesh)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxpp_mpi import checkpoint as ck


def _tree(step: int) -> dict:
    return {"w": np.full((3,), step, np.float32), "n": np.int32(step)}


def _interrupt_between_renames(path: str, new_step: int | None) -> None:
    """What a crash between the commit's renames leaves: the previous checkpoint at
    `.NAME.old-*`, no NAME, and (when `new_step`) the new complete one at `.NAME.tmp-*`."""
    parent, name = os.path.split(path)
    if new_step is not None:
        ck.save(os.path.join(parent, "scratch"), _tree(new_step), step=new_step)
        os.rename(os.path.join(parent, "scratch"), os.path.join(parent, f".{name}.tmp-aa"))
    os.rename(path, os.path.join(parent, f".{name}.old-bb"))


def _holds(path: str, step: int) -> None:
    assert ck.read_manifest(path).step == step
    got = ck.restore(path, _tree(0))
    np.testing.assert_array_equal(got["w"], _tree(step)["w"])


def test_find_none_where_nothing_was_saved(tmp_path):
    assert ck.find(str(tmp_path / "ckpt")) is None


@pytest.mark.parametrize("new_step, expected", [(None, 3), (4, 4)],
                         ids=["previous-only", "new-complete"])
def test_find_takes_up_a_save_interrupted_between_its_renames(tmp_path, new_step, expected):
    path = str(tmp_path / "ckpt")
    ck.save(path, _tree(3), step=3)
    _interrupt_between_renames(path, new_step)
    assert not os.path.exists(path)
    assert ck.find(path).step == expected
    _holds(path, expected)
    ck.save(path, _tree(5), step=5, overwrite=True)  # the leftovers go with the next save
    _holds(path, 5)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_an_incomplete_temp_dir_is_not_taken(tmp_path):
    path = str(tmp_path / "ckpt")
    ck.save(path, _tree(3), step=3)
    _interrupt_between_renames(path, 4)
    os.remove(os.path.join(tmp_path, ".ckpt.tmp-aa", "arrays", os.listdir(
        os.path.join(tmp_path, ".ckpt.tmp-aa", "arrays"))[0]))
    assert ck.find(path).step == 3


def test_a_save_never_replaces_a_newer_step(tmp_path):
    path = str(tmp_path / "ckpt")
    ck.save(path, _tree(7), step=7)
    with pytest.raises(ck.CheckpointError, match="holds step 7, newer than the step 2"):
        ck.save(path, _tree(2), step=2, overwrite=True)
    _holds(path, 7)
    _interrupt_between_renames(path, None)  # also when the newer one is mid-rename
    with pytest.raises(ck.CheckpointError, match="holds step 7, newer than the step 2"):
        ck.save(path, _tree(2), step=2, overwrite=True)
    _holds(path, 7)
    ck.save(path, _tree(7), step=7, overwrite=True)  # the same step may be saved again
    _holds(path, 7)
