"""Counts new XLA programs, so that a timed call which had to build one can be detected and rerun."""

import jax

_EVENTS = (
    "/jax/core/compile/backend_compile_duration",
    # Tracing too: with a persistent compilation cache a new shape is traced and loaded, not compiled.
    "/jax/core/compile/jaxpr_trace_duration",
)
_count = [0]


def _listener(event: str, duration: float, **kwargs) -> None:
  if event in _EVENTS:
    _count[0] += 1


jax.monitoring.register_event_duration_secs_listener(_listener)


def count() -> int:
  """Programs compiled (or traced and loaded from the persistent cache) in this process so far."""
  return _count[0]
