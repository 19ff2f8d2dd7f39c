// LazyTrain host optimizer kernels (built on first use by lazytrain/optim/kernels/__init__.py).
//
// * lt_adam8bit: one fused pass per block of `bs` elements: dequantize both Adam moments (uint8 codes
//   into a 256-entry map times the block's fp32 absmax), apply the Adam(W) update with the clip
//   coefficient, write the fp32 master weight and (optionally) its bf16/fp16 compute copy, then
//   requantize the block's moments with a new absmax. The moments never leave the L1-resident block
//   buffer in fp32.
// * lt_adam32: the same update with fp32 moments (small and sensitive tensors).
//   Both can zero the gradient as they go (zero_g): each block's gradient is cleared right after the block
//   read it, while it is in cache, instead of in a separate pass over the buffer after the step.
// * lt_quantize_blockwise / lt_dequantize_blockwise: the storage format on its own.
// * lt_add_square_sum: the gradient sinks' add of a compute-dtype gradient into its fp32 buffer and the
//   buffer's sum of squares, in one pass (lazytrain/engine/host_accumulate.py); into a buffer the caller
//   knows is zero (from_zero) it writes 0 + g without reading the buffer.
//
// The encoder is exact nearest-code: a table indexed by sign, exponent and the leading 8 mantissa bits
// of x gives the code at the bucket start and the low-mantissa threshold at which it steps by one (see
// lazytrain/optim/quantization.py, which builds the table). The AVX2 path and the scalar path compute
// the same operations in the same order (compiled with -ffp-contract=off), so they agree bit for bit.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#define LT_AVX2 1
#else
#define LT_AVX2 0
#endif

namespace {

constexpr int kShift = 15;        // 23 - mantissa bits in the table index
constexpr int kLowMask = 0x7FFF;  // low mantissa bits compared against the threshold
constexpr int64_t kMaxBlock = 16384;

struct Hyper {  // mirrored by ctypes.Structure in __init__.py
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float eps, weight_decay, decay, step_size, inv_bc2_sqrt, clip;
  int32_t adamw, pad;
};

struct Table {  // see EncoderTable in quantization.py
  const int32_t* lut;
  int32_t base, kmax, half;
};

int g_force_scalar = 0;

enum { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = 3 };

inline float bits_to_f32(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline uint32_t f32_to_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

inline float half_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0x1F) return bits_to_f32(sign | 0x7F800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return bits_to_f32(sign);
    float f = (float)man * 5.9604644775390625e-08f;  // 2^-24
    return sign ? -f : f;
  }
  return bits_to_f32(sign | ((exp + 112) << 23) | (man << 13));
}

inline uint16_t f32_to_half(float f) {  // round to nearest even, like torch / F16C
  uint32_t x = f32_to_bits(f), sign = (x >> 16) & 0x8000;
  uint32_t ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) return (uint16_t)(sign | 0x7C00 | (ax > 0x7F800000u ? 0x200 : 0));
  if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00);  // overflow after rounding
  if (ax < 0x38800000u) {  // subnormal half or zero
    float r = bits_to_f32(ax) + 0.5f;  // 0.5 = 2^-1: aligns the half subnormal ulp (2^-24) to float ulp
    return (uint16_t)(sign | (f32_to_bits(r) - 0x3F000000u));
  }
  uint32_t mant_odd = (ax >> 13) & 1;
  ax += 0xC8000FFFu + mant_odd;  // rebias exponent (-112 << 23) and round
  return (uint16_t)(sign | (ax >> 13));
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t b = f32_to_bits(f);
  if (std::isnan(f)) return 0x7FC0;
  return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

template <int GT>
inline float load_g(const void* g, int64_t i) {
  if (GT == kF32) return static_cast<const float*>(g)[i];
  uint16_t h = static_cast<const uint16_t*>(g)[i];
  if (GT == kBF16) return bits_to_f32((uint32_t)h << 16);
  return half_to_f32(h);
}

template <int CT>
inline void store_copy(void* c, int64_t i, float x) {
  if (CT == kBF16) static_cast<uint16_t*>(c)[i] = f32_to_bf16(x);
  else if (CT == kF16) static_cast<uint16_t*>(c)[i] = f32_to_half(x);
}

