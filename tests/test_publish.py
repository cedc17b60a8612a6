"""The publication is what its runs say: results/INDEX.md, the generated tables of docs/ and README's Results
paragraph equal what `experiments.publish` renders from results/, and a number changed by hand fails the check."""

from __future__ import annotations

import datetime
import pathlib
import re
import shutil

import pytest

from configs import common
from experiments import cli, projection, publish, report

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_published_files_match_what_the_runs_render():
  problems = publish.check(ROOT)
  assert not problems, "run `python -m experiments.publish`:\n" + "\n".join(problems)


@pytest.fixture
def publication_copy(tmp_path: pathlib.Path) -> pathlib.Path:
  """The published files copied, and every run folder linked, so the copy renders exactly as the tree does."""
  for file in {file for file, _ in publish.BLOCKS.values()}:
    (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / file, tmp_path / file)
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "layer_skip_sets").symlink_to(ROOT / "configs" / "layer_skip_sets")
  (tmp_path / "results" / publish.ARCHIVE).mkdir(parents=True)
  shutil.copy(ROOT / publish.INDEX, tmp_path / publish.INDEX)
  for run_md in [*(ROOT / "results").glob("*/RUN.md"), *(ROOT / "results").glob(f"{publish.ARCHIVE}/*/RUN.md")]:
    folder = run_md.parent
    (tmp_path / folder.relative_to(ROOT)).symlink_to(folder)
  return tmp_path


def _change_first_number(text: str, start: int = 0) -> str:
  """The first number with two decimals after `start`, its last digit changed."""
  found = re.compile(r"\d\.\d\d").search(text, start)
  assert found is not None
  last = found.end() - 1
  return text[:last] + str((int(text[last]) + 1) % 10) + text[last + 1:]


def test_check_fails_when_a_published_number_is_changed(publication_copy):
  planted = {"README.md": "readme-results", "docs/results.md": "adaptive-by-category-full",
             "docs/benchmarks.md": "h200-costs"}
  for file, block in planted.items():
    path = publication_copy / file
    text = path.read_text()
    path.write_text(_change_first_number(text, text.index(f"<!-- publish:begin {block} -->")))
  index = publication_copy / publish.INDEX  # INDEX.md quotes commits and dates: the time of a code change
  index.write_text(index.read_text().replace("| 38c672e | 2026-11-30 22:47 |", "| 38c672e | 2026-11-30 22:48 |"))
  problems = publish.check(publication_copy)
  assert len(problems) == 4
  for file, problem in zip([publish.INDEX, *planted], problems):
    assert f"{file} (rendered from results/)" in problem


def test_check_fails_when_a_generated_block_is_missing(publication_copy):
  path = publication_copy / "docs" / "results.md"
  path.write_text(re.sub(r"<!-- publish:begin batch-sweep -->.*?<!-- publish:end batch-sweep -->\n", "",
                         path.read_text(), flags=re.S))
  with pytest.raises(ValueError, match="batch-sweep"):
    publish.check(publication_copy)


def test_check_fails_while_a_superseded_run_is_outside_the_archive(publication_copy):
  archived = publication_copy / "results" / publish.ARCHIVE / "adaptive_by_category-trained"
  target = archived.resolve()
  archived.unlink()
  (publication_copy / "results" / "adaptive_by_category-trained").symlink_to(target)
  problems = publish.check(publication_copy)
  assert any("results/adaptive_by_category-trained is superseded: git mv it to "
             "results/archive/adaptive_by_category-trained" in p for p in problems)


