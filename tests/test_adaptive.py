"""Verification that reuses a layer-skip draft's layers, and the drafting policies: the draft-length rule, the
confidence bars, the running estimates, and verification of rows that drafted fewer tokens."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import speculative, verify
from specjax.adaptive import (ACCELERATOR_FORWARD_COSTS, CPU_FORWARD_COSTS, Acceptance, AdaptiveDrafting, Choice,
                              FixedGamma, Outcome, RoundCosts, confidence_bars, draft_length, drafts_tree,
                              expected_rounds, forward_cost, tree_prior, verify_widths)
from specjax.decoding import prefill
from specjax.drafters import DraftCost, DraftInputs, PromptInfo
from specjax.model import init_cache
from specjax.sampling import SamplingParams
from tests.task_drafters import perturbed

# Free verification widths (and free drafts: `free`): every round drafts gamma, and rows stop early where the draft
# is unsure (so rounds verify fewer than gamma + 1 tokens); drafters that reuse layers plan the same rounds.
EAGER = AdaptiveDrafting(min_confidence=0.15, prior_alpha=0.7, forward_costs=((1, 1.0), (64, 1.0)))


def free(drafter):
  """The drafter with draft steps that cost nothing."""
  return dataclasses.replace(drafter, cost=dataclasses.replace(drafter.cost, step=0.0))


def ragged_prompts(vocab, batch=4, seed=0):
  rng = np.random.RandomState(seed)
  return [list(rng.randint(0, vocab, size=n)) * 2 for n in [7, 12, 3, 9][:batch]]


def early_exits(target):
  return {"exit": specjax.make_drafter("layer_skip", target, exit_layer=2),
          "adapter": perturbed(specjax.make_drafter("layer_skip", target, adapter="fresh", exit_layer=2), seed=3,
                               scale=0.1)}


def drafting_start(target, drafter):
  """The state a drafter proposes from after the target's prefill of 4 ragged prompts: (drafter state, sequence,
  lengths, target cache)."""
  prompts = ragged_prompts(target.config.vocab_size)
  width = max(map(len, prompts))
  tokens = jnp.asarray([p + [0] * (width - len(p)) for p in prompts], jnp.int32)
  lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
  logits, last_hidden, out = prefill(target.params, target.config, tokens, lengths, init_cache(target.config, 4, 64),
                                     return_layer_hidden=True)
  rows = jnp.arange(4)
  sequence = jnp.zeros((4, 64), jnp.int32).at[:, :width].set(tokens).at[rows, lengths].set(jnp.argmax(logits, -1))
  prompt = PromptInfo(tokens=tokens, lengths=lengths, first_token=sequence[rows, lengths], last_hidden=last_hidden,
                      features=jnp.stack([out.layer_hidden[i] for i in drafter.feature_layers], axis=2)
                      if drafter.feature_layers else None, cache_len=64)
  return drafter.init(target.params, drafter.params, drafter.options, prompt), sequence, lengths, out.cache


# The fast tier runs the adapter at the full budget: the exit's reuse is the same handover without the adapter's block.
@pytest.mark.parametrize("name, budget", [("adapter", 3)] + [pytest.param(n, b, marks=pytest.mark.slow)
                                                            for n, b in [("exit", 3), ("exit", 2), ("adapter", 2),
                                                                         ("exit", 1), ("adapter", 1)]])
def test_verify_reusing_the_draft_layers_equals_the_plain_verify(name, budget, random_target):
  """Ragged rows, the draft run for `budget` of gamma=3 steps: equal logits at every slot verification reads
  (pending .. x_budget), equal layer-k features, equal K/V in the cache over those positions."""
  target, gamma = random_target, 3
  drafter = early_exits(target)[name]
  assert drafter.reuse_layers == 2
  state, sequence, lengths, cache = drafting_start(target, drafter)
  rows = jnp.arange(4)
  inputs = DraftInputs(sequence=sequence, position=lengths, target_cache=cache, key=jax.random.PRNGKey(0),
                       budget=jnp.asarray(budget, jnp.int32))
  proposal = drafter.propose(target.params, drafter.params, drafter.options, state, inputs, gamma, SamplingParams())
  assert int(proposal.steps) == budget
  verify_tokens = jnp.concatenate([sequence[rows, lengths][:, None], proposal.tokens], axis=1)

  def run(reuse_layers):
    return speculative._verify_forward(target.params, target.config, verify_tokens, proposal, proposal.target_cache,
                                       lengths, gamma + 1, reuse_layers, with_layers=True, longest=budget)

  reused, plain = run(drafter.reuse_layers), run(0)
  read = slice(0, budget + 1)  # no row drafted past x_budget

  def assert_close(a, b):  # float32 rounding of differently shaped products, relative to the values' scale
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(b))))

  assert_close(reused.logits[:, read], plain.logits[:, read])
  assert_close(reused.hidden[:, read], plain.hidden[:, read])
  assert_close(reused.layer_hidden[1][:, read], plain.layer_hidden[1][:, read])

  def assert_same_cache(cache, width):
    positions = lengths[:, None] + jnp.arange(width)[None, :]
    for layer in range(target.config.num_layers):
      for cached in ("k", "v"):
        assert_close(getattr(cache, cached)[layer][rows[:, None], positions],
                     getattr(plain.cache, cached)[layer][rows[:, None], positions])
  assert_same_cache(reused.cache, budget + 1)
  # Adaptive drafting verifies only as wide as the longest draft (width - 1 tokens): any width up to budget + 1
  # reads the same, from width 1 (every row unsure at its first slot) up. Up to width `budget` the draft ran a step
  # past the longest draft and its own layer k-1 outputs serve every position; at budget + 1 layers 0..k-1 run for
  # x_budget.
  for width in range(1, budget + 2):
    narrow = speculative._verify_forward(target.params, target.config, verify_tokens, proposal,
                                         proposal.target_cache, lengths, width, drafter.reuse_layers,
                                         with_layers=True, longest=width - 1)
    assert narrow.logits.shape == plain.logits[:, :width].shape
    assert_close(narrow.logits[:, :width], plain.logits[:, :width])
    assert_close(narrow.layer_hidden[1], plain.layer_hidden[1][:, :width])
    assert_same_cache(narrow.cache, width)


@pytest.mark.parametrize("adaptive", [False, pytest.param(EAGER, marks=pytest.mark.slow)],
                         ids=["fixed_gamma", "adaptive"])
@pytest.mark.parametrize("temperature", [0.0, pytest.param(1.0, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", [pytest.param("exit", marks=pytest.mark.slow), "adapter"])
def test_reusing_the_draft_layers_decodes_the_same_tokens(name, temperature, adaptive, random_target):
  target = random_target
  drafter = free(early_exits(target)[name])
  prompts = ragged_prompts(target.config.vocab_size)
  kwargs = dict(max_new_tokens=16, gamma=3, stop_ids=[], temperature=temperature, seed=2, adaptive=adaptive)
  reused = specjax.generate(target, prompts, drafter=drafter, **kwargs)
  plain = specjax.generate(target, prompts, drafter=dataclasses.replace(drafter, reuse_layers=0), **kwargs)
  assert reused.tokens == plain.tokens
  assert reused.stats["accepted_per_row"] == plain.stats["accepted_per_row"]
  if temperature == 0.0:
    assert reused.tokens == specjax.generate(target, prompts, max_new_tokens=16, stop_ids=[]).tokens


@pytest.mark.parametrize("name", ["layer_skip", pytest.param("mtp_parallel", marks=pytest.mark.slow),
                                  pytest.param("mtp_sequential", marks=pytest.mark.slow)])
def test_rows_keep_draft_slots_while_their_joint_confidence_clears_the_bars(name, random_target):
  """Per-slot bars on the joint confidence (the product of the top draft probabilities so far) in each of the three
  drafting loops (the shared one, parallel heads, sequential modules): a row keeps slot i while its joint confidence
  is at or above the slot's keep bar and it went on from every slot before (joint at or above that slot's go bar
  too), and what it keeps is the draft it would have made without bars."""
  target, gamma = random_target, 4
  drafter = {"layer_skip": specjax.make_drafter("layer_skip", target, exit_layer=2),
             "mtp_parallel": perturbed(specjax.make_drafter("mtp_parallel", target, path=None, num_heads=gamma)),
             "mtp_sequential": perturbed(specjax.make_drafter("mtp_sequential", target, path=None, depth=gamma))}[name]
  state, sequence, lengths, cache = drafting_start(target, drafter)

  def propose(keep, go):
    inputs = DraftInputs(sequence=sequence, position=lengths, target_cache=cache, key=jax.random.PRNGKey(0),
                         keep_bars=keep, go_bars=go)
    return drafter.propose(target.params, drafter.params, drafter.options, state, inputs, gamma,
                           SamplingParams(temperature=1.0))

  full = propose(0.0, 0.0)
  assert np.asarray(full.lengths).tolist() == [gamma] * 4
  confidences = np.max(np.asarray(full.probs), axis=-1)  # [B, gamma]: q's top probability, as `confidence` reads it
  joint = np.cumprod(confidences, axis=1)

  def expected(values, keep, go):
    kept = values >= keep
    went_on = np.concatenate([np.ones((len(values), 1), bool), (kept & (values >= go))[:, :-1]], axis=1)
    return np.cumprod(kept & went_on, axis=1).sum(axis=1).tolist()

  # Bars at which rows stop at different slots, and at which a slot's own confidence would keep another length
  # than the joint one: the per-slot medians of the joint confidence, or else one bar for every slot.
  candidates = [np.median(joint, axis=0)] + [np.full(gamma, b) for b in np.linspace(0.05, 0.6, 12)]
  bars = next(b for b in candidates if len(set(expected(joint, b, b))) > 1
              and expected(joint, b, b) != expected(confidences, b, b))
  zero = np.zeros(gamma)
  # One bar (a row stops at the first slot below it), and go bars only (a row keeps the slot where it stops).
  cases = [(bars, bars), (zero, bars)]
  assert expected(joint, *cases[0]) != expected(joint, *cases[1])
  for keep, go in cases:
    out = propose(jnp.asarray(keep, jnp.float32), jnp.asarray(go, jnp.float32))
    lengths_kept = expected(joint, keep, go)
    assert np.asarray(out.lengths).tolist() == lengths_kept
    for row, n in enumerate(lengths_kept):
      assert np.asarray(out.tokens)[row, :n].tolist() == np.asarray(full.tokens)[row, :n].tolist()


def test_only_early_exits_reuse_layers(random_target):
  assert specjax.make_drafter("layer_skip", random_target, skip_layers=[1]).reuse_layers == 0
  assert specjax.make_drafter("layer_skip", random_target, exit_layer=3).reuse_layers == 3


# ------------------------------------------------------------------------------------- the draft-length rule


def policy(draft_cost, verify_costs, rows=1, prior_alpha=0.5, memory=0.9, gamma=4, refill_cost=0.0,
           optimism=0.0) -> AdaptiveDrafting:
  costs = RoundCosts(draft_cost=draft_cost, plain_cost=1.0, widths=verify_widths(gamma),
                     verify_costs=tuple(verify_costs), refill_cost=refill_cost, rows=rows)
  return AdaptiveDrafting(prior_alpha=prior_alpha, memory=memory, plain_memory=memory, optimism=optimism, costs=costs)


def evidence(accepted, tested, drafted=None, stopped=0):
  """Decayed counts; by default every row drafted the whole budget (no early stops)."""
  drafted = tested if drafted is None else drafted
  return Acceptance(accepted=jnp.float32(accepted), tested=jnp.float32(tested), drafted=jnp.float32(drafted),
                    stopped=jnp.float32(stopped))


def test_draft_length_is_leviathans_optimum_and_falls_back_to_plain_steps():
  cheap = policy(0.05, (1.0, 1.2, 1.2))
  assert cheap.costs.round_costs == pytest.approx((1.0, 1.25, 1.3, 1.35, 1.4))
  assert int(draft_length(cheap, evidence(90, 100))) == 4  # alpha ~ 0.9, cheap drafts: the longest
  assert int(draft_length(cheap, evidence(1, 100))) == 0  # nothing gets accepted: plain steps
  costly = policy(0.8, (1.0, 1.1, 1.1))
  assert int(draft_length(costly, evidence(60, 100))) == 0  # a draft step nearly as dear as a target step
  # In between, the argmax of E(alpha, g) / cost(g), with E = 1 + alpha + ... + alpha^g.
  middle = policy(0.3, (1.0, 1.1, 1.1))
  alpha = (70 + 0.5) / (100 + 1)
  expected = [sum(alpha ** i for i in range(g + 1)) / c for g, c in enumerate(middle.costs.round_costs)]
  assert int(draft_length(middle, evidence(70, 100))) == int(np.argmax(expected)) not in (0, 4)
  # The policy's choice is that budget, with the bars of `confidence_bars`.
  choice = middle.choose(evidence(70, 100))
  assert int(choice.budget) == int(np.argmax(expected))
  for bars, expected_bars in zip((choice.keep_bars, choice.go_bars), confidence_bars(middle, evidence(70, 100))):
    np.testing.assert_allclose(bars, expected_bars)


def test_optimism_drafts_where_an_acceptance_a_few_errors_up_would_pay_and_not_where_evidence_rules_it_out():
  """A drafter with c = 0.17 pays from alpha 0.17 on (a 2-token forward costs a 1-token one). At a running
  acceptance of 0.14 from about ten drafts (standard error 0.11), z = 0.5 errors up pays: it drafts one token. The
  same 0.14 from 200 drafts (error 0.02), or 0.02 from ten, does not: plain steps, as without optimism."""
  for optimism in (0.0, 0.5):
    p = policy(0.17, (1.0, 1.0, 1.12), optimism=optimism)
    noisy = evidence(0.9, 9)  # alpha (0.9 + 0.5) / (9 + 1) = 0.14
    assert float(noisy.alpha(p.prior_alpha)) == pytest.approx(0.14)
    assert float(noisy.alpha_error(p.prior_alpha)) == pytest.approx(np.sqrt(0.14 * 0.86 / 10))
    assert int(draft_length(p, noisy)) == (1 if optimism else 0)
    assert int(draft_length(p, evidence(27.64, 200))) == 0  # alpha 0.14 again, error 0.024
    assert int(draft_length(p, evidence(0, 24))) == 0  # alpha 0.02, error 0.028
    assert int(draft_length(p, evidence(90, 100))) == 4  # where the estimate itself says draft, it decides alone
  with pytest.raises(ValueError, match="optimism"):
    AdaptiveDrafting(optimism=-1.0)


def test_confidence_bars_charge_each_slot_its_widening_and_the_next_its_draft_step_at_the_rounds_rate():
  """At the round's best expected tokens per unit of cost: slot i is kept for the widening of the verification it
  needs (widths 1, 2, 5 for gamma 4: slot 1 widens 1 -> 2, slot 2 2 -> 5, slots 3 and 4 fit in 5), and slot i + 1
  is drafted when joint_i x alpha pays for a draft step and slot i + 1's widening."""
  p = policy(0.05, (1.0, 1.02, 1.2))
  assert p.costs.widening_costs == pytest.approx((0.02, 0.18, 0.0, 0.0))
  seen = evidence(60, 100)
  alpha = (60 + 0.5) / (100 + 1)
  tokens, cost = expected_rounds(p.costs, alpha, seen.continues())
  rate = float(np.max(np.asarray(tokens) / np.asarray(cost)))
  assert rate > 1.0  # drafting pays at alpha 0.6
  keep, go = confidence_bars(p, seen)
  np.testing.assert_allclose(keep, rate * np.asarray([0.02, 0.18, 0.0, 0.0]), rtol=1e-5)
  np.testing.assert_allclose(go, rate * (0.05 + np.asarray([0.18, 0.0, 0.0, 0.0])) / alpha, rtol=1e-5)
  # A first draft is kept from a low confidence where a 2-token forward is nearly free ...
  assert float(keep[0]) < 0.05
  # ... and needs a confident draft where the wider forward is dear (here 1.37 plain steps for 2 tokens).
  assert float(confidence_bars(policy(0.05, (1.0, 1.37, 2.7), rows=8), seen)[0][0]) > 0.3
  # Both bars x at every slot when `min_confidence` = x.
  for bar in confidence_bars(dataclasses.replace(p, min_confidence=0.3), seen):
    np.testing.assert_allclose(bar, [0.3] * 4, rtol=1e-6)