template <bool ADAMW>
inline void adam_scalar(const Hyper& h, float& p, float g, float& m, float& v) {
  g = g * h.clip;
  if (!ADAMW) g = g + p * h.weight_decay;
  m = m * h.beta1 + g * h.one_minus_beta1;
  v = v * h.beta2 + (g * g) * h.one_minus_beta2;
  if (ADAMW) p = p * h.decay;
  float denom = std::sqrt(v) * h.inv_bc2_sqrt + h.eps;
  p = p - (m / denom) * h.step_size;
}

// SIGNED: entries for negative x start at t.half; unsigned tables encode |x| (their inputs are >= 0).
template <bool SIGNED>
inline uint8_t encode_scalar(float x, const Table& t) {
  const uint32_t bits = f32_to_bits(x);
  int32_t k = (int32_t)((bits >> kShift) & 0xFFFF) - t.base;
  k = k < 0 ? 0 : (k > t.kmax ? t.kmax : k);
  if (SIGNED && (bits >> 31)) k += t.half;
  const uint32_t e = (uint32_t)t.lut[k];
  return (uint8_t)(((bits & kLowMask) > (e >> 16)) ? (e >> 8) : e);
}

#if LT_AVX2
template <int GT>
inline __m256 load_g8(const void* g, int64_t i) {
  if (GT == kF32) return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
  if (GT == kBF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

template <int CT>
inline void store_copy8(void* c, int64_t i, __m256 x) {
  if (CT == kNone) return;
  __m128i out;
  if (CT == kBF16) {
    __m256i b = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    __m256i pk = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    out = _mm256_castsi256_si128(pk);
  } else {
    out = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(c) + i), out);
}

// 8 codes -> values * absmax. Scalar loads: on the CPUs measured (AMD Zen 3) eight scalar table loads are
// faster than one vpgatherdd, and this lookup sits on the critical path of the update.
inline __m256 dequant8(const uint8_t* c, const float* qmap, __m256 absmax) {
  uint64_t w;
  std::memcpy(&w, c, 8);
  const __m128 lo = _mm_setr_ps(qmap[w & 0xFF], qmap[(w >> 8) & 0xFF], qmap[(w >> 16) & 0xFF], qmap[(w >> 24) & 0xFF]);
  const __m128 hi = _mm_setr_ps(qmap[(w >> 32) & 0xFF], qmap[(w >> 40) & 0xFF], qmap[(w >> 48) & 0xFF], qmap[w >> 56]);
  return _mm256_mul_ps(_mm256_set_m128(hi, lo), absmax);
}

template <bool ADAMW>
inline void adam8(const Hyper& h, __m256& p, __m256 g, __m256& m, __m256& v) {
  g = _mm256_mul_ps(g, _mm256_set1_ps(h.clip));
  if (!ADAMW) g = _mm256_add_ps(g, _mm256_mul_ps(p, _mm256_set1_ps(h.weight_decay)));
  m = _mm256_add_ps(_mm256_mul_ps(m, _mm256_set1_ps(h.beta1)), _mm256_mul_ps(g, _mm256_set1_ps(h.one_minus_beta1)));
  v = _mm256_add_ps(_mm256_mul_ps(v, _mm256_set1_ps(h.beta2)),
                    _mm256_mul_ps(_mm256_mul_ps(g, g), _mm256_set1_ps(h.one_minus_beta2)));
  if (ADAMW) p = _mm256_mul_ps(p, _mm256_set1_ps(h.decay));
  __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v), _mm256_set1_ps(h.inv_bc2_sqrt)), _mm256_set1_ps(h.eps));
  p = _mm256_sub_ps(p, _mm256_mul_ps(_mm256_div_ps(m, denom), _mm256_set1_ps(h.step_size)));
}