def _run(name: str, started: str, cells: dict[str, list[int]], config: str = "adaptive_by_category-full",
         commit: str = "abc1234", adaptive: bool = True) -> publish.Run:
  """A run of `config` that timed each method on the given question ids (one category per ten ids)."""
  questions = sorted({q for qs in cells.values() for q in qs})
  records = [{"method": m, "question_ids": [q], "category": f"category{q // 10}"}
             for m, qs in cells.items() for q in qs]
  results = {"name": config,
             "config": {"adaptive": adaptive, "methods": [{"name": "autoregressive"}] +
                        [{"name": m, "drafter": m} for m in cells]},
             "summary": {"baseline": "autoregressive", "methods": {"autoregressive": {}, **{m: {} for m in cells}}},
             "prompts": [{"question_id": q, "category": f"category{q // 10}"} for q in questions],
             "records": records}
  return publish.Run(folder=name, path=pathlib.Path(name), heading=name, started=publish._utc(started),
                     commit=commit, results=results, backend="cpu")


def _runs(*runs: publish.Run) -> publish.Runs:
  out = publish.Runs(ROOT)
  out.update({run.name: run for run in runs})
  return out


def test_a_run_is_superseded_once_newer_runs_of_its_config_measured_all_it_measured():
  old = _run("old", "2026-12-01 10:00", {"draft_model": [1, 2, 11], "mtp_parallel": [1, 2, 11]})
  newer = _run("newer", "2026-12-02 10:00", {"draft_model": [1, 2, 11]})
  newest = _run("newest", "2026-12-03 10:00", {"mtp_parallel": [1]})
  other_config = _run("other", "2026-12-04 10:00", {"mtp_parallel": [2, 11]}, config="compare_drafters")
  runs = _runs(old, newer, newest, other_config)
  state = publish.status(old, runs)
  assert not state.superseded and state.remaining == {("mtp_parallel", 2), ("mtp_parallel", 11)}
  assert [(r.name, cells) for r, cells in state.replaced_by] == [
      ("newest", {("mtp_parallel", 1)}), ("newer", {("draft_model", 1), ("draft_model", 2), ("draft_model", 11)})]
  assert publish._cells_text(old, state.replaced_by[0][1]) == "mtp_parallel on category0 (some prompts)"
  assert publish._cells_text(old, state.replaced_by[1][1]) == "draft_model on every category"
  runs["latest"] = _run("latest", "2026-12-05 10:00", {"mtp_parallel": [2, 11]})
  assert publish.status(old, runs).superseded
  assert not publish.status(runs["latest"], runs).replaced_by
  assert publish.misplaced(runs) == ["results/old is superseded: git mv it to results/archive/old"]


def test_a_renamed_method_reads_under_its_name_today_and_its_newer_runs_supersede_the_old_name():
  assert publish.current_name("layer_skip_24") == "layer_skip_exit24"
  assert publish.current_name("layer_skip_24_g2") == "layer_skip_exit24_g2"
  assert publish.current_name("layer_skip_trained_z0.5") == "layer_skip_trained_exit_z0.5"
  assert publish.current_name("layer_skip_trained_exit_z0.5") == "layer_skip_trained_exit_z0.5"
  assert publish.current_name("layer_skip_240") == "layer_skip_240"  # not a suffix of the old name
  old = _run("old", "2026-12-01 10:00", {"layer_skip_24": [1, 2], "layer_skip_trained": [1]})
  new = _run("new", "2026-12-02 10:00", {"layer_skip_exit24": [1, 2]})
  state = publish.status(old, _runs(old, new))
  assert state.replaced_by[0][1] == {("layer_skip_24", 1), ("layer_skip_24", 2)}
  assert state.remaining == {("layer_skip_trained", 1)}


def test_code_changes_are_listed_beside_the_runs_they_concern():
  adaptive_run = _run("a", "2026-12-03 09:00", {"draft_model": [1]})
  fixed_run = _run("f", "2026-12-03 09:00", {"draft_model": [1]}, adaptive=False)
  at_the_change = _run("c", "2026-12-03 09:00", {"draft_model": [1]}, commit="b24eb40")
  change = next(c for c in publish.CODE_CHANGES if c.commit == "b24eb40")
  assert change.concerns == "adaptive" and change.committed > datetime.datetime(2026, 12, 3, 9)
  assert adaptive_run.concerned_by(change)
  assert not fixed_run.concerned_by(change)
  assert not at_the_change.concerned_by(change)
  assert not _run("later", "2026-12-03 13:00", {"draft_model": [1]}).concerned_by(change)


