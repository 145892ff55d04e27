// GGUF quantized blocks on CPU: the compiled counterpart of
// parallel/quant/gguf.py's torch `dequantize` (block layouts in its
// docstring), for the seven types it takes (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K,
// Q5_K, Q6_K; ggml type ids below).
//
//   gguf_dequant: raw uint8 rows [N, row_bytes] -> W [N, k] fp32 or bf16.
//     Bit-exact against the torch reference in fp32: the same fp32 products
//     and sums in the same order (built with -ffp-contract=off, so no
//     multiply-add is fused); bf16 is that fp32 value rounded once to
//     nearest-even. Threaded over rows.
//   gguf_gemv: y [M, N] = x [M, k] @ W^T for a few rows of x (decode): each
//     block is dequantized in registers, W floats at a time (the same
//     decoders as gguf_dequant), and dotted with up to 8 rows of x at once:
//     fp32 accumulation with fused multiply-adds; W is never written out.
//     Threaded over N.
//
// Vectors are GCC vector extensions of W = 16 floats with AVX-512, else 8
// (lowered to what the target has; FMA intrinsics where it has them), so
// the same source builds anywhere g++ does. Plain C ABI called through
// ctypes (parallel/quant/gguf_cpu.py): no torch headers, g++ with OpenMP only.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

// ggml type ids (gguf.GGMLQuantizationType), as parallel/quant/gguf.py's QTYPES.
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

inline float h2f(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {   // subnormal: renormalise
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            bits = sign | (uint32_t)(112 - e) << 23 | (man & 0x3ff) << 13;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | man << 13;
    } else {
        bits = sign | (exp + 112) << 23 | man << 13;
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
#endif
}

// -- vectors of W floats (GCC vector extensions: lowered to whatever the
// target has; zmm with AVX-512, ymm pairs / xmm quads otherwise).
#if defined(__AVX512F__)
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));
typedef uint8_t vb __attribute__((vector_size(W)));

#define INLINE inline __attribute__((always_inline))

