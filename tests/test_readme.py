"""The README and docs/ work as written: the README's opening commands, and every Python snippet of the README and
of docs/*.md run as-is on one CPU."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO_ROOT, "README.md")
DOCS = sorted(str(path) for path in pathlib.Path(REPO_ROOT, "docs").glob("*.md"))
SNIPPET_TIMEOUT_S = 600


def code_blocks(text: str, language: str) -> list[str]:
  return re.findall(rf"^```{language}\n(.*?)^```$", text, re.M | re.S)


def read(path: str) -> str:
  with open(path) as f:
    return f.read()


def readme() -> str:
  return read(README)


def python_snippets() -> list[tuple[str, str]]:
  """(where, code) of every ```python block of the README and of docs/, in that order."""
  snippets = []
  for path in [README] + DOCS:
    name = os.path.relpath(path, REPO_ROOT)
    snippets += [(f"{name}:{i}", code) for i, code in enumerate(code_blocks(read(path), "python"))]
  return snippets


SNIPPETS = python_snippets()


def test_readme_opens_with_the_quickstart_and_the_test_command():
  opening = readme().split("\n## ", 1)[0]
  blocks = code_blocks(opening, "bash")
  assert [len(block.strip().splitlines()) for block in blocks] == [1, 1]
  quickstart, tests = (block.strip() for block in blocks)
  assert quickstart.endswith("python -m experiments.run --config=configs/quickstart.py")
  assert tests.split(" && ")[-1].startswith("python -m pytest -q") and "pip install -e '.[test]'" in tests


@pytest.mark.slow
def test_ci_runs_the_readme_test_command_and_the_tpu_compile_tests():
  proc = subprocess.run(["bash", os.path.join(REPO_ROOT, ".ci", "run"), "--print-test-command"],
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  tests_section = readme().split("\n## Tests\n", 1)[1].split("\n## ", 1)[0]
  tpu = [block.strip() for block in code_blocks(tests_section, "bash") if "-m tpu_compile" in block]
  assert proc.stdout.strip().splitlines() == [code_blocks(readme().split("\n## ", 1)[0], "bash")[1].strip()] + tpu
  assert "pip install -e '.[tpu]'" in tpu[0]


def test_readme_python_snippets_include_the_mesh_with_the_flag_it_needs():
  codes = code_blocks(readme(), "python")
  assert len(codes) == 2
  assert "specjax.make_mesh(data=2, model=4)" in codes[1] and "xla_force_host_platform_device_count=8" in codes[1]


def anchors(markdown: str) -> set[str]:
  """The anchors GitHub gives a file's headings: lower case, punctuation dropped, spaces as hyphens."""
  return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
          for heading in re.findall(r"^#+ (.*)$", markdown, re.M)}


def test_docs_link_only_to_files_and_headings_that_exist():
  for path in [README] + DOCS:
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", read(path)):
      if re.match(r"[a-z]+://", target):
        continue
      linked = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
      assert os.path.exists(linked), f"{path}: {target}"
      if anchor:
        assert anchor in anchors(read(linked)), f"{path}: {target}#{anchor}"


@pytest.fixture(scope="module")
def snippet_runs():
  """Every ```python block of the README and docs/, each run as-is in a fresh interpreter, all at once."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("SPECJAX_")}
  env["JAX_PLATFORMS"] = "cpu"  # one CPU device, as on a laptop
  procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for _, code in SNIPPETS]
  runs = []
  for proc in procs:
    try:
      stdout, stderr = proc.communicate(timeout=SNIPPET_TIMEOUT_S)
    except subprocess.TimeoutExpired:
      proc.kill()
      stdout, stderr = proc.communicate()
    runs.append((proc.args[2], proc.returncode, stdout, stderr))
  return runs


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(SNIPPETS)), ids=[where for where, _ in SNIPPETS])
def test_python_snippet_runs_as_written(snippet_runs, index):
  code, returncode, stdout, stderr = snippet_runs[index]
  assert returncode == 0, f"{code}\n--- stdout:\n{stdout[-3000:]}\n--- stderr:\n{stderr[-6000:]}"
  if "print(" in code:
    assert stdout.strip(), "the snippet prints nothing"
  assert "<|im_end|>" not in stdout  # texts stop before the stop token