template <bool SIGNED>
inline __m256i encode8(__m256 x, const Table& t) {
  const __m256i bits = _mm256_castps_si256(x);
  // 16-bit lanes: low = exponent and 8 mantissa bits, high = sign; saturating subtract clamps at 0
  __m256i k = _mm256_subs_epu16(_mm256_srli_epi32(bits, kShift), _mm256_set1_epi32(t.base));
  __m256i idx;
  if (SIGNED) {
    k = _mm256_min_epu16(k, _mm256_set1_epi32(t.kmax | (1 << 16)));
    idx = _mm256_madd_epi16(k, _mm256_set1_epi32(1 | (t.half << 16)));  // k + sign * half
  } else {
    idx = _mm256_min_epu16(k, _mm256_set1_epi32(t.kmax));  // also drops the sign
  }
  const __m256i e = _mm256_i32gather_epi32(t.lut, idx, 4);
  const __m256i up = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(kLowMask)), _mm256_srli_epi32(e, 16));
  return _mm256_and_si256(_mm256_blendv_epi8(e, _mm256_srli_epi32(e, 8), up), _mm256_set1_epi32(0xFF));
}

// 32 floats (times scale) -> 32 codes
template <bool SIGNED>
inline void encode32(const float* x, __m256 scale, const Table& t, uint8_t* out) {
  __m256i c0 = encode8<SIGNED>(_mm256_mul_ps(_mm256_loadu_ps(x), scale), t);
  __m256i c1 = encode8<SIGNED>(_mm256_mul_ps(_mm256_loadu_ps(x + 8), scale), t);
  __m256i c2 = encode8<SIGNED>(_mm256_mul_ps(_mm256_loadu_ps(x + 16), scale), t);
  __m256i c3 = encode8<SIGNED>(_mm256_mul_ps(_mm256_loadu_ps(x + 24), scale), t);
  __m256i p01 = _mm256_packus_epi32(c0, c1);
  __m256i p23 = _mm256_packus_epi32(c2, c3);
  __m256i b = _mm256_packus_epi16(p01, p23);
  b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), b);
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
#endif

// Encode len values of buf (times scale) into out.
template <bool SIGNED>
inline void encode_block(const float* buf, int64_t len, float scale, const Table& t, uint8_t* out) {
  int64_t j = 0;
#if LT_AVX2
  if (!g_force_scalar) {
    __m256 vs = _mm256_set1_ps(scale);
    for (; j + 32 <= len; j += 32) encode32<SIGNED>(buf + j, vs, t, out + j);
  }
#endif
  for (; j < len; ++j) out[j] = encode_scalar<SIGNED>(buf[j] * scale, t);
}

inline float inv_absmax(float amax) { return amax > 0.0f ? 1.0f / amax : 0.0f; }

// The largest moment kept: 2^126, so that 1 / absmax stays a normal float (1 / FLT_MAX is subnormal, and
// flushed to 0 where denormals are flushed: every code of the block would then read 0).
constexpr float kMomentMax = 0x1p126f;

inline float absmax_of(const float* x, int64_t len) {
  float mx = 0.0f;
  int64_t j = 0;
#if LT_AVX2
  if (!g_force_scalar) {
    __m256 vm = _mm256_setzero_ps();
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (; j + 8 <= len; j += 8) vm = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + j), absmask), vm);
    mx = hmax8(vm);
  }
#endif
  for (; j < len; ++j) mx = std::max(mx, std::fabs(x[j]));
  return mx;
}

// Clears elements [s, s + len) of the gradient (fp32, bf16 or fp16): every bit pattern 0 is +0.
template <int GT>
inline void zero_g(const void* g, int64_t s, int64_t len) {
  constexpr int64_t size = GT == kF32 ? 4 : 2;
  std::memset(static_cast<char*>(const_cast<void*>(g)) + s * size, 0, static_cast<size_t>(len * size));
}

