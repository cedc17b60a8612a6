"""Training on one budget of answer positions (configs/train_budget.py): the positions a run sees are counted from
its batches, evaluation points are log-spaced in positions, a killed run keeps its evaluation points, and the curves
command reads runs' metrics into one table and plot."""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest

import specjax
from configs import train_budget
from experiments import curves, train
from specjax import export
from specjax import train_drafter as td
from specjax.data.features import build_feature_cache

SEQ_LEN = 24


@pytest.fixture(scope="module")
def caches(tiny, tmp_path_factory):
  """Train and held-out caches of `tiny` with every layer's features; answers of varied lengths."""
  root = tmp_path_factory.mktemp("budget")
  rng = np.random.default_rng(0)
  out = {}
  for split, n in (("train", 24), ("held_out", 8)):
    seqs = [(rng.integers(0, tiny.config.vocab_size, size=SEQ_LEN).astype(np.int32),
             np.arange(SEQ_LEN) >= rng.integers(4, 20)) for _ in range(n)]
    out[split] = build_feature_cache(tiny, seqs, str(root / "data" / split), seq_len=SEQ_LEN,
                                     feature_layers=tuple(range(tiny.config.num_layers)), top_k=4, batch_size=8)
  return out, root


def test_positions_seen_are_the_masked_positions_of_each_steps_batch(caches):
  cache = caches[0]["train"]
  seen = td.positions_seen(cache, len(cache), batch_size=4, seed=3, steps=6)
  per_step = [td._batch(cache, td.batch_indices(len(cache), 4, 3, step), [0])["mask"].sum() for step in range(6)]
  np.testing.assert_array_equal(seen, np.cumsum(per_step))
  steps = td.steps_for_positions(cache, len(cache), 4, 3, positions=int(seen[3]) - 1)
  assert steps == 4  # the fewest steps holding the positions asked for
  assert td.steps_for_positions(cache, len(cache), 4, 3, positions=int(seen[3])) == 4
  assert td.steps_for_positions(cache, len(cache), 4, 3, positions=int(seen[3]) + 1) == 5


def test_pool_holds_the_positions_asked_for_and_too_few_is_a_clear_error(caches):
  cache = caches[0]["train"]
  held = np.cumsum(td.answer_positions(cache))
  n = td.pool_sequences(cache, int(held[9]))
  assert n == 10 and td.pool_sequences(cache, int(held[9]) + 1) == 11 and td.pool_sequences(cache, 0) == len(cache)
  assert all(td.batch_indices(n, 4, 0, step).max() < n for step in range(20))
  with pytest.raises(ValueError, match="holds .* answer positions, fewer than the pool"):
    td.pool_sequences(cache, int(held[-1]) + 1)


def test_evaluation_points_are_log_spaced_in_positions(caches):
  cache = caches[0]["train"]
  steps = td.steps_for_positions(cache, len(cache), 2, 0, positions=4000)
  seen = td.positions_seen(cache, len(cache), 2, 0, steps)
  fractions = [2.0 ** -i for i in range(6, -1, -1)]
  eval_steps = td.steps_at_fractions(seen, fractions)
  assert len(eval_steps) == 7 and eval_steps[-1] == steps
  for step, fraction in zip(eval_steps, fractions):
    assert seen[step - 1] >= fraction * seen[-1] and (step == 1 or seen[step - 2] < fraction * seen[-1])
  ratios = np.diff(np.log2(seen[np.array(eval_steps) - 1]))
  assert np.all(np.abs(ratios - 1.0) < 0.2)  # each point sees about twice the positions of the one before


