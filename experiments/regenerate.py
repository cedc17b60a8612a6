"""Training data of the target's own answers: the target answers each prompt itself, and a feature cache of prompt
+ answer is kept while it decodes (`build_regenerated_cache`, used by `experiments/prepare_data.py`).

EAGLE trains its drafters on the target's own answers to the data's prompts rather than on the data's answers:
that is the text a drafter meets at inference. The cache has `specjax.data.features`' format and is written by
its `write_cache` (atomic, resumable); the features and the target's top-K come from the decode itself
(`specjax.generate.generate_recorded`), so there is no second forward. This sits outside the library because it
runs the decode loop (`specjax.generate`), which stands above the data package.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Sequence

import jax
import numpy as np
from absl import logging

from specjax.data import features
from specjax.generate import RecordSpec, generate_recorded
from specjax.loading import Model


def prompts_fingerprint(prompts: Sequence[Sequence[int]]) -> str:
  digest = hashlib.sha256()
  for prompt in prompts:
    digest.update(np.asarray(prompt, np.int32).tobytes())
    digest.update(b"|")
  return digest.hexdigest()


def build_regenerated_cache(model: Model, prompts: Sequence[Sequence[int]], out_dir: str, *, seq_len: int,
                            feature_layers: Sequence[int], top_k: int = 32, batch_size: int = 32,
                            dtype: str = "float16", temperature: float = 0.0, seed: int = 0,
                            stop_ids: Sequence[int] | None = None, source: dict[str, Any] | None = None
                            ) -> features.FeatureCache:
  """The target answers each prompt itself and a feature cache of prompt + answer is written to `out_dir`
  (`specjax.data.features`' format; one row per prompt, in prompt order).

  Each answer takes what fits in seq_len after its prompt, up to the end-of-turn token; its loss mask marks
  the positions from the prompt's last token to the answer's last but one. The features and the target's top-K
  are kept while decoding (`specjax.generate.generate_recorded`): the prompt's prefill and the decode steps
  compute them anyway, so there is no second forward. Prompts of similar lengths are answered `batch_size` at
  a time; a progress record follows every batch, so a killed build redoes at most one.

  Args:
    prompts: chat prompts as token ids (`specjax.data.sequences.make_prompts`), each shorter than seq_len.
    temperature: 0 answers greedily; above 0 samples from the target's softmax at that temperature, with the
      PRNG key of batch b `fold_in(PRNGKey(seed), b)`: the same prompts, batch size and seed give the same
      answers.
    stop_ids: tokens that end an answer (default: the tokenizer's EOS and end-of-turn tokens).
    Others: as `specjax.data.features.build_feature_cache`.
  """
  config = model.config
  feature_layers = features.check_options(config, feature_layers, top_k, dtype)
  if not prompts:
    raise ValueError("no prompts")
  for i, prompt in enumerate(prompts):
    if not 0 < len(prompt) < seq_len:
      raise ValueError(f"prompt {i} has {len(prompt)} tokens; expected 1..{seq_len - 1} (room for an answer)")
    if np.any((np.asarray(prompt) < 0) | (np.asarray(prompt) >= config.vocab_size)):
      raise ValueError(f"prompt {i} has token ids outside [0, {config.vocab_size})")
  if not temperature >= 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if stop_ids is None:
    stop_ids = model.tokenizer.stop_ids if model.tokenizer else ()
  stop_ids = sorted(int(i) for i in stop_ids)
  generation = {"temperature": float(temperature), "seed": int(seed) if temperature else None, "stop_ids": stop_ids}
  meta = features.cache_meta(model, seq_len, feature_layers, top_k, dtype, len(prompts), batch_size, 1, source,
                             stop_ids, prompts_fingerprint=prompts_fingerprint(prompts), generation=generation)
  record = RecordSpec(feature_layers=feature_layers, top_k=top_k, length=seq_len, dtype=dtype)

  def answered(number: int, rows: np.ndarray) -> dict[str, np.ndarray]:
    key = jax.random.fold_in(jax.random.PRNGKey(seed), number)
    out = generate_recorded(model, [prompts[i] for i in rows], record, temperature=temperature, key=key,
                            stop_ids=stop_ids)
    positions = np.arange(seq_len)[None, :]
    mask = (positions >= out.prompt_lengths[:, None] - 1) & (positions < out.lengths[:, None] - 1)
    logging.info("batch %d of %d: %d prompts of up to %d tokens, %d answer tokens in %d steps, %.1f s (%.1f "
                 "answer tokens/s)", number + 1, len(batches), len(rows), out.prompt_lengths.max(),
                 out.stats["new_tokens"], out.stats["steps"], out.stats["seconds"],
                 out.stats["new_tokens"] / out.stats["seconds"])
    return {"tokens": out.tokens, "lengths": out.lengths, "mask": mask, "features": out.features,
            "teacher_ids": out.top_ids, "teacher_probs": out.top_probs.astype(np.float16)}

  order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
  batches = [order[first:first + batch_size] for first in range(0, len(order), batch_size)]
  return features.write_cache(out_dir, meta, batches, answered, f"answers {os.path.basename(out_dir)}")