template <int GT, int CT, bool ADAMW>
void adam8bit_impl(const Hyper& h, float* p, const void* g, uint8_t* c1, uint8_t* c2, float* amax1,
                   float* amax2, const float* q1, const float* q2, Table t1, Table t2, void* copy, int64_t n,
                   int64_t bs, bool clear_g, int nthreads) {
  const int64_t nb = (n + bs - 1) / bs;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && nb > 1)
  {
    alignas(64) float mbuf[kMaxBlock];
    alignas(64) float vbuf[kMaxBlock];
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t s = b * bs, len = std::min(bs, n - s);
      const float a1 = amax1[b], a2 = amax2[b];
      float mx1 = 0.0f, mx2 = 0.0f;
      int64_t j = 0;
#if LT_AVX2
      if (!g_force_scalar) {
        const __m256 va1 = _mm256_set1_ps(a1), va2 = _mm256_set1_ps(a2);
        const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        __m256 vm1 = _mm256_setzero_ps(), vm2 = _mm256_setzero_ps();
        const __m256 vfmax = _mm256_set1_ps(kMomentMax), vfmin = _mm256_set1_ps(-kMomentMax);
        for (; j + 8 <= len; j += 8) {
          const int64_t i = s + j;
          __m256 m = dequant8(c1 + i, q1, va1);
          __m256 v = dequant8(c2 + i, q2, va2);
          __m256 pp = _mm256_loadu_ps(p + i);
          adam8<ADAMW>(h, pp, load_g8<GT>(g, i), m, v);
          m = _mm256_min_ps(vfmax, _mm256_max_ps(vfmin, m));   // finite moments (a NaN stays NaN)
          v = _mm256_min_ps(vfmax, v);
          _mm256_storeu_ps(p + i, pp);
          store_copy8<CT>(copy, i, pp);
          _mm256_store_ps(mbuf + j, m);
          _mm256_store_ps(vbuf + j, v);
          vm1 = _mm256_max_ps(_mm256_and_ps(m, absmask), vm1);   // a NaN lane yields vm1: NaN is not a max
          vm2 = _mm256_max_ps(_mm256_and_ps(v, absmask), vm2);
        }
        mx1 = hmax8(vm1);
        mx2 = hmax8(vm2);
      }
#endif
      for (; j < len; ++j) {
        const int64_t i = s + j;
        float m = q1[c1[i]] * a1, v = q2[c2[i]] * a2, pp = p[i];
        adam_scalar<ADAMW>(h, pp, load_g<GT>(g, i), m, v);
        m = std::min(std::max(m, -kMomentMax), kMomentMax);   // finite moments (a NaN stays NaN)
        v = std::min(v, kMomentMax);
        p[i] = pp;
        store_copy<CT>(copy, i, pp);
        mbuf[j] = m;
        vbuf[j] = v;
        mx1 = std::max(mx1, std::fabs(m));
        mx2 = std::max(mx2, std::fabs(v));
      }
      amax1[b] = mx1;
      amax2[b] = mx2;
      if (clear_g) zero_g<GT>(g, s, len);
      encode_block<true>(mbuf, len, inv_absmax(mx1), t1, c1 + s);
      encode_block<false>(vbuf, len, inv_absmax(mx2), t2, c2 + s);
    }
  }
}

template <int GT, int CT, bool ADAMW>
void adam32_impl(const Hyper& h, float* p, const void* g, float* m, float* v, void* copy, int64_t n, bool clear_g,
                 int nthreads) {
  constexpr int64_t chunk = 8192;
  const int64_t nc = (n + chunk - 1) / chunk;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && nc > 1)
  for (int64_t c = 0; c < nc; ++c) {
    const int64_t s = c * chunk, e = std::min(n, s + chunk);
    int64_t i = s;
#if LT_AVX2
    if (!g_force_scalar) {
      for (; i + 8 <= e; i += 8) {
        __m256 mm = _mm256_loadu_ps(m + i), vv = _mm256_loadu_ps(v + i), pp = _mm256_loadu_ps(p + i);
        adam8<ADAMW>(h, pp, load_g8<GT>(g, i), mm, vv);
        _mm256_storeu_ps(p + i, pp);
        _mm256_storeu_ps(m + i, mm);
        _mm256_storeu_ps(v + i, vv);
        store_copy8<CT>(copy, i, pp);
      }
    }
#endif
    for (; i < e; ++i) {
      float pp = p[i], mm = m[i], vv = v[i];
      adam_scalar<ADAMW>(h, pp, load_g<GT>(g, i), mm, vv);
      p[i] = pp;
      m[i] = mm;
      v[i] = vv;
      store_copy<CT>(copy, i, pp);
    }
    if (clear_g) zero_g<GT>(g, s, e - s);
  }
}

// dst += g (fp32, bf16 or fp16, widened exactly: the IEEE sums torch's add gives), and, with want_sum, the
// sum of squares of dst afterwards. A row of `row` elements is one thread's: element j's square (rounded:
// -ffp-contract=off) goes into running fp32 sum j % 16, and the 16 sums are added in order; the rows' sums
// are added in fp64 in row order. So the value is the same at every thread count, in every build.
// MODE: kSumOnly (g unused), kAdd (d += g), kFromZero (d = 0 + g: the add into a zero d, bit for bit, -0 of g
// included, without reading d).
enum { kSumOnly = 0, kAdd = 1, kFromZero = 2 };

