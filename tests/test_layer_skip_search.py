"""Layer-skip search: greedy selection, the speedup model, and saved skip sets that make_drafter accepts."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np
import pytest

import specjax
from experiments import layer_skip_search as lss
from experiments.layer_skip_search import Evaluation
from specjax import leviathan
from specjax.drafters.layer_skip import load_skip_set


def planted(optimum, num_layers):
  """An objective peaked at `optimum`: +1 per optimum layer skipped, -1 per other; counts its calls."""
  calls = []

  def objective(skip):
    calls.append(skip)
    assert list(skip) == sorted(set(skip)) and 0 < len(skip) < num_layers
    return Evaluation(speedup=len(set(skip) & optimum) - len(set(skip) - optimum))
  return objective, calls


def test_greedy_search_finds_planted_optimum():
  objective, calls = planted({1, 3, 4}, num_layers=6)
  result = lss.greedy_search(6, objective, budget=100)
  assert result.skip_layers == (1, 3, 4)
  assert result.evaluation.speedup == 3
  assert result.stopped == "no improvement"
  assert len(calls) == len(set(calls)) == result.evaluations == 6 + 5 + 4 + 3  # four full steps
  assert [skip for skip, _ in result.history] == calls


def test_greedy_search_respects_budget_and_candidate_order():
  objective, calls = planted({1, 3, 4}, num_layers=6)
  result = lss.greedy_search(6, objective, budget=3, candidate_layers=[4, 0, 5, 1, 2, 3])
  assert calls == [(4,), (0,), (5,)]
  assert result.skip_layers == (4,) and result.stopped == "budget"


def test_greedy_search_keeps_the_least_bad_single_layer():
  """Skipping nothing is no drafter: with every set slower than autoregressive, the best single one wins."""
  def objective(skip):
    return Evaluation(speedup=0.9 - 0.1 * len(skip) - 0.01 * skip[0])
  result = lss.greedy_search(4, objective, budget=50)
  assert result.skip_layers == (0,)
  assert result.evaluation.speedup < 1


def test_exit_layer_sweep_is_a_suffix_skip_set():
  seen = []

  def objective(skip):
    seen.append(skip)
    return Evaluation(speedup=-abs(skip[0] - 4))
  results = lss.exit_layer_sweep(6, objective, [2, 4, 5])
  assert seen == [(2, 3, 4, 5), (4, 5), (5,)]
  assert max(results, key=lambda r: r[1].speedup)[0] == 4
  assert lss.drafter_options(6, (4, 5)) == {"exit_layer": 4}
  assert lss.drafter_options(6, (5, 1)) == {"skip_layers": [1, 5]}


@pytest.mark.parametrize("alpha,gamma", [(0.0, 3), (0.5, 4), (0.8, 2), (0.99, 5)])
def test_alpha_from_stats_recovers_leviathan_alpha(alpha, gamma):
  """On simulated i.i.d. acceptances the estimate converges to α, and E matches the mean tokens per round."""
  rng = np.random.default_rng(0)
  rounds = 20000
  draws = rng.random((rounds, gamma)) < alpha
  accepted = np.cumprod(draws, axis=1).sum(axis=1)
  stats = {"accepted_per_row": [int(accepted.sum())], "rounds_per_row": [rounds],
           "rejections_per_row": [int(np.sum(accepted < gamma))]}
  estimate = leviathan.alpha_from_stats(stats, gamma)
  assert estimate == pytest.approx(alpha, abs=0.01)
  assert leviathan.expected_tokens_per_round(estimate, gamma) == pytest.approx(1 + accepted.mean(), rel=0.01)


def test_predicted_speedup_limits():
  assert leviathan.expected_tokens_per_round(1.0, 4) == 5
  assert leviathan.expected_tokens_per_round(0.0, 4) == 1
  assert leviathan.predicted_speedup(1.0, 4, draft_cost=0.0) == 5  # free perfect draft: gamma + 1 per forward
  assert leviathan.predicted_speedup(0.0, 4, draft_cost=0.5) == pytest.approx(1 / 3)


def test_draft_cost_counts_layers_and_head(tiny):
  config = tiny.config
  assert leviathan.draft_cost(tiny.params, config, range(config.num_layers)) == pytest.approx(1.0)
  one = leviathan.draft_cost(tiny.params, config, [0])
  assert 1 / config.num_layers < one < 1  # the LM head is read whatever the layers


@pytest.fixture(scope="module")
def proxy_record(tiny):
  prompts = [[5, 9, 2, 7, 5, 9, 2, 7, 1], [3, 3, 8, 1, 4, 3, 3, 8]]
  return lss.search(tiny, prompts, gamma=3, max_new_tokens=12, budget=4, objective="proxy",
                    exit_layers=[2])


def test_proxy_search_returns_a_valid_skip_set(proxy_record, tiny):
  num_layers = tiny.config.num_layers
  search = proxy_record["search"]
  assert search["evaluations"] <= 4
  assert search["exit_layer_sweep"][0]["exit_layer"] == 2
  options = proxy_record["options"]
  skip = options["skip_layers"] if "skip_layers" in options else list(range(options["exit_layer"], num_layers))
  assert skip == sorted(set(skip)) and 0 < len(skip) < num_layers and set(skip) <= set(range(num_layers))
  scores = [r["speedup"] for r in search["greedy_history"] + search["exit_layer_sweep"]]
  assert proxy_record["proxy_speedup"] == max(scores)
  assert 0 <= proxy_record["alpha"] <= 1 and 0 < proxy_record["draft_cost"] < 1
  expected = leviathan.predicted_speedup(proxy_record["alpha"], 3, proxy_record["draft_cost"])
  assert proxy_record["proxy_speedup"] == pytest.approx(expected)


def test_saved_skip_set_round_trips_into_make_drafter(proxy_record, tiny, tmp_path):
  path = str(tmp_path / "sets" / "tiny.json")
  lss.save_skip_set(path, proxy_record)
  options = load_skip_set(path, model=tiny)
  assert options == proxy_record["options"]
  drafter = specjax.make_drafter("layer_skip", tiny, **options)
  prompt = [[5, 9, 2, 7, 5, 9, 2, 7, 1]]
  expected = specjax.generate(tiny, prompt, max_new_tokens=10, stop_ids=[])
  out = specjax.generate(tiny, prompt, max_new_tokens=10, drafter=drafter, gamma=proxy_record["gamma"], stop_ids=[])
  assert out.tokens == expected.tokens
  with open(path) as f:
    assert json.load(f)["model"] == "tiny"


def test_load_skip_set_rejects_another_model(tmp_path, tiny):
  path = str(tmp_path / "other.json")
  lss.save_skip_set(path, {"drafter": "layer_skip", "options": {"skip_layers": [7]}, "num_layers": 30})
  assert load_skip_set(path) == {"skip_layers": [7]}
  with pytest.raises(ValueError, match="30-layer"):
    load_skip_set(path, model=tiny)


def test_save_is_atomic(tmp_path, monkeypatch):
  path = str(tmp_path / "set.json")
  good = {"drafter": "layer_skip", "options": {"exit_layer": 2}, "measured_speedup": math.nan}
  replaced = []
  real_replace = os.replace

  def spy(src, dst):
    replaced.append((src, dst, os.path.exists(dst)))
    with open(src) as f:  # complete before it takes the final name
      assert json.load(f)["options"] == {"exit_layer": 2}
    real_replace(src, dst)
  monkeypatch.setattr(os, "replace", spy)
  lss.save_skip_set(path, good)
  assert len(replaced) == 1
  src, dst, existed = replaced[0]
  assert dst == path and not existed and os.path.dirname(src) == str(tmp_path) and not os.path.exists(src)
  assert json.load(open(path))["measured_speedup"] is None  # nan is not JSON
  umask = os.umask(0)
  os.umask(umask)
  assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask  # as open() would create it, not mkstemp's 0600

  # A record that fails to serialize leaves the previous file untouched and no temporary behind.
  with pytest.raises(TypeError):
    lss.save_skip_set(path, {**good, "options": {"exit_layer": 3}, "bad": object()})
  assert json.load(open(path))["options"] == {"exit_layer": 2}
  assert os.listdir(tmp_path) == ["set.json"]
  assert len(replaced) == 1


# --- Deeper skip sets, scored under teacher forcing on training text -----------------------------------------


def test_greedy_path_search_goes_past_a_step_that_scores_lower():
  """Skipping one layer scores below the start, three score best: the path carries on and finds them, where the
  stop-at-no-improvement search keeps a single layer."""
  optimum = {1, 3, 4}

  def objective(skip):
    return Evaluation(speedup=[0.0, 1.0, 0.5, 3.0][len(set(skip) & optimum)] - len(set(skip) - optimum))
  path = lss.greedy_path_search(6, objective, candidates=range(1, 5), max_skip=3)
  assert path.skip_layers == (1, 3, 4) and path.stopped == "max_skip"
  assert [len(skip) for skip, _ in path.path] == [1, 2, 3]
  assert path.evaluations == 4 + 3 + 2  # every remaining candidate at each step
  assert len(lss.greedy_search(6, objective, budget=100).skip_layers) == 1
  cut = lss.greedy_path_search(6, objective, candidates=range(1, 5), max_skip=3, budget=5)
  assert cut.stopped == "budget" and cut.evaluations == 5 and len(cut.path) == 2
  with pytest.raises(ValueError, match="max_skip must be in"):
    lss.greedy_path_search(6, objective, candidates=[1, 2], max_skip=3)


@pytest.mark.parametrize("skip", [pytest.param((1,), marks=pytest.mark.slow), (0, 2)])
def test_teacher_forced_draft_logits_equal_the_layer_skip_drafts_first_step(skip, tiny):
  """At position n the proxy's draft is what layer skip drafts for the pending token at n: the kept layers
  run on it, reading the target's K/V of positions < n from the shared cache."""
  import jax.numpy as jnp
  from specjax.model import forward, init_cache
  config, params = tiny.config, tiny.params
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, size=(2, 16)), jnp.int32)
  keys, values, _, _ = lss._target_pass(params, tokens, config=config, top_k=4)
  keep = jnp.asarray([0.0 if i in skip else 1.0 for i in range(config.num_layers)])
  proxy = lss.teacher_forced_draft_logits(params, tokens, keys, values, keep, config)
  layers = tuple(i for i in range(config.num_layers) if i not in skip)
  for n in (1, 6, 15):
    cache = forward(params, tokens[:, :n], init_cache(config, 2, 16), jnp.zeros(2, jnp.int32), config).cache
    draft = forward(params, tokens[:, n:n + 1], cache, jnp.full(2, n, jnp.int32), config, layers=layers).logits
    np.testing.assert_allclose(proxy[:, n], draft[:, 0], atol=5e-5, rtol=1e-5)
  assert not np.allclose(proxy, lss.teacher_forced_draft_logits(params, tokens, keys, values,
                                                                jnp.ones(config.num_layers), config))


