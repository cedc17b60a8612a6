"""The frozen target's features and next-token distributions over training sequences, computed once, on disk.

Drafters trained by self-distillation (MTP heads, EAGLE-style modules, early-exit adapters) read, at every
position t of a training sequence: hidden states of the target (the residual stream after a few layers,
EAGLE-3's low/mid/high features, and the last layer's output, which the LM head reads) and the target's own
distribution over token t + 1, its label. The target is frozen, so these are computed once per data set.

A cache is a directory of `.npy` files (open them with `np.load(..., mmap_mode="r")`) and `meta.json`:

  tokens        int32   [N, T]        the sequences, right-padded with 0 (`lengths` says where they end)
  lengths       int32   [N]
  mask          bool    [N, T]        loss mask: position t's next token is an answer token (False on padding)
  features      float16 [N, T, F, D]  residual stream after each of `meta["feature_layers"]` (0-based; layer
                                      L - 1's output is `ForwardOutput.hidden`, before the final norm)
  teacher_ids   int32   [N, T, K]     the target's top-K next-token ids at each position, most likely first
  teacher_probs float16 [N, T, K]     their probabilities (softmax of the float32 logits, temperature 1)
  token_counts  int64   [V]           how often each token is the target's greedy next token at masked positions

Padding positions hold zeros. `write_cache` writes one from a function that computes the arrays of a batch of
rows: `build_feature_cache` runs the target over given sequences (the data's own answers); a builder may instead
let the target answer given prompts and keep the same arrays while it decodes (`experiments/regenerate.py`).
Writing is atomic and resumable: arrays are written into `<out_dir>.tmp-<pid>`, progress is recorded after each
chunk of batches, and the directory is renamed to `out_dir` when complete; a rerun after a kill continues from
the last finished chunk.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from tqdm.auto import tqdm

from specjax import ops
from specjax.config import ModelConfig
from specjax.loading import CheckpointError, Model
from specjax.model import forward, init_cache, lm_head
from specjax.sampling import top_k_probabilities

FORMAT_VERSION = 1
ARRAYS = ("tokens", "lengths", "mask", "features", "teacher_ids", "teacher_probs", "token_counts")
_PROGRESS = "progress.json"
_META = "meta.json"


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
  """(2, L // 2, L - 3, L - 1): EAGLE-3's low, middle and high features plus the last hidden state."""
  return (2, num_layers // 2, num_layers - 3, num_layers - 1)


def _array_specs(meta: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  n, t, k = meta["num_sequences"], meta["seq_len"], meta["top_k"]
  return {
      "tokens": ((n, t), np.dtype(np.int32)),
      "lengths": ((n,), np.dtype(np.int32)),
      "mask": ((n, t), np.dtype(bool)),
      "features": ((n, t, len(meta["feature_layers"]), meta["hidden_size"]), np.dtype(meta["dtype"])),
      "teacher_ids": ((n, t, k), np.dtype(np.int32)),
      "teacher_probs": ((n, t, k), np.dtype(np.float16)),
      "token_counts": ((meta["vocab_size"],), np.dtype(np.int64)),
  }


def params_fingerprint(model: Model) -> str:
  """A cheap SHA-256 over the norms and a sample of embedding rows: tells checkpoints apart."""
  params = model.params
  digest = hashlib.sha256()
  rows = jnp.arange(0, model.config.vocab_size, max(1, model.config.vocab_size // 64))
  leaves = [params["final_norm"], *(layer["attn_norm"] for layer in params["layers"]), ops.take(params["embed"], rows)]
  for leaf in leaves:
    digest.update(np.asarray(leaf, np.float32).tobytes())
  return digest.hexdigest()


def sequences_fingerprint(sequences: Sequence) -> str:
  digest = hashlib.sha256()
  for tokens, loss_mask in sequences:
    digest.update(np.asarray(tokens, np.int32).tobytes())
    digest.update(np.asarray(loss_mask, bool).tobytes())
    digest.update(b"|")
  return digest.hexdigest()


# What must agree for a cache (or a partial build) to be this build's; the rest of meta is description.
_IDENTITY = ("format_version", "model", "params_fingerprint", "vocab_size", "hidden_size", "num_layers", "seq_len",
             "feature_layers", "top_k", "dtype", "num_sequences", "sequences_fingerprint", "prompts_fingerprint",
             "generation", "batch_size", "chunk_batches")


def _identity(meta: dict[str, Any]) -> dict[str, Any]:
  return {k: meta.get(k) for k in _IDENTITY}


def _mismatch(found: dict[str, Any], wanted: dict[str, Any]) -> str:
  return ", ".join(f"{k} {found.get(k)!r} (this build: {wanted[k]!r})" for k in _IDENTITY
                   if found.get(k) != wanted[k])


@functools.partial(jax.jit, static_argnames=("config", "feature_layers", "top_k", "dtype"))
def _target_outputs(params, tokens: jax.Array, *, config: ModelConfig, feature_layers: tuple[int, ...],
                    top_k: int, dtype: str):
  """One forward over tokens [B, T] from position 0: features [B, T, F, D], top-K ids and probabilities."""
  batch, seq_len = tokens.shape
  out = forward(params, tokens, init_cache(config, batch, seq_len), jnp.zeros(batch, jnp.int32), config,
                compute_logits=False, return_layer_hidden=True)
  features = jnp.stack([out.layer_hidden[i] for i in feature_layers], axis=2).astype(dtype)
  top_probs, top_ids = top_k_probabilities(lm_head(params, out.hidden, config), top_k)
  return features, top_ids, top_probs.astype(jnp.float16)


def _write_json(path: str, payload: dict[str, Any]) -> None:
  """Writes JSON atomically: a reader sees the old file or the new one, never half of one."""
  tmp = f"{path}.partial"
  with open(tmp, "w") as f:
    json.dump(payload, f, indent=1)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _claim_partial_build(out_dir: str, identity: dict[str, Any]) -> str:
  """The tmp dir to build in: a dead process's partial build of the same cache (renamed to ours), or a new one.

  A partial build of a different cache, or one another live process is writing, is an error.
  """
  mine = f"{out_dir}.tmp-{os.getpid()}"
  partial = sorted(glob.glob(glob.escape(out_dir) + ".tmp-*"))
  for path in partial:
    pid = path.rsplit(".tmp-", 1)[1]
    if path != mine and pid.isdigit() and _pid_alive(int(pid)):
      raise CheckpointError(f"{path} is being written by process {pid}; wait for it or stop it first")
  if len(partial) > 1:
    raise CheckpointError(f"several partial builds of {out_dir}: {partial}; delete all but one")
  if not partial:
    return mine
  path = partial[0]
  progress_path = os.path.join(path, _PROGRESS)
  if not os.path.isfile(progress_path):
    raise CheckpointError(f"{path} is a partial build without {_PROGRESS}; delete it to start over")
  with open(progress_path) as f:
    found = json.load(f)
  if _identity(found["meta"]) != identity:
    raise CheckpointError(f"{path} is a partial build of a different cache: {_mismatch(found['meta'], identity)}; "
                          "delete it or choose another out_dir")
  if path != mine:
    os.rename(path, mine)
    logging.info("resuming the partial build %s (%d of %d sequences done)", path, found["done"],
                 identity["num_sequences"])
  return mine


def check_options(config: ModelConfig, feature_layers: Sequence[int], top_k: int, dtype: str) -> tuple[int, ...]:
  """The feature layers as a tuple of ints, after checking them, top_k and the stored dtype against the target."""
  feature_layers = tuple(int(i) for i in feature_layers)
  bad = [i for i in feature_layers if not 0 <= i < config.num_layers]
  if bad or len(set(feature_layers)) != len(feature_layers) or not feature_layers:
    raise ValueError(f"feature_layers must be distinct layers in [0, {config.num_layers}), got {feature_layers}")
  if dtype not in ("float16", "float32"):
    raise ValueError(f"dtype must be float16 or float32, got {dtype!r}")
  if not 1 <= top_k <= config.vocab_size:
    raise ValueError(f"top_k must be in [1, {config.vocab_size}], got {top_k}")
  return feature_layers


def cache_meta(model: Model, seq_len: int, feature_layers: tuple[int, ...], top_k: int, dtype: str,
               num_sequences: int, batch_size: int, chunk_batches: int, source: dict[str, Any] | None,
               stop_ids: Sequence[int] | None = None, **identity: Any) -> dict[str, Any]:
  """meta.json of a cache before it is written; `identity` names what else must agree for a partial build to be
  resumed (`sequences_fingerprint`, `prompts_fingerprint`, `generation`: see `_IDENTITY`)."""
  config = model.config
  if stop_ids is None:
    stop_ids = model.tokenizer.stop_ids if model.tokenizer else ()
  return {
      "format_version": FORMAT_VERSION, "model": model.name, "params_fingerprint": params_fingerprint(model),
      "vocab_size": config.vocab_size, "hidden_size": config.hidden_size, "num_layers": config.num_layers,
      "seq_len": seq_len, "feature_layers": list(feature_layers), "top_k": top_k, "dtype": dtype,
      "num_sequences": num_sequences, **identity, "batch_size": batch_size, "chunk_batches": chunk_batches,
      "stop_ids": sorted(int(i) for i in stop_ids), "source": source or {},
  }


def write_cache(out_dir: str, meta: dict[str, Any], batches: Sequence[Sequence[int]], compute_batch,
                description: str) -> FeatureCache:
  """Writes the cache `meta` describes into out_dir, `compute_batch(number, rows)` giving the arrays of the rows
  of batch `number` of `batches` (tokens, lengths, mask, features, teacher_ids, teacher_probs; zeros past each
  row's length). Returns the cache already there if it is this one (an error if it is another); resumes a dead
  process's partial build of the same cache after its last progress record (one per `meta["chunk_batches"]`
  batches)."""
  identity = _identity(meta)
  if os.path.exists(out_dir):
    meta_path = os.path.join(out_dir, _META)
    if not os.path.isfile(meta_path):
      raise CheckpointError(f"{out_dir} exists but has no {_META}: not a finished feature cache; delete it")
    with open(meta_path) as f:
      found = json.load(f)
    if _identity(found) != identity:
      raise CheckpointError(f"{out_dir} holds a different feature cache: {_mismatch(found, identity)}; "
                            "delete it or choose another out_dir")
    logging.info("%s already holds this feature cache", out_dir)
    return FeatureCache.open(out_dir)

  tmp_dir = _claim_partial_build(out_dir, identity)
  specs = _array_specs(meta)
  resuming = os.path.isdir(tmp_dir)
  done = 0  # rows written: those of the first batches
  if resuming:
    with open(os.path.join(tmp_dir, _PROGRESS)) as f:
      done = json.load(f)["done"]
    try:
      arrays = {name: np.lib.format.open_memmap(os.path.join(tmp_dir, f"{name}.npy"), mode="r+")
                for name in ARRAYS if name != "token_counts"}
    except (OSError, ValueError) as e:
      raise CheckpointError(f"cannot resume the partial build {tmp_dir} ({e}); delete it to start over") from e
    wrong = [name for name, a in arrays.items() if (a.shape, a.dtype) != specs[name]]
    if wrong:
      raise CheckpointError(f"the partial build {tmp_dir} has arrays of other shapes ({wrong}); delete it")
  else:
    os.makedirs(tmp_dir)
    arrays = {name: np.lib.format.open_memmap(os.path.join(tmp_dir, f"{name}.npy"), mode="w+", dtype=d, shape=s)
              for name, (s, d) in specs.items() if name != "token_counts"}
    _write_json(os.path.join(tmp_dir, _PROGRESS), {"done": 0, "meta": meta})

  start = time.perf_counter()
  resumed_from = done if resuming else None  # rows a killed build had finished
  n = meta["num_sequences"]
  first_batch = int(np.searchsorted(np.cumsum([len(rows) for rows in batches]), done, side="right"))
  with tqdm(total=n, initial=done, desc=description, unit="seq") as progress:
    for number in range(first_batch, len(batches)):
      rows = np.asarray(batches[number], np.int64)
      computed = compute_batch(number, rows)
      if not np.isfinite(computed["features"]).all():
        raise ValueError(f"the target's hidden states overflow {meta['dtype']} (max |h| beyond its range); "
                         "build with dtype='float32'")
      for name, array in arrays.items():
        array[rows] = computed[name]
      progress.update(len(rows))
      done += len(rows)
      if (number + 1) % meta["chunk_batches"] == 0 or number == len(batches) - 1:
        for array in arrays.values():
          array.flush()
        _write_json(os.path.join(tmp_dir, _PROGRESS), {"done": done, "meta": meta})

  # The greedy (top-1) next token at every masked position.
  counts = np.zeros(meta["vocab_size"], np.int64)
  for first in range(0, n, 1024):
    greedy = arrays["teacher_ids"][first:first + 1024, :, 0]
    counts += np.bincount(greedy[arrays["mask"][first:first + 1024]], minlength=meta["vocab_size"])
  np.save(os.path.join(tmp_dir, "token_counts.npy"), counts)
  del arrays  # closes the memmaps
  meta = {**meta, "masked_positions": int(counts.sum()), "build_seconds": round(time.perf_counter() - start, 1),
          "resumed_from": resumed_from}
  _write_json(os.path.join(tmp_dir, _META), meta)
  os.remove(os.path.join(tmp_dir, _PROGRESS))
  os.rename(tmp_dir, out_dir)
  logging.info("wrote %s: %d sequences, %d masked positions, %.0f s", out_dir, n, meta["masked_positions"],
               meta["build_seconds"])
  return FeatureCache.open(out_dir)


def build_feature_cache(model: Model, sequences: Sequence, out_dir: str, *, seq_len: int,
                        feature_layers: Sequence[int], top_k: int = 32, batch_size: int = 8, dtype: str = "float16",
                        chunk_batches: int = 16, source: dict[str, Any] | None = None) -> FeatureCache:
  """Runs the frozen target over `sequences` and writes a feature cache to `out_dir` (see the module doc).

  Args:
    model: the target.
    sequences: (tokens, loss_mask) pairs of at most seq_len tokens (`specjax.data.sequences.Sequence`).
    out_dir: the cache directory. If it already holds this very cache, that cache is returned; if it holds
      another one (different model, sequences, seq_len, layers, ...), that is an error.
    feature_layers: 0-based layers whose output residual stream is stored, in this order
      (`default_feature_layers`).
    top_k: how many of the target's most likely next tokens are stored per position.
    batch_size: sequences per forward (one compiled shape [batch_size, seq_len]).
    dtype: of the stored features, "float16" or "float32".
    chunk_batches: batches between progress records; a killed build resumes from the last record.
    source: a JSON-able description of where the sequences come from, stored in meta.json.
  Returns:
    The finished cache, opened.
  """
  config = model.config
  feature_layers = check_options(config, feature_layers, top_k, dtype)
  if not sequences:
    raise ValueError("no sequences")
  for i, (tokens, loss_mask) in enumerate(sequences):
    if not 0 < len(tokens) <= seq_len or len(loss_mask) != len(tokens):
      raise ValueError(f"sequence {i} has {len(tokens)} tokens and {len(loss_mask)} mask entries; "
                       f"expected 1..{seq_len} of each")
    if np.any((np.asarray(tokens) < 0) | (np.asarray(tokens) >= config.vocab_size)):
      raise ValueError(f"sequence {i} has token ids outside [0, {config.vocab_size})")
  meta = cache_meta(model, seq_len, feature_layers, top_k, dtype, len(sequences), batch_size, chunk_batches, source,
               sequences_fingerprint=sequences_fingerprint(sequences))

  def second_forward(number: int, rows: np.ndarray) -> dict[str, np.ndarray]:
    return forward_rows(model, [sequences[i] for i in rows], seq_len=seq_len, batch_size=batch_size,
                        feature_layers=feature_layers, top_k=top_k, dtype=dtype)

  batches = [range(first, min(first + batch_size, len(sequences))) for first in range(0, len(sequences), batch_size)]
  return write_cache(out_dir, meta, batches, second_forward, f"features {os.path.basename(out_dir)}")


def forward_rows(model: Model, sequences: Sequence, *, seq_len: int, batch_size: int, feature_layers: tuple[int, ...],
                 top_k: int, dtype: str) -> dict[str, np.ndarray]:
  """A cache's arrays (but token_counts) for up to batch_size sequences, from one forward of the target over them
  (padded to the compiled shape [batch_size, seq_len]); zeros past each row's length."""
  tokens = np.zeros((batch_size, seq_len), np.int32)
  mask = np.zeros((len(sequences), seq_len), bool)
  lengths = np.asarray([len(sequence[0]) for sequence in sequences], np.int32)
  for j, sequence in enumerate(sequences):
    tokens[j, :lengths[j]], mask[j, :lengths[j]] = sequence
  features, top_ids, top_probs = jax.device_get(_target_outputs(
      model.params, jnp.asarray(tokens), config=model.config, feature_layers=feature_layers, top_k=top_k,
      dtype=dtype))
  n = len(sequences)
  valid = np.arange(seq_len)[None, :] < lengths[:, None]  # [rows, T]
  return {"tokens": tokens[:n], "lengths": lengths, "mask": mask,
          "features": np.where(valid[:, :, None, None], features[:n], 0),
          "teacher_ids": np.where(valid[:, :, None], top_ids[:n], 0),
          "teacher_probs": np.where(valid[:, :, None], top_probs[:n], 0)}


@dataclasses.dataclass(frozen=True)
class FeatureCache:
  """A finished feature cache, its arrays memory-mapped read-only (see the module doc for each array)."""
  path: str
  meta: dict[str, Any]
  tokens: np.ndarray
  lengths: np.ndarray
  mask: np.ndarray
  features: np.ndarray
  teacher_ids: np.ndarray
  teacher_probs: np.ndarray
  token_counts: np.ndarray

  @classmethod
  def open(cls, path: str) -> FeatureCache:
    """Opens the cache at `path`; a missing, partial or truncated cache is a CheckpointError naming the file."""
    if not os.path.isdir(path):
      partial = glob.glob(glob.escape(path) + ".tmp-*")
      hint = f" (a partial build is at {partial[0]}: rerun the build to finish it)" if partial else ""
      raise CheckpointError(f"no feature cache at {path}{hint}")
    meta_path = os.path.join(path, _META)
    if not os.path.isfile(meta_path):
      raise CheckpointError(f"{path} has no {_META}: not a finished feature cache")
    with open(meta_path) as f:
      meta = json.load(f)
    if meta.get("format_version") != FORMAT_VERSION:
      raise CheckpointError(f"{meta_path}: format_version {meta.get('format_version')}, expected {FORMAT_VERSION}")
    arrays = {}
    for name, (shape, dtype) in _array_specs(meta).items():
      file = os.path.join(path, f"{name}.npy")
      if not os.path.isfile(file):
        raise CheckpointError(f"feature cache file {file} is missing")
      with open(file, "rb") as f:
        try:
          version = np.lib.format.read_magic(f)
          read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                         (2, 0): np.lib.format.read_array_header_2_0}[version]
          found_shape, _, found_dtype = read_header(f)
        except (ValueError, KeyError) as e:
          raise CheckpointError(f"{file} is not a .npy file this reader knows: {e!r}") from e
        data_offset = f.tell()
      if tuple(found_shape) != shape or found_dtype != dtype:
        raise CheckpointError(f"{file} holds {found_dtype}{list(found_shape)}; {_META} says {dtype}{list(shape)}")
      expected = data_offset + int(np.prod(shape)) * dtype.itemsize
      size = os.path.getsize(file)
      if size != expected:
        raise CheckpointError(f"{file} is {size:,} bytes, expected {expected:,}: truncated or corrupt")
      arrays[name] = np.load(file, mmap_mode="r")
    return cls(path=path, meta=meta, **arrays)

  def __len__(self) -> int:
    return self.tokens.shape[0]

  def batch(self, indices: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
    """Sequences `indices` as arrays in memory: tokens, mask, lengths, features and teacher_probs as float32,
    teacher_ids."""
    indices = np.asarray(indices, np.int64)
    return {
        "tokens": np.asarray(self.tokens[indices]),
        "mask": np.asarray(self.mask[indices]),
        "lengths": np.asarray(self.lengths[indices]),
        "features": self.features[indices].astype(np.float32),
        "teacher_ids": np.asarray(self.teacher_ids[indices]),
        "teacher_probs": self.teacher_probs[indices].astype(np.float32),
    }


def top_token_map(token_counts: np.ndarray, size: int, stop_ids: Sequence[int] = ()) -> np.ndarray:
  """The draft vocabulary of a truncated LM head (FR-Spec; EAGLE-3's d2t map): int32 [size], ascending ids.

  The `size` most frequent ids in `token_counts` (ties broken by the smaller id), with every id in
  `stop_ids` (pass the tokenizer's `stop_ids`, as the cache's meta records them) forced in, in place of
  the least frequent others: a drafter that cannot propose the end of a turn never ends one.
  """
  token_counts = np.asarray(token_counts)
  stop_ids = sorted({int(i) for i in stop_ids})
  if not len(stop_ids) <= size <= len(token_counts):
    raise ValueError(f"size must be in [{len(stop_ids)}, {len(token_counts)}], got {size}")
  ids = np.arange(len(token_counts))
  by_count = np.lexsort((ids, -token_counts))  # most frequent first, then smaller ids
  others = by_count[~np.isin(by_count, stop_ids)][:size - len(stop_ids)]
  return np.sort(np.concatenate([others, np.asarray(stop_ids, np.int64)])).astype(np.int32)


def token_map_coverage(token_counts: np.ndarray, token_map: np.ndarray) -> float:
  """The fraction of counted greedy tokens that `token_map` contains: an upper bound on a truncated head's
  top-1 agreement with the target."""
  total = int(np.sum(token_counts))
  return float(np.asarray(token_counts)[np.asarray(token_map)].sum() / total) if total else 0.0
