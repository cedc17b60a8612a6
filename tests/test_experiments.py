"""The experiment runner: Spec-Bench prompt selection, configs, method setup and small end-to-end runs (on the tiny
model with a word-level tokenizer; on SmolLM2, slow)."""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys
import time

import ml_collections
import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

import specjax
from configs import (adaptive_by_category, adaptive_optimism, adaptive_vs_fixed, batch_sweep,
                     bench_peers, common, compare_drafters, depth_sweep, gamma_sweep, quickstart,
                     spec_bench as spec_bench_config, train_budget, trees)
from experiments import cli, costs, report, run, spec_bench
from specjax import leviathan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_spec_bench_has_480_questions_in_13_categories():
  questions = spec_bench.load_questions()
  counts = collections.Counter(q.category for q in questions)
  assert tuple(counts) == spec_bench.CATEGORIES
  assert counts == {c: 10 if i < 8 else 80 for i, c in enumerate(spec_bench.CATEGORIES)}
  assert len({q.question_id for q in questions}) == 480
  assert all(q.turns and all(isinstance(t, str) and t for t in q.turns) for q in questions)


def test_select_takes_the_first_per_category_in_the_given_order():
  questions = spec_bench.load_questions()
  chosen = spec_bench.select(questions, categories=["rag", "coding"], per_category=3)
  assert [q.category for q in chosen] == ["rag"] * 3 + ["coding"] * 3
  assert [q.question_id for q in chosen[3:]] == [q.question_id for q in questions if q.category == "coding"][:3]
  assert len(spec_bench.select(questions, per_category=2)) == 26
  assert len(spec_bench.select(questions, per_category=2, max_prompts=5)) == 5
  assert len(spec_bench.select(questions, categories=["qa"])) == 80


def test_the_dev_and_test_splits_halve_every_category():
  questions = spec_bench.load_questions()
  dev, test = (spec_bench.select(questions, split=s) for s in ("dev", "test"))
  assert not {q.question_id for q in dev} & {q.question_id for q in test} and len(dev) + len(test) == 480
  for category in spec_bench.CATEGORIES:
    ids = [q.question_id for q in questions if q.category == category]
    assert [q.question_id for q in dev if q.category == category] == ids[0::2]
    assert [q.question_id for q in test if q.category == category] == ids[1::2]
    assert len(ids[1::2]) >= 5
  firsts = spec_bench.select(questions, categories=["writing"], per_category=2, split="test")
  writing = [q.question_id for q in questions if q.category == "writing"]
  assert [q.question_id for q in firsts] == [writing[1], writing[3]]  # per_category counts within the split
  with pytest.raises(ValueError, match="not on the dev side"):
    spec_bench.select(questions, question_ids=[firsts[0].question_id], split="dev")
  with pytest.raises(ValueError, match="unknown split"):
    spec_bench.select(questions, split="train")


def test_select_by_question_ids_keeps_their_order():
  chosen = spec_bench.select(spec_bench.load_questions(), question_ids=[130, 81], categories=["rag"])
  assert [(q.question_id, q.category) for q in chosen] == [(130, "coding"), (81, "writing")]


@pytest.mark.parametrize("kwargs, message", [
    ({"categories": ["poetry"]}, "unknown Spec-Bench categories"),
    ({"categories": ["math"], "per_category": 11}, "has 10 questions, asked for 11"),
    ({"question_ids": [81, 99999]}, "unknown Spec-Bench question ids"),
])
def test_select_rejects_impossible_selections(kwargs, message):
  with pytest.raises(ValueError, match=message):
    spec_bench.select(spec_bench.load_questions(), **kwargs)


class _WordTokenizer:
  """Words as tokens: enough to count a prompt's length."""

  def encode(self, text):
    return list(range(len(text.split())))


def test_a_least_prompt_length_puts_the_questions_before_it_first():
  questions = spec_bench.load_questions()
  tokenizer = _WordTokenizer()
  question = questions[1]
  alone = spec_bench.prompt_text(question)
  assert alone == question.turns[0]
  text = spec_bench.prompt_text(question, min_tokens=600, tokenizer=tokenizer, questions=questions)
  assert text.endswith("\n\n" + question.turns[0]) and len(text.split()) >= 600
  # the nearest earlier question next to it (questions[0]), then wrapping around to the end of the file
  assert text.endswith(questions[0].turns[0] + "\n\n" + question.turns[0])
  assert questions[-1].turns[0] + "\n\n" + questions[0].turns[0] in text
  # and no more of them than it takes
  first = next(q.turns[0] for q in reversed(questions) if text.startswith(q.turns[0] + "\n\n"))
  assert len(text[len(first) + 2:].split()) < 600
  with pytest.raises(ValueError, match="needs the tokenizer"):
    spec_bench.prompt_text(question, min_tokens=10)
  with pytest.raises(ValueError, match="fewer than"):
    spec_bench.prompt_text(question, min_tokens=10**7, tokenizer=tokenizer, questions=questions)


@pytest.mark.slow
def test_prompt_ids_use_the_chat_template_on_the_first_turn_only(smollm2):
  question = spec_bench.select(spec_bench.load_questions(), question_ids=[81])[0]
  tokenizer = smollm2.tokenizer
  chat = tokenizer.decode(spec_bench.prompt_ids(question, tokenizer, chat=True))
  assert question.turns[0] in chat and question.turns[1] not in chat
  assert chat.startswith("<|im_start|>") and chat.endswith("<|im_start|>assistant\n")
  assert spec_bench.prompt_ids(question, tokenizer, chat=False) == tokenizer.encode(question.turns[0])


# Every config and variant: (module, argument, prompts it selects, max_new_tokens, the side of the dev/test split:
# test where a run reports, dev where it chooses a constant).
CONFIGS = [
    (quickstart, None, 4, 64, "test"),
    (spec_bench_config, None, 65, 128, "test"),
    (spec_bench_config, "small", 13, 64, "test"),
    (compare_drafters, None, 65, 128, "test"),
    (compare_drafters, "small", 13, 64, "test"),
    (compare_drafters, "small,sampling", 13, 64, "test"),
    (gamma_sweep, "small", 13, 64, "dev"),
    (depth_sweep, None, 26, 128, "dev"),
    (batch_sweep, None, 24, 64, "test"),
    (batch_sweep, "small", 8, 64, "test"),
    (adaptive_vs_fixed, None, 26, 128, "test"),
    (adaptive_vs_fixed, "small", 13, 64, "test"),
    (adaptive_by_category, None, 52, 64, "test"),
    (adaptive_by_category, "small", 26, 64, "test"),
    (adaptive_by_category, "full", 65, 64, "test"),
    (adaptive_optimism, None, 35, 64, "dev"),
    (adaptive_optimism, "small", 14, 64, "dev"),
    (bench_peers, None, 26, 128, "test"),
    (bench_peers, "small", 13, 64, "test"),
    (bench_peers, "gemma", 13, 128, "test"),
    (bench_peers, "quantized", 26, 128, "test"),
    (bench_peers, "gemma,quantized", 13, 128, "test"),
    (trees, None, 65, 128, "dev"),
    (trees, "small", 13, 64, "dev"),
    (trees, "mtp", 65, 128, "dev"),
]


@pytest.mark.parametrize("module, arg, prompts, max_new_tokens, split", CONFIGS,
                         ids=[f"{m.__name__.split('.')[-1]}{':' + a if a else ''}" for m, a, *_ in CONFIGS])
