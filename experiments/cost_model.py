r"""An analytic cost model of a speculative round's programs: what each reads, computes and sends per device, counted
from a model's config and a (data, model) mesh alone, and timed with four figures of a device.

  python -m experiments.cost_model --measure=results/cost_model/cpu_rates.json   # this CPU's FLOP rate (seconds)
  python -m experiments.cost_model --out=results/cost_model                       # validation and projections

Its projections are the accelerator projection's costs (experiments/projection.py: the experiments report, the
tables of docs/results.md, README's answer). XLA's counts of the programs compiled for a TPU
(experiments/compile_for.py) count what a program as compiled moves, the cache's copies between memory spaces
included, so the same verification came out cheaper than a 1-token step on one v5e chip and dearer on a v5p slice
(results/tpu_compile/results.md); here every term is a count a reader can redo by hand. The same count at one device
of this CPU (`step_bytes`) is the roofline the experiments' runs and benchmarks divide a step's time by.

Counts, per device. A program is a sum of passes; a pass runs some arrays over n = rows x tokens vectors, rows = the
batch over the data axis. An array's share is the product of the mesh axes the project's sharding rules split it
over (`specjax.sharding.logical_to_spec`: 1 where a dimension does not divide); m is the model axis.

  weights W = sum over the arrays a pass reads of size / share x itemsize (the embedding: only its gathered rows)
  cache   K = per layer run: rows x (S + tokens) x 2 kv_heads head_dim / share x itemsize, S the slots its attention
              reads: the whole cache on an accelerator (specjax's attention masks the slots past a row's position but
              reads them all), min(positions in use, window) on this CPU (its kernels read the slots in use)
  FLOPs F = 2 n x sum over matrices of size / share + per layer 4 n x heads / share x head_dim x S
  sent  C = per all-reduce 2 (m - 1) / m x n x hidden x itemsize (after wo where heads are split, after w_down where
              the MLP is, after the embedding gather where the vocabulary is), and (m - 1) x n x 8 where a head's
              columns are split (each shard's (max, index) pair: what XLA's partitioner gathers for an argmax);
              nothing on one device
  products N = the weight-matrix products (7 per decoder layer, 1 per head, 1 per MTP module's input projection, ...)

Time on a device {read bandwidth B, peak FLOP rate P, interconnect bandwidth I, overhead o per product}:

  t = max((W + K) / B, F / P) + C / I + N o

The memory and compute terms overlap (the roofline's max, Williams et al. 2009), not add: a forward's time stays
nearly flat as its tokens grow until their FLOPs outweigh its bytes, then grows at the FLOP rate
(results/bench_verify/bench_verify.txt, the kernel column, on this CPU; the H200's forwards of 2 to 32 tokens in
results/accelerator), where a sum would add every token's FLOPs from the second token on. The overhead o is the one
number fitted: from a device's measured 1-token target step t_1, o = (t_1 - the rest of its t) / its N. A TPU runs a
program without a launch per product and has no measurement, so o = 0 there.

In units of the 1-token target step t_1 (Leviathan et al. 2023; experiments/projection.py), a drafter at gamma costs

  c = t(propose of gamma tokens) / gamma / t_1,   r = t(target over gamma + 1 tokens) / t_1,   u = t(update) / t_1,
  projected speedup = tau / (gamma c + r + u),

and experiments/costs.py measures c as (propose + update) / gamma / t_1 (its loop runs the round's update), which
the validation compares with the same sum. Elementwise work (norms, RoPE, softmax, sampling, a tree's top-k and
masks) and copies a compiler makes are not counted.

Draft trees of N nodes, gamma deep (specjax/trees.py, specjax/drafters/draft_tree.py): the proposal is the
drafter's (`propose_tree`: EAGLE-2's growth, a first step then a forward over k = 8 nodes per further depth, for the
model drafters; the chain's own distributions for parallel heads and a block; ceil(N / gamma) searches for prompt
lookup), r the target over [pending, N nodes] plus the accepted path's keys and values moved (`verify_tree`), u the
update over the accepted path. A block drafter (specjax/drafters/block.py) proposes gamma tokens in one forward of
its blocks over gamma + 1 positions: its c falls as 1 / gamma.

The projections take each drafter of configs/compile_tpu.py at the tau and gamma of the methods it names in that
config's fixed-gamma runs (`acceptance`), and its trees of every size the run of configs/trees.py measured
(`tree_acceptance`), at that run's depth and tau, and of the config's other sizes, its gamma deep, with no tau.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import textwrap
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from configs import compile_tpu
from configs.train_budget import EXIT_LAYER
from experiments import cli, projection
from experiments.chips import CHIPS, GPUS
from specjax import sharding
from specjax.config import ModelConfig, shaped_config
from specjax.drafters.block import default_feature_layers as block_feature_layers
from specjax.drafters.draft_tree import TOP_K
from specjax.drafters.mtp_sequential import default_feature_layers
from specjax.model import ParamSpec, attention_keys, layer_shapes, mlp_keys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = "results/cost_model"
RATES = "cpu_rates.json"  # this CPU's FLOP rate, measured by --measure, in the --out folder
# Where c and r were measured: batch-1 runs of experiments/costs.py on this CPU (with the read bandwidth measured in
# the same run) and the H200's (results/accelerator/RUN.md).
CPU_RUNS = ("compare_drafters-budget", "compare_drafters-budget-adaptive", "bench_peers-gemma")
H200_RUNS = ("results/accelerator/h200_float32.json", "results/accelerator/h200_bfloat16.json")
TOLERANCE = 0.20  # the target: every predicted c and r within 20% of the measured one ...
FLOOR = 0.01  # ... or, where 20% of it is less, within 0.01 of a target step (c near 0: moves gamma c by <= 0.04)
# The projection's workload: configs/compile_tpu.py's cache and prompts, bf16; batch 1 on one chip, 8 and 64 rows on
# 8 chips as a (data 2, model 4) mesh.
PROJECTED_MODELS = ("smollm2-135m", "gemma3-270m")
LAYOUTS = (("v5e:1x1", 1, 1, 1), ("v5e:2x4", 2, 4, 8), ("v5e:2x4", 2, 4, 64),
           ("v5p:1x1x1", 1, 1, 1), ("v5p:2x2x2", 2, 4, 8), ("v5p:2x2x2", 2, 4, 64),
           ("v6e:1x1", 1, 1, 1), ("v6e:2x4", 2, 4, 8), ("v6e:2x4", 2, 4, 64))  # (topology, data, model, batch)


# ------------------------------------------------------------------------------------------------------- counts


class Work(NamedTuple):
  """What a program does on one device."""
  weight_bytes: float = 0.0
  cache_bytes: float = 0.0
  flops: float = 0.0
  sent_bytes: float = 0.0  # by collectives over the model axis
  products: int = 0  # weight-matrix products (launches)

  def __add__(self, other: "Work") -> "Work":  # type: ignore[override]
    return Work(*(a + b for a, b in zip(self, other)))

  def __mul__(self, k: int) -> "Work":  # type: ignore[override]
    return Work(*(a * k for a in self))

  __rmul__ = __mul__


@dataclasses.dataclass(frozen=True)
class Setting:
  """Where a program runs: the model, the batch and cache, the mesh, and which cache slots attention reads."""
  config: ModelConfig
  batch: int = 1
  cache_len: int = 256
  positions: float = 128  # in use (what attention reads where it does not read the whole cache; a mean: a decode's)
  data: int = 1
  model: int = 1
  whole_cache: bool = True  # an accelerator's XLA attention reads every slot; this CPU's kernels the slots in use

  def __post_init__(self):
    if self.batch % self.data:
      raise ValueError(f"batch {self.batch} does not divide over data={self.data}")

  @property
  def shape(self) -> dict[str, int]:  # what `sharding.logical_to_spec` reads of a mesh
    return {"data": self.data, "model": self.model}

  @property
  def rows(self) -> int:
    return self.batch // self.data

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.config.dtype).itemsize

  def share(self, spec: ParamSpec) -> int:
    """How many devices split an array: the product of the mesh axes its sharding puts on its dimensions."""
    partition = sharding.logical_to_spec(spec.axes, spec.shape, self)  # type: ignore[arg-type]
    axes = [a for entry in partition if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)]
    return math.prod(self.shape[a] for a in axes)

  def split(self, logical: str, size: int) -> int:
    return self.share(ParamSpec((size,), (logical,)))

  def all_reduce(self, tokens: int) -> float:
    """Bytes one device sends to all-reduce [rows, tokens, hidden] over the model axis (a ring: 2 (m - 1) / m)."""
    return 2 * (self.model - 1) / self.model * self.rows * tokens * self.config.hidden_size * self.itemsize


def is_matrix(spec: ParamSpec) -> bool:
  """A product's weight: two or more dimensions besides a stack of copies, one of them the hidden size ("embed"); norms
  and biases (a stack of them included) are vectors."""
  axes = [a for a in spec.axes if a != "stack"]
  return len(axes) >= 2 and "embed" in axes


def arrays(s: Setting, specs: Sequence[ParamSpec], tokens: int) -> Work:
  """Arrays read once, each matrix (`is_matrix`) multiplying rows x tokens vectors."""
  n, work = s.rows * tokens, Work()
  for spec in specs:
    local = math.prod(spec.shape) / s.share(spec)
    matrix = is_matrix(spec)
    work += Work(weight_bytes=local * s.itemsize, flops=2 * n * local if matrix else 0.0, products=int(matrix))
  return work


def attention(s: Setting, window: int | None, tokens: int, written: int | None = None) -> Work:
  """One layer's cache: the slots its queries read and the `written` positions (default: `tokens`) it writes, and the
  FLOPs of the scores and weighted values of `tokens` queries over those slots. Keys a query sees beside the cache (a
  tree's block, its ancestors', a draft block's own: at most N + 1 against the cache's slots) are not counted."""
  c = s.config
  slots = s.cache_len if s.whole_cache else min(s.positions, window or s.positions)
  flops = 4 * s.rows * tokens * c.num_heads / s.split("heads", c.num_heads) * c.head_dim * slots
  return Work(cache_bytes=s.rows * (slots + (tokens if written is None else written)) * per_slot(s), flops=flops)


def per_slot(s: Setting) -> float:
  """Bytes of one position's keys and values in one layer, one row, on one device."""
  c = s.config
  return 2 * c.num_kv_heads / s.split("kv_heads", c.num_kv_heads) * c.head_dim * s.itemsize


