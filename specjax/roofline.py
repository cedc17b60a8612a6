"""Bytes moved per decode step (the roofline of batch-1 decoding, with a memory bandwidth measured in the run).

A batch-1 decode step reads every weight it uses once and the KV cache in use; its arithmetic is tiny, so on any
hardware its time is bounded below by bytes / memory bandwidth (Williams et al. 2009, "Roofline"):

  target step bytes  = all parameter bytes + KV bytes read,
  KV bytes read      = sum over layers of {K, V} x rows x positions it reads x kv_heads x head_dim x itemsize,
                       a layer reading every position in use, a sliding layer at most its window,
  roofline fraction  = bytes per step / step time / read bandwidth,

the read bandwidth being what a jitted full reduction over a large array reads per second on the same device, in
the same run (measured by `experiments.costs.measure_read_bandwidth`): a decode step streams its weights and cache
from memory and writes almost nothing, so a read-only stream is its floor.

A verification forward over gamma + 1 tokens reads the same weights and the same cache as a 1-token step and
writes gamma + 1 cache rows instead of one, so while decoding is memory-bound its cost over a 1-token step is

  r_bytes = (weights + KV read + (gamma + 1) KV rows written) / (weights + KV read + 1 KV row written) ~ 1.

A drafter's step is counted by XLA itself: `draft_step_bytes` compiles one `propose` call for a single draft
token and reads the compiled program's "bytes accessed" (`compiled.cost_analysis()`), so every drafter (layer
subsets, heads, an independent draft model, prompt lookup) is counted by the same rule without a formula per
drafter. XLA counts what every fused operation reads and writes, a gather included as its whole operand, so its
count of a target step (`target_step_bytes_xla`) is larger than the formula above (SmolLM2: ~650 MB against
~540 MB); c_bytes = draft step / target step divides two counts made by the same rule, so such over-counts
largely cancel. These are what speculative decoding would cost on an accelerator where every step is
memory-bound (Leviathan et al. 2023, section 3: c is the draft's cost over the target's).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.backends import cpu
from specjax.config import ModelConfig
from specjax.drafters import DraftInputs, Drafter
from specjax.model import KVCache, forward
from specjax.sampling import SamplingParams, argmax


def param_bytes(params) -> int:
  """Bytes of every array in a parameter pytree."""
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params)))


def kv_bytes_per_position(config: ModelConfig, itemsize: int | None = None) -> int:
  """Bytes of keys and values one position occupies across all layers, for one row."""
  itemsize = itemsize or np.dtype(config.dtype).itemsize
  return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize


def kv_bytes_read(config: ModelConfig, positions_in_use: float, itemsize: int | None = None) -> float:
  """Bytes of keys and values one row's query reads over `positions_in_use` cached positions: every layer's, a
  sliding layer's at most its window."""
  per_layer = kv_bytes_per_position(config, itemsize) / config.num_layers
  return sum(per_layer * (positions_in_use if config.window(i) is None else min(positions_in_use, config.window(i)))
             for i in range(config.num_layers))


def target_step_bytes(params, config: ModelConfig, positions_in_use: float, rows: int = 1,
                      new_tokens: int = 1) -> float:
  """Bytes one target forward of `new_tokens` tokens per row moves: weights once, the KV cache in use read, the
  new tokens' KV written. The formula in the module docstring."""
  return param_bytes(params) + rows * (kv_bytes_read(config, positions_in_use)
                                       + new_tokens * kv_bytes_per_position(config))


def verify_cost_bytes(params, config: ModelConfig, positions_in_use: float, gamma: int, rows: int = 1) -> float:
  """r_bytes: a (gamma + 1)-token verification's bytes over a 1-token step's (~1 while memory-bound)."""
  return (target_step_bytes(params, config, positions_in_use, rows, gamma + 1)
          / target_step_bytes(params, config, positions_in_use, rows, 1))


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