def test_expected_rounds_match_a_simulation_of_early_stopping_rows():
  """Rows draft each next slot with probability `continues` and have each draft accepted with probability alpha;
  the round runs a draft step while some row still drafts and verifies in the narrowest width holding the longest
  draft, and a drafter reusing the target's first layers runs them for its last draft when a row drafted. The
  closed form agrees with simulating exactly that, at every budget and batch size."""
  rng = np.random.default_rng(0)
  alpha, continues, n = 0.7, 0.6, 200_000
  for rows in (1, 4):
    p = policy(0.1, (0.8, 1.1, 1.8), rows=rows, refill_cost=0.2).costs
    tokens, cost = (np.asarray(x) for x in expected_rounds(p, alpha, continues))
    for g in range(1, p.gamma + 1):
      drafted = np.minimum(rng.geometric(1 - continues, size=(n, rows)) - 1, g)  # slots each row drafts
      accepted = np.minimum(rng.geometric(1 - alpha, size=(n, rows)) - 1, drafted)  # a prefix of them
      longest = drafted.max(axis=1)
      width = np.searchsorted(np.asarray(p.widths), longest + 1)
      round_cost = (np.minimum(longest + 1, g) * p.draft_cost + np.asarray(p.verify_costs)[width]
                    + p.refill_cost * (longest >= 1))
      assert tokens[g] == pytest.approx(1 + accepted.mean(), abs=0.01)
      assert cost[g] == pytest.approx(round_cost.mean(), abs=0.01)
    assert cost[0] == p.plain_cost and tokens[0] == 1.0


