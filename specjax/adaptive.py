"""Adaptive drafting: how many tokens each round drafts, and where a row stops drafting.

Both rules run inside the compiled loop (no host sync):

1. Per-row early stop (Kangaroo, Liu et al. 2024; EAGLE-2, Li et al. 2024): a row stops drafting at the first
   slot where the draft's top probability falls below `min_confidence`, and its later slots are never
   accepted. The confidence at slot i is a function of the tokens before slot i only (never of the token
   drawn there), so whether slot i is drafted is decided before x_i is drawn: every emitted token still
   follows the target (an undrafted slot is verified with q = 0, i.e. drawn from p, as the bonus token is).
2. A draft length per round (Leviathan et al. 2023, section 3.4, "optimal gamma"): with alpha the running
   acceptance estimate, a round that drafts gamma tokens commits E(alpha, gamma) = sum_{i=0..gamma} alpha^i
   tokens per row on average and costs gamma * c + v(gamma) plain target steps, so the round drafts

       gamma* = argmax_{0 <= gamma <= G} E(alpha, gamma) / cost(gamma),

   G being the static maximum (`generate`'s `gamma`). gamma = 0 is a plain target step (one token, cost 1
   plus the drafter's `plain_step_cost`): where drafting cannot pay, decoding falls back to autoregressive
   steps. Verification runs over the narrowest compiled width that holds the longest draft any row made plus
   the pending token (`verify_widths`: 1, 2 and G + 1, chosen inside the compiled loop), so a one-token draft pays
   for a 2-token forward only. Each width is one more compiled target forward in the program: more compile
   time, and more executable memory mappings (XLA:CPU maps each kernel apart; Linux allows 65,530 per process
   by default, which a long experiment run with every width reached). Costs are in units of a plain target
   step at the same batch size B:
     c         a draft step (`draft_cost`; default: the drafter's estimate from the weights it reads, since a
               batch-1 step is memory-bound);
     v(gamma)  a verification forward over B x w rows over a plain step's B rows, w the compiled width that
               holds gamma + 1 tokens: f(B w) / f(B), f(n) being a target forward over n rows (batch rows
               times tokens) in units of a 1-row one, interpolated linearly between the points of
               `forward_costs`. The default on a CPU backend
               (`CPU_FORWARD_COSTS`) was measured on this project's 2-core XLA:CPU with SmolLM2-135M: a forward
               costs about 1 + 0.11 (n - 1) (f(5) = 1.43, f(40) = 4.75: each row's arithmetic adds to the
               weight stream), so at batch 8 a 5-token verification costs ~2.8 plain steps and drafting pays
               only at high alpha. On a GPU/TPU backend the default is flat (`ACCELERATOR_FORWARD_COSTS`: a
               small model's forward stays memory-bound far beyond these row counts); pass measured points
               for another machine or a large batch. A drafter that reuses the target's first k layers
               (`Drafter.reuse_layers`) runs them on one token only, so its verification costs
               s + (1 - s) v(gamma), s being their share of the weights.
   alpha is accepted / tested drafts over past rounds, both counts decayed by `memory` each round and
   started from a prior (`prior_alpha`, worth one tested draft), so it follows the text and, after a run of
   plain steps, drifts back to the prior: a drafter that pays under the prior is tried again.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from specjax import leviathan


# f(n) on 2 cores of XLA:CPU, SmolLM2-135M fp32, context 200 (medians of 5 interleaved rounds; 1 row 20 ms):
# about 1 + 0.11 (n - 1), the arithmetic of each extra row adding to the weight stream.
CPU_FORWARD_COSTS = ((1, 1.0), (2, 1.07), (3, 1.28), (4, 1.28), (5, 1.43), (6, 1.45), (8, 1.71), (10, 1.96),
                     (12, 2.16), (16, 2.67), (20, 3.02), (24, 3.64), (40, 4.75))

# Elsewhere (GPU/TPU): a forward over up to 64 rows costs about one row's; flat past it. On one H200 with
# SmolLM2-135M's shape, forwards over 2-64 tokens took 0.80-1.10 of a 1-token one (results/accelerator/).
ACCELERATOR_FORWARD_COSTS = ((1, 1.0), (64, 1.0))


def default_forward_costs() -> tuple[tuple[int, float], ...]:
  return CPU_FORWARD_COSTS if jax.default_backend() == "cpu" else ACCELERATOR_FORWARD_COSTS


def verify_widths(gamma: int) -> tuple[int, ...]:
  """The verification widths a program compiles for drafts of up to `gamma` tokens: 1 (a plain step), 2, gamma + 1."""
  return tuple(sorted({1, min(2, gamma + 1), gamma + 1}))


def width_index(widths: tuple[int, ...], drafted):
  """Index of the narrowest of `widths` that holds `drafted` draft tokens and the pending token; `drafted` may
  be a Python int (the plan's costs) or a traced array (the compiled loop's choice)."""
  return jnp.searchsorted(jnp.asarray(widths), drafted + 1)


def forward_cost(points: tuple[tuple[int, float], ...], rows: int) -> float:
  """f(rows): linear interpolation between the (rows, cost) points, extrapolated from the last two."""
  for (n0, f0), (n1, f1) in zip(points, points[1:]):
    if rows <= n1:
      break
  return f0 + (f1 - f0) * (rows - n0) / (n1 - n0)


@dataclasses.dataclass(frozen=True)
class AdaptiveDrafting:
  """Options of adaptive drafting (see the module docstring); `specjax.generate(..., adaptive=...)`."""
  min_confidence: float = 0.5  # a row stops drafting below this top draft probability (Kangaroo: 0.6); 0: never
  draft_cost: float | None = None  # c; None: the drafter's own estimate (`Drafter.draft_cost`)
  # f(n): a target forward over n rows (batch x tokens) over a 1-row one, as (n, f) points (see the docstring);
  # None: `default_forward_costs()` for the backend
  forward_costs: tuple[tuple[int, float], ...] | None = None
  prior_alpha: float = 0.5  # the acceptance assumed before any evidence (and returned to without evidence)
  memory: float = 0.9  # per-round decay of the acceptance counts

  def __post_init__(self):
    if not 0.0 <= self.min_confidence <= 1.0:
      raise ValueError(f"min_confidence must be in [0, 1], got {self.min_confidence}")
    if self.draft_cost is not None and not self.draft_cost >= 0.0:
      raise ValueError(f"draft_cost must be >= 0 (a draft step's cost over a target step), got {self.draft_cost}")
    if self.forward_costs is not None:
      points = tuple((int(n), float(f)) for n, f in self.forward_costs)
      object.__setattr__(self, "forward_costs", points)  # hashable, whatever sequence it came as
      rows = [n for n, _ in points]
      if (len(points) < 2 or rows[0] != 1 or rows != sorted(set(rows))
          or any(not f >= 1.0 for _, f in points) or points[0][1] != 1.0):
        raise ValueError("forward_costs must be (rows, cost) points with increasing rows, starting at (1, 1.0), "
                         f"every cost >= 1, at least two points; got {self.forward_costs!r}")
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


def make_plan(options: AdaptiveDrafting, drafter, target_params, config, gamma: int, batch: int = 1) -> Plan:
  """Round costs by draft length for `batch` rows (per device: the rows one forward processes)."""
  c = drafter.draft_cost if options.draft_cost is None else options.draft_cost
  reused = leviathan.draft_cost(target_params, config, range(drafter.reuse_layers), head_columns=0) \
      if drafter.reuse_layers else 0.0
  points = options.forward_costs or default_forward_costs()
  plain = forward_cost(points, batch)
  widths = verify_widths(gamma)

  def verify(g):
    return reused + (1.0 - reused) * forward_cost(points, batch * widths[int(width_index(widths, g))]) / plain

  costs = (1.0 + drafter.plain_step_cost,) + tuple(g * c + verify(g) for g in range(1, gamma + 1))
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