def test_deep_search_record_round_trips_into_make_drafter(tiny, tmp_path):
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, tiny.config.vocab_size, size=(5, 24)).astype(np.int32)
  mask = np.arange(24)[None, :] >= rng.integers(4, 12, size=(5, 1))
  record = lss.deep_search(tiny, tokens, mask, gamma=3, max_skip_fraction=0.34, keep_layers=[0], batch_size=4,
                           calibration={"source": "random tokens"})
  search = record["search"]
  num_layers = tiny.config.num_layers  # a third of them is one layer, any of 1 .. num_layers - 1
  assert search["max_skip"] == 1 and search["evaluations"] == num_layers - 1 and search["stopped"] == "max_skip"
  assert record["calibration"] == {"positions": int(mask.sum()), "sequences": 5, "source": "random tokens"}
  best = max(search["history"], key=lambda r: r["speedup"])
  assert record["proxy_speedup"] == best["speedup"] and 0 <= record["alpha"] <= 1
  assert record["proxy_speedup"] == pytest.approx(leviathan.predicted_speedup(record["alpha"], 3, record["draft_cost"]))
  path = str(tmp_path / "deep.json")
  lss.save_skip_set(path, record)
  drafter = specjax.make_drafter("layer_skip", tiny, **load_skip_set(path, model=tiny))
  assert set(drafter.options.layers) | set(best["skip_layers"]) == set(range(num_layers))