def test_rows_that_stop_drafting_early_make_wide_verification_pay_less():
  """The same verifier evidence (alpha 0.8), with most rows stopping before they draft: at batch 1 a round whose
  row stopped is verified in a 1-token forward, so drafting still pays; at batch 4 some row nearly always drafts, the
  wide forward runs anyway and the few accepted drafts do not pay for it, so the rounds are plain steps."""
  costs = {1: (1.0, 1.07, 1.43), 4: (1.0, 1.34, 2.5)}
  for rows, verify_costs in costs.items():
    p = policy(0.06, verify_costs, rows=rows)
    assert int(draft_length(p, evidence(80, 100))) > 0  # no early stops: every round pays at alpha 0.8
  stops = dict(drafted=100, stopped=300)  # a row drafts the next slot a quarter of the time
  assert int(draft_length(policy(0.06, costs[1], rows=1), evidence(80, 100, **stops))) > 0
  assert int(draft_length(policy(0.06, costs[4], rows=4), evidence(80, 100, **stops))) == 0


def outcome(budget, drafted=(0, 0), accepted=(0, 0), rejected=(False, False)):
  drafted = jnp.array(drafted)
  return Outcome(budget=budget, drafted=drafted, accepted=jnp.array(accepted), rejected=jnp.array(rejected),
                 stopped=drafted < budget)


