"""Drafting policies: how many tokens each speculative round drafts, and where a row stops drafting.

A policy is a static, hashable object (equal policies share one compiled program) whose functions are pure and
run inside the compiled loop over a small state pytree the loop carries (`specjax.speculative.SpecState.policy`),
so no choice needs a host sync:

  plan(cost: DraftCost, gamma, rows, tree_nodes=None) -> policy
      the policy for one program, from the drafter's costs (`specjax.drafters.DraftCost`), the most tokens a round
      drafts, the rows one target forward processes (the batch per device) and the size of the draft trees the
      program may verify (None: chains only).
  gamma, widths, tree_nodes
      the most tokens a round drafts (a tree's depth), the verification widths the program compiles for chains (a
      round verifies in the narrowest that holds its longest draft and the pending token), and N: a tree round
      verifies its N nodes and the pending token (None: no tree rounds).
  init() -> state
  choose(state) -> Choice(budget, keep_bars, go_bars, tree)
      before a round: draft at most `budget` tokens (0: a plain target step), and the bars on a row's joint
      confidence at each slot to keep the slot and to draft the next one (`specjax.drafters.keeps`); or, `tree`,
      a tree of N nodes, `budget` deep. A kind of round a policy never chooses (its choice a Python value) is not
      compiled.
  observe(state, outcome: Outcome) -> state
      after the round, from what its rows drafted and the verifier accepted.

`specjax.generate(..., adaptive=False)` runs `FixedGamma`: every round drafts gamma tokens in every row (Leviathan
et al. 2023, "Fast Inference from Transformers via Speculative Decoding"), or with `tree_nodes` a tree of N nodes.
`adaptive=True` runs `AdaptiveDrafting()`, which drafts where drafting pays by the costs of a round's parts:

1. Per-row early stop (Kangaroo, Liu et al. 2024; EAGLE-2, Li et al. 2024) on a row's joint confidence at slot i,
   the product of the draft's top probabilities over slots 1..i (EAGLE-2's path value: about the chance that
   drafts 1..i are all accepted). A row keeps slot i while joint_i pays for the wider verification the slot needs,
   and drafts slot i + 1 while joint_i x alpha pays for a draft step and that slot's widening, both at the rate of
   tokens per unit of cost the round is expected to achieve (`confidence_bars`). `min_confidence = x` sets both
   bars to x at every slot instead (Kangaroo's fixed bar). The confidence at slot i is a function of the tokens
   before slot i only, never of the token drawn there, so whether slot i is drafted is decided before x_i is drawn:
   every emitted token still follows the target (an undrafted slot is verified with q = 0, i.e. drawn from p, as
   the bonus token is).

2. A draft budget per round: Leviathan et al.'s optimal gamma (section 3.4), extended to rows that stop early.
   With alpha the running acceptance of drafted tokens and d the running chance that a row drafts its next slot,
   a row commits E(gamma) = sum_{i=0..gamma} (d alpha)^i tokens in a round with budget gamma, and the round costs a
   draft step c while any of the B rows still drafts plus a verification over the narrowest compiled width that
   holds the longest draft (P(some row drafts >= k slots) = 1 - (1 - d^k)^B; `expected_rounds`). The round drafts

       gamma* = argmax_{0 <= gamma <= G} E(gamma) / cost(gamma),

   G being the static maximum; gamma = 0 is a plain target step (cost 1 plus the drafter following it), so where
   drafting cannot pay decoding falls back to autoregressive steps at about their cost. With d = 1 this is
   Leviathan's round, gamma c + v(gamma). Costs are in target steps at the same batch size: c and the plain step's
   share from the drafter (`DraftCost`), and v(gamma) = f(B w) / f(B), w the compiled width that holds gamma + 1
   tokens and f(n) a target forward over n rows (batch rows times tokens) over a 1-row one, from `forward_costs`
   (the points of a table, interpolated: by default measured for the model, dtype, rows and host a generation runs
   on, `specjax.calibration`; else a typed one, `default_forward_costs`). A drafter that reuses the target's first
   layers (`Drafter.reuse_layers`) has run them for the positions verification reads, so its verification runs only
   the rest, plus the reused layers for the last draft when a row kept it (`RoundCosts.refill_cost`).

3. The running estimates: alpha = accepted / tested drafts and d = drafted / (drafted + stopped) slots over past
   rounds, the counts decayed by `memory` each drafting round and started from priors (`prior_alpha` worth one
   tested draft, d = 1 worth one slot), so they follow the text. A plain step brings no evidence and ages the counts
   by `plain_memory` only: after a run of plain steps they drift back to the priors, and a drafter that pays under
   the priors is tried again, rarely.

4. Optimism under uncertainty (as in UCB bandits): where the estimate says a plain step, the round drafts anyway
   when an acceptance `optimism` = z standard errors above it says drafting pays. Near the break-even the
   estimate, the mean of a few recent decayed drafts, dips below it by chance and would hold a paying drafter in
   plain steps, which bring no evidence. results/adaptive_optimism/ (configs/adaptive_optimism.py) paired
   z = 0.5, 0.25 and 0 per prompt and repeat: for the distilled draft model z = 0.5 decoded faster than z = 0 with
   a 90% interval of the paired ratio above 1, and no comparison read slower.

5. Trees (`tree_nodes=N`, a drafter that drafts trees): a round may instead draft a tree of N nodes, gamma deep
   (EAGLE-2's, `specjax.drafters.draft_tree`), verified at width N + 1 (a forward over B (N + 1) rows, costed by
   the same f(n)). Its draft is gamma draft steps: the first over the pending token, each later one over the k
   nodes a depth expands per row (`draft_tree.TOP_K`), a draft step c scaled as a forward over B k rows,
   c f(B k) / f(B) (`RoundCosts.of`). Its tokens come from evidence, as the chain's do: T = tokens committed per
   live row in tree rounds over those rows, decayed by `memory` each tree round, from a prior worth one row. The
   prior is the chain's expected tokens with every one of the gamma slots drafted, each depth accepted with
   1 - (1 - alpha)^2 (a tree holds the chain's draft and other candidates beside it: as if each depth offered two
   drafts accepted independently at the chain's alpha), so a tree is tried where a tree could pay and the chain's
   evidence is good. The round drafts the tree when T per unit of its cost beats every chain budget and the plain
   step (`drafts_tree`). A round is evidence on its own kind only: a chain round or a plain step ages the tree's
   counts by `plain_memory`, and a tree round the chain's, as a plain step does; so a kind not chosen drifts back
   to its prior and is tried again, rarely.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.drafters import DraftCost
from specjax.drafters.draft_tree import TOP_K

# f(n), a target forward over n rows (batch rows x tokens) over a 1-row one, on 2 cores of XLA:CPU with specjax's CPU
# kernels and SmolLM2-135M fp32, causal: benchmarks/bench_verify.py on 2026-12-04 (results/bench_verify/). The
# kernels' products take rows 8 at a time, so the cost steps up past each multiple of 8; a tree's forward under its
# mask costs 1.04-1.08x the causal one over as many rows there. The typed table a CPU plans with where no calibration
# for the model runs (`specjax.calibration`).
CPU_FORWARD_COSTS = ((1, 1.0), (2, 1.16), (3, 1.09), (4, 1.12), (5, 1.09), (8, 1.27), (9, 1.42), (16, 1.8), (17, 2.03),
                     (20, 2.22), (24, 2.51), (32, 3.05), (33, 3.32), (40, 3.82), (48, 4.41), (64, 5.72), (65, 5.91),
                     (68, 6.17), (136, 11.84))

# GPU/TPU: a small model's forward stays memory-bound over these row counts (results/accelerator/).
ACCELERATOR_FORWARD_COSTS = ((1, 1.0), (64, 1.0))


def default_forward_costs() -> tuple[tuple[int, float], ...]:
  """The typed table for the backend: `CPU_FORWARD_COSTS` on a CPU, else `ACCELERATOR_FORWARD_COSTS`; what a policy
  plans with where no calibration runs (`specjax.calibration`)."""
  return CPU_FORWARD_COSTS if jax.default_backend() == "cpu" else ACCELERATOR_FORWARD_COSTS


def verify_widths(gamma: int) -> tuple[int, ...]:
  """The verification widths a program compiles for drafts of up to `gamma` tokens: 1 (a plain step), 2, gamma + 1."""
  return tuple(sorted({1, min(2, gamma + 1), gamma + 1}))


def priced_tokens(gamma: int, tree_nodes: int | None = None) -> tuple[int, ...]:
  """The tokens per row of every forward `RoundCosts.of` prices, each at the batch's rows: the verification widths,
  and with trees a depth's expansion over TOP_K nodes and a tree's verification over its nodes and the pending
  token."""
  trees = () if tree_nodes is None else (TOP_K, int(tree_nodes) + 1)
  return tuple(sorted(set(verify_widths(gamma)) | set(trees)))


def priced_forward_costs(points: tuple[tuple[int, float], ...], rows: int, gamma: int,
                         tree_nodes: int | None = None) -> tuple[tuple[int, float], ...]:
  """The points (n, f(n)) a plan for `rows` rows a forward reads from the table `points`: n = 1, rows and rows times
  each of `priced_tokens`, f interpolated as `forward_cost` does (3 decimals)."""
  rows_read = sorted({1, int(rows)} | {int(rows) * t for t in priced_tokens(gamma, tree_nodes)})
  return tuple((n, round(forward_cost(points, n), 3)) for n in rows_read)


def width_index(widths: tuple[int, ...], drafted):
  """Index of the narrowest of `widths` that holds `drafted` draft tokens and the pending token; `drafted` may
  be a Python int (the plan's costs) or a traced array (the compiled loop's choice)."""
  return jnp.searchsorted(jnp.asarray(widths), drafted + 1)


def forward_cost(points: tuple[tuple[int, float], ...], rows: int) -> float:
  """f(rows): linear interpolation between the (rows, cost) points, extrapolated from the last two; never more than
  a point at more rows costs (a forward over more rows does not cost less: a measurement above a later one is
  noise)."""
  for (n0, f0), (n1, f1) in zip(points, points[1:]):
    if rows <= n1:
      break
  later = [f for n, f in points if n >= rows]
  return min([f0 + (f1 - f0) * (rows - n0) / (n1 - n0)] + later)


# ------------------------------------------------------------------------------------------ the interface


class Choice(NamedTuple):
  """A policy's choice for the next round."""
  budget: jax.Array | int  # scalar: draft at most this many tokens (0: a plain target step)
  # Bars on a row's joint confidence, [gamma] or one for every slot (0: rows never stop early): to keep slot i, and
  # to draft slot i + 1 (`specjax.drafters.keeps`)
  keep_bars: jax.Array | float
  go_bars: jax.Array | float
  tree: jax.Array | bool = False  # scalar: draft a tree of the program's `tree_nodes` nodes, `budget` deep

  def kinds(self):
    """(plain step, chain, tree): whether the round is each kind. Python bools where the choice is a Python value
    (known when the program is traced: a kind never chosen is not compiled), else traced scalars."""
    drafts, tree = self.budget > 0, self.tree
    known = lambda x: isinstance(x, (bool, np.bool_))  # noqa: E731
    plain = (not drafts) if known(drafts) else ~drafts
    if known(tree):
      return plain, drafts if not tree else False, drafts if tree else False
    return plain, drafts & ~tree, drafts & tree