def cache_write(s: Setting, tokens: int) -> Work:
  """A layer's keys and values of `tokens` positions a row written, none read."""
  return Work(cache_bytes=s.rows * tokens * per_slot(s))


def block(s: Setting, keys: Sequence[str], window: int | None, tokens: int, config: ModelConfig | None = None,
          written: int | None = None) -> Work:
  """A decoder block's arrays `keys` (a layer's, or its attention's alone) over `tokens`, with its attention over its
  cache (writing `written` positions: `attention`) and the all-reduces its split products need."""
  c = config or s.config
  shapes = layer_shapes(c)
  work = arrays(s, [shapes[k] for k in keys], tokens) + attention(s, window, tokens, written)
  reduced = (("wo", "heads", c.num_heads), ("w_down", "mlp", c.intermediate_size))
  return work + Work(sent_bytes=sum(s.all_reduce(tokens) for key, axis, size in reduced
                                    if key in keys and s.split(axis, size) > 1))


def layers(s: Setting, indices: Sequence[int], tokens: int, config: ModelConfig | None = None,
           written: int | None = None) -> Work:
  """Decoder layers `indices` of `config` (default: the target's) over `tokens` new tokens a row (writing `written`
  positions of each layer's cache: `attention`; 0 for a tree's nodes, which write none)."""
  c = config or s.config
  keys = tuple(layer_shapes(c))
  return sum((block(s, keys, c.window(i), tokens, c, written) for i in indices), Work())


