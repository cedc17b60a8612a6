"""Compiling for TPU topologies without a TPU (experiments/compile_for.py, configs/compile_tpu.py).

The tests marked `tpu_compile` run the TPU compiler (libtpu, `pip install -e ".[tpu]"`) on abstract devices; the rest
check the grid, the projection's arithmetic and the model shapes without it.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import compile_tpu
from experiments import compile_for
from specjax import sharding
from specjax.config import ModelConfig, shaped_config

# head_dim 64 and bf16: shapes specjax's CPU attention kernel takes, so a program that let it in would not compile.
SMALL_CONFIG = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=6, num_heads=4,
                           num_kv_heads=2, head_dim=64, tie_embeddings=False, max_position_embeddings=1024,
                           dtype="bfloat16")

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="needs libtpu to compile for TPU: pip install -e '.[tpu]'")


def small_run(programs, topology=("v5e:2x4", 2, 4)):
  """configs/compile_tpu.py's drafters and programs for SMALL_CONFIG at small sizes."""
  config = compile_tpu.get_config()
  config.models = ({"name": "small", "draft_vocab": 128},)
  config.topologies = (topology,)
  config.batch_size, config.prompt_len, config.cache_len = 4, 32, 128
  config.train.batch_size, config.train.seq_len, config.train.top_k = 4, 32, 8
  config.train_drafters = ("exit_adapter", "draft_model", "mtp_parallel", "mtp_sequential")
  config.runs = ({"models": ("small",), "topologies": (topology[0],), "programs": programs},)
  return config


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
def test_every_program_compiles_for_a_v5e_slice_without_a_tpu():
  config = small_run(compile_for.PROGRAMS)
  records = compile_for.compile_all(config, progress=lambda line: None, model_configs={"small": SMALL_CONFIG})
  failed = [(r["program"], r["drafter"], r.get("error")) for r in records if r["status"] != "compiled"]
  assert not failed
  drafters = {d["name"] for d in config.drafters}
  assert {r["drafter"] for r in records if r["program"] == "speculative"} == drafters
  assert {r["drafter"] for r in records if r["program"] == "train_drafter"} == set(config.train_drafters)
  programs = {r["program"] for r in records}
  assert {"prefill", "autoregressive", "train", "decode_step", "verify_5", "verify_3"} <= programs
  for r in records:
    assert 0 < r["bytes_per_device"] < 16 * 2**30 and r["bytes_accessed"] > 0
  # The step programs count one step: a verification of 5 tokens does more arithmetic than a decode step.
  flops = {r["program"]: r["flops"] for r in records if r["drafter"] is None}
  assert flops["verify_5"] > flops["decode_step"] > 0
  # Parallel heads draft without a loop: their whole proposal is counted. A draft model drafts in a loop, whose body
  # XLA would count once: one step is counted. The sequential module's later steps run under jax.lax.cond.
  proposals = {(r["program"], r["drafter"]): r for r in records if r["program"].startswith("propose")}
  assert not proposals[("propose_4", "mtp_parallel")]["has_loop"]
  assert ("propose_1", "draft_model") in proposals and ("propose_4", "draft_model") not in proposals
  assert not proposals[("propose_4", "mtp_sequential")]["has_loop"]
  acceptance = compile_for.measured_acceptance(config.acceptance)
  projected = compile_for.projections(records, config, acceptance)
  assert {p["drafter"] for p in projected} == drafters
  assert all(p["projected_speedup"] > 0 for p in projected)
  counted = {p["drafter"]: p["draft_counted"] for p in projected}
  assert counted["mtp_parallel"] == counted["mtp_sequential"] == "propose(gamma)"
  assert counted["draft_model"] == counted["layer_skip"] == "gamma x propose(1)"


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
def test_a_program_larger_than_the_chips_memory_is_reported_as_not_fitting():
  # One layer, and an embedding of 2^22 x 2048 bf16 (16 GiB) on a single v5e chip (16 GiB of HBM).
  huge = dataclasses.replace(SMALL_CONFIG, vocab_size=2**22, hidden_size=2048, num_layers=1, num_heads=32,
                             num_kv_heads=8)
  config = small_run(("prefill",), topology=("v5e:1x1", 1, 1))
  config.drafters = ()
  records = compile_for.compile_all(config, progress=lambda line: None, model_configs={"small": huge})
  assert [r["status"] for r in records] == ["does_not_fit"]
  assert "RESOURCE_EXHAUSTED" in records[0]["error"] or "memory" in records[0]["error"]