class Outcome(NamedTuple):
  """What a round did, per row [B] (zeros for rows that had finished)."""
  budget: jax.Array | int  # scalar: the round's budget (0: a plain target step)
  drafted: jax.Array  # [B] slots drafted
  accepted: jax.Array  # [B] drafts accepted
  rejected: jax.Array  # [B] bool: the round ended at a rejected draft
  stopped: jax.Array  # [B] bool: the row drafted fewer slots than the budget (its draft was unsure)
  tree: jax.Array | bool = False  # the round drafted a tree (drafted: the depth each live row's tree reaches)


class Policy(Protocol):
  """A drafting policy (the module docstring); static and hashable. `gamma`, `widths` and `tree_nodes` are those of
  a planned policy (`plan`'s result); a policy whose `plan` takes no `tree_nodes` drafts chains only."""
  gamma: int
  widths: tuple[int, ...]
  tree_nodes: int | None

  def plan(self, cost: DraftCost, gamma: int, rows: int, tree_nodes: int | None = None) -> "Policy": ...

  def init(self) -> Any: ...

  def choose(self, state) -> Choice: ...

  def observe(self, state, outcome: Outcome) -> Any: ...


def is_policy(value) -> bool:
  """Whether `value` is a policy object (not its class): it has a policy's functions (`Policy`)."""
  return not isinstance(value, type) and all(callable(getattr(value, name, None))
                                             for name in ("plan", "init", "choose", "observe"))


