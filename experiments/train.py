r"""Trains a drafter on cached target features, exports it with a model card, measures it on Spec-Bench.

  python -m experiments.train --config=configs/train_mtp.py:parallel [--config.steps=N]
  python -m experiments.train --config=configs/train_exit.py:8      # an exit adapter after 8 layers
  python -m experiments.train --config=configs/train_draft.py       # a distilled 4-layer draft model

Reads <data_dir>/train and <data_dir>/held_out (built by `python -m experiments.prepare_data`), trains the
drafter's own parameters with the target frozen (`specjax.train_drafter`), and writes to the workdir:
metrics.jsonl (training and held-out metrics), checkpoints/ (orbax; a rerun of the same command resumes),
<drafter>.safetensors (the exported drafter) and <drafter>.md, its model card (how to reproduce it and what
it measured); a draft model also as an HF Llama directory (`config.export_hf`); parallel heads also their rank
accuracy on the held-out split, <drafter>.ranks.json (`experiments.rank_accuracy`: what their static trees use).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Sequence

import ml_collections
import numpy as np
from absl import app, flags, logging

import specjax
from specjax import drafters, export, sharding, train_drafter
from specjax.data import features, sequences
from specjax.drafters import draft_head, draft_model
from specjax.loading import CheckpointError
from experiments import cli, curves, draft_vocab, prepare_data, rank_accuracy, spec_bench
from experiments.cli import code_commit, environment, parse_flags

_CONFIG = cli.define_config_flag("Training config: configs/train_mtp.py:<variant>.")


def open_caches(data_dir: str, held_out_dir: str = "") -> dict[str, features.FeatureCache]:
  """<data_dir>/train and the held-out cache (default <data_dir>/held_out)."""
  caches = {}
  for split in ("train", "held_out"):
    path = held_out_dir if split == "held_out" and held_out_dir else os.path.join(data_dir, split)
    try:
      caches[split] = features.FeatureCache.open(path)
    except CheckpointError as e:
      raise CheckpointError(f"{e}. Build the training data first: python -m experiments.prepare_data "
                            f"--config=configs/train_data.py --config.workdir={data_dir}") from e
  return caches


def spec_bench_acceptance(model, drafter, config: ml_collections.ConfigDict,
                          references: dict[int, list] | None = None) -> dict[str, Any]:
  """Greedy mean_accepted (tokens per target forward, pooled over prompts) and alpha of `drafter` on the first
  `per_category` Spec-Bench prompts of every category on the config's `split` side (dev), in the model's prompt format
  (chat, or plain text for a base model: `sequences.default_chat`); every output is checked against autoregressive
  decoding (whose tokens are kept in `references`, by question id, when a dict is given: a run evaluated many times
  decodes each prompt autoregressively once)."""
  questions = spec_bench.select(spec_bench.load_questions(), per_category=config.per_category,
                                split=config.get("split", "dev"))
  references = {} if references is None else references
  per_category: dict[str, list[float]] = {}
  lossless, produced, rounds, accepted, tested = True, 0, 0, 0, 0
  chat = sequences.default_chat(model.tokenizer)
  for q in questions:
    ids = spec_bench.prompt_ids(q, model.tokenizer, chat=chat)
    out = specjax.generate(model, [ids], max_new_tokens=config.max_new_tokens, drafter=drafter, gamma=config.gamma,
                           adaptive=False)  # a chain of gamma drafts every round: the acceptance of the drafter itself
    if q.question_id not in references:
      references[q.question_id] = specjax.generate(model, [ids], max_new_tokens=config.max_new_tokens).tokens
    lossless &= out.tokens == references[q.question_id]
    s = out.stats
    per_category.setdefault(q.category, []).append(s["mean_accepted"])
    produced += sum(s["new_tokens_per_row"]) - len(s["new_tokens_per_row"])  # the prefill gives each row's first
    rounds += sum(s["rounds_per_row"])
    accepted += sum(s["accepted_per_row"])
    tested += sum(s["accepted_per_row"]) + sum(s["rejections_per_row"])
  return {"prompts": len(questions), "gamma": config.gamma, "max_new_tokens": config.max_new_tokens,
          "mean_accepted": produced / rounds if rounds else float("nan"),
          "alpha": accepted / tested if tested else float("nan"),
          "mean_accepted_per_category": {c: round(float(np.mean(v)), 3) for c, v in per_category.items()},
          "lossless": bool(lossless)}


def model_card(card: dict[str, Any]) -> str:
  """The model card (Markdown) from the card dict saved in the checkpoint."""
  ev = card["held_out"]
  depths = sorted(int(k.rsplit("_", 1)[1]) for k in ev if k.startswith("eval_top1_"))
  top1 = " | ".join(f"{ev[f'eval_top1_{k}']:.3f}" for k in depths)
  data = card["data"]
  lines = [
      f"# {card['drafter']} for {card['target']}",
      "",
      f"Self-distilled drafter ({card['drafter']}, options {json.dumps(card['options'])}) for the frozen target "
      f"{card['target']}. Load it with `specjax.make_drafter({card['drafter']!r}, specjax.load({card['target']!r}), "
      f"{drafters.checkpoint_option(card['drafter'])}=<this .safetensors file>)`" + _shipped_load(card) + ".",
      "",
      *_export_note(card),
      "## Reproduce",
      "",
      "```bash",
      card.get("data_command") or "python -m experiments.prepare_data --config=configs/train_data.py",
      # Where this machine kept the data is no part of the recipe.
      " ".join(w for w in card["command"].split() if not w.startswith("--config.data_dir")),
      "```",
      "",
      "## Training",
      "",
      f"- data: {data['train']['source'].get('dataset')} ({data['train']['source'].get('dataset_package')}), "
      f"{data['train']['sequences']} train sequences / {data['train']['masked_positions']:,} answer positions, "
      f"held out by conversation id: {data['held_out']['sequences']} sequences; regenerated answers: "
      f"{data['train']['source'].get('regenerate')}. Never trained on Spec-Bench.",
      f"- labels: the target's top-{data['train']['top_k']} next-token distributions (soft cross-entropy), "
      f"per-depth weights 0.8^(k-1)",
      f"- draft vocabulary: {card['options'].get('draft_vocab') or 'full'} tokens"
      + (f" (covers {card['token_map_coverage']:.1%} of the target's greedy tokens on the train split)"
         if card.get("token_map_coverage") is not None else ""),
      f"- steps {card['steps']}, batch {card['config']['batch_size']} x {data['train']['seq_len']} tokens, "
      f"AdamW lr {card['config']['learning_rate']} (warmup {card['config']['warmup_steps']}, cosine), seed "
      f"{card['config']['seed']}",
      f"- wall time {card['train_seconds'] / 60:.0f} min on {card['environment']['cpu_count']} CPU cores "
      f"({card['environment']['backend']})"
      + (f" ({card['stalled_seconds'] / 60:.0f} min of it stopped or starved: under {curves.STALLED:.0%} of the "
         "run's median CPU rate)" if card.get("stalled_seconds", 0) >= 60 else "")
      + f", commit {card['environment']['specjax_commit']}, {card['date']}",
  ]
  if card["config"].get("options", {}).get("path"):
    lines.append(f"- started from the trained checkpoint `{card['config']['options']['path']}` as it was at commit "
                 f"{card['environment']['specjax_commit']} (continued training)")
  if card.get("positions"):
    lines += [
        f"- answer positions seen: {card['positions']:,} (drawn from the first {card['pool_sequences']:,} train "
        f"sequences); training CPU time {card['train_cpu_seconds'] / 3600:.2f} h, evaluation and compilation apart; "
        f"{card['flops_per_position'] / 1e9:.2f} GFLOPs per answer position (XLA's count of the training step)"]
  lines += [
      "",
      "## Measured",
      "",
      "| held-out | " + " | ".join(f"depth {k}" for k in depths) + " |",
      "|---|" + "---:|" * len(depths),
      f"| top-1 agreement with the target's greedy token | {top1} |",
      "",
  ]
  points = card.get("curve", [])
  if len(points) > 1:
    lines += ["## Curve", "", "Held-out top-1 at depth 1 and Spec-Bench tokens per target forward as training went:",
              "", "| positions seen | training min | depth-1 top-1 | tokens per forward |", "|---:|---:|---:|---:|"]
    lines += [f"| {p['positions']:,} | {p['train_seconds'] / 60:.1f} | {p['eval_top1_1']:.3f} | "
              + (f"{p['spec_bench_mean_accepted']:.2f} |" if "spec_bench_mean_accepted" in p else "- |")
              for p in points]
    lines.append("")
  sb = card.get("spec_bench")
  if sb:
    lines += [f"Spec-Bench ({sb['prompts']} prompts, one per category, greedy, gamma {sb['gamma']}, "
              f"{sb['max_new_tokens']} new tokens): mean_accepted **{sb['mean_accepted']:.2f}** tokens per target "
              f"forward, alpha {sb['alpha']:.3f}, output identical to autoregressive decoding: {sb['lossless']}.", ""]
  if hasattr(drafters.module(card["drafter"]), "depth_logits"):  # parallel heads, a block
    lines += [TREES_NOTE.format(name=card["drafter"]), ""]
  c = card.get("shipped_comparison")
  if c:  # experiments.compare_checkpoints' verdict, added to the card when the checkpoint was shipped
    lines += ["## Against the checkpoint it replaced", "",
              f"On {c['prompts']} held-out prompts (the target's own answers; greedy, a chain of gamma {c['gamma']}, "
              f"{c['max_new_tokens']} new tokens; `python -m experiments.compare_checkpoints`): "
              f"{c['candidate']['mean_accepted']:.2f} tokens per target forward against "
              f"{c['shipped']['mean_accepted']:.2f}, better on {c['prompts_candidate_better']} prompts and worse on "
              f"{c['prompts_shipped_better']}.", ""]
  return "\n".join(lines)


def _shipped_load(card: dict[str, Any]) -> str:
  """How a shipped checkpoint (one with experiments.compare_checkpoints' verdict) loads without its path."""
  if not card.get("shipped_comparison"):
    return ""
  option = drafters.checkpoint_option(card["drafter"])
  names = drafters.shipped_names(card["drafter"], card["target"])
  return ", or " + " or ".join(f'`{option}="{n}"`' for n in names) + " for the copy shipped inside specjax"


def _export_note(card: dict[str, Any]) -> list[str]:
  """A distilled draft is a standalone Llama too: how HF transformers gets it as an assistant model."""
  if card["drafter"] != draft_model.NAME:
    return []
  return ["It is a standalone Llama with the target's embedding and tokenizer: `specjax.export.save_hf("
          "draft_model.as_model(target, drafter), directory)` writes it as an HF Llama directory (the full "
          "vocabulary's head), which is what `experiments/peers.py`'s `hf_assisted` gives HF assisted generation "
          "for draft=<this file>" + (f" (training also wrote one: `{card['config']['export_hf']}`)"
                                     if card["config"].get("export_hf") else "") + ".", ""]


# How drafters that draft every depth from one forward (parallel heads, a block) draft trees, in their model card.
TREES_NOTE = ("## Trees\n\nDraft trees (`generate(..., tree_nodes=N)`) are Medusa's static ones, built from "
              "{name}.ranks.json beside this file: how often depth k's rank-r draft token is the target's greedy "
              "token, measured on held-out answers (`python -m experiments.rank_accuracy --drafter={name} "
              "--checkpoint=<this file> --cache=<a feature cache's held_out>`; training writes it on its held-out "
              "split).")


def check_answers(cache: features.FeatureCache, answers: str) -> None:
  """A config that names whose answers it trains on ("regenerated" or "sharegpt") gets a cache of them."""
  regenerated = bool(cache.meta.get("source", {}).get("regenerate"))
  if answers and answers != ("regenerated" if regenerated else "sharegpt"):
    raise ValueError(f"the config trains on {answers} answers, but the cache {cache.path} holds "
                     f"{'the target' if regenerated else 'ShareGPT'}'s own: point --config.data_dir at the other one")


def budget(config: ml_collections.ConfigDict, train_cache: features.FeatureCache) -> dict[str, Any]:
  """The steps, the sequences batches are drawn from and the evaluation steps of a run: from `positions` (answer
  positions to see, with evaluation where `eval_fractions` of them are seen) when set, else `steps`."""
  pool = train_drafter.pool_sequences(train_cache, config.get("pool_positions", 0))
  if not config.get("positions"):
    if config.get("stop_fraction", 0.0):
      raise ValueError("stop_fraction applies to a budget of `positions`; this run counts `steps`")
    return {"steps": config.steps, "num_sequences": pool, "eval_steps": None, "stop_step": None}
  steps = train_drafter.steps_for_positions(train_cache, pool, config.batch_size, config.seed, config.positions)
  seen = train_drafter.positions_seen(train_cache, pool, config.batch_size, config.seed, steps)
  fractions = config.eval_fractions or (1.0,)
  eval_steps = train_drafter.steps_at_fractions(seen, fractions)
  stop = config.get("stop_fraction", 0.0)
  if stop and stop not in fractions:
    raise ValueError(f"stop_fraction must be one of eval_fractions {tuple(fractions)} (a run stops at an evaluation "
                     f"point), got {stop}")
  stop_step = train_drafter.steps_at_fractions(seen, (stop,))[0] if stop else None
  return {"steps": steps, "num_sequences": pool, "eval_steps": eval_steps, "stop_step": stop_step}


def run(config: ml_collections.ConfigDict, command: str) -> dict[str, Any]:
  start = time.strftime("%Y-%m-%d")
  model = specjax.load(config.model, dtype="float32")
  caches = open_caches(config.data_dir, config.get("held_out_dir", ""))
  check_answers(caches["train"], config.get("data_answers", ""))
  plan = budget(config, caches["train"])
  draft_size = config.draft_vocab
  if config.get("draft_vocab_record"):  # the size chosen on the Spec-Bench dev prompts (experiments/draft_vocab.py)
    draft_size = draft_vocab.load_draft_vocab(config.draft_vocab_record, config.model, caches["train"].token_counts)
    print(f"draft vocabulary: {draft_size or 'the full vocabulary'} (from {config.draft_vocab_record})")
  # Each start of the run (a killed run resumes from its checkpoint at the code of its restart): when, at what code
  # (a -dirty commit with the files it held uncommitted).
  os.makedirs(config.workdir, exist_ok=True)
  commit = code_commit()
  with open(os.path.join(config.workdir, "starts.jsonl"), "a") as f:
    f.write(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
                        "uncommitted": cli.uncommitted_paths() if (commit or "").endswith("-dirty") else [],
                        "command": command, "config": config.to_dict()}) + "\n")
  token_map, coverage = None, None
  if draft_size:
    counts = caches["train"].token_counts
    token_map = features.top_token_map(counts, draft_size, caches["train"].meta.get("stop_ids", ()))
    coverage = features.token_map_coverage(counts, token_map)
  options = config.options.to_dict()
  if "seed" in drafters.option_names(config.drafter) and "seed" not in options:  # a random start: the run's seed
    options["seed"] = config.seed
  fresh = specjax.make_drafter(config.drafter, model, token_map=token_map, **options)
  if config.spec_bench.enabled and fresh.max_gamma is not None and fresh.max_gamma < config.spec_bench.gamma:
    # Said before the first step, not at the first evaluation point after minutes of training.
    raise ValueError(f"{config.drafter} with options {config.options.to_dict()} proposes at most {fresh.max_gamma} "
                     f"tokens a round; the Spec-Bench evaluation drafts spec_bench.gamma={config.spec_bench.gamma}: "
                     "lower it or give the drafter more heads or modules")
  mesh = sharding.make_mesh(*config.mesh_shape) if config.mesh_shape else None
  along_the_way = config.spec_bench.enabled and config.spec_bench.get("along_the_way", False)
  references: dict[int, list] = {}  # autoregressive outputs, decoded once per run

  def spec_bench_metrics(drafter) -> dict[str, Any]:
    measured = spec_bench_acceptance(model, drafter, config.spec_bench, references)
    return {"spec_bench_mean_accepted": measured["mean_accepted"], "spec_bench_alpha": measured["alpha"],
            "spec_bench_lossless": measured["lossless"], "spec_bench": measured}

  result = train_drafter.train_drafter(
      model, fresh, caches["train"], caches["held_out"], workdir=config.workdir, steps=plan["steps"],
      batch_size=config.batch_size, learning_rate=config.learning_rate, warmup_steps=config.warmup_steps,
      weight_decay=config.weight_decay, clip_norm=config.clip_norm, seed=config.seed, log_every=config.log_every,
      eval_every=config.eval_every, eval_steps=plan["eval_steps"], eval_sequences=config.eval_sequences,
      save_every=config.save_every, num_sequences=plan["num_sequences"],
      evaluate_drafter=spec_bench_metrics if along_the_way else None, mesh=mesh,
      stop_step=plan["stop_step"])
  print("held-out:", {k: round(v, 4) for k, v in result.final_eval.items()})
  if result.steps < plan["steps"]:
    print(f"stopped after {result.positions:,} of {config.positions:,} positions (stop_fraction "
          f"{config.stop_fraction}); the same command without it goes on from {config.workdir}")
    return {"stopped": True, "steps": result.steps, "positions": result.positions, "held_out": result.final_eval}
  card = {
      "drafter": config.drafter, "target": config.model, "options": result.drafter.options.saved(),
      "command": command, "config": config.to_dict(), "steps": result.steps, "train_seconds": result.train_seconds,
      "train_cpu_seconds": result.train_cpu_seconds, "stalled_seconds": curves.stalled_seconds(result.history),
      "positions": result.positions,
      "flops_per_position": result.flops_per_position, "compile_seconds": result.compile_seconds,
      "pool_sequences": plan["num_sequences"], "curve": curve(result.history),
      "held_out": result.final_eval, "token_map_coverage": coverage, "environment": environment(), "date": start,
      "data_command": prepare_data.reproduce_command(config.data_dir),
      "data": {split: {"path": os.path.abspath(c.path), "sequences": len(c), "masked_positions":
                       c.meta.get("masked_positions"), "seq_len": c.meta["seq_len"], "top_k": c.meta["top_k"],
                       "source": c.meta.get("source", {})} for split, c in caches.items()},
  }
  if along_the_way:
    card["spec_bench"] = result.history[-1]["spec_bench"]
  elif config.spec_bench.enabled:
    card["spec_bench"] = spec_bench_acceptance(model, result.drafter, config.spec_bench)
  if "spec_bench" in card:
    print("Spec-Bench:", card["spec_bench"])
  with open(os.path.join(config.workdir, "run.json"), "w") as f:
    json.dump(card, f, indent=1)
  path = config.export_path or os.path.join(config.workdir, f"{config.drafter}.safetensors")
  draft_head.save(result.drafter, path, model, card=card, dtype=config.export_dtype)
  card_path = os.path.splitext(path)[0] + ".md"
  with open(card_path, "w") as f:
    f.write(model_card(card))
  print(f"exported {path} ({os.path.getsize(path) / 1e6:.1f} MB) and its model card {card_path}")
  if hasattr(drafters.module(config.drafter), "depth_logits"):  # Medusa's static trees: the measured rank accuracy
    ranks, _ = rank_accuracy.measure_and_save(model, result.drafter, caches["held_out"], path)
    print(f"rank accuracy on the held-out split: {ranks}")
  if config.get("export_hf"):
    hf_dir = export.save_hf(draft_model.as_model(model, result.drafter, name=os.path.basename(config.export_hf)),
                            config.export_hf)
    print(f"exported the draft model as an HF Llama directory: {hf_dir}")
  return card


def curve(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The evaluation points of a run's metrics: positions seen, training seconds, held-out top-1 per depth and the
  Spec-Bench figures when measured."""
  keep = ("step", "positions", "train_seconds", "train_cpu_seconds", "spec_bench_mean_accepted", "spec_bench_alpha")
  return [{k: v for k, v in r.items() if k in keep or k.startswith("eval_top1_")}
          for r in history if any(k.startswith("eval_top1_") for k in r)]


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.INFO)
  code_commit()  # the code this run starts with, reported in the model card
  run(_CONFIG.value, "python -m experiments.train " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main, flags_parser=parse_flags)