@pytest.mark.tpu_compile
@needs_libtpu
def test_a_topology_gives_its_devices_and_the_chips_published_figures():
  target = compile_for.tpu_target("v2:2x2", 2, 4)  # Colab's v2-8: 4 chips of 2 TensorCores, one device each
  assert dict(target.mesh.shape) == {"data": 2, "model": 4}
  assert target.hbm_bytes == 8 * 2**30 and target.bf16_flops_per_second == 23e12
  single = compile_for.tpu_target("v5e:1x1", 1, 1)
  assert single.mesh.size == 1 and single.hbm_bytes_per_second == 819e9
  with pytest.raises(ValueError, match="expected <generation>"):
    compile_for.tpu_target("v9z:2x4", 2, 4)


def test_the_cover_grid_has_every_program_on_every_topology_and_every_model():
  config = compile_tpu.get_config("cover")
  grid = compile_for.blocks(config)
  topologies = {t[0] for t in config.topologies}
  drafters = tuple(d["name"] for d in config.drafters)
  assert {(t[0], p) for _, t, p, _ in grid} == {(t, p) for t in topologies for p in compile_for.PROGRAMS}
  assert {m for m, _, _, _ in grid} == {m["name"] for m in config.models}
  assert all(d == drafters for _, _, _, d in grid)
  assert len(grid) == len({(m, t, p) for m, t, p, _ in grid})


def test_the_default_grid_projects_every_drafter_on_every_topology():
  config = compile_tpu.get_config()
  grid = compile_for.blocks(config)
  drafters = tuple(d["name"] for d in config.drafters)
  steps = {t[0] for m, t, p, d in grid if p == "steps" and m == "smollm2-135m" and d == drafters}
  assert steps == {t[0] for t in config.topologies}
  assert ("llama-3.1-8b", ("v5e:2x4", 2, 4), "speculative", ("mtp_sequential",)) in grid
  assert len(compile_for.blocks(compile_tpu.get_config("full"))) == 3 * len(config.topologies) * len(
      compile_for.PROGRAMS)
  assert compile_for.blocks(compile_tpu.get_config("small"))


def test_a_block_naming_an_unknown_program_is_an_error():
  config = compile_tpu.get_config()
  config.runs = ({"models": ("smollm2-135m",), "topologies": ("v5e:2x4",), "programs": ("decode",)},)
  with pytest.raises(ValueError, match="unknown programs"):
    compile_for.blocks(config)


def step_record(program, drafter, flops, bytes_accessed):
  return {"kind": "steps", "status": "compiled", "model": "m", "topology": "v5e:2x4", "program": program,
          "drafter": drafter, "flops": flops, "bytes_accessed": bytes_accessed,
          "projected_seconds": max(bytes_accessed / 819e9, flops / 197e12)}  # v5e's roofline


def test_the_projection_is_tau_decode_steps_over_a_round_of_draft_verify_and_update():
  config = compile_tpu.get_config()
  config.drafters = ({"name": "heads", "acceptance_of": "heads"}, {"name": "loop", "acceptance_of": "loop"})
  records = [step_record("decode_step", None, 1e9, 819e6),  # 1 ms, memory-bound
             step_record("verify_5", None, 394e12, 819e6),  # 2 s: compute-bound (394 TFLOP at 197 TFLOP/s)
             step_record("propose_4", "heads", 0, 1638e6),
             step_record("update", "heads", 0, 819e6),
             step_record("propose_1", "loop", 0, 819e6)]
  acceptance = {"heads": {"gamma": 4, "tau": 3.0}, "loop": {"gamma": 4, "tau": 2.0}}
  by_drafter = {p["drafter"]: p for p in compile_for.projections(records, config, acceptance)}
  # heads: its whole proposal (2 ms), verify (2 s), update (1 ms); tau 3 decode steps of 1 ms each.
  assert by_drafter["heads"]["projected_speedup"] == pytest.approx(3 * 1e-3 / (2e-3 + 2.0 + 1e-3))
  # loop: a drafter that drafts in a loop is counted by one step, gamma times (4 ms); no update: it keeps no state.
  assert by_drafter["loop"]["draft_seconds"] == pytest.approx(4e-3)
  assert by_drafter["loop"]["projected_speedup"] == pytest.approx(2 * 1e-3 / (4e-3 + 2.0))