@dataclasses.dataclass(frozen=True)
class FixedGamma:
  """Every round drafts `gamma` tokens and every row drafts them all: Leviathan et al.'s fixed round; with
  `tree_nodes`, every round drafts a tree of that many nodes, gamma deep."""
  gamma: int | None = None  # None: generate's gamma (`plan`)
  tree_nodes: int | None = None  # set by `plan` (generate's tree_nodes)

  def plan(self, cost: DraftCost, gamma: int, rows: int, tree_nodes: int | None = None) -> "FixedGamma":
    if self.gamma is not None and self.gamma != gamma:
      raise ValueError(f"FixedGamma(gamma={self.gamma}) with generate's gamma={gamma}")
    return FixedGamma(gamma=int(gamma), tree_nodes=None if tree_nodes is None else int(tree_nodes))

  @property
  def widths(self) -> tuple[int, ...]:
    return (self.gamma + 1,)

  def init(self):
    return ()

  def choose(self, state) -> Choice:
    return Choice(budget=self.gamma, keep_bars=0.0, go_bars=0.0, tree=self.tree_nodes is not None)

  def observe(self, state, outcome: Outcome):
    return state


# --------------------------------------------------------------------------------------- the cost model


@dataclasses.dataclass(frozen=True)
class RoundCosts:
  """What a round's parts cost, in plain target steps at one batch size (the module docstring, rule 2)."""
  draft_cost: float  # c: one draft step
  plain_cost: float  # a round that does not draft: one target step plus the drafter following it
  widths: tuple[int, ...]  # the compiled verification widths (`verify_widths`)
  verify_costs: tuple[float, ...]  # a verification forward of each width
  refill_cost: float  # layers a drafter reuses (`Drafter.reuse_layers`) over its last draft, when a row kept it
  rows: int  # B: the rows one forward processes
  tree_nodes: int | None = None  # N: a tree round drafts N nodes, gamma deep (None: no tree rounds)
  tree_draft_cost: float = 0.0  # growing a tree: gamma draft steps, each after the first over k nodes a row
  tree_verify_cost: float = 0.0  # its verification, a forward over B (N + 1) rows
  round_cost: float = 0.0  # a drafting round's part that does not grow with its length (`DraftCost.round`)

  @classmethod
  def of(cls, cost: DraftCost, forward_costs: tuple[tuple[int, float], ...], gamma: int, rows: int,
         tree_nodes: int | None = None) -> "RoundCosts":
    """The costs of rounds drafting up to `gamma` tokens for `rows` rows a forward, and of rounds drafting trees of
    `tree_nodes` nodes, from the drafter's `cost` and the target's forward costs f(n)."""
    plain = forward_cost(forward_costs, rows)
    widths = verify_widths(gamma)
    # The layers after the reused ones over w tokens (all of them when none are reused); the reused ones run over
    # the last drafted token only if a row kept it (`refill_cost`).
    verify_costs = tuple((1.0 - cost.reused) * forward_cost(forward_costs, rows * w) / plain for w in widths)
    trees = {}
    if tree_nodes is not None:
      # Depth 1 is one draft step over the pending token; each of depths 2..gamma one over the TOP_K nodes a row
      # expands, a draft step scaled as the target's forward over as many rows (the module docstring, rule 5).
      expansion = forward_cost(forward_costs, rows * TOP_K) / plain
      trees = dict(tree_nodes=int(tree_nodes),
                   tree_draft_cost=float(cost.round) + float(cost.step) * (1.0 + (gamma - 1) * expansion),
                   tree_verify_cost=forward_cost(forward_costs, rows * (tree_nodes + 1)) / plain)
    return cls(draft_cost=float(cost.step), plain_cost=1.0 + cost.plain_step, widths=widths,
               verify_costs=verify_costs, refill_cost=float(cost.reused), rows=int(rows), round_cost=float(cost.round),
               **trees)

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
  def tree_cost(self) -> float:
    """A tree round: its draft and its verification."""
    return self.tree_draft_cost + self.tree_verify_cost

  @property
  def round_costs(self) -> tuple[float, ...]:
    """cost(gamma) for gamma = 0..G when every row drafts the whole budget (Leviathan's fixed-gamma round)."""
    return tuple(float(c) for c in expected_rounds(self, 0.0, 1.0)[1])


