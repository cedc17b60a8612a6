// Decode kernels for XLA:CPU, called through the XLA FFI (see kernels.py). Float32 arithmetic; weights and
// caches float32 or bfloat16.
//
//   PackedMatmul: out[M, NB * P] = x[M, K] @ w, w packed as NB column panels [NB, K, P] (P = kPanel)
//
// A decode step or a verification over a few tokens multiplies M = batch x tokens rows by every weight
// matrix. The weights are read from memory once per call whatever M is, so the product should cost about what a
// matrix-vector product costs. XLA:CPU's general matrix product packs the weight matrix into a scratch layout on
// every call, which reads and writes it again (5 rows cost ~2-2.6x one row). Here the weights are packed once,
// when they are loaded for decoding (packing.pack): each panel of P output columns is one contiguous run of
// K x P values, so a call streams every weight exactly once, sequentially, prefetching ahead. Within a panel,
// groups of up to kGroup rows keep their P-column accumulators in registers over all of K; more rows take more
// passes over the panel, which then comes from L2 (a panel is K x P x 4 bytes: 72 KB for K = 576). The panels are
// split over XLA's intra-op thread pool. Every output element sums over k in the same order whatever M is, so a
// row's result does not depend on which other rows share the call.
//
//   DecodeAttention: causal grouped-query attention of a few new tokens per row over the KV cache
//
// XLA:CPU turns decode attention (per row and KV head, a handful of queries against the cache) into many tiny
// batched matrix products that each cost more in overhead than in arithmetic: at batch 8 on SmolLM2 they took
// half of a decode step. The kernel reads each row's cache once per KV head for up to kLanes of the head's queries
// at a time (one query per vector lane, so scores need no horizontal sums), and only the positions a query may
// see: a query sees a range of slots, starts..positions (a sliding window's last W slots, or the whole prefix),
// so a windowed query reads W slots whatever the cache's length. Each query's scores, softmax and weighted sum
// run in an order that does not depend on the other queries of the call, so a verification's logits for a token
// equal a decode step's for it.
//
// Written with GCC/Clang vector extensions (no intrinsics): compiled with -march=native on the machine that
// runs it, with vectors of the host's width (kLanes floats: 16 with AVX-512, else 8). A generic vector wider than
// the host's registers is emulated through the stack: 64-byte vectors on an AVX2 host (AMD EPYC Zen 3) ran the
// product at 4.3 GFLOP/s whatever the rows, a quarter of XLA's dot.

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif

typedef float vf __attribute__((vector_size(4 * kLanes)));

inline vf Load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void Store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

// acc + a * b. The file is compiled with multiply-adds unfused (kernels.py: _FLAGS), so that a result does not depend
// on how the compiler contracted each instantiation; this one is fused explicitly wherever the host has FMA.
inline vf Fma(vf a, vf b, vf acc) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, acc);
#elif defined(__FMA__)
  return _mm256_fmadd_ps(a, b, acc);
#else
  return acc + a * b;
#endif
}

// Weights are float32 or bfloat16 (the top 16 bits of a float32: widening is a shift).
typedef uint16_t vu16 __attribute__((vector_size(2 * kLanes)));
typedef uint32_t vu32 __attribute__((vector_size(4 * kLanes)));

inline vf LoadW(const float* p) { return Load(p); }

inline vf LoadW(const uint16_t* p) {
  vu16 h;
  std::memcpy(&h, p, sizeof(h));
  const vu32 wide = __builtin_convertvector(h, vu32) << 16;
  vf v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

// Must equal packing.PANEL.
constexpr int64_t kPanel = 32;
constexpr int kVecs = kPanel / kLanes;
// Software prefetch kPrefetchBytes ahead of the panel row being read, into L2 (locality 2: prefetcht1). Measured on
// the LM head of Gemma-3-270M (640 x 262,144) at 1 and 5 rows, Intel Xeon host: prefetching into L1 (prefetcht0)
// streamed bfloat16 panels at 20-21 GB/s against 25-27 GB/s into L2 (float32: 22-28 against 25-28); 4, 8 or 16 KB
// ahead within noise of each other; non-temporal prefetch (locality 0) halved float32.
constexpr int64_t kPrefetchBytes = 8192;
constexpr int kPrefetchLocality = 2;
// A block is MR rows x NV vectors of a panel's columns, its MR x NV accumulators, NV weight vectors and a broadcast
// row value held in the host's vector registers (32 with AVX-512, 16 with AVX2) over all of K. With AVX-512 a block
// is a whole panel (2 vectors) of up to 8 rows. With AVX2 a panel is 4 vectors: a whole panel takes 2 rows per
// block, or half a panel (2 vectors) takes 6; more rows pass over the panel, which then comes from L2.
constexpr int kWideRows = kLanes == 16 ? 8 : 2;    // rows of a block over the whole panel
constexpr int kNarrowVecs = kLanes == 16 ? kVecs : 2;
constexpr int kNarrowRows = kLanes == 16 ? 8 : 6;  // rows of a block over kNarrowVecs vectors

// MR rows x NV vectors of out (columns kLanes * NV from `wp`'s first), over all K; wp points into one panel,
// [K, kPanel] contiguous, so its rows are kPanel apart. Its multiply-add is fused (`Fma`): unfused, 5 rows ran at two
// thirds of the speed on an AVX2 host.
template <typename W, int MR, int NV>
void PanelBlock(const float* __restrict x, int64_t K, const W* __restrict wp, float* __restrict out, int64_t ldo) {
  vf acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NV; ++j) acc[m][j] = vf{};
  for (int64_t k = 0; k < K; ++k) {
    const W* row = wp + k * kPanel;
    constexpr int64_t ahead = kPrefetchBytes / sizeof(W);
    __builtin_prefetch(row + ahead, 0, kPrefetchLocality);
    if (sizeof(W) * kLanes * NV > 64) __builtin_prefetch(row + ahead + 64 / sizeof(W), 0, kPrefetchLocality);
    vf wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = LoadW(row + kLanes * j);
    for (int m = 0; m < MR; ++m) {
      const vf xv = vf{} + x[m * K + k];
      for (int j = 0; j < NV; ++j) acc[m][j] = Fma(xv, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NV; ++j) Store(out + m * ldo + kLanes * j, acc[m][j]);
}

// Calls f(std::integral_constant<int, V>) for the V among Vs that equals the runtime `value` (callers pass only
// values in the list): the kernels' row counts are compile-time constants.
template <int... Vs, typename F>
void WithConstant(int64_t value, F f) {
  (void)((value == Vs && (f(std::integral_constant<int, Vs>{}), true)) || ...);
}

// All rows of panels [b0, b1): rows in groups of at most kWideRows over whole panels, or, for more rows on an
// AVX2 host, of at most kNarrowRows over kNarrowVecs vectors at a time; groups as even as possible (16 rows:
// 8 + 8). Each output element sums over k in the same order whichever block computes it.
template <typename W>
void Panels(const float* x, int64_t M, int64_t K, const W* w, float* out, int64_t N, int64_t b0, int64_t b1) {
  const bool wide = M <= kWideRows || kNarrowVecs == kVecs;
  const int64_t most = wide ? kWideRows : kNarrowRows;
  const int64_t groups = (M + most - 1) / most;
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t v0 = 0; v0 < kVecs; v0 += wide ? kVecs : kNarrowVecs) {
      const W* wp = w + b * K * kPanel + kLanes * v0;
      int64_t m0 = 0;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t mr = (M - m0) / (groups - g);
        float* o = out + m0 * N + b * kPanel + kLanes * v0;
        const auto block = [&](auto vecs) {
          WithConstant<1, 2, 3, 4, 5, 6, 7, 8>(mr, [&](auto rows) {
            PanelBlock<W, decltype(rows)::value, decltype(vecs)::value>(x + m0 * K, K, wp, o, N);
          });
        };
        if (wide) {
          block(std::integral_constant<int, kVecs>{});
        } else {
          block(std::integral_constant<int, kNarrowVecs>{});
        }
        m0 += mr;
      }
    }
  }
}