def test_observing_rounds_moves_the_estimates_and_plain_steps_let_them_decay_back_to_the_prior():
  p = dataclasses.replace(policy(1.0, (1.0, 2.0, 2.0), prior_alpha=0.6, memory=0.5), plain_memory=0.9)
  # Two rows with a budget of 2: one drafted a slot, had it rejected and stopped; one stopped before drafting.
  first = p.observe(p.init(), outcome(2, drafted=(1, 0), rejected=(True, False)))
  assert float(first.alpha(p.prior_alpha)) == pytest.approx(0.6 / 2)
  assert float(first.continues()) == pytest.approx(2 / 4)
  # A drafting round in which no row drafted ages the counts by `memory`, a plain step by `plain_memory`.
  assert float(p.observe(first, outcome(1)).tested) == pytest.approx(0.5)
  assert float(p.observe(first, outcome(0)).tested) == pytest.approx(0.9)
  a = first
  for _ in range(10):  # plain steps: the evidence ages slowly
    a = p.observe(a, outcome(0))
  assert float(a.tested) == pytest.approx(0.9 ** 10) and float(a.alpha(p.prior_alpha)) < 0.5
  for _ in range(200):
    a = p.observe(a, outcome(0))
  assert float(a.alpha(p.prior_alpha)) == pytest.approx(0.6, abs=1e-6)
  assert float(a.continues()) == pytest.approx(1.0, abs=1e-6)


