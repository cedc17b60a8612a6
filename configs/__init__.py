"""Experiment configs: each file has `get_config(arg=None)` and shows its command at the top."""
