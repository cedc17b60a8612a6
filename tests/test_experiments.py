"""The experiment runner: Spec-Bench prompt selection, configs, method setup and a small end-to-end run."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from configs import quickstart, spec_bench as spec_bench_config
from experiments import run, spec_bench

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


def test_prompt_ids_use_the_chat_template_on_the_first_turn_only(smollm2):
  question = spec_bench.select(spec_bench.load_questions(), question_ids=[81])[0]
  tokenizer = smollm2.tokenizer
  chat = tokenizer.decode(spec_bench.prompt_ids(question, tokenizer, chat=True))
  assert question.turns[0] in chat and question.turns[1] not in chat
  assert chat.startswith("<|im_start|>") and chat.endswith("<|im_start|>assistant\n")
  assert spec_bench.prompt_ids(question, tokenizer, chat=False) == tokenizer.encode(question.turns[0])


@pytest.mark.parametrize("module, arg, prompts, max_new_tokens", [
    (quickstart, None, 5, 64),
    (spec_bench_config, None, 65, 128),
    (spec_bench_config, "small", 13, 64),
])
def test_configs_select_their_prompts(module, arg, prompts, max_new_tokens):
  config = module.get_config(arg)
  assert len(spec_bench.select(spec_bench.load_questions(), **config.prompts.to_dict())) == prompts
  assert config.max_new_tokens == max_new_tokens
  assert dict(config.methods[0]) == {"name": "autoregressive"}


def test_config_rejects_an_unknown_variant():
  with pytest.raises(ValueError, match="'small'"):
    spec_bench_config.get_config("huge")


def _config(**overrides) -> ml_collections.ConfigDict:
  config = quickstart.get_config()
  config.update(overrides)
  return config


def test_make_methods_puts_the_baseline_first_and_honours_only(smollm2):
  config = _config(methods=({"name": "pld", "drafter": "prompt_lookup"}, {"name": "ar"},
                            {"name": "skip", "drafter": "layer_skip", "gamma": 2}), only="pld")
  methods = run.make_methods(config, smollm2)
  assert [m.name for m in methods] == ["ar", "pld"]
  assert methods[0].drafter is None and methods[1].drafter.name == "prompt_lookup"
  assert methods[1].gamma == config.gamma


@pytest.mark.parametrize("methods, only, message", [
    (({"name": "pld", "drafter": "prompt_lookup"},), "", "needs an autoregressive baseline"),
    (({"name": "ar"}, {"name": "ar"}), "", "must be unique"),
    (({"name": "ar"},), "ar,typo", r"unknown methods \['typo'\]"),
    (({"name": "ar", "exit_layer": 3},), "", "a method is a dict"),
])
def test_make_methods_rejects_bad_method_lists(methods, only, message):
  with pytest.raises(ValueError, match=message):
    run.make_methods(_config(methods=methods, only=only), model=None)  # fails before building drafters


def test_batches_never_mix_categories():
  questions = spec_bench.select(spec_bench.load_questions(), categories=["qa", "math"], per_category=3)
  batches = run.make_batches(questions, [[i + 1] for i in range(6)], batch_size=2)
  assert [(b.category, len(b.prompts)) for b in batches] == [("qa", 2), ("qa", 1), ("math", 2), ("math", 1)]
  assert [b.index for b in batches] == [0, 1, 2, 3]
  assert sum((b.prompts for b in batches), ()) == tuple((i + 1,) for i in range(6))


def test_run_writes_results_table_and_plots(smollm2, tmp_path):
  # qa and writing prompts fall into one length bucket: one compilation per method.
  config = _config(max_new_tokens=8, repeats=2, only="prompt_lookup")
  config.prompts.categories = ("qa", "writing")
  results = run.run(config, str(tmp_path), model=smollm2, name="test")

  with open(tmp_path / "results.json") as f:
    saved = json.load(f)
  assert saved["config"]["max_new_tokens"] == 8
  assert saved["environment"]["cpu_count"] == os.cpu_count()
  summary = saved["summary"]["methods"]
  assert list(summary) == ["autoregressive", "prompt_lookup"]
  assert all(s["lossless"] is True and s["compile_seconds"] > 0 for s in summary.values())
  # tokens/s: per batch, median tokens over median seconds of its repeats; then the median over batches.
  for method, s in summary.items():
    rates = [np.median([r["new_tokens"] for r in saved["records"] if (r["method"], r["batch"]) == (method, b)])
             / np.median([r["seconds"] for r in saved["records"] if (r["method"], r["batch"]) == (method, b)])
             for b in (0, 1)]
    assert s["tokens_per_second"] == pytest.approx(np.median(rates))
  assert summary["prompt_lookup"]["speedup"] == pytest.approx(
      summary["prompt_lookup"]["tokens_per_second"] / summary["autoregressive"]["tokens_per_second"])
  assert summary["prompt_lookup"]["acceptance_rate"] is not None
  assert set(saved["summary"]["speedup_by_category"]["prompt_lookup"]) == {"qa", "writing"}
  # 2 batches x 2 repeats x 2 methods, interleaved per batch.
  assert [(r["batch"], r["method"]) for r in saved["records"]] == [
      (b, m) for b in (0, 1) for _ in range(2) for m in ("autoregressive", "prompt_lookup")]
  assert len(saved["outputs"]) == 4
  assert all(o["matches_baseline"] and 0 < o["new_tokens"] <= 8 for o in saved["outputs"])
  assert results["summary"] == saved["summary"]

  table = (tmp_path / "results.md").read_text()
  assert "| method | tokens/s | speedup |" in table
  assert "| autoregressive |" in table and "| prompt_lookup |" in table
  for plot in ("speedup.png", "speedup_by_category.png"):
    assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_line_overrides_reach_the_config():
  argv = ["run", "--config=configs/quickstart.py", "--config.max_new_tokens=16", "--config.only=prompt_lookup",
          "--config.prompts.categories=('qa','math')", "--config.mesh_shape=(2,1)"]
  values = flags.FlagValues()
  config = config_flags.DEFINE_config_file("config", flag_values=values, lock_config=True, sys_argv=argv)
  values(argv)
  assert (config.value.max_new_tokens, config.value.only) == (16, "prompt_lookup")
  assert config.value.prompts.categories == ("qa", "math") and config.value.mesh_shape == (2, 1)


def test_cli_rejects_an_unknown_config_key(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "experiments.run", "--config=configs/quickstart.py", "--config.max_new_tokns=16",
       f"--workdir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode != 0
  assert "no such field 'max_new_tokns'" in result.stderr
  assert 'Did you mean "max_new_tokens"' in result.stderr
  assert not os.listdir(tmp_path)  # failed before running anything


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
