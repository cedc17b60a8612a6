"""specjax.stats: what a speculative run reports from its loop's counts, and how runs pool."""

import numpy as np

from specjax import stats


def test_summarize_counts_acceptance_over_proposed_tested_and_live_rounds():
  # Two rows: row 0 ran 3 live rounds (5 of 6 drafts accepted, one rejection), row 1 ran 2 (1 of 4, one rejection).
  counts = {"rounds": np.int32(3), "live_rounds": np.array([3, 2]), "proposed": np.array([6, 4]),
            "accepted": np.array([5, 1]), "rejections": np.array([1, 1]), "proposed_at": np.array([5, 5]),
            "accepted_at": np.array([4, 2]), "width_rounds": np.array([0, 1, 4]), "plain_steps": np.int32(0),
            "tree_rounds": np.int32(2), "draft_steps": np.int32(3)}
  num_generated = np.array([9, 4])  # each row's first token comes from the prefill
  summary = stats.summarize(counts, num_generated, seconds=2.0, forwards_per_step=2, compile_seconds=1.5)
  assert summary["target_calls"] == 4 and summary["draft_calls"] == 6
  assert summary["acceptance_rate"] == 6 / 10
  assert summary["alpha"] == 6 / 8  # every accepted draft plus the one rejected in each rejecting round
  assert summary["mean_accepted"] == (13 - 2) / 5
  assert summary["acceptance_per_position"] == [4 / 5, 2 / 5]
  assert summary["tokens_per_second"] == 13 / 2.0 and summary["compile_seconds"] == 1.5
  assert summary["tree_rounds"] == 2 and summary["plain_steps"] == 0


def test_summarize_gives_nan_for_a_slot_no_round_drafted():
  counts = {"rounds": np.int32(1), "live_rounds": np.array([1]), "proposed": np.array([1]),
            "accepted": np.array([1]), "rejections": np.array([0]), "proposed_at": np.array([1, 0]),
            "accepted_at": np.array([1, 0]), "width_rounds": np.array([0, 1, 0]), "plain_steps": np.int32(0),
            "tree_rounds": np.int32(0), "draft_steps": np.int32(1)}
  summary = stats.summarize(counts, np.array([3]), seconds=1.0)
  assert summary["acceptance_per_position"][0] == 1.0 and np.isnan(summary["acceptance_per_position"][1])


def test_merge_stats_pools_runs_by_the_rounds_that_drafted_each_slot():
  def run(rounds, accepted, rejections, new_tokens, per_position, proposed_at):
    return {"rounds_per_row": [rounds], "accepted_per_row": [accepted], "rejections_per_row": [rejections],
            "new_tokens_per_row": [new_tokens], "proposed_per_row": [sum(proposed_at)],
            "acceptance_per_position": per_position, "proposed_per_position": proposed_at}

  # The second run never drafted slot 1 (adaptive drafting): its NaN there must not count.
  pooled = stats.merge_stats([run(4, 3, 3, 8, [0.5, 0.25], [4, 4]),
                              run(2, 2, 0, 5, [1.0, float("nan")], [2, 0])], gamma=2)
  np.testing.assert_allclose(pooled["acceptance_per_position"], [(0.5 * 4 + 1.0 * 2) / 6, 0.25])
  assert pooled["acceptance_rate"] == 5 / 10
  assert pooled["mean_accepted"] == ((8 - 1) + (5 - 1)) / 6  # tokens per live round, the prefill's first excluded
  assert pooled["rounds_per_row"] == [6] and pooled["rejections_per_row"] == [3]


def test_an_autoregressive_run_reports_one_token_per_target_forward():
  summary = stats.summarize_autoregressive(np.int32(7), np.array([8, 5]), seconds=0.5, compile_seconds=2.0)
  assert summary["target_calls"] == 8 and summary["draft_calls"] == 0 and summary["mean_accepted"] == 1.0
  assert summary["new_tokens"] == 13 and summary["new_tokens_per_row"] == [8, 5]
  assert summary["tokens_per_second"] == 26.0 and summary["compile_seconds"] == 2.0
