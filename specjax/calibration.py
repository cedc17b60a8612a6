"""Forward costs f(n) measured for the model, dtype, batch rows and host a generation runs on.

Adaptive drafting (specjax/adaptive.py) prices a round with f(n): the time of a target forward over n rows (batch
rows x new tokens per row) over a 1-row one. How f grows with n depends on the model (SmolLM2-135M's products over
its 30 layers; Gemma-3-270M's LM head over a 262k vocabulary, 63% of a step), the dtype, the rows and the host (2
cores of an AMD EPYC with AVX-512 or of an Intel Xeon with AVX-512 VNNI and AMX multiply several rows at different
prices), so one typed table (`specjax.adaptive.CPU_FORWARD_COSTS`, SmolLM2 float32 on one CPU) misprices the rest.

`forward_costs(model, rows, tokens)` times the target's own jit-compiled forward at the batch's `rows` rows over
each of `tokens` new tokens per row (the widths the plan prices: `specjax.adaptive.priced_tokens`), and over 1 row
and 1 token, at position `CONTEXT` of a cache of `CACHE_LEN` positions (a typical Spec-Bench prompt and answer), on
the parameters decoding reads (`specjax.decoding.decode_params`: packed for the CPU kernels). Each forward is timed
as the decode loop runs it, inside a compiled `fori_loop` whose iterations depend on each other: seconds per forward
= (t(long loop) - t(short loop)) / (long - short), so the per-call overhead cancels; the cases are interleaved, one
long/short pair of each in turn, over `REPEATS` rounds (more, up to 9, while a case's rounds move by more than
`NOISY` of their median), and f(n) is the median over rounds of a case's time over the 1-row forward's in the same
round, so a drift of a shared machine hits both alike. Compiling is excluded (and reported); a case whose rounds
still moved by more than `NOISY` is logged: the machine was busy. The result, the points (n, f(n)) with f(1) = 1, is
written to `$SPECJAX_CACHE/forward_costs/<key digest>.json` (default ~/.cache/specjax), keyed by everything it depends
on (`cache_key`: the model's config, dtype and how its weights are stored (a GGUF's quantized blocks or arrays), rows
and tokens, the host's CPU, cores, backend and device, jax and jaxlib, whether the CPU kernels run), atomically (a
temporary file renamed over it); later runs read it. A file that does not parse, or holds another key or invalid
points, is measured again and rewritten, not an error.

XLA's own count of a compiled forward (`cost_analysis`: flops and bytes) was the cheaper alternative, with no timing
at all; it cannot see into the CPU kernels (XLA custom calls, which run every product and attention of a decode step
here): for SmolLM2's forward over 1, 2, 5 and 17 tokens it counts 0.5, 1.0, 2.4 and 8.3 MFLOP, where the products
alone are 270 MFLOP a token, and bytes that jump 4x from 1 token to 2 (49 and 212 MB) while the time grows ~1.1x.
Timing is the only measure that sees what the kernels do.

`for_generation` is what `specjax.generate` calls before compiling a speculative program: the table an
`AdaptiveDrafting` policy with `forward_costs=None` plans with, and where it came from ("calibrated": measured now;
"cached": measured before; "typed table": an explicit table, or the backend's typed one where calibration does not
run). `SPECJAX_CALIBRATE` chooses where it runs: unset, on a CPU (accelerators keep the flat
`ACCELERATOR_FORWARD_COSTS`); "1", on any backend; "0", nowhere. It never runs on a mesh or in a multi-process run
(every process must plan the same program, and the sharded forward is another program): those plan with the typed
table.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import statistics
import tempfile
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from absl import logging

from specjax import compilation
from specjax.config import cache_dir as cache_root
from specjax.adaptive import AdaptiveDrafting, default_forward_costs, priced_tokens

CONTEXT = 256  # tokens in the cache before the timed forward's (a Spec-Bench prompt and part of its answer)
CACHE_LEN = 512  # cache positions (at most the model's context length)
REPEATS = 5  # interleaved rounds, up to 9 on a busy machine (`interleaved_seconds`); the median counts
SHORT, LONG = 1, 4  # forwards in the short and the long timed loop
MIN_SECONDS = 0.03  # the long loop is lengthened (doubling) until it takes this long, so that tiny steps time well
MAX_CALLS = 1024
NOISY = 0.1  # a case whose rounds move by more than this share of their median was timed on a busy machine: a warning
VERSION = 1  # of the measurement: a change to how f(n) is measured keys new cache files
SOURCES = ("calibrated", "cached", "typed table")


@dataclasses.dataclass(frozen=True)
class Calibration:
  """A table of forward costs and where it came from."""
  points: tuple[tuple[int, float], ...]  # (n, f(n)): n = rows x tokens, f(1) = 1
  source: str  # one of SOURCES
  seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # measure: "compile", "timing"; else empty
  path: str | None = None  # the cache file (None: not cached)


def cache_dir() -> str:
  """Where calibrations are kept: $SPECJAX_CACHE/forward_costs (default ~/.cache/specjax/forward_costs)."""
  return cache_root("forward_costs")


def mode() -> str:
  """SPECJAX_CALIBRATE: "auto" (unset: on a CPU only), "1" (on any backend) or "0" (never)."""
  value = os.environ.get("SPECJAX_CALIBRATE", "").strip().lower()
  if value in ("", "auto"):
    return "auto"
  if value in ("0", "1"):
    return value
  raise ValueError(f"SPECJAX_CALIBRATE must be 0, 1 or unset (auto: on a CPU), got {value!r}")


@functools.cache
def _cpu() -> dict[str, str]:
  """The CPU's model name and a digest of its feature flags (AVX-512, VNNI, AMX, ... change what products cost)."""
  fields: dict[str, str] = {}
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
  except OSError:
    pass
  flags = " ".join(sorted((fields.get("flags") or fields.get("Features") or "").split()))
  return {"model": fields.get("model name") or platform.processor(), "machine": platform.machine(),
          "flags": hashlib.sha256(flags.encode()).hexdigest()[:16]}


