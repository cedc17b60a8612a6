"""Adaptive drafting: how many tokens each round drafts, and where a row stops drafting.

Both rules run inside the compiled loop (no host sync):

1. Per-row early stop (Kangaroo, Liu et al. 2024; EAGLE-2, Li et al. 2024) on a row's joint confidence at slot i,
   the product of the draft's top probabilities over slots 1..i (EAGLE-2's path value: about the chance that
   drafts 1..i are all accepted), against two bars per slot that follow from the costs (`confidence_bars`), rate
   being the plan's expected tokens per unit of cost (rule 2):
     keep slot i       joint_i >= rate x (v(i) - v(i - 1)): the tokens it is expected to add pay for the wider
                       verification it needs (its draft step has run already);
     draft slot i + 1  joint_i x alpha >= rate x (c + v(i + 1) - v(i)): the expected joint confidence of the
                       next slot pays for its draft step and its widening (alpha: the running acceptance).
   A row keeps its leading slots while both hold; later slots are never accepted. Where verifying one more
   token is nearly free (a CPU at batch 1: a 2-token forward costs a 1-token one) every first draft is kept, and
   a row drafts a second token only when its first is confident enough to pay for a draft step (c = 0.01-0.2)
   and the 5-token verification; at batch 8, or with a dear draft, the bars rise with the costs.
   `AdaptiveDrafting(min_confidence=x)` sets both bars to x at every slot instead (a row stops at the first slot
   whose joint confidence is below x). The confidence at slot i is a function of the tokens before slot i only
   (never of the token drawn there), so whether slot i is drafted is decided before x_i is drawn: every emitted
   token still follows the target (an undrafted slot is verified with q = 0, i.e. drawn from p, as the bonus
   token is).
2. A draft budget per round (Leviathan et al. 2023, section 3.4, "optimal gamma", extended to rows that stop
   early): with alpha the running acceptance of drafted tokens and d the running chance that a row drafts its next
   slot (rule 1 stops it otherwise), a row commits E = sum_{i=0..gamma} (d alpha)^i tokens in a round with budget
   gamma, and the round costs a draft step (c) while any row still drafts plus a verification over the narrowest
   compiled width that holds the longest draft (`expected_rounds`: with B rows, P(some row drafts >= k slots) =
   1 - (1 - d^k)^B). The round drafts

       gamma* = argmax_{0 <= gamma <= G} E(gamma) / cost(gamma),

   G being the static maximum (`generate`'s `gamma`). gamma = 0 is a plain target step (one token, cost 1
   plus the drafter following it: a drafter with its own cache, e.g. a draft model, reads the step's token,
   `Drafter.plain_step_cost`):
   where drafting cannot pay, decoding falls back to autoregressive steps at nearly their cost. Verification
   runs over the narrowest compiled width that holds the longest draft any row made plus the pending token
   (`verify_widths`: 1, 2 and G + 1, chosen inside the compiled loop), so a one-token draft pays for a 2-token
   forward only. Each width is one more compiled target forward in the program: more compile
   time, and more executable memory mappings (XLA:CPU maps each kernel apart; Linux allows 65,530 per process
   by default, which a long experiment run with every width reached). Costs are in units of a plain target
   step at the same batch size B:
     c         a draft step (`draft_cost`; default: the drafter's estimate from the weights it reads, since a
               batch-1 step is memory-bound);
     v(gamma)  a verification forward over B x w rows over a plain step's B rows, w the compiled width that
               holds gamma + 1 tokens: f(B w) / f(B), f(n) being a target forward over n rows (batch rows
               times tokens) in units of a 1-row one, interpolated linearly between the points of
               `forward_costs`. The default on a CPU backend (`CPU_FORWARD_COSTS`) was measured on this
               project's 2-core XLA:CPU with specjax's CPU kernels and SmolLM2-135M: flat to 5 rows (f(5) =
               1.06), f(8) = 1.2, f(40) = 2.8 (past ~5 rows each row's arithmetic adds to the weight stream),
               so at batch 8 a 5-token verification costs ~2.3 plain steps and drafting pays only at high
               alpha. On a GPU/TPU backend the default is flat (`ACCELERATOR_FORWARD_COSTS`: a small model's
               forward stays memory-bound far beyond these row counts); pass measured points for another
               machine or a large batch. A drafter that reuses the target's first k layers
               (`Drafter.reuse_layers`) has run them for every position its verification reads but the
               last drafted token when the longest draft kept its last step's token (a draft whose every row
               dropped the last step's token ran them one step further), so its verification costs
               (1 - s) v(gamma), plus s when a row drafted (the last step's token is nearly always kept), s being
               their share of the weights.
   With d = 1 (no row stops early) this is Leviathan's fixed round, gamma c + v(gamma). Counting early stops
   matters: alpha alone describes only the rows that drafted, so at batch 4 with most rows stopping at once, a
   plan from alpha alone verified a wide forward for one or two confident rows and lost 10-13% against
   autoregressive decoding. alpha is accepted / tested drafts and d is drafted / (drafted + stopped) slots over
   past rounds, all counts decayed by `memory` each drafting round and started from priors (`prior_alpha` worth
   one tested draft; d = 1 worth one slot), so they follow the text. A plain step drafts nothing and ages
   the counts by `plain_memory` only, so after a long run of plain steps they drift back to the priors and a
   drafter that pays under the priors is tried again. A try costs a draft step even when every row is unsure at
   its first slot; aged by `memory` in plain steps too, the estimate of d returned above c / alpha within about
   three plain steps, and a draft model that rarely paid tried in a third to a half of all rounds.
   Near the break-even the estimate's noise decides (alpha is the mean of about ten recent drafts: a standard
   error of ~0.13 at alpha 0.22), and a dip below it held a paying drafter in plain steps for tens of steps: the
   trained exit adapter (break-even alpha 0.17, accepted 0.22) ran plain steps in 53% of its rounds and read 1.04x
   where drafting one token every round read 1.09x. So where the plan says a plain step, the round drafts anyway
   when an acceptance `optimism` (z) standard errors above the estimate says drafting pays (optimism under
   uncertainty, as in UCB bandits). Each such round adds evidence, but the counts decay by `memory`, so the error
   never falls below about sqrt(alpha (1 - alpha) / 11) and the bonus never below z times that (0.045 at alpha 0.1
   and z = 0.5; the prior adds (prior_alpha - alpha) / 11 more): a drafter at half its break-even still drafts in
   a share of rounds (the trained exit adapter on Spec-Bench's translation, alpha 0.08-0.10, break-even 0.17: in
   28% of rounds). configs/adaptive_optimism.py measured z = 0.5, 0.25 and 0 for the two trained drafters whose
   acceptance lies near their break-even, on seven categories (results/adaptive_optimism/): less optimism took more
   plain steps on translation (the exit adapter 72%, 80%, 86% of rounds) without a speedup there (0.97x at all
   three), and lost where drafting pays (the exit adapter on qa 1.03x, 0.99x, 0.96x; the draft model on humanities
   1.10x, 1.11x, 0.99x); over all 168 pairs z = 0.5 read best or level (draft model 1.04x, 1.03x, 1.00x).
"""

