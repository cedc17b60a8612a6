// Decode kernels for XLA:CPU, called through the XLA FFI (see cpu_kernels.py). Float32 arithmetic; weights and
// caches float32 or bfloat16.
//
//   SmallMatmulKN: out[M, N] = x[M, K] @ w[K, N]    (the decoder's projections)
//   SmallMatmulNK: out[M, N] = x[M, K] @ w[N, K]^T  (a tied LM head: the embedding table, rows = tokens)
//
// A decode step or a verification over a few tokens multiplies M = batch x tokens rows by every weight
// matrix. The weights are read from memory once per call whatever M is, so the product should cost about what a
// matrix-vector product costs. XLA:CPU's general matrix product packs the weight matrix into a scratch layout on
// every call, which reads and writes it again: 5 rows cost ~2-2.6x one row. These kernels keep up to 8 rows'
// accumulators in registers or L1 (more rows, up to kMaxRows: one pass over the weight updating them all) and
// stream each weight once, prefetching ahead; the column blocks are split over XLA's intra-op thread pool. Every output element sums over k in the same order whatever M is, so a row's result
// does not depend on which other rows share the call.
//
//   DecodeAttention: causal grouped-query attention of a few new tokens per row over the KV cache
//
// XLA:CPU turns decode attention (per row and KV head, a handful of queries against the cache) into many tiny
// batched matrix products that each cost more in overhead than in arithmetic: at batch 8 on SmolLM2 they took
// half of a decode step. The kernel reads each row's cache once per KV head for all of the head's queries, and
// only the positions a query may see.
//
// Written with GCC/Clang vector extensions (no intrinsics): compiled with -march=native on the machine that
// runs it.

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));

