"""specjax.roofline: bytes per decode step by XLA's count (the analytic count: tests/test_cost_model.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import specjax
from specjax import roofline
from specjax.drafters import DraftInputs
from specjax.model import init_cache


def test_xla_counts_a_deeper_draft_step_as_more_bytes(tiny):
  config = tiny.config
  cache, position = init_cache(config, 1, 64), jnp.full((1,), 20, jnp.int32)
  target = roofline.target_step_bytes_xla(tiny.params, cache, config, position)
  assert target >= sum(x.nbytes for x in jax.tree_util.tree_leaves(tiny.params))  # every weight read at least once
  inputs = DraftInputs(sequence=jnp.ones((1, 64), jnp.int32), position=position, target_cache=cache,
                       key=jax.random.PRNGKey(0))
  steps = [roofline.draft_step_bytes(specjax.make_drafter("layer_skip", tiny, exit_layer=k), tiny.params, (), inputs)
           for k in (1, 2)]
  lookup = roofline.draft_step_bytes(specjax.make_drafter("prompt_lookup", tiny), tiny.params, (), inputs)
  assert lookup < steps[0] < steps[1] < target