def gather(s: Setting, tokens: int) -> Work:
  """The embedding rows of `tokens` tokens a row, summed over the model axis where the vocabulary is split."""
  c = s.config
  split = s.split("vocab", c.vocab_size) > 1
  return Work(weight_bytes=s.rows * tokens * c.hidden_size * s.itemsize,
              sent_bytes=s.all_reduce(tokens) if split else 0.0)


def head(s: Setting, columns: int, tokens: int) -> Work:
  """The final norm and the LM head's `columns` (the vocabulary, or a truncated draft vocabulary's V') over `tokens`
  a row; where the columns are split, the choice of a token gathers each shard's (max, index) pair, as XLA
  partitions an argmax over a split dimension (not the logits)."""
  c = s.config
  matrix = ParamSpec((c.hidden_size, columns), ("embed", "vocab"))
  work = arrays(s, [ParamSpec((c.hidden_size,), ("norm",)), matrix], tokens)
  m = s.split("vocab", columns)
  return work + Work(sent_bytes=(m - 1) * s.rows * tokens * 8 if m > 1 else 0.0)


def target(s: Setting, tokens: int) -> Work:
  """The target's forward over `tokens` a row: the embedding's rows, every layer, the head over every token."""
  return gather(s, tokens) + layers(s, range(s.config.num_layers), tokens) + head(s, s.config.vocab_size, tokens)


def verify_tree(s: Setting, nodes: int, depth: int) -> Work:
  """A tree's verification (specjax/trees.py): the target over [pending, its N nodes] under the tree mask, then the
  accepted path's depth + 1 positions of keys and values moved where a chain's would be (`trees.move_path`: read
  and written in every layer)."""
  return target(s, nodes + 1) + s.config.num_layers * Work(cache_bytes=2 * s.rows * (depth + 1) * per_slot(s))


def one_device(config: ModelConfig, positions: float, rows: int = 1) -> Setting:
  """One device of this CPU: `rows` rows with `positions` in use, its attention reading those slots only."""
  return Setting(config, batch=rows, positions=positions, whole_cache=False)


def step_bytes(config: ModelConfig, positions: float, rows: int = 1, tokens: int = 1, params=None) -> float:
  """Bytes a target forward of `tokens` tokens a row reads and writes on one device of this CPU with `positions`
  in use: its weights W (of the embedding, the gathered rows) and its cache K, the roofline of batch-1 decoding
  (Williams et al. 2009): a decode step's time is at least these bytes over the read bandwidth. W is counted from
  the config at its dtype, or, given the model's `params`, as they are stored (a quantized model's blocks and scales:
  `stored_weight_bytes`)."""
  work = target(one_device(config, positions, rows), tokens)
  weights = work.weight_bytes if params is None else stored_weight_bytes(params, config, rows * tokens)
  return weights + work.cache_bytes


def stored_weight_bytes(params, config: ModelConfig, vectors: int = 1) -> float:
  """Bytes of the weights a forward over `vectors` token vectors reads, as the arrays of `params` (`Model.params`,
  not a decode copy) store them: every array once, of an untied embedding table only the gathered rows (at its bytes
  per element); a tied table is read whole as the head."""
  size = lambda tree: sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))
  total = size(params)
  if not config.tie_embeddings:
    embed = size(params["embed"])
    total += embed * (vectors / config.vocab_size - 1)
  return total


def head_share(config: ModelConfig) -> float:
  """The LM head's share of the weights a 1-token target step reads on one device (the `head` pass's bytes over
  `target`'s)."""
  s = one_device(config, 1)
  return head(s, config.vocab_size, 1).weight_bytes / target(s, 1).weight_bytes


# ------------------------------------------------------------------------------------------------------ drafters


@dataclasses.dataclass(frozen=True)
class Drafter:
  """What a drafter family runs (specjax/drafters/): `layers` of the target (layer skip, the exit adapter's first
  k), its own decoder layers (a distilled draft model: copies of target layers), an adapter block, parallel
  residual heads, sequential modules or a block's decoder blocks, and the head's columns (`draft_vocab`; None: the
  whole vocabulary)."""
  family: str  # prompt_lookup, layer_skip, exit_adapter, draft_model, mtp_parallel, mtp_sequential, block
  layers: tuple[int, ...] = ()
  draft_vocab: int | None = None
  mlp: bool = True  # the exit adapter's block has an MLP
  heads: int = 0  # parallel heads
  modules: int = 0  # sequential modules (1: recurrent, EAGLE's; 4: DeepSeek-V3's chain)
  blocks: int = 0  # a block drafter's decoder blocks
  features: int = 1  # target layers a sequential module or a block reads (3: EAGLE-3's projection)
  ngram_sizes: int = 3  # prompt lookup's searches


def prompt_lookup() -> Drafter:
  return Drafter("prompt_lookup")


def layer_skip(config: ModelConfig, exit_layer: int | None = None, skip_layers: Sequence[int] = (),
               draft_vocab: int | None = None) -> Drafter:
  kept = range(exit_layer) if exit_layer else [i for i in range(config.num_layers) if i not in set(skip_layers)]
  return Drafter("layer_skip", layers=tuple(kept), draft_vocab=draft_vocab)


def exit_adapter(exit_layer: int, draft_vocab: int | None, mlp: bool = True) -> Drafter:
  return Drafter("exit_adapter", layers=tuple(range(exit_layer)), draft_vocab=draft_vocab, mlp=mlp)


def draft_model(config: ModelConfig, num_layers: int, draft_vocab: int | None) -> Drafter:
  spaced = np.round(np.linspace(0, config.num_layers - 1, num_layers)).astype(int)  # draft_model.evenly_spaced_layers
  return Drafter("draft_model", layers=tuple(int(i) for i in spaced), draft_vocab=draft_vocab)


def mtp_parallel(heads: int, draft_vocab: int | None) -> Drafter:
  return Drafter("mtp_parallel", heads=heads, draft_vocab=draft_vocab)


def mtp_sequential(config: ModelConfig, depth: int, recurrent: bool, eagle3: bool,
                   draft_vocab: int | None) -> Drafter:
  return Drafter("mtp_sequential", modules=1 if recurrent else depth,
                 features=len(default_feature_layers(config, eagle3)), draft_vocab=draft_vocab)