def test_killed_run_resumes_keeping_its_evaluation_points(tiny, caches, tmp_path, monkeypatch):
  """Killed after its second evaluation, a run restarted with the same arguments neither repeats nor loses an
  evaluation; every record counts the positions of the steps before it, and the clocks only move forward."""
  cache, held_out = caches[0]["train"], caches[0]["held_out"]
  evaluated = []

  def run():
    fresh = specjax.make_drafter("mtp_parallel", tiny, path=None, num_heads=2)
    return td.train_drafter(tiny, fresh, cache, held_out, workdir=str(tmp_path), steps=12, batch_size=4,
                            warmup_steps=2, log_every=1, eval_steps=(1, 2, 4, 8), save_every=5, eval_sequences=4,
                            evaluate_drafter=lambda drafter: evaluated.append(1) or {"evaluations": len(evaluated)},
                            progress=False)

  real_batch, calls = td._batch, []

  def dies_at_step_7(cache_, indices, layers):
    if cache_ is cache:
      calls.append(1)
      if len(calls) == 1 + 7:  # one batch to compile the step with, then steps 1..6; the 7th dies
        raise KeyboardInterrupt("killed")
    return real_batch(cache_, indices, layers)
  monkeypatch.setattr(td, "_batch", dies_at_step_7)
  with pytest.raises(KeyboardInterrupt):
    run()
  assert len(evaluated) == 3  # steps 1, 2 and 4
  monkeypatch.setattr(td, "_batch", real_batch)
  result = run()
  records = td.read_metrics(str(tmp_path / "metrics.jsonl"))
  assert [r["step"] for r in records] == list(range(1, 13))  # steps 6 (past the step-5 checkpoint) replayed once
  assert [r["step"] for r in records if "eval_top1_1" in r] == [1, 2, 4, 8, 12]
  assert [r["evaluations"] for r in records if "evaluations" in r] == [1, 2, 3, 4, 5]  # none repeated
  seen = td.positions_seen(cache, len(cache), 4, 0, 12)
  assert [r["positions"] for r in records] == seen.tolist() and result.positions == seen[-1]
  for key in ("train_seconds", "train_cpu_seconds", "flops"):
    assert np.all(np.diff([r[key] for r in records]) >= 0), key
  assert result.flops_per_step > 0 and result.flops_per_position == pytest.approx(
      result.flops_per_step * 12 / seen[-1])
  assert result.final_eval == {k: v for k, v in records[-1].items()
                               if k.startswith("eval_") and k not in ("eval_seconds", "eval_cpu_seconds")}


def test_budget_config_names_its_families_and_one_budget_for_all():
  with pytest.raises(ValueError, match=r"one family of \('parallel', 'sequential', 'deepseek', 'exit', 'exit16', 'exit10', 'draft', 'block'\)"):
    train_budget.get_config("medusa")
  with pytest.raises(ValueError, match="one family of"):
    train_budget.get_config("parallel,sequential")
  with pytest.raises(ValueError, match="one family of"):
    train_budget.get_config("sharegpt")
  configs = [train_budget.get_config(f) for f in train_budget.FAMILIES if f != "exit10"] + [
      train_budget.get_config("sequential,sharegpt")]
  shared = ("positions", "pool_positions", "held_out_dir", "eval_fractions", "batch_size", "seed", "draft_vocab")
  for field in shared:
    assert len({str(c[field]) for c in configs}) == 1, field
  assert len({c.workdir for c in configs}) == len(configs)
  assert configs[-1].data_answers == "sharegpt" and configs[1].data_answers == "regenerated"
  assert configs[-1].data_dir != configs[1].data_dir and configs[-1].options == configs[1].options
  assert len(configs[0].eval_fractions) >= 5
  for exit in ("exit", "exit16"):  # a layer the regenerated cache holds
    assert train_budget.get_config(exit).options.exit_layer - 1 in (2, 15)
  with pytest.raises(ValueError, match="exit10 exits after layer 9, which smollm2-135m's cache does not hold"):
    train_budget.get_config("exit10")
  assert all(c.model == "smollm2-135m" and c.draft_vocab == 8192 and not c.draft_vocab_record for c in configs)
  # A second seed: the same run but for its seed, in a workdir of its own.
  default, seed2 = (train_budget.get_config(a) for a in ("sequential", "sequential,seed2"))
  assert (default.seed, seed2.seed) == (0, 1) and seed2.workdir == default.workdir + "-seed2"
  assert {k: v for k, v in seed2.items() if k not in ("seed", "workdir")} == {
      k: v for k, v in default.items() if k not in ("seed", "workdir")}