// Runs body(begin, end) over [0, n) in up to kChunksPerThread chunks per pool thread. The calling thread and the
// pool tasks share the chunks: whoever comes first takes the next one, so the call never waits on a task that has
// not started (the pool may be busy, or the caller may be one of its threads), and a task that wakes late finds
// less left to do than an equal split would leave it. A task that starts after every chunk is taken returns
// without touching body.
constexpr int64_t kChunksPerThread = 8;

template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, const F& body) {
  const int64_t threads = pool.num_threads() > 1 ? pool.num_threads() : 1;
  const int64_t most = threads > 1 ? threads * kChunksPerThread : 1;
  const int chunks = static_cast<int>(most < n ? most : n);
  if (chunks <= 1) {
    if (n > 0) body(0, n);
    return;
  }
  struct Counters {
    std::atomic<int> next{0};
    std::atomic<int> done{0};
  };
  auto counters = std::make_shared<Counters>();
  auto work = [counters, chunks, n, body]() {
    int c;
    while ((c = counters->next.fetch_add(1)) < chunks) {
      body(n * c / chunks, n * (c + 1) / chunks);
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int t = 1; t < threads && t < chunks; ++t) pool.Schedule([work]() { work(); });
  work();
  while (counters->done.load(std::memory_order_acquire) < chunks) {
  }
}

template <ffi::DataType WT>
ffi::Error PackedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w,
                        ffi::ResultBuffer<ffi::F32> out) {
  using W = ffi::NativeType<WT>;
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (wd.size() != 3 || xd.size() < 1 || wd[2] != kPanel)
    return ffi::Error::InvalidArgument("specjax: w must be packed panels [NB, K, 32]");
  const int64_t K = xd.back(), NB = wd[0], N = NB * kPanel;
  if (wd[1] != K) return ffi::Error::InvalidArgument("specjax: contraction sizes differ");
  const int64_t M = K ? x.element_count() / K : 0;
  const float* xp = x.typed_data();
  const W* wp = w.typed_data();
  float* op = out->typed_data();
  if (M > 0 && NB > 0)
    ParallelFor(pool, NB, [&](int64_t b0, int64_t b1) { Panels(xp, M, K, wp, op, N, b0, b1); });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------
// Quantized weights. QuantizedMatmul<Q>: out[M, NB * P] = x[M, K] @ w, w a GGUF-quantized matrix repacked once when it
// is loaded (quantized.py, where the layout is drawn) as NB column panels of P = kPanel columns, each panel
// K / Q::kBlockK blocks of BlockBytes<Q>(): a header of per-column scales, then Q::kBlockK rows of Q::kRow bytes, row
// k holding the P columns' codes at k. A call streams the blocks once, in order, as PackedMatmul streams float
// panels, at 4.5-8.6 bits a weight instead of 32.
//
// Each weight is decoded to float32 as gguf's dequantization computes it (the scale products it forms are exact,
// and its one rounding, a product or a multiply-add, is the same), then multiplied into float32 accumulators in k
// order: a product equals a float32 product over the dequantized matrix up to summation order, and a row's result
// never depends on the other rows of the call. Activations stay float32 (llama.cpp rounds them to 8 bits).
//
// A type is a struct (Q8_0 ... Q6_K below) that says where its scales and codes are and how a code becomes an
// integer; one panel decoder (DecodePanel) feeds one product loop (QuantPanelBlock) for every type. Up to 16 rows
// decode each weight in registers as they stream it; more (a 65-node tree's verification) decode a panel into a
// float scratch panel first, which the float32 loop (Panels) then reads from L2 for every group of rows.
// DequantizeMatrix writes the whole float32 matrix, for XLA's product over a prefill's rows (quantized.py).

typedef int32_t vi __attribute__((vector_size(4 * kLanes)));
typedef uint8_t vu8 __attribute__((vector_size(kLanes)));
typedef int8_t vs8 __attribute__((vector_size(kLanes)));

// An IEEE half's float32 value, exactly (subnormals included), for hosts without F16C.
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu, bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: mantissa x 2^-24, normal in float32
    uint32_t e = 113;
    while (!(mantissa & 0x400u)) mantissa <<= 1, --e;
    bits = sign | (e << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// kLanes consecutive halves as float32 (exact: every half is a float32).
inline vf Halves(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  const __m256 wide = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float wide[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    uint16_t h;
    std::memcpy(&h, p + 2 * l, sizeof(h));
    wide[l] = HalfToFloat(h);
  }
#endif
  vf v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

// kLanes bytes widened to int32 lanes. Explicitly vpmovzxbd / vpmovsxbd: GCC 12 widens a generic byte vector lane by
// lane through general registers, which made a Q4_1 product 2.5x slower than the float32 one.
inline vi Bytes(const uint8_t* p) {
  vi out;
#if defined(__AVX512F__)
  const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&out, &wide, sizeof(out));
#elif defined(__AVX2__)
  const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&out, &wide, sizeof(out));
#else
  vu8 b;
  std::memcpy(&b, p, sizeof(b));
  out = __builtin_convertvector(b, vi);
#endif
  return out;
}

inline vi SignedBytes(const uint8_t* p) {
  vi out;
#if defined(__AVX512F__)
  const __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&out, &wide, sizeof(out));
#elif defined(__AVX2__)
  const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&out, &wide, sizeof(out));