def block_drafter(config: ModelConfig, blocks: int, draft_vocab: int | None) -> Drafter:
  """specjax/drafters/block.py with its default feature layers (EAGLE-3's three)."""
  return Drafter("block", blocks=blocks, features=len(block_feature_layers(config)), draft_vocab=draft_vocab)


def _columns(s: Setting, d: Drafter) -> int:
  return d.draft_vocab or s.config.vocab_size


def _adapter(s: Setting, d: Drafter, tokens: int, written: int | None = None) -> Work:
  c = s.config
  keys = attention_keys(c) + (mlp_keys(c) if d.mlp else ())
  return block(s, keys, c.window(len(d.layers)), tokens, written=written)


def _projection(s: Setting, d: Drafter, tokens: int) -> Work:
  """W_f over the concatenated features of `d.features` target layers (none where it reads one)."""
  c = s.config
  matrix = ParamSpec((d.features * c.hidden_size, c.hidden_size), ("embed", "embed"))
  return arrays(s, [matrix], tokens) if d.features > 1 else Work()


def _module(s: Setting, tokens: int, whole: bool, written: int | None = None) -> Work:
  """A sequential module over `tokens`: W [norm(emb); norm(h)], then its block (`whole`, writing `written` positions
  of its cache), or only the keys and values it writes into its cache (a chained module's update)."""
  c = s.config
  d = c.hidden_size
  inputs = arrays(s, [ParamSpec((2 * d, d), ("embed", "embed")), ParamSpec((d,), ("norm",)),
                      ParamSpec((d,), ("norm",))], tokens)
  if whole:
    return inputs + block(s, tuple(layer_shapes(c)), None, tokens, written=written)
  shapes = layer_shapes(c)
  return inputs + arrays(s, [shapes["wk"], shapes["wv"]], tokens) + cache_write(s, tokens)


def _blocks(s: Setting, d: Drafter, gamma: int) -> Work:
  """A block drafter's forward: the pending token's anchor W_in [norm(emb); norm(c)] (one product over one position),
  added to gamma slot embeddings, through its blocks, each reading its context cache and writing none (the block's
  own keys stay in the forward), then the head over gamma slots."""
  c = s.config
  dim = c.hidden_size
  anchor = arrays(s, [ParamSpec((2 * dim, dim), ("embed", "embed")), ParamSpec((dim,), ("norm",)),
                      ParamSpec((dim,), ("norm",))], 1)
  slots = gamma * arrays(s, [ParamSpec((dim,), ("embed",))], 1)  # added to the anchor, not multiplied
  own = d.blocks * block(s, tuple(layer_shapes(c)), None, gamma + 1, written=0)
  return gather(s, 1) + anchor + slots + own + head(s, _columns(s, d), gamma)


def propose(s: Setting, d: Drafter, gamma: int) -> Work:
  """One `propose` of gamma tokens (a chain)."""
  c, columns = s.config, _columns(s, d)
  if d.family == "prompt_lookup":  # one search of the token buffer per n-gram size
    return Work(cache_bytes=d.ngram_sizes * s.rows * s.cache_len * 4)
  if d.family == "layer_skip":  # only the pending token is new to the shared cache
    return gamma * (gather(s, 1) + layers(s, d.layers, 1) + head(s, columns, 1))
  if d.family == "exit_adapter":
    return gamma * (gather(s, 1) + layers(s, d.layers, 1) + _adapter(s, d, 1) + head(s, columns, 1))
  if d.family == "draft_model":  # its own cache: [pending - 1, pending] first, then one token a step
    own = c.layers_config(d.layers)
    step = lambda tokens: gather(s, tokens) + layers(s, range(own.num_layers), tokens, own) + head(s, columns, 1)
    return step(2) + (gamma - 1) * step(1)
  if d.family == "mtp_parallel":  # every head on the last hidden state, then the head over gamma rows
    w = ParamSpec((d.heads, c.hidden_size, c.hidden_size), ("stack", "embed", "embed"))
    return arrays(s, [w, ParamSpec((d.heads, c.hidden_size), ("stack", "embed"))], 1) + head(s, columns, gamma)
  if d.family == "mtp_sequential":  # the first draft from the kept hidden state, then a module a step
    return head(s, columns, 1) + (gamma - 1) * (gather(s, 1) + _module(s, 1, True) + head(s, columns, 1))
  if d.family == "block":  # one forward over [pending, mask x gamma], whatever gamma
    return _blocks(s, d, gamma)
  raise ValueError(f"unknown drafter family {d.family!r}")


def propose_tree(s: Setting, d: Drafter, depth: int, nodes: int) -> Work:
  """One `propose` of a tree of `nodes` nodes at most `depth` deep (specjax/drafters/draft_tree.py).

  Prompt lookup searches for ceil(N / depth) branches, each search a pass over the token buffer per n-gram size.
  Parallel heads and a block score every depth from the distributions of their chain's proposal (expanding a node
  costs nothing). The model drafters grow EAGLE-2's tree: their chain's first step, then per depth 2..depth one
  forward over the k = min(TOP_K, V') nodes it expands (`model.forward_nodes`: the draft's layers over k tokens a
  row, reading its cache and writing none) and the head over k rows."""
  columns = _columns(s, d)
  if d.family == "prompt_lookup":
    return math.ceil(nodes / depth) * propose(s, d, depth)
  if d.family in ("mtp_parallel", "block"):
    return propose(s, d, depth)
  k = min(TOP_K, columns)
  if d.family == "layer_skip":
    first = gather(s, 1) + layers(s, d.layers, 1) + head(s, columns, 1)
    expand = gather(s, k) + layers(s, d.layers, k, written=0) + head(s, columns, k)
  elif d.family == "exit_adapter":
    first = gather(s, 1) + layers(s, d.layers, 1) + _adapter(s, d, 1) + head(s, columns, 1)
    expand = gather(s, k) + layers(s, d.layers, k, written=0) + _adapter(s, d, k, written=0) + head(s, columns, k)
  elif d.family == "draft_model":
    own = s.config.layers_config(d.layers)
    first = gather(s, 2) + layers(s, range(own.num_layers), 2, own) + head(s, columns, 1)
    expand = gather(s, k) + layers(s, range(own.num_layers), k, own, written=0) + head(s, columns, k)
  elif d.family == "mtp_sequential":  # the first depth from the kept hidden state
    first = head(s, columns, 1)
    expand = gather(s, k) + _module(s, k, True, written=0) + head(s, columns, k)
  else:
    raise ValueError(f"unknown drafter family {d.family!r}")
  return first + (depth - 1) * expand


