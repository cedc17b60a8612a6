r"""An analytic cost model of a speculative round's programs: what each reads, computes and sends per device, counted
from a model's config and a (data, model) mesh alone, and timed with four figures of a device.

  python -m experiments.cost_model --measure=results/cost_model/cpu_rates.json   # this CPU's FLOP rate (seconds)
  python -m experiments.cost_model --out=results/cost_model                       # validation and projections

It stands beside XLA's counts of the programs compiled for a TPU (experiments/compile_for.py) as the accelerator
projection's costs (experiments/projection.py). XLA counts what a program as compiled moves, the cache's copies
between memory spaces included, so the same verification came out cheaper than a 1-token step on one v5e chip and
dearer on a v5p slice (results/tpu_compile/results.md); here every term is a count a reader can redo by hand.

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
the validation compares with the same sum. Elementwise work (norms, RoPE, softmax, sampling) and copies a compiler
makes are not counted.
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

import jax.numpy as jnp
import numpy as np
from absl import app, flags

from configs import compile_tpu
from configs.train_budget import EXIT_LAYER
from experiments import cli, projection
from experiments.chips import CHIPS, GPUS
from specjax import sharding
from specjax.config import ModelConfig, shaped_config
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
ACCEPTANCE = "results/compare_drafters-budget/results.json"  # tau of each family at fixed gamma, on this CPU


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
  positions: int = 128  # in use (what attention reads where it does not read the whole cache)
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


def attention(s: Setting, window: int | None, tokens: int, write_only: bool = False) -> Work:
  """One layer's cache: the slots its queries read (none with `write_only`: a layer that only writes its keys and
  values) and the `tokens` it writes, and the FLOPs of its scores and weighted values."""
  c = s.config
  slots = 0 if write_only else s.cache_len if s.whole_cache else min(s.positions, window or s.positions)
  per_slot = 2 * c.num_kv_heads / s.split("kv_heads", c.num_kv_heads) * c.head_dim * s.itemsize
  flops = 4 * s.rows * tokens * c.num_heads / s.split("heads", c.num_heads) * c.head_dim * slots
  return Work(cache_bytes=s.rows * (slots + tokens) * per_slot, flops=flops)


def block(s: Setting, keys: Sequence[str], window: int | None, tokens: int, config: ModelConfig | None = None) -> Work:
  """A decoder block's arrays `keys` (a layer's, or its attention's alone) over `tokens`, with its attention over its
  cache and the all-reduces its split products need."""
  c = config or s.config
  shapes = layer_shapes(c)
  work = arrays(s, [shapes[k] for k in keys], tokens) + attention(s, window, tokens)
  reduced = (("wo", "heads", c.num_heads), ("w_down", "mlp", c.intermediate_size))
  return work + Work(sent_bytes=sum(s.all_reduce(tokens) for key, axis, size in reduced
                                    if key in keys and s.split(axis, size) > 1))


def layers(s: Setting, indices: Sequence[int], tokens: int, config: ModelConfig | None = None) -> Work:
  """Decoder layers `indices` of `config` (default: the target's) over `tokens` new tokens a row."""
  c = config or s.config
  keys = tuple(layer_shapes(c))
  return sum((block(s, keys, c.window(i), tokens, c) for i in indices), Work())


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


# ------------------------------------------------------------------------------------------------------ drafters


@dataclasses.dataclass(frozen=True)
class Drafter:
  """What a drafter family runs (specjax/drafters/): `layers` of the target (layer skip, the exit adapter's first
  k), its own decoder layers (a distilled draft model: copies of target layers), an adapter block, parallel
  residual heads or sequential modules, and the head's columns (`draft_vocab`; None: the whole vocabulary)."""
  family: str  # prompt_lookup, layer_skip, exit_adapter, draft_model, mtp_parallel, mtp_sequential
  layers: tuple[int, ...] = ()
  draft_vocab: int | None = None
  mlp: bool = True  # the exit adapter's block has an MLP
  heads: int = 0  # parallel heads
  modules: int = 0  # sequential modules (1: recurrent, EAGLE's; 4: DeepSeek-V3's chain)
  features: int = 1  # target layers a sequential module reads (3: EAGLE-3's projection)
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


def _columns(s: Setting, d: Drafter) -> int:
  return d.draft_vocab or s.config.vocab_size


def _adapter(s: Setting, d: Drafter, tokens: int) -> Work:
  c = s.config
  keys = attention_keys(c) + (mlp_keys(c) if d.mlp else ())
  return block(s, keys, c.window(len(d.layers)), tokens)


def _module(s: Setting, tokens: int, whole: bool) -> Work:
  """A sequential module over `tokens`: W [norm(emb); norm(h)], then its block (`whole`), or only the keys and values
  it writes into its cache (a chained module's update)."""
  c = s.config
  d = c.hidden_size
  inputs = arrays(s, [ParamSpec((2 * d, d), ("embed", "embed")), ParamSpec((d,), ("norm",)),
                      ParamSpec((d,), ("norm",))], tokens)
  if whole:
    return inputs + block(s, tuple(layer_shapes(c)), None, tokens)
  shapes = layer_shapes(c)
  return inputs + arrays(s, [shapes["wk"], shapes["wv"]], tokens) + attention(s, None, tokens, write_only=True)


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
  raise ValueError(f"unknown drafter family {d.family!r}")


def update(s: Setting, d: Drafter, gamma: int) -> Work:
  """The round's `update` after a chain of gamma drafts was verified (gamma + 1 positions of target features)."""
  c, width = s.config, gamma + 1
  if d.family == "exit_adapter":  # the adapter's cache from the verified positions' features
    return _adapter(s, d, width)
  if d.family == "mtp_sequential":  # every module's cache from the true features; module 1's output is kept
    projected = arrays(s, [ParamSpec((d.features * c.hidden_size, c.hidden_size), ("embed", "embed"))], width)
    work = (projected if d.features > 1 else Work()) + gather(s, width) + _module(s, width, True)
    return work + (d.modules - 1) * _module(s, width, False)
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


def round_seconds(s: Setting, d: Drafter, gamma: int, device: Device) -> dict[str, float]:
  """The programs of a round in seconds: the 1-token step, the drafter's propose of gamma and update, the
  verification of gamma + 1 tokens."""
  return {"decode_step_seconds": seconds(target(s, 1), device),
          "draft_seconds": seconds(propose(s, d, gamma), device),
          "update_seconds": seconds(update(s, d, gamma), device),
          "verify_seconds": seconds(target(s, gamma + 1), device)}


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
    else:
      d = mtp_sequential(config, options["depth"], options["recurrent"], options["eagle3"], vocab)
    for method in projection.files_of(recipe["acceptance_of"]):
      found[method] = (recipe["name"], d)
  return found


def project(acceptance: dict[str, Any]) -> list[dict[str, Any]]:
  """Every projected (model, layout, method): the round's programs in seconds and the speedup at the method's
  measured tau and gamma (`ACCEPTANCE`)."""
  compiled = compile_tpu.get_config()
  vocab_of = {m["name"]: m["draft_vocab"] for m in (*compiled.models, *compile_tpu.FAMILY_MODELS)}
  rows = []
  for name in PROJECTED_MODELS:
    config = shaped_config(name, compiled.dtype)
    drafters = projected_drafters(config, vocab_of[name])
    for topology, data, model, batch in LAYOUTS:
      s = Setting(config, batch=batch, cache_len=compiled.cache_len, positions=compiled.prompt_len, data=data,
                  model=model)
      device = tpu(topology)
      step = target(s, 1)
      for method, summary in acceptance.items():
        if method not in drafters or summary.get("gamma") is None:
          continue
        drafter_name, d = drafters[method]
        gamma, tau = summary["gamma"], summary["mean_accepted"]
        programs = round_seconds(s, d, gamma, device)
        costs = projection.round_costs(gamma, programs["decode_step_seconds"], programs["draft_seconds"],
                                       programs["verify_seconds"], programs["update_seconds"])
        rows.append({"model": name, "topology": topology, "mesh": [data, model], "batch": batch,
                     "acceptance_of": method, "drafter": drafter_name, "gamma": gamma, "tau": tau,
                     "tree_nodes": None, **programs, **costs, "projected_speedup": projection.speedup(tau, costs),
                     "step_bytes": step.weight_bytes + step.cache_bytes, "step_weight_bytes": step.weight_bytes,
                     "step_flops": step.flops, "step_sent_bytes": step.sent_bytes})
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
  with open(os.path.join(ROOT, ACCEPTANCE)) as f:
    measured = json.load(f)
  acceptance = measured["summary"]["methods"]
  compiled = compile_tpu.get_config()
  results = {"name": "cost_model", "environment": cli.environment(), "rates": rates, "tolerance": TOLERANCE,
             "floor": FLOOR, "fits": fits, "validation": validation,
             "workload": {"dtype": compiled.dtype, "cache_len": compiled.cache_len, "positions": compiled.prompt_len,
                          "acceptance": ACCEPTANCE, "acceptance_model": measured["config"]["model"],
                          "chips": {t: tpu(t).source for t, *_ in LAYOUTS}},
             "projections": project(acceptance)}
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
           "(results/accelerator), the tau of results/compare_drafters-budget.",
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