template <int GT, int MODE>
inline float next_value(const float* d, const void* g, int64_t j) {
  if (MODE == kSumOnly) return d[j];
  const float base = MODE == kFromZero ? 0.0f : d[j];
  return base + load_g<GT>(g, j);
}

template <int GT, int MODE, bool SUM>
float add_square_row(float* __restrict d, const void* __restrict g, int64_t n) {
  alignas(32) float acc[16] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t j = 0;
#if LT_AVX2
  // Into a zero buffer: streaming stores, so the row's cache lines are written without first being read
  // (a plain store reads each line in before it writes it). The same operations per lane as below.
  if (MODE == kFromZero && !g_force_scalar && (reinterpret_cast<uintptr_t>(d) & 31) == 0) {
    const __m256 zero = _mm256_setzero_ps();
    __m256 lo = zero, hi = zero;
    for (; j + 16 <= n; j += 16) {
      const __m256 x0 = _mm256_add_ps(zero, load_g8<GT>(g, j));
      const __m256 x1 = _mm256_add_ps(zero, load_g8<GT>(g, j + 8));
      _mm256_stream_ps(d + j, x0);
      _mm256_stream_ps(d + j + 8, x1);
      if (SUM) {
        lo = _mm256_add_ps(lo, _mm256_mul_ps(x0, x0));
        hi = _mm256_add_ps(hi, _mm256_mul_ps(x1, x1));
      }
    }
    _mm_sfence();  // the streamed stores are visible before anything this thread does next
    _mm256_store_ps(acc, lo);
    _mm256_store_ps(acc + 8, hi);
  }
#endif
  for (; j + 16 <= n; j += 16) {
    for (int k = 0; k < 16; ++k) {
      const float x = next_value<GT, MODE>(d, g, j + k);
      if (MODE != kSumOnly) d[j + k] = x;
      if (SUM) acc[k] = acc[k] + x * x;
    }
  }
  for (int k = 0; j < n; ++j, ++k) {
    const float x = next_value<GT, MODE>(d, g, j);
    if (MODE != kSumOnly) d[j] = x;
    if (SUM) acc[k] = acc[k] + x * x;
  }
  float total = 0.f;
  for (int k = 0; k < 16; ++k) total = total + acc[k];
  return total;
}

template <int GT>
double add_square_sum_impl(float* d, const void* g, int64_t n, int64_t row, bool want_sum, bool from_zero,
                           int nthreads) {
  const int64_t nr = (n + row - 1) / row;
  const bool add = g != nullptr;
  std::vector<float> sums(want_sum ? nr : 0);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && nr > 1)
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t s = r * row, len = std::min(row, n - s);
    const void* gr = add ? static_cast<const void*>(static_cast<const char*>(g) + s * (GT == kF32 ? 4 : 2)) : nullptr;
    const float v = !add ? add_square_row<GT, kSumOnly, true>(d + s, gr, len)
                    : from_zero ? (want_sum ? add_square_row<GT, kFromZero, true>(d + s, gr, len)
                                            : add_square_row<GT, kFromZero, false>(d + s, gr, len))
                    : want_sum ? add_square_row<GT, kAdd, true>(d + s, gr, len)
                               : add_square_row<GT, kAdd, false>(d + s, gr, len);
    if (want_sum) sums[r] = v;
  }
  double total = 0.0;
  for (int64_t r = 0; r < (want_sum ? nr : 0); ++r) total += static_cast<double>(sums[r]);
  return total;
}

