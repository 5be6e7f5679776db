"""The lifetime walk of `ir/memory.py` on hand-built programs, against sums done by hand."""

import pytest

from jaxpp_mpi._src.ir.instructions import AllReduce, Aval, Free, Recv, Run, Send
from jaxpp_mpi._src.ir.memory import device_bytes, itemsize, live_bytes
from jaxpp_mpi._src.ir.program import GroupProgram

W = Aval((256, 256), "float32")  # 256 KiB
ACT = Aval((64, 256), "bfloat16")  # 32 KiB
SMALL = Aval((16,), "float32")  # 64 B


@pytest.mark.parametrize("dtype,size", [("float32", 4), ("bfloat16", 2), ("int8", 1),
                                        ("bool", 1), ("complex64", 8), ("float8_e4m3fn", 1),
                                        ("int4", 1), ("float64", 8)])
def test_itemsize(dtype, size):
    assert itemsize(dtype) == size


def test_device_bytes_divide_each_sharded_dimension_rounding_up():
    sizes = {"data": 2, "model": 4}
    assert device_bytes(Aval((8, 6), "float32", ("data",)), sizes) == 4 * 6 * 4
    assert device_bytes(Aval((8, 6), "float32", (None, "model")), sizes) == 8 * 2 * 4
    assert device_bytes(Aval((8, 6), "float32", (("data", "model"),)), sizes) == 1 * 6 * 4
    assert device_bytes(Aval((8, 6), "float32"), sizes) == 8 * 6 * 4


def _stage() -> GroupProgram:
    """Weights in, a forward, a message each way, a backward into a donated accumulator."""
    return GroupProgram(
        0,
        inputs={0: 0, 1: 1},  # a weight and the accumulator
        instrs=(
            Run("fwd", (0,), (2, 3), task="F0s0"),  # activation and a residual
            Send(2, 1, 0),
            Free((2,)),
            Recv(4, 1, 1, ACT),  # the gradient coming back
            Run("bwd", (0, 3, 4, 1), (5,), task="B0s0", donate=(1,)),
            Free((3, 4)),
            AllReduce((5,), "sum"),
        ),
        outputs={5: 0},
        avals={0: W, 1: W, 2: ACT, 3: ACT, 4: ACT, 5: W},
    )


def test_live_bytes_follow_every_birth_and_death():
    w, a = 256 * 256 * 4, 64 * 256 * 2
    profile = live_bytes(_stage())
    assert profile.argument_bytes == 2 * w
    assert profile.live_after == (2 * w + 2 * a, 2 * w + 2 * a, 2 * w + a, 2 * w + 2 * a,
                                  2 * w + 2 * a, 2 * w, 2 * w)
    assert profile.peak_live_bytes == 2 * w + 2 * a
    # The AllReduce's flat copy of its bucket tops everything else.
    assert profile.peak_bytes == 3 * w and profile.peak_at == 6


def test_a_run_holds_its_inputs_outputs_and_scratch_at_once():
    w, a = 256 * 256 * 4, 64 * 256 * 2
    gp = _stage()
    gp = GroupProgram(0, gp.inputs, gp.instrs[:-1], gp.outputs, gp.avals)  # no AllReduce
    profile = live_bytes(gp, temp_bytes={"fwd": 10 * w})
    assert profile.peak_bytes == 2 * w + 2 * a + 10 * w and profile.peak_at == 0
    # The backward's output reuses the donated accumulator: no new bytes, just scratch.
    profile = live_bytes(gp, temp_bytes={"bwd": w})
    assert profile.peak_bytes == 2 * w + 2 * a + w and profile.peak_at == 4


def test_per_device_bytes_of_a_sharded_group():
    sharded = Aval((256, 256), "float32", ("data",))
    gp = GroupProgram(0, {0: 0}, (Run("f", (0,), (1,)), Free((0,))), {1: 0},
                      {0: sharded, 1: SMALL})
    assert live_bytes(gp, {"data": 4}).argument_bytes == 256 * 256
    with pytest.raises(KeyError):
        live_bytes(gp)  # the spec names an axis the mesh lacks
