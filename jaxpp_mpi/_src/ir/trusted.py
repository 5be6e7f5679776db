"""Instructions made without running their constructors' checks (`Note: trusted
instructions`): for the passes' rewrites of instructions already checked.

Note: trusted instructions
  `Run(...)`, `Send(...)` and the other constructors check and canonicalise every field
  (their `__post_init__`), which costs more than the object itself. The `new_*`
  functions here make an object of the exact class with the fields exactly as given,
  and check nothing: the caller vouches that each field already is what the
  constructor would keep (buffers: ints >= 0 of type int; peers and tags: ints of type
  int; an aval: an `Aval`; a Free's buffers: a non-empty tuple of such ints), so the
  object equals, field for field and type for type, the one the constructor would
  make. Callers are the passes, rebuilding an instruction from the fields of one of
  exact class (already checked when it was made) with counted tags or sorted buffer
  ids, and the walks' emission (`Note: emitted once` in compiler/walks.py), making a
  Run from a task node (its names checked when the node was made) and buffer ids it
  counted itself. They are internal: nothing a user parses or builds reaches them.
"""

from __future__ import annotations

from jaxpp_mpi._src.ir.instructions import Aval, Free, Recv, Run, Send, SendRecv

__all__ = ["new_free", "new_recv", "new_run", "new_send", "new_sendrecv"]

_new = object.__new__
# The slots' own setters: `object.__setattr__` (what a frozen dataclass's __init__
# calls) looks the name up first.
_send_buf, _send_dst, _send_tag = Send.buf.__set__, Send.dst.__set__, Send.tag.__set__
_recv_buf, _recv_src = Recv.buf.__set__, Recv.src.__set__
_recv_tag, _recv_aval = Recv.tag.__set__, Recv.aval.__set__
_sr_send_buf, _sr_dst = SendRecv.send_buf.__set__, SendRecv.dst.__set__
_sr_send_tag, _sr_recv_buf = SendRecv.send_tag.__set__, SendRecv.recv_buf.__set__
_sr_src, _sr_recv_tag = SendRecv.src.__set__, SendRecv.recv_tag.__set__
_sr_aval = SendRecv.aval.__set__
_free_bufs = Free.bufs.__set__
_run_exe, _run_ins, _run_outs = Run.exe.__set__, Run.ins.__set__, Run.outs.__set__
_run_task, _run_donate = Run.task.__set__, Run.donate.__set__


def new_run(exe: str, ins: tuple[int, ...], outs: tuple[int, ...], task: str,
            donate: tuple[int, ...]) -> Run:
    """`Run(exe, ins, outs, task, donate)`, unchecked (`Note: trusted instructions`):
    `exe` and `task` without whitespace, `donate` ascending, each of it in `ins`."""
    instr = _new(Run)
    _run_exe(instr, exe)
    _run_ins(instr, ins)
    _run_outs(instr, outs)
    _run_task(instr, task)
    _run_donate(instr, donate)
    return instr


def new_send(buf: int, dst: int, tag: int) -> Send:
    """`Send(buf, dst, tag)`, unchecked (`Note: trusted instructions`)."""
    instr = _new(Send)
    _send_buf(instr, buf)
    _send_dst(instr, dst)
    _send_tag(instr, tag)
    return instr


def new_recv(buf: int, src: int, tag: int, aval: Aval) -> Recv:
    """`Recv(buf, src, tag, aval)`, unchecked (`Note: trusted instructions`)."""
    instr = _new(Recv)
    _recv_buf(instr, buf)
    _recv_src(instr, src)
    _recv_tag(instr, tag)
    _recv_aval(instr, aval)
    return instr


def new_sendrecv(send_buf: int, dst: int, send_tag: int, recv_buf: int, src: int,
                 recv_tag: int, aval: Aval) -> SendRecv:
    """`SendRecv(...)`, unchecked (`Note: trusted instructions`)."""
    instr = _new(SendRecv)
    _sr_send_buf(instr, send_buf)
    _sr_dst(instr, dst)
    _sr_send_tag(instr, send_tag)
    _sr_recv_buf(instr, recv_buf)
    _sr_src(instr, src)
    _sr_recv_tag(instr, recv_tag)
    _sr_aval(instr, aval)
    return instr


def new_free(bufs: tuple[int, ...]) -> Free:
    """`Free(bufs)`, unchecked (`Note: trusted instructions`): `bufs` a non-empty tuple."""
    instr = _new(Free)
    _free_bufs(instr, bufs)
    return instr