def test_config_builds_a_run_that_checks_out_without_running(module, arg, prompts, max_new_tokens, split):
  """Its prompts (and their side of the dev/test split), and its methods as far as they check without the model
  (run.check_methods): known keys, drafters and peers, unique names, adaptive drafting options, the autoregressive
  baseline first."""
  config = module.get_config(arg)
  assert config.prompts.split == split
  assert len(spec_bench.select(spec_bench.load_questions(), **config.prompts.to_dict())) == prompts
  assert config.max_new_tokens == max_new_tokens
  assert dict(config.methods[0]) == {"name": "autoregressive"}
  names = [m["name"] for m in config.methods]
  assert [m["name"] for m in run.check_methods(config)] == names[:1] + [run.CONTROL] * config.control + names[1:]


@pytest.mark.parametrize("module, arg, message", [
    (quickstart, "small", "takes no argument"),
    (spec_bench_config, "huge", "'small'"),
    (bench_peers, "huge", "comma-separated subset of small, gemma, quantized"),
    (compare_drafters, "small,greedy", "comma-separated subset of small, sampling, both, adaptive, budget, data"),
    (compare_drafters, "sampling,both", "exclude each other"),
    (compare_drafters, "budget,data", "exclude each other"),
    (adaptive_by_category, "small,full", "exclude each other"),
    (adaptive_by_category, "large", "comma-separated subset of small, full"),
    (adaptive_by_category, "g2", "subset of small"),
    (adaptive_vs_fixed, "tiny", "subset of g1, g2, g3, g4, small"),
    (adaptive_vs_fixed, "small,g5", "subset of g1, g2, g3, g4, small"),
])
def test_config_rejects_an_argument_it_does_not_take(module, arg, message):
  with pytest.raises(ValueError, match=message):
    module.get_config(arg)


def test_adaptive_optimism_runs_each_drafter_at_each_optimism():
  config = adaptive_optimism.get_config()
  for name in adaptive_optimism.DRAFTERS:
    runs = [m for m in config.methods if m["name"].startswith(f"{name}_z")]
    assert [m["adaptive"]["optimism"] for m in runs] == list(adaptive_optimism.OPTIMISMS)
    method = common.METHODS[name]
    assert all(m["drafter"] == method["drafter"] and m["options"] == method["options"] for m in runs)




def test_compare_drafters_variants():
  assert compare_drafters.get_config("small,sampling").temperature == 0.7
  assert compare_drafters.get_config("small,sampling").top_p == 0.9
  assert tuple(compare_drafters.get_config("both").temperatures) == (0.0, 0.7)
  assert compare_drafters.get_config(None).temperature == 0.0
  names = [m["name"] for m in compare_drafters.get_config("small").methods]
  assert names == ["autoregressive", "prompt_lookup", "layer_skip_exit24", "layer_skip_best_set",
                   "layer_skip_deep_set", "layer_skip_trained_exit", "draft_model", "mtp_parallel", "mtp_sequential"]
  best = next(m for m in compare_drafters.get_config("small").methods if m["name"] == "layer_skip_best_set")
  # The runner reads the record in configs/layer_skip_sets: its options, and the gamma it was searched for.
  assert run.method_options(best) == ({"skip_layers": [12]}, 2)
  assert run.method_options({**best, "gamma": 4, "options": {"adapter": None}}) == (
      {"skip_layers": [12], "adapter": None}, 4)  # the method's own gamma and options win


def test_a_method_naming_a_missing_or_misplaced_skip_set_is_refused():
  config = quickstart.get_config()
  config.methods = (*config.methods, {"name": "lost", "drafter": "layer_skip", "skip_set": "configs/nowhere.json"})
  with pytest.raises(ValueError, match="method 'lost': no skip set at .*nowhere.json"):
    run.check_methods(config)
  config.methods = (*config.methods[:-1], {**common.METHODS["layer_skip_best_set"], "drafter": "prompt_lookup"})
  with pytest.raises(ValueError, match="a skip set is a layer_skip drafter's"):
    run.check_methods(config)


def test_configs_name_each_method_once_from_the_one_method_list():
  """Every config's method is configs/common.py's METHODS entry of its name, or a declared variant of one (its
  name with a suffix, its fields with gamma or adaptive drafting set), or an early exit of `layer_skip_exit`."""
  for module, arg, *_ in CONFIGS:
    for method in module.get_config(arg).methods:
      method = dict(method)
      base = next((common.METHODS[n] for n in sorted(common.METHODS, key=len, reverse=True)
                   if method["name"] == n or method["name"].startswith(n + "_")), None)
      if base is None:
        layer = int(method["name"].removeprefix("layer_skip_exit"))
        base = common.layer_skip_exit(layer)
      assert {k: v for k, v in method.items() if k not in ("name", "gamma", "adaptive", "tree_nodes")} == {
          k: v for k, v in base.items() if k != "name"}, (module.__name__, method)


def test_a_method_drafts_with_its_own_checkpoint_file_and_is_left_out_without_it(tmp_path, tiny):
  from specjax.drafters import draft_head
  spec = {"name": "mine", "drafter": "mtp_parallel", "options": {}, "checkpoint": str(tmp_path / "heads.safetensors")}
  assert run.missing_checkpoints([spec], tiny) == {"mine": [spec["checkpoint"]]}
  draft_head.save(specjax.make_drafter("mtp_parallel", tiny, path=None, num_heads=2), spec["checkpoint"], tiny)
  assert run.missing_checkpoints([spec], tiny) == {}
  options, _ = run.method_options(spec, tiny)
  assert options == {"path": spec["checkpoint"]}
  assert specjax.make_drafter("mtp_parallel", tiny, **options).options.num_heads == 2
  with pytest.raises(ValueError, match="name the same thing"):
    run.method_options(dict(spec, options={"path": "elsewhere.safetensors"}), tiny)


def test_the_budget_comparison_drafts_with_each_budget_runs_exported_checkpoint():
  names = [m["name"] for m in compare_drafters.get_config("budget").methods]
  for run_name, drafter in common.BUDGET_RUNS.items():
    method = common.METHODS["budget_" + run_name.replace("-", "_")]
    assert method["name"] in names and method["drafter"] == drafter
    training = train_budget.get_config(run_name.replace("-", ","))  # "sequential-sharegpt": the variant's run
    assert (training.drafter, training.export_path) == (drafter, "")  # exported as <workdir>/<drafter>.safetensors
    assert method["checkpoint"] == f"{training.workdir}/{training.drafter}.safetensors"
  # the data control: the sequential module on either answers, both in the budget comparison too
  data = [m["name"] for m in compare_drafters.get_config("data,adaptive").methods]
  assert data == ["autoregressive", "budget_sequential", "budget_sequential_sharegpt"] and set(data) <= set(names)
  assert (train_budget.get_config("sequential,sharegpt").positions, train_budget.get_config("sequential,sharegpt")
          .held_out_dir) == (train_budget.get_config("sequential").positions,
                             train_budget.get_config("sequential").held_out_dir)


