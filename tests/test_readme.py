"""The README works as written: its opening commands, and every Python snippet run as-is on one CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO_ROOT, "README.md")
SNIPPET_TIMEOUT_S = 600


def code_blocks(text: str, language: str) -> list[str]:
  return re.findall(rf"^```{language}\n(.*?)^```$", text, re.M | re.S)


def readme() -> str:
  with open(README) as f:
    return f.read()


def test_readme_opens_with_two_commands_each_said_what_it_does():
  opening = readme().split("\n## ", 1)[0]
  blocks = code_blocks(opening, "bash")
  assert [len(block.strip().splitlines()) for block in blocks] == [1, 1]
  quickstart, tests = (block.strip() for block in blocks)
  assert quickstart.endswith("python -m experiments.run --config=configs/quickstart.py")
  assert tests.split(" && ")[-1].startswith("python -m pytest -q") and "pip install -e '.[test]'" in tests
  # One sentence before each block says which is which.
  sentences = re.findall(r"^(\S[^\n]*):\n\n```bash", opening, re.M)
  assert len(sentences) == 2 and "quickstart" in sentences[0] and "tests" in sentences[1]


@pytest.mark.slow
def test_ci_runs_the_readme_test_command():
  proc = subprocess.run(["bash", os.path.join(REPO_ROOT, ".ci", "run"), "--print-test-command"],
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == code_blocks(readme().split("\n## ", 1)[0], "bash")[1].strip()


@pytest.fixture(scope="module")
def snippet_runs():
  """Every ```python block of the README, each run as-is in a fresh interpreter, all at once."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("SPECJAX_")}
  env["JAX_PLATFORMS"] = "cpu"  # one CPU device, as on a laptop
  procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for code in code_blocks(readme(), "python")]
  runs = []
  for proc in procs:
    try:
      stdout, stderr = proc.communicate(timeout=SNIPPET_TIMEOUT_S)
    except subprocess.TimeoutExpired:
      proc.kill()
      stdout, stderr = proc.communicate()
    runs.append((proc.args[2], proc.returncode, stdout, stderr))
  return runs


def test_readme_python_snippets_include_the_mesh_with_the_flag_it_needs():
  codes = code_blocks(readme(), "python")
  assert len(codes) == 3
  assert "specjax.make_mesh(data=2, model=4)" in codes[1] and "xla_force_host_platform_device_count=8" in codes[1]


@pytest.mark.slow
@pytest.mark.parametrize("index", range(3), ids=["use", "mesh", "distributed"])
def test_readme_python_snippet_runs_as_written(snippet_runs, index):
  code, returncode, stdout, stderr = snippet_runs[index]
  assert returncode == 0, f"{code}\n--- stdout:\n{stdout[-3000:]}\n--- stderr:\n{stderr[-6000:]}"
  if "print(" in code:
    assert stdout.strip(), "the snippet prints nothing"
  assert "<|im_end|>" not in stdout  # texts stop before the stop token