def test_plain_steps_age_the_evidence_slower_so_a_drafter_that_rarely_pays_is_tried_rarely():
  """The row is unsure at its first slot whenever the drafter tries (c = 0.15, 3 of 4 drafts accepted before):
  with the default ages it tries in a few of 200 rounds; aged by `memory` in plain steps too, in more than twice
  as many."""
  def tries(defaults, rounds=200):
    p = dataclasses.replace(policy(0.15, (1.0, 1.0, 1.12)), memory=defaults.memory,
                            plain_memory=defaults.plain_memory)
    a, count = p.observe(p.init(), Outcome(budget=4, drafted=jnp.array([4]), accepted=jnp.array([3]),
                                           rejected=jnp.array([True]), stopped=jnp.array([False]))), 0
    for _ in range(rounds):
      budget = int(p.choose(a).budget)
      count += budget > 0
      a = p.observe(a, outcome(budget, drafted=(0,), accepted=(0,), rejected=(False,)))  # a try: the row stops
    return count

  default = tries(AdaptiveDrafting())
  same = tries(AdaptiveDrafting(plain_memory=AdaptiveDrafting().memory))
  assert same > 50 and default < same / 2, (default, same)


def test_fixed_gamma_drafts_gamma_in_every_row_every_round():
  p = FixedGamma().plan(DraftCost(step=0.9), gamma=3, rows=8)
  assert p == FixedGamma(3) and hash(p) == hash(FixedGamma(3)) and p.widths == (4,)
  state = p.init()
  for _ in range(3):
    choice = p.choose(state)
    assert (choice.budget, choice.keep_bars, choice.go_bars) == (3, 0.0, 0.0)
    state = p.observe(state, outcome(3, drafted=(1, 3), accepted=(0, 3), rejected=(True, False)))
  with pytest.raises(ValueError, match="gamma"):
    FixedGamma(2).plan(DraftCost(), gamma=3, rows=1)


def test_round_costs_follow_the_forward_costs_of_the_rows_verified(random_target):
  exit_drafter = specjax.make_drafter("layer_skip", random_target, exit_layer=2)
  reused = exit_drafter.cost.reused
  points = ((1, 1.0), (5, 1.4), (10, 2.4))
  with_reuse, without = (RoundCosts.of(DraftCost(step=0.3, reused=s), points, 4, 1) for s in (reused, 0.0))
  # g c + f(w): gamma drafted tokens are verified in the narrowest compiled width w >= gamma + 1 (2 or 5).
  assert verify_widths(4) == (1, 2, 5) and verify_widths(1) == (1, 2)
  assert without.round_costs == pytest.approx((1.0, 0.3 + 1.1, 0.6 + 1.4, 0.9 + 1.4, 1.2 + 1.4))
  assert with_reuse.round_costs[0] == 1.0 and all(a < b for a, b in zip(with_reuse.round_costs[1:],
                                                                       without.round_costs[1:]))
  # Reusing layers 0..k-1 (share s of the weights): they run for the last draft when it reached the budget, and
  # the rest of the forward over every position; a drafting round whose rows all stopped at once runs layers k..
  s = with_reuse.refill_cost
  assert 0.2 < s < 0.8 and without.refill_cost == 0.0
  assert with_reuse.round_costs == pytest.approx([1.0] + [g * 0.3 + s + (1 - s) * v for g, v in
                                                          zip(range(1, 5), (1.1, 1.4, 1.4, 1.4))])
  assert with_reuse.verify_costs[0] == pytest.approx(1 - s)
  # At batch 2 the forward covers 2 w rows, over a plain step's f(2) = 1.1; f(20) extrapolates.
  at_2 = RoundCosts.of(DraftCost(step=0.3), points, 4, 2)
  assert at_2.round_costs == pytest.approx((1.0, 0.3 + 1.3 / 1.1, 0.6 + 2.4 / 1.1, 0.9 + 2.4 / 1.1, 1.2 + 2.4 / 1.1))
  assert RoundCosts.of(DraftCost(step=0.3), points, 4, 4).round_costs[4] == pytest.approx(1.2 + 4.4 / 1.3)
  # A forward over more rows does not cost less: a point measured above a later one is read as that one's cost.
  noisy = ((1, 1.0), (2, 1.3), (5, 1.1), (10, 2.0))
  assert [forward_cost(noisy, n) for n in (2, 4, 5, 7)] == pytest.approx([1.1, 1.1, 1.1, 1.46])