@pytest.mark.slow
def test_compare_drafters_leaves_out_exactly_the_unshipped_checkpoints(smollm2):
  config = compare_drafters.get_config("small")
  shipped = os.path.join(os.path.dirname(specjax.__file__), "checkpoints", "smollm2-135m")
  expected = {name: [f"{checkpoint}.safetensors"] for name, checkpoint in
              (("layer_skip_trained_exit", "exit_adapter"), ("draft_model", "draft_model"))
              if not os.path.exists(os.path.join(shipped, f"{checkpoint}.safetensors"))}
  assert run.missing_checkpoints([dict(m) for m in config.methods], smollm2) == expected
  config.only = "prompt_lookup,layer_skip_trained_exit,draft_model,layer_skip_best_set"
  methods = run.make_methods(config, smollm2)
  assert [m.name for m in methods] == ["autoregressive", run.CONTROL, "prompt_lookup", "layer_skip_best_set"] + [
      n for n in ("layer_skip_trained_exit", "draft_model") if n not in expected]
  assert methods[3].gamma == 2 and methods[3].drafter.options.layers == tuple(i for i in range(30) if i != 12)


def test_gamma_sweep_runs_each_drafter_at_each_gamma_up_to_its_limit(tiny_chat):
  config = _config(methods=({"name": "ar"}, {"name": "pld", "drafter": "prompt_lookup"},
                            {"name": "heads", "drafter": "mtp_parallel", "options": {"path": None, "num_heads": 2}}),
                   gammas=(1, 3))
  methods = run.make_methods(config, tiny_chat)
  assert [(m.name, m.family, m.gamma) for m in methods] == [
      ("ar", "ar", 4), ("pld_g1", "pld", 1), ("pld_g3", "pld", 3), ("heads_g1", "heads", 1)]


def test_adaptive_vs_fixed_runs_each_drafter_adaptive_and_at_every_fixed_gamma():
  config = adaptive_vs_fixed.get_config("small")
  methods = {m["name"]: m for m in config.methods}
  drafters = [m["name"] for m in config.methods[1:] if m["adaptive"]]
  assert drafters == ["prompt_lookup", "layer_skip_exit24", "mtp_parallel", "mtp_sequential", "draft_model",
                      "layer_skip_trained_exit"]
  for name in drafters:
    assert methods[name]["gamma"] == 4
    for gamma in (1, 2, 3, 4):
      fixed = methods[f"{name}_g{gamma}"]
      assert fixed["adaptive"] is False and fixed["gamma"] == gamma
      assert {k: v for k, v in fixed.items() if k not in ("name", "adaptive", "gamma")} == {
          k: v for k, v in methods[name].items() if k not in ("name", "adaptive", "gamma")}
  assert len(config.methods) == 1 + 5 * len(drafters) and config.repeats == 2
  some = adaptive_vs_fixed.get_config("small,g1,g2")  # only the fixed draft lengths named
  assert [m["name"] for m in some.methods[:4]] == ["autoregressive", "prompt_lookup", "prompt_lookup_g1",
                                                   "prompt_lookup_g2"]
  assert len(some.methods) == 1 + 3 * len(drafters)


def test_acceptance_table_shows_bytes_costs_only_when_the_run_measured_them():
  methods = {"autoregressive": {"acceptance_per_position": None},
             "pld": {"acceptance_per_position": [0.5, 0.25]}, "heads": {"acceptance_per_position": [0.4]}}
  table = report.acceptance_table({"methods": methods})
  assert table.splitlines()[0] == "| method | k=1 | k=2 |" and "bytes" not in table
  assert "| heads | 0.400 | – |" in table
  methods["heads"].update(draft_cost_bytes=0.05, verify_cost_bytes=1.01)
  table = report.acceptance_table({"methods": methods})
  assert table.splitlines()[0] == "| method | k=1 | k=2 | c (bytes) | r (bytes) |"
  assert "| heads | 0.400 | – | 0.050 | 1.010 |" in table and "| pld | 0.500 | 0.250 | – | – |" in table


def test_adaptive_rounds_pool_plain_steps_over_calls():
  def record(method, batch, plain):
    return {"method": method, "batch": batch, "repeat": 0, "category": "qa", "seconds": 1.0, "new_tokens": 20,
            "tokens_per_second": 20.0, "target_calls": 11, "mean_accepted": 1.5, "compile_call_seconds": None,
            "plain_steps": plain, "rounds_per_row": [10], "accepted_per_row": [5], "rejections_per_row": [3],
            "new_tokens_per_row": [20], "acceptance_per_position": [0.5], "proposed_per_position": [8],
            "gamma_histogram": None if plain is None else [plain, 10 - plain]}
  records = [record("ar", 0, None), record("ar", 1, None), record("dm", 0, 4), record("dm", 1, 2),
             record("dm_careful", 0, 6), record("dm_careful", 1, 8), record("dm_fixed", 0, 0), record("dm_fixed", 1, 0)]
  records[0]["rounds_per_row"] = records[1]["rounds_per_row"] = None
  info = {"ar": {}, "dm": {"gamma": 1, "adaptive": True}, "dm_careful": {"gamma": 1, "adaptive": {"optimism": 0.0}},
          "dm_fixed": {"gamma": 1, "adaptive": False}}
  summary = report.summarize(records, ["ar", "dm", "dm_careful", "dm_fixed"], "ar", {}, {}, info)
  assert summary["methods"]["dm"]["plain_share"] == pytest.approx(6 / 20)
  assert summary["methods"]["dm_careful"]["plain_share"] == pytest.approx(14 / 20)
  assert summary["methods"]["ar"]["plain_share"] is None
  assert report.adaptive_rounds_table(summary).splitlines()[2:] == ["| dm | 30% | 0.625 |",
                                                                    "| dm_careful | 70% | 0.625 |"]


def test_adaptive_table_puts_each_adaptive_drafter_beside_its_best_and_worst_fixed_gamma():
  def method(speedup, adaptive, gamma):
    return {"speedup": speedup, "adaptive": adaptive, "gamma": gamma}
  summary = {"baseline": "ar", "methods": {
      "ar": method(1.0, None, None), "pld": method(1.2, True, 4), "pld_g1": method(1.1, False, 1),
      "pld_g2": method(1.3, False, 2), "pld_g4": method(0.9, False, 4), "heads": method(1.05, True, 4)},
      "speedup_by_category": {"ar": {"qa": 1.0, "rag": 1.0}, "pld": {"qa": 1.4, "rag": 0.97},
                              "pld_g1": {"qa": 1.2, "rag": 1.0}, "pld_g2": {"qa": 1.5, "rag": 0.8},
                              "pld_g4": {"qa": 1.0, "rag": 0.8}, "heads": {"qa": 1.0, "rag": 1.1}}}
  rows = report.adaptive_table(summary).splitlines()
  assert rows[2:] == ["| pld | 1.20x | 1.30x (γ 2) | 0.90x (γ 4) | 0.97x | 0.80x |"]  # heads: no fixed runs
  summary["methods"] = {n: m for n, m in summary["methods"].items() if "_g" not in n}
  assert report.adaptive_table(summary) == ""


def test_adaptive_by_category_runs_every_drafter_adaptive_with_repeats():
  config = adaptive_by_category.get_config(None)
  assert config.repeats == 3 and not config.prompts.categories  # all 13 categories
  assert [m["name"] for m in config.methods] == ["autoregressive", *common.DRAFTERS]
  assert all(m["adaptive"] and m["gamma"] == 4 for m in config.methods[1:])


