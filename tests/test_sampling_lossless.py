"""Speculative sampling follows the target's distribution exactly, and a broken verifier is caught.

On a tiny model (vocabulary 16) the joint distribution of the first three generated tokens is computed
exactly from the target's logits; 20k speculative samples (fixed seeds) are compared with it by a
chi-square test. Token 1 comes from the prefill, tokens 2 and 3 from the first speculative round (an
accepted draft, a correction from the residual, or the bonus token), so every branch of the rule is used.
The chi-square tests are slow; the fast tier keeps the verification rule on hand-made distributions.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import sampling, speculative, verify
from specjax.loading import Model
from specjax.model import init_params
from tests.task_drafters import own_tree_drafter, perturbed
from tests.test_trees import residual_kept_after_a_rejected_sibling
from specjax.sampling import SamplingParams, probabilities, sample_from_probs

VOCAB, SAMPLES, PROMPT = 16, 20_000, [3, 1, 4, 1, 5]


def small_vocabulary_model(tiny_config, seed, layers):
  # A second shape: the exact joint has VOCAB^3 cells (4,096 for 20k samples at 16 tokens, not 32,768), and with
  # a tied head of width 32 the drafts are unsure often enough that rows stop drafting at every slot.
  config = tiny_config.replace(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, head_dim=8, num_layers=layers,
                               tie_embeddings=True)
  return Model(config, init_params(config, jax.random.PRNGKey(seed), std=0.5), None, f"tiny-{seed}")


@pytest.fixture(scope="module")
def target(tiny_config):
  return small_vocabulary_model(tiny_config, 0, 3)


@pytest.fixture(scope="module")
def draft(tiny_config):
  return small_vocabulary_model(tiny_config, 7, 1)


def exact_joint(model, sampling: SamplingParams) -> np.ndarray:
  """P(t1, t2, t3 | prompt) under the processed target distribution, [V, V, V]."""
  pairs = np.array(list(itertools.product(range(VOCAB), repeat=2)), np.int32)
  seqs = np.concatenate([np.tile(PROMPT, (len(pairs), 1)), pairs], axis=1)
  batch_logits = _batch_logits(model, seqs)
  probs = np.asarray(probabilities(jnp.asarray(batch_logits), sampling), np.float64)
  n = len(PROMPT)
  p1 = probs[0, n - 1]  # every row shares the prompt
  p2 = probs[::VOCAB, n].reshape(VOCAB, VOCAB)  # [t1, t2]
  p3 = probs[:, n + 1].reshape(VOCAB, VOCAB, VOCAB)  # [t1, t2, t3]
  return p1[:, None, None] * p2[:, :, None] * p3


def _batch_logits(model, seqs):
  from specjax.model import forward, init_cache
  cache = init_cache(model.config, len(seqs), seqs.shape[1])
  out = jax.jit(lambda p, s, c: forward(p, s, c, jnp.zeros(len(seqs), jnp.int32), model.config).logits)(
      model.params, jnp.asarray(seqs), cache)
  return np.asarray(out)


def chi_square_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
  """Pearson chi-square of sample counts against exact cell probabilities (cells with expected < 5 pooled)."""
  counts = np.bincount(np.ravel_multi_index(samples.T, probs.shape), minlength=probs.size).astype(np.float64)
  expected = probs.ravel() * len(samples)
  small = expected < 5
  observed = np.append(counts[~small], counts[small].sum())
  expected = np.append(expected[~small], expected[small].sum())
  if expected[-1] == 0:
    observed, expected = observed[:-1], expected[:-1]
  statistic = np.sum((observed - expected) ** 2 / expected)
  from scipy import stats
  return float(stats.chi2.sf(statistic, len(observed) - 1))


# Drafters whose q differ in kind: an independent model, MTP heads over a truncated vocabulary (q is zero on
# tokens 0-2, which only the residual can produce), a recurrent sequential module, an exit adapter over a
# truncated vocabulary, a draft model distilled from the target's layers.
DRAFTERS = {
    "draft_model": lambda target, draft: specjax.make_drafter("draft_model", target, draft=draft),
    "draft_model_distilled": lambda target, draft: perturbed(specjax.make_drafter(
        "draft_model", target, draft="fresh", num_layers=1), seed=3, scale=0.1),
    "layer_skip_adapter_truncated": lambda target, draft: perturbed(specjax.make_drafter(
        "layer_skip", target, adapter="fresh", exit_layer=1, token_map=list(range(3, VOCAB))),
        seed=3, scale=0.1),
    "mtp_parallel_truncated": lambda target, draft: perturbed(specjax.make_drafter(
        "mtp_parallel", target, path=None, num_heads=3, token_map=list(range(3, VOCAB))), seed=3, scale=0.1),
    "mtp_sequential": lambda target, draft: perturbed(specjax.make_drafter(
        "mtp_sequential", target, path=None, depth=2, recurrent=True), seed=3, scale=0.5),
    "block_truncated": lambda target, draft: perturbed(specjax.make_drafter(
        "block", target, path=None, block_size=3, token_map=list(range(3, VOCAB))), seed=3, scale=0.1),
}


# Adaptive drafting as it decides on these drafters, priced at 0.1 target steps a draft step: the first round (the
# one the joint covers) drafts the length the prior and the costs choose (2 of 3 here: E(0.5, g) / (0.1 g + 1) is
# largest at g = 2; flat forward costs, so the thousands of rows do not change the plan), and rows stop at unsure
# slots, so rounds mix rows that drafted 0, 1 or 2 tokens (their undrafted slots drawn from p) and verify 1, 2 or 3
# tokens.
ADAPTIVE = specjax.AdaptiveDrafting(min_confidence=0.3, prior_alpha=0.5, forward_costs=((1, 1.0), (64, 1.0)))


def speculative_samples(target, draft, sampling, seed=0, gamma=3, samples=SAMPLES, drafter="draft_model",
                        adaptive=ADAPTIVE, tree_nodes=None):
  drafter = DRAFTERS[drafter](target, draft) if isinstance(drafter, str) else drafter
  drafter = dataclasses.replace(drafter, cost=dataclasses.replace(drafter.cost, step=0.1, round=0.0))
  out = specjax.generate(target, [PROMPT] * samples, max_new_tokens=3, drafter=drafter, gamma=gamma, seed=seed,
                         temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, stop_ids=[],
                         max_len=16, adaptive=adaptive, tree_nodes=tree_nodes)
  return np.array(out.tokens), out.stats


SETTINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=6, top_p=0.9)]


# Every drafter at both settings; the block drafter (whose slots' q are one forward's, as the parallel heads' are) at
# the filtered one only.
SAMPLING_CASES = [(drafter, sampling) for drafter in sorted(DRAFTERS) for sampling in ("t1", "topk_topp")
                  if not (drafter == "block_truncated" and sampling == "t1")]


@pytest.mark.slow
@pytest.mark.parametrize("drafter, sampling", SAMPLING_CASES)
def test_speculative_sampling_matches_the_target_distribution(drafter, sampling, target, draft):
  """With adaptive drafting: a chosen draft length, rows stopping early."""
  sampling = SETTINGS[("t1", "topk_topp").index(sampling)]
  samples, s = speculative_samples(target, draft, sampling, drafter=drafter)
  # Both branches of the rule run many times: accepted drafts, and rounds ending at a rejection.
  assert sum(s["accepted_per_row"]) >= 300 and sum(s["rejections_per_row"]) >= 300
  assert chi_square_pvalue(samples, exact_joint(target, sampling)) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["draft_model", "layer_skip_adapter_truncated"])
def test_speculative_sampling_with_fixed_gamma_matches_the_target_distribution(drafter, target, draft):
  samples, s = speculative_samples(target, draft, SETTINGS[1], drafter=drafter, adaptive=False)
  assert s["plain_steps"] == 0 and sum(s["proposed_per_row"]) == 3 * sum(s["rounds_per_row"])
  assert chi_square_pvalue(samples, exact_joint(target, SETTINGS[1])) > 1e-3


@pytest.mark.slow
def test_speculative_sampling_with_bars_from_the_costs_matches_the_target_distribution(target, draft):
  """The default bars: per slot, from the costs and the running acceptance (they move from round to round)."""
  costs = dataclasses.replace(ADAPTIVE, min_confidence=None)
  samples, s = speculative_samples(target, draft, SETTINGS[0], adaptive=costs)
  assert sum(s["accepted_per_row"]) >= 300 and sum(s["rejections_per_row"]) >= 300
  assert len(set(s["proposed_per_row"])) >= 2  # rows stopped at different slots
  assert chi_square_pvalue(samples, exact_joint(target, SETTINGS[0])) > 1e-3


@pytest.mark.slow
def test_adaptive_rounds_mix_draft_lengths(target, draft):
  """What the sampling test covers: rounds draft the chosen length (2 of 3), and rows stop before it."""
  _, s = speculative_samples(target, draft, SETTINGS[0], samples=2_000)
  assert s["gamma_histogram"][3] == 0 and s["gamma_histogram"][2] > 0
  assert {0, 1} <= set(np.unique(s["proposed_per_row"]).tolist())  # rows that stopped at slot 1 or 2


@pytest.mark.slow
def test_autoregressive_sampling_matches_the_target_distribution(target):
  sampling = SETTINGS[1]
  out = specjax.generate(target, [PROMPT] * SAMPLES, max_new_tokens=3, temperature=sampling.temperature,
                         top_k=sampling.top_k, top_p=sampling.top_p, stop_ids=[], max_len=16)
  assert chi_square_pvalue(np.array(out.tokens), exact_joint(target, sampling)) > 1e-3


def always_accept(key, draft_tokens, draft_probs, target_probs, lengths, parents=None):
  rows = jnp.arange(draft_tokens.shape[0])
  return lengths, sample_from_probs(key, target_probs[rows, lengths])


def correct_from_p(key, draft_tokens, draft_probs, target_probs, lengths, parents=None):
  accepted, _ = verify.speculative_verify(key, draft_tokens, draft_probs, target_probs, lengths)
  rows = jnp.arange(draft_tokens.shape[0])
  return accepted, sample_from_probs(jax.random.fold_in(key, 1), target_probs[rows, accepted])


def residual_where_a_row_stopped(key, draft_tokens, draft_probs, target_probs, lengths, parents=None):
  """Where a row stopped drafting (its draft was unsure of slot i), draws from the residual max(0, p - q) of the
  draft distribution computed there, as if slot i had been drafted and rejected, instead of from p."""
  accepted, _ = verify.speculative_verify(key, draft_tokens, draft_probs, target_probs, lengths)
  rows = jnp.arange(draft_tokens.shape[0])
  p = target_probs[rows, accepted]
  residual = jnp.maximum(p - jnp.pad(draft_probs, ((0, 0), (0, 1), (0, 0)))[rows, accepted], 0.0)
  mass = jnp.sum(residual, axis=-1, keepdims=True)
  return accepted, sample_from_probs(jax.random.fold_in(key, 1), jnp.where(mass > 0, residual / mass, p))


@pytest.mark.slow
@pytest.mark.parametrize("broken", [always_accept, correct_from_p, residual_where_a_row_stopped])
def test_the_test_detects_a_broken_verifier(broken, target, draft, monkeypatch):
  sampling = SETTINGS[0]
  monkeypatch.setattr(speculative, "speculative_verify", broken)
  speculative._speculative_program.clear()  # retrace with the broken rule
  try:
    samples, _ = speculative_samples(target, draft, sampling, samples=5_000)  # a gross error needs few
  finally:
    monkeypatch.undo()
    speculative._speculative_program.clear()
  assert chi_square_pvalue(samples, exact_joint(target, sampling)) < 1e-6


# Trees of 6 nodes, 2 deep (the first round covers the joint's tokens 2 and 3): siblings at both depths, tested one
# after another with the residual left by each rejected one. One drafter of each family: parallel heads, sequential
# module, draft model, layer skip, and prompt lookup (branches where the prompt holds several continuations).
TREE_DRAFTERS = {**DRAFTERS, "prompt_lookup": lambda target, draft: specjax.make_drafter("prompt_lookup", target)}


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["mtp_parallel_truncated", "mtp_sequential", "draft_model",
                                     "layer_skip_adapter_truncated", "prompt_lookup"])
def test_tree_speculative_sampling_matches_the_target_distribution(drafter, target, draft):
  samples, s = speculative_samples(target, draft, SETTINGS[1], drafter=TREE_DRAFTERS[drafter](target, draft), gamma=2,
                                   adaptive=False, tree_nodes=6)
  assert sum(s["accepted_per_row"]) >= 300 and sum(s["rejections_per_row"]) >= 300
  assert chi_square_pvalue(samples, exact_joint(target, SETTINGS[1])) > 1e-3


@pytest.mark.slow
def test_adaptive_tree_speculative_sampling_matches_the_target_distribution(target, draft):
  """Adaptive drafting with trees of 6 nodes, 2 deep: the first round (the joint's tokens 2 and 3) is a tree, the
  prior's choice, in a program whose other rounds may be chains or plain steps."""
  drafter = DRAFTERS["mtp_sequential"](target, draft)
  planned = ADAPTIVE.plan(dataclasses.replace(drafter.cost, step=0.1), 2, SAMPLES, tree_nodes=6)
  assert bool(planned.choose(planned.init()).tree)
  samples, s = speculative_samples(target, draft, SETTINGS[1], drafter="mtp_sequential", gamma=2, tree_nodes=6)
  assert s["tree_rounds"] >= 1
  assert sum(s["accepted_per_row"]) >= 300 and sum(s["rejections_per_row"]) >= 300
  assert chi_square_pvalue(samples, exact_joint(target, SETTINGS[1])) > 1e-3


def own_tree_samples(target, sampling, samples=SAMPLES, chunk=5_000):
  """Samples of trees of 6 nodes, 2 deep, whose siblings are the target's own top tokens, in runs of `chunk` rows
  (one compilation; each node's children are scored from its own copy of the cache)."""
  drafter = own_tree_drafter(target)
  runs = [speculative_samples(target, None, sampling, seed=seed, gamma=2, samples=chunk, drafter=drafter,
                              adaptive=False, tree_nodes=6) for seed in range(samples // chunk)]
  return np.concatenate([tokens for tokens, _ in runs]), [s for _, s in runs]


@pytest.mark.slow
@pytest.mark.parametrize("sampling", SETTINGS, ids=["t1", "topk_topp"])
def test_tree_sampling_over_the_targets_own_top_tokens_matches_the_target_distribution(sampling, target):
  """First siblings the target itself favours: rejecting one moves a lot of mass, which the residual must follow."""
  samples, stats = own_tree_samples(target, sampling)
  accepted, rejections = (sum(sum(s[name]) for s in stats) for name in ["accepted_per_row", "rejections_per_row"])
  assert accepted >= 300 and rejections >= 300
  assert chi_square_pvalue(samples, exact_joint(target, sampling)) > 1e-3


@pytest.mark.slow
def test_the_tree_test_detects_a_residual_not_updated_after_a_rejected_sibling(target, monkeypatch):
  monkeypatch.setattr(speculative, "speculative_verify", residual_kept_after_a_rejected_sibling)
  speculative._speculative_program.clear()  # retrace with the broken rule
  try:
    samples, _ = own_tree_samples(target, SETTINGS[0], samples=5_000)  # a gross error needs few
  finally:
    monkeypatch.undo()
    speculative._speculative_program.clear()
  assert chi_square_pvalue(samples, exact_joint(target, SETTINGS[0])) < 1e-6


def test_verify_rule_emits_p_for_one_slot():
  """One draft slot, hand-made p and q: the emitted first token is distributed as p."""
  p = np.array([0.5, 0.2, 0.2, 0.1, 0.0])
  q = np.array([0.1, 0.1, 0.3, 0.2, 0.3])
  n = 200_000
  key_draft, key_verify = jax.random.split(jax.random.PRNGKey(3))
  drafts = jax.random.choice(key_draft, 5, (n, 1), p=jnp.asarray(q)).astype(jnp.int32)
  target_probs = jnp.broadcast_to(jnp.asarray(p, jnp.float32), (n, 2, 5))
  draft_probs = jnp.broadcast_to(jnp.asarray(q, jnp.float32), (n, 1, 5))
  accepted, correction = verify.speculative_verify(key_verify, drafts, draft_probs, target_probs)
  first = np.where(np.asarray(accepted) == 1, np.asarray(drafts[:, 0]), np.asarray(correction))
  observed = np.bincount(first, minlength=5) / n
  np.testing.assert_allclose(observed, p, atol=4e-3)
  assert observed[4] == 0.0  # a token the target forbids is never emitted
  # Acceptance probability is sum_x min(p, q).
  assert np.mean(np.asarray(accepted)) == pytest.approx(np.minimum(p, q).sum(), abs=4e-3)


@pytest.mark.parametrize("vocab", [1000, 49152, 77])
def test_argmax_is_jnp_argmax_with_ties_and_infinities(vocab):
  """Vocabularies that fill whole blocks of sampling.ARGMAX_BLOCK logits and ones that do not."""
  rng = np.random.default_rng(vocab)
  logits = rng.standard_normal((3, 5, vocab)).astype(np.float32)
  logits[0, 0, [7, 30, vocab - 1]] = 50.0  # a tie: the first index
  logits[0, 1, :] = -np.inf  # all -inf: index 0
  logits[0, 2, [10, 20]] = np.inf
  logits[1, 1, vocab - 1] = 1e30  # the last index
  logits[1, 2, vocab - 2:] = 1e30  # a tie in the last block
  logits[2] = np.round(logits[2])  # many ties
  got = jax.jit(sampling.argmax)(jnp.asarray(logits))
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(logits), axis=-1)))
  assert (got[0, 0], got[0, 1], got[0, 2], got[1, 1], got[1, 2]) == (7, 0, 10, vocab - 1, vocab - 2)
  logits[1, 0, [3, 40]] = np.nan  # a broken model's logits: still an index in range
  assert 0 <= int(jax.jit(sampling.argmax)(jnp.asarray(logits))[1, 0]) < vocab


@pytest.mark.parametrize("k", [1, 2, 3, 7, 16, 17])
def test_kth_largest_is_top_ks_last_value_with_ties(k):
  """top-k's threshold by passes of max equals lax.top_k's k-th value, repeats counted, infinities included."""
  values = np.random.default_rng(k).integers(-3, 3, size=(64, 40)).astype(np.float32)  # every row full of ties
  values[0] = -np.inf
  values[1, :3] = np.inf
  expected = jax.lax.top_k(jnp.asarray(values), k)[0][..., -1:]
  np.testing.assert_array_equal(sampling.kth_largest(jnp.asarray(values), k), expected)
