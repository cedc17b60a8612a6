#!/usr/bin/env bash
# Trains every drafter family on one budget (configs/train_budget.py), one run after another, then draws the curves.
#
#   launch/train_budget.sh                 # starts the set in the background (nice 19) and returns
#   launch/train_budget.sh --foreground    # the same, in this shell
#   RUNS="sequential exit" launch/train_budget.sh --config.positions=100000   # some runs; overrides for every run
#
# Rerunning it resumes the set: a run whose run.json exists (written when it ends) is skipped, a killed run resumes
# from its last checkpoint without repeating or losing an evaluation point. One set runs at a time (a lock file).
# Log: workdirs/budget/train_budget.log; curves: python -m experiments.curves --workdirs=workdirs/budget.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-"sequential parallel exit deepseek draft sequential,sharegpt"}
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
for run in $RUNS; do
  workdir="$ROOT/${run//,/-}"
  if [[ -f "$workdir/run.json" ]]; then
    echo "$(date -Is) $run: finished before ($workdir/run.json), skipped"
    continue
  fi
  echo "$(date -Is) $run: training in $workdir"
  python -m experiments.train --config="configs/train_budget.py:$run" "$@"
  echo "$(date -Is) $run: done"
done
python -m experiments.curves --workdirs="$ROOT" --out="$ROOT/curves"
echo "$(date -Is) all runs done: $ROOT/curves/results.md"
