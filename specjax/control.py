"""Control flow for decode loops that carry KV caches."""

import jax
import jax.numpy as jnp
import numpy as np


def run_if(pred, fn, state):
  """`fn(state)` where the scalar `pred` holds, else `state`, as a `jax.lax.while_loop` that runs at most once.

  XLA updates a while loop's state in place, but copies a buffer that several branches of a `jax.lax.cond` or
  `switch` update: on the way into each branch and out of the conditional. With a choice between a drafting and
  a plain round, or between verify widths, that buffer is the whole KV cache, twice a round (at batch 8 on
  CPU, a plain speculative round under such a `cond` cost 1.4x an autoregressive step). `fn` must return
  `state`'s structure. A Python bool `pred` (a choice known when tracing) decides without a loop.
  """
  if isinstance(pred, (bool, np.bool_)):
    return fn(state) if pred else state

  def body(carry):
    return jnp.zeros((), bool), fn(carry[1])

  return jax.lax.while_loop(lambda carry: carry[0], body, (jnp.asarray(pred, bool), state))[1]
