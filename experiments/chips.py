"""Accelerators as their makers publish them: per chip, HBM, its bandwidth, peak compute and the interconnect between
chips. The compiled programs (experiments/compile_for.py) are sized against these figures and the cost model
(experiments/cost_model.py) times its programs with them; nothing here is measured by this project.
"""

from __future__ import annotations

from typing import NamedTuple


class Chip(NamedTuple):
  """One TPU chip's or GPU's published figures, and the page they come from."""
  tensor_cores: int  # a device is one TensorCore, or (megacore) all of them
  hbm_bytes: float
  hbm_bytes_per_second: float
  bf16_flops_per_second: float  # dense (no structured sparsity)
  source: str
  # Bidirectional chip-to-chip bandwidth per chip (TPU ICI over all its ports; GPU NVLink); 0 where unused here.
  interconnect_bytes_per_second: float = 0.0
  fp32_flops_per_second: float = 0.0  # where the maker gives it (the GPUs' non-tensor FP32); 0 where unused here


# Per chip. GiB where the page gives GB for a capacity that is a power of two (16 GB of v5e is 16 GiB: the
# compiler's own limit). ICI: the pages' "bidirectional inter-chip interconnect (ICI) bandwidth (per chip)" (v5e 400
# GBps, v6e 800 GBps) or "interchip interconnect BW" (v5p 4800 Gbps = 600 GB/s).
CHIPS = {
    # The v2 page cites Jouppi et al. 2020, "A Domain-Specific Supercomputer for Training Deep Neural Networks"
    # (CACM 63(7)), Table 3, for its figures.
    "v2": Chip(2, 16 * 2**30, 700e9, 46e12, "https://cloud.google.com/tpu/docs/v2 (Jouppi et al. 2020, Table 3)"),
    "v3": Chip(2, 32 * 2**30, 900e9, 123e12, "https://cloud.google.com/tpu/docs/v3"),
    "v4": Chip(2, 32 * 2**30, 1200e9, 275e12, "https://cloud.google.com/tpu/docs/v4"),
    "v5e": Chip(1, 16 * 2**30, 819e9, 197e12, "https://cloud.google.com/tpu/docs/v5e", 400e9),
    "v5p": Chip(2, 95 * 2**30, 2765e9, 459e12, "https://cloud.google.com/tpu/docs/v5p", 600e9),
    "v6e": Chip(1, 32 * 2**30, 1640e9, 918e12, "https://cloud.google.com/tpu/docs/v6e", 800e9),
}


# NVIDIA's SXM parts (dense bf16, no sparsity), one device per GPU; NVLink 4 at 900 GB/s bidirectional; FP32 the
# datasheet's non-tensor figure (67 TFLOPS on both).
GPUS = {
    "h100": Chip(1, 80e9, 3.35e12, 989e12, "https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM)", 900e9, 67e12),
    "h200": Chip(1, 141e9, 4.8e12, 989e12, "https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM)", 900e9, 67e12),
}