def test_interleaved_seconds_lengthens_the_loops_of_tiny_steps():
  """A 20 us step behind 2 ms of per-call overhead: an 8-call loop would measure mostly noise, so the long loop
  grows until it takes 50 ms, and the per-step time comes out right."""
  calls_seen = []

  def run(calls):
    calls_seen.append(calls)
    time.sleep(0.002 + 2e-5 * calls)
    return np.zeros(())

  seconds = costs.interleaved_seconds({"tiny": run}, repeats=3)
  assert max(calls_seen) == 4096 and calls_seen.count(4096) == 3 + 1
  assert seconds["tiny"] == pytest.approx(2e-5, rel=0.3)
  slow = costs.interleaved_seconds({"slow": lambda calls: time.sleep(0.01 * calls)}, repeats=1)
  assert slow["slow"] == pytest.approx(0.01, rel=0.3)


def test_interleaved_seconds_measures_again_longer_when_noise_hides_the_step():
  """Another process slows the first short loops more than the step's whole long loop takes: the median difference
  reads negative, so that run is measured again with a doubled long loop until the step shows."""
  noise = {"short calls left": 3}

  def run(calls):
    delay = 2e-3 * calls
    if calls == 2 and noise["short calls left"] > 0:  # interference lands on the short loops of the first rounds
      noise["short calls left"] -= 1
      delay += 0.2
    time.sleep(delay)
    return np.zeros(())

  lengths = []
  seconds = costs.interleaved_seconds({"noisy": lambda calls: lengths.append(calls) or run(calls)}, repeats=3,
                                      min_seconds=0.0)
  assert seconds["noisy"] == pytest.approx(2e-3, rel=0.3)
  assert 16 in lengths  # measured again, longer


def test_bandwidths_are_measured_over_every_byte():
  x = np.arange(1 << 20, dtype=np.float32) % 7
  assert float(costs._sum(x)) == float(np.sum(x, dtype=np.float64))  # the read reduction sees every element
  assert 0 < costs.measure_read_bandwidth(megabytes=4, repeats=2) < 1e15
  assert 0 < costs.measure_copy_bandwidth(megabytes=4, repeats=2) < 1e15


@pytest.mark.parametrize("n, ranks", [(4, None), (5, (1, 5)), (12, (3, 10)), (15, (4, 12)), (40, (15, 26))])
def test_median_interval_takes_the_order_statistics_a_binomial_bound_allows(n, ranks):
  values = list(np.random.default_rng(n).permutation(np.arange(1.0, n + 1)))  # value i is the i-th smallest
  interval = report.median_interval(values, confidence=0.9)
  assert interval == (None if ranks is None else tuple(float(r) for r in ranks))
  if ranks is not None:  # the coverage of ranks k and n + 1 - k is >= 0.9, that of k + 1 and n - k below it
    k = ranks[0]
    below = lambda j: sum(math.comb(n, i) for i in range(j)) / 2 ** n  # P(Binomial(n, 1/2) < j)
    assert 1 - 2 * below(k) >= 0.9 > 1 - 2 * below(k + 1)


def test_median_interval_covers_the_median_at_its_confidence():
  # Draws from a distribution with median 1.0: the interval misses it at most ~10% of the time (less: the
  # order statistics' coverage is the first at or above 0.9).
  rng = np.random.default_rng(0)
  misses = 0
  for _ in range(2000):
    low, high = report.median_interval(list(rng.lognormal(0.0, 0.15, size=12)), confidence=0.9)
    misses += not low <= 1.0 <= high
  assert 0.02 < misses / 2000 < 0.1


def test_paired_speedups_average_the_repeats_of_a_prompt_before_pairing():
  # Repeat k runs 5% faster for every method (a drift of the machine); the method is 1 + 0.1 b times the baseline on
  # batch b. Each batch gives one ratio, its repeats pooled: 7 prompts, not 21 correlated pairs.
  records = []
  for b in range(7):
    for k in range(3):
      base_seconds = 6.4 / (1 + 0.05 * k)
      for m, seconds in (("ar", base_seconds), ("pld", base_seconds / (1 + 0.1 * b))):
        records.append({"method": m, "batch": b, "repeat": k, "category": "qa" if b < 5 else "rag", "seconds": seconds,
                        "new_tokens": 64, "tokens_per_second": 64 / seconds, "target_calls": 64, "mean_accepted": 1.0,
                        "compile_call_seconds": None})
  records.remove(next(r for r in records if (r["method"], r["batch"], r["repeat"]) == ("ar", 0, 2)))
  records[-1]["seconds"] *= 2  # the method's last call (batch 6, repeat 2) twice as slow: its batch pools 3 calls
  ratios = report.paired_speedups(records, "pld", "ar")
  assert len(ratios) == 7
  assert ratios[:6] == pytest.approx([1.0, 1.1, 1.2, 1.3, 1.4, 1.5])  # batch 0 pairs repeats 0 and 1 only
  seconds = [6.4 / (1 + 0.05 * k) / 1.6 for k in range(3)]
  seconds[2] *= 2
  assert ratios[6] == pytest.approx(sum(6.4 / (1 + 0.05 * k) for k in range(3)) / sum(seconds))
  intervals = report.category_intervals(records, "pld", "ar")
  assert intervals["qa"]["pairs"] == 5 and intervals["qa"]["median"] == pytest.approx(1.2)
  assert (intervals["qa"]["low"], intervals["qa"]["high"]) == pytest.approx((1.0, 1.4))  # 5 prompts: min and max
  assert intervals["rag"]["pairs"] == 2 and intervals["rag"]["low"] is None  # too few prompts for 90%
  summary = report.summarize(records, ["ar", "pld"], "ar", {}, {})
  assert summary["category_intervals"] == {"pld": intervals}
  assert summary["methods"]["pld"]["pairs"] == 7 and summary["methods"]["pld"]["speedup"] == np.median(ratios)
  table = report.category_table(summary).splitlines()
  assert table[2] == "| qa (5) | 1.20 (1.00–1.40) |" and table[3] == f"| rag (2) | {np.median(ratios[5:]):.2f} |"
  assert table[-1] == "| above / containing / below 0.95x | 1 / 0 / 0 |"
  summary["category_intervals"]["pld"].pop("qa")
  assert report.category_table(summary) == ""  # no category with an interval


def _config(**overrides) -> ml_collections.ConfigDict:
  """The quickstart's config with `overrides`, without the control unless they ask for it."""
  config = quickstart.get_config()
  config.control = False
  config.update(overrides)
  return config


def test_make_methods_puts_the_baseline_first_and_honours_only(tiny_chat):
  config = _config(methods=({"name": "pld", "drafter": "prompt_lookup"}, {"name": "ar"},
                            {"name": "skip", "drafter": "layer_skip", "gamma": 2}), only="pld")
  methods = run.make_methods(config, tiny_chat)
  assert [m.name for m in methods] == ["ar", "pld"]
  assert methods[0].drafter is None and methods[1].drafter.name == "prompt_lookup"
  assert methods[1].gamma == config.gamma


def test_the_control_decodes_as_the_baseline_right_after_it(tiny_chat):
  config = _config(methods=({"name": "ar"}, {"name": "pld", "drafter": "prompt_lookup"}), control=True, only="pld")
  methods = run.make_methods(config, tiny_chat)
  assert [m.name for m in methods] == ["ar", run.CONTROL, "pld"] and methods[1].drafter is None
  assert [m.name for m in run.make_methods(_config(methods=config.methods, control=False), tiny_chat)] == ["ar", "pld"]
  with pytest.raises(ValueError, match="adds a method named 'control'"):
    run.check_methods(_config(methods=({"name": "ar"}, {"name": "control", "drafter": "prompt_lookup"}), control=True))