def expected_rounds(costs: RoundCosts, alpha, continues):
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
  gamma = costs.gamma
  gammas = jnp.arange(gamma + 1)
  tokens = jnp.cumsum((continues * alpha) ** gammas)
  k = jnp.arange(gamma + 1, dtype=jnp.float32)
  some_row = 1.0 - (1.0 - continues ** k) ** costs.rows  # [k]: P(the longest draft >= k); k = 0: 1
  # Draft steps for budget g: step i + 1 runs while some row has drafted all i before it, i = 0..g-1.
  steps = jnp.concatenate([jnp.zeros(1), jnp.cumsum(some_row[:-1])])
  verify = jnp.zeros(gamma + 1)
  for i, width in enumerate(costs.widths):  # the narrowest width >= n + 1 holds a longest draft n (capped at g)
    lo, hi = (costs.widths[i - 1] if i else 0), width  # width i holds lo <= n < hi
    below_hi = some_row[hi] if hi <= gamma else 0.0
    reach = jnp.where(gammas >= lo, some_row[lo], 0.0) - jnp.where(gammas >= hi, below_hi, 0.0)
    verify = verify + reach * costs.verify_costs[i]
  cost = jnp.where(gammas == 0, costs.plain_cost,
                   costs.round_cost + steps * costs.draft_cost + verify + costs.refill_cost * some_row[1])
  return tokens, cost


