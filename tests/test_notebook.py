"""The Colab notebooks run top to bottom (their SMALL variants, on CPU) and report their stats:
notebooks/colab_tpu_quickstart.ipynb and notebooks/compare_drafters.ipynb."""

from __future__ import annotations

import json
import os
import re

import nbformat
import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO_ROOT, "notebooks", "colab_tpu_quickstart.ipynb")
COMPARE_NOTEBOOK = os.path.join(REPO_ROOT, "notebooks", "compare_drafters.ipynb")


def stream_text(cell) -> str:
  return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream")


def execute(path: str):
  """The notebook at `path` after execution by a python3 kernel started in the repository root."""
  from nbclient import NotebookClient
  notebook = nbformat.read(path, as_version=4)
  # Raises CellExecutionError, with the failing cell's traceback, if any cell fails.
  NotebookClient(notebook, timeout=300, kernel_name="python3", startup_timeout=120,
                 resources={"metadata": {"path": REPO_ROOT}}).execute()
  return notebook


@pytest.fixture(scope="module")
def small_cpu(monkeypatch_module):
  monkeypatch_module.setenv("SPECJAX_NOTEBOOK_SMALL", "1")
  monkeypatch_module.setenv("JAX_PLATFORMS", "cpu")


@pytest.fixture(scope="module")
def executed(small_cpu):
  return execute(NOTEBOOK)


@pytest.fixture(scope="module")
def executed_compare(small_cpu):
  return execute(COMPARE_NOTEBOOK)


@pytest.fixture(scope="module")
def monkeypatch_module():
  with pytest.MonkeyPatch.context() as patch:
    yield patch


@pytest.mark.parametrize("path", [NOTEBOOK, COMPARE_NOTEBOOK], ids=os.path.basename)
def test_notebook_is_valid_nbformat_v4_for_a_colab_tpu(path):
  notebook = nbformat.read(path, as_version=4)
  nbformat.validate(notebook)
  assert notebook.nbformat == 4
  assert notebook.metadata["accelerator"] == "TPU"
  assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code")  # stored clean


@pytest.mark.slow
def test_notebook_runs_every_cell_and_prints_each_method_and_prompt(executed):
  cells = [cell for cell in executed.cells if cell.cell_type == "code"]
  assert [cell.execution_count for cell in cells] == list(range(1, len(cells) + 1))  # all of them, in order
  text = "\n".join(stream_text(cell) for cell in cells)
  for category in ("coding", "extraction"):  # SMALL's two prompts
    assert re.search(rf"^\[{category}\] \d+ tokens: ", text, re.M)
    assert f"=== [{category}] autoregressive:\n" in text
  for name in ("autoregressive", "prompt_lookup", "layer_skip"):
    assert re.search(rf"^{name}: \d+ tokens in [\d.]+ s, after compiling for [\d.]+ s$", text, re.M), text
  for name in ("prompt_lookup", "layer_skip"):
    assert text.count(f"  {name} gives the same tokens: True") == 2


@pytest.mark.slow
def test_notebook_reports_speculative_stats(executed):
  text = "\n".join(stream_text(cell) for cell in executed.cells if cell.cell_type == "code")
  assert "specjax is already installed" in text  # the install cell is skipped inside the checkout
  assert "backend: cpu" in text
  summary = json.loads(next(line for line in text.splitlines() if line.startswith("SUMMARY "))[len("SUMMARY "):])
  assert list(summary) == ["autoregressive", "prompt_lookup", "layer_skip"]
  for name, stats in summary.items():
    assert set(stats) == {"tokens_per_second", "speedup", "acceptance_rate", "mean_accepted", "lossless"}
    assert stats["lossless"], f"{name}: greedy speculative tokens differ from autoregressive"
    baseline = summary["autoregressive"]["tokens_per_second"]
    assert stats["speedup"] == pytest.approx(stats["tokens_per_second"] / baseline)
    # The printed table has the same row: name, tokens/s, speedup, acceptance_rate (- when none), mean_accepted.
    rate = "-" if stats["acceptance_rate"] is None else f"{stats['acceptance_rate']:.2f}"
    assert re.search(rf"^{name} +{stats['tokens_per_second']:.1f} +{stats['speedup']:.2f}x +{re.escape(rate)} +"
                     rf"{stats['mean_accepted']:.2f}$", text, re.M), text
  assert summary["autoregressive"]["acceptance_rate"] is None and summary["autoregressive"]["mean_accepted"] == 1
  for name in ("prompt_lookup", "layer_skip"):
    assert 0 <= summary[name]["acceptance_rate"] <= 1
    assert 1 <= summary[name]["mean_accepted"] <= 5  # at most gamma + 1 tokens per target forward


@pytest.mark.slow
def test_compare_notebook_runs_the_shipped_drafters_through_the_runner(executed_compare):
  cells = [cell for cell in executed_compare.cells if cell.cell_type == "code"]
  assert [cell.execution_count for cell in cells] == list(range(1, len(cells) + 1))
  text = "\n".join(stream_text(cell) for cell in cells)
  assert "backend: cpu" in text and "mtp_parallel.safetensors, mtp_sequential.safetensors" in text
  summary = json.loads(next(line for line in text.splitlines() if line.startswith("SUMMARY "))[len("SUMMARY "):])
  assert list(summary) == ["autoregressive", "control", "mtp_parallel", "mtp_sequential"]  # SMALL's, and the control
  for name in ("mtp_parallel", "mtp_sequential"):
    stats = summary[name]
    assert stats["lossless"], f"{name}: greedy speculative tokens differ from autoregressive"
    assert len(stats["acceptance_per_position"]) == 4 and 1 <= stats["mean_accepted"] <= 5
    assert stats["draft_cost"] > 0 and stats["verify_cost"] > 0 and stats["projected_speedup"] > 0
  outputs = [o for cell in cells for o in cell.get("outputs", []) if o.output_type == "display_data"]
  assert any("image/png" in o.data for o in outputs)  # the per-position plot
  table = next(o.data["text/markdown"] for o in outputs if "text/markdown" in o.data)
  assert "| mtp_sequential | 4 |" in table and "accelerator projection" in table