def test_make_methods_builds_adaptive_drafting_from_a_methods_options(tiny_chat):
  config = _config(methods=({"name": "ar"}, {"name": "pld", "drafter": "prompt_lookup"},
                            {"name": "pld_careful", "drafter": "prompt_lookup", "adaptive": {"optimism": 0.25}},
                            {"name": "pld_fixed", "drafter": "prompt_lookup", "adaptive": False}))
  methods = {m.name: m for m in run.make_methods(config, tiny_chat)}
  assert methods["pld"].adaptive is True and methods["pld_fixed"].adaptive is False
  assert methods["pld_careful"].adaptive == specjax.AdaptiveDrafting(optimism=0.25)
  info = run._method_info(list(methods.values()))
  assert info["pld_careful"]["adaptive"]["optimism"] == 0.25 and info["pld"]["adaptive"] is True
  json.dumps(info)  # results.json holds the options


@pytest.mark.parametrize("adaptive, message", [
    ({"optimsm": 0.25}, r"unknown adaptive drafting option\(s\) \['optimsm'\]"),
    ({"optimism": -1.0}, "optimism must be >= 0"),
    ("yes", "'adaptive' is True, False or a dict"),
])
def test_make_methods_rejects_bad_adaptive_options(adaptive, message):
  config = _config(methods=({"name": "ar"}, {"name": "pld", "drafter": "prompt_lookup", "adaptive": adaptive}))
  with pytest.raises(ValueError, match=message):
    run.make_methods(config, model=None)  # fails before building the drafter


@pytest.mark.parametrize("methods, only, message", [
    (({"name": "pld", "drafter": "prompt_lookup"},), "", "needs an autoregressive baseline"),
    (({"name": "ar"}, {"name": "ar"}), "", "must be unique"),
    (({"name": "ar"},), "ar,typo", r"unknown methods \['typo'\]"),
    (({"name": "ar", "exit_layer": 3},), "", "a method is a dict"),
])
def test_make_methods_rejects_bad_method_lists(methods, only, message):
  with pytest.raises(ValueError, match=message):
    run.make_methods(_config(methods=methods, only=only), model=None)  # fails before building drafters


def test_tree_methods_draft_trees_of_their_size_in_fixed_rounds(tiny_chat):
  heads = {"drafter": "mtp_parallel", "options": {"path": None, "num_heads": 2}}
  config = _config(methods=({"name": "ar"}, {"name": "heads", **heads}, {"name": "heads_tree4", **heads,
                                                                           "tree_nodes": 4}), adaptive=False)
  methods = run.make_methods(config, tiny_chat)
  assert [(m.name, m.tree_nodes, m.adaptive) for m in methods] == [
      ("ar", None, False), ("heads", None, False), ("heads_tree4", 4, False)]
  assert run._method_info(methods)["heads_tree4"]["tree_nodes"] == 4
  # With adaptive drafting, trees where they pay.
  tree_method = run.make_methods(_config(methods=config.methods, adaptive=True), tiny_chat)[2]
  assert (tree_method.name, tree_method.tree_nodes, tree_method.adaptive) == ("heads_tree4", 4, True)
  names = [m["name"] for m in trees.get_config("small").methods]
  assert {8, 16, 32} <= set(trees.TREE_NODES)
  assert names == ["autoregressive", *trees.DRAFTERS] + [f"{d}_tree{n}" for d in trees.DRAFTERS
                                                         for n in trees.TREE_NODES]
  assert [m["name"] for m in trees.get_config("mtp").methods] == [
      "autoregressive", *trees.MTP, *(f"{d}_tree{trees.CPU_TREE}" for d in trees.MTP)]


@pytest.mark.parametrize("method, adaptive, message", [
    ({"name": "heads_tree0", "drafter": "mtp_parallel", "tree_nodes": 0, "adaptive": False}, False,
     "tree_nodes is a positive integer"),
    ({"name": "ar_tree4", "tree_nodes": 4}, False, "tree_nodes is a positive integer of a drafting method"),
])
def test_check_methods_rejects_bad_tree_methods(method, adaptive, message):
  with pytest.raises(ValueError, match=message):
    run.check_methods(_config(methods=({"name": "ar"}, method), adaptive=adaptive))


def test_batches_never_mix_categories():
  questions = spec_bench.select(spec_bench.load_questions(), categories=["qa", "math"], per_category=3)
  batches = run.make_batches(questions, [[i + 1] for i in range(6)], batch_size=2)
  assert [(b.category, len(b.prompts)) for b in batches] == [("qa", 2), ("qa", 1), ("math", 2), ("math", 1)]
  assert [b.index for b in batches] == [0, 1, 2, 3]
  assert sum((b.prompts for b in batches), ()) == tuple((i + 1,) for i in range(6))


@pytest.mark.slow
def test_run_writes_results_table_and_plots(smollm2, tmp_path):
  # qa and humanities prompts (test side) fall into one length bucket: one compilation per method.
  config = _config(max_new_tokens=8, repeats=2, only="prompt_lookup", control=True)
  config.costs.enabled = False  # measured on a tiny model below
  config.prompts.categories = ("qa", "humanities")
  results = run.run(config, str(tmp_path), model=smollm2, name="test")

  with open(tmp_path / "results.json") as f:
    saved = json.load(f)
  assert saved["config"]["max_new_tokens"] == 8
  assert saved["environment"]["cpu_count"] == os.cpu_count()
  # The checkpoints it may have decoded with, hashed: the shipped ones for its model (the publication compares them).
  shipped = "specjax/checkpoints/smollm2-135m/mtp_sequential.safetensors"
  assert saved["fingerprint"]["checkpoints"][shipped] == cli.file_digest(os.path.join(run.REPO, shipped))
  summary = saved["summary"]["methods"]
  assert list(summary) == ["autoregressive", run.CONTROL, "prompt_lookup"]
  assert all(s["lossless"] is True for s in summary.values())
  assert summary["autoregressive"]["compile_seconds"] > 0 and summary["prompt_lookup"]["compile_seconds"] > 0
  assert summary[run.CONTROL]["mean_accepted"] == 1 and summary[run.CONTROL]["speedup"] > 0
  # tokens/s: per batch, median tokens over median seconds of its repeats; then the median over batches.
  for method, s in summary.items():
    rates = [np.median([r["new_tokens"] for r in saved["records"] if (r["method"], r["batch"]) == (method, b)])
             / np.median([r["seconds"] for r in saved["records"] if (r["method"], r["batch"]) == (method, b)])
             for b in (0, 1)]
    assert s["tokens_per_second"] == pytest.approx(np.median(rates))
  # The speedup is the median over batches of paired speedups, each batch's repeats pooled before pairing.
  def rate(method, batch):
    calls = [r for r in saved["records"] if (r["method"], r["batch"]) == (method, batch)]
    return sum(r["new_tokens"] for r in calls) / sum(r["seconds"] for r in calls)

  ratios = [rate("prompt_lookup", b) / rate("autoregressive", b) for b in (0, 1)]
  assert summary["prompt_lookup"]["speedup"] == pytest.approx(np.median(ratios))
  assert summary["prompt_lookup"]["pairs"] == 2 and summary["prompt_lookup"]["speedup_low"] is None  # < 5 prompts
  accepted = sum(sum(r["accepted_per_row"]) for r in saved["records"] if r["method"] == "prompt_lookup")
  new_tokens = sum(sum(r["new_tokens_per_row"]) for r in saved["records"] if r["method"] == "prompt_lookup")
  assert summary["prompt_lookup"]["draft_share"] == pytest.approx(accepted / new_tokens)
  assert summary["prompt_lookup"]["acceptance_rate"] is not None
  assert set(saved["summary"]["speedup_by_category"]["prompt_lookup"]) == {"qa", "humanities"}
  # 2 batches x 2 repeats x 3 methods, interleaved per batch, the second repeat starting with the second method.
  assert [(r["batch"], r["repeat"], r["method"]) for r in saved["records"]] == [
      (b, k, m) for b in (0, 1) for k in range(2)
      for m in (("autoregressive", run.CONTROL, "prompt_lookup") if k == 0
                else (run.CONTROL, "prompt_lookup", "autoregressive"))]
  assert len(saved["outputs"]) == 6
  assert all(o["matches_baseline"] and 0 < o["new_tokens"] <= 8 for o in saved["outputs"])
  # Slots no round drafted have NaN acceptance, written as null (JSON has no NaN).
  assert report.json_safe(results["summary"]) == saved["summary"]

  table = (tmp_path / "results.md").read_text()
  assert "| method | γ | tokens/s | speedup (paired median, 90% interval) | tokens per forward |" in table
  assert "| autoregressive |" in table and "| prompt_lookup |" in table
  for plot in ("speedup.png", "speedup_by_category.png"):
    assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_line_overrides_reach_the_config():
  argv = ["run", "--config=configs/quickstart.py", "--config.max_new_tokens=16", "--config.only=prompt_lookup",
          "--config.prompts.categories=('qa','math')", "--config.mesh_shape=(2,1)", "--config.temperatures=(0.0,0.7)",
          "--config.gammas=(1,3)", "--config.costs.enabled=False"]
  values = flags.FlagValues()
  config = config_flags.DEFINE_config_file("config", flag_values=values, lock_config=True, sys_argv=argv)
  values(argv)
  assert (config.value.max_new_tokens, config.value.only) == (16, "prompt_lookup")
  assert config.value.prompts.categories == ("qa", "math") and config.value.mesh_shape == (2, 1)
  assert config.value.temperatures == (0.0, 0.7) and config.value.gammas == (1, 3) and not config.value.costs.enabled