def test_gemma3_budget_trains_every_family_on_gemma3s_cache_at_smollm2s_budget():
  """`gemma3` with any family (and lk/ce, small): Gemma-3-270M, its regenerated cache and held-out split, runs of its
  own, the draft vocabulary of its record, SmolLM2's positions, pool and evaluation points; each family's layers are
  ones its cache holds."""
  from configs import train_data
  from experiments import draft_vocab
  from specjax.config import ModelConfig
  from specjax.drafters import block, draft_model, mtp_sequential
  data = train_data.get_config("regenerate,gemma3")
  cache_layers = tuple(data.feature_layers)
  assert train_budget.TARGETS["gemma3"]["feature_layers"] == cache_layers
  assert train_budget.TARGETS["smollm2"]["feature_layers"] == tuple(train_data.get_config("regenerate").feature_layers)
  assert train_budget.REGENERATED == train_data.get_config("regenerate").workdir
  shared = ("positions", "pool_positions", "eval_fractions", "batch_size", "seed", "learning_rate", "options",
            "drafter", "warmup_steps", "spec_bench")
  gemma_families = [f for f in train_budget.FAMILIES]
  for family in gemma_families:
    config = train_budget.get_config(f"{family},gemma3")
    assert config.model == "gemma3-270m" and config.workdir == f"workdirs/budget-gemma3/{family}"
    assert config.data_dir == data.workdir and config.held_out_dir == f"{data.workdir}/held_out"
    assert config.data_answers == "regenerated"
    assert config.draft_vocab_record == draft_vocab.record_path("gemma3-270m") and config.draft_vocab == 0
    if family != "exit10":
      smollm2 = train_budget.get_config(family)
      assert {k: str(config[k]) for k in shared} == {k: str(smollm2[k]) for k in shared}
    if "exit_layer" in config.options:
      assert config.options.exit_layer - 1 in cache_layers
  # The layers each family reads on an 18-layer target: all in the cache.
  gemma = ModelConfig(vocab_size=64, hidden_size=8, intermediate_size=16, num_layers=18, num_heads=1, num_kv_heads=1,
                      head_dim=8)
  assert set(block.default_feature_layers(gemma)) <= set(cache_layers)
  assert set(mtp_sequential.default_feature_layers(gemma, eagle3=True)) <= set(cache_layers)
  assert mtp_sequential.default_feature_layers(gemma, eagle3=False) == (17,)
  assert draft_model.evenly_spaced_layers(18, train_budget.FAMILIES["draft"]["options"]["num_layers"]) == (0, 6, 11, 17)
  seed2 = train_budget.get_config("exit10,gemma3,seed2")
  assert seed2.seed == 1 and seed2.workdir == "workdirs/budget-gemma3/exit10-seed2"
  small = train_budget.get_config("block,gemma3,small")
  assert small.data_dir == train_data.get_config("regenerate,gemma3,small").workdir
  assert small.workdir == "workdirs/budget-gemma3/block-small" and small.draft_vocab == 8192
  with pytest.raises(ValueError, match="gemma3-270m is a base model"):
    train_budget.get_config("sequential,sharegpt,gemma3")


