"""specjax.roofline: bytes per decode step by formula and by XLA's count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import specjax
from specjax import roofline
from specjax.drafters import DraftInputs
from specjax.model import init_cache


def test_target_step_bytes_are_the_weights_plus_the_cache_in_use(tiny):
  config = tiny.config
  weights = sum(x.size * 4 for x in jax.tree_util.tree_leaves(tiny.params))
  row = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
  assert roofline.param_bytes(tiny.params) == weights
  assert roofline.kv_bytes_per_position(config) == row
  assert roofline.target_step_bytes(tiny.params, config, 100, rows=2) == weights + 2 * 101 * row
  r = roofline.verify_cost_bytes(tiny.params, config, 100, gamma=4)
  assert r == pytest.approx((weights + 105 * row) / (weights + 101 * row)) and 1 < r < 1.1


def test_xla_counts_a_deeper_draft_step_as_more_bytes(tiny):
  config = tiny.config
  cache, position = init_cache(config, 1, 64), jnp.full((1,), 20, jnp.int32)
  target = roofline.target_step_bytes_xla(tiny.params, cache, config, position)
  assert target >= roofline.param_bytes(tiny.params)  # every weight is read at least once
  inputs = DraftInputs(sequence=jnp.ones((1, 64), jnp.int32), position=position, target_cache=cache,
                       key=jax.random.PRNGKey(0))
  steps = [roofline.draft_step_bytes(specjax.make_drafter("layer_skip", tiny, exit_layer=k), tiny.params, (), inputs)
           for k in (1, 2)]
  lookup = roofline.draft_step_bytes(specjax.make_drafter("prompt_lookup", tiny), tiny.params, (), inputs)
  assert lookup < steps[0] < steps[1] < target