@struct.dataclass
class Acceptance:
  """`AdaptiveDrafting`'s state: decayed counts over past rounds, summed over the batch's live rows: drafts accepted
  and tested (accepted + rejected: the verifier's evidence), and slots drafted and stopped at (a row drafting fewer
  than the round's budget: the drafter's own early stop), in chain rounds; tokens committed and rows, in tree
  rounds."""
  accepted: jax.Array  # scalar float32
  tested: jax.Array
  drafted: jax.Array
  stopped: jax.Array
  tree_tokens: jax.Array | float = 0.0
  tree_rows: jax.Array | float = 0.0

  @classmethod
  def zero(cls):
    z = jnp.zeros((), jnp.float32)
    return cls(accepted=z, tested=z, drafted=z, stopped=z, tree_tokens=z, tree_rows=z)

  def update(self, memory, accepted: jax.Array, rejected: jax.Array, drafted: jax.Array,
             stopped: jax.Array) -> "Acceptance":
    """The counts decayed by `memory`, plus a round's: per row [B], accepted drafts, whether the round ended at a
    rejection, slots drafted and whether the row stopped drafting before the budget."""
    total = lambda x: jnp.sum(x).astype(jnp.float32)  # noqa: E731
    accepted_sum = total(accepted)
    return self.replace(accepted=memory * self.accepted + accepted_sum,
                        tested=memory * self.tested + accepted_sum + total(rejected),
                        drafted=memory * self.drafted + total(drafted), stopped=memory * self.stopped + total(stopped))

  def update_trees(self, memory, tokens: jax.Array, rows: jax.Array) -> "Acceptance":
    """The tree counts decayed by `memory`, plus a tree round's: per row [B], tokens committed and whether the row
    was live (0 and False outside tree rounds)."""
    return self.replace(tree_tokens=memory * self.tree_tokens + jnp.sum(tokens).astype(jnp.float32),
                        tree_rows=memory * self.tree_rows + jnp.sum(rows).astype(jnp.float32))

  def tree_tokens_per_row(self, prior_tokens) -> jax.Array:
    """T: tokens a live row commits in a tree round, from `prior_tokens` worth one row."""
    return (self.tree_tokens + prior_tokens) / (self.tree_rows + 1.0)

  def alpha(self, prior_alpha: float) -> jax.Array:
    """P(a drafted token is accepted | the drafts before it were): from the prior, worth one tested draft."""
    return (self.accepted + prior_alpha) / (self.tested + 1.0)

  def alpha_error(self, prior_alpha: float) -> jax.Array:
    """The standard error of `alpha`: sqrt(alpha (1 - alpha) / n) over the n = tested + 1 (decayed) drafts."""
    alpha = self.alpha(prior_alpha)
    return jnp.sqrt(alpha * (1.0 - alpha) / (self.tested + 1.0))

  def continues(self) -> jax.Array:
    """P(a row drafts the next slot | it drafted the ones before): from a prior of 1, worth one slot."""
    return (self.drafted + 1.0) / (self.drafted + self.stopped + 1.0)


