"""The speculative engine: lossless greedy decoding for every drafter, stats, stopping, compilation."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import speculative
from specjax.adaptive import Choice, verify_widths
from specjax.drafters import DraftCost, available, tree_drafters
from specjax.loading import Model
from specjax.model import init_params
from tests.task_drafters import VOCAB, perturbed, ragged_prompts

# test id -> (drafter name, options given the target and an independent draft model)
DRAFTERS = {
    "draft_model": ("draft_model", lambda draft: dict(draft=draft)),
    "layer_skip_exit": ("layer_skip", lambda draft: dict(exit_layer=2)),
    "layer_skip_skip": ("layer_skip", lambda draft: dict(skip_layers=[1, 2])),
    "prompt_lookup": ("prompt_lookup", lambda draft: dict(ngram_sizes=(3, 2, 1))),
}


@pytest.fixture(scope="module")
def target(tiny):
  return tiny


@pytest.fixture(scope="module")
def draft(tiny_draft):
  return tiny_draft


def make(name, target, draft):
  drafter_name, options = DRAFTERS[name]
  return specjax.make_drafter(drafter_name, target, **options(draft))


# Adaptive drafting that drafts eagerly on the tiny models (with free drafts, `free`, and a low confidence bar), so
# rounds of every width, early-stopped rows and plain steps all occur. Its forward costs are pinned (a CPU's, wider
# forwards dearer at batch 4) so that the rounds these tests see do not move with the measured default table.
EAGER = specjax.AdaptiveDrafting(min_confidence=0.15, prior_alpha=0.7,
                                 forward_costs=((1, 1.0), (2, 1.0), (3, 1.0), (4, 1.05), (5, 1.12), (6, 1.18),
                                                (8, 1.35), (10, 1.55), (12, 1.6), (16, 1.85), (20, 2.2), (40, 3.65)))


def free(drafter):
  """The drafter with draft steps that cost nothing."""
  return dataclasses.replace(drafter, cost=dataclasses.replace(drafter.cost, step=0.0))


# How draft lengths are chosen: a fixed gamma, the default adaptive drafting, and the eager one above with free
# draft steps (rounds of every width, rows that stop drafting early).
CHOOSERS = {"fixed_gamma": False, "adaptive": True, "eager": EAGER}

# Pairwise rather than the full product (4 x 3 x 2 x 3 = 72 programs): every pair of values of two parameters is in
# some row (test_the_grid_holds_every_pair_of_settings).
GRID = [
    # The fast tier: every value of every parameter once.
    ("draft_model", 3, 4, "fixed_gamma"), ("layer_skip_exit", 5, 1, "eager"), ("layer_skip_skip", 1, 4, "adaptive"),
    ("prompt_lookup", 3, 1, "adaptive"),
    # Slow: the other pairs.
    ("draft_model", 1, 4, "eager"), ("draft_model", 5, 1, "adaptive"), ("layer_skip_exit", 1, 4, "adaptive"),
    ("layer_skip_exit", 3, 4, "fixed_gamma"), ("layer_skip_skip", 3, 4, "eager"),
    ("layer_skip_skip", 5, 1, "fixed_gamma"), ("prompt_lookup", 1, 1, "fixed_gamma"), ("prompt_lookup", 5, 4, "eager"),
]
FAST_ROWS = 4


def test_the_grid_holds_every_pair_of_settings():
  values = [sorted(DRAFTERS), [1, 3, 5], [1, 4], sorted(CHOOSERS)]
  for i, j in itertools.combinations(range(len(values)), 2):
    assert {(row[i], row[j]) for row in GRID} == set(itertools.product(values[i], values[j])), (i, j)
  for i, options in enumerate(values):
    assert {row[i] for row in GRID[:FAST_ROWS]} == set(options), i


def assert_stats_add_up(s, gamma, chooser):
  """What the per-row counts say about each other: each live round commits its accepted drafts plus the target's
  token (the last may be cut short), the verifier tests the accepted drafts and one rejected per rejecting round, and
  a fixed gamma drafts gamma tokens every round."""
  produced = np.array(s["new_tokens_per_row"]) - 1  # the prefill makes the first token
  accepted, rounds = np.array(s["accepted_per_row"]), np.array(s["rounds_per_row"])
  proposed, rejections = np.array(s["proposed_per_row"]), np.array(s["rejections_per_row"])
  histogram = s["gamma_histogram"]
  assert s["target_calls"] == s["rounds"] + 1 and sum(histogram) == s["rounds"]
  assert np.all(produced <= accepted + rounds) and np.all(produced >= accepted + rounds - (gamma + 1))
  assert np.all(accepted <= proposed) and np.all(proposed <= gamma * rounds)
  assert np.all(rejections <= rounds)
  assert 0.0 <= s["acceptance_rate"] <= 1.0
  if proposed.sum():
    assert s["acceptance_rate"] == pytest.approx(accepted.sum() / proposed.sum())
    assert s["alpha"] == pytest.approx(accepted.sum() / (accepted.sum() + rejections.sum()))
  proposed_at = np.array(s["proposed_per_position"])
  assert proposed_at.sum() == proposed.sum() and np.all(np.diff(proposed_at) <= 0)
  per_position = np.array(s["acceptance_per_position"])
  assert np.all((per_position >= 0) & (per_position <= 1) | np.isnan(per_position))
  if chooser == "fixed_gamma":
    assert histogram == [0] * gamma + [s["rounds"]] and s["plain_steps"] == 0
    assert list(proposed_at) == [int(rounds.sum())] * gamma
    assert np.all(accepted >= gamma * (rounds - rejections)) and s["alpha"] >= s["acceptance_rate"]
    assert all(a >= b for a, b in zip(per_position, per_position[1:]))  # accepting i+1 implies accepting i
  else:
    # A row drafts at most the widest slot its round verified.
    assert proposed.sum() <= sum(width * n for width, n in enumerate(histogram)) * len(rounds)
    assert s["plain_steps"] <= histogram[0] and s["draft_calls"] <= gamma * (s["rounds"] - s["plain_steps"])
  if chooser == "eager" and gamma > 1:
    assert sum(h > 0 for h in histogram) >= 2  # rounds of several widths (else the row tests no adaptivity)


@pytest.mark.parametrize("name, gamma, batch, chooser", [
    row if i < FAST_ROWS else pytest.param(*row, marks=pytest.mark.slow) for i, row in enumerate(GRID)],
    ids=[f"{name}-gamma{gamma}-batch{batch}-{chooser}" for name, gamma, batch, chooser in GRID])
def test_greedy_speculative_equals_autoregressive(name, gamma, batch, chooser, target, draft):
  prompts = ragged_prompts(batch)
  expected = specjax.generate(target, prompts, max_new_tokens=24, stop_ids=[])
  drafter = make(name, target, draft)
  out = specjax.generate(target, prompts, max_new_tokens=24, drafter=free(drafter) if chooser == "eager" else drafter,
                         gamma=gamma, stop_ids=[], adaptive=CHOOSERS[chooser])
  assert out.tokens == expected.tokens
  assert all(len(t) == 24 for t in out.tokens)
  assert_stats_add_up(out.stats, gamma, chooser)
  if name == "prompt_lookup":
    assert out.stats["draft_calls"] == 0  # an n-gram search runs no model
  elif chooser == "fixed_gamma":
    assert out.stats["draft_calls"] == gamma * out.stats["rounds"]


# Drafters that draft trees (every drafter does: `tree_drafters`), with random models, heads or modules (drafts wrong
# in varied ways, accepted now and then): test id -> (drafter name, options given an independent draft model).
TREE_DRAFTERS = {
    "mtp_parallel": ("mtp_parallel", lambda draft: dict(path=None, num_heads=3)),
    # Medusa's static tree from a rank accuracy table (made up: ranks 0-3 of each head)
    "mtp_parallel_static": ("mtp_parallel", lambda draft: dict(path=None, num_heads=3, rank_accuracy=[
        [0.5, 0.2, 0.1, 0.05], [0.4, 0.2, 0.1, 0.05], [0.3, 0.2, 0.1, 0.05]])),
    "mtp_sequential": ("mtp_sequential", lambda draft: dict(path=None, depth=3)),
    "mtp_sequential_recurrent": ("mtp_sequential", lambda draft: dict(path=None, depth=3, recurrent=True)),
    "draft_model": ("draft_model", lambda draft: dict(draft=draft)),
    # distilled from two of the target's layers, over a truncated vocabulary
    "draft_model_distilled": ("draft_model", lambda draft: dict(draft="fresh", num_layers=2,
                                                                token_map=list(range(3, VOCAB)))),
    "layer_skip_exit": ("layer_skip", lambda draft: dict(exit_layer=2)),
    "layer_skip_skip": ("layer_skip", lambda draft: dict(skip_layers=[1, 2])),
    "layer_skip_adapter": ("layer_skip", lambda draft: dict(adapter="fresh", exit_layer=1)),
    "prompt_lookup": ("prompt_lookup", lambda draft: dict(ngram_sizes=(3, 2, 1))),
    # one forward drafts every depth; Medusa's static tree from a made-up rank accuracy
    "block_static": ("block", lambda draft: dict(path=None, block_size=3, rank_accuracy=[
        [0.5, 0.2, 0.1, 0.05], [0.4, 0.2, 0.1, 0.05], [0.3, 0.2, 0.1, 0.05]])),
}
# (drafter, gamma: the depth, tree_nodes, batch): trees of one level, of a chain's size, and bushy ones.
# The fast tier runs the first: EAGLE-2's grow over a drafter's expansion of nodes by its own modules (the recurrent
# sequential module; by a forward of a draft model's layers over them with their ancestors' K/V: the Llama draft
# model's tree in tests/test_families.py, and the second row here in the whole suite); layer skip with an
# exit adapter, whose chain rounds hand the draft's layers over to verification and whose tree rounds verify every
# layer, runs in the fast test_greedy_rounds_of_every_kind_in_one_program_equal_autoregressive (chains, trees and
# plain steps in turn). The slow rows add the other drafters (the parallel heads add one broadcast to the sequential
# module's expansion, a skip set and a plain exit are the adapter's layers without it, prompt lookup's branches are
# test_trees.py's) and tree shapes.
TREE_GRID = [("mtp_sequential_recurrent", 2, 6, 1), ("draft_model", 3, 10, 4), ("layer_skip_adapter", 2, 5, 4),
             ("mtp_parallel", 3, 20, 4), ("mtp_sequential", 3, 3, 4), ("mtp_parallel", 1, 8, 1),
             ("mtp_sequential_recurrent", 3, 32, 4), ("mtp_parallel_static", 3, 12, 4),
             ("draft_model_distilled", 2, 12, 1), ("layer_skip_exit", 3, 16, 4), ("layer_skip_skip", 3, 8, 1),
             ("prompt_lookup", 3, 9, 1), ("prompt_lookup", 1, 3, 4), ("block_static", 3, 12, 4)]
FAST_TREE_ROWS = 1


@pytest.mark.parametrize("name, gamma, nodes, batch", [
    row if i < FAST_TREE_ROWS else pytest.param(*row, marks=pytest.mark.slow) for i, row in enumerate(TREE_GRID)],
    ids=[f"{name}-depth{gamma}-nodes{nodes}-batch{batch}" for name, gamma, nodes, batch in TREE_GRID])
def test_greedy_tree_speculative_equals_autoregressive(name, gamma, nodes, batch, target, draft):
  prompts = ragged_prompts(batch)
  expected = specjax.generate(target, prompts, max_new_tokens=24, stop_ids=[])
  drafter_name, options = TREE_DRAFTERS[name]
  drafter = perturbed(specjax.make_drafter(drafter_name, target, **options(draft)), seed=3, scale=0.1)
  out = specjax.generate(target, prompts, max_new_tokens=24, drafter=drafter, gamma=gamma, stop_ids=[],
                         adaptive=False, tree_nodes=nodes)
  assert out.tokens == expected.tokens
  s = out.stats
  produced, accepted = np.array(s["new_tokens_per_row"]) - 1, np.array(s["accepted_per_row"])
  rounds = np.array(s["rounds_per_row"])
  assert np.all(produced <= accepted + rounds) and np.all(produced >= accepted + rounds - (gamma + 1))
  assert accepted.sum() > 0 and s["plain_steps"] == 0
  # Per depth: rounds whose tree reached it, and of those, the ones that accepted it.
  assert len(s["acceptance_per_position"]) == gamma and s["proposed_per_position"][0] == rounds.sum()


def test_every_drafter_drafts_trees_and_is_in_the_tree_grid():
  assert tree_drafters() == available()
  assert {TREE_DRAFTERS[row[0]][0] for row in TREE_GRID} == set(available())


@pytest.mark.slow
def test_drafters_that_are_the_target_accept_the_greedy_path_of_every_tree(target):
  """A draft that is the target itself (a draft model, or an exit adapter after L - 1 layers that starts as a copy
  of layer L - 1), drafting every candidate of a 2-deep tree (8 + 64 nodes: the greedy path among them), accepts 2
  tokens every round only if each node saw what a chain of its path would and the draft's caches followed the
  accepted paths (the draft model's read in `update`, the adapter's from the features along the path)."""
  drafters = {"draft_model": specjax.make_drafter("draft_model", target, draft=target),
              "exit_adapter": specjax.make_drafter("layer_skip", target, adapter="fresh",
                                                   exit_layer=target.config.num_layers - 1)}
  prompts = ragged_prompts(2)
  expected = specjax.generate(target, prompts, max_new_tokens=25, stop_ids=[])
  for name, drafter in drafters.items():
    out = specjax.generate(target, prompts, max_new_tokens=25, gamma=2, stop_ids=[], drafter=drafter, adaptive=False,
                           tree_nodes=8 + 8 * 8)
    assert out.tokens == expected.tokens, name
    assert out.stats["acceptance_per_position"] == [1.0, 1.0], (name, out.stats)
    assert out.stats["rounds"] == 8, name  # 24 tokens after the prefill's, 3 a round


@dataclasses.dataclass(frozen=True)
class KindsInTurn:
  """A drafting policy (`specjax.adaptive.Policy`) that takes a plain step, drafts a chain of the whole budget and
  drafts a tree, in turn, with no early stops."""
  gamma: int = 0
  tree_nodes: int | None = None

  def plan(self, cost, gamma, rows, tree_nodes=None):
    return KindsInTurn(gamma, tree_nodes)

  @property
  def widths(self):
    return verify_widths(self.gamma)

  def init(self):
    return jnp.zeros((), jnp.int32)  # rounds so far

  def choose(self, rounds):
    kind = rounds % 3
    return Choice(budget=jnp.where(kind == 0, 0, self.gamma), keep_bars=0.0, go_bars=0.0, tree=kind == 2)

  def observe(self, rounds, outcome):
    return rounds + 1


def test_greedy_rounds_of_every_kind_in_one_program_equal_autoregressive(target):
  """Plain steps, chains and trees in turn, ragged rows: each kind of round hands the next one the cache, sequence
  and drafter state a chain would have. The drafter is an exit adapter: its chains hand the target's first layers
  over to verification, its trees do not."""
  prompts = ragged_prompts(4)
  expected = specjax.generate(target, prompts, max_new_tokens=24, stop_ids=[])
  drafter = perturbed(specjax.make_drafter("layer_skip", target, adapter="fresh", exit_layer=1), seed=3, scale=0.1)
  assert drafter.reuse_layers
  out = specjax.generate(target, prompts, max_new_tokens=24, drafter=drafter, gamma=2, stop_ids=[],
                         adaptive=KindsInTurn(), tree_nodes=6)
  assert out.tokens == expected.tokens
  s = out.stats
  assert s["tree_rounds"] == s["rounds"] // 3 >= 2 and s["plain_steps"] == (s["rounds"] + 2) // 3
  assert sum(s["accepted_per_row"]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mtp_parallel", "mtp_sequential"])
def test_greedy_adaptive_drafting_with_trees_equals_autoregressive(name, target, draft):
  """The cost model choosing among plain steps, chains and trees (flat forward costs: trees are tried)."""
  prompts = ragged_prompts(4)
  expected = specjax.generate(target, prompts, max_new_tokens=24, stop_ids=[])
  drafter_name, options = TREE_DRAFTERS[name]
  drafter = perturbed(specjax.make_drafter(drafter_name, target, **options(draft)), seed=3, scale=0.1)
  policy = specjax.AdaptiveDrafting(forward_costs=((1, 1.0), (64, 1.0)))
  out = specjax.generate(target, prompts, max_new_tokens=24, drafter=drafter, gamma=3, stop_ids=[],
                         adaptive=policy, tree_nodes=8)
  assert out.tokens == expected.tokens
  assert out.stats["tree_rounds"] >= 1


def test_tree_nodes_need_a_drafter_that_drafts_trees_and_a_policy_that_plans_them(target):
  prompts = ragged_prompts(1)
  chains_only = dataclasses.replace(specjax.make_drafter("prompt_lookup", target), trees=False)
  with pytest.raises(ValueError, match="drafts chains only") as error:
    specjax.generate(target, prompts, max_new_tokens=4, drafter=chains_only, gamma=2, adaptive=False, tree_nodes=4)
  assert all(name in str(error.value) for name in tree_drafters())
  heads = specjax.make_drafter("mtp_parallel", target, path=None, num_heads=2)
  with pytest.raises(ValueError, match="EveryEleventhRound drafts chains only"):
    specjax.generate(target, prompts, max_new_tokens=4, drafter=heads, gamma=2, tree_nodes=4,
                     adaptive=EveryEleventhRound())
  with pytest.raises(ValueError, match="tree_nodes must be a positive integer"):
    specjax.generate(target, prompts, max_new_tokens=4, drafter=heads, gamma=2, adaptive=False, tree_nodes=0)
  with pytest.raises(ValueError, match="pass drafter="):
    specjax.generate(target, prompts, max_new_tokens=4, tree_nodes=4)


def test_target_as_its_own_draft_accepts_every_draft(target):
  gamma, max_new = 3, 25
  drafter = specjax.make_drafter("draft_model", target, draft=target)
  out = specjax.generate(target, ragged_prompts(4), max_new_tokens=max_new, drafter=drafter, gamma=gamma,
                         stop_ids=[], adaptive=False)
  assert out.stats["acceptance_rate"] == 1.0 and out.stats["alpha"] == 1.0
  assert out.stats["acceptance_per_position"] == [1.0] * gamma
  # 24 tokens after the prefill's first one, gamma + 1 per round: 6 full rounds, no truncated round.
  assert out.stats["rounds"] == (max_new - 1) // (gamma + 1)
  assert out.stats["mean_accepted"] == gamma + 1


@pytest.mark.slow  # end to end; the rule itself is test_adaptive.py's
def test_adaptive_drafting_falls_back_to_plain_steps_when_drafting_cannot_pay(target):
  """Three of four layers per draft step (c ~ 0.8): no draft length pays at the prior acceptance."""
  drafter = specjax.make_drafter("layer_skip", target, skip_layers=[1])
  assert drafter.cost.step > 0.7
  out = specjax.generate(target, ragged_prompts(4), max_new_tokens=12, gamma=3, stop_ids=[], drafter=drafter)
  s = out.stats
  assert s["plain_steps"] == s["rounds"] == 11 and s["gamma_histogram"] == [11, 0, 0, 0]
  assert s["draft_calls"] == 0 and s["mean_accepted"] == 1.0


def test_a_drafter_that_cannot_pay_is_rarely_tried(target, draft):
  """A random draft model (its drafts almost never accepted) priced to pay at the prior acceptance (c = 0.2, flat
  forward costs): it drafts in the first rounds, and once the evidence is in, only when plain steps have aged it back
  towards the prior: in under a tenth of the rounds."""
  drafter = dataclasses.replace(specjax.make_drafter("draft_model", target, draft=draft),
                                cost=DraftCost(step=0.2, plain_step=0.02))
  s = specjax.generate(target, ragged_prompts(2), max_new_tokens=200, gamma=3, stop_ids=[], drafter=drafter,
                       adaptive=specjax.AdaptiveDrafting(forward_costs=((1, 1.0), (64, 1.0)))).stats
  tries = s["rounds"] - s["plain_steps"]
  assert s["alpha"] < 0.1 and 0 < tries < s["rounds"] / 10, s


@pytest.mark.slow
def test_a_draft_loop_stops_once_every_row_is_unsure(target, draft):
  """min_confidence 1: every row stops at its first slot, so each drafting round runs one draft step."""
  unsure = specjax.AdaptiveDrafting(min_confidence=1.0)
  for name, options in [("layer_skip", dict(exit_layer=2)), ("draft_model", dict(draft=draft))]:
    out = specjax.generate(target, ragged_prompts(4), max_new_tokens=12, gamma=3, stop_ids=[], adaptive=unsure,
                           drafter=free(specjax.make_drafter(name, target, **options)))
    s = out.stats
    assert s["draft_calls"] == s["rounds"] - s["plain_steps"] > 0
    assert sum(s["proposed_per_row"]) == 0 and s["gamma_histogram"][0] == s["rounds"]


def test_stop_token_inside_an_accepted_block_ends_the_row_there(target):
  prompts = ragged_prompts(4)
  free = specjax.generate(target, prompts, max_new_tokens=24, stop_ids=[])
  stop = free.tokens[0][5]  # a token the target emits mid-sequence
  expected = specjax.generate(target, prompts, max_new_tokens=24, stop_ids=[stop])
  out = specjax.generate(target, prompts, max_new_tokens=24, stop_ids=[stop], gamma=4, adaptive=False,
                         drafter=specjax.make_drafter("draft_model", target, draft=target))
  assert out.tokens == expected.tokens
  assert out.tokens[0][-1] == stop and len(out.tokens[0]) <= 6
  for row in out.tokens:
    assert stop not in row[:-1]


# Every draft accepted, 5 tokens a round: 7 ends inside the second round; 1 before any, 2 and 9 inside others.
@pytest.mark.parametrize("max_new", [7] + [pytest.param(n, marks=pytest.mark.slow) for n in (1, 2, 9)])
def test_max_new_tokens_reached_mid_round_truncates(max_new, target):
  drafter = specjax.make_drafter("draft_model", target, draft=target)
  out = specjax.generate(target, ragged_prompts(2), max_new_tokens=max_new, drafter=drafter, gamma=4,
                         stop_ids=[], adaptive=False)
  assert [len(t) for t in out.tokens] == [max_new, max_new]


def test_cache_capacity_is_checked_with_gamma_slack(target):
  drafter = specjax.make_drafter("prompt_lookup", target)
  with pytest.raises(ValueError, match="exceeds the cache capacity"):
    specjax.generate(target, [[1, 2, 3]], max_new_tokens=60, drafter=drafter, gamma=5, max_len=64)
  with pytest.raises(ValueError, match="gamma must be a positive integer"):
    specjax.generate(target, [[1, 2, 3]], max_new_tokens=4, drafter=drafter, gamma=0)


def test_unknown_drafter_and_bad_options_are_rejected(target):
  with pytest.raises(ValueError, match="unknown drafter"):
    specjax.make_drafter("medusa9000", target)
  with pytest.raises(ValueError, match="exactly one of"):
    specjax.make_drafter("layer_skip", target)
  with pytest.raises(ValueError, match="exit_layer"):
    specjax.make_drafter("layer_skip", target, exit_layer=4)
  with pytest.raises(ValueError, match="skip_layers"):
    specjax.make_drafter("layer_skip", target, skip_layers=[0, 1, 2, 3])


@pytest.mark.parametrize("name, options, message", [
    ("layer_skip", {"bogus_option": 1}, "drafter 'layer_skip' has no option 'bogus_option'; "
                                        "its options: exit_layer, skip_layers, adapter, mlp, "
                                        "token_map"),
    ("prompt_lookup", {"ngram_size": 2}, "drafter 'prompt_lookup' has no option 'ngram_size'; "
                                         "its options: ngram_sizes"),
    ("draft_model", {"path": "x", "gamma": 3}, "drafter 'draft_model' has no option 'gamma', 'path'; "
                                               "its options: draft, num_layers, init_layers, "
                                               "token_map, prompt_window"),
])
def test_unknown_drafter_options_name_the_drafter_and_its_options(target, name, options, message):
  with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
    specjax.make_drafter(name, target, **options)


def test_draft_model_with_another_vocabulary_is_rejected(target):
  config = target.config.replace(vocab_size=2 * target.config.vocab_size)
  with pytest.raises(ValueError, match="vocabulary"):
    specjax.make_drafter("draft_model", target, draft=Model(config, init_params(config, jax.random.PRNGKey(2)), None,
                                                            "tiny-wide"))


@pytest.mark.slow
def test_draft_model_with_another_tokenizer_is_rejected(smollm2):
  import dataclasses

  class OtherTokenizer:
    def fingerprint(self):
      return "something-else"

  other = dataclasses.replace(smollm2, tokenizer=OtherTokenizer(), name="other")
  with pytest.raises(ValueError, match="different tokenizer"):
    specjax.make_drafter("draft_model", smollm2, draft=other)


def test_second_call_does_not_recompile_and_program_has_no_host_callbacks(target):
  drafter = specjax.make_drafter("layer_skip", target, exit_layer=1)
  prompts = ragged_prompts(4)
  first = specjax.generate(target, prompts, max_new_tokens=10, drafter=drafter, gamma=2, stop_ids=[])
  before = speculative._speculative_program.cache_size()
  # Same shapes, a new but equal drafter object, new prompt contents: no new compilation.
  again = specjax.make_drafter("layer_skip", target, exit_layer=1)
  out = specjax.generate(target, ragged_prompts(4, seed=1), max_new_tokens=10, drafter=again, gamma=2, stop_ids=[])
  assert speculative._speculative_program.cache_size() == before
  assert first.stats["compile_seconds"] > 0 and out.stats["compile_seconds"] == 0.0
  assert out.stats["tokens_per_second"] == out.stats["new_tokens"] / out.stats["seconds"]

  def lowered(policy):
    return speculative._generate_speculative.lower(
        target.params, drafter.params, np.zeros((4, 16), np.int32), np.full(4, 5, np.int32),
        jax.random.PRNGKey(0), config=target.config, drafter=drafter.static(), policy=policy,
        sampling=specjax.SamplingParams(), max_new_tokens=10, cache_len=128, stop_ids=()).as_text()

  text = lowered(specjax.FixedGamma(2))
  assert "stablehlo.while" in text
  assert "callback" not in text.lower() and "host" not in text.lower()
  adaptive = lowered(specjax.AdaptiveDrafting().plan(drafter.cost, 2, 1))
  # The draft length and the verify width are chosen in the program (control.run_if loops), not on the host.
  assert adaptive.count("stablehlo.while") > text.count("stablehlo.while")
  assert "callback" not in adaptive.lower() and "host" not in adaptive.lower()


@dataclasses.dataclass(frozen=True)
class EveryEleventhRound:
  """A drafting policy (`specjax.adaptive.Policy`) that drafts the whole budget in every 11th round, with no early
  stops, and takes plain steps in between."""
  gamma: int = 0

  def plan(self, cost, gamma, rows):
    return EveryEleventhRound(gamma)

  @property
  def widths(self):
    return verify_widths(self.gamma)

  def init(self):
    return jnp.zeros((), jnp.int32)  # rounds so far

  def choose(self, rounds):
    return Choice(budget=jnp.where(rounds % 11 == 0, self.gamma, 0), keep_bars=0.0, go_bars=0.0)

  def observe(self, rounds, outcome):
    return rounds + 1


@pytest.mark.slow
def test_drafters_with_their_own_cache_follow_plain_steps(target):
  """A draft that is the target itself (a draft model, or an exit adapter after L - 1 layers that starts as a copy
  of layer L - 1) accepts every draft only if its cache holds every position the plain steps committed."""
  drafters = {"draft_model": specjax.make_drafter("draft_model", target, draft=target),
              "exit_adapter": specjax.make_drafter("layer_skip", target, adapter="fresh",
                                                   exit_layer=target.config.num_layers - 1)}
  prompts = ragged_prompts(2)
  expected = specjax.generate(target, prompts, max_new_tokens=40, stop_ids=[])
  for name, drafter in drafters.items():
    out = specjax.generate(target, prompts, max_new_tokens=40, gamma=3, stop_ids=[], drafter=drafter,
                           adaptive=EveryEleventhRound())
    s = out.stats
    assert out.tokens == expected.tokens, name
    drafting = s["rounds"] - s["plain_steps"]
    assert s["plain_steps"] >= 2 * 10 and drafting >= 2, (name, s)  # runs of plain steps between drafting rounds
    assert s["acceptance_rate"] == 1.0 and sum(s["proposed_per_row"]) == 2 * 3 * drafting, (name, s)


def _cache_copies(hlo: str, cache_shape) -> int:
  """Copy instructions of a KV-cache array in compiled HLO text."""
  shape = ",".join(map(str, cache_shape))
  return len(re.findall(rf"= f32\[{shape}\]\S* copy\(", hlo))


def _compiled_loop_text(target, drafter, batch, cache_len, policy):
  """The optimized HLO of the speculative loop for `policy`, at `batch` rows of 16-token prompts."""
  return speculative._generate_speculative.lower(
      target.params, drafter.params, np.zeros((batch, 16), np.int32), np.full(batch, 5, np.int32),
      jax.random.PRNGKey(0), config=target.config, drafter=drafter.static(), policy=policy,
      sampling=specjax.SamplingParams(), max_new_tokens=10, cache_len=cache_len, stop_ids=()).compile().as_text()


@pytest.mark.parametrize("name, options", [("layer_skip", {"exit_layer": 1}),
                                           pytest.param("prompt_lookup", {}, marks=pytest.mark.slow)])
def test_adaptive_rounds_update_the_cache_in_place(name, options, target):
  """A `jax.lax.cond` or `switch` whose branches each update the KV cache makes XLA copy all of it every round
  (at batch 8 on CPU a plain round cost 1.4x an autoregressive step); the adaptive loop's choices copy no more
  of the cache than the fixed-gamma loop, whose only copies are outside the loop."""
  drafter = specjax.make_drafter(name, target, **options)
  batch, cache_len = 8, 128

  compiled = functools.partial(_compiled_loop_text, target, drafter, batch, cache_len)
  shape = (batch, cache_len, target.config.num_kv_heads, target.config.head_dim)
  fixed = _cache_copies(compiled(specjax.FixedGamma(3)), shape)
  adaptive = _cache_copies(compiled(specjax.AdaptiveDrafting().plan(drafter.cost, 3, batch)), shape)
  assert adaptive <= fixed, (adaptive, fixed)


@pytest.mark.slow
def test_adaptive_rounds_with_trees_update_the_cache_in_place(target):
  """Plain steps, chains and trees in one program copy no more of the cache than every round a tree."""
  drafter = specjax.make_drafter("mtp_sequential", target, path=None, depth=3)
  batch, cache_len = 4, 128

  compiled = functools.partial(_compiled_loop_text, target, drafter, batch, cache_len)
  shape = (batch, cache_len, target.config.num_kv_heads, target.config.head_dim)
  fixed = _cache_copies(compiled(specjax.FixedGamma(3, tree_nodes=8)), shape)
  adaptive = _cache_copies(compiled(specjax.AdaptiveDrafting().plan(drafter.cost, 3, batch, tree_nodes=8)), shape)
  assert adaptive <= fixed, (adaptive, fixed)


# ------------------------------------------------------------------------------------------ SmolLM2

def spec_bench_prompts(model, n=4):
  import json
  import pathlib
  path = pathlib.Path(__file__).resolve().parents[1] / "data" / "spec_bench" / "question.jsonl"
  rows = [json.loads(line) for line in path.read_text().splitlines()]
  # Different categories and lengths (42-92 tokens with SmolLM2's chat template): a batch's prefill runs every row to
  # the longest's bucket, so one long prompt would make each call's prefill 4x dearer (a 374-token one: the 512 bucket).
  picked = [rows[i] for i in (0, 90, 250, 330, 170, 410)][:n]
  return [model.tokenizer.apply_chat_template([{"role": "user", "content": r["turns"][0]}]) for r in picked]


SMOLLM2_DRAFTERS = {
    "layer_skip_exit": ("layer_skip", lambda model: dict(exit_layer=24)),
    "layer_skip_skip": ("layer_skip", lambda model: dict(skip_layers=[4, 9, 14, 19, 24])),
    "prompt_lookup": ("prompt_lookup", lambda model: dict(ngram_sizes=(3, 2, 1))),
}


# One (gamma, adaptive) setting per drafter: every real-model program compiles for a minute on 2 cores, and the
# tiny-model grid above runs every drafter at gamma 1, 3 and 5, fixed and adaptive. The draft model runs on SmolLM2
# as the shipped distilled draft (below); a target drafting for itself is
# test_target_as_its_own_draft_accepts_every_draft (tiny model).
@pytest.mark.slow
@pytest.mark.parametrize("name, gamma, adaptive", [("layer_skip_exit", 3, EAGER), ("layer_skip_skip", 5, False),
                                                   ("prompt_lookup", 1, False)])
def test_greedy_speculative_equals_autoregressive_on_smollm2(name, gamma, adaptive, smollm2, smollm2_ar_outputs):
  """Four Spec-Bench prompts of different lengths in one batch, 32 new tokens, chat template."""
  prompts, expected = smollm2_ar_outputs
  drafter_name, options = SMOLLM2_DRAFTERS[name]
  out = specjax.generate(smollm2, prompts, max_new_tokens=32, gamma=gamma, adaptive=adaptive,
                         drafter=free(specjax.make_drafter(drafter_name, smollm2, **options(smollm2))))
  assert out.tokens == expected.tokens


@pytest.mark.slow
def test_greedy_speculative_equals_autoregressive_on_smollm2_batch_of_one(smollm2, smollm2_ar_outputs):
  prompts, expected = smollm2_ar_outputs
  out = specjax.generate(smollm2, prompts[1:2], max_new_tokens=32, gamma=3,
                         drafter=specjax.make_drafter("prompt_lookup", smollm2))
  assert out.tokens == expected.tokens[1:2]


@pytest.fixture(scope="module")
def smollm2_ar_outputs(smollm2):
  prompts = spec_bench_prompts(smollm2)
  return prompts, specjax.generate(smollm2, prompts, max_new_tokens=32)


def test_prompt_padding_never_outgrows_a_cache_that_is_not_a_power_of_two(target):
  """A 260-token prompt pads to the 512 bucket, but the cache holds only 300 positions."""
  model = Model(target.config.replace(max_position_embeddings=300), target.params, None, "tiny-300")
  prompt = list(np.random.RandomState(0).randint(0, model.config.vocab_size, size=260))
  expected = specjax.generate(model, [prompt], max_new_tokens=8, stop_ids=[])
  out = specjax.generate(model, [prompt], max_new_tokens=8, stop_ids=[], gamma=3,
                         drafter=specjax.make_drafter("prompt_lookup", model, ngram_sizes=2))
  assert out.tokens == expected.tokens and len(out.tokens[0]) == 8


@pytest.mark.slow
@pytest.mark.parametrize("name, options", [("mtp_parallel", {}), ("mtp_sequential", {}),
                                           ("layer_skip", {"adapter": "default"}),
                                           ("draft_model", {"draft": "smollm2-135m-draft"})],
                         ids=["mtp_parallel", "mtp_sequential", "exit_adapter", "draft_model"])
def test_shipped_trained_drafters_are_lossless_and_accept_drafts_on_smollm2(name, options, smollm2,
                                                                           smollm2_ar_outputs):
  """The checkpoints shipped in specjax/checkpoints load by default, decode exactly what the target decodes, and
  their drafts are accepted (an untrained head or adapter would accept almost none)."""
  prompts, expected = smollm2_ar_outputs
  drafter = specjax.make_drafter(name, smollm2, **options)
  out = specjax.generate(smollm2, prompts, max_new_tokens=32, gamma=3, drafter=drafter, adaptive=False)
  assert out.tokens == expected.tokens
  assert out.stats["alpha"] > 0.1, out.stats