from __future__ import annotations

import bisect
import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from specjax import leviathan


# f(n) on 2 cores of XLA:CPU with specjax.cpu_kernels, SmolLM2-135M fp32 (benchmarks/bench_verify.py, context
# 100, medians of 5 interleaved rounds, two runs on 2026-12-02; 1 row 13.5-14.2 ms): flat up to 5 tokens of one
# row (0.99-1.06), then the arithmetic of each extra row adds to the weight stream, and rows of different
# sequences add attention over their own caches (8 rows of 1 token: 1.24-1.32; 8 tokens of 1 row: 1.05-1.16;
# 16 tokens 1.39-1.43; 4 rows of 5 tokens 1.70-1.82, 8 rows of 5 2.74-2.99).
CPU_FORWARD_COSTS = ((1, 1.0), (2, 1.0), (4, 1.05), (5, 1.06), (8, 1.2), (16, 1.4), (20, 1.75), (40, 2.8))

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
  # None: per-slot bars on the joint draft confidence from the costs (`confidence_bars`); a float: one bar for every
  # slot, to keep it and to draft the next (0: rows never stop early; Kangaroo stops at 0.6, on the top probability
  # of each slot alone)
  min_confidence: float | None = None
  draft_cost: float | None = None  # c; None: the drafter's own estimate (`Drafter.draft_cost`)
  # f(n): a target forward over n rows (batch x tokens) over a 1-row one, as (n, f) points (see the docstring);
  # None: `default_forward_costs()` for the backend
  forward_costs: tuple[tuple[int, float], ...] | None = None
  prior_alpha: float = 0.5  # the acceptance assumed before any evidence (and returned to without evidence)
  memory: float = 0.9  # decay of the acceptance counts per drafting round
  plain_memory: float = 0.98  # their decay per plain step (no evidence): how soon a drafter is tried again
  # z: where the running acceptance says a plain step, draft anyway while an acceptance z standard errors above it
  # says drafting pays (optimism under uncertainty; 0: trust the running estimate)
  optimism: float = 0.5

  def __post_init__(self):
    if self.min_confidence is not None and not 0.0 <= self.min_confidence <= 1.0:
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
    if not 0.0 <= self.plain_memory < 1.0:
      raise ValueError(f"plain_memory must be in [0, 1), got {self.plain_memory}")
    if not self.optimism >= 0.0:
      raise ValueError(f"optimism must be >= 0 (standard errors above the running acceptance), got {self.optimism}")


