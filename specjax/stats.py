"""Run statistics: what a run reports in `Output.stats` (a speculative run: `summarize`, from the arrays its compiled
loop carries; an autoregressive one: `summarize_autoregressive`) and how several speculative runs pool into one
(`merge_stats`).

Acceptance is reported three ways, each over what it counts:
  acceptance_rate         = accepted drafts / proposed drafts,
  alpha                   = accepted drafts / tested drafts (each accepted one plus the one rejected in a rejecting
                            round): Leviathan et al.'s (2023) chance a tested draft is accepted, with
                            E[tokens per round] = (1 - alpha^(gamma+1)) / (1 - alpha),
  mean_accepted           = tokens per live round (a target forward), the bonus or correction token included,
and per draft slot i, P(draft i accepted | slot i drafted) over the rounds that drafted slot i.
"""

from __future__ import annotations

import math

import numpy as np


def _ratio(numerator, denominator) -> float:
  return float(numerator / denominator) if denominator else float("nan")


def summarize(stats, num_generated, seconds: float, forwards_per_step: int = 1, compile_seconds: float = 0.0) -> dict:
  """Host-side stats from the arrays the compiled loop returns; `seconds` excludes `compile_seconds`."""
  rounds = int(stats["rounds"])
  live_rounds = int(stats["live_rounds"].sum())
  accepted = int(stats["accepted"].sum())
  # The first token of every row comes from the prefill; each later one from a verification round.
  from_rounds = int(num_generated.sum()) - len(num_generated)
  # Drafts the verifier actually tested: every accepted one plus the one rejected in each rejecting round.
  checked = accepted + int(stats["rejections"].sum())
  new_tokens = int(num_generated.sum())
  proposed_at = stats["proposed_at"].astype(np.int64)
  return {
      "rounds": rounds,
      "target_calls": rounds + 1,
      "draft_calls": int(stats["draft_steps"]) * forwards_per_step,
      "new_tokens": new_tokens,
      "acceptance_rate": _ratio(accepted, int(stats["proposed"].sum())),  # accepted / proposed drafts
      # Leviathan et al.'s alpha, the chance a tested draft is accepted: E[tokens/round] = (1-a^(g+1))/(1-a).
      "alpha": _ratio(accepted, checked),
      "mean_accepted": _ratio(from_rounds, live_rounds),  # tokens per target forward, bonus included
      # P(draft i accepted | slot i drafted), over the rounds that drafted slot i.
      "acceptance_per_position": [_ratio(a, n) for a, n in zip(stats["accepted_at"].tolist(), proposed_at.tolist())],
      "proposed_per_position": proposed_at.tolist(),
      # Rounds by the gamma actually used: the longest draft a row made (index 0: a 1-token target step).
      "gamma_histogram": stats["width_rounds"].tolist(),
      "plain_steps": int(stats["plain_steps"]),  # rounds in which adaptive drafting did not draft at all
      "tree_rounds": int(stats["tree_rounds"]),  # rounds that drafted a tree (`tree_nodes`)
      "new_tokens_per_row": num_generated.tolist(),
      "rounds_per_row": stats["live_rounds"].tolist(),
      "proposed_per_row": stats["proposed"].tolist(),
      "accepted_per_row": stats["accepted"].tolist(),
      "rejections_per_row": stats["rejections"].tolist(),
      "compile_seconds": compile_seconds,
      "seconds": seconds,
      "tokens_per_second": new_tokens / seconds,
  }


def summarize_autoregressive(steps, num_generated, seconds: float, compile_seconds: float = 0.0) -> dict:
  """Host-side stats of an autoregressive run of `steps` decode forwards after the prefill, under the keys a
  speculative run reports them (one token per target forward, no draft calls)."""
  new_tokens = int(num_generated.sum())
  return {"rounds": int(steps), "target_calls": int(steps) + 1, "draft_calls": 0,
          "new_tokens": new_tokens, "new_tokens_per_row": num_generated.tolist(),
          "mean_accepted": 1.0, "compile_seconds": compile_seconds, "seconds": seconds,
          "tokens_per_second": new_tokens / seconds}


def merge_stats(stats: list[dict], gamma: int) -> dict:
  """Pools the stats (`summarize`'s dicts) of several speculative runs, as if one: acceptance per position weighted
  by the rounds that drafted it, alpha and mean_accepted over all rounds."""
  live = sum(sum(s["rounds_per_row"]) for s in stats)
  accepted = sum(sum(s["accepted_per_row"]) for s in stats)
  from_rounds = sum(sum(s["new_tokens_per_row"]) - len(s["new_tokens_per_row"]) for s in stats)
  # Slot i's acceptance is over the rounds that drafted slot i (all live rounds at a fixed gamma).
  drafted_at = [s.get("proposed_per_position") or [sum(s["rounds_per_row"])] * gamma for s in stats]
  per_position = []
  for i in range(gamma):
    total = sum(d[i] for d in drafted_at)
    per_position.append(sum(s["acceptance_per_position"][i] * d[i] for s, d in zip(stats, drafted_at) if d[i]) / total
                        if total else math.nan)
  rejections = sum(sum(s["rejections_per_row"]) for s in stats)
  proposed = sum(sum(s.get("proposed_per_row") or [gamma * sum(s["rounds_per_row"])]) for s in stats)
  return {"rounds_per_row": [live], "accepted_per_row": [accepted], "rejections_per_row": [rejections],
          "acceptance_per_position": per_position,
          "acceptance_rate": accepted / proposed if proposed else math.nan,
          "mean_accepted": from_rounds / live if live else math.nan}
