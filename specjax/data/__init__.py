"""Drafter training data: ShareGPT conversations (`sharegpt`), the sequences and prompts rendered from them with
the target's chat template (`sequences`), and the frozen target's features over them, on disk (`features`).

The package sits below the decode loop (`specjax.generate`, `specjax.speculative`): what needs the target to
answer prompts (regenerated data) is built by `experiments/regenerate.py`.
"""