def host_key() -> dict[str, Any]:
  """What the host adds to a calibration's key: CPU, cores this process may use, backend and device, jax, jaxlib,
  XLA's flags and whether the CPU kernels run (their build, which is keyed by their source)."""
  import jaxlib
  from specjax.backends import cpu
  try:
    cores = len(os.sched_getaffinity(0))
  except (AttributeError, OSError):
    cores = os.cpu_count()
  kernels = os.path.basename(cpu.library_path()) if cpu.available() else None
  return {"cpu": _cpu(), "cores": cores, "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
          "jax": jax.__version__, "jaxlib": jaxlib.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "cpu_kernels": kernels}


def weights_key(params) -> str:
  """A digest of how the parameters are stored: every array's path, dtype and shape, and of a quantized weight
  (`specjax.backends.cpu.Quantized`, `specjax.load(..., quantized=True)`) its kind and layout instead of the float32
  it stands for. A quantized model and the float32 one of its config read other bytes with other kernels, and a
  verification over several tokens costs them differently: they must not share a table."""
  from specjax.backends import cpu
  leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, cpu.Quantized))
  described = []
  for path, leaf in leaves:
    if isinstance(leaf, cpu.Quantized):
      what = [leaf.kind, list(leaf.shape), leaf.k_dims, leaf.transposed, list(leaf.data.shape)]
    else:
      what = [str(jnp.dtype(leaf.dtype)), list(leaf.shape)]
    described.append([jax.tree_util.keystr(path), *what])
  return hashlib.sha256(json.dumps(described).encode()).hexdigest()[:16]


def cache_key(model, rows: int, tokens: Sequence[int]) -> dict[str, Any]:
  """Everything a calibration depends on: the model's config (its dtype included), how its weights are stored
  (`weights_key`: quantized or not, and as which blocks), the rows and tokens per row timed (one token always), the
  position the forward is timed at, the host (`host_key`) and the measurement's version."""
  config = json.loads(json.dumps(dataclasses.asdict(model.config), default=str))
  return {"version": VERSION, "config": config, "dtype": model.config.dtype, "weights": weights_key(model.params),
          "rows": int(rows), "tokens": sorted({int(t) for t in tokens} | {1}),
          "context": _context(model.config, max(tokens))[0], "host": host_key()}


def cache_path(key: dict[str, Any], directory: str | None = None) -> str:
  """The file of the calibration keyed `key`: <directory, default `cache_dir()`>/<a digest of the key>.json."""
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
  return os.path.join(directory or cache_dir(), f"{digest}.json")


def _context(config, tokens: int) -> tuple[int, int]:
  """(position of the timed forward, cache length), within the model's context length."""
  cache_len = min(CACHE_LEN, config.max_position_embeddings)
  return max(0, min(CONTEXT, cache_len - tokens)), cache_len


def check_points(points) -> tuple[tuple[int, float], ...]:
  """`points` as a forward-cost table, or ValueError: what `AdaptiveDrafting(forward_costs=...)` accepts."""
  points = tuple((int(n), float(f)) for n, f in points)
  AdaptiveDrafting(forward_costs=points)
  return points