#else
  vs8 b;
  std::memcpy(&b, p, sizeof(b));
  out = __builtin_convertvector(b, vi);
#endif
  return out;
}

// Vector v's columns (kLanes * v on) of a row of 16 bytes holding the panel's 32 4-bit codes: column c's code is the
// low half of byte c for c < 16, the high half of byte c - 16 otherwise, so each vector's codes are one load.
inline vi Nibbles(const uint8_t* row, int v) {
  const int c0 = kLanes * v;
  const vi wide = Bytes(row + (c0 & 15));
  return c0 < 16 ? (wide & 15) : (wide >> 4);
}

// The types. kBlockK: the k of one block (GGUF's block, or its super-block for K-quants); kSubK: the k one scale
// serves; kHeader: bytes of per-column scales at the block's start; kRow: bytes of one row of codes. Scales(block,
// s, v) gives vector v's scale (and offset, kOffset) for sub-block s; Codes(row, v) their integer codes. A weight is
// scale x code (+ offset). GGUF's formulas (ggml-quants.c, gguf-py's dequantize_blocks):
//   Q8_0  d x q, q int8                        Q4_0  d x (q - 8), q 4-bit     Q4_1  d x q + m, q 4-bit
//   Q4_K  (d x sc_s) x q - dmin x m_s, q 4-bit, sc and m 6-bit per 32 of 256
//   Q6_K  (d x sc_s) x (q - 32), q 6-bit, sc int8 per 16 of 256;     d, m, dmin halves.
// Products of a half and a 6- or 8-bit integer are exact in float32, so the expanded scales lose nothing. Q5_0
// (d x (q - 16)) is widened to Q8_0 blocks when it is loaded (int8 codes q - 16), and Q6_K's codes to int8: on an AVX2
// host (AMD EPYC Zen 3) decoding the 5th and 6th bits from bit planes took 2-3x the time of int8 codes, and the
// product is bound by decoding, not by reading memory.
struct Q8_0 {
  static constexpr int kBlockK = 32, kSubK = 32, kHeader = 2 * kPanel, kRow = kPanel;
  static constexpr bool kOffset = false;
  static void Scales(const uint8_t* block, int, int v, vf* scale, vf*) { *scale = Halves(block + 2 * kLanes * v); }
  static vi Codes(const uint8_t* row, int v) { return SignedBytes(row + kLanes * v); }
};

struct Q4_0 {
  static constexpr int kBlockK = 32, kSubK = 32, kHeader = 2 * kPanel, kRow = kPanel / 2;
  static constexpr bool kOffset = false;
  static void Scales(const uint8_t* block, int, int v, vf* scale, vf*) { *scale = Halves(block + 2 * kLanes * v); }
  static vi Codes(const uint8_t* row, int v) { return Nibbles(row, v) - 8; }
};

struct Q4_1 {
  static constexpr int kBlockK = 32, kSubK = 32, kHeader = 4 * kPanel, kRow = kPanel / 2;
  static constexpr bool kOffset = true;
  static void Scales(const uint8_t* block, int, int v, vf* scale, vf* offset) {
    *scale = Halves(block + 2 * kLanes * v);
    *offset = Halves(block + 2 * kPanel + 2 * kLanes * v);
  }
  static vi Codes(const uint8_t* row, int v) { return Nibbles(row, v); }
};

struct Q4_K {  // header: d [32], dmin [32] halves, sc [8][32], m [8][32] bytes
  static constexpr int kBlockK = 256, kSubK = 32, kHeader = 4 * kPanel + 16 * kPanel, kRow = kPanel / 2;
  static constexpr bool kOffset = true;
  static void Scales(const uint8_t* block, int s, int v, vf* scale, vf* offset) {
    const vf sc = __builtin_convertvector(Bytes(block + 4 * kPanel + s * kPanel + kLanes * v), vf);
    const vf m = __builtin_convertvector(Bytes(block + 12 * kPanel + s * kPanel + kLanes * v), vf);
    *scale = Halves(block + 2 * kLanes * v) * sc;
    *offset = -(Halves(block + 2 * kPanel + 2 * kLanes * v) * m);
  }
  static vi Codes(const uint8_t* row, int v) { return Nibbles(row, v); }
};

struct Q6_K {  // header: d [32] halves, sc [16][32] int8; a row: 32 int8 codes (GGUF's 6-bit q - 32, widened)
  static constexpr int kBlockK = 256, kSubK = 16, kHeader = 2 * kPanel + 16 * kPanel, kRow = kPanel;
  static constexpr bool kOffset = false;
  static void Scales(const uint8_t* block, int s, int v, vf* scale, vf*) {
    *scale = Halves(block + 2 * kLanes * v) * __builtin_convertvector(SignedBytes(block + 2 * kPanel + s * kPanel +
                                                                                  kLanes * v), vf);
  }
  static vi Codes(const uint8_t* row, int v) { return SignedBytes(row + kLanes * v); }
};