def test_budget_run_trains_to_its_positions_and_the_card_shows_the_curve(tiny, caches, tmp_path, monkeypatch):
  (cache_set, root) = caches
  model_dir = export.save_hf(tiny, str(tmp_path / "model"))
  config = train_budget.get_config("parallel,small")
  config.model, config.data_dir, config.held_out_dir = model_dir, str(root / "data"), str(root / "data" / "held_out")
  config.batch_size, config.positions, config.pool_positions = 4, 400, 200
  config.spec_bench.enabled, config.options.num_heads, config.workdir = False, 2, str(tmp_path / "run")
  with pytest.raises(ValueError, match="trains on regenerated answers, but the cache .* holds ShareGPT's own"):
    train.run(config, "test")
  config.data_answers = "sharegpt"  # the tiny caches record no regeneration
  # The draft vocabulary from a record (experiments/draft_vocab.py), as Gemma-3-270M's runs take theirs.
  config.draft_vocab_record = str(tmp_path / "draft_vocab.json")
  with pytest.raises(FileNotFoundError, match=re.escape(f"python -m experiments.draft_vocab --model={model_dir}")):
    train.run(config, "test")
  (tmp_path / "draft_vocab.json").write_text(json.dumps({
      "model": model_dir, "vocab_size": 32, "draft_vocab": 16, "train_cache": {"path": "", "token_counts_sha256": ""}}))
  # A run stopped at an evaluation point (stop_fraction) is the full run's first part: the full budget's schedule, no
  # card or export yet; the same command without it goes on from its checkpoint.
  config.stop_fraction = 0.3
  with pytest.raises(ValueError, match=r"stop_fraction must be one of eval_fractions \(0.25, 0.5, 1.0\)"):
    train.run(config, "test")
  config.stop_fraction = 0.5
  stopped = train.run(config, "python -m experiments.train (stopped)")
  assert stopped["stopped"] and not os.path.exists(os.path.join(config.workdir, "run.json"))
  assert not os.path.exists(os.path.join(config.workdir, "mtp_parallel.safetensors"))
  config.stop_fraction = 0.0
  card = train.run(config, "python -m experiments.train (test)")
  with open(os.path.join(config.workdir, "starts.jsonl")) as f:
    starts = [json.loads(line) for line in f]
  assert [s["command"] for s in starts] == ["python -m experiments.train (stopped)",
                                            "python -m experiments.train (test)"]
  assert starts[0]["config"]["positions"] == config.positions
  pool = td.pool_sequences(cache_set["train"], 200)
  seen = td.positions_seen(cache_set["train"], pool, 4, 0, card["steps"])
  half = td.steps_at_fractions(seen, (.5,))[0]
  assert 1 < stopped["steps"] == half < card["steps"] and stopped["positions"] == seen[half - 1]
  assert seen[-1] >= 400 > seen[-2] and card["positions"] == seen[-1] and card["pool_sequences"] == pool
  assert card["options"]["draft_vocab"] == 16
  assert [p["positions"] for p in card["curve"]] == [seen[s - 1] for s in td.steps_at_fractions(seen, (.25, .5, 1))]
  with open(os.path.join(config.workdir, "mtp_parallel.md")) as f:
    text = f.read()
  assert f"answer positions seen: {seen[-1]:,}" in text and "## Curve" in text
  assert "built from mtp_parallel.ranks.json beside this file" in text and "started from" not in text
  # Continued training (--config.options.path): starts from the run's checkpoint, and its card says so.
  continued = train_budget.get_config("parallel,small")
  continued.update({k: config[k] for k in ("model", "data_dir", "held_out_dir", "draft_vocab", "draft_vocab_record",
                                           "batch_size", "positions", "pool_positions", "data_answers")})
  continued.spec_bench.enabled, continued.workdir = False, str(tmp_path / "continued")
  continued.options.path = os.path.join(config.workdir, "mtp_parallel.safetensors")
  again = train.run(continued, "python -m experiments.train (continued)")
  def first_eval_loss(workdir):
    return next(r["eval_loss"] for r in td.read_metrics(os.path.join(workdir, "metrics.jsonl")) if "eval_loss" in r)
  assert first_eval_loss(continued.workdir) < first_eval_loss(config.workdir)  # a head start over fresh heads
  assert again["steps"] == card["steps"]
  with open(os.path.join(continued.workdir, "mtp_parallel.md")) as f:
    assert f"started from the trained checkpoint `{continued.options.path}`" in f.read()
  # Shipping it: the checkpoint, its rank accuracy and a card recording the comparison replace the shipped files.
  from experiments import compare_checkpoints
  shipped = tmp_path / "shipped"
  shipped.mkdir()
  (shipped / "mtp_parallel.safetensors").write_bytes(b"the checkpoint shipped before")
  monkeypatch.setattr(compare_checkpoints.draft_head, "shipped_checkpoint",
                      lambda model, name: str(shipped / f"{name}.safetensors"))
  comparison = {"prompts": 3, "gamma": 2, "max_new_tokens": 6, "candidate": {"mean_accepted": 1.5},
                "shipped": {"mean_accepted": 1.25}, "prompts_candidate_better": 2, "prompts_shipped_better": 1,
                "replace": True}
  candidate = os.path.join(config.workdir, "mtp_parallel.safetensors")
  written = compare_checkpoints.ship(tiny, "mtp_parallel", candidate, comparison)
  assert sorted(os.path.basename(w) for w in written) == ["mtp_parallel.md", "mtp_parallel.ranks.json",
                                                           "mtp_parallel.safetensors"]
  with open(candidate, "rb") as a, open(shipped / "mtp_parallel.safetensors", "rb") as b:
    assert a.read() == b.read()
  card_text = (shipped / "mtp_parallel.md").read_text()
  shipped_load = ', or `path="default"` for the copy shipped inside specjax'
  assert shipped_load in card_text and shipped_load not in text  # only the shipped copy loads by that name
  assert card_text.replace(shipped_load, "").startswith(text.rstrip("\n"))
  assert "1.50 tokens per target forward against 1.25" in card_text
  assert sorted(p.name for p in shipped.iterdir()) == ["mtp_parallel.md", "mtp_parallel.ranks.json",
                                                       "mtp_parallel.safetensors"]  # no temporary file left


