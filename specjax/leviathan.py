"""The speedup model of speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", section 3).

With α the chance that the verifier accepts a draft token (i.i.d. across positions), γ draft tokens per round,
c the cost of one draft step and v the cost of one verification forward, both in units of one autoregressive
target step:

  E[tokens per round] = (1 - α^(γ+1)) / (1 - α)        (accepted drafts + the target's own token)
  speedup             = E[tokens per round] / (γ·c + v)

On memory-bound hardware (batch-1 decoding on GPU/TPU) v ≈ 1 and c ≈ the fraction of weights a draft step
reads; on a CPU whose multi-row matrix products are slower than its matrix-vector ones, v > 1 (measure it).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np

from specjax.config import ModelConfig


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
  """Leviathan et al. (2023), eq. 1: E = (1 - α^(γ+1)) / (1 - α), tokens committed per target forward."""
  if alpha >= 1.0:
    return float(gamma + 1)
  return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, gamma: int, draft_cost: float, verify_cost: float = 1.0) -> float:
  """E[tokens per round] / (γ·c + v): c, v = a draft step's and a verification's cost over one AR step."""
  return expected_tokens_per_round(alpha, gamma) / (gamma * draft_cost + verify_cost)


def alpha_from_stats(stats: dict, gamma: int) -> float:
  """Maximum-likelihood per-token acceptance α from a speculative run's stats.

  Under Leviathan's i.i.d. model each round accepts drafts with probability α until the first rejection, so
  every accepted draft is a success and every round that stopped short of γ is one failure:
  α = accepted / (accepted + rounds with a rejection) -- the engine's `alpha`, here from per-row counts so
  that runs can be pooled. This is not `acceptance_rate` (accepted / proposed), which also counts the drafts
  after a rejection, never examined: at α = 0.5, γ = 4 it is 0.23.
  """
  accepted = float(np.sum(stats["accepted_per_row"]))
  rejections = float(np.sum(stats["rejections_per_row"]))
  return accepted / (accepted + rejections) if accepted + rejections else math.nan


def _weight_bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def draft_cost(params, config: ModelConfig, layers: Sequence[int], own=None, head_columns: int | None = None) -> float:
  """Weights read by one draft step (the target layers run + the drafter's `own` arrays + final norm + LM head,
  of which `head_columns` columns when truncated, at the bytes the drafter holds them in) over those of a full
  target step.

  A batch-1 decode step is memory-bound, so this is its relative time to first order. With a small model
  the LM head is a large share (SmolLM2: 28 M of 135 M weights), so it exceeds the fraction of layers run. Bytes
  are counted as the arrays store them: a quantized target's GGUF blocks (`backends.cpu.Quantized`), an int8
  target's codes and scales (`specjax.int8`), beside a drafter's own arrays at their dtype.
  """
  table = params["lm_head"] if "lm_head" in params else params["embed"]
  head = _weight_bytes(table)
  layer_bytes = [_weight_bytes(layer) for layer in params["layers"]]
  norm = _weight_bytes(params["final_norm"])
  # A truncated head's columns are gathered out of the table (`draft_head.head_columns`) in the dtype of the values
  # it stands for: a quantized table's columns are float32, not its blocks.
  draft_head = head if head_columns is None else head_columns * config.hidden_size * np.dtype(table.dtype).itemsize
  draft = draft_head + norm + sum(layer_bytes[i] for i in layers) + (_weight_bytes(own) if own is not None else 0)
  return draft / (head + norm + sum(layer_bytes))
