#!/usr/bin/env bash
# Trains every drafter family on one budget (configs/train_budget.py), one run after another, then draws the curves.
#
#   launch/train_budget.sh                 # starts the set in the background (nice 19) and returns
#   launch/train_budget.sh --foreground    # the same, in this shell
#   RUNS="sequential exit" launch/train_budget.sh --config.positions=100000   # some runs; overrides for every run
#   RUNS="sequential,gemma3 exit,gemma3 exit10,gemma3" launch/train_budget.sh  # Gemma-3-270M's (workdirs/budget-gemma3)
#   RUNS="sequential,seed2" launch/train_budget.sh --config.stop_fraction=0.5   # the first half of a run (its points
#                                          # the full run's); the same line without the flag goes on from there
#
# Rerunning it resumes the set: a run whose run.json exists (written when it ends) is skipped, a killed run resumes
# from its last checkpoint without repeating or losing an evaluation point. One set runs at a time (a lock file).
# A run's training data is built first where it is missing (prepare_data, itself resumable): the target's own
# answers (configs/train_data.py:regenerate, ~3 CPU-hours) and, for the `sharegpt` control, ShareGPT's answers to
# as many conversations (configs/train_budget.py says which; ~2.7 CPU-hours). A `gemma3` run builds Gemma-3-270M's
# own answers (configs/train_data.py:regenerate,gemma3) and its draft vocabulary record (experiments/draft_vocab.py)
# where they are missing, and goes to workdirs/budget-gemma3/<run>.
# Log: workdirs/budget/train_budget.log; curves: python -m experiments.curves --workdirs=workdirs/budget.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-"sequential parallel exit exit16 deepseek draft sequential,sharegpt"}
ROOT=workdirs/budget
LOG=$ROOT/train_budget.log
mkdir -p "$ROOT"

if [[ "${1:-}" != "--foreground" ]]; then
  RUNS="$RUNS" nohup nice -n 19 "$0" --foreground "$@" >> "$LOG" 2>&1 &
  echo "training in the background (pid $!): tail -f $LOG"
  exit 0
fi
shift
exec 9> "$ROOT/.lock"
flock -n 9 || { echo "another launch/train_budget.sh holds $ROOT/.lock"; exit 1; }
ensure_data() {  # $1: prepare_data's workdir (configs/train_budget.py's data_dir); the rest: its arguments
  [[ -f "$1/train/meta.json" && -f "$1/held_out/meta.json" ]] && return
  echo "$(date -Is) building the training data in $1"
  python -m experiments.prepare_data "${@:2}" --config.workdir="$1"
}
for run in $RUNS; do
  name=$(sed 's/,gemma3,/,/; s/^,//; s/,$//' <<< ",$run,")  # the run's name within its target's folder
  root=$ROOT
  [[ ",$run," == *,gemma3,* ]] && root=workdirs/budget-gemma3
  workdir="$root/${name//,/-}"
  if [[ -f "$workdir/run.json" ]]; then
    echo "$(date -Is) $run: finished before ($workdir/run.json), skipped"
    continue
  fi
  if [[ ",$run," == *,sharegpt,* ]]; then
    ensure_data workdirs/data/train_data --config=configs/train_data.py --config.num_train=14000
  elif [[ ",$run," == *,gemma3,*small,* || ",$run," == *,small,*gemma3,* ]]; then
    ensure_data workdirs/data/train_data-regenerate-gemma3-small --config=configs/train_data.py:regenerate,gemma3,small
  elif [[ ",$run," == *,gemma3,* ]]; then
    ensure_data workdirs/data/train_data-regenerate-gemma3 --config=configs/train_data.py:regenerate,gemma3
    if [[ ! -f configs/draft_vocab/gemma3-270m.json ]]; then
      echo "$(date -Is) choosing Gemma-3-270M's draft vocabulary on the Spec-Bench dev prompts"
      python -m experiments.draft_vocab --model=gemma3-270m
    fi
  else
    ensure_data workdirs/data/train_data-regenerate --config=configs/train_data.py:regenerate
  fi
  echo "$(date -Is) $run: training in $workdir"
  python -m experiments.train --config="configs/train_budget.py:$run" "$@"
  echo "$(date -Is) $run: done"
done
for root in $ROOT workdirs/budget-gemma3; do
  [[ -d $root ]] || continue
  python -m experiments.curves --workdirs="$root" --out="$root/curves"
  echo "$(date -Is) all runs done: $root/curves/results.md"
done