def update(s: Setting, d: Drafter, gamma: int, tree: bool = False) -> Work:
  """The round's `update` after gamma drafts were verified: gamma + 1 positions of target features (after a `tree`
  gamma deep, its accepted path's)."""
  width = gamma + 1
  if d.family == "exit_adapter":  # the adapter's cache from the verified positions' features
    return _adapter(s, d, width)
  if d.family == "mtp_sequential":  # every module's cache from the true features; module 1's output is kept
    work = _projection(s, d, width) + gather(s, width) + _module(s, width, True)
    return work + (d.modules - 1) * _module(s, width, False)
  if d.family == "block":  # the features projected, each block's keys and values of them written
    shapes = layer_shapes(s.config)
    return _projection(s, d, width) + d.blocks * (arrays(s, [shapes["wk"], shapes["wv"]], width)
                                                  + cache_write(s, width))
  if d.family == "draft_model" and tree:  # its nodes wrote no cache: it reads the accepted path's tokens
    own = s.config.layers_config(d.layers)
    return gather(s, width) + layers(s, range(own.num_layers), width, own)
  return Work()


# ------------------------------------------------------------------------------------------------------- devices


class Device(NamedTuple):
  """What the model times a program with, and where each figure comes from."""
  name: str
  read_bytes_per_second: float
  flops_per_second: float
  interconnect_bytes_per_second: float = 0.0
  overhead_seconds: float = 0.0  # per weight-matrix product
  whole_cache: bool = True
  source: str = ""


def seconds(work: Work, device: Device) -> float:
  """t = max((W + K) / B, F / P) + C / I + N o."""
  t = max((work.weight_bytes + work.cache_bytes) / device.read_bytes_per_second,
          work.flops / device.flops_per_second) + work.products * device.overhead_seconds
  if work.sent_bytes:
    if not device.interconnect_bytes_per_second:
      raise ValueError(f"{device.name} has no interconnect bandwidth for {work.sent_bytes:.0f} bytes of collectives")
    t += work.sent_bytes / device.interconnect_bytes_per_second
  return t


def fit_overhead(device: Device, step_seconds: float, step: Work) -> Device:
  """The device with its overhead per product fitted to a measured 1-token target step: what the step's bytes,
  FLOPs and collectives leave unexplained, over its products (0 where they explain all of it)."""
  rest = seconds(step, device._replace(overhead_seconds=0.0))
  return device._replace(overhead_seconds=max(0.0, (step_seconds - rest) / step.products))


def tpu(topology: str) -> Device:
  """A TPU chip (one device per chip: v5p's two TensorCores as one megacore) from its published figures."""
  chip = CHIPS[topology.partition(":")[0]]
  return Device(topology, chip.hbm_bytes_per_second, chip.bf16_flops_per_second,
                chip.interconnect_bytes_per_second, 0.0, True, chip.source)


def round_seconds(s: Setting, d: Drafter, gamma: int, device: Device, tree_nodes: int | None = None
                  ) -> dict[str, float]:
  """The programs of a round in seconds: the 1-token step, the drafter's propose of gamma and update, the
  verification of gamma + 1 tokens; with `tree_nodes` N, a tree's, gamma deep: its proposal, its verification
  of [pending, N nodes] and the update over its accepted path."""
  if tree_nodes is None:
    draft, verify = propose(s, d, gamma), target(s, gamma + 1)
  else:
    draft, verify = propose_tree(s, d, gamma, tree_nodes), verify_tree(s, tree_nodes, gamma)
  return {"decode_step_seconds": seconds(target(s, 1), device), "draft_seconds": seconds(draft, device),
          "update_seconds": seconds(update(s, d, gamma, tree=tree_nodes is not None), device),
          "verify_seconds": seconds(verify, device)}


# ---------------------------------------------------------------------------------------------------- validation


def measured_drafters(config: ModelConfig) -> dict[str, Drafter]:
  """What each method of the measured runs drafted with: its config (configs/compare_drafters.py and
  configs/train_budget.py) and the options its checkpoint records (the shipped ones as of the H200 run, commit
  8155a6f: the exit adapter after 4 layers, the others as the budget runs'); every trained drafter reads 8,192 head
  columns."""
  vocab = 8192
  sets = os.path.join(ROOT, "configs", "layer_skip_sets")

  def skip_set(name: str) -> Drafter:
    with open(os.path.join(sets, name)) as f:
      return layer_skip(config, skip_layers=json.load(f)["options"]["skip_layers"])

  found = {"prompt_lookup": prompt_lookup(),
           "layer_skip_exit24": layer_skip(config, exit_layer=24),
           "layer_skip_exit12": layer_skip(config, exit_layer=12),
           "layer_skip_trained_exit": exit_adapter(4, vocab),
           "budget_exit": exit_adapter(EXIT_LAYER, vocab),
           "budget_exit16": exit_adapter(16, vocab),
           "draft_model": draft_model(config, 4, vocab), "budget_draft": draft_model(config, 4, vocab),
           "mtp_parallel": mtp_parallel(4, vocab), "budget_parallel": mtp_parallel(4, vocab),
           "mtp_sequential": mtp_sequential(config, 4, True, True, vocab),
           "budget_sequential": mtp_sequential(config, 4, True, True, vocab),
           "budget_deepseek": mtp_sequential(config, 4, False, False, vocab)}
  if config.num_layers == 30:  # SmolLM2's searched skip sets
    found.update(layer_skip_best_set=skip_set("smollm2-135m.json"),
                 layer_skip_deep_set=skip_set("smollm2-135m-deep.json"))
  return {name: d for name, d in found.items() if max(d.layers, default=0) < config.num_layers}


