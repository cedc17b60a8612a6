"""XLA:CPU kernels for decoding (kernels.py, kernels.cc), their build, and the weights laid out as they read them:
float panels (packing.py) and GGUF-quantized blocks (quantized.py). `specjax.ops` chooses them where a program is
compiled for a CPU; `specjax.decoding` packs the weights when the process decodes on its CPU."""

from specjax.backends.cpu.kernels import (MAX_QUERY_TOKENS, attention, attention_applies, available, build,
                                          cache_write, cache_write_applies, enabled, library_path, matmul_applies,
                                          packed_matmul, quantized_matmul_applies, set_enabled, status, usable)
from specjax.backends.cpu.packing import (PANEL, Packed, matmul_panels, pack, pack_draft_params, pack_layer,
                                          pack_params)
from specjax.backends.cpu.quantized import Quantized, dequantize_params