INLINE vf loadu(const float* p) {
    vf v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
INLINE vb loadb(const uint8_t* p) {
    vb v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
INLINE vi widen(vb q) { return __builtin_convertvector(q, vi); }
INLINE vf tof(vi q) { return __builtin_convertvector(q, vf); }
INLINE vu iota() {
    vu v;
    for (int l = 0; l < W; l++) v[l] = l;
    return v;
}

INLINE vf vfma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && defined(__AVX__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;     // -ffp-contract=off: a multiply and an add
#endif
}

// Sum of the lanes, halving: log2(W) vector adds, not W dependent scalar ones.
typedef float v4f __attribute__((vector_size(16)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));
template <class V, class H>
INLINE H fold(V v) {
    H a, b;
    std::memcpy(&a, &v, sizeof a);
    std::memcpy(&b, (const char*)&v + sizeof a, sizeof b);
    return a + b;
}
INLINE float hsum(v4f v) { return (v[0] + v[2]) + (v[1] + v[3]); }
INLINE float hsum(v8f v) { return hsum(fold<v8f, v4f>(v)); }
INLINE float hsum(v16f v) { return hsum(fold<v16f, v8f>(v)); }

// fp32 -> bf16, round to nearest even (c10::BFloat16's rounding; NaN -> 0x7fc0).
INLINE void store_bf16(uint16_t* p, vf v) {
    const vu u = (vu)v;
    const vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
    const vh h = __builtin_convertvector((nan & 0x7fc0u) | (~nan & r), vh);
    std::memcpy(p, &h, sizeof h);
}

// Calls f(integral_constant<int, i>) for i < N, unrolled.
template <class Fn, int... I>
INLINE void unroll_(Fn&& f, std::integer_sequence<int, I...>) {
    (f(std::integral_constant<int, I>{}), ...);
}
template <int N, class Fn>
INLINE void unroll(Fn&& f) {
    unroll_(f, std::make_integer_sequence<int, N>{});
}
template <class I>
constexpr std::integral_constant<int, I::value % 2> par(I) { return {}; }

// -- block decoders. Fmt<T>::each(block, f) calls f(p, e, w) for each
// e = 0, W, 2W, ... < BLOCK, with w = elements [e, e + W) of the block and p
// = (e / W) % 2 as a compile-time constant (which accumulator takes them),
// computed with the torch reference's fp32 operations (gguf.py: _q8_0,
// _q4_0, ...): the same values, bit for bit. Chunks never straddle a
// nibble half or a sub-block (W divides 16).
template <int QT> struct Fmt;

template <> struct Fmt<Q8_0> {            // w = d * q
    static constexpr int BLOCK = 32, SIZE = 34;
    template <class Fn> static INLINE void each(const uint8_t* b, Fn&& f) {
        const float d = h2f(b);
        unroll<BLOCK / W>([&](auto I) {
            // int8 q = (q ^ 0x80) - 128, zero-extended first (GCC 12 scalarises a signed widening)
            const vb q = loadb(b + 2 + W * I) ^ 0x80;
            f(par(I), W * I, d * tof(widen(q) - 128));
        });
    }
};

template <> struct Fmt<Q4_0> {            // w = d * (q - 8)
    static constexpr int BLOCK = 32, SIZE = 18;
    template <class Fn> static INLINE void each(const uint8_t* b, Fn&& f) {
        const float d = h2f(b);
        unroll<BLOCK / W>([&](auto I) {
            constexpr int e = W * I;
            const vb q = loadb(b + 2 + e % 16);
            f(par(I), e, d * tof(widen(e < 16 ? q & 15 : q >> 4) - 8));
        });
    }
};

template <> struct Fmt<Q4_1> {            // w = d * q + m
    static constexpr int BLOCK = 32, SIZE = 20;
    template <class Fn> static INLINE void each(const uint8_t* b, Fn&& f) {
        const float d = h2f(b), m = h2f(b + 2);
        unroll<BLOCK / W>([&](auto I) {
            constexpr int e = W * I;
            const vb q = loadb(b + 4 + e % 16);
            f(par(I), e, d * tof(widen(e < 16 ? q & 15 : q >> 4)) + m);
        });
    }
};

template <> struct Fmt<Q5_0> {            // w = d * (q - 16), bit 4 of q[i] = bit i of qh
    static constexpr int BLOCK = 32, SIZE = 22;
    template <class Fn> static INLINE void each(const uint8_t* b, Fn&& f) {
        const float d = h2f(b);
        uint32_t qh;
        std::memcpy(&qh, b + 2, 4);
        unroll<BLOCK / W>([&](auto I) {
            constexpr int e = W * I;
            const vb q = loadb(b + 6 + e % 16);
            const vu hi = ((vu{} + qh) >> (iota() + (uint32_t)e)) & 1u;
            const vi v = widen(e < 16 ? q & 15 : q >> 4) | (vi)(hi << 4);
            f(par(I), e, d * tof(v - 16));
        });
    }
};

// Q4_K / Q5_K: the 8 six-bit scales and mins times d and dmin (gguf.py
// _scale_min, _k_affine): w = (d*sc_j) * q - (dmin*m_j).
INLINE void k_scales(const uint8_t* b, float* ds, float* dm) {
    const float d = h2f(b), dmin = h2f(b + 2);
    const uint8_t* s = b + 4;
    for (int j = 0; j < 4; j++) {
        ds[j] = d * (float)(s[j] & 63);
        dm[j] = dmin * (float)(s[j + 4] & 63);
    }
    for (int j = 4; j < 8; j++) {
        ds[j] = d * (float)((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
        dm[j] = dmin * (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

template <> struct Fmt<Q4_K> {            // element 64c + 32t + l: nibble t of qs[32c + l], sub-block 2c + t
    static constexpr int BLOCK = 256, SIZE = 144;
    template <class Fn> static INLINE void each(const uint8_t* b, Fn&& f) {
        float ds[8], dm[8];
        k_scales(b, ds, dm);
        for (int c = 0; c < 4; c++) {          // a loop, not unrolled: keeps the build short
            unroll<64 / W>([&](auto I) {
                constexpr int e = W * I, t = e / 32, l = e % 32;
                const int j = 2 * c + t;
                const vb q = loadb(b + 16 + 32 * c + l);
                f(par(I), 64 * c + e, ds[j] * tof(widen(t ? q >> 4 : q & 15)) - dm[j]);
            });
        }
    }
};

template <> struct Fmt<Q5_K> {            // as Q4_K, bit 4 of element l of sub-block j = bit j of qh[l]
    static constexpr int BLOCK = 256, SIZE = 176;
    template <class Fn> static INLINE void each(const uint8_t* b, Fn&& f) {
        float ds[8], dm[8];
        k_scales(b, ds, dm);
        for (int c = 0; c < 4; c++) {
            unroll<64 / W>([&](auto I) {
                constexpr int e = W * I, t = e / 32, l = e % 32;
                const int j = 2 * c + t;
                const vb q = loadb(b + 48 + 32 * c + l);
                const vb h = (loadb(b + 16 + l) >> j) & 1;
                f(par(I), 64 * c + e, ds[j] * tof(widen((t ? q >> 4 : q & 15) | (vb)(h << 4))) - dm[j]);
            });
        }
    }
};

template <> struct Fmt<Q6_K> {            // element 128h + 32s + l: see gguf.py _q6_k
    static constexpr int BLOCK = 256, SIZE = 210;
    template <class Fn> static INLINE void each(const uint8_t* b, Fn&& f) {
        const float d = h2f(b + 208);
        const int8_t* sc = (const int8_t*)(b + 192);
        for (int h = 0; h < 2; h++) {
            unroll<128 / W>([&](auto I) {
                constexpr int e = W * I, s = e / 32, l = e % 32;
                const vb ql = loadb(b + 64 * h + 32 * (s & 1) + l);
                const vb qh = loadb(b + 128 + 32 * h + l);
                const vb q = ((s >> 1) ? ql >> 4 : ql & 15) | (vb)(((qh >> (2 * s)) & 3) << 4);
                const float scale = d * (float)sc[8 * h + 2 * s + l / 16];
                f(par(I), 128 * h + e, scale * tof(widen(q) - 32));
            });
        }
    }
};

// Below this many output elements a call runs on one thread (the fork costs more).
constexpr int64_t PAR_MIN = 1 << 15;

template <int QT>
void dequant_rows(const uint8_t* raw, int64_t rs, int64_t n, int64_t k, void* out, int64_t os, int bf16,
                  int nthreads) {
    using F = Fmt<QT>;
    const int64_t nb = k / F::BLOCK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n * k >= PAR_MIN)
    for (int64_t r = 0; r < n; r++) {
        const uint8_t* row = raw + r * rs;
        if (!bf16) {
            float* o = (float*)out + r * os;
            for (int64_t b = 0; b < nb; b++, o += F::BLOCK)
                F::each(row + b * F::SIZE, [&](auto, int e, vf w) { std::memcpy(o + e, &w, sizeof w); });
        } else {
            uint16_t* o = (uint16_t*)out + r * os;
            for (int64_t b = 0; b < nb; b++, o += F::BLOCK)
                F::each(row + b * F::SIZE, [&](auto, int e, vf w) { store_bf16(o + e, w); });
        }
    }
}

// -- GEMV: rows [n0, n1) of W against MT rows of x (row stride xs), into y
// (row stride ys). Each chunk of a block goes from its decoder straight
// into MT fused multiply-adds; two accumulators per row (even / odd chunks)
// halve the dependency chains.
template <int QT, int MT>
void gemv_tile(const uint8_t* raw, int64_t rs, int64_t n0, int64_t n1, int64_t k, const float* x, int64_t xs,
               float* y, int64_t ys) {
    using F = Fmt<QT>;
    const int64_t nb = k / F::BLOCK;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t* row = raw + n * rs;
        vf acc[2][MT];
        for (int m = 0; m < MT; m++) acc[0][m] = acc[1][m] = vf{};
        const float* xb = x;
        for (int64_t b = 0; b < nb; b++, xb += F::BLOCK) {
            F::each(row + b * F::SIZE, [&](auto P, int e, vf w) {
                for (int m = 0; m < MT; m++)
                    acc[P][m] = vfma(w, loadu(xb + m * xs + e), acc[P][m]);
            });
        }
        for (int m = 0; m < MT; m++) y[m * ys + n] = hsum(acc[0][m] + acc[1][m]);
    }
}

constexpr int MAX_MT = 8;       // x rows per pass over W
constexpr int64_t ROW_CHUNK = 16;   // W rows per pass when M > MAX_MT (kept in cache across passes)

template <int QT>
void gemv_rows(const uint8_t* raw, int64_t rs, int64_t n0, int64_t n1, int64_t k, const float* x, int64_t xs,
               int64_t m, float* y, int64_t ys) {
    for (int64_t c0 = n0; c0 < n1; c0 += (m > MAX_MT ? ROW_CHUNK : n1 - n0)) {
        const int64_t c1 = m > MAX_MT ? std::min(n1, c0 + ROW_CHUNK) : n1;
        for (int64_t m0 = 0; m0 < m; m0 += MAX_MT) {
            const float* xm = x + m0 * xs;
            float* ym = y + m0 * ys;
            switch ((int)std::min<int64_t>(MAX_MT, m - m0)) {
                case 1: gemv_tile<QT, 1>(raw, rs, c0, c1, k, xm, xs, ym, ys); break;
                case 2: gemv_tile<QT, 2>(raw, rs, c0, c1, k, xm, xs, ym, ys); break;
                case 3: gemv_tile<QT, 3>(raw, rs, c0, c1, k, xm, xs, ym, ys); break;
                case 4: gemv_tile<QT, 4>(raw, rs, c0, c1, k, xm, xs, ym, ys); break;
                case 5: gemv_tile<QT, 5>(raw, rs, c0, c1, k, xm, xs, ym, ys); break;
                case 6: gemv_tile<QT, 6>(raw, rs, c0, c1, k, xm, xs, ym, ys); break;
                case 7: gemv_tile<QT, 7>(raw, rs, c0, c1, k, xm, xs, ym, ys); break;
                default: gemv_tile<QT, 8>(raw, rs, c0, c1, k, xm, xs, ym, ys); break;
            }
        }
    }
}

template <int QT>
void gemv_q(const uint8_t* raw, int64_t rs, int64_t n, int64_t k, const float* x, int64_t xs, int64_t m,
            float* y, int64_t ys, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (n * k >= PAR_MIN)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
#else
        const int64_t t = 0, T = 1;
#endif
        // Contiguous row ranges, a multiple of 8 rows each (y's cache lines stay per thread).
        const int64_t units = (n + 7) / 8;
        const int64_t n0 = std::min(n, units * t / T * 8), n1 = std::min(n, units * (t + 1) / T * 8);
        if (n0 < n1) gemv_rows<QT>(raw, rs, n0, n1, k, x, xs, m, y, ys);
    }
}

// fp32 -> bf16 bits, round to nearest even (store_bf16's rounding, one value).
inline uint16_t f2bf(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace

extern "C" {

// raw: rows of blocks, row stride rs bytes; out: [n, k] fp32 (bf16 = 0) or
// bf16 (bf16 = 1), row stride os elements. Returns 0, or -1 for an unknown
// type or a k that is not a whole number of blocks.
int gguf_dequant(const uint8_t* raw, int64_t rs, int64_t n, int qtype, int64_t k, void* out, int64_t os, int bf16,
                 int nthreads) {
    switch (qtype) {
#define CASE(T)                                                         \
    case T:                                                             \
        if (k % Fmt<T>::BLOCK) return -1;                               \
        dequant_rows<T>(raw, rs, n, k, out, os, bf16, nthreads);        \
        return 0;
        CASE(Q8_0) CASE(Q4_0) CASE(Q4_1) CASE(Q5_0) CASE(Q4_K) CASE(Q5_K) CASE(Q6_K)
#undef CASE
        default: return -1;
    }
}

// y[i, j] = sum_c x[i, c] * W[j, c] for i < m, j < n: x fp32 [m, k] (row
// stride xs elements), W as gguf_dequant's raw, y fp32 (row stride ys).
int gguf_gemv(const float* x, int64_t xs, int64_t m, const uint8_t* raw, int64_t rs, int64_t n, int qtype,
              int64_t k, float* y, int64_t ys, int nthreads) {
    switch (qtype) {
#define CASE(T)                                                         \
    case T:                                                             \
        if (k % Fmt<T>::BLOCK) return -1;                               \
        gemv_q<T>(raw, rs, n, k, x, xs, m, y, ys, nthreads);            \
        return 0;
        CASE(Q8_0) CASE(Q4_0) CASE(Q4_1) CASE(Q5_0) CASE(Q4_K) CASE(Q5_K) CASE(Q6_K)
#undef CASE
        default: return -1;
    }
}

// gguf_gemv for bf16 x and y (row strides xs, ys elements): x widened to
// fp32 (exact), the fp32 product rounded once to bf16, as torch's
// x.float() -> gguf_gemv -> y.to(bfloat16) would, without the three extra
// torch ops per call (a decode step makes ~200 of these calls).
int gguf_gemv_bf16(const uint16_t* x, int64_t xs, int64_t m, const uint8_t* raw, int64_t rs, int64_t n, int qtype,
                   int64_t k, uint16_t* y, int64_t ys, int nthreads) {
    std::vector<float> xf((size_t)(m * k)), yf((size_t)(m * n));
    for (int64_t i = 0; i < m; i++)
        for (int64_t c = 0; c < k; c++) {
            const uint32_t u = (uint32_t)x[i * xs + c] << 16;
            std::memcpy(&xf[(size_t)(i * k + c)], &u, 4);
        }
    const int rc = gguf_gemv(xf.data(), k, m, raw, rs, n, qtype, k, yf.data(), n, nthreads);
    if (rc) return rc;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) y[i * ys + j] = f2bf(yf[(size_t)(i * n + j)]);
    return 0;
}

}  // extern "C"