def test_drafters_describe_their_costs(random_target):
  """A draft step reads the weights it runs over the target's: a draft model as large as the target costs about a
  target step, and follows a plain step with its layers alone; an early exit after k layers reuses them (no
  following); prompt lookup costs nothing."""
  draft = specjax.make_drafter("draft_model", random_target, draft=random_target).cost
  assert draft.step == pytest.approx(1.0, abs=0.02) and 0.3 < draft.plain_step < draft.step and draft.reused == 0.0
  early_exit = specjax.make_drafter("layer_skip", random_target, exit_layer=2).cost
  assert 0.0 < early_exit.reused < early_exit.step < 1.0 and early_exit.plain_step == 0.0
  assert specjax.make_drafter("layer_skip", random_target, skip_layers=[1]).cost.reused == 0.0
  assert specjax.make_drafter("prompt_lookup", random_target).cost == DraftCost()
  # A plain step costs one target step plus the drafter following it, at any batch size.
  for rows in (1, 2, 8):
    assert RoundCosts.of(draft, ((1, 1.0), (4, 1.0), (8, 1.6)), 4, rows).plain_cost == pytest.approx(
        1.0 + draft.plain_step)
  for bad in (dict(step=-0.1), dict(plain_step=-1.0), dict(reused=1.0), dict(round=-0.5)):
    with pytest.raises(ValueError, match="draft costs"):
      DraftCost(**bad)
  # A block drafter's forward (and the parallel heads' head) is paid once a drafting round, whatever its length.
  block = specjax.make_drafter("block", random_target, path=None, block_size=4).cost
  heads = specjax.make_drafter("mtp_parallel", random_target, path=None, num_heads=4).cost
  assert block.round > 0.0 and block.step == 0.0 and 0.0 < block.plain_step < block.round
  assert heads.round > 0.0 and heads.step > 0.0


def test_a_rounds_fixed_cost_is_paid_once_a_drafting_round():
  points = ((1, 1.0), (2, 1.1), (5, 1.4))
  per_step = RoundCosts.of(DraftCost(step=0.3), points, 4, 1)
  with_round = RoundCosts.of(DraftCost(step=0.3, round=0.5), points, 4, 1)
  assert with_round.round_costs[0] == per_step.round_costs[0] == 1.0  # a plain step does not draft
  assert with_round.round_costs[1:] == pytest.approx([c + 0.5 for c in per_step.round_costs[1:]])
  trees = [RoundCosts.of(DraftCost(step=0.3, round=r), points, 4, 1, tree_nodes=8) for r in (0.0, 0.5)]
  assert trees[1].tree_cost == pytest.approx(trees[0].tree_cost + 0.5)


def test_the_default_costs_draft_at_batch_1_and_not_at_batch_8(random_target):
  """On 2-core XLA:CPU (`CPU_FORWARD_COSTS`) a 2-token forward at batch 8 costs ~1.5 plain steps (16 rows over 8),
  so alpha 0.1 does not pay there; at batch 1 it costs ~1.09 steps, less than the 1.1 tokens alpha 0.1 brings."""
  lookup = specjax.make_drafter("prompt_lookup", random_target)
  plans = {b: AdaptiveDrafting().plan(lookup.cost, 4, b) for b in (1, 8)}
  assert int(draft_length(plans[1], evidence(10, 100))) > 0
  assert int(draft_length(plans[8], evidence(10, 100))) == 0
  assert int(draft_length(plans[8], evidence(90, 100))) > 0  # high acceptance still pays


def test_bad_adaptive_options_are_rejected(random_target):
  with pytest.raises(ValueError, match="min_confidence"):
    AdaptiveDrafting(min_confidence=1.5)
  for points in [((1, 1.0),), ((1, 1.0), (4, 0.9)), ((2, 1.0), (4, 2.0)), ((1, 1.0), (4, 2.0), (3, 2.5))]:
    with pytest.raises(ValueError, match="forward_costs"):
      AdaptiveDrafting(forward_costs=points)
  with pytest.raises(ValueError, match="plain_memory"):
    AdaptiveDrafting(plain_memory=1.0)
  for adaptive in ("yes", AdaptiveDrafting):
    with pytest.raises(TypeError, match="adaptive must be"):
      specjax.generate(random_target, [[1, 2, 3]], max_new_tokens=4, adaptive=adaptive,
                       drafter=specjax.make_drafter("prompt_lookup", random_target))


# ---------------------------------------------------------------------- verification of shorter drafts