@dataclasses.dataclass(frozen=True)
class AdaptiveDrafting:
  """Drafting where the costs say it pays (the module docstring): `specjax.generate(..., adaptive=...)`."""
  # None: per-slot bars on the joint draft confidence from the costs (`confidence_bars`); a float: one bar for every
  # slot, to keep it and to draft the next (0: rows never stop early)
  min_confidence: float | None = None
  # f(n): a target forward over n rows (batch x tokens) over a 1-row one, as (n, f) points. None: measured for the
  # model, dtype, rows and host a generation runs on (`specjax.calibration`, on a CPU), else (and in a bare `plan`)
  # the typed table for the backend, `default_forward_costs()`; "typed": always that typed table
  forward_costs: tuple[tuple[int, float], ...] | str | None = None
  prior_alpha: float = 0.5  # the acceptance assumed before any evidence (and returned to without evidence)
  memory: float = 0.9  # decay of the acceptance counts per drafting round
  plain_memory: float = 0.98  # their decay per plain step (no evidence): how soon a drafter is tried again
  optimism: float = 0.5  # z: standard errors above the running acceptance that may still draft (0: none)
  costs: RoundCosts | None = None  # set by `plan`

  def __post_init__(self):
    if self.min_confidence is not None and not 0.0 <= self.min_confidence <= 1.0:
      raise ValueError(f"min_confidence must be in [0, 1], got {self.min_confidence}")
    if isinstance(self.forward_costs, str):
      if self.forward_costs != "typed":
        raise ValueError(f"forward_costs must be None, \"typed\" or (rows, cost) points, got {self.forward_costs!r}")
    elif self.forward_costs is not None:
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

  def plan(self, cost: DraftCost, gamma: int, rows: int, tree_nodes: int | None = None) -> "AdaptiveDrafting":
    points = self.forward_costs if isinstance(self.forward_costs, tuple) else default_forward_costs()
    return dataclasses.replace(self, costs=RoundCosts.of(cost, points, gamma, rows, tree_nodes))

  @property
  def gamma(self) -> int:
    return self.costs.gamma

  @property
  def widths(self) -> tuple[int, ...]:
    return self.costs.widths

  @property
  def tree_nodes(self) -> int | None:
    return self.costs.tree_nodes

  def init(self) -> Acceptance:
    return Acceptance.zero()

  def choose(self, acceptance: Acceptance) -> Choice:
    keep_bars, go_bars = confidence_bars(self, acceptance)
    budget = draft_length(self, acceptance)
    if self.tree_nodes is None:
      return Choice(budget=budget, keep_bars=keep_bars, go_bars=go_bars)
    tree = drafts_tree(self, acceptance)
    return Choice(budget=jnp.where(tree, self.gamma, budget), keep_bars=keep_bars, go_bars=go_bars, tree=tree)

  def observe(self, acceptance: Acceptance, outcome: Outcome) -> Acceptance:
    """A round is evidence on its own kind of round only; the other kind's counts age by `plain_memory`, as in a
    plain step (the module docstring, rules 3 and 5)."""
    tree = jnp.asarray(outcome.tree)
    chain = (jnp.asarray(outcome.budget) > 0) & ~tree
    chain_memory = jnp.where(chain, self.memory, self.plain_memory)
    acceptance = acceptance.update(chain_memory, *(jnp.where(tree, jnp.zeros_like(x), x) for x in (
        outcome.accepted, outcome.rejected, outcome.drafted, outcome.stopped)))
    live = tree & (outcome.drafted > 0)  # every live row of a tree round drafted its tree
    return acceptance.update_trees(jnp.where(tree, self.memory, self.plain_memory),
                                   jnp.where(live, outcome.accepted + 1, 0), live)