def within(predicted: float, measured: float) -> bool:
  """The target: |predicted - measured| <= max(20% of measured, 0.01)."""
  return abs(predicted - measured) <= max(TOLERANCE * abs(measured), FLOOR)


def _row(device: str, source: str, method: str, gamma: int, quantity: str, measured: float, predicted: float,
         **extra) -> dict[str, Any]:
  return {"device": device, "source": source, "method": method, "gamma": gamma, "quantity": quantity,
          "measured": measured, "predicted": predicted, "error": predicted / measured - 1 if measured else None,
          "within": within(predicted, measured), **extra}


def validate_costs(costs: dict[str, Any], s: Setting, device: Device, device_label: str,
                   source: str) -> tuple[list[dict[str, Any]], Device]:
  """Measured against predicted c and r of every method of an experiments/costs.py measurement whose drafter is known
  (`measured_drafters`), the overhead fitted to its 1-token step. Returns (rows, the fitted device)."""
  device = fit_overhead(device, costs["target_seconds"]["1"], target(s, 1))
  t_1 = seconds(target(s, 1), device)
  known = measured_drafters(s.config)
  rows = []
  for name, m in costs["methods"].items():
    if name not in known:
      continue
    gamma, d = m["gamma"], known[name]
    draft = seconds(propose(s, d, gamma), device) + seconds(update(s, d, gamma), device)
    bytes_read = sum(w.weight_bytes + w.cache_bytes for w in (propose(s, d, gamma), update(s, d, gamma)))
    measured_seconds = costs["draft_seconds"][name]
    rows.append(_row(device_label, source, name, gamma, "c", m["draft_cost"], draft / gamma / t_1,
                     draft_bytes=bytes_read, draft_seconds=measured_seconds,
                     draft_bandwidth=bytes_read / measured_seconds if measured_seconds > 0 else None))
    rows.append(_row(device_label, source, name, gamma, "r", m["verify_cost"],
                     seconds(target(s, gamma + 1), device) / t_1))
  return rows, device


def _fitted(device: Device, label: str, source: str, step_seconds: float, step: Work) -> dict[str, Any]:
  """What a device was fitted to and with: its figures, the 1-token step's terms and the overhead they leave."""
  return {"device": label, "source": source, "read_bytes_per_second": device.read_bytes_per_second,
          "flops_per_second": device.flops_per_second, "whole_cache": device.whole_cache,
          "step_seconds": step_seconds, "step_bytes": step.weight_bytes + step.cache_bytes, "step_flops": step.flops,
          "step_products": step.products, "memory_seconds": (step.weight_bytes + step.cache_bytes) /
          device.read_bytes_per_second, "compute_seconds": step.flops / device.flops_per_second,
          "overhead_seconds": device.overhead_seconds, "figures": device.source}


def validate_cpu(run: str, rates: dict[str, Any]) -> tuple[list[dict], dict]:
  """A run of experiments/run.py on this CPU: its own read bandwidth, its own FLOP rate where it recorded one (else
  the one measured by --measure), its 1-token step for the overhead."""
  with open(os.path.join(ROOT, "results", run, "results.json")) as f:
    results = json.load(f)
  costs, config = results["costs"], results["config"]
  flop_rate = costs.get("flop_rate") or rates["flop_rate"]
  s = Setting(shaped_config(config["model"], config["dtype"]), batch=costs["rows"], cache_len=costs["cache_len"],
              positions=costs["context_tokens"], whole_cache=False)
  source = f"results/{run}/results.json"
  device = Device("cpu", costs["read_bandwidth"], flop_rate, whole_cache=False,
                  source=f"read bandwidth: {source}; FLOP rate: " + (source if costs.get("flop_rate") else
                                                                     f"{OUT}/{RATES}"))
  label = f"CPU, {config['model']} {config['dtype']}"
  rows, device = validate_costs(costs, s, device, label, source)
  fitted = _fitted(device, label, source, costs["target_seconds"]["1"], target(s, 1))
  # Not used by the model: the FLOP rate at which the run's widest verification would cost its FLOPs over a 1-token
  # step's on top of it (what the run itself says of its host's rate, where that host recorded none).
  widest = max(int(t) for t in costs["target_seconds"])
  extra = target(s, widest).flops - target(s, 1).flops
  fitted["implied_flop_rate"] = extra / (costs["target_seconds"][str(widest)] - costs["target_seconds"]["1"])
  return rows, fitted


def validate_h200(path: str) -> tuple[list[dict], list[dict]]:
  """The H200's costs (the overhead fitted to their 1-token step) and its forwards of T tokens and of a batch (the
  overhead fitted to that measurement's own 1-token step): its copy bandwidth measured in the run, the published peak
  FLOP rate of the run's dtype."""
  with open(os.path.join(ROOT, path)) as f:
    measured = json.load(f)
  costs, chip = measured["costs"], GPUS["h200"]
  dtype = measured["dtype"]
  s = Setting(shaped_config(measured["model"], dtype), batch=costs["rows"], cache_len=costs["cache_len"],
              positions=costs["context_tokens"])
  peak = chip.bf16_flops_per_second if dtype == "bfloat16" else chip.fp32_flops_per_second
  device = Device("h200", measured["bandwidth_gbs"] * 1e9, peak, source=f"copy bandwidth: {path}; FLOP rate: "
                  f"{chip.source}, {dtype}")
  label = f"H200, {measured['model']} {dtype}"
  rows, fitted = validate_costs(costs, s, device, label, path)
  fits = [_fitted(fitted, label, path, costs["target_seconds"]["1"], target(s, 1))]
  widths = measured["width_seconds"]
  width_device = fit_overhead(device, widths["T1"], target(s, 1))
  fits.append(_fitted(width_device, label + " (forwards of T tokens)", path + " width_seconds", widths["T1"],
                      target(s, 1)))
  t_1 = seconds(target(s, 1), width_device)
  for key, value in widths.items():
    if key == "T1":
      continue
    tokens, batch = (int(key[1:]), 1) if key.startswith("T") else (1, int(key[1:]))
    wide = dataclasses.replace(s, batch=batch)
    rows.append(_row(label, path + " width_seconds", f"{tokens} tokens x {batch} rows", tokens - 1, "forward",
                     value / widths["T1"], seconds(target(wide, tokens), width_device) / t_1))
  return rows, fits