def synthetic_run(workdir, family, positions, top1, accepted, alpha=None, finished=True):
  os.makedirs(workdir)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    for i, (p, t, a) in enumerate(zip(positions, top1, accepted)):
      f.write(json.dumps({"step": i + 1, "positions": p, "flops": 2e9 * p, "train_seconds": p / 100.0,
                          "train_cpu_seconds": p / 50.0, "eval_top1_1": t, "eval_top1_2": t / 2,
                          "spec_bench_mean_accepted": a, "spec_bench_alpha": alpha or a - 1}) + "\n")
  if finished:
    with open(os.path.join(workdir, "run.json"), "w") as f:
      json.dump({"drafter": family, "config": {"family": family, "data_answers": "regenerated",
                                               "positions": positions[-1]}}, f)


def test_curves_table_plot_and_extrapolation_from_runs_metrics(tmp_path):
  positions = [1000, 10000, 100000]
  synthetic_run(tmp_path / "runs" / "sequential", "sequential", positions, [0.3, 0.4, 0.5], [1.4, 1.6, 1.8])
  synthetic_run(tmp_path / "runs" / "parallel", "parallel", positions, [0.2, 0.3, 0.35], [1.5, 1.7, 1.6])
  synthetic_run(tmp_path / "runs" / "exit", "exit", positions, [0.2, 0.2, 0.2], [1.2, 1.2, 1.2], alpha=0.2,
                finished=False)
  # A run ended at a point of its budget (`stop_fraction`) says so, where one still training says it is running.
  synthetic_run(tmp_path / "runs" / "sequential-lk", "sequential", positions[:2], [0.3, 0.45], [1.4, 1.5],
                finished=False)
  (tmp_path / "runs" / "sequential-lk" / "starts.jsonl").write_text(json.dumps(
      {"date": "2026-12-07 12:00 UTC", "commit": "abc", "command": "train", "config": {
          "family": "sequential", "objective": "lk", "data_answers": "regenerated", "positions": 200000,
          "stop_fraction": 0.5}}) + "\n" + json.dumps(
      {"date": "2026-12-07 13:00 UTC", "commit": "def-dirty", "uncommitted": ["docs/training.md"], "command": "train",
       "config": {"family": "sequential", "objective": "lk", "data_answers": "regenerated", "positions": 200000,
                  "stop_fraction": 0.5}}) + "\n")
  comparison = {"prompts": 48, "gamma": 4, "max_new_tokens": 64, "candidate": {"mean_accepted": 1.74, "score": 1.37},
                "shipped": {"mean_accepted": 1.88, "score": 1.49}, "prompts_candidate_better": 10,
                "prompts_shipped_better": 34, "replace": False}
  (tmp_path / "runs" / "sequential" / curves.SHIPPED_COMPARISON).write_text(json.dumps(comparison))
  # A family with no shipped checkpoint of its own, measured against another family's (--against).
  (tmp_path / "runs" / "exit" / curves.SHIPPED_COMPARISON).write_text(json.dumps(
      {**comparison, "against": "mtp_sequential", "replace": True}))
  results = curves.curves([str(tmp_path / "runs")], str(tmp_path / "out"))
  runs = {r["name"]: r for r in results["runs"]}
  assert set(runs) == {"sequential", "parallel", "exit", "sequential-lk"}
  assert runs["sequential-lk"]["stopped_at"] == 0.5 and runs["exit"]["stopped_at"] is None
  assert runs["sequential"]["shipped_comparison"]["shipped_mean_accepted"] == 1.88
  assert "shipped_comparison" not in runs["parallel"]
  seq = runs["sequential"]
  assert seq["target"]["reached"] is False
  assert seq["target"]["positions"] == pytest.approx(10 ** 7, rel=1e-6)  # +0.2 per decade: 2.2 two decades on
  assert seq["target"]["slope_per_decade"] == pytest.approx(0.2)
  assert seq["target"]["cpu_hours"] == pytest.approx(10 ** 7 / 50 / 3600)
  assert runs["parallel"]["target"] == {"metric": "spec_bench_mean_accepted", "target": 1.6, "reached": True,
                                        "positions": 10000, "method": "measured", "cpu_hours": 10000 / 50 / 3600}
  assert runs["exit"]["target"]["positions"] is None and not runs["exit"]["finished"]  # flat: no extrapolation
  assert seq["flops_per_position"] == pytest.approx(2e9) and seq["final_top1"] == {"1": 0.5, "2": 0.25}
  saved = json.loads((tmp_path / "out" / "results.json").read_text())
  assert saved["runs"] == json.loads(json.dumps(results["runs"]))
  table = (tmp_path / "out" / "results.md").read_text()
  assert "| sequential | regenerated | kl | 100,000 | 0.28 | 0.56 | 2.00 | 0.500 | 0.250 | 1.80 | 0.800 |" in table
  assert "exit (running)" in table and "~1e+07 positions" in table
  assert "| sequential-lk (stopped at 0.5) | regenerated | lk |" in table
  assert "| sequential | 48 | 1.74 | 1.88 | 10 / 34 | keeps the shipped one |" in table
  assert "| exit (against the shipped mtp_sequential) | 48 | 1.74 | 1.88 | 10 / 34 | replaces it |" in table
  # An option (here the objective) against its family's default run at the last positions both reached.
  assert [(o["run"], o["against"], o["positions"]) for o in results["options"]] == [("sequential-lk", "sequential",
                                                                                     10000)]
  assert ("| sequential-lk | sequential | 10,000 | 0.450 / 0.400 | 0.225 / 0.200 | 1.50 / 1.60 | 0.500 / 0.600 |"
          in table)
  assert (tmp_path / "out" / "curves.png").stat().st_size > 10000
  run_md = (tmp_path / "out" / "RUN.md").read_text()
  assert run_md.startswith(f"# train_budget, {saved['date']} {saved['time']} UTC") and "python -m experiments.curves" in run_md
  assert "  - exit: still training when the curves were drawn; 3 steps, 100,000 answer positions" in run_md
  assert ("  - sequential-lk: stopped at 0.5 of its budget (`stop_fraction`: the same command without it goes on)"
          in run_md)
  # A start from a tree with uncommitted edits says which files.
  assert "2026-12-07 13:00 UTC at def-dirty (uncommitted edits to docs/training.md)" in run_md
  assert seq["stalled_seconds"] == 0.0
  # The publication keeps the logs it was drawn from: with the workdirs gone, it is drawn again from them alone.
  assert sorted(p.name for p in (tmp_path / "out" / "runs" / "sequential").iterdir()) == [
      "metrics.jsonl", "run.json", curves.SHIPPED_COMPARISON]
  shutil.rmtree(tmp_path / "runs")
  again = curves.curves([], str(tmp_path / "out"))
  assert [r["name"] for r in again["runs"]] == ["exit", "parallel", "sequential", "sequential-lk"]
  assert again["runs"][-1]["stopped_at"] == 0.5  # its starts.jsonl kept with its logs
  for a, b in zip(again["runs"], sorted(saved["runs"], key=lambda r: r["name"])):
    assert {k: v for k, v in a.items() if k != "workdir"} == {k: v for k, v in b.items() if k != "workdir"}
  # A run published before the logs were kept (none under runs/) is carried over from results.json, and says so;
  # a new run's workdir joins the kept ones.
  shutil.rmtree(tmp_path / "out" / "runs" / "parallel")
  synthetic_run(tmp_path / "new" / "draft", "draft", positions, [0.1, 0.2, 0.3], [1.1, 1.2, 1.3])
  third = curves.curves([str(tmp_path / "new")], str(tmp_path / "out"))
  runs = {r["name"]: r for r in third["runs"]}
  assert sorted(runs) == ["draft", "exit", "parallel", "sequential", "sequential-lk"]
  assert runs["parallel"]["carried_from"] == {"date": again["date"], "commit": again["commit"]}
  published = {r["name"]: r for r in saved["runs"]}
  assert runs["parallel"]["curve"] == published["parallel"]["curve"] and "carried_from" not in runs["draft"]
  assert "parallel: finished at commit" in (tmp_path / "out" / "RUN.md").read_text()
  assert "its summary carried over from the publication of" in (tmp_path / "out" / "RUN.md").read_text()
  kept = tmp_path / "out" / "runs" / "draft" / "metrics.jsonl"
  written = kept.stat().st_mtime_ns
  curves.curves([str(tmp_path / "new")], str(tmp_path / "out"))
  assert kept.stat().st_mtime_ns == written  # a log that did not change is not written again
  # A run carried over unfinished is no longer running.
  shutil.rmtree(tmp_path / "out" / "runs" / "exit")
  curves.curves([], str(tmp_path / "out"))
  assert "| exit (stopped) |" in (tmp_path / "out" / "results.md").read_text()
  assert "exit: stopped before its budget, its workdir gone" in (tmp_path / "out" / "RUN.md").read_text()
  with pytest.raises(FileNotFoundError, match="no training run"):
    curves.curves([str(tmp_path / "nothing")], str(tmp_path / "empty"))


