"""Command-line plumbing shared by the experiment commands (ml_collections config files on absl flags)."""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

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


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


@functools.cache
def _git(*args: str) -> str:
  """git's output for `args` in the checkout ("" where git is missing)."""
  try:
    return subprocess.run(["git", *args], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout
  except OSError:
    return ""


def code_commit() -> str | None:
  """The checkout's commit (`git describe --always --dirty`), as of the first call: entry points call it when
  they start, so a long run reports the code it ran even if the checkout moves on meanwhile."""
  return _git("describe", "--always", "--dirty").strip() or None


def uncommitted_paths() -> list[str]:
  """The tracked files the checkout holds uncommitted edits to (what `-dirty` in `code_commit` stands for)."""
  out = _git("status", "--porcelain", "--untracked-files=no")
  return sorted(line[3:].strip() for line in out.splitlines() if line.strip())


def code_digest() -> str:
  """A digest of the code a run computes with: every file of the specjax package (its source and the checkpoints it
  ships) and the source of every module of experiments/ the process has imported. Unlike `code_commit`, edits to
  anything else (docs, results, configs, whose values a run compares itself, modules the run does not import) leave
  it as it is, so a stopped run may resume after them."""
  import specjax  # the package as imported, wherever it is installed
  package = pathlib.Path(specjax.__file__).parent
  files = {p.relative_to(package.parent).as_posix(): p for p in package.rglob("*")
           if p.is_file() and "__pycache__" not in p.parts}
  files.update((name, pathlib.Path(module.__file__)) for name, module in list(sys.modules.items())
               if name.startswith("experiments.") and getattr(module, "__file__", None))
  digest = hashlib.sha256()
  for key in sorted(files):
    digest.update(key.encode() + b"\0" + files[key].read_bytes() + b"\0")
  return digest.hexdigest()[:16]


def file_digest(path: str) -> str | None:
  """sha256 of a file's bytes (None: no such file)."""
  if not os.path.isfile(path):
    return None
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()


class ResumableLog:
  """A JSON-lines log that a long command appends its finished pieces of work to as it goes (each line on disk before
  the next piece starts), so that the command, stopped and started again, resumes from what it finds.

  The first line is a header saying what the log's work computes (a config, the code, ...). Opening a log whose header
  is `header` (or, with `same`, one that `same(old_header)` accepts) keeps its entries (`entries`; a last line cut by
  a kill is dropped); a log with another header is moved aside to `<path>.<time>.stale` (what it held is not lost)
  and a new log headed by `header` is started, as it is where there was none.
  """

  def __init__(self, path: str, header: dict[str, Any], same: Callable[[dict[str, Any]], bool] | None = None):
    self.path = path
    header = json.loads(json.dumps(header))  # as it reads back from the file (tuples as lists)
    lines, cut = [], False
    if os.path.exists(path):
      with open(path) as f:
        for line in f:
          try:
            lines.append(json.loads(line))
          except json.JSONDecodeError:  # only the last line can be cut short (by a kill while writing it)
            cut = True
            break
    old = lines[0].get("header") if lines and isinstance(lines[0], dict) else None
    if old is not None and (same(old) if same is not None else old == header):
      self.entries: list[dict[str, Any]] = lines[1:]
      if cut:  # appending after a cut line would join the two
        write_atomic(path, "".join(json.dumps(line) + "\n" for line in lines))
      return
    if os.path.exists(path):
      os.replace(path, f"{path}.{time.strftime('%Y%m%d-%H%M%S')}.stale")
    self.entries = []
    write_atomic(path, json.dumps({"header": header}) + "\n")

  def append(self, entry: dict[str, Any]) -> None:
    with open(self.path, "a") as f:
      f.write(json.dumps(entry) + "\n")
      f.flush()
      os.fsync(f.fileno())
    self.entries.append(json.loads(json.dumps(entry)))


def environment() -> dict[str, Any]:
  commit = code_commit()
  return {"jax": jax.__version__, "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
          "cpu_count": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
          "numpy": np.__version__, "specjax_commit": commit}