template <typename Q>
constexpr int64_t BlockBytes() { return Q::kHeader + static_cast<int64_t>(Q::kBlockK) * Q::kRow; }

template <typename Q>
inline vf Weight(const uint8_t* row, int v, vf scale, vf offset) {
  const vf code = __builtin_convertvector(Q::Codes(row, v), vf);
  if constexpr (Q::kOffset) {
    return Fma(scale, code, offset);  // d x q is exact: the one rounding is the sum's, as in d * q + m
  } else {
    return scale * code;
  }
}

inline vf Splat(const float* p) {  // a broadcast load (vf{} + x is an addition: x = -0.f becomes +0.f)
#if defined(__AVX512F__)
  const __m512 v = _mm512_set1_ps(*p);
#elif defined(__AVX__)
  const __m256 v = _mm256_broadcast_ss(p);
#else
  float v[kLanes];
  for (int l = 0; l < kLanes; ++l) v[l] = *p;
#endif
  vf out;
  std::memcpy(&out, &v, sizeof(out));
  return out;
}

// Vectors of a panel a block of rows decodes together. One row's four AVX2 vectors of weights, scales and offsets fit
// the 16 registers; two rows' accumulators with them spilled one to the stack, so a block of more rows decodes two
// vectors (v and v + 2: the low and high halves of the same 4-bit codes) and passes over the panel twice. With
// AVX-512 the whole panel.
constexpr int PassVecs(int rows) { return kLanes == 16 || rows == 1 ? kVecs : 2; }

// Calls row(k, weights) for every k of one panel's blocks, in order, with the decoded weights of NV of its vectors:
// v0, v0 + kVecs / NV, ... (NV = kVecs: all of them).
template <typename Q, int NV, typename F>
inline void DecodePanel(const uint8_t* __restrict panel, int64_t K, int v0, F row) {
  constexpr int64_t kSubBytes = static_cast<int64_t>(Q::kSubK) * Q::kRow;
  const uint8_t* block = panel;
  for (int64_t k0 = 0; k0 < K; k0 += Q::kBlockK, block += BlockBytes<Q>()) {
    for (int s = 0; s < Q::kBlockK / Q::kSubK; ++s) {
      vf scale[NV], offset[NV];
      for (int j = 0; j < NV; ++j) {
        offset[j] = vf{};
        Q::Scales(block, s, v0 + j * (kVecs / NV), &scale[j], &offset[j]);
      }
      const uint8_t* rows = block + Q::kHeader + s * kSubBytes;
      for (int64_t byte = 0; byte < kSubBytes; byte += 64)
        __builtin_prefetch(rows + kPrefetchBytes + byte, 0, kPrefetchLocality);
      for (int kk = 0; kk < Q::kSubK; ++kk) {
        vf w[NV];
        for (int j = 0; j < NV; ++j) w[j] = Weight<Q>(rows + kk * Q::kRow, v0 + j * (kVecs / NV), scale[j], offset[j]);
        row(k0 + s * Q::kSubK + kk, w);
      }
    }
  }
}

// MR rows x NV vectors of a panel (v0, v0 + kVecs / NV, ...) over all K, decoding each weight once for the MR rows
// (PanelBlock's loop); out points at the panel's first column.
template <typename Q, int MR, int NV>
void QuantPanelBlock(const float* __restrict x, int64_t K, const uint8_t* __restrict panel, int v0,
                     float* __restrict out, int64_t ldo) {
  vf acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NV; ++j) acc[m][j] = vf{};
  DecodePanel<Q, NV>(panel, K, v0, [&](int64_t k, const vf* w) {
    for (int m = 0; m < MR; ++m) {
      const vf xv = Splat(x + m * K + k);
      for (int j = 0; j < NV; ++j) acc[m][j] = Fma(xv, w[j], acc[m][j]);
    }
  });
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NV; ++j) Store(out + m * ldo + kLanes * (v0 + j * (kVecs / NV)), acc[m][j]);
}

// Up to kStreamedRows rows decode the weights in registers as they stream them, in blocks of at most kBlockRows rows
// (one pass over the panel per block and PassVecs); more rows decode a panel into a float scratch panel first, which
// Panels' float32 blocks then read. Measured on one AVX2 core (AMD EPYC Zen 3), 512 x 49,152 weights of each type:
// streaming took half the scratch path's time at 3 rows, 0.6-0.8x at 9, about the same at 17.
constexpr int64_t kStreamedRows = 16;
constexpr int64_t kBlockRows = kLanes == 16 ? 8 : 4;

// This thread's float panel [K, kPanel], kept between calls.
inline float* PanelScratch(int64_t floats) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < floats) buffer.resize(floats);
  return buffer.data();
}

template <typename Q>
void QuantPanels(const float* x, int64_t M, int64_t K, const uint8_t* w, float* out, int64_t N, int64_t b0,
                 int64_t b1) {
  const int64_t panel_bytes = K / Q::kBlockK * BlockBytes<Q>();
  if (M <= kStreamedRows) {
    const int64_t groups = (M + kBlockRows - 1) / kBlockRows;
    for (int64_t b = b0; b < b1; ++b) {
      int64_t m0 = 0;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t mr = (M - m0) / (groups - g);
        WithConstant<1, 2, 3, 4, 5, 6, 7, 8>(mr, [&](auto rows) {
          constexpr int kRows = decltype(rows)::value, kPass = PassVecs(kRows);
          for (int v0 = 0; v0 < kVecs / kPass; ++v0)
            QuantPanelBlock<Q, kRows, kPass>(x + m0 * K, K, w + b * panel_bytes, v0, out + m0 * N + b * kPanel, N);
        });
        m0 += mr;
      }
    }
    return;
  }
  float* scratch = PanelScratch(K * kPanel);
  for (int64_t b = b0; b < b1; ++b) {
    DecodePanel<Q, kVecs>(w + b * panel_bytes, K, 0, [&](int64_t k, const vf* wv) {
      for (int j = 0; j < kVecs; ++j) Store(scratch + k * kPanel + kLanes * j, wv[j]);
    });
    Panels(x, M, K, static_cast<const float*>(scratch), out + b * kPanel, N, 0, 1);
  }
}

