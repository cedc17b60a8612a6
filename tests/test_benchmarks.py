"""benchmarks/bench_costs.py's parts that the accelerator figures rest on: a model of the real shape with random
weights takes every shipped drafter checkpoint, and a saved run prints again with another run's alpha."""

import importlib.util
import json
import os

import numpy as np
import pytest

import specjax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench_costs():
  spec = importlib.util.spec_from_file_location("bench_costs", os.path.join(ROOT, "benchmarks", "bench_costs.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow
def test_random_weights_of_the_real_shape_take_the_shipped_drafters(bench_costs, smollm2, tmp_path):
  path = tmp_path / "shape.json"
  path.write_text(json.dumps(bench_costs.model_shape(smollm2)))
  model = bench_costs.random_model(str(path), "float32")
  assert model.config == smollm2.config and model.name == smollm2.name
  assert model.params["embed"].shape == smollm2.params["embed"].shape
  assert not np.allclose(model.params["embed"], smollm2.params["embed"])
  for name, options in (("mtp_parallel", {}), ("mtp_sequential", {}), ("layer_skip", {"adapter": "default"}),
                        ("draft_model", {"draft": "smollm2-135m-draft"})):
    drafter = specjax.make_drafter(name, model, **options)
    assert drafter.params is not None


def test_a_saved_run_prints_with_another_runs_alpha(bench_costs, tmp_path, capsys):
  results = tmp_path / "results.json"
  results.write_text(json.dumps({"summary": {"methods": {
      "autoregressive": {"alpha": None, "gamma": None}, "mtp_parallel": {"alpha": 0.5, "gamma": 4}}}}))
  alphas = bench_costs.measured_alpha(str(results))
  assert alphas == {"mtp_parallel": {"alpha": 0.5, "gamma": 4}}
  run = {"backend": "gpu", "device_kind": "test", "jax": "0", "dtype": "float32", "weights": "random",
         "width_seconds": {"T1": 0.001, "T5": 0.0009, "B8": 0.0008}, "batch": 8, "bandwidth_gbs": 3000.0,
         "wall_seconds": 1.0, "costs": {"target_step_bytes_xla": 1.5e9, "methods": {"mtp_parallel": {
             "gamma": 4, "draft_cost": 0.01, "verify_cost": 0.9, "draft_cost_bytes": 0.02, "verify_cost_bytes": 1.0}}}}
  bench_costs.report(run, alphas)
  out = capsys.readouterr().out
  # (1 - 0.5^5) / (1 - 0.5) = 1.9375 tokens per round over 4 * 0.01 + 0.9 = 0.94 steps: 2.06x.
  assert "| mtp_parallel | 4 | 0.010 | 0.90 | 0.020 | 0.50 | 2.06x |" in out
  assert "roofline fraction 50%" in out  # 1.5 GB / 3000 GB/s = 0.5 ms of a 1 ms step
