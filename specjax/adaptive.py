"""Adaptive drafting: how many tokens each round drafts, and where a row stops drafting.

Both rules run inside the compiled loop (no host sync):

1. Per-row early stop (Kangaroo, Liu et al. 2024; EAGLE-2, Li et al. 2024): a row stops drafting at the first
   slot where the draft's top probability falls below `min_confidence`, and its later slots are never
   accepted. The confidence at slot i is a function of the tokens before slot i only (never of the token
   drawn there), so whether slot i is drafted is decided before x_i is drawn: every emitted token still
   follows the target (an undrafted slot is verified with q = 0, i.e. drawn from p, as the bonus token is).
2. A draft length per round (Leviathan et al. 2023, section 3.4, "optimal gamma"): with alpha the running
   acceptance estimate, a round that drafts gamma tokens commits E(alpha, gamma) = sum_{i=0..gamma} alpha^i
   tokens on average and costs gamma * c + r(G) target steps (verification always covers the G + 1 positions
   when any row drafted: each narrower width would be one more compiled target forward, and r varies little
   with the width), so the round drafts

       gamma* = argmax_{0 <= gamma <= G} E(alpha, gamma) / cost(gamma),

   G being the static maximum (`generate`'s `gamma`). gamma = 0 is a plain target step (one token, cost 1
   plus the drafter's `plain_step_cost`): where drafting cannot pay, decoding falls back to autoregressive
   steps. Costs are in units of a 1-token target forward:
     c         a draft step (`draft_cost`; default: the drafter's estimate from the weights it reads, since a
               batch-1 step is memory-bound);
     r(G)      a verification forward over G + 1 tokens, modelled as 1 + (r - 1) sqrt(G / 4) from
               `verify_cost` = r(4), a 5-token forward. On this project's 2-core XLA:CPU r(4) measured 1.24-1.35
               and a 16-token forward 1.64 (the sqrt fits both); on a GPU/TPU at batch 1, r is about 1. A
               drafter that reuses the target's first k layers (`Drafter.reuse_layers`) runs them on one
               token only, so its verification costs f + (1 - f) r(G), f being their share of the weights.
   alpha is accepted / tested drafts over past rounds, both counts decayed by `memory` each round and
   started from a prior (`prior_alpha`, worth one tested draft), so it follows the text and, after a run of
   plain steps, drifts back to the prior: a drafter that pays under the prior is tried again.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import struct

from specjax import leviathan


@dataclasses.dataclass(frozen=True)
class AdaptiveDrafting:
  """Options of adaptive drafting (see the module docstring); `specjax.generate(..., adaptive=...)`."""
  min_confidence: float = 0.5  # a row stops drafting below this top draft probability (Kangaroo: 0.6); 0: never
  draft_cost: float | None = None  # c; None: the drafter's own estimate (`Drafter.draft_cost`)
  verify_cost: float = 1.3  # r(4): a 5-token target forward over a 1-token one (2-core XLA:CPU; ~1 on GPU/TPU)
  prior_alpha: float = 0.5  # the acceptance assumed before any evidence (and returned to without evidence)
  memory: float = 0.9  # per-round decay of the acceptance counts

  def __post_init__(self):
    if not 0.0 <= self.min_confidence <= 1.0:
      raise ValueError(f"min_confidence must be in [0, 1], got {self.min_confidence}")
    if self.draft_cost is not None and not self.draft_cost >= 0.0:
      raise ValueError(f"draft_cost must be >= 0 (a draft step's cost over a target step), got {self.draft_cost}")
    if not self.verify_cost >= 1.0:
      raise ValueError(f"verify_cost must be >= 1 (a 5-token forward over a 1-token one), got {self.verify_cost}")
    if not 0.0 < self.prior_alpha < 1.0:
      raise ValueError(f"prior_alpha must be in (0, 1), got {self.prior_alpha}")
    if not 0.0 <= self.memory < 1.0:
      raise ValueError(f"memory must be in [0, 1), got {self.memory}")


@dataclasses.dataclass(frozen=True)
class Plan:
  """What the compiled loop needs (static): round costs by draft length 0..G, and the estimator's settings."""
  min_confidence: float
  round_costs: tuple[float, ...]  # [G + 1]: cost(gamma) in target steps; gamma = 0 is a plain step
  prior_alpha: float
  memory: float


def make_plan(options: AdaptiveDrafting, drafter, target_params, config, gamma: int) -> Plan:
  c = drafter.draft_cost if options.draft_cost is None else options.draft_cost
  reused = leviathan.draft_cost(target_params, config, range(drafter.reuse_layers), head_columns=0) \
      if drafter.reuse_layers else 0.0

  def verify(g):
    return reused + (1.0 - reused) * (1.0 + (options.verify_cost - 1.0) * math.sqrt(g / 4))

  # A round that drafts verifies all gamma + 1 positions: each narrower width would be one more compiled forward.
  costs = (1.0 + drafter.plain_step_cost,) + tuple(g * c + verify(gamma) for g in range(1, gamma + 1))
  return Plan(min_confidence=options.min_confidence, round_costs=costs, prior_alpha=options.prior_alpha,
              memory=options.memory)


@struct.dataclass
class Acceptance:
  """Decayed counts of accepted and tested drafts (accepted + rejected), summed over the batch."""
  accepted: jax.Array  # scalar float32
  tested: jax.Array  # scalar float32

  @classmethod
  def zero(cls):
    return cls(accepted=jnp.zeros((), jnp.float32), tested=jnp.zeros((), jnp.float32))

  def update(self, plan: Plan | None, accepted: jax.Array, rejected: jax.Array) -> "Acceptance":
    """After a round: accepted [B] drafts and rejected [B] (whether the row's round ended at a rejection)."""
    memory = 1.0 if plan is None else plan.memory
    accepted = jnp.sum(accepted).astype(jnp.float32)
    tested = accepted + jnp.sum(rejected).astype(jnp.float32)
    return Acceptance(accepted=memory * self.accepted + accepted, tested=memory * self.tested + tested)

  def alpha(self, plan: Plan) -> jax.Array:
    return (self.accepted + plan.prior_alpha) / (self.tested + 1.0)


def draft_length(plan: Plan, acceptance: Acceptance) -> jax.Array:
  """gamma* in 0..G: the draft length with the most expected tokens per unit of cost (0: a plain step)."""
  alpha = acceptance.alpha(plan)
  gammas = jnp.arange(len(plan.round_costs))
  expected = jnp.cumsum(alpha ** gammas)  # E(alpha, gamma) = 1 + alpha + ... + alpha^gamma
  return jnp.argmax(expected / jnp.asarray(plan.round_costs, jnp.float32)).astype(jnp.int32)
