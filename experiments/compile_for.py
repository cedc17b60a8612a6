r"""Compiles specjax's programs for TPU topologies this machine does not have, and projects their step times.

  python -m experiments.compile_for --config=configs/compile_tpu.py [--workdir=DIR]

Needs libtpu (`pip install -e ".[tpu]"`); for GPUs ("h100:1x1x8", "h200:1x1x1": `GPUS`), JAX's CUDA plugin
(`pip install "jax[cuda12]"`), which compiles for a described GPU without one, but gives no cost analysis then
(memory only, no projection). `jax.experimental.topologies.get_topology_desc` describes a TPU slice
("v5e:2x4": 8 chips) as abstract devices; the parameters, prompts and caches are `jax.ShapeDtypeStruct`s with the
shardings of the project's logical rules (`specjax.sharding`) on a (data, model) mesh of those devices, so no weight
is read or downloaded; `jax.jit(program).lower(...).compile()` runs the TPU compiler itself. The programs are the
ones a user runs, at the config's shapes (bf16, `batch_size` rows, a KV cache of `cache_len` positions):

  prefill              the prompts of `prompt_len` tokens into a fresh cache (the first step of every generate)
  autoregressive       `specjax.generate`'s program: prefill and the whole decode loop
  speculative/<name>   `specjax.generate(..., drafter=...)`'s program (adaptive drafting on, as by default, with the
                       forward costs it uses on an accelerator), one per drafter; and for the drafters that draft
                       trees, `generate(..., gamma=gamma, tree_nodes=N)`'s, one per tree size N of
                       `tree_nodes` (a block's, or the config's)
  train_drafter/<name> `specjax.train_drafter`'s step (AdamW) on a batch of cached features, one per trainable drafter
  train                `specjax.train`'s sharded step over the whole target (`lm_loss`, AdamW)

Per program: compile seconds, the bytes per device XLA allocates (`memory_analysis()`: arguments + outputs +
temporaries + code - aliased) against the chip's HBM, XLA's count of flops and bytes accessed
(`cost_analysis()`, per device), and the calls of specjax's CPU kernels in it (`cpu_kernel_calls`: none belongs in a
program for another platform). A model entry with `"weights": "int8"` holds the target's matrices as int8 codes and
a scale per output channel (specjax/int8.py; `"shape"` names its `MODEL_SHAPES` entry when its name is its own), and
results.md compares each of its programs with the same program of that shape with the config's dtype
(`weights_table`). A program the TPU compiler cannot fit into HBM is reported as not fitting, with its
message; any other failure as failed, with its error.

XLA counts a while loop's body once, whatever its trip count, so the whole-loop programs' counts are not a step's.
The projection compiles loop-free step programs instead ("steps"): one decode step (1 token per row over the cache),
one verification of gamma + 1 tokens, and per drafter one `propose` and one `update` after a round; for trees of N
nodes, one verification of [pending, N nodes] under the tree mask (its accepted path's keys and values moved where a
chain's go: `_tree_verify_step`) and per drafter that drafts trees one proposal of a tree, gamma deep. A program's
projected time is Williams et al.'s (2009) roofline bound, per device:

  t = max(bytes accessed / HBM bandwidth, flops / peak bf16 flops)           (`CHIPS`: the published figures)

and a drafter's round, in Leviathan et al.'s (2023) model, costs its draft, a verification of gamma + 1 tokens and
its update. The draft is XLA's count of `propose` for gamma tokens when that program has no while loop (parallel
heads, prompt lookup, the sequential module's steps under `jax.lax.cond`, which XLA counts as its dearer branch:
every step drafting); otherwise gamma times a 1-token `propose` (a draft step). With tau the tokens a
round commits (bonus included) as measured on this project's CPU runs (`acceptance`: a results.json of
experiments/run.py at fixed gamma; each drafter names the method it takes tau from):

  projected speedup = tau * t(decode step) / (t(draft) + t(verify gamma + 1) + t(update))

A tree round costs its proposal, its verification and the update over its accepted path; its tau comes from a run of
configs/trees.py (`tree_acceptance`); where there is none, a tree's row gives its costs and the tau from which it
pays (its round's cost in decode steps), not a speedup.

These projections are this run's own (results.md, compile_tpu.png): XLA's counts include copies of the cache between
memory spaces, which move a program's costs between topologies more than the program does. The accelerator projection
of the experiments report, docs/results.md and README reads the analytic cost model (experiments/cost_model.py,
experiments/projection.py).

The step programs leave their input and output layouts to the compiler, as a loop's state is (`Lowering`). XLA's
count is of the program as compiled: copies and slices between memory spaces count, and specjax's attention reads
every slot of the cache, so a step's bytes grow with `cache_len`, not with the positions in use. The projection
leaves out inter-chip communication (an all-reduce has no time in XLA's count). The other models (Llama, Gemma and
Qwen shaped) take SmolLM2's acceptance as a stand-in: their own is unmeasured.

The grid: `runs` is a tuple of blocks, each crossing its models, topologies and programs; the union is compiled,
one program at a time. Writes results.json (every program's record, the projections, the chips' figures and
sources), results.md (the tables), compile_tpu.png (HBM per device, projected speedups) and RUN.md (command, code,
machine, times) to the workdir.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import json
import math
import os
import re
import sys
import time
import traceback
from typing import Any, Callable, NamedTuple, Sequence

# Compiling without a TPU holds none, so several processes (two commands, test workers) may load libtpu at once: its
# lock file is for the owner of a TPU. Read when JAX first initialises its backends.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Without a GPU (or its driver) JAX's CUDA plugin fails its version check and is not registered; compiling for
# abstract GPUs needs the plugin, not the driver.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags, logging
from jax.experimental.layout import Format, Layout
from ml_collections import config_flags

from specjax import compilation, sharding, speculative, train, train_drafter, trees
from specjax.adaptive import ACCELERATOR_FORWARD_COSTS, AdaptiveDrafting
from specjax.config import ModelConfig, shaped_config
from specjax.decoding import prefill
from specjax.drafters import Drafter, DraftInputs, PromptInfo, RoundResult, keep_state, make_drafter
from specjax.drafters import tree_drafters as tree_drafters_of_library
from specjax.loading import Model
from specjax.model import KVCache, forward, init_cache
from specjax.sampling import SamplingParams, argmax
from specjax.verify import greedy_verify
from experiments import cli, projection
from experiments.chips import CHIPS, GPUS, Chip  # noqa: F401  (the figures compile_for sizes and times against)
from experiments.cli import ResumableLog, code_commit, environment, parse_flags, write_atomic

_CONFIG = cli.define_config_flag("Compile config: configs/compile_tpu.py[:small].")
_WORKDIR = cli.define_workdir_flag("Output folder (default: workdirs/<config>-<time>).")
_RENDER = flags.DEFINE_string("render", None, "A run's folder: project its compiled costs again at the acceptance "
                              "files its config names (as they are now; with --config, at those that config names, "
                              "which must compile the same programs), and write its results.json, tables, plot and "
                              "RUN.md again, compiling nothing.")

PROGRAMS = ("prefill", "autoregressive", "speculative", "train_drafter", "train", "steps")
TREE_PROGRAMS = ("speculative", "steps")  # the kinds with tree programs (`tree_nodes`)


class Target(NamedTuple):
  """A mesh of abstract TPU or GPU devices and what one device of it has."""
  topology: str
  mesh: jax.sharding.Mesh
  hbm_bytes: float  # per device
  hbm_bytes_per_second: float
  bf16_flops_per_second: float

  def seconds(self, flops: float, bytes_accessed: float) -> float:
    """The roofline bound of a program on one device: max(bytes / bandwidth, flops / peak)."""
    return max(bytes_accessed / self.hbm_bytes_per_second, flops / self.bf16_flops_per_second)


def target(topology: str, data: int, model: int) -> Target:
  """The (data, model) mesh over a topology's abstract devices: a TPU slice ("v5e:2x4", `tpu_target`) or GPUs
  ("h100:1x1x8", `gpu_target`)."""
  if topology.partition(":")[0] in GPUS:
    return gpu_target(topology, data, model)
  return tpu_target(topology, data, model)


def chip_of(topology: str) -> Chip:
  generation = topology.partition(":")[0]
  return GPUS[generation] if generation in GPUS else CHIPS[generation]


def _gpu_description(name: str, chip: Chip) -> str:
  """XLA:GPU's description of a device it compiles for (a GpuTargetConfigProto in text form)."""
  return f"""
gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {int(chip.hbm_bytes_per_second)} l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: {int(chip.hbm_bytes)} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }} registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 9 }}
device_description_str: "NVIDIA {name.upper()}"
"""


