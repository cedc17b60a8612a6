"""Command-line plumbing shared by the experiment commands (ml_collections config files on absl flags)."""

from __future__ import annotations

import functools
import glob
import os
import platform
import subprocess
import sys
import tempfile
from typing import Any

import jax
import numpy as np
from absl import flags
from ml_collections import config_flags


def define_config_flag(help_text: str):
  """The --config flag (an ml_collections config file), defined once per process: several experiment modules
  can be imported together (tests, notebooks) and each is also a command of its own. Read it as `.value`."""
  if "config" not in flags.FLAGS:
    config_flags.DEFINE_config_file("config", None, help_text, lock_config=True)
  return flags.FLAGS["config"]


def define_workdir_flag(help_text: str):
  """The --workdir flag, defined once per process as `define_config_flag` is. Read it as `.value`."""
  if "workdir" not in flags.FLAGS:
    flags.DEFINE_string("workdir", None, help_text)
  return flags.FLAGS["workdir"]


def _missing_config(path: str) -> str:
  configs = [c for c in sorted(glob.glob(os.path.join("configs", "*.py"))) if not c.endswith("__init__.py")]
  return f"FATAL --config: no config file {path!r}" + (f"; configs here: {', '.join(configs)}" if configs else "")


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parser, with one-line errors for a config file that does not load and an override it does not have."""
  # Checked first: overrides of a config file that does not exist would fail with a traceback of their own.
  for arg in argv[1:]:
    if arg.startswith("--config=") and not os.path.isfile(arg[len("--config="):].split(":", 1)[0]):
      sys.exit(_missing_config(arg[len("--config="):].split(":", 1)[0]))
  try:
    argv = flags.FLAGS(argv)
  except AttributeError as e:  # ml_collections wraps a KeyError whose message suggests the closest field
    message = e.args[0].args[0] if e.args and isinstance(e.args[0], KeyError) else str(e)
    sys.exit(f"FATAL config override: no such field {message}")
  except flags.Error as e:
    if str(e).startswith("flag --config=") and e.__context__ is not None:  # get_config raised: not its traceback
      while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
      sys.exit(f"FATAL --config: {e}")
    sys.exit(f"FATAL Flags parsing error: {e}\nPass --helpshort or --helpfull to see help on flags.")
  if "config" in flags.FLAGS:
    try:
      dict(flags.FLAGS["config"].value or {})  # ml_collections defers a file that did not load until it is read
    except OSError:
      sys.exit(_missing_config(config_flags.get_config_filename(flags.FLAGS["config"]).split(":", 1)[0]))
  return argv


def write_atomic(path: str, data: str | bytes) -> None:
  """Writes `data` to `path` through a temporary file beside it, flushed to disk and renamed over it: a reader never
  sees a half-written file, a killed or failed write leaves the previous one (and no temporary file), and the file
  gets the permissions open() would give it."""
  folder = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
  try:
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would make the file private
    with os.fdopen(fd, "wb") as f:
      f.write(data.encode() if isinstance(data, str) else data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


@functools.cache
def code_commit() -> str | None:
  """The checkout's commit (`git describe --always --dirty`), as of the first call: entry points call it when
  they start, so a long run reports the code it ran even if the checkout moves on meanwhile."""
  try:
    return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip() or None
  except OSError:
    return None


def environment() -> dict[str, Any]:
  commit = code_commit()
  return {"jax": jax.__version__, "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
          "cpu_count": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
          "numpy": np.__version__, "specjax_commit": commit}