def test_a_speedup_cell_gives_the_median_and_its_interval_or_the_prompts():
  assert publish.speedup_cell([1.0, 1.1, 1.2, 0.9, 1.05, 0.95, 1.15]) == "1.05x (0.90–1.20)"  # x_(1), x_(7)
  assert publish.speedup_cell([1.0, 1.2, 0.9]) == "1.00x (3 prompts)"


def test_the_accelerator_projection_of_the_results_is_the_cost_models_own():
  """docs/results.md projects the fixed-γ comparisons and the trees with the analytic cost model's round costs
  (experiments/projection.py's default file, model, topology and batch): for the methods whose τ the cost model took
  from those runs, the same speedups as its own projections."""
  runs = publish.load_runs(ROOT)
  modeled = runs["cost_model"].results
  costs = projection.read()
  # the fixed-γ comparisons the cost model took τ from (the one training budget's, the shipped checkpoints', the data
  # control's), in its order: a method in several takes the first's τ, and its first row here
  folders = [pathlib.Path(path).parent.name for path in modeled["workload"]["acceptance"]]
  assert {"compare_drafters", "compare_drafters-budget"} <= set(folders)
  table = "\n".join(publish.compare_drafters_block(runs, "", folder) for folder in folders)
  assert "(XLA's counts)" not in table
  assert f"| projected on TPU {projection.TOPOLOGY}, batch {projection.BATCH} |" in table
  trees = publish.trees_block(runs, "").splitlines()
  mine = [p for p in modeled["projections"]
          if (p["model"], p["topology"], p["batch"]) == (projection.MODEL, projection.TOPOLOGY, projection.BATCH)]
  assert any(p["tree_nodes"] and p["projected_speedup"] is not None for p in mine)
  for p in mine:
    cost = costs[p["acceptance_of"]]
    assert cost["tree_nodes"] == p["tree_nodes"]
    round_seconds = p["draft_seconds"] + p["verify_seconds"] + p["update_seconds"]
    assert projection.break_even_tau(cost) == pytest.approx(round_seconds / p["decode_step_seconds"])
    if p["projected_speedup"] is None:  # a tree whose tau no run of configs/trees.py measured
      continue
    assert projection.speedup(p["tau"], cost) == pytest.approx(p["projected_speedup"])
    if p["tree_nodes"]:  # its tau comes from the run of configs/trees.py, and its row is in that table
      chain = p["acceptance_of"].removesuffix(f"_tree{p['tree_nodes']}")
      row = next(line for line in trees if line.startswith(f"| `{chain}` | {p['tree_nodes']} |"))
    else:
      row = next(line for line in table.splitlines() if line.startswith(f"| `{p['acceptance_of']}` |"))
    assert row.endswith(f"| {p['projected_speedup']:.2f} |")


def _spec(method: str) -> dict:
  """A method's config: a budget method as the configs write it (drafting with its training run's export), any other
  drafting with the drafter of its name."""
  budget = {m["name"]: m for m in map(common.budget_method, common.BUDGET_RUNS)}
  return budget.get(method, {"name": method, "drafter": method})


def _train_budget(*runs: dict) -> publish.Run:
  """results/train_budget with `runs` (name, and what else the test reads), each in its own workdir."""
  return publish.Run(folder="train_budget", path=pathlib.Path("t"), heading="t",
                     started=publish._utc("2026-12-05 10:00"), commit="abc1234", backend=None,
                     results={"name": "train_budget", "runs": [dict(r, workdir=f"/w/budget/{r['name']}") for r in runs]})