def gpu_target(topology: str, data: int, model: int) -> Target:
  """The (data, model) mesh over abstract GPUs: "h100:1x1x8" is 1 slice of 1 host with 8 H100s. XLA:GPU's cost
  analysis is not available without a GPU, so the programs compiled for one have memory but no flops or bytes."""
  try:
    from jax.experimental import topologies
    import jax_plugins.xla_cuda12  # noqa: F401  (imported for its error only)
  except ImportError as e:
    raise SystemExit(f"compiling for a GPU needs JAX's CUDA plugin: pip install 'jax[cuda12]' ({e})") from e
  name, _, shape = topology.partition(":")
  if not re.fullmatch(r"\d+x\d+x\d+", shape):
    raise ValueError(f"topology {topology!r}: expected <gpu>:<slices>x<hosts>x<gpus per host>, e.g. 'h100:1x1x8'")
  chip = GPUS[name]
  devices = topologies.get_topology_desc(platform="cuda", topology=shape,
                                         target_config=_gpu_description(name, chip)).devices
  return Target(topology, sharding.make_mesh(data, model, devices=devices), chip.hbm_bytes,
                chip.hbm_bytes_per_second, chip.bf16_flops_per_second)


def tpu_target(topology: str, data: int, model: int) -> Target:
  """The (data, model) mesh over a TPU topology's abstract devices ("v5e:2x4"; one chip: "v5e:1x1")."""
  try:
    from jax.experimental import topologies
    import libtpu  # noqa: F401  (imported for its error only: get_topology_desc's is unclear without it)
  except ImportError as e:
    raise SystemExit(f"compiling for a TPU needs libtpu: pip install -e '.[tpu]' ({e})") from e
  generation, _, shape = topology.partition(":")
  if generation not in CHIPS or not re.fullmatch(r"\d+(x\d+)+", shape):
    raise ValueError(f"topology {topology!r}: expected <generation>:<chips per axis>, e.g. 'v5e:2x4', with a "
                     f"generation among {', '.join(CHIPS)}")
  one_chip = math.prod(int(n) for n in shape.split("x")) == 1
  # A single chip is a host of one chip; the default bounds describe a full host (4 or 8 chips).
  devices = topologies.get_topology_desc(topology_name=topology, platform="tpu",
                                         **({"chips_per_host_bounds": (1, 1, 1)} if one_chip else {})).devices
  chip = CHIPS[generation]
  per_chip = chip.tensor_cores // devices[0].num_cores  # devices per chip: one per TensorCore without megacore
  return Target(topology, sharding.make_mesh(data, model, devices=devices), chip.hbm_bytes / per_chip,
                chip.hbm_bytes_per_second / per_chip, chip.bf16_flops_per_second / per_chip)


# ------------------------------------------------------------------------------------------------ models


@dataclasses.dataclass
class Shapes:
  """A model's shapes on one target: its abstract parameters and drafters, and the shapes of the inputs."""
  config: ModelConfig
  params: Any  # sharded ShapeDtypeStructs
  drafters: dict[str, Drafter]  # name -> the drafter (its params: `draft_params`)
  draft_params: dict[str, Any]  # name -> sharded ShapeDtypeStructs
  gammas: dict[str, int]  # name -> the gamma of its measured acceptance (its projected round's)
  batch: int
  prompt_len: int
  cache_len: int
  target: Target

  def sds(self, shape, dtype, spec=None):
    """A ShapeDtypeStruct on the target's mesh: rows over the data axis (`spec` "batch"), or replicated."""
    mesh = self.target.mesh
    placed = sharding.batch_sharding(mesh) if spec == "batch" else sharding.replicated(mesh)
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=placed)

  @property
  def cache_sharding(self):
    return sharding.cache_sharding(self.config, self.target.mesh, batch_size=self.batch, max_len=self.cache_len)

  def cache(self) -> KVCache:
    shapes = jax.eval_shape(lambda: init_cache(self.config, self.batch, self.cache_len))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.cache_sharding), shapes)


def drafter_options(recipe: dict, config: ModelConfig, draft_vocab: int) -> dict:
  """A recipe's `make_drafter` options for this model: layer fractions become layers, `draft_vocab` a token map
  (the first V' ids: the shapes of a trained map)."""
  options = dict(recipe.get("options", {}))
  if "exit_layer_fraction" in recipe:
    options["exit_layer"] = max(1, round(recipe["exit_layer_fraction"] * config.num_layers))
  if "skip_layer_fraction" in recipe:
    options["skip_layers"] = (round(recipe["skip_layer_fraction"] * config.num_layers),)
  if recipe.get("draft_vocab"):
    options["token_map"] = np.arange(draft_vocab)
  return options


def abstract_drafter(name: str, options: dict, config: ModelConfig, params) -> tuple[Drafter, Any]:
  """`make_drafter(name, ...)` for a model with abstract weights: (the drafter, ShapeDtypeStructs of its params).
  Fresh parameters are built by tracing, so none is materialised."""
  built = {}

  def build(params):
    built["drafter"] = make_drafter(name, Model(config=config, params=params, tokenizer=None), **options)
    return built["drafter"].params
  shapes = jax.eval_shape(build, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
  return dataclasses.replace(built["drafter"], params=None), shapes  # no traced arrays left behind


def model_shapes(model_config: ModelConfig, draft_vocab: int, target: Target, config: ml_collections.ConfigDict,
                 acceptance: dict[str, dict[str, float]], weights: str = "") -> Shapes:
  """The model's and its drafters' abstract parameters on the target's mesh, and the config's input shapes;
  `acceptance` (`measured_acceptance`) gives each drafter's gamma. `weights="int8"`: the target's matrices as int8
  codes with a scale per output channel (`specjax.int8`, `sharding.abstract_params`)."""
  params = sharding.abstract_params(model_config, target.mesh, weights=weights)
  drafters, draft_params = {}, {}
  for recipe in config.drafters:
    drafter, shapes = abstract_drafter(recipe["drafter"], drafter_options(recipe, model_config, draft_vocab),
                                       model_config, params)
    drafters[recipe["name"]] = drafter
    draft_params[recipe["name"]] = sharding.abstract_tree(shapes, drafter.param_specs, target.mesh)
  gammas = {recipe["name"]: int(acceptance[projection.methods_of(recipe)[0]]["gamma"]) for recipe in config.drafters}
  return Shapes(model_config, params, drafters, draft_params, gammas, config.batch_size, config.prompt_len,
                config.cache_len, target)


# ---------------------------------------------------------------------------------------------- programs


class Lowering(NamedTuple):
  """A program to compile: a function, its abstract arguments and static arguments.

  `fn` is a jitted function, lowered as a user's call would be, or (`free_layouts`) a plain one that is jitted here
  with every input and output layout left to the compiler: a step program stands for one iteration of a decode
  loop, whose state never leaves the layouts the compiler chose, so converting to and from the default layouts at
  its boundary is not a step's cost."""
  name: str
  drafter: str | None
  fn: Callable
  args: tuple
  static: dict
  donate: tuple[int, ...] = ()
  free_layouts: bool = False
  tree_nodes: int | None = None  # a tree program's N (None: a chain's, or no draft at all)

  def lower(self):
    if not self.free_layouts:
      return self.fn.lower(*self.args, **self.static)
    auto = jax.tree.map(lambda x: Format(Layout.AUTO, x.sharding), self.args)
    jitted = jax.jit(functools.partial(self.fn, **self.static), in_shardings=auto, out_shardings=Format(Layout.AUTO),
                     donate_argnums=self.donate)
    return jitted.lower(*jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.args))


@functools.partial(jax.jit, static_argnames=("config", "cache_len", "cache_sharding"))
def _prefill(params, prompt_tokens, lengths, *, config, cache_len, cache_sharding):
  """The prompts into a fresh cache and the first token, as every generate program starts."""
  cache = sharding.constrain_cache(init_cache(config, prompt_tokens.shape[0], cache_len), cache_sharding)
  logits, _, out = prefill(params, config, prompt_tokens, lengths, cache)
  return argmax(logits), sharding.constrain_cache(out.cache, cache_sharding)


