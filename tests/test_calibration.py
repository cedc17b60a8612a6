"""Forward costs calibrated for the model a generation runs (specjax/calibration.py): the plan follows the table it
is given, the cache round-trips and re-measures what it cannot read, its key separates what changes the costs, the
typed table is the fallback, and a run reports the table each method planned with."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os

import jax
import pytest

import specjax
from configs import calibrated_costs
from experiments import report, run, spec_bench
from specjax import calibration
from specjax.adaptive import CPU_FORWARD_COSTS, AdaptiveDrafting, FixedGamma, priced_forward_costs, priced_tokens

PROMPTS = [[3, 7, 1, 9, 4, 2, 8, 5]]
GAMMA, TREE_NODES = 4, 8  # priced tokens per row: 1, 2, 5 (chains), 8 and 9 (trees)
FLAT = ((1, 1.0), (2, 1.0), (5, 1.0), (8, 1.0), (9, 1.0))  # every width costs a step (an accelerator's)
TWO = ((1, 1.0), (2, 1.0), (5, 5.0), (8, 8.0), (9, 9.0))  # 2 tokens cost one step, 5 cost five
STEEP = ((1, 1.0), (2, 3.0), (5, 7.5), (8, 12.0), (9, 13.5))  # every extra token costs more than a step


@pytest.fixture
def calibrating(tmp_path, monkeypatch):
  """Calibration on (SPECJAX_CALIBRATE=1), into a cache of the test's own; returns the cache directory."""
  monkeypatch.setenv("SPECJAX_CALIBRATE", "1")
  monkeypatch.setattr(calibration, "cache_dir", lambda: str(tmp_path / "forward_costs"))
  monkeypatch.setattr(calibration, "_unwritten", {})
  return tmp_path / "forward_costs"


def fake_measure(calls: list):
  """A `calibration.measure` that counts its calls and times a forward over n rows as 1 + (n - 1) / 16 ms."""
  def measure(model, rows, tokens, repeats=calibration.REPEATS):
    calls.append((rows, tuple(tokens)))
    cases = {(1, 1)} | {(rows, t) for t in tokens}
    return {(b, t): 1e-3 * (1 + (b * t - 1) / 16) for b, t in cases}, 0.0, {case: 0.0 for case in cases}
  return measure


def inject(model, points, rows=1, tree_nodes=None):
  """Writes `points` into the cache as the calibration of `model` at `rows` rows for gamma 4 (and trees)."""
  key = calibration.cache_key(model, rows, priced_tokens(GAMMA, tree_nodes))
  points = tuple(p for p in points if p[0] == 1 or p[0] in {rows * t for t in priced_tokens(GAMMA, tree_nodes)})
  assert calibration.write(calibration.cache_path(key), key, points, {})
  return points


def self_draft(target):
  """The target as its own draft (every draft accepted, greedy), its draft steps and following free: the plan then
  turns on the forward costs alone."""
  drafter = specjax.make_drafter("draft_model", target, draft=target)
  return dataclasses.replace(drafter, cost=dataclasses.replace(drafter.cost, step=0.0, plain_step=0.0))