def _timed_run(name: str, config: str, speeds: dict[str, list[float]], adaptive: bool,
               summary: dict[str, dict] | None = None) -> publish.Run:
  """A run of `config` whose records give each method the tokens/s of `speeds` in batches 0, 1, ... (one repeat)."""
  records = [{"method": m, "batch": b, "repeat": 0, "tokens_per_second": v, "new_tokens": v, "seconds": 1.0,
              "question_ids": [b],
              "category": "qa"} for m, vs in speeds.items() for b, v in enumerate(vs)]
  results = {"name": config, "environment": {"cpu_count": 2},
             "config": {"adaptive": adaptive, "model": "smollm2-135m", "dtype": "float32",
                        "methods": [_spec(m) for m in speeds if m != "ar"] + [{"name": "ar"}]},
             "summary": {"baseline": "ar", "all_lossless": True,
                         "methods": {m: (summary or {}).get(m, {}) for m in speeds}},
             "prompts": [{"question_id": b, "category": "qa"} for b in range(len(speeds["ar"]))], "records": records}
  return publish.Run(folder=name, path=pathlib.Path(name), heading=name, started=publish._utc("2026-12-06 10:00"),
                     commit="abc1234", results=results, backend="cpu")


def test_the_answer_names_the_fastest_method_the_fastest_trained_drafter_and_why(monkeypatch):
  ar = [10.0] * 7
  costs_of = {"budget_parallel": {"mean_accepted": 1.2, "gamma": 4, "draft_cost": 0.01, "verify_cost": 1.2},
              "budget_sequential": {"mean_accepted": 1.5, "gamma": 4, "draft_cost": 0.05, "verify_cost": 1.2},
              "prompt_lookup": {"mean_accepted": 1.6, "gamma": 4, "draft_cost": -0.001, "verify_cost": 1.2}}
  adaptive = _timed_run("budget-adaptive", "compare_drafters-budget,adaptive",
                        {"ar": ar, "budget_parallel": [12.0, 12, 12, 12, 12, 12, 11],
                         "budget_sequential": [13.0, 14, 13, 14, 13, 14, 13], "prompt_lookup": [20.0] * 7}, True,
                        summary=costs_of)
  fixed = _timed_run("budget", "compare_drafters-budget", {"ar": ar, "budget_parallel": ar, "budget_sequential": ar},
                     False, summary={"budget_parallel": {"gamma": 4, "mean_accepted": 2.0},
                                     "budget_sequential": {"gamma": 4, "mean_accepted": 2.1}})
  train_budget = _train_budget({"name": "parallel", "positions": 1500822}, {"name": "sequential", "positions": 1500822})
  costs = {m: {"gamma": 4, "draft_cost": d, "verify_cost": 1.0, "update_cost": 0.0, "tree_nodes": None,
               "source": "f (m, t)"} for m, d in [("budget_parallel", 0.01), ("budget_sequential", 0.2)]}
  monkeypatch.setattr(publish.projection, "read", lambda *args, **kwargs: costs)
  text = publish.readme_answer_block(_runs(adaptive, fixed, train_budget), "results/")
  # Prompt lookup is the fastest method; of the families trained on the budget the sequential module wins, paired
  # 13/12 .. 14/12 over the heads and 13/20 .. 14/20 against prompt lookup.
  assert text.startswith(
      "**SmolLM2-135M** (float32, adaptive drafting, 2 CPU cores; 7 prompts each; "
      "[`budget-adaptive`](results/budget-adaptive/RUN.md) at commit abc1234; every output equal to autoregressive "
      "decoding's): the fastest method is prompt lookup at 2.00x (2.00–2.00) over autoregressive decoding, untrained; "
      "the fastest of the 2 drafters trained on one budget (1.50M training positions each) is the sequential MTP "
      "module at 1.30x (1.30–1.40), 0.65x (0.65–0.70) against prompt lookup and 1.17x (1.08–1.18) over the runner-up, "
      "the parallel MTP heads at 1.20x (1.10–1.20). Why, in this run's numbers: the LM head is 21% of the weights a "
      "target step reads;")
  # A timing below zero for a free draft shows as 0.000; each drafter's tokens per forward beside its costs.
  assert ("prompt lookup c = 0.000, r = 1.20 at γ = 4, 1.60 tokens per forward; the sequential MTP module c = 0.050, "
          "r = 1.20 at γ = 4, 1.50 tokens per forward.") in text
  # Projected: 2.0 / (4 x 0.01 + 1) = 1.92 for the heads, 2.1 / (4 x 0.2 + 1) = 1.17 for the module.
  assert text.endswith("the ranking of the trained drafters puts the parallel MTP heads first at 1.92x and the "
                       "sequential MTP module second at 1.17x.")
  assert "of the fixed-γ run [`budget`](results/budget/RUN.md)" in text
  with pytest.raises(ValueError, match="needs two families"):
    publish.readme_answer_block(_runs(_timed_run("budget-adaptive", "compare_drafters-budget,adaptive",
                                                 {"ar": ar, "budget_parallel": ar}, True), fixed, train_budget), "")