def test_a_run_writes_its_results_tables_plot_and_run_record(tmp_path, monkeypatch):
  config = compile_tpu.get_config()
  config.drafters = ({"name": "heads", "acceptance_of": "mtp_parallel"},)
  config.topologies = (("v5e:2x4", 2, 4),)
  program = {"kind": "speculative", "status": "compiled", "model": "m", "topology": "v5e:2x4", "mesh": [2, 4],
             "program": "speculative", "drafter": "heads", "seconds": 30.0, "cpu_seconds": 20.0,
             "memory": {"arguments": 2**30, "outputs": 0, "temporaries": 2**30, "code": 0, "aliased": 0},
             "bytes_per_device": 2**31, "hbm_fraction": 0.125, "flops": 1e9, "bytes_accessed": 1e9}
  too_big = dict(program, drafter=None, program="train", kind="train", status="does_not_fit",
                 error="RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")
  steps = [dict(step_record(*args), mesh=[2, 4], seconds=1.0, cpu_seconds=1.0, memory=program["memory"])
           for args in (("decode_step", None, 1e9, 819e6), ("verify_5", None, 1e9, 819e6),
                        ("propose_4", "heads", 0, 81.9e6))]
  monkeypatch.setattr(compile_for, "compile_all", lambda config, log_path=None: [program, too_big] + steps)
  v5e = compile_for.CHIPS["v5e"]
  monkeypatch.setattr(compile_for, "tpu_target", lambda topology, data, model: compile_for.Target(
      topology, sharding.make_mesh(1, 1), v5e.hbm_bytes, v5e.hbm_bytes_per_second, v5e.bf16_flops_per_second))
  results = compile_for.run(config, str(tmp_path), command="python -m experiments.compile_for --config=x")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["RUN.md", "compile_tpu.png", "results.json", "results.md"]
  table, run_md = (tmp_path / "results.md").read_text(), (tmp_path / "RUN.md").read_text()
  assert "| m | v5e:2x4 | 2 x 4 | speculative heads | compiled | 30.0 | 2.00 | 12% |" in table
  assert "train: does_not_fit: `RESOURCE_EXHAUSTED" in table
  tau = compile_for.measured_acceptance(config.acceptance)["mtp_parallel"]["tau"]
  assert results["projections"][0]["projected_speedup"] == pytest.approx(tau * 1e-3 / (0.1e-3 + 1e-3))
  assert "python -m experiments.compile_for --config=x" in run_md
  assert "5 programs: 4 compiled, 1 do not fit in HBM, 0 failed" in run_md


def test_the_acceptance_comes_from_a_fixed_gamma_run():
  acceptance = compile_for.measured_acceptance(compile_tpu.get_config().acceptance)
  assert acceptance["mtp_sequential"]["gamma"] == 4 and 1.0 < acceptance["mtp_sequential"]["tau"] < 5.0
  assert acceptance["layer_skip_best_set"]["gamma"] == 2
  assert "autoregressive" not in acceptance


def test_the_llama_shapes_have_their_published_parameter_counts():
  assert shaped_config("llama-3.2-1b").num_params == pytest.approx(1.236e9, rel=1e-3)
  assert shaped_config("llama-3.1-8b").num_params == pytest.approx(8.030e9, rel=1e-3)
  with pytest.raises(ValueError, match="unknown model shape"):
    shaped_config("llama-9")


@pytest.mark.slow
def test_the_smollm2_shape_is_the_shipped_models_config(smollm2):
  shaped = shaped_config("smollm2-135m")
  assert shaped == dataclasses.replace(smollm2.config, rms_norm_eps=shaped.rms_norm_eps)
  assert shaped.rms_norm_eps == pytest.approx(smollm2.config.rms_norm_eps)


def test_abstract_params_carry_the_shardings_of_the_rules():
  mesh = sharding.make_mesh(1, 1)
  config = dataclasses.replace(SMALL_CONFIG, dtype="float32")
  abstract = sharding.abstract_params(config, mesh)
  expected = sharding.param_shardings(config, mesh)
  assert jax.tree.structure(abstract) == jax.tree.structure(expected)
  leaves = jax.tree.leaves(abstract)
  assert all(isinstance(x, jax.ShapeDtypeStruct) and x.dtype == jnp.float32 for x in leaves)
  assert [x.sharding for x in leaves] == jax.tree.leaves(expected)
  assert sum(int(np.prod(x.shape)) for x in leaves) == config.num_params