def _target_step(params, tokens, cache, position, *, config):
  """One target forward over tokens [B, T] at `position`: a decode step (T = 1) or a verification (T = gamma + 1)."""
  out = forward(params, tokens, cache, position, config)
  return argmax(out.logits), out.cache


def _tree_verify_step(params, tokens, parents, cache, position, *, config, depth):
  """One verification of a draft tree, as a tree round runs it (specjax/speculative.py): the target over [pending,
  its N nodes] [B, N + 1] under the tree mask of `parents` [B, N], the longest path of argmax matches accepted, and
  that path's keys and values moved where a chain of its tokens would have written them (`trees.move_path`)."""
  batch, nodes = parents.shape
  tree = trees.describe(parents, batch, nodes)
  out = forward(params, tokens, cache, position, config, block=tree.block_mask())
  end, next_token = greedy_verify(tokens[:, 1:], out.logits, None, parents)
  return next_token, trees.move_path(out.cache, position, trees.path(tree, end, depth))


def _propose(target_params, draft_params, state, inputs, *, drafter, gamma, sampling):
  proposal = drafter.propose(target_params, draft_params, drafter.options, state, inputs, gamma, sampling)
  return proposal.tokens, proposal.state, proposal.target_cache, proposal.parents


def _update(target_params, draft_params, state, result, *, drafter):
  return drafter.update(target_params, draft_params, drafter.options, state, result)


def _prompt(s: Shapes, drafter: Drafter, batch: int) -> PromptInfo:
  b, t, d = batch, s.prompt_len, s.config.hidden_size
  layers = len(drafter.feature_layers)
  return PromptInfo(tokens=s.sds((b, t), jnp.int32), lengths=s.sds((b,), jnp.int32),
                    first_token=s.sds((b,), jnp.int32), last_hidden=s.sds((b, d), s.config.dtype),
                    features=s.sds((b, t, layers, d), s.config.dtype) if layers else None, cache_len=s.cache_len)


def draft_state(s: Shapes, name: str):
  """The drafter's state after `init`, as sharded ShapeDtypeStructs: each array's batch axis (the one whose size
  follows the batch) over the data axis, the rest replicated."""
  drafter = s.drafters[name]

  def init_shapes(batch):
    return jax.eval_shape(lambda p, dp, prompt: drafter.init(p, dp, drafter.options, prompt), s.params,
                          s.draft_params[name], _prompt(s, drafter, batch))
  state, doubled = init_shapes(s.batch), init_shapes(2 * s.batch)
  data_axes = sharding.batch_sharding(s.target.mesh).spec[0]

  def placed(x, y):
    axis = next((i for i, (a, b) in enumerate(zip(x.shape, y.shape)) if a != b), None)
    spec = [None] * len(x.shape)
    if axis is not None:
      spec[axis] = data_axes
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(
        s.target.mesh, jax.sharding.PartitionSpec(*spec)))
  return jax.tree.map(placed, state, doubled)


def _inputs(s: Shapes, tree_nodes: int | None = None) -> DraftInputs:
  return DraftInputs(sequence=s.sds((s.batch, s.cache_len), jnp.int32, "batch"),
                     position=s.sds((s.batch,), jnp.int32, "batch"), target_cache=s.cache(),
                     key=s.sds((2,), jnp.uint32), keep_bars=s.sds((), jnp.float32), go_bars=s.sds((), jnp.float32),
                     tree_nodes=tree_nodes)


def _tokens_key(s: Shapes):
  return (s.sds((s.batch, s.prompt_len), jnp.int32, "batch"), s.sds((s.batch,), jnp.int32, "batch"),
          s.sds((2,), jnp.uint32))


def tree_drafters(s: Shapes, drafters: Sequence[str]) -> list[str]:
  """Those of `drafters` that draft trees (`Drafter.trees`)."""
  return [name for name in drafters if s.drafters[name].trees]


def generate_programs(s: Shapes, config: ml_collections.ConfigDict, which: str, drafters: Sequence[str] = (),
                      tree_nodes: Sequence[int] = ()) -> list[Lowering]:
  """The whole-loop programs of `which` ("prefill", "autoregressive", "speculative"); "speculative" is one per drafter
  drafting chains, and one per drafter that drafts trees and tree size of `tree_nodes`."""
  tokens, lengths, key = _tokens_key(s)
  sampling = SamplingParams(temperature=config.temperature)
  # A round writes its block past the committed tokens: gamma drafts, or a tree's nodes, and the pending token.
  max_new_tokens = s.cache_len - s.prompt_len - (max([config.gamma, *tree_nodes]) + 1)
  common = dict(config=s.config, sampling=sampling, max_new_tokens=max_new_tokens, cache_len=s.cache_len,
                stop_ids=tuple(config.stop_ids), cache_sharding=s.cache_sharding)
  if which == "prefill":
    return [Lowering("prefill", None, _prefill, (s.params, tokens, lengths),
                     dict(config=s.config, cache_len=s.cache_len, cache_sharding=s.cache_sharding))]
  if which == "autoregressive":
    generate = importlib.import_module("specjax.generate")  # the module (specjax.generate is also the function)
    return [Lowering("autoregressive", None, generate._generate_autoregressive, (s.params, tokens, lengths, key),
                     common)]
  programs = []
  rows_per_device = max(1, s.batch // s.target.mesh.shape["data"])
  # generate's default on an accelerator: adaptive drafting with the accelerator's forward costs.
  policy = AdaptiveDrafting(forward_costs=ACCELERATOR_FORWARD_COSTS)
  for name in drafters:
    drafter = s.drafters[name]
    programs.append(Lowering("speculative", name, speculative._generate_speculative,
                             (s.params, s.draft_params[name], tokens, lengths, key),
                             dict(common, drafter=drafter.static(),
                                  policy=policy.plan(drafter.cost, config.gamma, rows_per_device))))
  # generate(..., gamma=depth, tree_nodes=N): rounds of a plain step, a chain or a tree of N nodes, gamma deep, as the
  # policy chooses.
  for name in tree_drafters(s, drafters):
    drafter = s.drafters[name]
    for nodes in tree_nodes:
      programs.append(Lowering("speculative", name, speculative._generate_speculative,
                               (s.params, s.draft_params[name], tokens, lengths, key),
                               dict(common, drafter=drafter.static(),
                                    policy=policy.plan(drafter.cost, config.gamma, rows_per_device,
                                                       tree_nodes=nodes)), tree_nodes=nodes))
  return programs


def training_programs(s: Shapes, config: ml_collections.ConfigDict, which: str,
                      drafters: Sequence[str] = ()) -> list[Lowering]:
  """The training steps of `which` ("train_drafter": one per drafter of `train_drafters` among `drafters`;
  "train")."""
  mesh, b, t = s.target.mesh, config.train.batch_size, config.train.seq_len
  optimizer = train.make_optimizer(1e-4, warmup_steps=10, total_steps=100)

  def step(trainable, frozen, loss_fn, batch, has_aux):
    state = train.TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=trainable,
                             opt_state=jax.eval_shape(optimizer.init, trainable))
    state_sharding = train.train_state_sharding(state, optimizer, mesh)
    jitted = train.make_train_step(loss_fn, optimizer, mesh, state_sharding=state_sharding,
                                   frozen_sharding=sharding.sharding_of(frozen), has_aux=has_aux)
    return jitted, (state, frozen, batch)

  tokens = {"tokens": jax.ShapeDtypeStruct((b, t), jnp.int32), "mask": jax.ShapeDtypeStruct((b, t), jnp.bool_)}
  if which == "train":
    trainable, frozen = train.split_params(s.params, lambda path, leaf: True)
    jitted, args = step(trainable, frozen, train.lm_loss(s.config), tokens, has_aux=False)
    return [Lowering("train", None, jitted, args, {})]
  programs = []
  for name in [d for d in config.train_drafters if d in drafters]:
    drafter = s.drafters[name]
    if drafter.loss is None:
      raise ValueError(f"train_drafters: {name!r} ({drafter.name}) is not trainable")
    layers = len(train_drafter.default_feature_layers(drafter, s.config.num_layers).feature_layers)
    batch = dict(tokens, features=jax.ShapeDtypeStruct((b, t, layers, s.config.hidden_size), jnp.float32),
                 teacher_ids=jax.ShapeDtypeStruct((b, t, config.train.top_k), jnp.int32),
                 teacher_probs=jax.ShapeDtypeStruct((b, t, config.train.top_k), jnp.float32))
    trainable, frozen, loss_fn = train_drafter.training_split(drafter, s.params, s.draft_params[name])
    jitted, args = step(trainable, frozen, loss_fn, batch, has_aux=True)
    programs.append(Lowering("train_drafter", name, jitted, args, {}))
  return programs