#define LT_DISPATCH(FN, GT_, CT_, ADAMW_, ...)                                   \
  do {                                                                           \
    auto run_ct = [&](auto gt_tag) {                                             \
      constexpr int G = decltype(gt_tag)::value;                                 \
      switch (CT_) {                                                             \
        case kBF16: (ADAMW_) ? FN<G, kBF16, true>(__VA_ARGS__) : FN<G, kBF16, false>(__VA_ARGS__); break; \
        case kF16: (ADAMW_) ? FN<G, kF16, true>(__VA_ARGS__) : FN<G, kF16, false>(__VA_ARGS__); break;    \
        default: (ADAMW_) ? FN<G, kNone, true>(__VA_ARGS__) : FN<G, kNone, false>(__VA_ARGS__); break;    \
      }                                                                          \
    };                                                                           \
    switch (GT_) {                                                               \
      case kBF16: run_ct(std::integral_constant<int, kBF16>{}); break;           \
      case kF16: run_ct(std::integral_constant<int, kF16>{}); break;             \
      default: run_ct(std::integral_constant<int, kF32>{}); break;               \
    }                                                                            \
  } while (0)

}  // namespace

extern "C" {

int lt_abi_version() { return 6; }
int lt_has_avx2() { return LT_AVX2; }
int lt_max_block() { return (int)kMaxBlock; }
void lt_set_force_scalar(int v) { g_force_scalar = v; }

void lt_quantize_blockwise(const float* x, int64_t n, int64_t bs, const int32_t* lut, int32_t base, int32_t kmax,
                           int32_t half, int32_t is_signed, uint8_t* out, float* absmax, int nthreads) {
  const Table t{lut, base, kmax, half};
  const int64_t nb = (n + bs - 1) / bs;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && nb > 1)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t s = b * bs, len = std::min(bs, n - s);
    const float mx = absmax_of(x + s, len);
    absmax[b] = mx;
    if (is_signed) encode_block<true>(x + s, len, inv_absmax(mx), t, out + s);
    else encode_block<false>(x + s, len, inv_absmax(mx), t, out + s);
  }
}

void lt_dequantize_blockwise(const uint8_t* c, const float* absmax, const float* qmap, int64_t n, int64_t bs,
                             float* out, int nthreads) {
  const int64_t nb = (n + bs - 1) / bs;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && nb > 1)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t s = b * bs, len = std::min(bs, n - s);
    const float a = absmax[b];
    int64_t j = 0;
#if LT_AVX2
    if (!g_force_scalar) {
      const __m256 va = _mm256_set1_ps(a);
      for (; j + 8 <= len; j += 8) _mm256_storeu_ps(out + s + j, dequant8(c + s + j, qmap, va));
    }
#endif
    for (; j < len; ++j) out[s + j] = qmap[c[s + j]] * a;
  }
}

void lt_adam8bit(const Hyper* h, float* p, const void* g, int gtype, uint8_t* c1, uint8_t* c2, float* amax1,
                 float* amax2, const float* q1, const float* q2, const int32_t* lut1, int32_t base1, int32_t kmax1,
                 int32_t half1, const int32_t* lut2, int32_t base2, int32_t kmax2, void* copy, int ctype, int64_t n,
                 int64_t bs, int zero_grad, int nthreads) {
  const Table t1{lut1, base1, kmax1, half1}, t2{lut2, base2, kmax2, 0};
  LT_DISPATCH(adam8bit_impl, gtype, ctype, h->adamw, *h, p, g, c1, c2, amax1, amax2, q1, q2, t1, t2, copy, n, bs,
              zero_grad != 0, nthreads);
}

void lt_adam32(const Hyper* h, float* p, const void* g, int gtype, float* m, float* v, void* copy, int ctype,
               int64_t n, int zero_grad, int nthreads) {
  LT_DISPATCH(adam32_impl, gtype, ctype, h->adamw, *h, p, g, m, v, copy, n, zero_grad != 0, nthreads);
}

// g: nullptr to take the sum of squares of d alone. Returns 0 unless want_sum. from_zero: d is zero (the
// caller knows), so d = 0 + g is written without reading d.
double lt_add_square_sum(float* d, const void* g, int gtype, int64_t n, int64_t row, int want_sum, int from_zero,
                         int nthreads) {
  const bool z = from_zero != 0;
  switch (gtype) {
    case kBF16: return add_square_sum_impl<kBF16>(d, g, n, row, want_sum != 0, z, nthreads);
    case kF16: return add_square_sum_impl<kF16>(d, g, n, row, want_sum != 0, z, nthreads);
    default: return add_square_sum_impl<kF32>(d, g, n, row, want_sum != 0, z, nthreads);
  }
}

}  // extern "C"