def measure_rates(path: str) -> dict[str, Any]:
  """This machine's FLOP rate (experiments/costs.py's product) and read bandwidth, measured now."""
  import jax
  from experiments import costs
  start = datetime.datetime.now(datetime.timezone.utc)
  bandwidth = costs.measure_read_bandwidth()
  rates = [costs.measure_flop_rate() for _ in range(3)]
  cpu = ""
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as f:
      info = f.read()
    names = [line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")]
    flags_line = next((line for line in info.splitlines() if line.startswith("flags")), "")
    cpu = (names[0] if names else "") + (", AVX-512" if "avx512f" in flags_line else ", AVX2" if "avx2" in flags_line
                                         else "")
  record = {"date": start.strftime("%Y-%m-%d %H:%M UTC"), "backend": jax.default_backend(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "load_average": list(os.getloadavg()), "flop_shape": list(costs.FLOP_SHAPE),
            "flop_rates": rates, "flop_rate": statistics.median(rates), "read_bandwidth": bandwidth,
            "seconds": (datetime.datetime.now(datetime.timezone.utc) - start).total_seconds(),
            "specjax_commit": cli.code_commit()}
  cli.write_atomic(path, json.dumps(record, indent=1) + "\n")
  return record


# --------------------------------------------------------------------------------------------------- projections


def projected_drafters(config: ModelConfig, draft_vocab: int) -> dict[str, tuple[str, Drafter]]:
  """configs/compile_tpu.py's drafters for a model: {the method whose tau it takes: (its name, what it runs)}, layers
  as fractions of the model's (experiments/compile_for.py's rule)."""
  found = {}
  for recipe in compile_tpu.get_config().drafters:
    options = dict(recipe.get("options", {}))
    vocab = draft_vocab if recipe.get("draft_vocab") else None
    exit_layer = max(1, round(recipe["exit_layer_fraction"] * config.num_layers)) \
        if "exit_layer_fraction" in recipe else None
    family = recipe["drafter"]
    if family == "prompt_lookup":
      d = prompt_lookup()
    elif family == "layer_skip" and "adapter" in options:
      d = exit_adapter(exit_layer, vocab, options.get("mlp", True))
    elif family == "layer_skip":
      skip = (round(recipe["skip_layer_fraction"] * config.num_layers),) if "skip_layer_fraction" in recipe else ()
      d = layer_skip(config, exit_layer=exit_layer, skip_layers=skip, draft_vocab=vocab)
    elif family == "draft_model":
      d = draft_model(config, options["num_layers"], vocab)
    elif family == "mtp_parallel":
      d = mtp_parallel(options["num_heads"], vocab)
    elif family == "block":
      d = block_drafter(config, options.get("layers", 1), vocab)
    else:
      d = mtp_sequential(config, options["depth"], options["recurrent"], options["eagle3"], vocab)
    for method in projection.methods_of(recipe):
      found[method] = (recipe["name"], d)
  return found


def projected_rounds(acceptance: dict[str, dict[str, Any]], trees: dict[str, dict[str, Any]] | None
                     ) -> list[tuple[str, str, str, int, int | None, float | None]]:
  """What is projected, per model: (method, drafter name, its first method (`projected_drafters`' key), gamma, tree
  size, tau). Every method of configs/compile_tpu.py's drafters with a measured tau (`acceptance`) at its gamma; and
  for each drafter's first method, its trees of every size the run of configs/trees.py (`trees`) measured for it, at
  that run's depth and tau, and of the config's other sizes, the config's gamma deep, with no tau."""
  config = compile_tpu.get_config()
  rounds = []
  for recipe in config.drafters:
    methods = projection.methods_of(recipe)
    rounds += [(m, recipe["name"], methods[0], acceptance[m]["gamma"], None, acceptance[m]["tau"])
               for m in methods if m in acceptance]
    if methods[0] not in acceptance:
      continue
    measured = {m["tree_nodes"]: m for name, m in (trees or {}).items()
                if name == projection.tree_method(methods[0], m["tree_nodes"])}
    for nodes in sorted(set(config.tree_nodes) | set(measured)):
      gamma, tau = (measured[nodes]["gamma"], measured[nodes]["tau"]) if nodes in measured else (config.gamma, None)
      rounds.append((projection.tree_method(methods[0], nodes), recipe["name"], methods[0], gamma, nodes, tau))
  return rounds


def project(acceptance: dict[str, dict[str, Any]], trees: dict[str, dict[str, Any]] | None) -> list[dict[str, Any]]:
  """Every projected (model, layout, method, tree size): the round's programs in seconds, c, r, u, the round's
  cost in decode steps and the speedup at the method's measured tau (None for a tree whose tau is unmeasured)."""
  compiled = compile_tpu.get_config()
  vocab_of = {m["name"]: m["draft_vocab"] for m in (*compiled.models, *compile_tpu.FAMILY_MODELS)}
  rounds = projected_rounds(acceptance, trees)
  rows = []
  for name in PROJECTED_MODELS:
    config = shaped_config(name, compiled.dtype)
    drafters = projected_drafters(config, vocab_of[name])
    for topology, data, model, batch in LAYOUTS:
      s = Setting(config, batch=batch, cache_len=compiled.cache_len, positions=compiled.prompt_len, data=data,
                  model=model)
      device = tpu(topology)
      for method, drafter_name, recipe_method, gamma, nodes, tau in rounds:
        programs = round_seconds(s, drafters[recipe_method][1], gamma, device, nodes)
        costs = projection.round_costs(gamma, programs["decode_step_seconds"], programs["draft_seconds"],
                                       programs["verify_seconds"], programs["update_seconds"])
        rows.append({"model": name, "topology": topology, "mesh": [data, model], "batch": batch,
                     "acceptance_of": method, "drafter": drafter_name, "gamma": gamma, "tau": tau,
                     "tree_nodes": nodes, **programs, **costs, "break_even_tau": projection.break_even_tau(costs),
                     "projected_speedup": None if tau is None else projection.speedup(tau, costs)})
  return rows


def run(out: str) -> dict[str, Any]:
  """The validation against every measurement and the projections; writes results.json and RUN.md to `out`."""
  with open(os.path.join(out, RATES)) as f:
    rates = json.load(f)
  validation, fits = [], []
  for name in CPU_RUNS:
    rows, fit = validate_cpu(name, rates)
    validation += rows
    fits.append(fit)
  for path in H200_RUNS:
    rows, fit = validate_h200(path)
    validation += rows
    fits += fit
  compiled = compile_tpu.get_config()
  acceptance = projection.measured_acceptance(compiled.acceptance)
  trees = projection.tree_acceptance(compiled.tree_acceptance)
  with open(os.path.join(ROOT, projection.files_of(compiled.acceptance)[0])) as f:
    acceptance_model = json.load(f)["config"]["model"]
  results = {"name": "cost_model", "environment": cli.environment(), "rates": rates, "tolerance": TOLERANCE,
             "floor": FLOOR, "fits": fits, "validation": validation,
             "workload": {"dtype": compiled.dtype, "cache_len": compiled.cache_len, "positions": compiled.prompt_len,
                          "acceptance": projection.files_of(compiled.acceptance),
                          "tree_acceptance": compiled.tree_acceptance if trees is not None else None,
                          "acceptance_model": acceptance_model,
                          "chips": {t: tpu(t).source for t, *_ in LAYOUTS}},
             "projections": project(acceptance, trees)}
  os.makedirs(out, exist_ok=True)
  cli.write_atomic(os.path.join(out, "results.json"), json.dumps(results, indent=1) + "\n")
  cli.write_atomic(os.path.join(out, "RUN.md"), run_md(results, out))
  return results


def run_md(results: dict[str, Any], out: str) -> str:
  """What was run, on which machine, what was fitted and what was predicted."""
  rates, env = results["rates"], results["environment"]
  date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  missed = [r for r in results["validation"] if not r["within"]]
  groups: dict[tuple[str, str], list[str]] = {}
  for r in missed:
    groups.setdefault((f"{r['device']}, {r['source']}", r["quantity"]), []).append(r["method"])
  lines = [f"# cost_model (the analytic cost model, validated and projected), {date}", "", "```bash",
           f"python -m experiments.cost_model --measure={out}/{RATES}   # {rates['date']}, {rates['seconds']:.0f} s",
           f"python -m experiments.cost_model --out={out}", "```", "",
           f"- code: commit {env['specjax_commit']}; Python {platform.python_version()}. The second command reads "
           "results files only (no model, no timing): the CPU runs' costs and read bandwidth, the H200's "
           "(results/accelerator), the tau of configs/compile_tpu.py's acceptance files: "
           + ", ".join(results["workload"]["acceptance"]) + (f" and trees' of {results['workload']['tree_acceptance']}"
                                                             if results["workload"]["tree_acceptance"] else "") + ".",
           f"- machine of the measurement: {rates['cpu']}, {rates['cpu_count']} cores, load average "
           f"{', '.join(f'{x:.1f}' for x in rates['load_average'])} at its start (a long background job shared the "
           f"cores): a float32 product {' x '.join(map(str, rates['flop_shape']))} at "
           f"{', '.join(f'{x / 1e9:.0f}' for x in rates['flop_rates'])} GFLOP/s (median of 7 calls each; their median "
           f"{rates['flop_rate'] / 1e9:.0f} is used), a jitted read of 512 MB at {rates['read_bandwidth'] / 1e9:.1f} "
           "GB/s. The CPU runs validated here were timed on other hosts of this kind (their RUN.md: an Intel Xeon "
           "with AVX-512), which recorded no FLOP rate; experiments/costs.py records one in every run from now on.",
           "- fitted: one overhead per weight-matrix product per measurement, to its 1-token target step "
           "(`fits` in results.json). Predicted from the counts and the device's figures: everything else.",
           f"- {len(results['validation'])} comparisons, {len(missed)} outside max(20%, 0.01)" + (": " + "; ".join(
               f"{quantity} of {', '.join(methods)} ({where})" for (where, quantity), methods in groups.items())
               if missed else "") + ".", "",
           "Files: `results.json` (the fits, every comparison, every projection), `cpu_rates.json` (the measurement)."]
  return "\n".join(textwrap.fill(line, 116, subsequent_indent="  " if line.startswith("- ") else "",
                                  break_long_words=False, break_on_hyphens=False)
                    if not line.startswith(("python", "```")) else line for line in lines) + "\n"


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  measure, out = flags.FLAGS.measure, flags.FLAGS.out
  if measure:
    os.makedirs(os.path.dirname(os.path.abspath(measure)), exist_ok=True)
    record = measure_rates(measure)
    print(f"FLOP rate {record['flop_rate'] / 1e9:.1f} GFLOP/s, read bandwidth {record['read_bandwidth'] / 1e9:.1f} "
          f"GB/s; wrote {measure}")
  if out:
    results = run(out)
    missed = [r for r in results["validation"] if not r["within"]]
    print(f"{len(results['validation'])} comparisons, {len(missed)} outside the tolerance; wrote {out}")
  if not (measure or out):
    raise app.UsageError("pass --measure=<file> and/or --out=<folder>")


def _define_flags():
  """Defined when the command runs, not on import (--out is other commands' flag too)."""
  flags.DEFINE_string("out", None, "Folder for results.json and RUN.md (validation and projections).")
  flags.DEFINE_string("measure", None, "Measure this machine's FLOP rate and read bandwidth into this file.")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