def step_programs(s: Shapes, config: ml_collections.ConfigDict, drafters: Sequence[str],
                  tree_nodes: Sequence[int] = ()) -> list[Lowering]:
  """The loop-free programs of the projection: a decode step, a verification of gamma + 1 tokens per gamma the
  drafters' measured methods use, and per drafter `propose` (of its gamma tokens; of one, a step, when it drafts in a
  loop) and `update` (unless it keeps no state). With `tree_nodes`, per size N a verification of a tree of N nodes
  (`_tree_verify_step`) and per drafter that drafts trees its proposal of one, `config.gamma` deep, and its update
  after a tree round where that differs from its chain's (a tree round hands it the accepted path: `config.gamma` + 1
  positions)."""
  sampling = SamplingParams(temperature=config.temperature)
  position = s.sds((s.batch,), jnp.int32, "batch")
  gammas = sorted({s.gammas[name] for name in drafters})
  step = functools.partial(Lowering, donate=(2,), free_layouts=True)  # the cache or the draft state is donated
  programs = [step("decode_step", None, _target_step,
                   (s.params, s.sds((s.batch, 1), jnp.int32, "batch"), s.cache(), position), dict(config=s.config))]
  for gamma in gammas:
    programs.append(step(f"verify_{gamma + 1}", None, _target_step,
                         (s.params, s.sds((s.batch, gamma + 1), jnp.int32, "batch"), s.cache(), position),
                         dict(config=s.config)))
  with_trees = tree_drafters(s, drafters) if tree_nodes else []
  for nodes in tree_nodes if with_trees else ():
    programs.append(Lowering(f"verify_tree_{nodes + 1}", None, _tree_verify_step,
                             (s.params, s.sds((s.batch, nodes + 1), jnp.int32, "batch"),
                              s.sds((s.batch, nodes), jnp.int32, "batch"), s.cache(), position),
                             dict(config=s.config, depth=config.gamma), donate=(3,), free_layouts=True,
                             tree_nodes=nodes))

  def update(name: str, label: str, width: int) -> Lowering:
    d, layers = s.config.hidden_size, len(s.drafters[name].feature_layers)
    result = RoundResult(sequence=s.sds((s.batch, s.cache_len), jnp.int32, "batch"), position=position,
                         accepted=position, verify_hidden=s.sds((s.batch, width, d), s.config.dtype, "batch"),
                         features=s.sds((s.batch, width, layers, d), s.config.dtype, "batch") if layers else None,
                         verify_position=position, drafted=True)
    return step(label, name, _update, (s.params, s.draft_params[name], draft_state(s, name), result),
                dict(drafter=s.drafters[name].static()))

  for name in drafters:
    drafter, gamma = s.drafters[name], s.gammas[name]
    state = draft_state(s, name)
    propose = functools.partial(Lowering, drafter=name, fn=_propose, args=(s.params, s.draft_params[name], state,
                                                                          _inputs(s)), donate=(2, 3), free_layouts=True)
    whole = propose(f"propose_{gamma}", static=dict(drafter=drafter.static(), gamma=gamma, sampling=sampling))
    # XLA would count a loop's body once: a drafter that loops over its steps is counted by one step instead.
    if "stablehlo.while" in whole.lower().as_text():
      whole = propose("propose_1", static=dict(drafter=drafter.static(), gamma=1, sampling=sampling))
    programs.append(whole)
    stateful = drafter.update is not keep_state
    if stateful:
      programs.append(update(name, "update", gamma + 1))
    if name not in with_trees:
      continue
    # A tree grows by depth in unrolled steps (`draft_tree.grow`): its proposal is counted whole.
    for nodes in tree_nodes:
      programs.append(Lowering(f"propose_tree_{nodes}", name, _propose,
                               (s.params, s.draft_params[name], state, _inputs(s, nodes)),
                               dict(drafter=drafter.static(), gamma=config.gamma, sampling=sampling),
                               donate=(2, 3), free_layouts=True, tree_nodes=nodes))
    if stateful and config.gamma != gamma:
      programs.append(update(name, f"update_{config.gamma + 1}", config.gamma + 1))
  return programs


# ---------------------------------------------------------------------------------------------- compiling


def _first_line(error: BaseException, limit: int = 600) -> str:
  text = f"{type(error).__name__}: {error}".strip()
  return text[:limit]


def compile_program(lowering: Lowering, target: Target) -> dict[str, Any]:
  """Compiles one program; its record: status ("compiled", "does_not_fit", "failed"), seconds, memory per device,
  XLA's flops and bytes accessed per device, and whether its HLO has a while loop (whose body XLA counts once)."""
  record: dict[str, Any] = {"program": lowering.name, "drafter": lowering.drafter, "tree_nodes": lowering.tree_nodes}
  start, cpu_start = time.perf_counter(), time.process_time()

  def clocks():  # wall seconds, and CPU seconds of this process (the figure a shared machine disturbs least)
    record["seconds"], record["cpu_seconds"] = time.perf_counter() - start, time.process_time() - cpu_start
  try:
    lowered = lowering.lower()
    record["lower_seconds"] = time.perf_counter() - start
    compiled = lowered.compile(compiler_options=compilation.COMPILER_OPTIONS)  # as generate compiles
  except Exception as e:  # noqa: BLE001  (every failure is a result: which program, why)
    clocks()
    message = _first_line(e)
    record["status"] = "does_not_fit" if "RESOURCE_EXHAUSTED" in message or "Ran out of memory" in message else "failed"
    record["error"] = message
    if record["status"] == "failed":
      logging.error("%s %s on %s failed:\n%s", lowering.name, lowering.drafter or "", target.topology,
                    traceback.format_exc(limit=4))
    return record
  clocks()
  record["status"] = "compiled"
  memory = compiled.memory_analysis()
  record["memory"] = {"arguments": memory.argument_size_in_bytes, "outputs": memory.output_size_in_bytes,
                      "temporaries": memory.temp_size_in_bytes, "code": memory.generated_code_size_in_bytes,
                      "aliased": memory.alias_size_in_bytes}
  total = (memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
           + memory.generated_code_size_in_bytes - memory.alias_size_in_bytes)
  record["bytes_per_device"] = total
  record["hbm_fraction"] = total / target.hbm_bytes
  costs = compiled.cost_analysis()
  if isinstance(costs, (list, tuple)):  # older jax: one dict per computation
    costs = costs[0] if costs else {}
  if costs:  # XLA:GPU gives none without a GPU
    record["flops"] = float(costs.get("flops", 0.0))
    record["bytes_accessed"] = float(costs.get("bytes accessed", 0.0))
    record["projected_seconds"] = target.seconds(record["flops"], record["bytes_accessed"])
  else:
    record["flops"] = record["bytes_accessed"] = record["projected_seconds"] = None
  text = compiled.as_text()
  record["has_loop"] = bool(re.search(r"\bwhile\(", text))
  # specjax's CPU kernels are XLA custom calls named specjax_*: none belongs in a program for another platform.
  record["cpu_kernel_calls"] = len(re.findall(r"custom_call_target=\"specjax_", text))
  return record


def blocks(config: ml_collections.ConfigDict) -> list[tuple[str, tuple[str, int, int], str, tuple[str, ...],
                                                             tuple[int, ...]]]:
  """The union of the config's run blocks: (model, (topology, data, model axis), program, drafters, tree sizes), each
  program once with the union of its blocks' drafters (a block's `drafters`, default all: those of speculative, steps
  and train_drafter) and tree sizes (a block's `tree_nodes`, default `config.tree_nodes`: the trees of speculative
  and steps, for the drafters that draft trees), ordered by model and topology (so each model's shapes are built once
  per topology)."""
  models = [m["name"] for m in config.models]
  topologies = [tuple(t) for t in config.topologies]
  drafters = [d["name"] for d in config.drafters]
  wanted: dict[tuple[str, str, str], tuple[set[str], set[int]]] = {}
  for block in config.runs:
    for field, known in (("models", models), ("topologies", [t[0] for t in topologies]), ("programs", PROGRAMS),
                         ("drafters", drafters)):
      unknown = sorted(set(block.get(field, ())) - set(known))
      if unknown:
        raise ValueError(f"runs: unknown {field} {unknown}; known: {known}")
    sizes = tuple(block.get("tree_nodes", config.get("tree_nodes", ())))  # a config from before trees: none
    if not all(isinstance(n, int) and n >= 1 for n in sizes):
      raise ValueError(f"runs: tree_nodes are positive integers (a tree's nodes), got {sizes}")
    for m in block["models"]:
      for t in block["topologies"]:
        for p in block["programs"]:
          names, nodes = wanted.setdefault((m, t, p), (set(), set()))
          names.update(block.get("drafters", drafters))
          nodes.update(sizes if p in TREE_PROGRAMS else ())
  order = []
  for m in models:
    for t in topologies:
      for p in PROGRAMS:
        if (m, t[0], p) in wanted:
          names, nodes = wanted[m, t[0], p]
          order.append((m, t, p, tuple(d for d in drafters if d in names), tuple(sorted(nodes))))
  return order