@dataclasses.dataclass(frozen=True)
class Plan:
  """What the compiled loop needs (static): the costs of a round's parts in plain target steps at this batch size,
  and the estimator's settings."""
  min_confidence: float | None  # one bar on the joint confidence for every slot; None: from the costs
  draft_cost: float  # c: one draft step
  plain_cost: float  # a round that does not draft: one target step plus the drafter following it
  widths: tuple[int, ...]  # the compiled verification widths (`verify_widths`)
  verify_costs: tuple[float, ...]  # a verification forward of each width
  refill_cost: float  # layers a drafter reuses (`Drafter.reuse_layers`) over its last draft, when a row kept it
  rows: int  # B: the rows one forward processes
  prior_alpha: float
  memory: float  # decay of the acceptance counts per drafting round
  plain_memory: float  # decay per plain step
  optimism: float  # z (`AdaptiveDrafting.optimism`)

  @property
  def gamma(self) -> int:
    return self.widths[-1] - 1

  @property
  def widening_costs(self) -> tuple[float, ...]:
    """What draft slot i = 1..G adds to a round's verification: the widening from the width that holds i - 1
    drafts to the one that holds i (0 within one compiled width)."""
    width = lambda drafted: bisect.bisect_left(self.widths, drafted + 1)  # noqa: E731 (as `width_index`)
    return tuple(self.verify_costs[width(i)] - self.verify_costs[width(i - 1)] for i in range(1, self.gamma + 1))

  @property
  def round_costs(self) -> tuple[float, ...]:
    """cost(gamma) for gamma = 0..G when every row drafts the whole budget (Leviathan's fixed-gamma round)."""
    return tuple(float(c) for c in expected_rounds(self, 0.0, 1.0)[1])