def test_deep_search_candidate_pool_takes_the_least_influential_layers(tiny):
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, tiny.config.vocab_size, size=(4, 24)).astype(np.int32)
  mask = np.arange(24)[None, :] < rng.integers(10, 22, size=(4, 1))
  record = lss.deep_search(tiny, tokens, mask, gamma=2, max_skip_fraction=0.34, keep_layers=[0], candidate_pool=1,
                           batch_size=4)
  influence = record["search"]["block_influence"]
  assert len(influence) == tiny.config.num_layers
  least = min(range(1, tiny.config.num_layers), key=lambda l: influence[l])
  assert record["search"]["candidates"] == [least] and record["search"]["evaluations"] == 1
  assert [row["skip_layers"] for row in record["search"]["history"]] == [[least]]


def test_sampling_acceptance_is_the_overlap_of_p_and_q(tiny):
  """With nothing skipped the draft is the target: α = 1 for greedy, and the top-K mass of p for sampling."""
  tokens = np.random.default_rng(2).integers(0, tiny.config.vocab_size, size=(2, 12)).astype(np.int32)
  mask = np.ones_like(tokens, bool)
  greedy = lss.teacher_forced_objective(tiny, tokens, mask, gamma=2, batch_size=2)(())
  sampling = lss.teacher_forced_objective(tiny, tokens, mask, gamma=2, batch_size=2, acceptance="sampling",
                                          top_k=tiny.config.vocab_size)(())
  assert greedy.alpha == pytest.approx(1.0) and sampling.alpha == pytest.approx(1.0, abs=1e-5)
  assert greedy.draft_cost == pytest.approx(1.0)