template <typename Q>
ffi::Error QuantizedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                           ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (wd.size() != 3 || xd.size() < 1 || wd[2] != BlockBytes<Q>())
    return ffi::Error::InvalidArgument("specjax: w must be quantized panels [NB, K / block, block bytes]");
  const int64_t K = xd.back(), NB = wd[0], N = NB * kPanel;
  if (wd[1] * Q::kBlockK != K) return ffi::Error::InvalidArgument("specjax: contraction sizes differ");
  const int64_t M = K ? x.element_count() / K : 0;
  const float* xp = x.typed_data();
  const uint8_t* wp = w.typed_data();
  float* op = out->typed_data();
  if (M > 0 && NB > 0)
    ParallelFor(pool, NB, [&](int64_t b0, int64_t b1) { QuantPanels<Q>(xp, M, K, wp, op, N, b0, b1); });
  return ffi::Error::Success();
}

// DequantizeMatrix<Q>: out [K, NB * P], the float32 matrix of the panels w (the values QuantizedMatmul multiplies by),
// for products over many rows (a prefill), which XLA's matrix product then computes faster than Panels' blocks.
template <typename Q>
ffi::Error DequantizeMatrix(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> w, ffi::ResultBuffer<ffi::F32> out) {
  const auto wd = w.dimensions();
  const auto od = out->dimensions();
  if (wd.size() != 3 || wd[2] != BlockBytes<Q>() || od.size() != 2 || od[0] != wd[1] * Q::kBlockK ||
      od[1] != wd[0] * kPanel)
    return ffi::Error::InvalidArgument("specjax: dequantize takes panels [NB, K / block, block bytes] -> [K, NB * 32]");
  const int64_t K = od[0], N = od[1];
  const int64_t panel_bytes = wd[1] * BlockBytes<Q>();
  const uint8_t* wp = w.typed_data();
  float* op = out->typed_data();
  ParallelFor(pool, wd[0], [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      DecodePanel<Q, kVecs>(wp + b * panel_bytes, K, 0, [&](int64_t k, const vf* wv) {
        for (int j = 0; j < kVecs; ++j) Store(op + k * N + b * kPanel + kLanes * j, wv[j]);
      });
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------
// Attention. q [B, T, H, D], k/v cache [B, S, KV, D], positions and starts [B, T] (query t of row b sits at
// positions[b, t] and sees cache slots starts[b, t]..positions[b, t], none when starts > positions); out
// [B, T, H, D] and lse [B, T, H], the log of each query's softmax denominator (log sum over its slots of
// exp(score); -inf when it sees none), so that attention over more keys can be merged with it (Milakov &
// Gimelshein 2018's online softmax). Head h uses KV head h / (H / KV). No slot outside a query's range enters its
// result: scores of slots only other queries of a pass see are computed in its lane but masked (bitwise), and its
// values are read over its own range only.

constexpr int64_t kMaxHeadVecs = 16;  // head_dim <= 256
constexpr int64_t kPartSlots = 256;   // cache slots per part (AttentionImpl)

template <typename W>
struct Attention {
  const float* q;
  const W* k;
  const W* v;
  const int32_t* pos;
  const int32_t* start;
  float* out;
  float* lse;
  int64_t B, T, H, KV, S, D;
  float scale;
};

inline vf Select(vi mask, vf yes, vf no) {  // mask lanes are all ones or all zeros
  vi y, n;
  std::memcpy(&y, &yes, sizeof(y));
  std::memcpy(&n, &no, sizeof(n));
  const vi r = (y & mask) | (n & ~mask);
  vf out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
}

// exp(x) for x <= 0 (a softmax's x - max), lanes below -87 flushed to 2^-126; Cephes' expf polynomial, ~1 ulp.
inline vf Exp(vf x) {
  x = Select(x < -87.f, vf{} - 87.f, x);
  const vf round = vf{} + 12582912.f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const vf n = (x * 1.44269504088896341f + round) - round;
  const vf r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float ScalarW(const float* p) { return *p; }

inline float ScalarW(const uint16_t* p) {
  const uint32_t wide = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

constexpr int64_t kQueryLanes = kLanes;  // queries per pass: query l of a pass is lane l of every vector
constexpr int64_t kScoreRows = 8;      // cache positions whose scores accumulate together (independent chains)
// Queries whose value sums share a pass over the values: QN x 4 accumulators and 4 value vectors in registers.
constexpr int64_t kValueQueries = kLanes == 16 ? 6 : 2;

// Scores of up to kLanes queries (the lanes of qt, which holds them transposed: qt[d * kLanes + l] is query l's
// d-th value) against NP consecutive cache positions: out[j * kLanes + l] = sum over d, in order, of q_l[d] k_j[d].
template <typename W, int NP>
void ScoreRows(const float* __restrict qt, const W* __restrict krow, int64_t kv_stride, int64_t D, float scale,
               float* __restrict out) {
  vf acc[NP];
  for (int j = 0; j < NP; ++j) acc[j] = vf{};
  for (int64_t d = 0; d < D; ++d) {
    const vf qd = Load(qt + d * kQueryLanes);
    for (int j = 0; j < NP; ++j) acc[j] += qd * ScalarW(krow + j * kv_stride + d);
  }
  for (int j = 0; j < NP; ++j) Store(out + j * kQueryLanes, acc[j] * scale);
}

// o_q = sum over positions s, in order, of weight_q(s) v_s / sums_q for QN queries whose weights are lanes of
// `weights` ([position][kLanes]) and whose positions are [first_q, end_q), 4 vectors of dimensions at a time: a
// value row is read once for all of them and their accumulators are independent chains. Positions that all of the
// queries see go together, after each query alone over its own positions before them and before each query alone
// over its own after them: every query sums over exactly its positions, in order, as it would alone, and reads
// no value outside them.
template <typename W, int QN>
void ValueRows(const float* __restrict weights, const int32_t* first, const int32_t* end, const float* sums,
               const W* vbase, int64_t kv_stride, int64_t D, float* const* out) {
  const int64_t vecs = D / kLanes;
  int64_t common_first = 0, common_end = -1;  // over the queries that see a slot (-1: none yet)
  for (int q = 0; q < QN; ++q) {
    if (first[q] >= end[q]) continue;
    const bool none_yet = common_end < 0;
    common_first = none_yet || first[q] > common_first ? first[q] : common_first;
    common_end = none_yet || end[q] < common_end ? end[q] : common_end;
  }
  if (common_end < common_first) common_end = common_first;  // none in common: each query alone, before or after
  for (int64_t j0 = 0; j0 < vecs; j0 += 4) {
    const int64_t nv = vecs - j0 < 4 ? vecs - j0 : 4;
    vf acc[QN][4];
    for (int q = 0; q < QN; ++q)
      for (int j = 0; j < 4; ++j) acc[q][j] = vf{};
    auto alone = [&](int q, int64_t s_begin, int64_t s_end) {
      for (int64_t s = s_begin; s < s_end; ++s) {
        const W* vr = vbase + s * kv_stride + kLanes * j0;
        for (int j = 0; j < nv; ++j) acc[q][j] += weights[s * kQueryLanes + q] * LoadW(vr + kLanes * j);
      }
    };
    for (int q = 0; q < QN; ++q) alone(q, first[q], end[q] < common_first ? end[q] : common_first);
    for (int64_t s = common_first; s < common_end; ++s) {
      const W* vr = vbase + s * kv_stride + kLanes * j0;
      vf vv[4];
      for (int j = 0; j < 4; ++j) vv[j] = j < nv ? LoadW(vr + kLanes * j) : vf{};
      for (int q = 0; q < QN; ++q) {
        const float w = weights[s * kQueryLanes + q];
        for (int j = 0; j < 4; ++j) acc[q][j] += w * vv[j];
      }
    }
    for (int q = 0; q < QN; ++q) {
      alone(q, first[q] > common_end ? first[q] : common_end, end[q]);
      // A query that sees no slot gets zeros (its accumulators took the other queries' common values, weighed 0).
      const float inv = end[q] > first[q] ? 1.f / sums[q] : 0.f;
      for (int j = 0; j < nv; ++j) Store(out[q] + kLanes * (j0 + j), end[q] > first[q] ? acc[q][j] * inv : vf{});
    }
  }
}

// Floats of scratch one task needs: queries transposed, [D][kLanes], and their scores, [S][kLanes] for S slots.
inline int64_t ScratchFloats(int64_t S, int64_t D) { return (D + S) * kQueryLanes; }

// This thread's scratch, kept between calls; zeros when it grows, so every value in it is finite.
inline float* TaskScratch(int64_t floats) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < floats) buffer.assign(floats, 0.f);
  return buffer.data();
}

// One (row, KV head, chunk of tokens): all of its H / KV query heads for tokens [t_begin, t_end), kLanes queries
// at a time, one per vector lane. The keys any of them sees are read for all of them at once (ScoreRows), the
// softmax runs across the lanes, each over its own range, and the values are read once per kValueQueries queries
// (ValueRows), each query's over its own range.
template <typename W>
void AttendTask(const Attention<W>& a, int64_t b, int64_t kh, int64_t t_begin, int64_t t_end, int64_t slot_lo,
                int64_t slot_hi, float* out_base, float* lse_base, float* scratch) {
  const int64_t groups = a.H / a.KV;
  const int64_t kv_stride = a.KV * a.D;  // elements between consecutive positions of one head
  const W* kbase = a.k + (b * a.S * a.KV + kh) * a.D;
  const W* vbase = a.v + (b * a.S * a.KV + kh) * a.D;
  // Token t sees slots [first, end): starts..positions clipped to the cache and to this task's part of it
  // [slot_lo, slot_hi); empty (first = end) when it sees none there.
  auto range_of = [&](int64_t t, int32_t* first, int32_t* end) {
    int64_t hi = static_cast<int64_t>(a.pos[b * a.T + t]) + 1;
    int64_t lo = a.start[b * a.T + t];
    hi = hi < slot_hi ? hi : slot_hi;
    lo = lo > slot_lo ? lo : slot_lo;
    const int64_t e = hi > a.S ? a.S : (hi < 0 ? 0 : hi);
    const int64_t f = lo < 0 ? 0 : (lo > e ? e : lo);
    *first = static_cast<int32_t>(f), *end = static_cast<int32_t>(e);
  };
  // The task's keys and values come from memory (the weights streamed since evicted them): ask for all of them
  // at once rather than one cache line at a time as the loops reach them.
  int64_t task_first = a.S, task_end = 0;
  for (int64_t t = t_begin; t < t_end; ++t) {
    int32_t f, e;
    range_of(t, &f, &e);
    if (f < e) {
      task_first = f < task_first ? f : task_first;
      task_end = e > task_end ? e : task_end;
    }
  }
  for (int64_t s = task_first; s < task_end; ++s)
    for (int64_t byte = 0; byte < a.D * static_cast<int64_t>(sizeof(W)); byte += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(kbase + s * kv_stride) + byte);
      __builtin_prefetch(reinterpret_cast<const char*>(vbase + s * kv_stride) + byte);
    }
  float* qt = scratch;
  // [kPartSlots][kLanes]: slot s's scores at sc + s * kLanes, s in [slot_lo, slot_hi)
  float* sc = scratch + (a.D - slot_lo) * kQueryLanes;
  const int64_t queries = (t_end - t_begin) * groups;  // query i: token t_begin + i / groups, head i % groups
  for (int64_t i0 = 0; i0 < queries; i0 += kQueryLanes) {
    const int64_t nq = queries - i0 < kQueryLanes ? queries - i0 : kQueryLanes;
    int32_t first[kQueryLanes], end[kQueryLanes];
    float* out[kQueryLanes];
    int64_t query_index[kQueryLanes];
    int64_t lowest = a.S, most = 0;  // the slots any query of the pass sees: [lowest, most)
    for (int64_t l = 0; l < kQueryLanes; ++l) {
      if (l < nq) {
        const int64_t t = t_begin + (i0 + l) / groups, head = kh * groups + (i0 + l) % groups;
        const float* qv = a.q + ((b * a.T + t) * a.H + head) * a.D;
        for (int64_t d = 0; d < a.D; ++d) qt[d * kQueryLanes + l] = qv[d];
        range_of(t, &first[l], &end[l]);
        query_index[l] = (b * a.T + t) * a.H + head;
        out[l] = out_base + query_index[l] * a.D;
        if (first[l] < end[l]) {
          lowest = first[l] < lowest ? first[l] : lowest;
          most = end[l] > most ? end[l] : most;
        }
      } else {
        first[l] = end[l] = 0;  // an unused lane keeps an earlier query (or the scratch's zeros): its scores are masked
      }
    }
    for (int64_t s0 = lowest; s0 < most; s0 += kScoreRows) {
      const int64_t n = most - s0 < kScoreRows ? most - s0 : kScoreRows;
      WithConstant<1, 2, 3, 4, 5, 6, 7, 8>(n, [&](auto rows) {
        ScoreRows<W, decltype(rows)::value>(qt, kbase + s0 * kv_stride, kv_stride, a.D, a.scale, sc + s0 * kQueryLanes);
      });
    }
    // Softmax down each lane: positions a query does not see weigh 0 (a query that sees none gets zeros). A lane's
    // total adds exact zeros outside its range, so it equals the total over its range alone.
    vi lo, hi;
    std::memcpy(&lo, first, sizeof(lo));
    std::memcpy(&hi, end, sizeof(hi));
    vf best = vf{} - __builtin_inff();
    for (int64_t s = lowest; s < most; ++s) {
      const vi seen = (lo <= static_cast<int32_t>(s)) & (hi > static_cast<int32_t>(s));
      const vf x = Load(sc + s * kQueryLanes);
      best = Select(seen, Select(x > best, x, best), best);
    }
    best = Select(hi > lo, best, vf{});
    vf total = vf{};
    for (int64_t s = lowest; s < most; ++s) {
      const vi seen = (lo <= static_cast<int32_t>(s)) & (hi > static_cast<int32_t>(s));
      const vf e = Select(seen, Exp(Load(sc + s * kQueryLanes) - best), vf{});
      Store(sc + s * kQueryLanes, e);
      total += e;
    }
    float sums[kQueryLanes], bests[kQueryLanes];
    Store(sums, total);
    Store(bests, best);
    for (int64_t l = 0; l < nq; ++l)
      lse_base[query_index[l]] = end[l] > first[l] ? bests[l] + std::log(sums[l]) : -__builtin_inff();
    for (int64_t q0 = 0; q0 < nq; q0 += kValueQueries) {
      const int64_t n = nq - q0 < kValueQueries ? nq - q0 : kValueQueries;
      WithConstant<1, 2, 3, 4, 5, 6>(n, [&](auto count) {
        ValueRows<W, decltype(count)::value>(sc + q0, first + q0, end + q0, sums + q0, vbase, kv_stride, a.D,
                                             out + q0);
      });
    }
  }
}

template <ffi::DataType WT>
ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<WT> k, ffi::Buffer<WT> v,
                         ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> start, ffi::ResultBuffer<ffi::F32> out,
                         ffi::ResultBuffer<ffi::F32> lse) {
  using W = ffi::NativeType<WT>;
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || pos.dimensions().size() != 2 || start.dimensions().size() != 2)
    return ffi::Error::InvalidArgument(
        "specjax: attention takes q [B,T,H,D], caches [B,S,KV,D], positions and starts [B,T]");
  Attention<W> a;
  a.B = qd[0], a.T = qd[1], a.H = qd[2], a.D = qd[3], a.S = kd[1], a.KV = kd[2];
  const auto pd = pos.dimensions();
  const auto sd = start.dimensions();
  if (kd[0] != a.B || kd[3] != a.D || a.KV == 0 || a.H % a.KV != 0 || a.D % 16 != 0 || a.D > 16 * kMaxHeadVecs ||
      pd[0] != a.B || pd[1] != a.T || sd[0] != a.B || sd[1] != a.T)
    return ffi::Error::InvalidArgument("specjax: attention shapes do not match");
  a.q = q.typed_data(), a.k = k.typed_data(), a.v = v.typed_data(), a.pos = pos.typed_data();
  a.start = start.typed_data();
  a.out = out->typed_data(), a.lse = lse->typed_data();
  a.scale = 1.f / __builtin_sqrtf(static_cast<float>(a.D));
  // Tasks are (row, KV head, chunk of tokens, part of the cache). With fewer (row, KV head) pairs than 4 per thread
  // (SmolLM2 at batch 1: 3 KV heads on 2 cores), a verification's tokens are split over the threads too, or one
  // thread would take two heads' queries while the other took one (16 tokens: 54 us per layer on 2 cores). The
  // cache is cut into parts of kPartSlots slots at fixed slot numbers: each part's attention is computed apart
  // (out and lse of the part's slots) and the parts merged in order by their softmax denominators, so a single
  // (row, KV head) (Gemma 3's one KV head at batch 1) spreads over the threads, and a query's result depends only on
  // its own range, never on the call's other queries or the cache's length.
  const int64_t threads = pool.num_threads() > 1 ? pool.num_threads() : 1;
  const int64_t pairs = a.B * a.KV;
  const int64_t chunks = pairs < 4 * threads ? (a.T < threads ? a.T : threads) : 1;
  const int64_t parts = (a.S + kPartSlots - 1) / kPartSlots;
  const int64_t queries = a.B * a.T * a.H;
  std::vector<float> part_out(parts > 1 ? parts * queries * a.D : 0), part_lse(parts > 1 ? parts * queries : 0);
  ParallelFor(pool, pairs * chunks * parts, [&](int64_t t0, int64_t t1) {
    float* scratch = TaskScratch(ScratchFloats(kPartSlots, a.D));
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t part = task % parts, chunk = task / parts % chunks, pair = task / parts / chunks;
      float* out_base = parts > 1 ? part_out.data() + part * queries * a.D : a.out;
      float* lse_base = parts > 1 ? part_lse.data() + part * queries : a.lse;
      AttendTask(a, pair / a.KV, pair % a.KV, a.T * chunk / chunks, a.T * (chunk + 1) / chunks, part * kPartSlots,
                 (part + 1) * kPartSlots, out_base, lse_base, scratch);
    }
  });
  if (parts > 1) {
    // o = sum over parts p, in order, of exp(lse_p - L) o_p / Z, Z = sum of exp(lse_p - L), L the largest lse_p;
    // lse = L + log Z. A part the query does not see has lse_p = -inf and o_p = 0: weight 0.
    ParallelFor(pool, queries, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        float most = -__builtin_inff();
        for (int64_t p = 0; p < parts; ++p) most = part_lse[p * queries + i] > most ? part_lse[p * queries + i] : most;
        float* o = a.out + i * a.D;
        if (most == -__builtin_inff()) {
          std::memset(o, 0, a.D * sizeof(float));
          a.lse[i] = most;
          continue;
        }
        float total = 0.f;
        std::memset(o, 0, a.D * sizeof(float));
        for (int64_t p = 0; p < parts; ++p) {
          const float l = part_lse[p * queries + i];
          if (l == -__builtin_inff()) continue;
          const float w = std::exp(l - most);
          total += w;
          const float* op = part_out.data() + (p * queries + i) * a.D;
          for (int64_t d = 0; d < a.D; ++d) o[d] += w * op[d];
        }
        const float inv = 1.f / total;
        for (int64_t d = 0; d < a.D; ++d) o[d] *= inv;
        a.lse[i] = most + std::log(total);
      }
    });
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------
// Cache writes. cache [B, S, ...], update [B, T, ...], positions [B, T]: slot positions[b, t] of row b takes
// update[b, t] (a negative position counts from the end, as in jnp indexing; one outside [0, S) is dropped; of
// two writes to one slot, the later t wins). The result aliases the cache operand (kernels.py: cache_write), so a
// decode step moves the new tokens' bytes only. XLA's scatter into a bfloat16 cache widened the whole cache to
// float32 and back, then copied it, every layer and step: 1.8 ms of Gemma-3-270M's 26 ms bfloat16 step at 1,024
// tokens of context.
template <ffi::DataType WT>
ffi::Error CacheWrite(ffi::Buffer<WT> cache, ffi::Buffer<WT> update, ffi::Buffer<ffi::S32> pos,
                      ffi::ResultBuffer<WT> out) {
  using W = ffi::NativeType<WT>;
  const auto cd = cache.dimensions();
  const auto ud = update.dimensions();
  const auto pd = pos.dimensions();
  if (cd.size() < 2 || ud.size() != cd.size() || pd.size() != 2 || ud[0] != cd[0] || pd[0] != cd[0] ||
      pd[1] != ud[1])
    return ffi::Error::InvalidArgument("specjax: cache_write takes cache [B,S,...], update [B,T,...], positions [B,T]");
  int64_t E = 1;
  for (size_t i = 2; i < cd.size(); ++i) {
    if (ud[i] != cd[i]) return ffi::Error::InvalidArgument("specjax: cache_write's update and cache differ");
    E *= cd[i];
  }
  const int64_t B = cd[0], S = cd[1], T = ud[1];
  W* o = out->typed_data();
  if (o != cache.typed_data()) std::memcpy(o, cache.typed_data(), cache.size_bytes());
  const W* u = update.typed_data();
  const int32_t* p = pos.typed_data();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      int64_t slot = p[b * T + t];
      if (slot < 0) slot += S;
      if (slot >= 0 && slot < S) std::memcpy(o + (b * S + slot) * E, u + (b * T + t) * E, E * sizeof(W));
    }
  return ffi::Error::Success();
}