@pytest.mark.slow
def test_injected_tables_move_the_draft_lengths_and_trees_the_predicted_way(tiny, calibrating, monkeypatch):
  """Free drafts every one accepted, so the plan is the forward costs alone: where every width costs a step, every
  round drafts gamma = 4 (a tree where trees may: its prior beats a chain); where 2 tokens cost a step and 5 cost
  five, every round drafts 1; where each extra token costs more than a step, every round is a plain step."""
  monkeypatch.setattr(calibration, "measure", lambda *a, **k: pytest.fail("the injected table was not read"))
  drafter = self_draft(tiny)
  rounds = {}
  for name, table in (("flat", FLAT), ("two", TWO), ("steep", STEEP)):
    points = inject(tiny, table)
    stats = specjax.generate(tiny, PROMPTS, max_new_tokens=24, drafter=drafter, gamma=GAMMA).stats
    assert (stats["forward_costs"], stats["forward_costs_source"]) == ([list(p) for p in points], "cached")
    assert stats["forward_costs_seconds"] == 0.0
    rounds[name] = stats["gamma_histogram"]
    assert sum(rounds[name]) == stats["rounds"]
  assert rounds["flat"] == [0, 0, 0, 0, sum(rounds["flat"])]
  assert rounds["two"] == [0, sum(rounds["two"]), 0, 0, 0]
  assert rounds["steep"] == [sum(rounds["steep"]), 0, 0, 0, 0]
  assert sum(rounds["flat"]) < sum(rounds["two"]) < sum(rounds["steep"])
  trees = {}
  for name, table in (("flat", FLAT), ("steep", STEEP)):
    inject(tiny, table, tree_nodes=TREE_NODES)
    stats = specjax.generate(tiny, PROMPTS, max_new_tokens=24, drafter=drafter, gamma=GAMMA,
                             tree_nodes=TREE_NODES).stats
    assert stats["forward_costs_source"] == "cached" and len(stats["forward_costs"]) == 5
    trees[name] = (stats["tree_rounds"], stats["plain_steps"], stats["rounds"])
  assert trees["flat"][0] > 0 and trees["flat"][1] == 0
  assert trees["steep"][0] == 0 and trees["steep"][1] == trees["steep"][2]


def test_the_cache_round_trips_and_a_corrupt_file_is_measured_again(tiny, calibrating, monkeypatch):
  first = calibration.forward_costs(tiny, 1, (1, 2, 5), repeats=1)  # measured on the tiny model
  assert first.source == "calibrated" and [n for n, _ in first.points] == [1, 2, 5]
  assert first.points[0] == (1, 1.0) and all(f >= 1.0 for _, f in first.points)
  assert first.seconds["compile"] > 0 and first.seconds["timing"] > 0
  assert os.listdir(calibrating) == [os.path.basename(first.path)]  # no temporary file left
  with open(first.path) as f:
    record = json.load(f)
  assert record["key"] == json.loads(json.dumps(calibration.cache_key(tiny, 1, (1, 2, 5))))
  assert set(record["seconds_per_forward"]) == set(record["noise"]) == {"1x1", "1x2", "1x5"}
  calls = []
  monkeypatch.setattr(calibration, "measure", fake_measure(calls))
  again = calibration.forward_costs(tiny, 1, (5, 2, 1))
  assert (again.source, again.points, again.path, calls) == ("cached", first.points, first.path, [])
  for corrupt in ("{not json", json.dumps({**record, "key": {**record["key"], "rows": 2}}),
                  json.dumps({**record, "points": [[1, 1.0]]}), json.dumps({**record, "points": [[1, 1.0], [2, 0.5]]}),
                  json.dumps({"points": record["points"]}), ""):
    with open(first.path, "w") as f:
      f.write(corrupt)
    measured = calibration.forward_costs(tiny, 1, (1, 2, 5))
    assert measured.source == "calibrated" and measured.points == ((1, 1.0), (2, 1.062), (5, 1.25))
    assert calibration.forward_costs(tiny, 1, (1, 2, 5)).source == "cached"  # rewritten, readable again
  assert len(calls) == 6 and os.listdir(calibrating) == [os.path.basename(first.path)]


def test_an_unwritable_cache_still_plans_with_the_measured_table(tiny, calibrating, monkeypatch, tmp_path):
  blocked = tmp_path / "a_file"
  blocked.write_text("")
  monkeypatch.setattr(calibration, "cache_dir", lambda: str(blocked / "forward_costs"))
  calls = []
  monkeypatch.setattr(calibration, "measure", fake_measure(calls))
  first = calibration.forward_costs(tiny, 2, (1, 2))
  assert first.source == "calibrated" and first.points == ((1, 1.0), (2, 1.062), (4, 1.188))
  assert calibration.forward_costs(tiny, 2, (1, 2)) == dataclasses.replace(first, source="cached", seconds={})
  assert len(calls) == 1