def missing_programs(config: ml_collections.ConfigDict, records: Sequence[dict]) -> list[str]:
  """The programs a user runs (every kind but the projection's `steps`) that the config's grid asks for and no record
  of `records` built (compiled, or compiled and found too large for the chip's HBM), as labels "model topology kind
  [drafter] [tree N]", in the grid's order."""
  trees = set(tree_drafters_of_library())
  recipes = {d["name"]: d["drafter"] for d in config.drafters}
  built = {(r["model"], r["topology"], r["kind"], r["drafter"], r.get("tree_nodes")) for r in records
           if r["status"] != "failed"}
  wanted = []
  for model, (topology, _, _), kind, drafters, tree_nodes in blocks(config):
    if kind in ("prefill", "autoregressive", "train"):
      wanted.append((model, topology, kind, None, None))
    elif kind == "speculative":
      wanted += [(model, topology, kind, d, None) for d in drafters]
      wanted += [(model, topology, kind, d, n) for d in drafters if recipes[d] in trees for n in tree_nodes]
    elif kind == "train_drafter":
      wanted += [(model, topology, kind, d, None) for d in config.train_drafters if d in drafters]
  return [" ".join([m, t, k] + ([d] if d else []) + ([f"tree {n}"] if n else [])) for m, t, k, d, n in wanted
          if (m, t, k, d, n) not in built]


def programs_of(s: Shapes, config: ml_collections.ConfigDict, which: str, drafters: Sequence[str],
                tree_nodes: Sequence[int] = ()) -> list[Lowering]:
  """The programs of kind `which` ("prefill", ..., "steps"; `PROGRAMS`), with `drafters` where it has drafters and
  trees of `tree_nodes` where it has trees (`TREE_PROGRAMS`)."""
  if which in ("prefill", "autoregressive", "speculative"):
    return generate_programs(s, config, which, drafters, tree_nodes)
  if which in ("train_drafter", "train"):
    return training_programs(s, config, which, drafters)
  return step_programs(s, config, drafters, tree_nodes)


def compile_all(config: ml_collections.ConfigDict, progress: Callable[[str], None] = print,
                model_configs: dict[str, ModelConfig] | None = None, log: ResumableLog | None = None,
                done: dict[tuple, dict] | None = None) -> list[dict]:
  """Every program of the config's blocks, compiled one at a time; their records (each also appended to `log` as soon
  as it is made, so a long run that stops keeps what it compiled; a program whose record is in `done`, by
  `record_key`, keeps it and is not compiled again). A model is `specjax.config.shaped_config(name)`
  unless `model_configs` gives its config."""
  done = done or {}
  acceptance = projection.measured_acceptance(config.acceptance)
  unknown = sorted({m for r in config.drafters for m in projection.methods_of(r)} - set(acceptance))
  if unknown:
    raise ValueError(f"drafters take their acceptance from methods {unknown}, which "
                     f"{projection.files_of(config.acceptance)} lack; they have {sorted(acceptance)}")
  for recipe in config.drafters:
    gammas = {m: acceptance[m]["gamma"] for m in projection.methods_of(recipe)}
    if len(set(gammas.values())) != 1:
      raise ValueError(f"drafter {recipe['name']}: the methods it takes its acceptance from draft at different gammas "
                       f"{gammas}; its step programs are compiled at one")
  records, shapes = [], {}
  model_configs = model_configs or {}
  models = {m["name"]: m for m in config.models}
  for model, (topology, data, model_axis), which, drafters, tree_nodes in blocks(config):
    key = (model, topology)
    if key not in shapes:
      shapes.clear()
      mesh_target = target(topology, data, model_axis)
      entry = models[model]
      model_config = model_configs.get(model) or shaped_config(entry.get("shape", model), config.dtype)
      shapes[key] = model_shapes(model_config, entry["draft_vocab"], mesh_target, config, acceptance,
                                 weights=entry.get("weights", ""))
    s = shapes[key]
    for lowering in programs_of(s, config, which, drafters, tree_nodes):
      before = done.get((model, topology, which, lowering.name, lowering.drafter, lowering.tree_nodes))
      if before is not None:
        records.append(before)
        continue
      record = compile_program(lowering, s.target)
      # What jax keeps of a program once it is compiled (~1 GiB of a SmolLM2 speculative program for a v5e slice) is
      # not needed again: kept, a few dozen programs fill the machine's memory.
      jax.clear_caches()
      record.update(model=model, topology=topology, mesh=[data, model_axis], kind=which,
                    shape=models[model].get("shape", model), weights=models[model].get("weights") or config.dtype)
      records.append(record)
      if log is not None:
        log.append(record)
      progress(f"{model} {topology} {_program_label(record)}: "
               f"{record['status']} in {record['seconds']:.1f} s"
               + (f", {record['bytes_per_device'] / 2**30:.2f} GiB per device ({record['hbm_fraction']:.0%} of HBM)"
                  if record["status"] == "compiled" else f" ({record.get('error', '')[:200]})"))
  return records


# -------------------------------------------------------------------------------------------- projection


def projections(records: list[dict], config: ml_collections.ConfigDict, acceptance: dict[str, dict[str, Any]],
                trees_acceptance: dict[str, dict[str, Any]] | None = None) -> list[dict]:
  """Per model, topology and drafter: the projected round and the speedup over the projected decode step (module
  docstring), for its chain and for each tree size compiled. A round's `break_even_tau` is its cost in decode steps:
  the tokens it must commit to pay. A tree's tau comes from `trees_acceptance` (`tree_acceptance`) at the config's
  gamma (its depth); without it the tree's row has its costs, no tau and no speedup. Drafters whose step programs did
  not all compile, or whose chain method has no acceptance, are left out."""
  steps: dict[tuple, dict] = {}
  for r in records:
    if r["kind"] == "steps" and r["status"] == "compiled" and r["projected_seconds"] is not None:
      steps[(r["model"], r["topology"], r["program"], r["drafter"])] = r
  out = []

  def row(model, topology, decode, name, method, gamma, tau, draft, counted, verify, update, tree_nodes=None):
    update_seconds = update["projected_seconds"] if update else 0.0
    costs = projection.round_costs(gamma, decode["projected_seconds"], draft, verify["projected_seconds"],
                                   update_seconds)
    out.append({"model": model, "topology": topology, "drafter": name, "tree_nodes": tree_nodes,
                "acceptance_of": method, "gamma": gamma, "tau": tau, "decode_step_seconds": decode["projected_seconds"],
                "draft_seconds": draft, "draft_counted": counted, "verify_seconds": verify["projected_seconds"],
                "update_seconds": update_seconds, "round_seconds": draft + verify["projected_seconds"] + update_seconds,
                "batch": config.batch_size, **costs, "break_even_tau": projection.break_even_tau(costs),
                "projected_speedup": None if tau is None else projection.speedup(tau, costs)})

  for model, topology in sorted({(m, t) for m, t, _, _ in steps}):
    decode = steps.get((model, topology, "decode_step", None))
    if decode is None:
      continue
    for recipe, method in [(r, m) for r in config.drafters for m in projection.methods_of(r)]:
      name = recipe["name"]
      if method not in acceptance:
        continue
      gamma, tau = acceptance[method]["gamma"], acceptance[method]["tau"]
      verify = steps.get((model, topology, f"verify_{gamma + 1}", None))
      whole = steps.get((model, topology, f"propose_{gamma}", name))
      single = steps.get((model, topology, "propose_1", name))
      update = steps.get((model, topology, "update", name))
      if verify is None or (whole or single) is None:
        continue
      counted_whole = whole is not None
      draft = whole["projected_seconds"] if counted_whole else gamma * single["projected_seconds"]
      row(model, topology, decode, name, method, gamma, tau, draft,
          "propose(gamma)" if counted_whole else "gamma x propose(1)", verify, update)
      if method != projection.methods_of(recipe)[0]:
        continue  # trees: at the tau of the drafter's first method (configs/trees.py runs measure those)
      # Its trees, config.gamma deep: after a tree round its update reads the accepted path, config.gamma + 1 wide.
      depth = config.gamma
      tree_update = steps.get((model, topology, f"update_{depth + 1}", name)) or (update if gamma == depth else None)
      for nodes in sorted({r["tree_nodes"] for r in records if r["kind"] == "steps" and r["drafter"] == name
                           and r.get("tree_nodes") and r["model"] == model and r["topology"] == topology}):
        tree_verify = steps.get((model, topology, f"verify_tree_{nodes + 1}", None))
        draft_tree = steps.get((model, topology, f"propose_tree_{nodes}", name))
        if tree_verify is None or draft_tree is None or (update is not None and tree_update is None):
          continue
        measured = (trees_acceptance or {}).get(projection.tree_method(method, nodes))
        tau = measured["tau"] if measured and (measured["gamma"], measured["tree_nodes"]) == (depth, nodes) else None
        row(model, topology, decode, name, projection.tree_method(method, nodes), depth, tau,
            draft_tree["projected_seconds"], "propose(tree)", tree_verify, tree_update, tree_nodes=nodes)
  return out


