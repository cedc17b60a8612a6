"""Experiments: run a config of decoding methods on Spec-Bench prompts and report speedups.

  python -m experiments.run --config=configs/quickstart.py

`run.py` is the runner, `spec_bench.py` loads the prompts, `report.py` writes the table and plots.
"""