def test_the_key_separates_models_dtypes_rows_tokens_and_hosts(tiny, monkeypatch):
  def path(model=tiny, rows=1, tokens=(1, 2, 5)):
    return calibration.cache_path(calibration.cache_key(model, rows, tokens))
  bfloat16 = dataclasses.replace(tiny, config=tiny.config.replace(dtype="bfloat16"))
  deeper = dataclasses.replace(tiny, config=tiny.config.replace(num_layers=3))
  paths = [path(), path(bfloat16), path(deeper), path(rows=4), path(tokens=(1, 2, 5, 8, 17))]
  assert len(set(paths)) == len(paths) and path() == path(tokens=[5, 2, 1]) == path(tokens=(2, 5))
  assert calibration.cache_key(bfloat16, 1, (1, 2))["dtype"] == "bfloat16"
  host = calibration.host_key()
  assert host["backend"] == jax.default_backend() and host["jax"] == jax.__version__ and host["cores"] >= 1
  for field, value in (("cpu", {**host["cpu"], "flags": "avx512_vnni amx_tile"}), ("jaxlib", "0.0.1"),
                       ("cores", host["cores"] + 14)):
    monkeypatch.setattr(calibration, "host_key", lambda field=field, value=value: {**host, field: value})
    assert path() not in paths


def test_the_key_separates_a_quantized_model_from_the_float32_one_of_its_config(tmp_path):
  """The same GGUF loaded with its quantized blocks and dequantized to float32: one config, other weights, other
  keys (a quantized step reads other bytes with other kernels); each key the same when loaded again."""
  from tests.test_quantized import write_quantized_gguf
  path = write_quantized_gguf(tmp_path / "tiny.gguf")

  def load(quantized):
    if not quantized:
      return specjax.load(path)
    with pytest.warns(UserWarning, match="dequantized to float32"):
      return specjax.load(path, quantized=True)

  def key(model):
    return calibration.cache_key(model, 1, (1, 2, 5))
  quantized, dense = load(True), load(False)
  assert quantized.config == dense.config
  assert key(quantized)["weights"] != key(dense)["weights"]
  assert {k: v for k, v in key(quantized).items() if k != "weights"} == {k: v for k, v in key(dense).items()
                                                                         if k != "weights"}
  assert calibration.cache_path(key(quantized)) != calibration.cache_path(key(dense))
  assert key(load(True)) == key(quantized) and key(load(False)) == key(dense)  # stable
  # Another kind of block in one matrix is another key; so is a float32 array of another dtype.
  layer = quantized.params["layers"][1]
  requantized = dict(quantized.params, layers=[quantized.params["layers"][0], {**layer, "w_up": layer["w_up"].replace(
      kind="Q4_0")}])
  assert calibration.weights_key(requantized) != calibration.weights_key(quantized.params)
  halved = jax.tree.map(lambda x: x.astype("bfloat16"), dense.params)
  assert calibration.weights_key(halved) != calibration.weights_key(dense.params)


def test_table_reads_seconds_per_forward_as_costs_over_one_row():
  times = {(1, 1): 0.010, (4, 1): 0.012, (4, 2): 0.020, (4, 5): 0.009, (1, 8): 0.5, (8, 1): 0.011}
  assert calibration.table({k: v for k, v in times.items() if k[0] != 8 and k != (1, 8)}, rows=4) == (
      (1, 1.0), (4, 1.2), (8, 2.0), (20, 1.0))  # a ratio below 1 is noise: 1
  assert calibration.table({k: times[k] for k in ((1, 1), (1, 8), (8, 1))}, rows=8) == ((1, 1.0), (8, 1.1))
  # What a plan at 4 rows, gamma 4, trees of 16 nodes reads of a table: f at 4 x (1, 2, 5, 8, 17), interpolated,
  # and never above a later point (f(4) 1.12 reads as f(5) 1.09).
  assert priced_forward_costs(CPU_FORWARD_COSTS, 4, 4, 16) == ((1, 1.0), (4, 1.09), (8, 1.27), (20, 2.22),
                                                               (32, 3.05), (68, 6.17))
  assert priced_forward_costs(((1, 1.0), (10, 2.0)), 1, 2) == ((1, 1.0), (2, 1.111), (3, 1.222))


