r"""Whether a newly trained drafter checkpoint should replace the shipped one: both measured on held-out prompts.

  python -m experiments.compare_checkpoints --drafter=mtp_sequential \
      --candidate=workdirs/budget/sequential/mtp_sequential.safetensors \
      --held_out=workdirs/data/train_data-regenerate/held_out [--shipped=default] [--prompts=48] [--out=<json>]
  python -m experiments.compare_checkpoints --drafter=block --candidate=workdirs/budget/block/block.safetensors \
      --against=mtp_sequential --held_out=workdirs/data/train_data-regenerate/held_out   # a new family: the best

The prompts are the prompt parts (everything before the first answer position) of the first `--prompts` sequences of
a held-out feature cache: conversations no drafter was trained on, and no evaluation prompt either. Each drafter
decodes every prompt greedily with a chain of `--gamma` drafts per round (`--max_new_tokens` new tokens, output
checked against autoregressive decoding), and is scored by Leviathan et al. (2023)'s speedup with the measured
tokens per target forward E in place of E(alpha): E / (gamma c + 1), c the drafter's cost per draft token over a
target step (`Drafter.cost`: a round's part and gamma steps, over gamma). For two drafters of one cost that ranks
them by tokens per forward; an exit adapter after fewer layers drafts more cheaply and is credited for it. The candidate replaces the shipped checkpoint
only if it scores higher; this command says which, and with `--ship` replaces it then (`ship`: the checkpoint, its
rank accuracy file and a model card that records this comparison). A family with no shipped checkpoint yet (the
block drafter) is measured `--against` another family's shipped checkpoint, and shipped where it beats it.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Sequence

import numpy as np
from absl import app, flags

import specjax
from specjax.data import features
from specjax.drafters import draft_head, exit_adapter
from experiments import train
from experiments.cli import code_commit, write_atomic


def held_out_prompts(cache: features.FeatureCache, count: int) -> list[list[int]]:
  """The prompt of each of the first `count` sequences of `cache`: its tokens before the first answer position."""
  prompts = []
  for i in range(min(count, len(cache))):
    answer = np.flatnonzero(np.asarray(cache.mask[i]))
    if answer.size:
      prompts.append([int(t) for t in cache.tokens[i, :answer[0]]])
  if not prompts:
    raise ValueError(f"no sequence of {cache.path} has an answer position")
  return prompts


def acceptance(model, drafter, prompts: Sequence[Sequence[int]], gamma: int, max_new_tokens: int) -> dict[str, Any]:
  """Tokens per target forward (pooled and per prompt) of greedy decoding with a chain of `gamma` drafts."""
  per_prompt, produced, rounds = [], 0, 0
  for ids in prompts:
    out = specjax.generate(model, [list(ids)], max_new_tokens=max_new_tokens, drafter=drafter, gamma=gamma,
                           adaptive=False)
    if out.tokens != specjax.generate(model, [list(ids)], max_new_tokens=max_new_tokens).tokens:
      raise AssertionError(f"{drafter.name}: speculative output differs from autoregressive decoding: a bug")
    s = out.stats
    per_prompt.append(s["mean_accepted"])
    produced += sum(s["new_tokens_per_row"]) - len(s["new_tokens_per_row"])  # the prefill gives each row's first
    rounds += sum(s["rounds_per_row"])
  mean_accepted = produced / rounds if rounds else float("nan")
  draft_cost = drafter.cost.round + gamma * drafter.cost.step  # a round's drafting, in target steps
  score = mean_accepted / (draft_cost + 1.0)
  return {"mean_accepted": mean_accepted, "draft_cost": draft_cost / gamma, "score": score, "per_prompt": per_prompt}


def compare(model, candidate, shipped, prompts: Sequence[Sequence[int]], *, gamma: int = 4,
            max_new_tokens: int = 64) -> dict[str, Any]:
  """Both drafters on the same prompts; `replace` is True when the candidate scores higher (see the module doc)."""
  new, old = (acceptance(model, d, prompts, gamma, max_new_tokens) for d in (candidate, shipped))
  wins = int(np.sum(np.array(new["per_prompt"]) > np.array(old["per_prompt"])))
  losses = int(np.sum(np.array(new["per_prompt"]) < np.array(old["per_prompt"])))
  return {"prompts": len(prompts), "gamma": gamma, "max_new_tokens": max_new_tokens, "candidate": new,
          "shipped": old, "prompts_candidate_better": wins, "prompts_shipped_better": losses,
          "replace": bool(new["score"] > old["score"])}


# The shipped checkpoint a trained drafter replaces (specjax/checkpoints/<model>/<name>.safetensors), by drafter.
SHIPPED_NAME = {"layer_skip": exit_adapter.SHIPPED_NAME}


def ship(model, drafter: str, candidate: str, comparison: dict[str, Any]) -> list[str]:
  """Replaces the shipped checkpoint of `drafter` with `candidate`: the .safetensors file, the .ranks.json beside it
  (parallel heads' rank accuracy) where there is one, and the model card, rendered from the run.json that
  experiments.train wrote beside the candidate with `comparison` added. Each file is written beside its target and
  renamed over it. Returns the paths written."""
  card_path = os.path.join(os.path.dirname(os.path.abspath(candidate)), "run.json")
  if not os.path.isfile(card_path):
    raise FileNotFoundError(f"no run.json beside {candidate}: the model card is rendered from it")
  with open(card_path) as f:
    card = json.load(f)
  card["shipped_comparison"] = comparison
  target = draft_head.shipped_checkpoint(model, SHIPPED_NAME.get(drafter, drafter))
  stem, candidate_stem = os.path.splitext(target)[0], os.path.splitext(candidate)[0]
  files = [(candidate, target)]
  if os.path.isfile(candidate_stem + ".ranks.json"):
    files.append((candidate_stem + ".ranks.json", stem + ".ranks.json"))
  for source, destination in files:
    with open(source, "rb") as f:
      write_atomic(destination, f.read())
  write_atomic(stem + ".md", train.model_card(card))
  written = [d for _, d in files] + [stem + ".md"]
  print("shipped: " + ", ".join(written))
  return written


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  model = specjax.load(flags.FLAGS.model, dtype="float32")
  argument = specjax.drafters.checkpoint_option(flags.FLAGS.drafter)
  candidate = specjax.make_drafter(flags.FLAGS.drafter, model, **{argument: flags.FLAGS.candidate})
  against = flags.FLAGS.against or flags.FLAGS.drafter
  shipped = specjax.make_drafter(against, model, **{specjax.drafters.checkpoint_option(against): flags.FLAGS.shipped})
  prompts = held_out_prompts(features.FeatureCache.open(flags.FLAGS.held_out), flags.FLAGS.prompts)
  result = compare(model, candidate, shipped, prompts, gamma=flags.FLAGS.gamma,
                   max_new_tokens=flags.FLAGS.max_new_tokens)
  for name in ("candidate", "shipped"):
    r = result[name]
    print(f"{name}: {r['mean_accepted']:.2f} tokens per target forward, draft cost {r['draft_cost']:.3f}, "
          f"score {r['score']:.3f}")
  print(f"candidate better on {result['prompts_candidate_better']} of {result['prompts']} prompts, shipped on "
        f"{result['prompts_shipped_better']}")
  print("REPLACE the shipped checkpoint" if result["replace"] else "KEEP the shipped checkpoint")
  print(json.dumps({k: v for k, v in result.items() if k not in ("candidate", "shipped")}))
  if flags.FLAGS.ship and result["replace"]:
    ship(model, flags.FLAGS.drafter, flags.FLAGS.candidate, result)
  if flags.FLAGS.out:  # the comparison behind a checkpoint's replacement, for its model card
    result.update(drafter=flags.FLAGS.drafter, against=against, candidate_path=flags.FLAGS.candidate,
                  shipped_path=flags.FLAGS.shipped,
                  held_out=flags.FLAGS.held_out, command="python -m experiments.compare_checkpoints " +
                  " ".join(sys.argv[1:]), commit=code_commit())
    write_atomic(flags.FLAGS.out, json.dumps(result, indent=1))
    print(f"wrote {flags.FLAGS.out}")


def _define_flags():
  """Defined when the command runs, not on import: its names (--model, --prompts, --gamma) are other commands' too."""
  flags.DEFINE_string("drafter", None, "make_drafter's name: mtp_parallel, mtp_sequential, layer_skip, ...")
  flags.DEFINE_string("candidate", None, "the new checkpoint (.safetensors)")
  flags.DEFINE_string("shipped", "default", "the checkpoint to beat; default: the one shipped for the model")
  flags.DEFINE_string("against", None, "the drafter whose checkpoint (--shipped) to beat, where it is another "
                      "family's (a family with no shipped checkpoint); default: --drafter's")
  flags.DEFINE_string("held_out", None, "a held-out feature cache (prepare_data's <workdir>/held_out)")
  flags.DEFINE_string("model", "smollm2-135m", "the target")
  flags.DEFINE_integer("prompts", 48, "held-out prompts")
  flags.DEFINE_integer("gamma", 4, "draft tokens per round")
  flags.DEFINE_integer("max_new_tokens", 64, "new tokens per prompt")
  flags.DEFINE_bool("ship", False, "when the candidate scores higher, replace the shipped checkpoint with it (and its "
                    "rank accuracy and model card)")
  flags.DEFINE_string("out", None, "also write the comparison (both drafters' figures, the verdict) to this JSON file")


if __name__ == "__main__":
  _define_flags()
  flags.mark_flags_as_required(["drafter", "candidate", "held_out"])
  app.run(main)
