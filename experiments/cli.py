"""Command-line plumbing shared by the experiment commands (ml_collections config files on absl flags)."""

from __future__ import annotations

import sys

from absl import app


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parser, with a one-line error for a --config.<field> override the config does not have."""
  try:
    return app.parse_flags_with_usage(argv)
  except AttributeError as e:  # ml_collections wraps a KeyError whose message suggests the closest field
    message = e.args[0].args[0] if e.args and isinstance(e.args[0], KeyError) else str(e)
    sys.exit(f"FATAL config override: no such field {message}")