# ----------------------------------------------------------------------------------------------- reports


def _gib(n: float) -> str:
  return f"{n / 2**30:.2f}"


def _program_label(r: dict) -> str:
  tree = r.get("tree_nodes") and r["program"] == "speculative"  # step programs name their tree size
  return r["program"] + (f" {r['drafter']}" if r["drafter"] else "") + (f" tree {r['tree_nodes']}" if tree else "")


def markdown(results: dict) -> str:
  """results.md: the compile table per model and topology, the step costs and the projections."""
  records, lines = results["records"], []
  counts = {s: sum(r["status"] == s for r in records) for s in ("compiled", "does_not_fit", "failed")}
  lines += [f"# Compiled without the devices ({results['name']})", "",
            f"{len(records)} programs: {counts['compiled']} compiled, {counts['does_not_fit']} do not fit in HBM, "
            f"{counts['failed']} failed; {results['compile_seconds']:.0f} s compiling, "
            + (f"{results['wall_seconds']:.0f} s in the last of the sittings it resumed over (RUN.md)"
               if results.get("resumed_records") else f"{results['wall_seconds']:.0f} s in all")
            + f". bf16, batch {results['config']['batch_size']}, cache {results['config']['cache_len']} positions, "
            f"prompts of {results['config']['prompt_len']} tokens, gamma {results['config']['gamma']}.", ""]
  lines += ["## Programs", "",
            "| model | topology | mesh (data, model) | program | status | compile s | GiB per device | of HBM | "
            "GFLOP per device | GB accessed per device |",
            "|---|---|---|---|---|---:|---:|---:|---:|---:|"]
  for r in records:
    if r["kind"] == "steps":
      continue
    sizes = ["", "", "", ""]
    if r["status"] == "compiled":
      counted = r["flops"] is not None
      sizes = [_gib(r["bytes_per_device"]), f"{r['hbm_fraction']:.0%}", f"{r['flops'] / 1e9:.1f}" if counted else "–",
               f"{r['bytes_accessed'] / 1e9:.2f}" if counted else "–"]
    lines.append(f"| {r['model']} | {r['topology']} | {r['mesh'][0]} x {r['mesh'][1]} | {_program_label(r)} | "
                 f"{r['status']} | {r['seconds']:.1f} | " + " | ".join(sizes) + " |")
  failures = [r for r in records if r["status"] != "compiled"]
  if failures:
    lines += ["", "Not compiled:", ""]
    lines += [f"- {r['model']} {r['topology']} {_program_label(r)}: {r['status']}: `{r['error'][:300]}`"
              for r in failures]
  step_records = [r for r in records if r["kind"] == "steps" and r["status"] == "compiled" and r["flops"] is not None]
  if step_records:
    lines += ["", "## Step costs (XLA's count per device, loop-free programs)", "",
              "MB of arguments: the program's inputs on one device (for a decode step or a verification, the "
              "parameters and the KV cache: what it reads at least); XLA's count adds every other operand and result "
              "of every operation, copies and slices between memory spaces included.", "",
              "| model | topology | program | GFLOP | MB accessed | MB of arguments | projected us | bound |",
              "|---|---|---|---:|---:|---:|---:|---|"]
    for r in step_records:
      target = results["targets"][r["topology"]]
      bound = "memory" if r["bytes_accessed"] / target["hbm_bytes_per_second"] >= r["flops"] / target[
          "bf16_flops_per_second"] else "compute"
      lines.append(f"| {r['model']} | {r['topology']} | {_program_label(r)} | {r['flops'] / 1e9:.2f} | "
                   f"{r['bytes_accessed'] / 1e6:.1f} | {r['memory']['arguments'] / 1e6:.1f} | "
                   f"{r['projected_seconds'] * 1e6:.0f} | {bound} |")
    # Where a verification of several tokens counts fewer bytes than a 1-token step, the compiler moved the cache
    # differently in the two programs: the projection there is not a property of speculative decoding.
    decode = {(r["model"], r["topology"]): r for r in step_records if r["program"] == "decode_step"}
    odd = [(r, decode[r["model"], r["topology"]]) for r in step_records if r["program"].startswith("verify")
           and (r["model"], r["topology"]) in decode
           and r["bytes_accessed"] < decode[r["model"], r["topology"]]["bytes_accessed"]]
    if odd:
      lines += ["", "XLA counts fewer bytes for a verification than for the decode step on " + "; ".join(
          f"{v['model']} {v['topology']} ({v['program']}: {v['bytes_accessed'] / 1e9:.2f} GB, decode step: "
          f"{d['bytes_accessed'] / 1e9:.2f} GB)" for v, d in odd) + ": the compiler slices and copies the cache "
          "between memory spaces differently in the two programs, and the projected speedups there inherit it."]
  lines += weights_table(records)
  if results["projections"]:
    config = results["config"]
    lines += ["", f"## Projected speedups (tau from {', '.join(projection.files_of(config['acceptance']))}"
              + (f"; trees' from {config['tree_acceptance']}" if config.get("tree_acceptance") else "") + ")", "",
              "Break-even tau: the round's cost in decode steps (draft + verify + update over a decode step), the "
              "tokens per target forward from which it pays.", "",
              "| model | topology | drafter | round | tau (gamma) | decode step us | draft us | verify us | "
              "update us | break-even tau | projected speedup |",
              "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for p in results["projections"]:
      tau = "–" if p["tau"] is None else f"{p['tau']:.2f}"
      speedup = "–" if p["projected_speedup"] is None else f"{p['projected_speedup']:.2f}x"
      round_seconds = p["draft_seconds"] + p["verify_seconds"] + p["update_seconds"]
      lines.append(f"| {p['model']} | {p['topology']} | {p['drafter']} | "
                   f"{'tree ' + str(p['tree_nodes']) if p.get('tree_nodes') else 'chain'} | {tau} ({p['gamma']}) | "
                   f"{p['decode_step_seconds'] * 1e6:.0f} | {p['draft_seconds'] * 1e6:.0f} | "
                   f"{p['verify_seconds'] * 1e6:.0f} | {p['update_seconds'] * 1e6:.0f} | "
                   f"{round_seconds / p['decode_step_seconds']:.2f} | {speedup} |")
    unmeasured = [p for p in results["projections"] if p.get("tree_nodes") and p["tau"] is None]
    if unmeasured:
      found = results.get("tree_acceptance_found")
      lines += ["", f"No tree's tau is measured ({config.get('tree_acceptance')} "
                + ("has none of these trees at depth gamma" if found else "does not exist")
                + "): the trees' rows give their costs and break-even tau, and no speedup (a run of configs/trees.py "
                "gives it)."]
  lines += ["", "## Chips (per device; published per-chip figures over devices per chip)", "",
            "| topology | HBM GiB | HBM GB/s | bf16 TFLOP/s | source |", "|---|---:|---:|---:|---|"]
  for topology, t in results["targets"].items():
    lines.append(f"| {topology} | {_gib(t['hbm_bytes'])} | {t['hbm_bytes_per_second'] / 1e9:.0f} | "
                 f"{t['bf16_flops_per_second'] / 1e12:.1f} | {t['source']} |")
  return "\n".join(lines) + "\n"


def weights_table(records: list[dict]) -> list[str]:
  """results.md's section comparing each program of a model compiled with int8 weights (a model entry's `weights`)
  against the same program of the model of its shape with arrays of the config's dtype (`weights_rows`); none where
  the run compiled no int8 weights."""
  rows = weights_rows(records)
  if not rows:
    return []
  return ["", "## int8 weights against the config's dtype", "",
          "The same program with the target's matrices as int8 codes and a scale per output channel (specjax/int8.py: "
          "(x @ codes) * scale, the codes converted inside the product). GiB per device: what XLA allocates (HBM "
          "per chip where a chip is one device); arguments: the parameters and the KV cache; accessed: XLA's count "
          "(step programs; a loop's body counts once). CPU kernel calls: specjax_* custom calls in the compiled "
          "program.", ""] + rows


def weights_rows(records: list[dict]) -> list[str]:
  """A Markdown table: per program compiled with int8 weights, the same program of its shape with the config's dtype
  beside it (HBM per device, arguments, XLA's bytes accessed) and its CPU kernel calls; [] where there is none."""
  def shape(r):
    return r.get("shape") or r["model"]
  plain = {(shape(r), r["topology"], r["kind"], r["program"], r["drafter"], r.get("tree_nodes")): r
           for r in records if r.get("weights", "bfloat16") != "int8" and r["status"] == "compiled"}
  pairs = [(plain[key], r) for r in records if r.get("weights") == "int8" and r["status"] == "compiled"
           and (key := (shape(r), r["topology"], r["kind"], r["program"], r["drafter"], r.get("tree_nodes"))) in plain]
  if not pairs:
    return []
  lines = ["| model | topology | program | GiB per device | int8 GiB per device | int8 / dtype | arguments GiB | "
           "int8 arguments GiB | GB accessed | int8 GB accessed | CPU kernel calls |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for dense, quantized in pairs:
    accessed = [f"{r['bytes_accessed'] / 1e9:.2f}" if r.get("bytes_accessed") is not None else "–"
                for r in (dense, quantized)]
    lines.append(f"| {quantized['model']} | {quantized['topology']} | {_program_label(quantized)} | "
                 f"{_gib(dense['bytes_per_device'])} | {_gib(quantized['bytes_per_device'])} | "
                 f"{quantized['bytes_per_device'] / dense['bytes_per_device']:.2f} | "
                 f"{_gib(dense['memory']['arguments'])} | {_gib(quantized['memory']['arguments'])} | "
                 f"{accessed[0]} | {accessed[1]} | {quantized.get('cpu_kernel_calls', '–')} |")
  return lines


def plot(results: dict, path: str) -> None:
  """HBM per chip of every whole program, program by model and topology (left), and where the run projects any, the
  projected speedups, drafter by model and topology (right)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  user = [r for r in results["records"] if r["kind"] != "steps"]
  projected = results["projections"]

  def where(r):  # a record's or a projection's column: its model and topology
    return f"{r['model']}\n{r['topology']}"

  def label(p):  # a drafter's chain, or its tree of N nodes
    return p["drafter"] + (f" tree {p['tree_nodes']}" if p.get("tree_nodes") else "")
  order = {d["name"]: i for i, d in enumerate(results["config"]["drafters"])}
  drafters = sorted(dict.fromkeys(label(p) for p in projected),
                    key=lambda name: (order.get(name.split(" ")[0], len(order)), name))
  columns = list(dict.fromkeys(where(p) for p in projected))
  programs = list(dict.fromkeys(_program_label(r) for r in user))
  targets = list(dict.fromkeys(where(r) for r in user))
  widths = [1.2 * len(targets) + 4] + ([1.2 * len(columns) + 4] if projected else [])
  fig, axes = plt.subplots(1, len(widths), figsize=(sum(widths), 1.5 + 0.35 * max(len(programs), len(drafters), 2)),
                           squeeze=False, gridspec_kw={"width_ratios": widths})
  memory = {}
  for r in user:
    if r["status"] == "compiled":
      memory[_program_label(r), where(r)] = (r["hbm_fraction"], f"{r['bytes_per_device'] / 2**30:.2f} GiB\n"
                                             f"{r['hbm_fraction']:.0%}", {"fontsize": 6})
    else:
      memory[_program_label(r), where(r)] = (None, "does not fit" if r["status"] == "does_not_fit" else "failed",
                                             {"fontsize": 6, "color": "red"})
  _grid_panel(fig, axes[0][0], programs, targets, memory, "Blues", 1.0, "bytes per chip / HBM per chip",
              "memory per chip of each program a user runs", row_fontsize=7)
  if projected:
    speedups = {}
    for p in projected:
      if p["projected_speedup"] is None:  # tau unmeasured (a tree without a run): the tau from which it pays
        tau = (p["draft_seconds"] + p["verify_seconds"] + p["update_seconds"]) / p["decode_step_seconds"]
        speedups[label(p), where(p)] = (None, f"pays at\ntau > {tau:.2f}", {"fontsize": 6, "color": "dimgray"})
      else:
        speedups[label(p), where(p)] = (p["projected_speedup"], f"{p['projected_speedup']:.2f}", {"fontsize": 7})
    _grid_panel(fig, axes[0][1], drafters, columns, speedups, "RdYlGn", 2.0, "projected speedup",
                f"projected speedup (roofline of XLA's counts; tau measured on CPU; grey: tau unmeasured), batch "
                f"{results['config']['batch_size']}, cache {results['config']['cache_len']}", row_fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _grid_panel(fig, ax, rows: list[str], columns: list[str], cells: dict[tuple[str, str], tuple], cmap: str,
                vmax: float, colorbar: str, title: str, row_fontsize: int) -> None:
  """A heat map of `rows` by `columns` on `ax`: `cells` maps (row, column) to (value, text, text style); a cell
  without a value (None) or not in `cells` is left blank."""
  grid = np.full((len(rows), len(columns)), np.nan)
  for (row, column), (value, text, style) in cells.items():
    i, j = rows.index(row), columns.index(column)
    if value is not None:
      grid[i, j] = value
    ax.text(j, i, text, ha="center", va="center", **style)
  image = ax.imshow(grid, cmap=cmap, vmin=0.0, vmax=vmax, aspect="auto")
  ax.set_xticks(range(len(columns)), columns, fontsize=7)
  ax.set_yticks(range(len(rows)), rows, fontsize=row_fontsize)
  fig.colorbar(image, ax=ax, label=colorbar)
  ax.set_title(title, fontsize=9)


def libtpu_version() -> str | None:
  try:
    return importlib.metadata.version("libtpu")
  except importlib.metadata.PackageNotFoundError:
    return None


def machine() -> dict[str, Any]:
  """The CPU model, its cores and memory (what compiling ran on), and the niceness the process ran at."""
  model = ""
  try:
    with open("/proc/cpuinfo") as f:
      model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
  except OSError:
    pass
  memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
  return {"cpu": model, "cores": os.cpu_count(), "memory_bytes": memory, "niceness": os.nice(0)}


def record_key(r: dict) -> tuple:
  return (r["model"], r["topology"], r["kind"], r["program"], r["drafter"], r["tree_nodes"])


def compile_log(log_path: str, config: ml_collections.ConfigDict) -> ResumableLog:
  """The log of compiled records at `log_path`, whose entries a stopped run left when its config was this one but for
  its grid (GRID_KEYS), to be kept instead of compiled again; a log of another config is moved aside and a new one
  started (cli.ResumableLog)."""
  header = {"config": json.loads(json.dumps(config.to_dict()))}
  return ResumableLog(log_path, header, same=lambda old: not config_differences(
      old.get("config", {}), header["config"], besides=GRID_KEYS))


def run(config: ml_collections.ConfigDict, workdir: str, name: str = "compile_tpu", command: str = "") -> dict:
  """Compiles the config's programs and writes results.json, results.md, compile_tpu.png and RUN.md (the command,
  commit, machine and times) into `workdir`."""
  code_commit()  # the checkout's commit as of the start
  os.makedirs(workdir, exist_ok=True)
  load_before, start, cpu_start = os.getloadavg(), time.perf_counter(), time.process_time()
  log_path = os.path.join(workdir, "records.jsonl")  # the records so far, while compiling; results.json after
  log = compile_log(log_path, config)
  earlier = {record_key(r): r for r in log.entries}
  records = compile_all(config, log=log, done=earlier)
  wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
  targets = {}
  for topology, data, model_axis in config.topologies:
    if any(r["topology"] == topology for r in records):
      t = target(topology, data, model_axis)
      targets[topology] = {"hbm_bytes": t.hbm_bytes, "hbm_bytes_per_second": t.hbm_bytes_per_second,
                           "bf16_flops_per_second": t.bf16_flops_per_second, "source": chip_of(topology).source}
  results = {"name": name, "command": command, "config": config.to_dict(), "environment": environment(),
             "libtpu": libtpu_version(), "machine": machine(), "started": time.strftime(
                 "%Y-%m-%d %H:%M", time.gmtime(time.time() - wall)), "wall_seconds": wall, "cpu_seconds": cpu,
             # 1-minute load averages: the machine may be shared, and compiling is CPU work
             "load_average": {"start": load_before[0], "end": os.getloadavg()[0]},
             "resumed_records": len(earlier),  # compiled before a restart: their time is not in wall/cpu_seconds
             "compile_seconds": sum(r["seconds"] for r in records), "targets": targets, "records": records,
             "tree_acceptance_found": projection.tree_acceptance(config.tree_acceptance) is not None,
             "projections": projections(records, config, projection.measured_acceptance(config.acceptance),
                                        projection.tree_acceptance(config.tree_acceptance))}
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  write_reports(results, workdir)
  if os.path.exists(log_path):
    os.remove(log_path)
  return results


# The keys of a config that may change between runs of the same programs. The grid: which programs a run builds, not
# how; a stopped run resumes under a config that differs from its own in these alone (compile_log). Where each
# drafter's tau is read (the top-level keys and a drafter's `acceptance_of`): a projection reads it besides the
# compiled costs, and a config that differs from a run's in these alone projects that run's programs again without
# compiling them (reproject). A resume keeps the acceptance keys: a drafter's gamma, so its programs, come from them.
GRID_KEYS = ("runs",)
ACCEPTANCE_KEYS = ("acceptance", "tree_acceptance")
DRAFTER_ACCEPTANCE_KEYS = ("acceptance_of",)


def config_differences(a: dict, b: dict, besides: Sequence[str] = (), drafter_besides: Sequence[str] = ()) -> list[str]:
  """The keys in which two configs (dicts, as read back from JSON) differ, leaving out the top-level keys `besides`
  and the drafters' keys `drafter_besides`; a drafter that differs is named `drafters.<its name>`."""
  a, b = ({k: v for k, v in c.items() if k not in besides} for c in (a, b))
  differ = sorted(k for k in set(a) | set(b) if k != "drafters" and a.get(k) != b.get(k))
  da, db = ({d["name"]: {k: v for k, v in d.items() if k not in drafter_besides} for d in c.get("drafters", [])}
            for c in (a, b))
  return differ + [f"drafters.{n}" for n in sorted(set(da) | set(db)) if da.get(n) != db.get(n)]


def reproject(workdir: str, config: ml_collections.ConfigDict | None = None) -> dict:
  """A run's projections again from its compiled records, at the acceptance files its config names as they are now
  (a run of configs/trees.py measured after the compile, say), or at those `config` names (its `acceptance`,
  `tree_acceptance` and drafters' `acceptance_of`: a newly measured method, say; `config` must build the same
  programs); results.json and the reports rewritten."""
  path = os.path.join(workdir, "results.json")
  with open(path) as f:
    results = json.load(f)
  if config is not None:
    new = json.loads(json.dumps(config.to_dict()))
    old = json.loads(json.dumps(results["config"]))
    differ = config_differences(new, old, ACCEPTANCE_KEYS, DRAFTER_ACCEPTANCE_KEYS)
    if differ:
      raise ValueError(f"{workdir} was compiled with another config (it differs in {differ}, besides where "
                       "acceptance comes from): compile it again")
    results["config"] = new
  config = ml_collections.ConfigDict(results["config"])
  trees = projection.tree_acceptance(config.tree_acceptance)
  results.update(tree_acceptance_found=trees is not None, projected=time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                 projections=projections(results["records"], config,
                                         projection.measured_acceptance(config.acceptance), trees))
  write_atomic(path, json.dumps(results, indent=1))
  write_reports(results, workdir)
  return results


def write_reports(results: dict, workdir: str) -> None:
  """results.md, RUN.md and compile_tpu.png from a run's results (`--render`: again, from its results.json)."""
  with open(os.path.join(workdir, "results.md"), "w") as f:
    f.write(markdown(results))
  with open(os.path.join(workdir, "RUN.md"), "w") as f:
    f.write(run_md(results))
  plot(results, os.path.join(workdir, "compile_tpu.png"))


def run_md(results: dict) -> str:
  """RUN.md: how the results were made (command, code, machine, times), rendered from results.json."""
  env, m = results["environment"], results["machine"]
  counts = {s: sum(r["status"] == s for r in results["records"]) for s in ("compiled", "does_not_fit", "failed")}
  return "\n".join([
      f"# {results['name']}, {results['started']} UTC", "", "```bash", results["command"], "```", "",
      f"- code: commit {env['specjax_commit']}; jax {env['jax']}"
      + (f", libtpu {results['libtpu']}" if results.get("libtpu") else "") + f", Python {env['python']}, "
      f"{env['platform']}.",
      f"- machine: {m['cores']} cores ({m['cpu']}), {m['memory_bytes'] / 2**30:.0f} GiB; no TPU or GPU (the programs "
      f"are compiled for abstract devices); the process at niceness {m.get('niceness', 0)}.",
      f"- time: {results['wall_seconds'] / 60:.1f} min wall, {results['cpu_seconds'] / 60:.1f} min of CPU time in the "
      f"process; load average {results['load_average']['start']:.1f} at the start and "
      f"{results['load_average']['end']:.1f} at the end (the machine is shared; wall time grows with the load, CPU "
      "time much less).",
      f"- {len(results['records'])} programs: {counts['compiled']} compiled, {counts['does_not_fit']} do not fit in "
      f"HBM, {counts['failed']} failed"
      + (f" ({results['resumed_records']} of them compiled before a restart: their time is not in the wall and CPU "
         f"time above; the compile times of all {len(results['records'])} sum to "
         f"{results['compile_seconds'] / 60:.1f} min)." if results.get("resumed_records") else "."),
      coverage_line(results)]
      + ([f"- projections derived again on {results['projected']} UTC from the compiled costs, at the acceptance "
          f"files as they were then (`python -m experiments.compile_for --render=<this folder>`; with `--config=`, at "
          "those that config names)."]
         if results.get("projected") else []) + ["",
      "Files: `results.md` (the tables), `results.json` (every program's record, the projections, the chips' figures "
      "and their sources), `compile_tpu.png` (memory per device, projected speedups).", ""])


def coverage_line(results: dict) -> str:
  """RUN.md's line on whether every program a user runs that the run's grid asks for was built."""
  missing = missing_programs(ml_collections.ConfigDict(results["config"]), results["records"])
  if not missing:
    return "- coverage: every program a user runs that the grid asks for was built (`missing_programs`)."
  return (f"- coverage: {len(missing)} programs a user runs that the grid asks for were not built: "
          + ", ".join(missing) + ".")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _RENDER.value:  # with --config: at the acceptance that config names
    reproject(_RENDER.value, _CONFIG.value)
    return
  name = os.path.basename(config_flags.get_config_filename(flags.FLAGS["config"])).replace(".py", "").replace(":", "-")
  workdir = _WORKDIR.value or os.path.join("workdirs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
  # The command as given, with the settings from the environment that change what is compiled.
  settings = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(("SPECJAX_", "XLA_", "LIBTPU_"))]
  command = " ".join(settings + ["python -m experiments.compile_for"] + sys.argv[1:])
  results = run(_CONFIG.value, workdir, name=name, command=command)
  failed = [r for r in results["records"] if r["status"] == "failed"]
  print(f"\nresults in {workdir}")
  if failed:
    sys.exit(f"{len(failed)} programs failed to compile (results.md lists them)")


if __name__ == "__main__":
  flags.register_multi_flags_validator(["config", "render"], lambda v: v["config"] is not None or bool(v["render"]),
                                      "--config is required (unless --render)")
  app.run(main, flags_parser=parse_flags)