def test_the_answer_gives_the_control_and_a_trained_winner_its_own_sentence(monkeypatch):
  ar = [10.0] * 5
  summary = {m: {"mean_accepted": 1.5, "gamma": 4} for m in ("budget_parallel", "budget_sequential", "prompt_lookup")}
  adaptive = _timed_run("budget-adaptive", "compare_drafters-budget,adaptive",
                        {"ar": ar, "control": [9.8, 10.0, 10.1, 10.2, 9.9], "budget_parallel": [12.0] * 5,
                         "budget_sequential": [14.0] * 5, "prompt_lookup": [11.0] * 5}, True, summary=summary)
  adaptive.results["config"]["control"] = True
  adaptive.results["config"]["methods"].remove({"name": "control", "drafter": "control"})
  train_budget = _train_budget({"name": "parallel", "positions": 1500822}, {"name": "sequential", "positions": 1500822})
  monkeypatch.setattr(publish.projection, "read", lambda *args, **kwargs: {})
  text = publish.readme_answer_block(_runs(adaptive, _timed_run("budget", "compare_drafters-budget", {"ar": ar}, False),
                                           train_budget), "")
  assert ("the fastest method is a trained drafter, the sequential MTP module at 1.40x (1.40–1.40) over autoregressive "
          "decoding, and 1.17x (1.17–1.17) over the runner-up of the 2 trained on one budget (1.50M training positions "
          "each), the parallel MTP heads at 1.20x (1.20–1.20); untrained, prompt lookup at 1.10x (1.10–1.10); the "
          "never-drafting control, the measurement floor, at 1.00x (0.98–1.02).") in text
  assert "prompt lookup 1.50 tokens per forward" in text  # no costs measured: tokens per forward only


def test_a_method_is_matched_to_the_training_run_whose_export_it_drafted_with():
  """By the checkpoint its config names, not by its name: the data control's two modules are told apart by the
  answers their runs trained on, and a control pairing two runs on the same answers is refused."""
  train_budget = _train_budget({"name": "sequential", "answers": "regenerated"},
                               {"name": "sequential-sharegpt", "answers": "sharegpt"},
                               {"name": "parallel", "answers": "regenerated"})
  data = _timed_run("data", "compare_drafters,data", {"ar": [1.0], "budget_sequential_sharegpt": [1.0],
                                                     "budget_sequential": [1.0]}, False)
  runs = _runs(data, train_budget)
  assert data.training_run("budget_sequential_sharegpt", runs)["name"] == "sequential-sharegpt"
  assert data.training_run("budget_sequential", runs)["name"] == "sequential"
  with pytest.raises(ValueError, match="0 runs of results/train_budget"):
    untrained = _timed_run("data", "c", {"ar": [1.0], "budget_deepseek": [1.0]}, False)
    untrained.training_run("budget_deepseek", _runs(untrained, train_budget))
  same = _timed_run("data", "compare_drafters,data", {"ar": [1.0], "budget_parallel": [1.0],
                                                     "budget_sequential": [1.0]}, False)
  with pytest.raises(ValueError, match="each kind of answers, not \\['regenerated'\\]"):
    publish.data_block(_runs(same, train_budget), "", folder="data")