def test_greedy_verify_never_accepts_an_undrafted_slot():
  target_logits = jax.nn.one_hot(jnp.array([[1, 2, 3, 4]] * 3), 8)  # argmax 1, 2, 3, 4
  drafts = jnp.array([[1, 2, 3]] * 3)  # all three would be accepted
  accepted, next_token = verify.greedy_verify(drafts, target_logits, jnp.array([3, 1, 0]))
  assert accepted.tolist() == [3, 1, 0] and next_token.tolist() == [4, 2, 1]


def test_speculative_verify_draws_an_undrafted_slot_from_p():
  """A row that drafted 1 of 2 slots, with q == p (every draft accepted): the token after the accepted draft
  is drawn from p at slot 2, never taken from the undrafted slot."""
  n, vocab = 50_000, 5
  p = jnp.broadcast_to(jnp.asarray([0.4, 0.3, 0.2, 0.1, 0.0]), (n, 3, vocab))
  drafts = jnp.full((n, 2), 4, jnp.int32).at[:, 0].set(0)  # slot 2 holds a token p forbids
  accepted, next_token = verify.speculative_verify(jax.random.PRNGKey(0), drafts, p[:, :2], p, jnp.ones(n, jnp.int32))
  assert np.all(np.asarray(accepted) <= 1)
  observed = np.bincount(np.asarray(next_token)[np.asarray(accepted) == 1], minlength=vocab) / n
  np.testing.assert_allclose(observed, [0.4, 0.3, 0.2, 0.1, 0.0], atol=0.01)


# ------------------------------------------------------------------------------------------------ trees


def tree_policy(forward_costs, rows=1, tree_nodes=16, step=0.1, gamma=4) -> AdaptiveDrafting:
  return AdaptiveDrafting(forward_costs=forward_costs, optimism=0.0).plan(DraftCost(step=step), gamma, rows,
                                                                          tree_nodes)


def with_trees(acceptance, tokens_per_row, rows):
  """`acceptance` plus tree evidence: `rows` live rows of tree rounds committed `tokens_per_row` each."""
  return acceptance.replace(tree_tokens=jnp.float32(tokens_per_row * rows), tree_rows=jnp.float32(rows))


def test_a_tree_round_costs_its_expansions_and_a_forward_over_its_nodes():
  """Depth 1 is a draft step over the pending token, depths 2..gamma a draft step over the k = 8 nodes a row
  expands, scaled as a forward over B k rows; verification a forward over B (N + 1) rows; chains as without trees."""
  points = ((1, 1.0), (8, 1.2), (16, 1.4), (40, 2.8))
  costs = RoundCosts.of(DraftCost(step=0.1), points, 4, 1, tree_nodes=16)
  f17 = 1.4 + (2.8 - 1.4) / 24
  assert costs.tree_draft_cost == pytest.approx(0.1 * (1 + 3 * 1.2))
  assert costs.tree_verify_cost == pytest.approx(f17) and costs.tree_cost == pytest.approx(0.46 + f17)
  assert costs.round_costs == RoundCosts.of(DraftCost(step=0.1), points, 4, 1).round_costs
  # At batch 2: expansions over 16 rows, verification over 34, over a plain step's f(2).
  at_2 = RoundCosts.of(DraftCost(step=0.1), points, 4, 2, tree_nodes=16)
  f2 = 1.0 + 0.2 / 7
  assert at_2.tree_draft_cost == pytest.approx(0.1 * (1 + 3 * 1.4 / f2))
  assert at_2.tree_verify_cost == pytest.approx((1.4 + 1.4 * 18 / 24) / f2)
  assert RoundCosts.of(DraftCost(step=0.1), points, 4, 1).tree_nodes is None


def test_the_policy_picks_a_tree_where_its_evidence_pays_more_than_every_chain():
  """The same evidence, a chain accepting 0.6 of its drafts and trees committing 2.6 tokens a row (a chain of 4 at
  that acceptance: 2.3): with flat forward costs (an accelerator) a tree costs what the longest chain does and
  wins; with this CPU's, its 17-row verification (~2 steps) and 8-row expansions cost more than 0.3 more tokens
  bring, and more than even 1.3 more; a tree of 7 nodes (8 rows: one pass of the CPU kernels' products) pays
  there once it commits well above the chain."""
  chain = evidence(60, 100)
  alpha = float(chain.alpha(0.5))
  assert sum(alpha ** i for i in range(5)) == pytest.approx(2.3, abs=0.01)
  seen = with_trees(chain, 2.6, rows=50)
  accelerator = tree_policy(ACCELERATOR_FORWARD_COSTS)
  choice = accelerator.choose(seen)
  assert bool(choice.tree) and int(choice.budget) == 4
  assert bool(drafts_tree(accelerator, seen))
  cpu = tree_policy(CPU_FORWARD_COSTS)
  choice = cpu.choose(seen)
  assert not bool(choice.tree) and int(choice.budget) == int(draft_length(cpu, seen)) > 0
  assert not bool(cpu.choose(with_trees(chain, 3.6, rows=50)).tree)
  assert bool(tree_policy(CPU_FORWARD_COSTS, tree_nodes=7).choose(with_trees(chain, 3.6, rows=50)).tree)


