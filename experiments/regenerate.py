"""Training data of the target's own answers: the target answers each prompt itself, and a feature cache of prompt
+ answer is kept while it decodes (`build_regenerated_cache`, used by `experiments/prepare_data.py`).

EAGLE trains its drafters on the target's own answers to the data's prompts rather than on the data's answers:
that is the text a drafter meets at inference. The cache has `specjax.data.features`' format and is written by
its `write_cache` (atomic, resumable); the features and the target's top-K come from the decode itself
(`specjax.generate.generate_recorded`), so there is no second forward. The answers alone (token ids, a few MB
where the cache takes GBs) are kept in an answers file beside it (`save_answers`): a rebuild of the cache (lost,
or with other feature layers) runs one forward over the answers it holds instead of decoding them again, and a
regeneration cut short in one place resumes in another from the file alone. This sits outside the library because
it runs the decode loop (`specjax.generate`), which stands above the data package.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from typing import Any, Sequence

import jax
import numpy as np
from absl import logging

from specjax.data import features, sequences
from specjax.generate import RecordSpec, generate_recorded
from specjax.loading import CheckpointError, Model


def prompts_fingerprint(prompts: Sequence[Sequence[int]]) -> str:
  digest = hashlib.sha256()
  for prompt in prompts:
    digest.update(np.asarray(prompt, np.int32).tobytes())
    digest.update(b"|")
  return digest.hexdigest()


def prompt_key(prompt: Sequence[int]) -> int:
  """A prompt's key in an answers file: the first 8 bytes of the SHA-256 of its token ids."""
  return int.from_bytes(hashlib.sha256(np.asarray(prompt, np.int32).tobytes()).digest()[:8], "little")


def answers_identity(model: Model, prompts_digest: str, seq_len: int, generation: dict[str, Any],
                     batch_size: int) -> dict[str, Any]:
  """What must agree for an answers file to serve these prompts: the target, seq_len and the generation; a sampled
  answer also depends on its batch (its PRNG key), so sampled answers serve the same prompts in the same batches
  only. Greedy answers serve any prompts they cover. `prompts_digest`: the prompts' `prompts_fingerprint`."""
  sampled = bool(generation["temperature"])
  return {"model": model.name, "params_fingerprint": features.params_fingerprint(model), "seq_len": seq_len,
          "generation": generation, "prompts_fingerprint": prompts_digest if sampled else None,
          "batch_size": batch_size if sampled else None}


def save_answers(path: str, answers: dict[int, np.ndarray], identity: dict[str, Any]) -> None:
  """Writes {prompt key: answer token ids} (`prompt_key`) and their identity to one compressed .npz, atomically."""
  keys = np.asarray(sorted(answers), np.uint64)
  tokens = np.concatenate([np.zeros(0, np.int32), *(answers[int(k)] for k in keys)]).astype(np.int32)
  lengths = np.asarray([len(answers[int(k)]) for k in keys], np.int32)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.partial.npz"
  np.savez_compressed(tmp, keys=keys, lengths=lengths, tokens=tokens,
                      identity=np.asarray(json.dumps(identity, sort_keys=True)))
  os.replace(tmp, path)


def load_answers(path: str, identity: dict[str, Any]) -> dict[int, np.ndarray]:
  """{prompt key: answer token ids} from `save_answers`; an error if the file holds another target's answers (or
  other generation settings), or cannot be read."""
  try:
    with np.load(path) as data:
      keys, lengths, tokens = data["keys"], data["lengths"], data["tokens"]
      found = json.loads(str(data["identity"]))
  except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
    raise CheckpointError(f"cannot read the answers file {path} ({e}); delete it to decode them again") from e
  if found != identity:
    differ = ", ".join(f"{k} {found.get(k)!r} (this build: {identity[k]!r})" for k in identity
                       if found.get(k) != identity[k])
    raise CheckpointError(f"{path} holds other answers: {differ}; delete it or choose another answers path")
  if len(lengths) != len(keys) or int(lengths.sum()) != len(tokens):
    raise CheckpointError(f"the answers file {path} is inconsistent; delete it to decode them again")
  starts = np.cumsum(lengths) - lengths
  return {int(k): tokens[s:s + n] for k, s, n in zip(keys, starts, lengths)}


