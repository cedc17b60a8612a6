r"""What verifying a draft tree costs against verifying a chain, on SmolLM2-135M: one target forward over
[pending, N nodes] under a tree mask (`specjax.trees`) against one over [pending, x_1..x_gamma], causal.

  python benchmarks/bench_trees.py [--nodes=8,16,32,64] [--gamma=4] [--batch_size=1] [--repeats=5]

A tree's nodes see the committed cache and their ancestors (`specjax.model.BlockMask`); every node sees the whole
committed cache, so attention over it needs no mask and the CPU kernel serves it, merged with the block's own
masked attention by their softmax denominators (`specjax.ops.attention`). For each implementation ("xla": XLA
only, weights as loaded; "kernel": the CPU kernels on the packed weights `generate` reads) the forward of a
1-token step, a chain of `--gamma` drafts and a tree of each `--nodes` count (4 children per node, in breadth-first
order: the mask's shape does not change the work), and a causal forward over as many tokens, is timed inside a compiled loop as `experiments.costs` does:
(t(long loop) - t(short loop)) / (long - short), all cases interleaved, medians over `--repeats` rounds.
Reported: ms per forward, r = t / t(1-token step) of the same implementation, and tree / chain.
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

_NODES = flags.DEFINE_list("nodes", ["8", "16", "32", "64"], "Tree sizes N (nodes besides the pending token).")
_GAMMA = flags.DEFINE_integer("gamma", 4, "The chain's drafts.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 1, "Rows, each its own tree.")
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


def main(argv):
  del argv
  model = specjax.load(_MODEL.value)
  config = model.config
  if not cpu.available():
    raise SystemExit(f"the CPU kernel is not available here: {cpu.status()}")
  weights = {False: model.params, True: decode_params(model)}  # the kernel reads packed weights
  rng = np.random.default_rng(0)
  b = _BATCH_SIZE.value
  prompt = jnp.asarray(np.tile(rng.integers(3, config.vocab_size, size=_POSITION.value).astype(np.int32), (b, 1)))
  filled = _loop(model.params, init_cache(config, b, _CACHE_LEN.value), prompt, jnp.zeros(b, jnp.int32),
                 jnp.zeros((b, 0), jnp.int32), 1, config=config, kernel=False, tree=False)[1]
  position = jnp.full((b,), _POSITION.value, jnp.int32)
  cases = {"step": (1, False), f"chain {_GAMMA.value}": (_GAMMA.value + 1, False)}
  for n in _NODES.value:  # a causal forward over as many rows: what the tree mask adds to the rows' cost
    cases.update({f"causal {int(n) + 1}": (int(n) + 1, False), f"tree {n}": (int(n) + 1, True)})
  runs, caches, compile_s = {}, {}, {}
  for name, (width, tree) in cases.items():
    tokens = jnp.asarray(rng.integers(3, config.vocab_size, size=(b, width)).astype(np.int32))
    parents = jnp.asarray(bushy_parents(b, width - 1))
    for kernel in (False, True):
      key = (name, "kernel" if kernel else "xla")
      caches[key] = jax.tree.map(jnp.copy, filled)

      def run(calls, key=key, tokens=tokens, parents=parents, kernel=kernel, tree=tree):
        out, caches[key] = _loop(weights[kernel], caches[key], tokens, position, parents, calls, config=config,
                                 kernel=kernel, tree=tree)
        return out
      compile_s[key] = timed(run, 2)
      runs[key] = run
  seconds = interleaved_seconds(runs, _REPEATS.value)

  print(f"\nSmolLM2-135M verification forward, float32, batch {b}, position {_POSITION.value}, cache "
        f"{_CACHE_LEN.value}; jax {jax.__version__}, {os.cpu_count()} CPUs; median of {_REPEATS.value} interleaved "
        f"rounds (compile: {sum(compile_s.values()):.0f} s, excluded)\n")
  chain = f"chain {_GAMMA.value}"
  header = (f"{'case':>10} {'rows':>5} {'xla ms':>8} {'kernel ms':>10} {'r xla':>7} {'r kernel':>9} "
            f"{'/ chain kernel':>15}")
  print(header)
  print("-" * len(header))
  for name, (width, _) in cases.items():
    x, k = seconds[(name, "xla")], seconds[(name, "kernel")]
    print(f"{name:>10} {width:>5} {1e3 * x:>8.2f} {1e3 * k:>10.2f} {x / seconds[('step', 'xla')]:>7.2f} "
          f"{k / seconds[('step', 'kernel')]:>9.2f} {k / seconds[(chain, 'kernel')]:>15.2f}")
  print(f"\nr: the forward's time over the same implementation's 1-token step. The kernels serve attention over the "
        f"cache for up to {cpu.MAX_QUERY_TOKENS} tokens per row.")


if __name__ == "__main__":
  app.run(main)
