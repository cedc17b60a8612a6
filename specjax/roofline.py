"""XLA's count of the bytes a step moves, as compiled on this device (the roofline of batch-1 decoding).

A batch-1 decode step reads every weight it uses once and the KV cache in use; its arithmetic is tiny, so on any
hardware its time is bounded below by bytes / memory bandwidth (Williams et al. 2009, "Roofline"). The analytic count
of those bytes, from the model's config, is experiments/cost_model.py's (`step_bytes`: what the experiments' roofline
fractions and r_bytes divide by); this module asks XLA instead.

A drafter's step is counted by XLA itself: `draft_step_bytes` compiles one `propose` call for a single draft
token and reads the compiled program's "bytes accessed" (`compiled.cost_analysis()`), so every drafter (layer
subsets, heads, an independent draft model, prompt lookup) is counted by the same rule without a formula per
drafter. XLA counts what every fused operation reads and writes, a gather included as its whole operand, so its
count of a target step (`target_step_bytes_xla`) is larger than the analytic one (SmolLM2: ~650 MB against
~540 MB); c_bytes = draft step / target step divides two counts made by the same rule, so such over-counts
largely cancel. These are what speculative decoding would cost on an accelerator where every step is
memory-bound (Leviathan et al. 2023, section 3: c is the draft's cost over the target's).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from specjax.backends import cpu
from specjax.config import ModelConfig
from specjax.drafters import DraftInputs, Drafter
from specjax.model import KVCache, forward
from specjax.sampling import SamplingParams, argmax


def compiled_bytes(fn, *args, **static) -> float:
  """XLA's "bytes accessed" of `jax.jit(fn, static_argnames=static)(*args, **static)` as compiled here, with XLA's
  own ops throughout: XLA cannot see what the CPU kernels (`specjax.backends.cpu`) read, so they are off while
  this traces (`fn` should be a fresh function: jax reuses an earlier trace of the same one)."""
  with cpu.enabled(False):
    compiled = jax.jit(fn, static_argnames=tuple(static)).lower(*args, **static).compile()
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):  # older jax: one dict per computation
    analysis = analysis[0] if analysis else {}
  if not analysis or "bytes accessed" not in analysis:
    raise RuntimeError(f"XLA on {jax.default_backend()} gives no 'bytes accessed' cost analysis")
  return float(analysis["bytes accessed"])


def target_step_bytes_xla(params, cache: KVCache, config: ModelConfig, position: jax.Array) -> float:
  """XLA's count of bytes for one 1-token target step at `position` ([B]) over `cache`: the forward and its greedy
  token (as a draft step, `draft_step_bytes`, counts the drafter's choice of its token)."""
  tokens = jnp.zeros((position.shape[0], 1), jnp.int32)

  def step(params, tokens, cache, position, *, config):
    return argmax(forward(params, tokens, cache, position, config).logits)
  return compiled_bytes(step, params, tokens, cache, position, config=config)


def draft_step_bytes(drafter: Drafter, target_params, state: Any, inputs: DraftInputs,
                     sampling: SamplingParams = SamplingParams()) -> float:
  """XLA's count of bytes for one draft step: `propose` of a single token from `state` (after `init`)."""
  static = drafter.static()

  def propose_one(target_params, params, state, inputs, *, static, sampling):
    return static.propose(target_params, params, static.options, state, inputs, 1, sampling).tokens
  return compiled_bytes(propose_one, target_params, drafter.params, state, inputs, static=static, sampling=sampling)
