r"""What a forward over T tokens and B rows costs against a 1-token, 1-row step, causal (a chain's verification,
B rows of decoding) and under a draft tree's mask, with and without specjax's CPU kernels, on SmolLM2-135M.

  python benchmarks/bench_verify.py [--tokens=1,2,5,...] [--batch_sizes=4,8] [--batch_tokens=1,5,17]
                                    [--nodes=8,16,32,64] [--repeats=5]

Verification over gamma + 1 tokens and decoding over B rows both multiply a few rows by every weight; while the
weights' bytes dominate, each should cost about one step. A tree of N nodes is verified by one forward over
[pending, N nodes] in which a node sees the committed cache and its ancestors (`specjax.trees`,
`specjax.model.BlockMask`; here every node has 4 children, breadth first: the mask's shape does not change the
work). For each implementation ("xla": XLA only, on the weights as loaded; "kernel": the CPU kernels on the
packed weights `generate` reads, for every product and for attention over the cache of up to
`cpu.MAX_QUERY_TOKENS` tokens per row) and each case, the cost of one forward at position `--position` over a
cache of `--cache_len` is timed inside a compiled loop, as `experiments.costs` does: (t(long loop) - t(short
loop)) / (long - short), so per-call overhead cancels. All cases run interleaved, medians over `--repeats`
rounds. Reported: ms per forward, r = t / t(1 row, 1 token) of the same implementation, kernel / xla time, a
tree's time over the causal forward of as many tokens, and the largest logit difference between the two
implementations. Compilation is excluded and reported. Last, the kernel column's causal costs by rows (B x T):
the `forward_costs` points adaptive drafting plans chains and trees with (`specjax.adaptive.CPU_FORWARD_COSTS`).
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
from specjax import sampling, trees
from specjax.backends import cpu
from specjax.decoding import decode_params
from specjax.model import forward, init_cache

_TOKENS = flags.DEFINE_list("tokens", ["1", "2", "3", "5", "8", "9", "16", "17", "24", "32", "33", "48", "64", "65"],
                            "Tokens per row (T) of the causal cases of one row.")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["4", "8"], "Rows (B) of the batched causal cases.")
_BATCH_TOKENS = flags.DEFINE_list("batch_tokens", ["1", "5", "17"], "Tokens per row of each batched case.")
_NODES = flags.DEFINE_list("nodes", ["8", "16", "32", "64"], "Tree sizes N (nodes besides the pending token), one "
                           "row each; the causal case of N + 1 tokens is added if --tokens lacks it.")
_POSITION = flags.DEFINE_integer("position", 100, "Tokens already in the cache.")
_CACHE_LEN = flags.DEFINE_integer("cache_len", 512, "Cache positions.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Interleaved timing rounds.")
_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model name or path for specjax.load.")
CHILDREN = 4


def bushy_parents(batch: int, nodes: int) -> np.ndarray:
  """Each node's parent (a block index) in a tree whose every node has CHILDREN children, breadth first."""
  return np.broadcast_to(np.arange(nodes, dtype=np.int32) // CHILDREN, (batch, nodes))


@functools.partial(jax.jit, static_argnames=("config", "kernel", "tree"), donate_argnums=(1,))
def _loop(params, cache, tokens, position, parents, calls, *, config, kernel, tree):
  with cpu.enabled(kernel):
    block = trees.describe(parents, *parents.shape).block_mask() if tree else None

    def body(i, carry):
      tokens, cache = carry
      out = forward(params, tokens, cache, position, config, block=block)
      return sampling.argmax(out.logits), out.cache  # a dependency between iterations
    return jax.lax.fori_loop(0, calls, body, (tokens, cache))


@functools.partial(jax.jit, static_argnames=("config", "kernel", "tree"))
def _logits(params, cache, tokens, position, parents, *, config, kernel, tree):
  with cpu.enabled(kernel):
    block = trees.describe(parents, *parents.shape).block_mask() if tree else None
    return forward(params, tokens, cache, position, config, block=block).logits


def main(argv):
  del argv
  model = specjax.load(_MODEL.value)
  config = model.config
  if not cpu.available():
    raise SystemExit(f"the CPU kernel is not available here: {cpu.status()}")
  weights = {False: model.params, True: decode_params(model)}  # the kernel reads packed weights
  rng = np.random.default_rng(0)
  context = rng.integers(3, config.vocab_size, size=_POSITION.value).astype(np.int32)
  nodes = [int(n) for n in _NODES.value]
  cases = [(1, int(t), False) for t in _TOKENS.value] + [(1, n + 1, False) for n in nodes]
  cases += [(int(b), int(t), False) for b in _BATCH_SIZES.value for t in _BATCH_TOKENS.value]
  cases = sorted(dict.fromkeys(cases + [(1, 1, False)] + [(1, n + 1, True) for n in nodes]))
  filled, runs, compile_s, diffs = {}, {}, {}, {}
  for b, t, tree in cases:
    if b not in filled:
      filled[b] = _loop(model.params, init_cache(config, b, _CACHE_LEN.value), jnp.asarray(np.tile(context, (b, 1))),
                        jnp.zeros(b, jnp.int32), jnp.zeros((b, 0), jnp.int32), 1, config=config, kernel=False,
                        tree=False)[1]
    tokens = jnp.asarray(rng.integers(3, config.vocab_size, size=(b, t)).astype(np.int32))
    position = jnp.full((b,), _POSITION.value, jnp.int32)
    parents = jnp.asarray(bushy_parents(b, t - 1))
    logits = {k: _logits(weights[k], filled[b], tokens, position, parents, config=config, kernel=k, tree=tree)
              for k in (False, True)}
    diffs[(b, t, tree)] = float(jnp.max(jnp.abs(logits[True] - logits[False])))
    for kernel in (False, True):
      key = ("kernel" if kernel else "xla", b, t, tree)
      cache = {"value": jax.tree.map(jnp.copy, filled[b])}

      def run(calls, cache=cache, tokens=tokens, position=position, parents=parents, kernel=kernel, tree=tree):
        out, cache["value"] = _loop(weights[kernel], cache["value"], tokens, position, parents, calls,
                                    config=config, kernel=kernel, tree=tree)
        return out
      compile_s[key] = timed(run, 2)
      runs[key] = run
  seconds = interleaved_seconds(runs, _REPEATS.value)

  print(f"\nSmolLM2-135M forward cost, float32, position {_POSITION.value}, cache {_CACHE_LEN.value}; jax "
        f"{jax.__version__}, {os.cpu_count()} CPUs; median of {_REPEATS.value} interleaved rounds (compile: "
        f"{sum(compile_s.values()):.0f} s, excluded)\n")
  header = (f"{'case':>6} {'B':>3} {'T':>3} {'xla ms':>8} {'kernel ms':>10} {'r xla':>7} {'r kernel':>9} "
            f"{'kernel/xla':>11} {'tree/causal':>12} {'max |dlogit|':>13}")
  print(header)
  print("-" * len(header))
  base = {impl: seconds[(impl, 1, 1, False)] for impl in ("xla", "kernel")}
  for b, t, tree in cases:
    x, k = seconds[("xla", b, t, tree)], seconds[("kernel", b, t, tree)]
    versus = f"{k / seconds[('kernel', b, t, False)]:>12.2f}" if tree else f"{'':>12}"
    print(f"{'tree' if tree else 'causal':>6} {b:>3} {t:>3} {1e3 * x:>8.2f} {1e3 * k:>10.2f} {x / base['xla']:>7.2f} "
          f"{k / base['kernel']:>9.2f} {k / x:>11.2f} {versus} {diffs[(b, t, tree)]:>13.1e}")
  print(f"\nr: the forward's time over the same implementation's 1-row, 1-token forward; tree/causal: the kernel "
        f"column's tree of N nodes over its causal forward of N + 1 tokens. The kernels serve products and "
        f"attention over the cache of up to {cpu.MAX_QUERY_TOKENS} tokens per row (beyond, XLA's attention).")
  # Adaptive drafting's cost model on this machine: f(n), a causal forward over n = B x T rows over a 1-row one.
  by_rows: dict[int, list[float]] = {}
  for b, t, tree in cases:
    if not tree:
      by_rows.setdefault(b * t, []).append(seconds[("kernel", b, t, tree)] / base["kernel"])
  points = tuple((n, round(float(np.median(f)), 2)) for n, f in sorted(by_rows.items()))
  print(f"\nFor adaptive drafting on this machine (specjax/adaptive.py; rows = B x T, kernel column, causal):\n"
        f"  specjax.AdaptiveDrafting(forward_costs={points})")


if __name__ == "__main__":
  app.run(main)