def test_a_shipped_checkpoints_replacement_concerns_the_runs_that_drafted_with_it():
  """The methods of configs/common.py: the shipped draft concerns its drafter and HF's assisted generation with it
  (a peer), not the target drafting for itself nor a draft trained on the budget; the MTP heads' concerns the heads
  loaded by default, not a budget run's."""
  methods = {m["name"]: m for m in common.METHODS.values()}
  draft = next(c for c in publish.CODE_CHANGES if c.commit == "5602652")
  heads = next(c for c in publish.CODE_CHANGES if c.commit == "926984a")
  assert publish.drafts_with_shipped(methods["draft_model"], draft.concerns)
  assert publish.drafts_with_shipped(methods["hf_assisted"], draft.concerns)
  assert not publish.drafts_with_shipped(methods["self_draft"], draft.concerns)
  assert not publish.drafts_with_shipped(methods["budget_draft"], draft.concerns)
  assert publish.drafts_with_shipped(methods["mtp_parallel"], heads.concerns)
  assert not publish.drafts_with_shipped(methods["budget_parallel"], heads.concerns)
  assert not publish.drafts_with_shipped(methods["mtp_sequential"], heads.concerns)
  assert publish.drafts_with_shipped(methods["layer_skip_trained_exit"], "exit_adapter")
  assert not publish.drafts_with_shipped(methods["budget_exit"], "exit_adapter")


def test_the_largest_program_a_user_runs_is_named_per_model_and_topology():
  def record(model, topology, program, gib, status="compiled", kind=None):
    return {"model": model, "topology": topology, "mesh": [2, 4], "program": program, "drafter": None,
            "kind": kind or program, "status": status, "bytes_per_device": gib * 2**30, "hbm_fraction": gib / 16}
  one = [record("m", "v5e:2x4", "prefill", 1.0), record("m", "v5e:2x4", "decode_step", 9.0, kind="steps")]
  assert publish.largest_programs_table({"records": one}) is None  # one model and topology: the run's line says it
  records = one + [record("m", "v6e:2x4", "autoregressive", 3.0), record("m", "v6e:2x4", "train", 20.0, "does_not_fit"),
                   record("m", "v6e:2x4", "prefill", 2.0)]
  rows = publish.largest_programs_table({"records": records}).splitlines()[2:]
  # The loop-free steps are not a user's program; a program that does not fit is counted, never the largest.
  assert rows == ["| m | v5e:2x4 | 2 x 4 | 1 of 1 | prefill | 1.00 | 6% | – |",
                  "| m | v6e:2x4 | 2 x 4 | 2 of 3 | autoregressive | 3.00 | 19% | train (does not fit) |"]
  failed = publish.largest_programs_table({"records": one + [record("m", "v6e:2x4", "train", 0, "failed")]})
  assert failed.splitlines()[-1] == "| m | v6e:2x4 | 2 x 4 | 0 of 1 | – | – | – | train (failed) |"


def test_a_compile_run_resumed_from_its_records_gives_its_programs_compile_time_not_its_last_sittings():
  records = [{"model": "m", "topology": "v5e:2x4", "status": "compiled", "seconds": 1800.0}] * 3
  results = {"name": "c", "records": records, "compile_seconds": 5400.0, "cpu_seconds": 600.0, "wall_seconds": 1200.0,
             "machine": {"cores": 2}, "libtpu": "0.1", "resumed_records": 0}
  run = publish.Run(folder="c", path=pathlib.Path("c"), heading="c", started=publish._utc("2026-12-05 10:00"),
                    commit="abc1234", backend=None, results=results)
  assert publish.compile_run_line(run, "../results/") == (
      "[`c`](../results/c/RUN.md) (commit abc1234, 2026-12-05 10:00 UTC, 10 min of CPU time and 20 min wall on 2 "
      "shared cores, libtpu 0.1): 3 programs of m for v5e:2x4, compiled without the devices: 3 compiled, 0 do not "
      "fit, 0 failed.")
  results["resumed_records"] = 2
  assert "(commit abc1234, 2026-12-05 10:00 UTC, 90 min of compiling summed over its programs, in sittings resumed " \
         "from its records, on 2 shared cores, libtpu 0.1)" in publish.compile_run_line(run, "../results/")