def make_plan(options: AdaptiveDrafting, drafter, target_params, config, gamma: int, batch: int = 1) -> Plan:
  """Round costs by draft length for `batch` rows (per device: the rows one forward processes)."""
  c = drafter.draft_cost if options.draft_cost is None else options.draft_cost
  reused = leviathan.draft_cost(target_params, config, range(drafter.reuse_layers), head_columns=0) \
      if drafter.reuse_layers else 0.0
  points = options.forward_costs or default_forward_costs()
  plain = forward_cost(points, batch)
  widths = verify_widths(gamma)
  # The layers after the reused ones over w tokens (all of them when none are reused); the reused ones run over the
  # last drafted token only if a row kept it (`refill_cost`).
  verify_costs = tuple((1.0 - reused) * forward_cost(points, batch * w) / plain for w in widths)
  return Plan(min_confidence=options.min_confidence, draft_cost=float(c), plain_cost=1.0 + drafter.plain_step_cost,
              widths=widths, verify_costs=verify_costs, refill_cost=float(reused), rows=int(batch),
              prior_alpha=options.prior_alpha, memory=options.memory, plain_memory=options.plain_memory,
              optimism=float(options.optimism))


@struct.dataclass
class Acceptance:
  """Decayed counts over past drafting rounds, summed over the batch's live rows: drafts accepted and tested
  (accepted + rejected: the verifier's evidence), and slots drafted and stopped at (a row drafting fewer than the
  round's budget: the drafter's own early stop)."""
  accepted: jax.Array  # scalar float32
  tested: jax.Array
  drafted: jax.Array
  stopped: jax.Array

  @classmethod
  def zero(cls):
    z = jnp.zeros((), jnp.float32)
    return cls(accepted=z, tested=z, drafted=z, stopped=z)

  def update(self, plan: Plan | None, accepted: jax.Array, rejected: jax.Array, drafted: jax.Array,
             stopped: jax.Array, plain: bool = False) -> "Acceptance":
    """After a round: per row [B], accepted drafts, whether the round ended at a rejection, slots drafted and
    whether the row stopped drafting before the budget (live rows only; zeros in a plain step, `plain`)."""
    memory = 1.0 if plan is None else plan.plain_memory if plain else plan.memory
    total = lambda x: jnp.sum(x).astype(jnp.float32)  # noqa: E731
    accepted_sum = total(accepted)
    return Acceptance(accepted=memory * self.accepted + accepted_sum,
                      tested=memory * self.tested + accepted_sum + total(rejected),
                      drafted=memory * self.drafted + total(drafted), stopped=memory * self.stopped + total(stopped))

  def alpha(self, plan: Plan) -> jax.Array:
    """P(a drafted token is accepted | the drafts before it were): from the prior, worth one tested draft."""
    return (self.accepted + plan.prior_alpha) / (self.tested + 1.0)

  def alpha_error(self, plan: Plan) -> jax.Array:
    """The standard error of `alpha`: sqrt(alpha (1 - alpha) / n) over the n = tested + 1 (decayed) drafts."""
    alpha = self.alpha(plan)
    return jnp.sqrt(alpha * (1.0 - alpha) / (self.tested + 1.0))

  def continues(self) -> jax.Array:
    """P(a row drafts the next slot | it drafted the ones before): from a prior of 1, worth one slot."""
    return (self.drafted + 1.0) / (self.drafted + self.stopped + 1.0)


