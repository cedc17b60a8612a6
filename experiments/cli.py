"""Command-line plumbing shared by the experiment commands (ml_collections config files on absl flags)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from typing import Any

import jax
import numpy as np
from absl import app


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parser, with a one-line error for a --config.<field> override the config does not have."""
  try:
    return app.parse_flags_with_usage(argv)
  except AttributeError as e:  # ml_collections wraps a KeyError whose message suggests the closest field
    message = e.args[0].args[0] if e.args and isinstance(e.args[0], KeyError) else str(e)
    sys.exit(f"FATAL config override: no such field {message}")


def environment() -> dict[str, Any]:
  try:
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip() or None
  except OSError:
    commit = None
  return {"jax": jax.__version__, "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
          "cpu_count": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
          "numpy": np.__version__, "specjax_commit": commit}