inline v16 Load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void Store(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// Weights are float32 or bfloat16 (the top 16 bits of a float32: widening is a shift).
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline v16 LoadW(const float* p) { return Load(p); }

inline v16 LoadW(const uint16_t* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x16 wide = __builtin_convertvector(h, u32x16) << 16;
  v16 v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

#ifndef SPECJAX_PF
#define SPECJAX_PF 16
#endif
#ifndef SPECJAX_PANEL
#define SPECJAX_PANEL 128  // 16, 32, 64, 128, 192 or 256
#endif
constexpr int64_t kPanel = SPECJAX_PANEL;  // output columns per block (kn)
constexpr int64_t kPrefetch = SPECJAX_PF;  // rows of w ahead (kn) / vectors ahead (nk)
static_assert(kPanel == 16 || kPanel == 32 || kPanel == 64 || kPanel == 128 || kPanel == 192 || kPanel == 256,
              "SPECJAX_PANEL must be one of the widths Columns dispatches on: 16, 32, 64, 128, 192 or 256");

// kn: MR rows x kVecs * 16 columns of out, over all K; w points at the panel's first column, row stride ldw.
// Each row of w contributes a contiguous run of columns; the accumulators live in L1.
template <typename W, int MR, int kVecs>
void BlockKN(const float* __restrict x, int64_t K, const W* __restrict w, int64_t ldw, float* __restrict out,
             int64_t ldo) {
  alignas(64) v16 acc[MR][kVecs];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < kVecs; ++j) acc[m][j] = v16{};
  for (int64_t k = 0; k < K; ++k) {
    const W* row = w + k * ldw;
    const W* ahead = row + kPrefetch * ldw;
    for (int j = 0; j < kVecs; ++j) __builtin_prefetch(ahead + 16 * j);
    float xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = x[m * K + k];
    for (int j = 0; j < kVecs; ++j) {
      const v16 wv = LoadW(row + 16 * j);
      for (int m = 0; m < MR; ++m) acc[m][j] += xv[m] * wv;
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < kVecs; ++j) Store(out + m * ldo + 16 * j, acc[m][j]);
}

// kn for more than 8 rows: the same stream over w, every row's accumulators (L1) updated from each loaded vector,
// so w is read once whatever the number of rows (up to kMaxRows).
constexpr int64_t kMaxRows = 32;

template <typename W, int kVecs>
void BlockKNWide(const float* __restrict x, int64_t M, int64_t K, const W* __restrict w, int64_t ldw,
                 float* __restrict out, int64_t ldo) {
  alignas(64) v16 acc[kMaxRows][kVecs];
  for (int64_t m = 0; m < M; ++m)
    for (int j = 0; j < kVecs; ++j) acc[m][j] = v16{};
  for (int64_t k = 0; k < K; ++k) {
    const W* row = w + k * ldw;
    const W* ahead = row + kPrefetch * ldw;
    for (int j = 0; j < kVecs; ++j) __builtin_prefetch(ahead + 16 * j);
    v16 wv[kVecs];
    for (int j = 0; j < kVecs; ++j) wv[j] = LoadW(row + 16 * j);
    for (int64_t m = 0; m < M; ++m) {
      const float xv = x[m * K + k];
      for (int j = 0; j < kVecs; ++j) acc[m][j] += xv * wv[j];
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int j = 0; j < kVecs; ++j) Store(out + m * ldo + 16 * j, acc[m][j]);
}

// nk: MR rows x 4 columns of out; w points at 4 consecutive rows of the [N, K] matrix.
template <typename W, int MR>
void BlockNK(const float* __restrict x, int64_t K, const W* __restrict w, float* __restrict out, int64_t ldo) {
  v16 acc[4][MR];
  for (int i = 0; i < 4; ++i)
    for (int m = 0; m < MR; ++m) acc[i][m] = v16{};
  for (int64_t k = 0; k < K; k += 16) {
    v16 wv[4];
    for (int i = 0; i < 4; ++i) {
      __builtin_prefetch(w + i * K + k + kPrefetch * 16);
      wv[i] = LoadW(w + i * K + k);
    }
    for (int m = 0; m < MR; ++m) {
      const v16 xv = Load(x + m * K + k);
      for (int i = 0; i < 4; ++i) acc[i][m] += wv[i] * xv;
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int m = 0; m < MR; ++m) {
      float s = 0.f;
      for (int j = 0; j < 16; ++j) s += acc[i][m][j];
      out[m * ldo + i] = s;
    }
}

// Calls f(std::integral_constant<int, V>) for the V among Vs that equals the runtime `value` (callers pass only
// values in the list): the kernels' row counts and column widths are compile-time constants.
template <int... Vs, typename F>
void WithConstant(int64_t value, F f) {
  (void)((value == Vs && (f(std::integral_constant<int, Vs>{}), true)) || ...);
}

template <typename W>
struct Problem {
  const float* x;
  const W* w;
  float* out;
  int64_t M, K, N;
  bool nk;
  int64_t col_block;  // output columns per block
};

// Computes all rows for output column blocks [b0, b1).
template <typename W>
void Columns(const Problem<W>& p, int64_t b0, int64_t b1) {
  const int64_t rows_per_group = p.nk ? 4 : 8;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t col = b * p.col_block;
    if (!p.nk && p.M > 8 && p.M <= kMaxRows) {
      WithConstant<16, 12, 8, 4, 2, 1>(p.col_block / 16, [&](auto vecs) {
        BlockKNWide<W, decltype(vecs)::value>(p.x, p.M, p.K, p.w + col, p.N, p.out + col, p.N);
      });
      continue;
    }
    for (int64_t m0 = 0; m0 < p.M; m0 += rows_per_group) {
      const int64_t mr = p.M - m0 < rows_per_group ? p.M - m0 : rows_per_group;
      const float* xr = p.x + m0 * p.K;
      float* o = p.out + m0 * p.N + col;
      WithConstant<1, 2, 3, 4, 5, 6, 7, 8>(mr, [&](auto rows) {
        constexpr int MR = decltype(rows)::value;
        if (p.nk) {
          BlockNK<W, MR>(xr, p.K, p.w + col * p.K, o, p.N);
        } else {
          WithConstant<16, 12, 8, 4, 2, 1>(p.col_block / 16, [&](auto vecs) {
            BlockKN<W, MR, decltype(vecs)::value>(xr, p.K, p.w + col, p.N, o, p.N);
          });
        }
      });
    }
  }
}

// Runs body(begin, end) over [0, n) in up to one chunk per pool thread. The calling thread and the pool tasks share
// the chunks: whoever comes first takes the next one, so the call never waits on a task that has not started (the
// pool may be busy, or the caller may be one of its threads). A task that starts after every chunk is taken returns
// without touching body.
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, const F& body) {
  const int64_t threads = pool.num_threads() > 1 ? pool.num_threads() : 1;
  const int chunks = static_cast<int>(threads < n ? threads : n);
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
  for (int t = 1; t < chunks; ++t) pool.Schedule([work]() { work(); });
  work();
  while (counters->done.load(std::memory_order_acquire) < chunks) {
  }
}

template <ffi::DataType WT>
ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w, ffi::ResultBuffer<ffi::F32> out,
                  bool nk) {
  using W = ffi::NativeType<WT>;
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (wd.size() != 2 || xd.size() < 1) return ffi::Error::InvalidArgument("cpu_kernels: w must be 2-D");
  Problem<W> p;
  p.K = xd.back();
  p.M = p.K ? x.element_count() / p.K : 0;
  p.nk = nk;
  p.N = nk ? wd[0] : wd[1];
  const int64_t wk = nk ? wd[1] : wd[0];
  p.col_block = 4;
  if (!nk) {
    p.col_block = 0;
    for (int64_t width : {kPanel, int64_t{192}, int64_t{128}, int64_t{64}, int64_t{32}, int64_t{16}})
      if (width <= kPanel && p.N % width == 0) { p.col_block = width; break; }
    if (p.col_block == 0) return ffi::Error::InvalidArgument("cpu_kernels: N must be a multiple of 16");
  }
  if (wk != p.K) return ffi::Error::InvalidArgument("cpu_kernels: contraction sizes differ");
  if (p.N % p.col_block != 0 || (nk && p.K % 16 != 0))
    return ffi::Error::InvalidArgument("cpu_kernels: unsupported shape");
  p.x = x.typed_data();
  p.w = w.typed_data();
  p.out = out->typed_data();
  if (p.M > 0) ParallelFor(pool, p.N / p.col_block, [&p](int64_t b0, int64_t b1) { Columns(p, b0, b1); });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------
// Attention. q [B, T, H, D], k/v cache [B, S, KV, D], positions [B, T] (query t of row b sits at positions[b, t]
// and sees cache slots 0..positions[b, t]); out [B, T, H, D]. Head h uses KV head h / (H / KV).

constexpr int64_t kMaxHeadVecs = 16;  // head_dim <= 256

template <typename W>
struct Attention {
  const float* q;
  const W* k;
  const W* v;
  const int32_t* pos;
  float* out;
  int64_t B, T, H, KV, S, D;
  float scale;
};

// One (row, KV head): all of its H / KV query heads for all T tokens.
template <typename W>
void AttendTask(const Attention<W>& a, int64_t task, float* scores) {
  const int64_t b = task / a.KV, kh = task % a.KV, groups = a.H / a.KV, vecs = a.D / 16;
  const int64_t kv_stride = a.KV * a.D;  // floats between consecutive positions of one head
  const W* kbase = a.k + (b * a.S * a.KV + kh) * a.D;
  const W* vbase = a.v + (b * a.S * a.KV + kh) * a.D;
  for (int64_t t = 0; t < a.T; ++t) {
    int64_t visible = static_cast<int64_t>(a.pos[b * a.T + t]) + 1;
    if (visible > a.S) visible = a.S;
    if (visible < 0) visible = 0;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t head = kh * groups + g;
      const float* qv = a.q + ((b * a.T + t) * a.H + head) * a.D;
      float* o = a.out + ((b * a.T + t) * a.H + head) * a.D;
      float best = -__builtin_inff();
      for (int64_t s = 0; s < visible; ++s) {
        const W* kr = kbase + s * kv_stride;
        v16 acc = v16{};
        for (int64_t j = 0; j < vecs; ++j) acc += Load(qv + 16 * j) * LoadW(kr + 16 * j);
        float dot = 0.f;
        for (int j = 0; j < 16; ++j) dot += acc[j];
        scores[s] = dot * a.scale;
        if (scores[s] > best) best = scores[s];
      }
      float total = 0.f;
      for (int64_t s = 0; s < visible; ++s) {
        scores[s] = __builtin_expf(scores[s] - best);
        total += scores[s];
      }
      const float inv = visible ? 1.f / total : 0.f;
      v16 acc[kMaxHeadVecs];
      for (int64_t j = 0; j < vecs; ++j) acc[j] = v16{};
      for (int64_t s = 0; s < visible; ++s) {
        const W* vr = vbase + s * kv_stride;
        for (int64_t j = 0; j < vecs; ++j) acc[j] += scores[s] * LoadW(vr + 16 * j);
      }
      for (int64_t j = 0; j < vecs; ++j) Store(o + 16 * j, acc[j] * inv);
    }
  }
}

template <ffi::DataType WT>
ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<WT> k, ffi::Buffer<WT> v,
                         ffi::Buffer<ffi::S32> pos, ffi::ResultBuffer<ffi::F32> out) {
  using W = ffi::NativeType<WT>;
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || pos.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("cpu_kernels: attention takes q [B,T,H,D], caches [B,S,KV,D], positions [B,T]");
  Attention<W> a;
  a.B = qd[0], a.T = qd[1], a.H = qd[2], a.D = qd[3], a.S = kd[1], a.KV = kd[2];
  if (kd[0] != a.B || kd[3] != a.D || a.KV == 0 || a.H % a.KV != 0 || a.D % 16 != 0 || a.D > 16 * kMaxHeadVecs)
    return ffi::Error::InvalidArgument("cpu_kernels: attention shapes do not match");
  a.q = q.typed_data(), a.k = k.typed_data(), a.v = v.typed_data(), a.pos = pos.typed_data();
  a.out = out->typed_data();
  a.scale = 1.f / __builtin_sqrtf(static_cast<float>(a.D));
  ParallelFor(pool, a.B * a.KV, [&a](int64_t t0, int64_t t1) {
    std::unique_ptr<float[]> scores(new float[a.S > 0 ? a.S : 1]);
    for (int64_t task = t0; task < t1; ++task) AttendTask(a, task, scores.get());
  });
  return ffi::Error::Success();
}

template <ffi::DataType WT, bool kNK>
ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w,
                      ffi::ResultBuffer<ffi::F32> out) {
  return Matmul<WT>(pool, x, w, out, kNK);
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
      .template Arg<ffi::Buffer<WT>>().template Arg<ffi::Buffer<ffi::S32>>().template Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SmallMatmulKN, (MatmulImpl<ffi::F32, false>), MatmulBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SmallMatmulNK, (MatmulImpl<ffi::F32, true>), MatmulBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SmallMatmulKNBF16, (MatmulImpl<ffi::BF16, false>), MatmulBinding<ffi::BF16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SmallMatmulNKBF16, (MatmulImpl<ffi::BF16, true>), MatmulBinding<ffi::BF16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttention, AttentionImpl<ffi::F32>, AttentionBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionBF16, AttentionImpl<ffi::BF16>, AttentionBinding<ffi::BF16>());
