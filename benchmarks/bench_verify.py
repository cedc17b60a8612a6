r"""What a forward over T tokens and B rows costs against a 1-token, 1-row step, with and without specjax's CPU
kernels (`specjax.backends.cpu`: matrix products over packed weights, decode attention), on SmolLM2-135M.

  python benchmarks/bench_verify.py [--tokens=1,2,5,8,16,32,64] [--batch_sizes=1,4,8] [--repeats=5]

Verification over gamma + 1 tokens and decoding over B rows both multiply a few rows by every weight; while the
weights' bytes dominate, each should cost about one step. For each implementation ("xla": XLA only, on the
weights as loaded; "kernel": the CPU kernels on the packed weights `generate` reads, for every product and for
attention of up to `cpu.MAX_QUERY_TOKENS` tokens per row) and each (B, T), the cost of one forward at
position `--position` over a cache of `--cache_len` is timed inside a compiled loop, as `experiments.costs` does:
(t(long loop) - t(short loop)) / (long - short), so per-call overhead cancels. All cases run interleaved,
medians over `--repeats` rounds. Reported: ms per forward, r = t(B, T) / t(1, 1) of the
same implementation, kernel / xla time, and the largest logit difference between the two implementations.
Compilation is excluded and reported. Last, the kernel column's costs by rows (B x T) as the `forward_costs`
points adaptive drafting plans with (`specjax.AdaptiveDrafting(forward_costs=...)`).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import specjax
from experiments.costs import interleaved_seconds, timed
from specjax import sampling
from specjax.backends import cpu
from specjax.decoding import decode_params
from specjax.model import forward, init_cache

_TOKENS = flags.DEFINE_list("tokens", ["1", "2", "5", "8", "16", "32", "64"], "Tokens per row (T).")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "4", "8"], "Rows (B), each at T = 1 and T = --gamma + 1.")
_GAMMA = flags.DEFINE_integer("gamma", 4, "Batch cases also verify gamma + 1 tokens per row.")
_POSITION = flags.DEFINE_integer("position", 100, "Tokens already in the cache.")
_CACHE_LEN = flags.DEFINE_integer("cache_len", 512, "Cache positions.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Interleaved timing rounds.")
_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model name or path for specjax.load.")


@functools.partial(jax.jit, static_argnames=("config", "kernel"), donate_argnums=(1,))
def _loop(params, cache, tokens, position, calls, *, config, kernel):
  with cpu.enabled(kernel):
    def body(i, carry):
      tokens, cache = carry
      out = forward(params, tokens, cache, position, config)
      return sampling.argmax(out.logits), out.cache
    return jax.lax.fori_loop(0, calls, body, (tokens, cache))


@functools.partial(jax.jit, static_argnames=("config", "kernel"))
def _logits(params, cache, tokens, position, *, config, kernel):
  with cpu.enabled(kernel):
    return forward(params, tokens, cache, position, config).logits


def main(argv):
  del argv
  model = specjax.load(_MODEL.value)
  config = model.config
  if not cpu.available():
    raise SystemExit(f"the CPU kernel is not available here: {cpu.status()}")
  weights = {False: model.params, True: decode_params(model)}  # the kernel reads packed weights
  rng = np.random.default_rng(0)
  context = rng.integers(3, config.vocab_size, size=_POSITION.value).astype(np.int32)
  shapes = [(1, int(t)) for t in _TOKENS.value]
  for b in map(int, _BATCH_SIZES.value):
    shapes += [(b, 1), (b, _GAMMA.value + 1)]
  shapes = list(dict.fromkeys(shapes))
  caches, runs, compile_s, diffs = {}, {}, {}, {}
  for b, t in shapes:
    prompt = jnp.asarray(np.tile(context, (b, 1)))
    filled = _loop(model.params, init_cache(config, b, _CACHE_LEN.value), prompt, jnp.zeros(b, jnp.int32), 1,
                   config=config, kernel=False)[1]
    tokens = jnp.asarray(rng.integers(3, config.vocab_size, size=(b, t)).astype(np.int32))
    position = jnp.full((b,), _POSITION.value, jnp.int32)
    logits = {k: _logits(weights[k], filled, tokens, position, config=config, kernel=k) for k in (False, True)}
    diffs[(b, t)] = float(jnp.max(jnp.abs(logits[True] - logits[False])))
    for kernel in (False, True):
      key = ("kernel" if kernel else "xla", b, t)
      caches[key] = jax.tree.map(jnp.copy, filled)

      def run(calls, key=key, tokens=tokens, position=position, kernel=kernel):
        out, caches[key] = _loop(weights[kernel], caches[key], tokens, position, calls, config=config,
                                 kernel=kernel)
        return out
      compile_s[key] = timed(run, 2)
      runs[key] = run
  seconds = interleaved_seconds(runs, _REPEATS.value)

  print(f"\nSmolLM2-135M forward cost, float32, position {_POSITION.value}, cache {_CACHE_LEN.value}; jax "
        f"{jax.__version__}, {os.cpu_count()} CPUs; median of {_REPEATS.value} interleaved rounds (compile: "
        f"{sum(compile_s.values()):.0f} s, excluded)\n")
  header = (f"{'B':>3} {'T':>3} {'xla ms':>8} {'kernel ms':>10} {'r xla':>7} {'r kernel':>9} {'kernel/xla':>11} "
            f"{'max |dlogit|':>13}")
  print(header)
  print("-" * len(header))
  base = {impl: seconds[(impl, 1, 1)] for impl in ("xla", "kernel")}
  for b, t in shapes:
    x, k = seconds[("xla", b, t)], seconds[("kernel", b, t)]
    print(f"{b:>3} {t:>3} {1e3 * x:>8.2f} {1e3 * k:>10.2f} {x / base['xla']:>7.2f} {k / base['kernel']:>9.2f} "
          f"{k / x:>11.2f} {diffs[(b, t)]:>13.1e}")
  print(f"\nr: the forward's time over the same implementation's 1-row, 1-token forward. The kernels serve products "
        f"and attention of up to {cpu.MAX_QUERY_TOKENS} tokens per row (beyond, XLA's attention).")
  # Adaptive drafting's cost model on this machine: f(n), a forward over n = B x T rows over a 1-row one.
  by_rows: dict[int, list[float]] = {}
  for b, t in shapes:
    by_rows.setdefault(b * t, []).append(seconds[("kernel", b, t)] / base["kernel"])
  points = tuple((n, round(float(np.median(f)), 2)) for n, f in sorted(by_rows.items()))
  print(f"\nFor adaptive drafting on this machine (specjax/adaptive.py; rows = B x T, kernel column):\n"
        f"  specjax.AdaptiveDrafting(forward_costs={points})")


if __name__ == "__main__":
  app.run(main)