def draft_length(policy: AdaptiveDrafting, acceptance: Acceptance) -> jax.Array:
  """gamma* in 0..G: the draft budget with the most expected tokens per unit of cost (0: a plain step).

  Where that is a plain step, the round drafts anyway (the best budget of at least one) if an acceptance
  `policy.optimism` standard errors above the running one says drafting pays (the module docstring, rule 4)."""
  costs, continues = policy.costs, acceptance.continues()
  alpha = acceptance.alpha(policy.prior_alpha)
  tokens, cost = expected_rounds(costs, alpha, continues)
  rate = tokens / cost
  best = jnp.argmax(rate).astype(jnp.int32)
  if not policy.optimism or costs.gamma == 0:
    return best
  hopeful = jnp.minimum(alpha + policy.optimism * acceptance.alpha_error(policy.prior_alpha), 1.0)
  tokens_hi, cost_hi = expected_rounds(costs, hopeful, continues)
  rate_hi = tokens_hi / cost_hi
  drafting = (1 + jnp.argmax(rate[1:])).astype(jnp.int32)
  return jnp.where((best == 0) & (jnp.max(rate_hi[1:]) > rate_hi[0]), drafting, best)


def tree_prior(gamma: int, alpha) -> jax.Array:
  """Tokens a row commits in a tree round before any evidence: a chain's E = 1 + s + ... + s^gamma with every slot
  drafted, each depth accepted with s = 1 - (1 - alpha)^2 (the module docstring, rule 5)."""
  either = 1.0 - (1.0 - alpha) ** 2
  return jnp.sum(either ** jnp.arange(gamma + 1))


def drafts_tree(policy: AdaptiveDrafting, acceptance: Acceptance) -> jax.Array:
  """Whether the round drafts a tree: T, the tokens a tree round is expected to commit per row, per unit of its cost
  beats the best chain budget's (a plain step included; `expected_rounds`)."""
  costs = policy.costs
  alpha = acceptance.alpha(policy.prior_alpha)
  tokens, cost = expected_rounds(costs, alpha, acceptance.continues())
  tree_tokens = acceptance.tree_tokens_per_row(tree_prior(costs.gamma, alpha))
  return tree_tokens / costs.tree_cost > jnp.max(tokens / cost)


def confidence_bars(policy: AdaptiveDrafting, acceptance: Acceptance) -> tuple[jax.Array, jax.Array]:
  """(keep [G], go [G]): the joint confidence (the product of the draft's top probabilities over slots 1..i) a row
  needs to keep slot i, and to draft slot i + 1 (the module docstring, rule 1; `specjax.drafters.keeps`).

  Slot i adds about its joint confidence in tokens (the chance drafts 1..i are all accepted). Keeping it costs its
  widening of the verification (`RoundCosts.widening_costs`: its draft step has run); drafting slot i + 1 costs a
  draft step and that slot's widening, for about joint_i x alpha tokens. Each pays when it adds tokens at least at
  the rate the round is expected to achieve, the best tokens per unit of cost (`expected_rounds`; both per row, so
  at batch B a cost counts as shared by the rows that pay it alike). `policy.min_confidence` (not None) is both bars
  at every slot instead.
  """
  costs = policy.costs
  if policy.min_confidence is not None:
    bar = jnp.full((costs.gamma,), policy.min_confidence, jnp.float32)
    return bar, bar
  alpha = acceptance.alpha(policy.prior_alpha)
  tokens, cost = expected_rounds(costs, alpha, acceptance.continues())
  rate = jnp.max(tokens / cost)
  widening = jnp.asarray(costs.widening_costs, jnp.float32)
  following = jnp.concatenate([widening[1:], jnp.zeros(1)])  # the widening of slot i + 1 (none past the last)
  return rate * widening, rate * (costs.draft_cost + following) / alpha