def build_regenerated_cache(model: Model, prompts: Sequence[Sequence[int]], out_dir: str, *, seq_len: int,
                            feature_layers: Sequence[int], top_k: int = 32, batch_size: int = 32,
                            dtype: str = "float16", temperature: float = 0.0, seed: int = 0,
                            stop_ids: Sequence[int] | None = None, source: dict[str, Any] | None = None,
                            answers_path: str | None = None) -> features.FeatureCache:
  """The target answers each prompt itself and a feature cache of prompt + answer is written to `out_dir`
  (`specjax.data.features`' format; one row per prompt, in prompt order).

  Each answer takes what fits in seq_len after its prompt, up to a stop token (the end of the turn, or of the text
  for a base model's plain-text prompt); its loss mask marks
  the positions from the prompt's last token to the answer's last but one. The features and the target's top-K
  are kept while decoding (`specjax.generate.generate_recorded`): the prompt's prefill and the decode steps
  compute them anyway, so there is no second forward. Prompts of similar lengths are answered `batch_size` at
  a time; a progress record follows every batch, so a killed build redoes at most one.

  Args:
    prompts: prompts as token ids (`specjax.data.sequences.make_prompts`: chat, or plain text for a base model),
      each shorter than seq_len.
    temperature: 0 answers greedily; above 0 samples from the target's softmax at that temperature, with the
      PRNG key of batch b `fold_in(PRNGKey(seed), b)`: the same prompts, batch size and seed give the same
      answers.
    stop_ids: tokens that end an answer (default: the tokenizer's EOS and end-of-turn tokens, as `specjax.generate`
      stops by default).
    answers_path: an answers file (`save_answers`), rewritten after every decoded batch: a batch whose answers
      it already holds is not decoded again but built by one forward over them (`features.forward_rows`). It keeps
      the answers of other prompts it held.
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
  digest = prompts_fingerprint(prompts)
  meta = features.cache_meta(model, seq_len, feature_layers, top_k, dtype, len(prompts), batch_size, 1, source,
                             stop_ids, prompts_fingerprint=digest, generation=generation)
  record = RecordSpec(feature_layers=feature_layers, top_k=top_k, length=seq_len, dtype=dtype)
  identity = answers_identity(model, digest, seq_len, generation, batch_size)
  answers = load_answers(answers_path, identity) if answers_path and os.path.exists(answers_path) else {}
  keys = [prompt_key(prompt) for prompt in prompts]

  def answered(number: int, rows: np.ndarray) -> dict[str, np.ndarray]:
    if all(keys[i] in answers for i in rows):
      kept = [sequences.sequence_from_ids(prompts[i], answers[keys[i]], seq_len) for i in rows]
      logging.info("batch %d of %d: %d answers from %s, one forward", number + 1, len(batches), len(rows),
                   answers_path)
      return features.forward_rows(model, kept, seq_len=seq_len, batch_size=batch_size,
                                   feature_layers=feature_layers, top_k=top_k, dtype=dtype)
    key = jax.random.fold_in(jax.random.PRNGKey(seed), number)
    out = generate_recorded(model, [prompts[i] for i in rows], record, temperature=temperature, key=key,
                            stop_ids=stop_ids)
    positions = np.arange(seq_len)[None, :]
    mask = (positions >= out.prompt_lengths[:, None] - 1) & (positions < out.lengths[:, None] - 1)
    logging.info("batch %d of %d: %d prompts of up to %d tokens, %d answer tokens in %d steps, %.1f s (%.1f "
                 "answer tokens/s)", number + 1, len(batches), len(rows), out.prompt_lengths.max(),
                 out.stats["new_tokens"], out.stats["steps"], out.stats["seconds"],
                 out.stats["new_tokens"] / out.stats["seconds"])
    if answers_path:
      for j, i in enumerate(rows):
        answers[keys[i]] = out.tokens[j, out.prompt_lengths[j]:out.lengths[j]]
      save_answers(answers_path, answers, identity)
    return {"tokens": out.tokens, "lengths": out.lengths, "mask": mask, "features": out.features,
            "teacher_ids": out.top_ids, "teacher_probs": out.top_probs.astype(np.float16)}

  order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
  batches = [order[first:first + batch_size] for first in range(0, len(order), batch_size)]
  return features.write_cache(out_dir, meta, batches, answered, f"answers {os.path.basename(out_dir)}")