def test_a_bfloat16_run_of_a_config_supersedes_none_of_its_float32_runs():
  """A timed run's dtype is part of its config: bench_peers:gemma in bfloat16 times other programs than in
  float32, so both are current."""
  runs = publish.load_runs()
  f32, bf16 = runs["bench_peers-gemma"], runs["bench_peers-gemma-bf16"]
  assert f32.results["name"] == bf16.results["name"] and f32.config != bf16.config
  assert not publish.status(f32, runs).superseded and not publish.status(bf16, runs).superseded


def test_a_quantized_run_of_a_config_supersedes_none_of_its_float32_runs_and_says_so():
  """The GGUF's quantized blocks are another target (other kernels, other tokens): a run of a config on them is a
  config of its own, and its description names its weights where a float32 run's names none."""
  runs = {name: _timed_run(name, config, {"ar": [1.0, 1.0], "prompt_lookup": [2.0, 2.0]}, True)
          for name, config in (("f32", "spec_bench"), ("q", "spec_bench"), ("peers", "bench_peers-quantized"))}
  runs["q"].results["config"]["quantized"] = runs["peers"].results["config"]["quantized"] = True
  runs["q"].started = runs["f32"].started + datetime.timedelta(days=1)
  assert [runs[n].config for n in runs] == ["spec_bench", "spec_bench (quantized)", "bench_peers-quantized"]
  assert not publish.status(runs["f32"], runs).superseded
  assert publish._describe_model(runs["q"].results["config"]) == "smollm2-135m quantized (GGUF blocks): "
  assert publish._describe_model(runs["f32"].results["config"]) == ""
  assert report.weights(runs["q"].results["config"]) == report.QUANTIZED == "quantized (GGUF blocks)"
  assert report.weights({"dtype": "bfloat16"}) == "bfloat16"


def test_the_index_says_whether_a_runs_checkpoints_are_the_files_it_decoded_with(tmp_path):
  shipped = tmp_path / "specjax" / "checkpoints" / "smollm2-135m"
  shipped.mkdir(parents=True)
  (shipped / "mtp_sequential.safetensors").write_bytes(b"module")
  run = _timed_run("r", "compare_drafters", {"ar": [1.0], "mtp_sequential": [1.0], "budget_parallel": [1.0]}, False)
  path = "specjax/checkpoints/smollm2-135m/mtp_sequential.safetensors"
  budget = common.budget_method("parallel")["checkpoint"]
  assert run.checkpoints_used() == sorted([budget, path])  # named by the method, and the shipped one it drafts with
  assert run.checkpoints_text(tmp_path) == "not recorded"
  run.results["fingerprint"] = {"checkpoints": {path: cli.file_digest(str(shipped / "mtp_sequential.safetensors")),
                                                budget: "0" * 64}}
  assert run.checkpoints_text(tmp_path) == f"not in the checkout: {budget}"
  (shipped / "mtp_sequential.safetensors").write_bytes(b"retrained")
  publish._file_digest.cache_clear()
  assert run.checkpoints_text(tmp_path) == f"changed since: {path}; not in the checkout: {budget}"
  none = _timed_run("n", "compare_drafters", {"ar": [1.0], "prompt_lookup": [1.0]}, False)
  assert none.checkpoints_text(tmp_path) == "–"