def read(path: str, key: dict[str, Any]) -> tuple[tuple[int, float], ...] | None:
  """The points cached at `path` for `key`; None when there are none, or when the file is corrupt (it does not parse,
  holds another key or invalid points: it is then measured again and rewritten)."""
  try:
    with open(path) as f:
      record = json.load(f)
    if record["key"] != json.loads(json.dumps(key)):
      raise ValueError("it holds another key")
    return check_points(record["points"])
  except (FileNotFoundError, NotADirectoryError):
    return None
  except (OSError, ValueError, KeyError, TypeError) as e:
    logging.warning("the forward-cost calibration at %s is unreadable (%s: %s); measuring again", path,
                    type(e).__name__, e)
    return None


def write(path: str, key: dict[str, Any], points, details: dict[str, Any]) -> bool:
  """Writes the record atomically (a temporary file beside `path`, renamed over it); False, logged, when the
  directory is not writable."""
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=os.path.dirname(path))
    try:
      with os.fdopen(fd, "w") as f:
        json.dump({"key": key, "points": [list(p) for p in points], **details}, f, indent=1)
      os.replace(tmp, path)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
    return True
  except OSError as e:
    logging.warning("could not cache the forward-cost calibration at %s: %s", path, e)
    return False


_unwritten: dict[str, tuple[tuple[int, float], ...]] = {}  # calibrations this process could not write, by path


