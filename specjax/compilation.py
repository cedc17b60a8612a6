"""Compilation, kept apart from decoding: explicitly compiled programs, their compile time, and a counter.

`jax.jit` compiles a program the first time it meets new static arguments or argument shapes, inside that
call, so the call's wall time mixes compiling (tens of seconds for SmolLM2 on a CPU) with decoding. `Program`
compiles ahead of time instead (`jitted.lower(...).compile()`), once per static arguments and argument
shapes, dtypes and shardings, and returns how long compiling took, so that `generate` can report
`compile_seconds` apart from the decoding time. It logs (absl, INFO) when it starts compiling, since a new
shape bucket makes a call pause for as long as compiling takes.

Every program is compiled with `COMPILER_OPTIONS`: XLA rounds each operation's result to its declared type. By
default XLA may keep a fusion's intermediate bfloat16 values in float32 ("excess precision"), and which values it
keeps depends on how it fuses, which depends on the shapes: a bfloat16 target's logits for a token then differed
between a 1-token decode step and a 5-token verification, and greedy speculative decoding of Gemma-3-270M diverged
from autoregressive decoding at a near tie (a Spec-Bench prompt, prompt lookup, token 26). Float32 programs are
unaffected.

`count()` counts every program XLA builds in this process (ours and any other jit), so that a caller can
tell whether a timed call had to build one.

Executables hold memory mappings: XLA:CPU maps each kernel of a program apart (a SmolLM2 speculative program
with adaptive drafting: ~1,400 mappings), and Linux refuses more than `vm.max_map_count` (65,530 by default)
per process, which makes LLVM fail with "Cannot allocate memory" and the process crash. So before compiling,
where /proc/self/maps exists and the process holds more than `MAP_BUDGET` of that limit, JAX's caches are
cleared (they keep every executable alive, ours included) and then the least recently used executables of every
`Program` are dropped until it holds less; a dropped one is compiled again if it is called again.
"""

from __future__ import annotations

import collections
import gc
import itertools
import time
import weakref
from typing import Any, Callable

import jax
from absl import logging

_EVENTS = (
    "/jax/core/compile/backend_compile_duration",
    # Tracing too: with a persistent compilation cache a new shape is traced and loaded, not compiled.
    "/jax/core/compile/jaxpr_trace_duration",
)
_count = [0]
_programs: "weakref.WeakSet[Program]" = weakref.WeakSet()
_clock = itertools.count()  # orders the uses of executables across programs
MAP_BUDGET = 0.6  # share of vm.max_map_count the executables may bring the process to before the oldest go
# Every result rounded to its type whatever the fusion, so a program's numbers do not depend on its shapes.
COMPILER_OPTIONS = {"xla_allow_excess_precision": False}


def _map_count() -> int | None:
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:
    return None


def _map_limit() -> int:
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):
    return 65530


def _make_room() -> None:
  """Frees executables while the process holds too many mappings: first those only JAX's own caches hold (other
  jits, executables the Programs already dropped), then the least recently used of every `Program`."""
  count, budget = _map_count(), MAP_BUDGET * _map_limit()
  if count is None or count <= budget:
    return
  # An AOT-compiled executable is also kept by JAX's compilation caches, so dropping it from a Program frees
  # nothing until those are cleared.
  jax.clear_caches()
  count, dropped = _map_count(), 0
  while count > budget:
    held = [(used, program, key) for program in list(_programs) for key, (_, used) in program._compiled.items()]
    if not held:
      break
    _, program, key = min(held, key=lambda h: h[0])
    del program._compiled[key]
    dropped += 1
    before, count = count, _map_count()
    if count >= before:  # held by a reference cycle, or not an executable's mappings at all
      gc.collect()
      count = _map_count()
      if count >= before:
        break
  if count > budget:
    logging.warning("the process holds %d memory mappings (%d allowed), and not in executables specjax can drop",
                    count, _map_limit())
  elif dropped:
    logging.info("dropped %d least recently used executables: the process held too many memory mappings (%s of "
                 "%d allowed)", dropped, count, _map_limit())


def _listener(event: str, duration: float, **kwargs) -> None:
  if event in _EVENTS:
    _count[0] += 1


jax.monitoring.register_event_duration_secs_listener(_listener)


def count() -> int:
  """Programs compiled (or traced and loaded from the persistent cache) in this process so far."""
  return _count[0]


def _signature(tree: Any) -> tuple:
  """What a compiled executable is specialised to besides static arguments: structure, shapes, dtypes, shardings."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((jax.numpy.shape(x), jax.numpy.result_type(x), getattr(x, "sharding", None),
                         getattr(x, "weak_type", False)) for x in leaves)


class Program:
  """A `jax.jit` function compiled ahead of time, once per static arguments and argument signature.

  `program(*args, describe=..., **static)` returns (outputs, compile_seconds): 0.0 when an executable for
  this signature was already compiled. Keeps the `max_programs` most recently used executables.
  """

  def __init__(self, jitted: Callable, name: str, max_programs: int = 32):
    self.jitted, self.name, self.max_programs = jitted, name, max_programs
    self._compiled: collections.OrderedDict = collections.OrderedDict()
    _programs.add(self)

  def __call__(self, *args, describe: str = "", **static) -> tuple[Any, float]:
    key = (_signature(args), tuple(sorted(static.items())))
    held = self._compiled.get(key)
    compile_seconds = 0.0
    if held is None:
      _make_room()
      logging.info("compiling %s for a new shape bucket (%s); calls with these shapes reuse it", self.name, describe)
      start = time.perf_counter()
      compiled = self.jitted.lower(*args, **static).compile(compiler_options=COMPILER_OPTIONS)
      compile_seconds = time.perf_counter() - start
      logging.info("compiled %s in %.1f s", self.name, compile_seconds)
      while len(self._compiled) >= self.max_programs:
        self._compiled.popitem(last=False)
    else:
      compiled = held[0]
    self._compiled[key] = (compiled, next(_clock))
    self._compiled.move_to_end(key)
    return compiled(*args), compile_seconds

  def cache_size(self) -> int:
    """Executables held."""
    return len(self._compiled)

  def clear(self) -> None:
    """Forgets every executable (and the jit's traces), so that the next call traces and compiles afresh."""
    self._compiled.clear()
    self.jitted.clear_cache()


def clear_all() -> None:
  """Forgets every compiled executable: each `Program`'s and every jit cache (`jax.clear_caches`), e.g. to give
  their memory back in a long session or between test modules."""
  for program in list(_programs):
    program.clear()
  jax.clear_caches()