def test_a_run_stopped_between_two_logged_steps_counts_the_stop_as_stalled_wall_time():
  # 10 s of wall and 20 s of CPU per interval; the third interval takes 1,000 s of wall for its 20 s of CPU.
  walls, cpus = [0, 10, 20, 1020, 1030], [0, 20, 40, 60, 80]
  records = [{"train_seconds": w, "train_cpu_seconds": c} for w, c in zip(walls, cpus)]
  assert curves.stalled_seconds(records) == pytest.approx(990)
  assert curves.stalled_seconds(records[:3]) == 0.0 and curves.stalled_seconds(records[:1]) == 0.0


def test_a_checkpoint_replaces_the_shipped_one_only_when_it_scores_higher_on_held_out_prompts(tiny, caches):
  from experiments import compare_checkpoints
  held_out = caches[0]["held_out"]
  prompts = compare_checkpoints.held_out_prompts(held_out, 3)
  first_answer = [int(np.flatnonzero(np.asarray(held_out.mask[i]))[0]) for i in range(3)]
  assert prompts == [held_out.tokens[i, :n].tolist() for i, n in enumerate(first_answer)]
  drafter = specjax.make_drafter("mtp_parallel", tiny, path=None, num_heads=2)
  same = compare_checkpoints.compare(tiny, drafter, drafter, prompts, gamma=2, max_new_tokens=6)
  assert same["candidate"]["score"] == same["shipped"]["score"] and not same["replace"]
  assert same["prompts_candidate_better"] == same["prompts_shipped_better"] == 0
  assert same["candidate"]["score"] == pytest.approx(
      same["candidate"]["mean_accepted"] / (drafter.cost.round + 2 * drafter.cost.step + 1))