def test_a_busy_machine_brings_more_rounds_and_the_median_of_each_rounds_ratio(monkeypatch):
  """Interleaved rounds of (t(long) - t(short)) / (long - short): 5 when every case's rounds agree, up to 9 while one
  moves by more than NOISY; f is the median of each round's ratio to the 1-row forward's."""
  monkeypatch.setattr(calibration, "_timed", lambda run, calls: run(calls))  # a run returns its own time
  loads = itertools.cycle([1.0, 1.5, 2.0, 1.25, 1.75, 1.1])

  def steady(calls):
    return 0.01 * calls

  def busy(calls):
    return 0.02 * calls * next(loads)
  assert {k: len(r) for k, r in calibration.interleaved_seconds({"a": steady, "b": steady}, 5).items()} == {
      "a": 5, "b": 5}
  rounds = calibration.interleaved_seconds({"a": steady, "b": busy}, 5)
  assert len(rounds["a"]) == len(rounds["b"]) == 9 and calibration.noise(rounds["b"]) > calibration.NOISY
  assert rounds["a"] == [pytest.approx(0.01)] * 9 and calibration.noise(rounds["a"]) == pytest.approx(0.0)


def test_the_typed_table_is_the_fallback_and_an_explicit_table_wins(tiny, calibrating, monkeypatch):
  def resolve(policy=AdaptiveDrafting(), **kwargs):
    return calibration.for_generation(policy, tiny, **{"rows": 1, "gamma": GAMMA, "tree_nodes": None, **kwargs})
  calls = []
  monkeypatch.setattr(calibration, "measure", fake_measure(calls))
  typed = calibration.Calibration(CPU_FORWARD_COSTS, "typed table")
  assert resolve().source == "calibrated" and calls == [(1, (1, 2, 5))]
  assert resolve(tree_nodes=16).points[-2:] == ((8, 1.438), (17, 2.0)) and calls[-1] == (1, (1, 2, 5, 8, 17))
  assert resolve(AdaptiveDrafting(forward_costs=FLAT)) == calibration.Calibration(FLAT, "typed table")
  assert resolve(AdaptiveDrafting(forward_costs="typed")) == typed
  assert resolve(mesh=object()) == typed  # a mesh plans with the typed table
  assert resolve(FixedGamma()) is None
  monkeypatch.setenv("SPECJAX_CALIBRATE", "0")
  assert resolve() == typed
  monkeypatch.setenv("SPECJAX_CALIBRATE", "sometimes")
  with pytest.raises(ValueError, match="SPECJAX_CALIBRATE"):
    resolve()
  monkeypatch.setenv("SPECJAX_CALIBRATE", "1")

  def broken(*args, **kwargs):
    raise RuntimeError("no timer")
  monkeypatch.setattr(calibration, "measure", broken)
  assert resolve(rows=3) == typed  # logged, and planned with the typed table
  with pytest.raises(ValueError, match="forward_costs"):
    AdaptiveDrafting(forward_costs="measured")
  # What generate reports: the explicit table, and no table for a fixed gamma.
  drafter = self_draft(tiny)
  stats = specjax.generate(tiny, PROMPTS, max_new_tokens=8, drafter=drafter, gamma=GAMMA,
                           adaptive=AdaptiveDrafting(forward_costs=FLAT[:3])).stats
  assert (stats["forward_costs"], stats["forward_costs_source"]) == ([list(p) for p in FLAT[:3]], "typed table")
  assert "forward_costs" not in specjax.generate(tiny, PROMPTS, max_new_tokens=8, drafter=drafter, gamma=GAMMA,
                                                 adaptive=False).stats