def expected_rounds(plan: Plan, alpha, continues):
  """(tokens, cost) [G + 1] of a round with a draft budget of gamma = 0..G, per row, in plain target steps.

  Each row drafts slot i with probability `continues` once it drafted the slots before (the drafter's early stop),
  and each drafted token is accepted with probability `alpha`, so a row commits
  E = 1 + s + ... + s^gamma tokens, s = continues * alpha (Leviathan's E with s for alpha). The round costs a draft
  step while any of the B rows still drafts, and a verification over the narrowest compiled width that holds the
  longest draft: P(some row drafts >= k) = 1 - (1 - continues^k)^B. With continues = 1 this is Leviathan's fixed
  round, gamma c + v(gamma + 1). A drafter that reuses the target's first layers runs them for its last draft in
  the verification when a row drafted (`refill_cost`, P = P(longest >= 1)): the draft loop ends at the step whose
  token the longest row kept, unless every row dropped that token at its keep bar (rare: the keep bars are 0
  within a compiled width).
  """
  gamma = plan.gamma
  gammas = jnp.arange(gamma + 1)
  tokens = jnp.cumsum((continues * alpha) ** gammas)
  k = jnp.arange(gamma + 1, dtype=jnp.float32)
  some_row = 1.0 - (1.0 - continues ** k) ** plan.rows  # [k]: P(the longest draft >= k); k = 0: 1
  # Draft steps for budget g: step i + 1 runs while some row has drafted all i before it, i = 0..g-1.
  steps = jnp.concatenate([jnp.zeros(1), jnp.cumsum(some_row[:-1])])
  verify = jnp.zeros(gamma + 1)
  for i, width in enumerate(plan.widths):  # the narrowest width >= n + 1 holds a longest draft n (capped at g)
    lo, hi = (plan.widths[i - 1] if i else 0), width  # width i holds lo <= n < hi
    below_hi = some_row[hi] if hi <= gamma else 0.0
    reach = jnp.where(gammas >= lo, some_row[lo], 0.0) - jnp.where(gammas >= hi, below_hi, 0.0)
    verify = verify + reach * plan.verify_costs[i]
  cost = jnp.where(gammas == 0, plan.plain_cost, steps * plan.draft_cost + verify + plan.refill_cost * some_row[1])
  return tokens, cost


def draft_length(plan: Plan, acceptance: Acceptance) -> jax.Array:
  """gamma* in 0..G: the draft budget with the most expected tokens per unit of cost (0: a plain step).

  Where that is a plain step, the round drafts anyway (the best budget of at least one) if an acceptance
  `plan.optimism` standard errors above the running one says drafting pays: the running acceptance is the mean of
  about ten recent drafts, and near the break-even its dips would otherwise hold a paying drafter in plain steps,
  which bring no evidence, for tens of steps. Each such round adds evidence, so the optimism shrinks where drafting
  truly does not pay."""
  alpha, continues = acceptance.alpha(plan), acceptance.continues()
  tokens, cost = expected_rounds(plan, alpha, continues)
  rate = tokens / cost
  best = jnp.argmax(rate).astype(jnp.int32)
  if not plan.optimism or plan.gamma == 0:
    return best
  hopeful = jnp.minimum(alpha + plan.optimism * acceptance.alpha_error(plan), 1.0)
  tokens_hi, cost_hi = expected_rounds(plan, hopeful, continues)
  rate_hi = tokens_hi / cost_hi
  drafting = (1 + jnp.argmax(rate[1:])).astype(jnp.int32)
  return jnp.where((best == 0) & (jnp.max(rate_hi[1:]) > rate_hi[0]), drafting, best)


def confidence_bars(plan: Plan, acceptance: Acceptance) -> tuple[jax.Array, jax.Array]:
  """(keep [G], go [G]): the joint confidence (the product of the draft's top probabilities over slots 1..i) a row
  needs to keep slot i, and to draft slot i + 1 (the module docstring, rule 1; `specjax.drafters.keeps`).

  Slot i adds about its joint confidence in tokens (the chance drafts 1..i are all accepted). Keeping it costs its
  widening of the verification (`Plan.widening_costs`: its draft step has run); drafting slot i + 1 costs a draft
  step and that slot's widening, for about joint_i x alpha tokens. Each pays when it adds tokens at least at the
  rate the round is expected to achieve, the plan's best tokens per unit of cost (`expected_rounds`; both per row,
  so at batch B a cost counts as shared by the rows that pay it alike). `plan.min_confidence` (not None) is both
  bars at every slot instead.
  """
  if plan.min_confidence is not None:
    bar = jnp.full((plan.gamma,), plan.min_confidence, jnp.float32)
    return bar, bar
  alpha = acceptance.alpha(plan)
  tokens, cost = expected_rounds(plan, alpha, acceptance.continues())
  rate = jnp.max(tokens / cost)
  widening = jnp.asarray(plan.widening_costs, jnp.float32)
  following = jnp.concatenate([widening[1:], jnp.zeros(1)])  # the widening of slot i + 1 (none past the last)
  return rate * widening, rate * (plan.draft_cost + following) / alpha