def test_calibration_prompts_come_from_the_end_of_each_categorys_dev_side_in_one_shape(tiny_chat):
  """The search decodes questions of the dev side only (the comparisons report the test side), all of one compiled
  shape: in each category, the last dev ones of that shape."""
  from experiments import search_layer_skip, spec_bench
  from specjax.decoding import prepare_batch
  model = dataclasses.replace(tiny_chat, config=tiny_chat.config.replace(max_position_embeddings=4096))  # long ones

  def shape(question):
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": question.turns[0]}],
                                              add_generation_prompt=True)
    batch = prepare_batch(model, [ids], 8, extra_positions=3)
    return batch.tokens.shape, batch.cache_len

  questions = spec_bench.load_questions()
  chosen, prompts = search_layer_skip.calibration_prompts(model, questions, 5, max_new_tokens=8, gamma=2)
  assert len(chosen) == len(prompts) == 5 and len({q.category for q in chosen}) > 1
  assert len({shape(q) for q in chosen}) == 1
  assert all(spec_bench.in_split(q, questions, "dev") for q in chosen)
  for category in {q.category for q in chosen}:
    taken = [q for q in chosen if q.category == category]
    same_shape = [q for q in questions if q.category == category and shape(q) == shape(chosen[0])
                  and spec_bench.in_split(q, questions, "dev")]
    assert taken == same_shape[::-1][:len(taken)]


@pytest.mark.slow
def test_training_sequences_are_sharegpt_train_conversations(smollm2):
  tokens, mask, source = lss.training_sequences(smollm2, 3, seq_len=64)
  assert tokens.shape[1] == mask.shape[1] == 64 and 1 <= len(tokens) <= 3 and mask.any()
  assert source["split_seed"] == 0 and source["held_out_fraction"] == 0.05 and source["positions"] == mask.sum()
  assert "ShareGPT" in source["source"] and tokens[0, 0] == smollm2.tokenizer.token_to_id("<|im_start|>")
