"""Platform kernels behind `specjax.ops`: one package per platform, each chosen by the platform a program is
compiled for. `cpu`: XLA:CPU kernels for decoding (a product over weights packed as column panels, decode
attention), their build and the packing of weights they read."""