def forward_costs(model, rows: int, tokens: Sequence[int], *, directory: str | None = None,
                  repeats: int = REPEATS) -> Calibration:
  """f(n) for `model` at `rows` rows and each of `tokens` new tokens per row, from the cache or measured (then
  cached): points (1, 1.0), (rows, f), (rows x t, f) for t in `tokens`."""
  rows, tokens = int(rows), sorted({int(t) for t in tokens} | {1})
  if rows < 1 or tokens[0] < 1:
    raise ValueError(f"rows and tokens must be positive, got rows={rows}, tokens={tokens}")
  key = cache_key(model, rows, tokens)
  path = cache_path(key, directory)
  points = read(path, key) or _unwritten.get(path)
  if points is not None:
    return Calibration(points, "cached", path=path)
  start = time.perf_counter()
  times, compile_seconds, noisy = measure(model, rows, tokens, repeats=repeats)
  points = table(times, rows)
  seconds = {"compile": compile_seconds, "timing": time.perf_counter() - start - compile_seconds}
  logging.info("calibrated forward costs for %s (%s) at %d rows in %.1f s (compiling %.1f s): %s",
               getattr(model, "name", "") or model.config.family, model.config.dtype, rows, sum(seconds.values()),
               compile_seconds, points)
  if max(noisy.values()) > NOISY:
    logging.warning("the forward costs at %s were timed on a busy machine (a forward's time moved by %.0f%% between "
                    "rounds): remove the file to measure them again on a quiet one", path, 100 * max(noisy.values()))
  details = {"seconds_per_forward": {f"{b}x{t}": s for (b, t), s in sorted(times.items())},
             "noise": {f"{b}x{t}": round(x, 4) for (b, t), x in sorted(noisy.items())}, "seconds": seconds,
             "measured": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
  if not write(path, key, points, details):
    _unwritten[path] = points
  return Calibration(points, "calibrated", seconds=seconds, path=path)


def table(times: dict[tuple[int, int], float], rows: int) -> tuple[tuple[int, float], ...]:
  """The points (n, f(n)) from seconds per forward by (rows, tokens): n = rows x tokens, over the (1, 1) forward;
  never below 1 (a forward over more rows is not cheaper: a ratio below 1 is noise). Where two shapes give one n
  (1 row x 8 tokens, 8 rows x 1 token), the batch's rows count."""
  base = times[1, 1]
  by_n = {1: 1.0}
  for (b, t), seconds in sorted(times.items(), key=lambda item: item[0][0] != rows):
    by_n.setdefault(b * t, round(max(1.0, seconds / base), 3))
  return check_points(sorted(by_n.items()))


@functools.partial(jax.jit, static_argnames=("config",), donate_argnums=(1,))
def _forward_loop(params, cache, tokens, position, calls, *, config):
  """`calls` target forwards over tokens [B, T] at `position`, each taking the previous one's greedy tokens (so
  none can be hoisted), writing the cache as verification does."""
  from specjax.model import forward

  def body(i, carry):
    tokens, cache = carry
    out = forward(params, tokens, cache, position, config)
    return jnp.argmax(out.logits, axis=-1).astype(jnp.int32), out.cache
  return jax.lax.fori_loop(0, calls, body, (tokens, cache))


def measure(model, rows: int, tokens: Sequence[int], *, repeats: int = REPEATS
            ) -> tuple[dict[tuple[int, int], float], float, dict[tuple[int, int], float]]:
  """({(rows, tokens): seconds per forward}, seconds spent compiling, {(rows, tokens): noise}) for the (1, 1) forward
  and `rows` rows over each of `tokens` (the module docstring). A case's seconds: the median over rounds of its time
  over the (1, 1) forward's in the round, times the (1, 1) forward's median; its noise: the median absolute deviation
  of its rounds over their median (`noise`)."""
  from specjax.decoding import decode_params
  from specjax.model import init_cache
  config = model.config
  params = decode_params(model)
  cases = sorted({(1, 1)} | {(int(rows), int(t)) for t in tokens})
  position, cache_len = _context(config, max(t for _, t in cases))
  runs: dict[tuple[int, int], Callable[[int], Any]] = {}
  compile_seconds = 0.0
  for b, t in cases:
    state = {"cache": init_cache(config, b, cache_len)}
    args = (jnp.ones((b, t), jnp.int32), jnp.full((b,), position, jnp.int32))
    start = time.perf_counter()
    compiled = _forward_loop.lower(params, state["cache"], *args, 1, config=config).compile(
        compiler_options=compilation.COMPILER_OPTIONS)  # as generate compiles
    compile_seconds += time.perf_counter() - start

    def run(calls, compiled=compiled, state=state, args=args):
      out, state["cache"] = compiled(params, state["cache"], *args, calls)
      return out
    runs[b, t] = run
  rounds = interleaved_seconds(runs, repeats)
  # Each case over the (1, 1) forward timed next to it in the same round (the load a round saw hits both), median
  # over rounds, in seconds of the (1, 1) forward's median.
  base = [max(x, 1e-9) for x in rounds[1, 1]]
  times = {case: max(statistics.median(base), 1e-9) * statistics.median(x / b for x, b in zip(r, base))
           for case, r in rounds.items()}
  return times, compile_seconds, {case: noise(r) for case, r in rounds.items()}


def _timed(run: Callable[[int], Any], calls: int) -> float:
  start = time.perf_counter()
  jax.block_until_ready(run(calls))
  return time.perf_counter() - start


def noise(rounds: Sequence[float]) -> float:
  """How much a case's rounds moved: their median absolute deviation over their median."""
  median = statistics.median(rounds)
  return statistics.median(abs(x - median) for x in rounds) / max(median, 1e-9)


def interleaved_seconds(runs: dict[Any, Callable[[int], Any]], repeats: int,
                        max_repeats: int | None = None) -> dict[Any, list[float]]:
  """Seconds per iteration of each `run(calls)` in each of `repeats` interleaved rounds: (t(long) - t(short)) /
  (long - short); each run's long loop doubled from LONG until it takes MIN_SECONDS (a tiny model's steps). While a
  run's rounds move by more than NOISY (`noise`), more rounds follow, up to `max_repeats` in all (default 2 x
  `repeats` - 1)."""
  lengths = {}
  for name, run in runs.items():
    _timed(run, SHORT)  # the first call of an executable pays for its setup
    calls, seconds = LONG, _timed(run, SHORT) * LONG / SHORT  # the long loop, estimated
    while seconds < MIN_SECONDS and calls < MAX_CALLS:
      calls *= 2
      seconds = _timed(run, calls)
    lengths[name] = calls
  deltas: dict[Any, list[float]] = {name: [] for name in runs}
  max_repeats = 2 * repeats - 1 if max_repeats is None else max_repeats
  while len(deltas[next(iter(runs))]) < repeats or (
      len(deltas[next(iter(runs))]) < max_repeats and max(noise(d) for d in deltas.values()) > NOISY):
    for name, run in runs.items():
      long = _timed(run, lengths[name])
      deltas[name].append((long - _timed(run, SHORT)) / (lengths[name] - SHORT))
  return deltas


def for_generation(policy, model, *, rows: int, gamma: int, tree_nodes: int | None, mesh=None) -> Calibration | None:
  """The forward costs an `AdaptiveDrafting` policy plans one program with (None for any other policy): its own
  table ("typed table"), or with `forward_costs=None` the calibrated one where calibration runs (`mode`, the module
  docstring; a failed measurement is logged and falls back), else the backend's typed table."""
  if not isinstance(policy, AdaptiveDrafting):
    return None
  if isinstance(policy.forward_costs, tuple):
    return Calibration(policy.forward_costs, "typed table")
  typed = Calibration(default_forward_costs(), "typed table")
  setting = mode()
  if (policy.forward_costs == "typed" or setting == "0" or (setting == "auto" and jax.default_backend() != "cpu")
      or mesh is not None or jax.process_count() > 1):
    return typed
  try:
    return forward_costs(model, rows, priced_tokens(gamma, tree_nodes))
  except Exception as e:  # noqa: BLE001 (a calibration that cannot run leaves the typed table, as documented)
    logging.warning("forward-cost calibration failed (%s: %s); planning with the typed table", type(e).__name__, e)
    return typed
