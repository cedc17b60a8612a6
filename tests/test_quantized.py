"""GGUF-quantized weights (`specjax.load(..., quantized=True)`, specjax.backends.cpu.quantized): they stand for the
values gguf dequantizes them to, the CPU kernel multiplies by those values, and a quantized model decodes what the
dequantized one does."""

import os
import shutil
import subprocess
import warnings

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

import specjax
from specjax import ops
from specjax.backends import cpu
from specjax.backends.cpu import quantized

TYPES = tuple(quantized.GGUF_TYPES)  # Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K


def gguf_rows(gguf_type: str, n: int, k: int, seed: int = 0, std: float = 0.3) -> np.ndarray:
  """N rows of K weights as GGUF stores them ([N, K / block * block bytes] uint8): gguf's own quantization where it
  has one, random blocks with small scales otherwise (K-quants)."""
  rng = np.random.default_rng(seed)
  kind = GGMLQuantizationType[gguf_type]
  try:
    return quants.quantize((std * rng.standard_normal((n, k))).astype(np.float32), kind)
  except NotImplementedError:
    pass
  block_k, block_bytes, _ = quantized.GGUF_TYPES[gguf_type]
  blocks = rng.integers(0, 256, (n, k // block_k, block_bytes), dtype=np.uint8)
  halves = lambda: rng.uniform(1e-4, 2e-3, (n, k // block_k, 1)).astype(np.float16).view(np.uint8)
  if gguf_type == "Q4_K":  # d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit codes
    blocks[..., 0:2], blocks[..., 2:4] = halves(), halves()
  else:  # Q6_K: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, d
    blocks[..., 208:210] = halves()
  return blocks.reshape(n, -1)


MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "embed", "lm_head")


def quantize_model(model: specjax.Model, gguf_types: str | dict[str, str] = "Q8_0", name: str = "") -> specjax.Model:
  """`model` (float32) with every matrix (`MATRICES`: the embedding table and head included) quantized by gguf's own
  quantizer to `gguf_types` (one type, or one per matrix name; gguf quantizes Q8_0, Q4_0, Q4_1 and Q5_0) and kept as
  its blocks: the target a GGUF of those types loads as with `quantized=True`. Its values are the quantized ones, so
  it is another model than `model` (its own reference for losslessness)."""
  def quantize(path, w):
    key = path[-1].key
    if key not in MATRICES:
      return w
    gguf_type = gguf_types if isinstance(gguf_types, str) else gguf_types[key]
    if key == "embed":  # [vocab, embed]: one GGUF row per token
      return quantized.from_gguf(quants.quantize(np.asarray(w, np.float32), GGMLQuantizationType[gguf_type]),
                                 gguf_type, w.shape, transposed=True)
    k_dims = 2 if key == "wo" else 1
    rows = np.asarray(w, np.float32).reshape(int(np.prod(w.shape[:k_dims])), -1).T  # [N, K]: one row per output
    return quantized.from_gguf(quants.quantize(np.ascontiguousarray(rows), GGMLQuantizationType[gguf_type]),
                               gguf_type, w.shape, k_dims)
  params = jax.tree_util.tree_map_with_path(quantize, model.params)
  return specjax.Model(model.config, params, model.tokenizer, name or f"{model.name}-quantized")


def dequantized(rows: np.ndarray, gguf_type: str) -> np.ndarray:
  """[N, K] float32, gguf's dequantization."""
  return quants.dequantize(rows, GGMLQuantizationType[gguf_type])


def _has_kernel(fn, *args) -> bool:
  return "specjax_quantized_matmul" in jax.jit(lambda *a: fn(*a)).lower(*args).as_text()


def _k(gguf_type: str) -> int:
  """An input size that is whole blocks of the type, and not a multiple of the 32-column panel where it can be."""
  return 512 if quantized.GGUF_TYPES[gguf_type][0] == 256 else 96


# ------------------------------------------------------------------------------------- the values

@pytest.mark.parametrize("gguf_type", TYPES)
def test_quantized_weights_stand_for_ggufs_dequantized_values(gguf_type):
  """dequantize() equals gguf's dequantization bit for bit, as a product's matrix ([K, N], [K, H, hd], [H, hd, N])
  and as an embedding table ([N, K]); `take` gathers the same values (table rows, head columns) from the blocks."""
  k, n = _k(gguf_type), 100  # 100 columns: the last panel is partly padding
  rows = gguf_rows(gguf_type, n, k)
  want = dequantized(rows, gguf_type)  # [N, K]
  for shape, k_dims in [((k, n), 1), ((k, 4, 25), 1), ((2, k // 2, n), 2)]:
    weight = quantized.from_gguf(rows, gguf_type, shape, k_dims)
    assert weight.matrix_shape == (k, n) and weight.shape == shape
    np.testing.assert_array_equal(np.asarray(weight.dequantize()), want.T.reshape(shape))
  table = quantized.from_gguf(rows, gguf_type, (n, k), transposed=True)
  np.testing.assert_array_equal(np.asarray(table.dequantize()), want)
  ids = np.array([[0, 99, 31], [32, 64, 7]])
  np.testing.assert_array_equal(np.asarray(ops.take(table, jnp.asarray(ids))), want[ids])
  np.testing.assert_array_equal(np.asarray(ops.take(table.T, jnp.asarray(ids[0]), axis=1)), want[ids[0]].T)
  assert table.T.T == table


def test_q5_0_is_read_as_int8_codes_and_every_type_as_bytes_per_weight():
  """Bits a weight the kernel reads: GGUF's, but Q5_0 and Q6_K widened to int8 codes (kernels.cc: the types)."""
  k, n = 512, 64
  bits = {t: quantized.from_gguf(gguf_rows(t, n, k), t, (k, n)).nbytes * 8 / (k * n) for t in TYPES}
  assert bits == {"Q8_0": 8.5, "Q4_0": 4.5, "Q4_1": 5.0, "Q5_0": 8.5, "Q4_K": 4.625, "Q6_K": 8.5625}
  assert quantized.from_gguf(gguf_rows("Q5_0", n, k), "Q5_0", (k, n)).kind == "Q8_0"


# ------------------------------------------------------------------------------------- the kernel

@pytest.mark.parametrize("rows", [1, 2, 5, 17, 65, 130])
@pytest.mark.parametrize("gguf_type", TYPES)
def test_the_kernel_equals_a_float32_product_over_the_dequantized_matrix(gguf_type, rows):
  """Decode (1 row), verification widths (up to 65: the product kernel), a prefill (more: XLA's product over the
  matrix the kernel dequantizes)."""
  k, n = _k(gguf_type), 100
  weights = gguf_rows(gguf_type, n, k, seed=rows)
  w = quantized.from_gguf(weights, gguf_type, (k, n))
  x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
  kernel = "specjax_quantized_matmul" if rows <= quantized.MAX_KERNEL_ROWS else "specjax_dequantize"
  assert kernel in jax.jit(ops.matmul).lower(jnp.asarray(x), w).as_text()
  got = np.asarray(jax.jit(ops.matmul)(jnp.asarray(x), w))
  want = x.astype(np.float64) @ dequantized(weights, gguf_type).T.astype(np.float64)
  assert got.shape == (rows, n)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_subnormal_and_zero_half_scales_are_read_exactly():
  """A half below 2^-14 is subnormal (a float32 is not): F16C's conversion and the scalar one of hosts without it."""
  k, n = 64, 40
  rows = gguf_rows("Q4_1", n, k).reshape(n, 2, 20)
  scales = np.array([2 ** -24, 3 * 2 ** -20, 0.0, -(2 ** -15), 6e-5], np.float16)
  rows[:, :, 0:2] = scales[np.arange(2 * n) % 5].reshape(n, 2, 1).view(np.uint8)  # d
  rows[:, :, 2:4] = scales[np.arange(2 * n) % 3].reshape(n, 2, 1).view(np.uint8)  # m
  rows = rows.reshape(n, -1)
  w = quantized.from_gguf(rows, "Q4_1", (k, n))
  want = dequantized(rows, "Q4_1")
  np.testing.assert_array_equal(np.asarray(w.dequantize()), want.T)
  x = jnp.asarray(np.eye(k, dtype=np.float32))  # the product's rows are the weights themselves
  np.testing.assert_array_equal(np.asarray(jax.jit(ops.matmul)(x, w)), want.T)


@pytest.mark.parametrize("gguf_type", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
def test_a_rows_product_does_not_depend_on_the_other_rows_of_the_call(gguf_type):
  """Bit for bit, a row alone, among 5 (decoded in registers as the weights stream) and among 65 (decoded into a
  float panel first): layer skip reuses a prefix's cache, verification reuses decode's logits."""
  k, n = _k(gguf_type), 160
  w = quantized.from_gguf(gguf_rows(gguf_type, n, k), gguf_type, (k, n))
  x = jnp.asarray(np.random.default_rng(0).standard_normal((65, k)).astype(np.float32))
  product = jax.jit(ops.matmul)
  many, few = np.asarray(product(x, w)), np.asarray(product(x[:5], w))
  for row in (0, 3, 4, 64):
    alone = np.asarray(product(x[row:row + 1], w))[0]
    np.testing.assert_array_equal(many[row], alone)
    if row < 5:
      np.testing.assert_array_equal(few[row], alone)


def test_jnp_where_the_kernel_does_not_run_and_for_gradients():
  """Kernels off (another platform's path): the dequantized matrix with jnp. Derivatives with respect to the
  activations are a float32 product's; the codes have none."""
  k, n = 256, 48
  weights = gguf_rows("Q4_K", n, k)
  w = quantized.from_gguf(weights, "Q4_K", (k, n))
  dense = jnp.asarray(dequantized(weights, "Q4_K").T)
  x = jnp.asarray(np.random.default_rng(1).standard_normal((3, k)).astype(np.float32))
  with cpu.enabled(False):
    assert not _has_kernel(ops.matmul, x, w)
    got = jax.jit(lambda x, w: ops.matmul(x, w))(x, w)
  np.testing.assert_allclose(np.asarray(got), np.asarray(x @ dense), rtol=1e-5, atol=1e-5)
  loss = lambda x: jnp.sum(jnp.tanh(ops.matmul(x, w)) ** 2)
  want = jax.grad(lambda x: jnp.sum(jnp.tanh(x @ dense) ** 2))(x)
  np.testing.assert_allclose(np.asarray(jax.grad(loss)(x)), np.asarray(want), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not shutil.which("g++") or os.uname().machine != "x86_64", reason="needs g++ on x86-64")
@pytest.mark.parametrize("flags", [pytest.param(["-mavx512f", "-mavx512bw", "-mavx512vl", "-mf16c", "-mfma"],
                                               marks=pytest.mark.slow), []], ids=["avx512", "generic"])
def test_the_other_vector_widths_compile_from_the_same_source(tmp_path, flags):
  """The AVX-512 path (16 lanes, an Intel host's) and the generic one (no AVX) build here; they cannot run here.
  Built without optimization (-O0, a quarter of the time): an intrinsic that the flags do not enable still fails, since
  GCC inlines intrinsics at every level."""
  from specjax.backends.cpu import kernels
  result = subprocess.run(["g++", *kernels._FLAGS, *flags, "-O0", "-I", jax.ffi.include_dir(), kernels._SOURCE, "-o",
                           str(tmp_path / "kernels.so")], capture_output=True, text=True)
  assert result.returncode == 0, result.stderr[-3000:]


# ------------------------------------------------------------------------------------- a quantized GGUF model

# Layer 0 mixes every kept type and one that is not (F16); layer 1 is all Q8_0, so its products fuse.
LAYER_TYPES = [{"attn_q": "Q4_K", "attn_k": "Q6_K", "attn_v": "Q5_0", "attn_output": "F16", "ffn_gate": "Q4_1",
                "ffn_up": "Q4_0", "ffn_down": "Q4_K"},
               {name: "Q8_0" for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                          "ffn_down")}]
D, F, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 300


def write_quantized_gguf(path) -> str:
  """A tiny llama GGUF (byte-level tokenizer, tied Q8_0 embedding) whose matrices take the types of LAYER_TYPES."""
  writer = gguf.GGUFWriter(str(path), "llama")
  for add, value in [(writer.add_block_count, len(LAYER_TYPES)), (writer.add_context_length, 128),
                     (writer.add_embedding_length, D), (writer.add_feed_forward_length, F),
                     (writer.add_head_count, HEADS), (writer.add_head_count_kv, KV_HEADS),
                     (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_vocab_size, VOCAB)]:
    add(value)
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("llama-bpe")
  printable = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2's byte alphabet
  alphabet = {b: chr(b) if b in printable else chr(256 + sorted(set(range(256)) - set(printable)).index(b))
              for b in range(256)}
  tokens = [alphabet[b] for b in range(256)] + [f"t{i}" for i in range(VOCAB - 257)] + ["\u0120t"]
  writer.add_token_list(tokens)
  writer.add_token_types([1] * VOCAB)
  writer.add_token_merges(["\u0120 t"])
  writer.add_bos_token_id(0)
  writer.add_eos_token_id(1)
  seed = iter(range(1000))

  def add(name, gguf_type, n, k):
    if gguf_type == "F16":
      data = (0.3 * np.random.default_rng(next(seed)).standard_normal((n, k))).astype(np.float16)
      writer.add_tensor(name, data)
    else:
      writer.add_tensor(name, gguf_rows(gguf_type, n, k, seed=next(seed)), raw_dtype=GGMLQuantizationType[gguf_type])

  add("token_embd.weight", "Q8_0", VOCAB, D)
  writer.add_tensor("output_norm.weight", np.ones(D, np.float32))
  hd = D // HEADS
  for i, types in enumerate(LAYER_TYPES):
    shapes = {"attn_q": (D, D), "attn_k": (KV_HEADS * hd, D), "attn_v": (KV_HEADS * hd, D),
              "attn_output": (D, D), "ffn_gate": (F, D), "ffn_up": (F, D), "ffn_down": (D, F)}
    for name, (n, k) in shapes.items():
      add(f"blk.{i}.{name}.weight", types[name], n, k)
    for norm in ("attn_norm", "ffn_norm"):
      writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * np.random.default_rng(next(seed)).standard_normal(D))
                        .astype(np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return str(path)


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory):
  path = write_quantized_gguf(tmp_path_factory.mktemp("quantized") / "tiny.gguf")
  with pytest.warns(UserWarning, match=r"dequantized to float32: 1 F16 matrix"):
    model = specjax.load(path, quantized=True)
  return path, model, specjax.load(path)


def test_a_quantized_gguf_keeps_its_blocks_and_says_what_it_dequantized(quantized_gguf):
  path, model, dense = quantized_gguf
  first, second = model.params["layers"]
  assert {name: getattr(w, "kind", "float32") for name, w in first.items() if name.startswith("w")} == {
      "wq": "Q4_K", "wk": "Q6_K", "wv": "Q8_0", "wo": "float32", "w_gate": "Q4_1", "w_up": "Q4_0", "w_down": "Q4_K"}
  assert isinstance(model.params["embed"], cpu.Quantized) and model.params["embed"].transposed
  assert all(isinstance(second[n], cpu.Quantized) for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
  # The same values as the dequantized model (llama.cpp's Q/K head permutation undone on the blocks' rows).
  for name in ("wq", "wk", "wv", "w_down"):
    np.testing.assert_array_equal(np.asarray(first[name].dequantize()), np.asarray(dense.params["layers"][0][name]))
  np.testing.assert_array_equal(np.asarray(ops.take(model.params["embed"], jnp.arange(VOCAB))),
                                np.asarray(dense.params["embed"]))
  with pytest.raises(ValueError, match="float32"):
    specjax.load(path, dtype="bfloat16", quantized=True)


def test_decoding_fuses_the_products_of_one_type_and_keeps_the_others_apart(quantized_gguf):
  from specjax.decoding import decode_params
  _, model, _ = quantized_gguf
  first, second = decode_params(model)["layers"]
  assert {"wq", "wk", "wv", "w_gate", "w_up"} <= set(first) and "wqkv" not in first and "w_gate_up" not in first
  assert isinstance(first["wo"], cpu.Packed)  # the F16 matrix, dequantized: float panels
  assert second["wqkv"].kind == "Q8_0" and second["wqkv"].matrix_shape == (D, D + 2 * KV_HEADS * D // HEADS)
  assert second["w_gate_up"].matrix_shape == (D, 2 * F)
  assert decode_params(model)["lm_head_packed"].data is model.params["embed"].data  # the table's own blocks


def test_a_quantized_model_computes_what_the_dequantized_one_does(quantized_gguf):
  _, model, dense = quantized_gguf
  ids = list(np.random.default_rng(0).integers(0, VOCAB, 40))
  got, want = np.asarray(specjax.logits(model, ids)), np.asarray(specjax.logits(dense, ids))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
  out = specjax.generate(model, [ids[:10]], max_new_tokens=8, stop_ids=())
  expected = specjax.generate(dense, [ids[:10]], max_new_tokens=8, stop_ids=())
  assert out.tokens == expected.tokens


def test_a_verification_gives_each_token_the_logits_a_decode_step_gives_it(quantized_gguf):
  """On the quantized weights as decoding reads them, T tokens verified in one forward get, bit for bit, the logits
  of T decode steps: greedy speculative decoding picks autoregressive decoding's tokens."""
  from specjax.decoding import decode_params
  from specjax.model import forward, init_cache
  _, model, _ = quantized_gguf
  params, config = decode_params(model), model.config
  step = jax.jit(lambda t, c, p: forward(params, t, c, p, config))
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(0, VOCAB, (2, 12)), jnp.int32)
  draft = jnp.asarray(rng.integers(0, VOCAB, (2, 6)), jnp.int32)
  filled = step(prompts, init_cache(config, 2, 32), jnp.zeros(2, jnp.int32)).cache
  starts = jnp.asarray([12, 9], jnp.int32)
  verified = np.asarray(step(draft, filled, starts).logits)
  cache, one_by_one = filled, []
  for t in range(6):
    out = step(draft[:, t:t + 1], cache, starts + t)
    cache = out.cache
    one_by_one.append(np.asarray(out.logits[:, 0]))
  np.testing.assert_array_equal(verified, np.stack(one_by_one, 1))


@pytest.mark.parametrize("drafter, options", [("layer_skip", {"exit_layer": 1, "token_map": np.arange(0, 300, 3)}),
                                              ("prompt_lookup", {})])
def test_greedy_speculative_decoding_on_a_quantized_target_equals_its_autoregressive_decoding(quantized_gguf, drafter,
                                                                                              options):
  """Layer skip's early exit reads the quantized head's columns (a truncated draft vocabulary) and reuses the
  prefix's cache; prompt lookup verifies chains of the target's own n-grams."""
  _, model, _ = quantized_gguf
  rng = np.random.default_rng(1)
  prompts = [list(rng.integers(0, VOCAB, 6)) * 3, list(rng.integers(0, VOCAB, 11))]
  expected = specjax.generate(model, prompts, max_new_tokens=12, stop_ids=())
  out = specjax.generate(model, prompts, max_new_tokens=12, stop_ids=(), gamma=3, adaptive=False,
                         drafter=specjax.make_drafter(drafter, model, **options))
  assert out.tokens == expected.tokens


# ------------------------------------------------------------------------------------- SmolLM2

def spec_bench_prompts(model, n: int) -> list[list[int]]:
  """The first Spec-Bench question of n categories, chat template."""
  from experiments import spec_bench
  questions = spec_bench.select(spec_bench.load_questions(), categories=["writing", "coding", "math_reasoning",
                                                                         "summarization"][:n], per_category=1)
  return [spec_bench.prompt_ids(q, model.tokenizer, chat=True) for q in questions]


@pytest.fixture(scope="module")
def smollm2_quantized():
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # every SmolLM2 matrix is Q8_0 or Q4_1: nothing to dequantize, nothing said
    return specjax.load("smollm2-135m", quantized=True)


@pytest.mark.slow
def test_smollm2_quantized_views_equal_ggufs_dequantization(smollm2_quantized, smollm2_path):
  """The embedding rows and the tied head the drafters read are gguf's values; so is every layer matrix."""
  from specjax.drafters import draft_head
  from specjax.loading import _gguf_reader
  params = smollm2_quantized.params
  assert params["embed"].kind == "Q8_0" and params["layers"][0]["w_gate"].kind == "Q4_1"
  embd = next(t for t in _gguf_reader(smollm2_path).tensors if t.name == "token_embd.weight")
  table = dequantized(np.asarray(embd.data), "Q8_0")
  ids = np.array([0, 1, 2, 100, 49151])
  np.testing.assert_array_equal(np.asarray(ops.take(params["embed"], jnp.asarray(ids))), table[ids])
  np.testing.assert_array_equal(np.asarray(draft_head.head_columns(params, smollm2_quantized.config, ids)),
                                table[ids].T)


@pytest.mark.slow
def test_smollm2_quantized_logits_and_greedy_decoding_match_the_dequantized_model(smollm2_quantized, smollm2):
  """Logits within 1e-3 of the float32 model (the same weights, dequantized at load) on Spec-Bench prompts, and a
  64-token greedy continuation token for token."""
  prompts = spec_bench_prompts(smollm2, 3)
  for prompt in prompts:
    got = np.asarray(specjax.logits(smollm2_quantized, prompt))
    want = np.asarray(specjax.logits(smollm2, prompt))
    assert np.abs(got - want).max() < 1e-3, np.abs(got - want).max()
  out = specjax.generate(smollm2_quantized, prompts, max_new_tokens=64)
  expected = specjax.generate(smollm2, prompts, max_new_tokens=64)
  assert out.tokens == expected.tokens


@pytest.mark.slow
def test_smollm2_quantized_speculative_decoding_equals_its_autoregressive_decoding(smollm2_quantized):
  prompts = spec_bench_prompts(smollm2_quantized, 3)  # 53-85 tokens (the fourth, 769, would pad every row's prefill)
  expected = specjax.generate(smollm2_quantized, prompts, max_new_tokens=32)
  out = specjax.generate(smollm2_quantized, prompts, max_new_tokens=32, gamma=4, adaptive=False,
                         drafter=specjax.make_drafter("prompt_lookup", smollm2_quantized))
  assert out.tokens == expected.tokens