// The handlers' signatures: the intra-op thread pool, then the operands and the result.
template <ffi::DataType WT>
auto MatmulBinding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<WT>>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

template <ffi::DataType WT>
auto AttentionBinding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<WT>>()
      .template Arg<ffi::Buffer<WT>>().template Arg<ffi::Buffer<ffi::S32>>().template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::F32>>().template Ret<ffi::Buffer<ffi::F32>>();
}

template <ffi::DataType WT>
auto CacheWriteBinding() {
  return ffi::Ffi::Bind().Arg<ffi::Buffer<WT>>().template Arg<ffi::Buffer<WT>>()
      .template Arg<ffi::Buffer<ffi::S32>>().template Ret<ffi::Buffer<WT>>();
}

auto DequantizeBinding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::U8>>().Ret<ffi::Buffer<ffi::F32>>();
}

auto QuantizedBinding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::U8>>()
      .Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PackedMatmulF32, PackedMatmul<ffi::F32>, MatmulBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(PackedMatmulBF16, PackedMatmul<ffi::BF16>, MatmulBinding<ffi::BF16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttention, AttentionImpl<ffi::F32>, AttentionBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionBF16, AttentionImpl<ffi::BF16>, AttentionBinding<ffi::BF16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CacheWriteF32, CacheWrite<ffi::F32>, CacheWriteBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CacheWriteBF16, CacheWrite<ffi::BF16>, CacheWriteBinding<ffi::BF16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizedMatmulQ8_0, QuantizedMatmul<Q8_0>, QuantizedBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizedMatmulQ4_0, QuantizedMatmul<Q4_0>, QuantizedBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizedMatmulQ4_1, QuantizedMatmul<Q4_1>, QuantizedBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizedMatmulQ4_K, QuantizedMatmul<Q4_K>, QuantizedBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizedMatmulQ6_K, QuantizedMatmul<Q6_K>, QuantizedBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(DequantizeMatrixQ8_0, DequantizeMatrix<Q8_0>, DequantizeBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(DequantizeMatrixQ4_0, DequantizeMatrix<Q4_0>, DequantizeBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(DequantizeMatrixQ4_1, DequantizeMatrix<Q4_1>, DequantizeBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(DequantizeMatrixQ4_K, DequantizeMatrix<Q4_K>, DequantizeBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(DequantizeMatrixQ6_K, DequantizeMatrix<Q6_K>, DequantizeBinding());