def test_with_no_acceptance_the_policy_takes_plain_steps_not_trees():
  for forward_costs in (ACCELERATOR_FORWARD_COSTS, CPU_FORWARD_COSTS):
    p = tree_policy(forward_costs)
    choice = p.choose(with_trees(evidence(0, 100), 1.0, rows=50))
    assert not bool(choice.tree) and int(choice.budget) == 0


def test_before_any_tree_evidence_a_tree_is_tried_where_it_could_pay():
  """The prior: a chain of gamma slots, each depth accepted as either of two drafts at the chain's acceptance."""
  chain = evidence(60, 100)
  alpha = float(chain.alpha(0.5))
  either = 1 - (1 - alpha) ** 2
  assert float(tree_prior(4, alpha)) == pytest.approx(sum(either ** i for i in range(5)), rel=1e-6)
  assert float(chain.tree_tokens_per_row(tree_prior(4, alpha))) == pytest.approx(float(tree_prior(4, alpha)))
  assert bool(tree_policy(ACCELERATOR_FORWARD_COSTS).choose(chain).tree)
  # At batch 8 on this CPU a 32-node tree is verified over 264 rows: no tree could pay for that.
  assert not bool(tree_policy(CPU_FORWARD_COSTS, rows=8, tree_nodes=32).choose(chain).tree)


def test_a_round_is_evidence_on_its_own_kind_and_ages_the_others():
  p = dataclasses.replace(policy(0.1, (1.0, 1.0, 1.0), memory=0.5), plain_memory=0.9)
  start = with_trees(evidence(6, 10), 2.0, rows=10)
  tree_round = Outcome(budget=4, drafted=jnp.array([4, 3, 0]), accepted=jnp.array([2, 3, 0]),
                       rejected=jnp.array([True, False, False]), stopped=jnp.array([False, True, True]), tree=True)
  after = p.observe(start, tree_round)
  # Two live rows committed 3 and 4 tokens; the chain's counts aged as in a plain step, nothing added.
  assert float(after.tree_tokens) == pytest.approx(0.5 * 20 + 7) and float(after.tree_rows) == pytest.approx(7)
  assert (float(after.accepted), float(after.tested)) == pytest.approx((0.9 * 6, 0.9 * 10))
  chain_round = outcome(2, drafted=(2, 1), accepted=(1, 0), rejected=(True, True))
  after = p.observe(start, chain_round)
  assert (float(after.tree_tokens), float(after.tree_rows)) == pytest.approx((0.9 * 20, 0.9 * 10))
  # The chain's update is what it is without trees.
  assert float(after.accepted) == pytest.approx(0.5 * 6 + 1) and float(after.tested) == pytest.approx(0.5 * 10 + 3)
  plain = p.observe(start, outcome(0))
  assert (float(plain.tree_rows), float(plain.tested)) == pytest.approx((0.9 * 10, 0.9 * 10))


def test_a_tree_found_wanting_is_left_for_chains_and_tried_again_rarely():
  """Flat costs, chains accepting 3 drafts of 4 every round, trees committing 1 token a row: the prior tries a
  tree first, its evidence then holds the policy to chains, and as that evidence ages a tree is tried again, in a
  few of 300 rounds."""
  p = tree_policy(ACCELERATOR_FORWARD_COSTS)
  state, kinds = p.init(), []
  for _ in range(300):
    choice = p.choose(state)
    tree, budget = bool(choice.tree), int(choice.budget)
    kinds.append("tree" if tree else "chain" if budget else "plain")
    accepted = 0 if tree else min(3, budget)
    state = p.observe(state, Outcome(budget=budget, drafted=jnp.array([budget]), accepted=jnp.array([accepted]),
                                     rejected=jnp.array([accepted < budget]), stopped=jnp.array([False]),
                                     tree=tree))
  assert kinds[0] == "tree" and kinds[1] == "chain"
  assert 2 <= kinds.count("tree") <= 15 and kinds.count("plain") == 0, kinds.count("tree")


def test_fixed_gamma_with_trees_drafts_a_tree_every_round():
  p = FixedGamma().plan(DraftCost(), gamma=3, rows=2, tree_nodes=12)
  assert p == FixedGamma(3, 12) and p.tree_nodes == 12
  choice = p.choose(p.init())
  assert (choice.budget, choice.tree) == (3, True)
  assert choice.kinds() == (False, False, True)  # known when tracing: no chain or plain round is compiled
  assert FixedGamma().plan(DraftCost(), gamma=3, rows=2).choose(()).kinds() == (False, True, False)
  plain, chain, tree = Choice(budget=jnp.int32(0), keep_bars=0.0, go_bars=0.0, tree=jnp.bool_(False)).kinds()
  assert (bool(plain), bool(chain), bool(tree)) == (True, False, False)
  plain, chain, tree = Choice(budget=jnp.int32(3), keep_bars=0.0, go_bars=0.0, tree=jnp.bool_(True)).kinds()
  assert (bool(plain), bool(chain), bool(tree)) == (False, False, True)
