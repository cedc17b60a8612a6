"""Runs a Python snippet in a fresh interpreter that sees N CPU devices.

XLA's `--xla_force_host_platform_device_count` is read once, when jax initialises its CPU backend; the
pytest process may already have initialised jax with one device, so multi-device checks run in a
subprocess. The snippet reports back by printing one line `RESULT <json>`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_with_devices(code: str, num_devices: int = 8, timeout: float = 600) -> tuple[dict, str]:
  """Runs `code` with `num_devices` CPU devices; returns (the RESULT json, the subprocess's stderr)."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={num_devices}".strip()
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO_ROOT,
                        capture_output=True, text=True, timeout=timeout)
  if proc.returncode:
    raise AssertionError(f"multi-device snippet failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-6000:]}")
  results = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
  if len(results) != 1:
    raise AssertionError(f"expected one RESULT line, got {len(results)}:\n{proc.stdout[-3000:]}")
  return json.loads(results[0]), proc.stderr