@pytest.mark.slow
def test_cli_rejects_an_unknown_config_key(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "experiments.run", "--config=configs/quickstart.py", "--config.max_new_tokns=16",
       f"--workdir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode != 0
  assert "no such field 'max_new_tokns'" in result.stderr
  assert 'Did you mean "max_new_tokens"' in result.stderr
  assert not os.listdir(tmp_path)  # failed before running anything


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--config=configs/does_not_exist.py"], "FATAL --config: no config file 'configs/does_not_exist.py'; "
                                             "configs here: configs/"),
    (["--config=configs/does_not_exist.py", "--config.gamma=3"], "no config file 'configs/does_not_exist.py'"),
    (["--config", "configs/does_not_exist.py"], "no config file 'configs/does_not_exist.py'"),
    (["--config=configs/spec_bench.py:huge"], "FATAL --config: configs/spec_bench.py takes no argument or 'small', "
                                              "got 'huge'"),
], ids=["missing", "missing_with_override", "missing_space_separated", "bad_argument"])
def test_cli_config_that_does_not_load_is_one_line(tmp_path, args, message):
  result = subprocess.run([sys.executable, "-m", "experiments.run", *args, f"--workdir={tmp_path}"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 1
  assert len(result.stderr.strip().splitlines()) == 1, result.stderr
  assert message in result.stderr
  if "configs here" in message:
    assert "configs/quickstart.py, configs/spec_bench.py" in result.stderr
  assert not os.listdir(tmp_path)


# ---------- The runner end to end on the tiny model with a word-level tokenizer (Spec-Bench prompts are text) -----

TINY_METHODS = (
    {"name": "autoregressive"},
    {"name": "prompt_lookup", "drafter": "prompt_lookup"},
    {"name": "exit2", "drafter": "layer_skip", "options": {"exit_layer": 2}},
    {"name": "heads", "drafter": "mtp_parallel", "options": {"path": None, "num_heads": 3}},
    {"name": "unshipped", "drafter": "layer_skip", "options": {"adapter": "default"}, "needs": ("exit_adapter",)},
)


def _tiny_config(**overrides) -> ml_collections.ConfigDict:
  config = compare_drafters.get_config("small")
  config.control = False
  config.update(dict(max_new_tokens=12, methods=TINY_METHODS, warmup=False, gamma=3))  # one verification shape
  config.prompts.categories = ("qa", "humanities")
  config.costs.repeats = 1
  config.update(overrides)
  return config


def test_a_tree_method_is_projected_from_its_modeled_round_though_its_cpu_costs_are_not_measured():
  """A run's tree method (configs/trees.py) gets the accelerator projection of its tree size from the costs file
  (experiments/projection.py), and none from a chain's or another size's."""
  summary = {"methods": {name: {"gamma": 4, "tree_nodes": nodes, "mean_accepted": 3.0, "adaptive": False,
                                "alpha": None}
                         for name, nodes in (("heads_tree16", 16), ("heads_tree32", 32))}}
  compiled = {"heads_tree16": {"gamma": 4, "draft_cost": 0.5, "verify_cost": 2.0, "update_cost": 0.0,
                               "tree_nodes": 16, "source": "f"},
              "heads_tree32": {"gamma": 4, "draft_cost": 0.5, "verify_cost": 2.0, "update_cost": 0.0,
                               "tree_nodes": None, "source": "f"}}  # a chain's costs under a tree's name
  report.add_costs(summary, {"methods": {}}, compiled)
  assert summary["methods"]["heads_tree16"]["projected_speedup"] == pytest.approx(3.0 / (4 * 0.5 + 2.0))
  assert "projected_speedup" not in summary["methods"]["heads_tree32"]


def test_run_reports_costs_prediction_efficiency_and_projection(tiny_chat, tmp_path, monkeypatch):
  config = _tiny_config(repeats=1)
  config.prompts.categories, config.prompts.per_category = ("qa",), 5
  config.costs.repeats = 3  # a tiny model's step is ~1 ms: a median of three keeps the load from flipping a sign
  # The accelerator projection's costs file: the heads at this run's gamma, the exit at another.
  compiled = {"heads": {"gamma": 3, "draft_cost": 0.02, "verify_cost": 1.1, "update_cost": 0.01, "source": "f"},
              "exit2": {"gamma": 4, "draft_cost": 0.5, "verify_cost": 1.0, "update_cost": 0.0, "source": "f"}}
  monkeypatch.setattr(run.projection, "read", lambda: compiled)
  results = run.run(config, str(tmp_path), model=tiny_chat, name="costs")
  with open(tmp_path / "results.json") as f:
    saved = json.load(f)
  summary = saved["summary"]
  methods = summary["methods"]
  assert list(methods) == ["autoregressive", "prompt_lookup", "exit2", "heads"]
  assert summary["skipped_methods"] == {"unshipped": ["exit_adapter.safetensors"]}
  assert summary["all_lossless"] is True and summary["lossless_failures"] == []
  for name in ("prompt_lookup", "exit2", "heads"):
    s = methods[name]
    records = [r for r in saved["records"] if r["method"] == name]
    accepted = sum(sum(r["accepted_per_row"]) for r in records)
    rejections = sum(sum(r["rejections_per_row"]) for r in records)
    assert s["alpha"] == pytest.approx(accepted / (accepted + rejections))  # pooled over calls, not a median
    assert len(s["acceptance_per_position"]) == s["gamma"]
    assert all(a >= b for a, b in zip(s["acceptance_per_position"], s["acceptance_per_position"][1:]))
    assert s["pairs"] == 5 and s["speedup_low"] <= s["speedup"] <= s["speedup_high"]  # 5 prompts
    # Prompt lookup's draft is an n-gram search, ~0 of a target step: timing noise can put it either side of 0.
    assert (math.isfinite(s["draft_cost"]) if name == "prompt_lookup" else s["draft_cost"] > 0)
    assert s["verify_cost"] > 0 and 0 < s["draft_cost_bytes"] and s["verify_cost_bytes"] >= 1
    assert s["predicted_speedup"] == pytest.approx(leviathan.predicted_speedup(
        s["alpha"], s["gamma"], s["draft_cost"], s["verify_cost"]))
    assert s["efficiency"] == pytest.approx(s["speedup"] / s["predicted_speedup"])
    assert s["draft_cost"] == pytest.approx(
        saved["costs"]["draft_seconds"][name] / s["gamma"] / saved["costs"]["target_seconds"]["1"])
  # Bytes per step: two layers of three read less than a target step; prompt lookup reads next to nothing.
  assert methods["prompt_lookup"]["draft_cost_bytes"] < 0.01 < methods["exit2"]["draft_cost_bytes"] < 1
  assert methods["autoregressive"]["alpha"] is None and methods["autoregressive"]["mean_accepted"] == 1
  assert results["summary"]["methods"]["heads"]["gamma"] == 3
  # Projected where the costs file has the method at its gamma: tau / (gamma c + r + u) in compiled decode steps.
  assert methods["heads"]["projected_speedup"] == pytest.approx(
      methods["heads"]["mean_accepted"] / (3 * 0.02 + 1.1 + 0.01))
  assert "projected_speedup" not in methods["exit2"] and "projected_speedup" not in methods["prompt_lookup"]
  costs = saved["costs"]
  assert summary["roofline_fraction"] == pytest.approx(
      costs["target_step_bytes"] / costs["target_seconds"]["1"] / costs["read_bandwidth"])
  assert 0 < summary["roofline_fraction"] < 10  # a tiny model's step is per-call overhead, far from the roofline
  # Five prompts: the smallest sample with a 90% interval (min, max).
  intervals = summary["category_intervals"]
  assert set(intervals) == {"prompt_lookup", "exit2", "heads"}
  for name, per in intervals.items():
    assert set(per) == {"qa"}
    for category, i in per.items():
      ratios = report.paired_speedups([r for r in saved["records"] if r["category"] == category], name,
                                      "autoregressive")
      assert i["pairs"] == 5 and (i["low"], i["median"], i["high"]) == pytest.approx(
          (min(ratios), np.median(ratios), max(ratios)))

  text = (tmp_path / "results.md").read_text()
  assert f"{summary['roofline_fraction']:.0%} of the read bandwidth measured in this run" in text
  assert "LOSSLESS CHECK FAILED" not in text
  assert "**Accelerator projection**" in text and "τ / (γ·c + r + u)" in text and "costs from f)" in text
  assert "| heads | 3 |" in text and "## Acceptance per draft position" in text
  assert "Left out (shipped checkpoint missing): unshipped (exit_adapter.safetensors)" in text
  assert "## Speedup by category" in text and "| qa (5) |" in text
  assert "| above / containing / below 0.95x |" in text
  for plot in ("speedup.png", "speedup_by_category.png", "acceptance_per_position.png", "acceptance_vs_depth.png"):
    assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"({plot})" in text


def test_rerun_with_the_same_seed_reproduces_every_acceptance_figure(tiny_chat, tmp_path):
  # The greedy programs are those of the test above (same shapes), so only the sampling ones compile here.
  config = _tiny_config(temperatures=(0.0, 0.7), only="heads")
  config.prompts.categories = ("qa",)
  config.costs.enabled = False
  figures = ("alpha", "mean_accepted", "acceptance_rate", "acceptance_per_position", "new_tokens")
  runs = [run.run(config, str(tmp_path / str(i)), model=tiny_chat) for i in range(2)]
  first, second = (r["summary"]["by_temperature"] for r in runs)
  assert list(first) == ["0", "0.7"]
  for t in first:
    for method in ("autoregressive", "heads"):
      assert {f: first[t][method][f] for f in figures} == {f: second[t][method][f] for f in figures}
  assert [o["tokens"] for o in runs[0]["outputs"]] == [o["tokens"] for o in runs[1]["outputs"]]
  # Sampling is not greedy: no token check at 0.7, and the main table is the first temperature's.
  assert runs[0]["summary"]["methods"]["heads"]["alpha"] == first["0"]["heads"]["alpha"]
  assert all(o["matches_baseline"] is None for o in runs[0]["outputs"] if o["temperature"] == 0.7)
  assert (tmp_path / "0" / "alpha_by_temperature.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_planted_mismatch_is_reported_loudly(tiny_chat, tmp_path, monkeypatch):
  generate = specjax.generate

  def broken(*args, drafter=None, **kwargs):  # a verifier bug: the drafted method's last token is wrong
    out = generate(*args, drafter=drafter, **kwargs)
    if drafter is not None and drafter.name == "prompt_lookup":
      out.tokens[0][-1] += 1
    return out
  monkeypatch.setattr(specjax, "generate", broken)
  config = _tiny_config(only="prompt_lookup")
  config.costs.enabled = False
  run.run(config, str(tmp_path), model=tiny_chat, name="planted")

  saved = json.loads((tmp_path / "results.json").read_text())
  summary = saved["summary"]
  assert summary["all_lossless"] is False and summary["methods"]["prompt_lookup"]["lossless"] is False
  assert summary["methods"]["autoregressive"]["lossless"] is True
  assert {(f["method"], tuple(f["question_ids"])) for f in summary["lossless_failures"]} == {
      ("prompt_lookup", (q,)) for q in (o["question_id"] for o in saved["outputs"] if o["method"] == "autoregressive")}
  text = (tmp_path / "results.md").read_text()
  assert text.splitlines()[2].startswith("**LOSSLESS CHECK FAILED**: greedy output differs from autoregressive")
  assert "| prompt_lookup |" in text and "| NO |" in text


def test_the_code_digest_follows_the_experiments_modules_a_run_imports(tmp_path, monkeypatch):
  before = cli.code_digest()
  assert cli.code_digest() == before
  module = tmp_path / "extra.py"
  module.write_text("X = 1\n")
  monkeypatch.setitem(sys.modules, "experiments.extra", type(sys)("experiments.extra"))
  sys.modules["experiments.extra"].__file__ = str(module)
  with_extra = cli.code_digest()
  assert with_extra != before
  module.write_text("X = 2\n")
  assert cli.code_digest() not in (before, with_extra)


class _Stopped(Exception):
  """A run killed in the middle."""


def test_a_stopped_run_resumes_where_it_stopped_and_only_with_the_same_config(tiny_chat, tmp_path, monkeypatch):
  config = _tiny_config(only="prompt_lookup")  # two prompt batches (qa, humanities), two methods
  config.costs.enabled = False
  whole = run.run(config, str(tmp_path / "whole"), model=tiny_chat)
  assert whole["resumed_batches"] == 0 and not (tmp_path / "whole" / run.PROGRESS).exists()
  generate, seen, stop = specjax.generate, [], [True]

  def recording(model, prompts, **kwargs):  # stops at the second batch while `stop`
    seen.append(prompts[0])
    if stop[0] and prompts[0] != seen[0]:
      raise _Stopped
    return generate(model, prompts, **kwargs)
  monkeypatch.setattr(specjax, "generate", recording)
  workdir = tmp_path / "stopped"
  with pytest.raises(_Stopped):
    run.run(config, str(workdir), model=tiny_chat)
  log = [json.loads(line) for line in (workdir / run.PROGRESS).read_text().splitlines()]
  assert log[0]["header"]["run"]["code"] == cli.code_digest() and [e["key"] for e in log[1:]] == [
      ["start", 0], ["batch", 1, 0.0, 0]]  # no warmup in this config

  first, stop[0] = seen[0], False
  seen.clear()
  resumed = run.run(config, str(workdir), model=tiny_chat)
  assert resumed["resumed_batches"] == 1 and first not in seen  # the first batch was not decoded again
  assert [s["batches_done"] for s in resumed["starts"]] == [0, 1] and whole["starts"][0]["batches_done"] == 0
  assert [(o["method"], o["question_id"], o["tokens"]) for o in resumed["outputs"]] == [
      (o["method"], o["question_id"], o["tokens"]) for o in whole["outputs"]]
  assert sorted((r["method"], r["batch"]) for r in resumed["records"]) == sorted(
      (r["method"], r["batch"]) for r in whole["records"])
  assert resumed["summary"]["all_lossless"] is True and not (workdir / run.PROGRESS).exists()

  # Stopped again, then started with another config: the old log is moved aside and the run starts afresh.
  seen.clear()
  stop[0] = True
  with pytest.raises(_Stopped):
    run.run(config, str(workdir), model=tiny_chat)
  stop[0] = False
  config.max_new_tokens = 8
  again = run.run(config, str(workdir), model=tiny_chat)
  assert again["resumed_batches"] == 0 and len(list(workdir.glob(run.PROGRESS + ".*.stale"))) == 1


def test_depth_and_gamma_plots_from_a_summary(tmp_path):
  def method(drafter, gamma, alpha, per_position, family=None, **options):
    return {"drafter": drafter, "gamma": gamma, "alpha": alpha, "acceptance_per_position": per_position,
            "family": family, "options": options, "mean_accepted": 1 + sum(per_position), "speedup": 1.0}
  summary = {"baseline": "ar", "methods": {
      "ar": {"drafter": None, "gamma": None, "alpha": None, "acceptance_per_position": None, "family": "ar",
             "options": {}, "mean_accepted": 1.0, "speedup": 1.0},
      "exit8": method("layer_skip", 2, 0.1, [0.1, 0.01], "exit8", exit_layer=8),
      "exit24": method("layer_skip", 2, 0.3, [0.3, 0.1], "exit24", exit_layer=24),
      "heads_g1": method("mtp_parallel", 1, 0.2, [0.2], "heads"),
      "heads_g2": method("mtp_parallel", 2, 0.2, [0.2, 0.05], "heads")}}
  assert not report.plot_alpha_by_temperature(summary, str(tmp_path / "alpha.png"))  # one temperature
  assert not os.path.exists(tmp_path / "alpha.png")
  summary["by_temperature"] = {"0": summary["methods"], "0.7": {**summary["methods"], "exit8": {"alpha": 0.2}}}
  assert report.plot_alpha_by_temperature(summary, str(tmp_path / "alpha.png"))
  assert report.plot_acceptance_vs_depth(summary, str(tmp_path / "depth.png"))
  assert report.plot_mean_accepted_vs_gamma(summary, str(tmp_path / "gamma.png"))
  for plot in ("depth.png", "gamma.png", "alpha.png"):
    assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # a comparison per batch size (the fast tier runs the comparison at one in the tests above)
def test_batch_sizes_run_the_comparison_at_each_and_check_every_one(tiny_chat, tmp_path, monkeypatch):
  config = _tiny_config(batch_sizes=(1, 2), only="exit2")
  config.prompts.categories = ("qa",)
  config.prompts.per_category = 2
  config.costs.enabled = False
  results = run.run(config, str(tmp_path / "clean"), model=tiny_chat)
  summary = results["summary"]
  assert list(summary["by_batch_size"]) == ["1", "2"] and summary["all_lossless"] is True
  assert summary["methods"] == summary["by_batch_size"]["1"]  # the main table is the first batch size's
  for b, rows in (("1", {1}), ("2", {2})):
    speedup = summary["by_batch_size"][b]["exit2"]["speedup"]
    assert speedup > 0 and summary["by_batch_size"][b]["exit2"]["lossless"] is True
    batch_records = [r for r in results["records"] if r["method"] == "exit2" and r["rows"] in rows]
    assert len(batch_records) == (2 if b == "1" else 1)
  text = (tmp_path / "clean" / "results.md").read_text()
  assert "## Speedup by batch size" in text and "batch 2: speedup" in text
  assert (tmp_path / "clean" / "speedup_vs_batch_size.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

  # A mismatch at the second batch size only still fails the run.
  generate = specjax.generate

  def broken_in_batches(model, prompts, *args, drafter=None, **kwargs):
    out = generate(model, prompts, *args, drafter=drafter, **kwargs)
    if drafter is not None and len(prompts) == 2:
      out.tokens[1][-1] += 1
    return out
  monkeypatch.setattr(specjax, "generate", broken_in_batches)
  summary = run.run(config, str(tmp_path / "planted"), model=tiny_chat)["summary"]
  assert summary["all_lossless"] is False
  assert [(f["method"], f["batch_size"]) for f in summary["lossless_failures"]] == [("exit2", 2)]


def test_a_method_that_never_drafted_says_so_instead_of_a_speedup_bar(tmp_path):
  methods = {
      "autoregressive": {"speedup": 1.0, "speedup_low": 1.0, "speedup_high": 1.0, "draft_share": None},
      "exit24": {"speedup": 1.01, "speedup_low": 0.98, "speedup_high": 1.03, "draft_share": 0.0},
      "few": {"speedup": 0.99, "speedup_low": 0.97, "speedup_high": 1.02, "draft_share": 0.04},
      "mtp": {"speedup": 1.23, "speedup_low": 1.2, "speedup_high": 1.25, "draft_share": 0.45},
  }
  assert report.speedup_text(methods["mtp"]) == "1.23x (1.20–1.25)"
  assert report.speedup_text(methods["exit24"]) == "1.01x (0.98–1.03) never drafted"
  assert report.speedup_text(methods["few"]) == "0.99x (0.97–1.02) drafted 4% of tokens"
  captured = {}
  original = report._save
  report._save = lambda fig, path: captured.setdefault("fig", fig)
  try:
    report.plot_speedup({"baseline": "autoregressive", "methods": methods}, str(tmp_path / "speedup.png"))
  finally:
    report._save = original
  ax = captured["fig"].axes[0]
  assert [round(p.get_height(), 2) for p in ax.patches] == [1.0, 1.23]  # bars for the baseline and mtp only
  assert {t.get_text() for t in ax.texts} >= {"never drafted", "drafted 4%\nof tokens"}
