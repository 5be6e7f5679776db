"""The compiler passes' memos give what the plain computations give."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxpp_mpi._src.compiler import keys, split
from jaxpp_mpi._src.ir.program import Aval


def test_aval_of_is_the_plain_aval():
    a = jax.core.ShapedArray((4, 8), jnp.float32)
    assert keys.aval_of(a) == Aval((4, 8), "float32")
    assert keys.aval_of(a, ("data",)) == Aval((4, 8), "float32", ("data",))
    assert keys.aval_of(a, ("data", None)) == Aval((4, 8), "float32", ("data",))
    assert keys.aval_of(jax.core.ShapedArray((), jnp.bfloat16)) == Aval((), "bfloat16")
    # An unhashable spec entry is made afresh, as before.
    assert keys.aval_of(a, (["data", "model"],)) == Aval((4, 8), "float32",
                                                        (("data", "model"),))
    # A key's Aval is its key data's.
    k = jax.eval_shape(lambda: jax.random.key(0))
    assert keys.aval_of(k) == Aval((2,), "uint32")


def test_replayable_leaves_a_keyless_jaxpr_alone():
    plain = jax.make_jaxpr(lambda x: x * 2 + 1)(np.ones(3, np.float32)).jaxpr
    assert keys.replayable(plain) is plain
    keyed = jax.make_jaxpr(lambda k: jax.random.fold_in(k, 1))(jax.random.key(0)).jaxpr
    assert keys.replayable(keyed) is not keyed


def test_var_ins_drop_literals_keep_repeats():
    jaxpr = jax.make_jaxpr(lambda x: (x * x + 1.0, x))(np.ones(3, np.float32)).jaxpr
    ins = split._var_ins(jaxpr.eqns)
    x = jaxpr.invars[0]
    assert ins[0] == [x, x]  # mul x x
    assert ins[1] == [jaxpr.eqns[0].outvars[0]]  # add _ 1.0: the literal dropped