def test_the_calibrated_costs_config_pairs_each_drafter_calibrated_and_typed():
  questions = spec_bench.load_questions()
  for arg, model, chat, prompts in (("smollm2", "smollm2-135m", True, 13), ("gemma3", "gemma3-270m", False, 13),
                                    ("gemma3,small", "gemma3-270m", False, 3)):
    config = calibrated_costs.get_config(arg)
    assert (config.model, config.chat) == (model, chat)
    assert len(spec_bench.select(questions, **config.prompts.to_dict())) == prompts
    names = [m["name"] for m in run.check_methods(config)]
    assert names == ["autoregressive", run.CONTROL] + [m["name"] for m in config.methods[1:]]
    calibrated = [n for n in names if n.endswith("_calibrated")]
    assert calibrated and [report.calibrated_pair(n, names) for n in calibrated] == [
        n.replace("_calibrated", "_typed") for n in calibrated]
    assert len(names) == 2 + 2 * len(calibrated)
    assert config.methods[0]["name"] == "autoregressive"
    for method in config.methods[1:]:
      assert method["adaptive"] == ({} if method["name"].endswith("_calibrated") else {"forward_costs": "typed"})
  assert tuple(calibrated_costs.get_config("smollm2,batch4").batch_sizes) == (1, 4)
  for bad in (None, "small", "smollm2,gemma3", "llama"):
    with pytest.raises(ValueError, match="calibrated_costs"):
      calibrated_costs.get_config(bad)


@pytest.mark.slow
def test_a_run_reports_the_forward_costs_each_method_planned_with(tiny_chat, calibrating, tmp_path):
  config = calibrated_costs.get_config("smollm2,small")
  config.methods = tuple(m for m in config.methods if m["name"] in ("autoregressive", "prompt_lookup_calibrated",
                                                                     "prompt_lookup_typed"))
  config.prompts.categories = ("qa", "humanities")
  config.max_new_tokens = 8
  results = run.run(config, str(tmp_path / "run"), model=tiny_chat, name="calibrated")
  (path,) = [os.path.join(calibrating, f) for f in os.listdir(calibrating)]  # the warmup calibrated it
  with open(path) as f:
    points = json.load(f)["points"]
  records = {m: [r for r in results["records"] if r["method"] == m] for m in ("prompt_lookup_calibrated",
                                                                             "prompt_lookup_typed")}
  assert [(r["forward_costs"], r["forward_costs_source"]) for r in records["prompt_lookup_calibrated"]] == [
      (points, "cached")] * 2
  assert [(r["forward_costs"], r["forward_costs_source"]) for r in records["prompt_lookup_typed"]] == [
      ([[1, 1.0], [2, 1.09], [5, 1.09]], "typed table")] * 2  # CPU_FORWARD_COSTS as the plan reads it
  methods = results["summary"]["methods"]
  assert methods["prompt_lookup_calibrated"]["forward_costs"] == [{"points": points, "calls": 2,
                                                                   "sources": {"cached": 2}}]
  over = methods["prompt_lookup_calibrated"]["over_typed"]
  assert over["method"] == "prompt_lookup_typed" and over["pairs"] == 2 and over["speedup"] > 0
  assert "over_typed" not in methods["prompt_lookup_typed"] and methods["autoregressive"]["forward_costs"] is None
  with open(tmp_path / "run" / "results.md") as f:
    text = f.read()
  section = text.split("## Forward costs")[1]
  assert "| prompt_lookup_calibrated | f(2)" in section and "(cached: 2)" in section
  assert "| prompt_lookup_typed | f(2) 1.09, f(5) 1.09 (typed table: 2) |" in section


@pytest.mark.slow
def test_calibration_measures_that_more_rows_cost_more(smollm2, calibrating):
  """SmolLM2's forward over 17 rows (17 tokens of one row; 17 rows of one token) and over 65 does several times the
  work of one row's: benchmarks/bench_verify.py measured 2.0x and 5.9x (one row) on a quiet machine. The bounds leave
  room for a loaded one, where the points scatter by about 0.2."""
  by_tokens = calibration.forward_costs(smollm2, 1, (1, 17, 65))
  by_rows = calibration.forward_costs(smollm2, 17, (1,))
  assert by_tokens.source == by_rows.source == "calibrated"
  f = dict(by_tokens.points)
  assert f[65] > 2.5 and f[65] > f[17] > 1.2 and dict(by_rows.points)[17] > 1.2
