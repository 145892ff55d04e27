// CPU decode attention over dense (f32 / bf16 / f16) paged KV, and the store
// of new K/V rows: the compiled counterpart of dense-torch's decode
// (DenseTorchBackend._attend, SDPA over gathered blocks) and of
// DenseLayerCache.write's index_copy_ (kvcache/dense_cpu.py calls them).
//
// Decode: one query token per sequence. The cache rows are read in place
// through the block tables (no gathered copy, no mask). A sequence's visible
// keys are cut at FIXED partition boundaries (every PART positions, absolute),
// one work item = (sequence, partition, KV head): each K/V row is converted
// once and serves the G query heads of its KV head; scores, their max, the
// exps and the weighted sum of V are computed per partition (fp32), and a
// second pass merges each sequence's partitions in order (max, sum, acc).
// What a sequence gets depends only on its own query, keys and length: not on
// the batch, its place in it, nor the thread count (batch invariance).
//
// Plain C ABI (called through ctypes): no torch headers. The per-layer and
// per-step integers come in small int64 descriptors (see LAYER_* / STEP_*),
// built once by the caller, so a call passes a handful of scalars.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Keys per partition: a constant (batch invariance). 128 measured best on
// SmolLM2 shapes (H 3, G 3, D 64, bf16, cold cache rows) at batch 1 and 16,
// over 32 / 64 / 256; so did items of one KV head over items of all of them,
// and prefetching rows PF ahead over all of an item's rows at its start.
constexpr int PART = 128;
constexpr int PF = 24;         // rows ahead that a score loop prefetches

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

// Layer descriptor: int64 [LAYER_N].
enum { L_K = 0, L_V, L_K_SLOT, L_K_HEAD, L_V_SLOT, L_V_HEAD, L_DTYPE, L_H, L_D, L_BS, L_WINDOW, L_SLOTS, LAYER_N };
// Step descriptor: int64 [STEP_N]. Block tables [B, W] (row stride), lengths [B].
enum { S_BT = 0, S_BT_ROW, S_BT_W, S_BT_64, S_LENS, S_LENS_64, S_B, STEP_N };

inline float bits2f(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint32_t f2bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

inline float bf2f(uint16_t h) { return bits2f((uint32_t)h << 16); }

// Round to nearest even, NaN -> quiet NaN: as torch's float -> bfloat16.
inline uint16_t f2bf(float f) {
    const uint32_t u = f2bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float h2f(uint16_t h) {
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
    return bits2f(bits);
#endif
}

// Round to nearest even (as torch's float -> half).
inline uint16_t f2h(float f) {
#ifdef __F16C__
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    const uint32_t u = f2bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);            // NaN
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);           // rounds past 65504: inf
    if (a < 0x38800000u) {                                             // subnormal half (or 0)
        if (a < 0x33000000u) return (uint16_t)sign;                    // below half the smallest: 0
        const uint32_t e = a >> 23, man = (a & 0x7fffffu) | 0x800000u;
        const int shift = 126 - (int)e;                                // 14..24
        uint32_t h = man >> shift;
        const uint32_t rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((a - 0x38000000u) >> 13);                            // rebias exponent
    const uint32_t rem = a & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) h++;
    return (uint16_t)(sign | h);
#endif
}

#define INLINE inline __attribute__((always_inline))

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

INLINE vf loadu(const float* p) {
    vf v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

INLINE vf vfma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && defined(__AVX__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
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
INLINE float hsum(v8f v) {
#if defined(__AVX__)
    const __m128 a = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
#else
    return hsum(fold<v8f, v4f>(v));
#endif
}
INLINE float hsum(v16f v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#else
    return hsum(fold<v16f, v8f>(v));
#endif
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

// exp(x) for x <= 0 (a score minus its max): Cody-Waite range reduction and
// cephes' expf polynomial (relative error ~1e-7). X: float or a vector of
// floats (I the matching int type), the same arithmetic lane by lane.
template <class X, class I>
INLINE X exp_le0(X x) {
    x = x < -87.0f ? X{} - 87.0f : x;      // exp(-87) ~ 1.6e-38: 0 against a sum >= 1
    const X n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;   // round to nearest (|.| < 2^22)
    const X r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    const X z = r * r;
    X y = r * 1.9875691500e-4f + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    I e;
    if constexpr (sizeof(X) == 4) e = ((I)n + 127) << 23;
    else e = (__builtin_convertvector(n, I) + 127) << 23;
    X sc;
    std::memcpy(&sc, &e, sizeof sc);
    return y * sc;
}

// W cache elements (dtype KT) at p + off as floats.
template <int KT>
INLINE vf load_w(const void* p, int64_t off) {
    if constexpr (KT == DT_F32) {
        return loadu((const float*)p + off);
    } else if constexpr (KT == DT_BF16) {
        const uint16_t* x = (const uint16_t*)p + off;
#if defined(__AVX512F__)
        return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)x)), 16);
#elif defined(__AVX2__)
        return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)x)), 16);
#else
        vh h;
        std::memcpy(&h, x, sizeof h);
        return (vf)(__builtin_convertvector(h, vu) << 16);
#endif
    } else {
#if defined(__AVX512F__)
        return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)p + off)));
#elif defined(__F16C__)
        return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)p + off)));
#else
        vf v;
        for (int l = 0; l < W; l++) v[l] = h2f(((const uint16_t*)p)[off + l]);
        return v;
#endif
    }
}

INLINE vf splat(float x) { return vf{} + x; }

// Sums of W vectors: r[j] = sum of x[j]'s lanes (a transpose folded into
// the adds: ~3 instructions a sum, against ~8 for each alone).
INLINE vf hsum_w(const vf* x) {
#if defined(__AVX512F__)
    __m512 a[8], b[4], e[2];
    for (int j = 0; j < 8; j++) {
        const __m512 u = (__m512)x[2 * j], v = (__m512)x[2 * j + 1];
        a[j] = _mm512_add_ps(_mm512_unpacklo_ps(u, v), _mm512_unpackhi_ps(u, v));
    }
    for (int j = 0; j < 4; j++)
        b[j] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int j = 0; j < 2; j++)
        e[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return (vf)_mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
#elif defined(__AVX__)
    __m256 a[4], b[2];
    for (int j = 0; j < 4; j++) {
        const __m256 u = (__m256)x[2 * j], v = (__m256)x[2 * j + 1];
        a[j] = _mm256_add_ps(_mm256_unpacklo_ps(u, v), _mm256_unpackhi_ps(u, v));
    }
    for (int j = 0; j < 2; j++)
        b[j] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return (vf)_mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
#else
    vf r;
    for (int j = 0; j < W; j++) r[j] = hsum(x[j]);
    return r;
#endif
}

// The vector path: head dim DD (a compile-time multiple of W), or DD = 0 and
// any D that is a multiple of W, given at run time.

// One key row's lane-partial dot products with GT query heads (q rows
// [GT, D] at qf): t[g * W] = the W partial sums of q_g * k.
template <int KT, int DD, int GT>
INLINE void score_row(const void* kc, int64_t off, const float* __restrict qf, vf* __restrict t, int D) {
    const int Dq = DD ? DD : D;
    vf a[GT];
    unroll<GT>([&](auto g) { a[g] = vf{}; });
#pragma GCC unroll 8
    for (int c = 0; c < Dq / W; c++) {
        const vf k = load_w<KT>(kc, off + c * W);
        unroll<GT>([&](auto g) { a[g] = vfma(loadu(qf + g * Dq + c * W), k, a[g]); });
    }
    unroll<GT>([&](auto g) { t[g * W] = a[g]; });
}

// Scores of the n keys (rows at kc + off[i]) against GT query heads:
// s[g * PART + i] = q_g . k_i, W keys at a time; t: scratch [GT * W]
// vectors. Meanwhile the K rows PF ahead and the V rows are prefetched.
template <int KT, int DD, int GT>
INLINE void scores(const void* kc, const int64_t* __restrict off, int n, const float* __restrict qf,
                   float* __restrict s, vf* __restrict t, const void* vc, const int64_t* __restrict voff, int D) {
    constexpr int64_t ES = KT == DT_F32 ? 4 : 2;
    const int64_t rb = (int64_t)(DD ? DD : D) * ES;
    auto fetch = [&](const void* base, int64_t o) {
        for (int64_t c = 0; c < rb; c += 64) __builtin_prefetch((const char*)base + o * ES + c, 0, 3);
    };
    int i = 0;
    for (; i + W <= n; i += W) {
        for (int j = 0; j < W; j++) {
            if (i + j + PF < n) fetch(kc, off[i + j + PF]);
            fetch(vc, voff[i + j]);
            score_row<KT, DD, GT>(kc, off[i + j], qf, t + j, D);
        }
        unroll<GT>([&](auto g) {
            const vf r = hsum_w(t + g * W);
            std::memcpy(s + g * PART + i, &r, sizeof r);
        });
    }
    for (; i < n; i++) {
        fetch(vc, voff[i]);
        score_row<KT, DD, GT>(kc, off[i], qf, t, D);
        unroll<GT>([&](auto g) { s[g * PART + i] = hsum(t[g * W]); });
    }
}

// Columns [c0 * W, (c0 + CH) * W) of acc [GT, Dq] = sum over the n keys of
// p[g * PART + i] * V row i (rows at vc + off[i]): GT * CH accumulators in
// registers.
template <int KT, int GT, int CH>
INLINE void accum_pass(const void* vc, const int64_t* __restrict off, int n, const float* __restrict p,
                       float* __restrict acc, int Dq, int c0) {
    vf a[GT][CH];
    unroll<GT>([&](auto g) { unroll<CH>([&](auto c) { a[g][c] = vf{}; }); });
    for (int i = 0; i < n; i++) {
        const int64_t o = off[i] + c0 * W;
        vf pg[GT];
        unroll<GT>([&](auto g) { pg[g] = splat(p[g * PART + i]); });
        unroll<CH>([&](auto c) {
            const vf v = load_w<KT>(vc, o + c * W);
            unroll<GT>([&](auto g) { a[g][c] = vfma(pg[g], v, a[g][c]); });
        });
    }
    unroll<GT>([&](auto g) {
        unroll<CH>([&](auto c) { std::memcpy(acc + g * Dq + (c0 + c) * W, &a[g][c], sizeof(vf)); });
    });
}

// acc [GT, D] = sum over the n keys of p[g * PART + i] * V row i, CH chunks
// of W columns per pass over the rows.
template <int KT, int DD, int GT>
INLINE void accum_v(const void* vc, const int64_t* __restrict off, int n, const float* __restrict p,
                    float* __restrict acc, int D) {
    const int Dq = DD ? DD : D, NC = Dq / W;
    constexpr int CMAX = 16 / GT >= 8 ? 8 : 16 / GT >= 4 ? 4 : 16 / GT >= 2 ? 2 : 1;
    constexpr int CH = DD && DD / W < CMAX ? DD / W : CMAX;
    int c0 = 0;
    for (; c0 + CH <= NC; c0 += CH) accum_pass<KT, GT, CH>(vc, off, n, p, acc, Dq, c0);
    if (DD == 0)
        for (; c0 < NC; c0++) accum_pass<KT, GT, 1>(vc, off, n, p, acc, Dq, c0);
}

// Softmax numerators of one head's n scores, in place: s = exp(s - max);
// returns (max, sum) through m, l.
INLINE void softmax_part(float* __restrict s, int n, float& m, float& l) {
    int i = 0;
    vf mv = splat(-INFINITY);
    for (; i + W <= n; i += W) {
        const vf x = loadu(s + i);
        mv = x > mv ? x : mv;
    }
    float mx = -INFINITY;
    for (int k = 0; k < W; k++) mx = std::max(mx, mv[k]);
    for (int k = i; k < n; k++) mx = std::max(mx, s[k]);
    vf lv = vf{};
    for (i = 0; i + W <= n; i += W) {
        const vf e = exp_le0<vf, vi>(loadu(s + i) - mx);
        std::memcpy(s + i, &e, sizeof e);
        lv += e;
    }
    float sum = hsum(lv);
    for (int k = i; k < n; k++) {
        s[k] = exp_le0<float, int32_t>(s[k] - mx);
        sum += s[k];
    }
    m = mx;
    l = sum;
}

// Scalar dot / axpy for head dims the vector path has no build for.
INLINE float dot_any(const float* __restrict a, const float* __restrict b, int D) {
    float t[8] = {};
    int d = 0;
    for (; d + 8 <= D; d += 8)
        for (int k = 0; k < 8; k++) t[k] += a[d + k] * b[d + k];
    float s = ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
    for (; d < D; d++) s += a[d] * b[d];
    return s;
}

INLINE void axpy_any(float* __restrict y, float a, const float* __restrict x, int D) {
    for (int d = 0; d < D; d++) y[d] += a * x[d];
}

INLINE float load1(const void* p, int64_t i, int dt) {
    if (dt == DT_F32) return ((const float*)p)[i];
    if (dt == DT_BF16) return bf2f(((const uint16_t*)p)[i]);
    return h2f(((const uint16_t*)p)[i]);
}

INLINE void store1(void* p, int64_t i, int dt, float x) {
    if (dt == DT_F32) ((float*)p)[i] = x;
    else if (dt == DT_BF16) ((uint16_t*)p)[i] = f2bf(x);
    else ((uint16_t*)p)[i] = f2h(x);
}

struct Seq {       // one sequence's partitions
    int64_t len, lo;      // visible keys [lo, len)
    int64_t first, n;     // partitions [first, first + n), absolute (PART positions each)
    int64_t item0;        // its first work index
};

// Per-thread scratch (grows, never shrinks): scores [G, PART], q [G, D], a
// row, the partition's slots.
struct Scratch {
    std::vector<float> s, q, row;
    std::vector<int64_t> koff, voff;
    std::vector<vf> t;
    void fit(int G, int D) {
        if (t.size() < (size_t)4 * W) t.resize((size_t)4 * W);
        if (s.size() < (size_t)G * PART) s.resize((size_t)G * PART);
        if (q.size() < (size_t)G * D) q.resize((size_t)G * D);
        if (row.size() < (size_t)D) row.resize(D);
        if (koff.size() < (size_t)PART) koff.resize(PART), voff.resize(PART);
    }
};

thread_local Scratch tls;
thread_local std::vector<Seq> tls_seqs;
thread_local std::vector<int64_t> tls_work;     // work index -> sequence
thread_local std::vector<float> tls_part;       // per item: m [G], l [G], acc [G, D]

INLINE int64_t idx(const void* p, int is64, int64_t i) {
    return is64 ? ((const int64_t*)p)[i] : (int64_t)((const int32_t*)p)[i];
}

template <int KT, int DD>
int decode_impl(const int64_t* L, const int64_t* S, const void* q, int64_t q_sb, int64_t q_sh, int q_dt,
                void* out, int o_dt, float scale, int G, int nthreads) {
    const void* kc0 = (const void*)L[L_K];
    const void* vc0 = (const void*)L[L_V];
    const int64_t k_ss = L[L_K_SLOT], k_sh = L[L_K_HEAD], v_ss = L[L_V_SLOT], v_sh = L[L_V_HEAD];
    const int H = (int)L[L_H], D = DD ? DD : (int)L[L_D], bs = (int)L[L_BS];
    const int64_t window = L[L_WINDOW], nslots = L[L_SLOTS];
    const void* bt = (const void*)S[S_BT];
    const int64_t bt_row = S[S_BT_ROW], W_ = S[S_BT_W];
    const int bt64 = (int)S[S_BT_64];
    const int B = (int)S[S_B];
    const int Hq = H * G;
    const int64_t esz = KT == DT_F32 ? 4 : 2, rbytes = (int64_t)D * esz;
    const bool vec = DD > 0 || D % W == 0;      // the vector path (else scalar rows)

    // The work list: (sequence, partition) pairs, each with H items (KV heads).
    std::vector<Seq>& seqs = tls_seqs;
    std::vector<int64_t>& work = tls_work;
    seqs.resize(B);
    work.clear();
    for (int b = 0; b < B; b++) {
        Seq& sq = seqs[b];
        sq.len = std::max<int64_t>(0, idx((const void*)S[S_LENS], (int)S[S_LENS_64], b));
        sq.lo = window > 0 ? std::max<int64_t>(0, sq.len - window) : 0;
        sq.first = sq.lo / PART;
        sq.n = sq.len > sq.lo ? (sq.len - 1) / PART - sq.first + 1 : 0;
        sq.item0 = (int64_t)work.size();
        if ((sq.len + bs - 1) / bs > W_) return -2;                    // longer than its block table
        for (int64_t p = 0; p < sq.n; p++) work.push_back(b);
    }
    const int64_t nwork = (int64_t)work.size(), items = nwork * H;
    const int64_t pstride = (int64_t)G * (D + 2);
    std::vector<float>& part = tls_part;
    if (part.size() < (size_t)(nwork * H * pstride)) part.resize((size_t)(nwork * H * pstride));
    float* partials = part.data();
    const int64_t* wk = work.data();
    const Seq* sqs = seqs.data();
    int bad = 0;

#pragma omp parallel num_threads((int)std::min<int64_t>(nthreads, items)) if (items > 1)
    {
        Scratch& sc = tls;
        sc.fit(G, D);
        float* __restrict s = sc.s.data();
        float* __restrict qf = sc.q.data();
        float* __restrict rb = sc.row.data();
        int64_t* __restrict koff = sc.koff.data();
        int64_t* __restrict voff = sc.voff.data();
        vf* __restrict vt = sc.t.data();
        // Item `it`: sequence b, keys [p0, p0 + n), KV head h.
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t wi = it / H;
            const int h = (int)(it % H);
            const int b = (int)wk[wi];
            const Seq& sq = sqs[b];
            const int64_t pi = sq.first + (wi - sq.item0);
            const int64_t p0 = std::max(sq.lo, pi * PART), p1 = std::min(sq.len, (pi + 1) * PART);
            const int n = (int)(p1 - p0);
            const void* kc = (const char*)kc0 + h * k_sh * esz;
            const void* vc = (const char*)vc0 + h * v_sh * esz;
            // The rows through the block table. They are cold (the weights
            // streamed through the caches since this layer's last step): the
            // first PF K rows are prefetched now, the score loop fetches the
            // rest PF rows ahead, and each V row as its K row is read (the
            // scalar path: all of them now).
            bool ok = true;
            for (int64_t p = p0; p < p1;) {
                const int64_t blk = idx(bt, bt64, (int64_t)b * bt_row + p / bs);
                if (blk < 0 || (blk + 1) * bs > nslots) { ok = false; break; }
                const int64_t j1 = std::min<int64_t>(bs, p % bs + (p1 - p));
                for (int64_t j = p % bs; j < j1; j++, p++) {
                    const int64_t ko = (blk * bs + j) * k_ss, vo = (blk * bs + j) * v_ss;
                    koff[p - p0] = ko;
                    voff[p - p0] = vo;
                    if (!vec || p - p0 < PF)   // the vector path prefetches the rest as it goes
                        for (int64_t c = 0; c < rbytes; c += 64) {
                            __builtin_prefetch((const char*)kc + ko * esz + c, 0, 3);
                            if (!vec) __builtin_prefetch((const char*)vc + vo * esz + c, 0, 3);
                        }
                }
            }
            if (!ok) {
#pragma omp atomic write
                bad = 1;
                continue;
            }
            for (int g = 0; g < G; g++) {      // scaled fp32 queries of the KV head's G query heads
                const int64_t qo = (int64_t)b * q_sb + (int64_t)(h * G + g) * q_sh;
                float* qg = qf + (int64_t)g * D;
                if (q_dt == DT_F32) {
                    const float* x = (const float*)q + qo;
                    for (int d = 0; d < D; d++) qg[d] = x[d] * scale;
                } else if (q_dt == DT_BF16) {
                    const uint16_t* x = (const uint16_t*)q + qo;
                    for (int d = 0; d < D; d++) qg[d] = bf2f(x[d]) * scale;
                } else {
                    for (int d = 0; d < D; d++) qg[d] = load1(q, qo + d, DT_F16) * scale;
                }
            }
            float* pm = partials + (wi * H + h) * pstride;   // m [G], l [G], acc [G, D]
            float* pl = pm + G;
            float* acc = pl + G;
            if (vec) {
                // Heads in tiles of up to 4: each K / V row is read once per tile.
                for (int g0 = 0; g0 < G; g0 += 4) {
                    const float* qt = qf + (int64_t)g0 * D;
                    float* st = s + (int64_t)g0 * PART;
                    float* at = acc + (int64_t)g0 * D;
                    switch (std::min(4, G - g0)) {
                        case 1:
                            scores<KT, DD, 1>(kc, koff, n, qt, st, vt, vc, voff, D);
                            break;
                        case 2:
                            scores<KT, DD, 2>(kc, koff, n, qt, st, vt, vc, voff, D);
                            break;
                        case 3:
                            scores<KT, DD, 3>(kc, koff, n, qt, st, vt, vc, voff, D);
                            break;
                        default:
                            scores<KT, DD, 4>(kc, koff, n, qt, st, vt, vc, voff, D);
                    }
                    for (int g = g0; g < std::min(G, g0 + 4); g++)
                        softmax_part(s + (int64_t)g * PART, n, pm[g], pl[g]);
                    switch (std::min(4, G - g0)) {
                        case 1: accum_v<KT, DD, 1>(vc, voff, n, st, at, D); break;
                        case 2: accum_v<KT, DD, 2>(vc, voff, n, st, at, D); break;
                        case 3: accum_v<KT, DD, 3>(vc, voff, n, st, at, D); break;
                        default: accum_v<KT, DD, 4>(vc, voff, n, st, at, D);
                    }
                }
            } else {
                // Any head dim: scalar rows.
                for (int i = 0; i < n; i++) {
                    const float* kr = rb;
                    for (int d = 0; d < D; d++) rb[d] = load1(kc, koff[i] + d, KT);
                    for (int g = 0; g < G; g++) s[(int64_t)g * PART + i] = dot_any(qf + (int64_t)g * D, kr, D);
                }
                for (int g = 0; g < G; g++) softmax_part(s + (int64_t)g * PART, n, pm[g], pl[g]);
                std::fill(acc, acc + (int64_t)G * D, 0.f);
                for (int i = 0; i < n; i++) {
                    for (int d = 0; d < D; d++) rb[d] = load1(vc, voff[i] + d, KT);
                    for (int g = 0; g < G; g++) axpy_any(acc + (int64_t)g * D, s[(int64_t)g * PART + i], rb, D);
                }
            }
        }
        // Merge each (sequence, KV head)'s partitions in order; a sequence
        // without keys gets zeros.
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < (int64_t)B * H; bh++) {
            const int b = (int)(bh / H), h = (int)(bh % H);
            const Seq& sq = sqs[b];
            for (int g = 0; g < G; g++) {
                float* o = rb;   // D floats
                float M = -INFINITY, l = 0.f;
                for (int64_t k = 0; k < sq.n; k++)
                    M = std::max(M, partials[((sq.item0 + k) * H + h) * pstride + g]);
                std::fill(o, o + D, 0.f);
                for (int64_t k = 0; k < sq.n; k++) {
                    const float* pm = partials + ((sq.item0 + k) * H + h) * pstride;
                    const float a = sq.n == 1 ? 1.f : std::exp(pm[g] - M);
                    l += a * pm[G + g];
                    axpy_any(o, a, pm + 2 * G + (int64_t)g * D, D);
                }
                const float inv = l > 0.f ? 1.f / l : 0.f;
                const int64_t oo = ((int64_t)b * Hq + h * G + g) * D;
                if (o_dt == DT_F32) {
                    float* y = (float*)out + oo;
                    for (int d = 0; d < D; d++) y[d] = o[d] * inv;
                } else if (o_dt == DT_BF16) {
                    uint16_t* y = (uint16_t*)out + oo;
                    for (int d = 0; d < D; d++) y[d] = f2bf(o[d] * inv);
                } else {
                    for (int d = 0; d < D; d++) store1(out, oo + d, DT_F16, o[d] * inv);
                }
            }
        }
    }
    return bad ? -3 : 0;
}

template <int KT>
int decode_kt(const int64_t* L, const int64_t* S, const void* q, int64_t q_sb, int64_t q_sh, int q_dt, void* out,
              float scale, int G, int nthreads) {
    // Head dims of the common models get their own builds; f16 caches
    // (rare on CPU) and other head dims the run-time one.
    if constexpr (KT == DT_F16) {
        return decode_impl<KT, 0>(L, S, q, q_sb, q_sh, q_dt, out, q_dt, scale, G, nthreads);
    } else {
        switch (L[L_D]) {
            case 64:
                return decode_impl<KT, 64>(L, S, q, q_sb, q_sh, q_dt, out, q_dt, scale, G, nthreads);
            case 128:
                return decode_impl<KT, 128>(L, S, q, q_sb, q_sh, q_dt, out, q_dt, scale, G, nthreads);
            case 256:
                return decode_impl<KT, 256>(L, S, q, q_sb, q_sh, q_dt, out, q_dt, scale, G, nthreads);
            default:
                return decode_impl<KT, 0>(L, S, q, q_sb, q_sh, q_dt, out, q_dt, scale, G, nthreads);
        }
    }
}

}  // namespace

extern "C" {

int dense_cpu_partition() { return PART; }

// Decode attention. layer: int64 [LAYER_N] (k / v stores [slots, H, D] with
// their slot and head strides, unit last stride; dtype DT_*; H, D, block
// size, sliding window (0: none), slots); step: int64 [STEP_N] (block tables
// [B, W] int32 / int64 with their row stride, lengths [B] int32 / int64, B);
// q [B, H * G, D] (dtype q_dt, strides q_sb, q_sh, unit last stride) -> out
// [B, H * G, D] contiguous, q's dtype. A key at position p is visible iff
// len - window <= p < len. Returns 0; -1 a bad argument, -2 a length past
// its block table, -3 a block number outside the cache.
int dense_cpu_decode(const int64_t* layer, const int64_t* step, const void* q, int64_t q_sb, int64_t q_sh, int q_dt,
                     void* out, float scale, int G, int nthreads) {
    if (G < 1 || layer[L_D] < 1 || layer[L_BS] < 1 || q_dt < DT_F32 || q_dt > DT_F16) return -1;
    nthreads = std::max(1, nthreads);
    switch (layer[L_DTYPE]) {
        case DT_F32:
            return decode_kt<DT_F32>(layer, step, q, q_sb, q_sh, q_dt, out, scale, G, nthreads);
        case DT_BF16:
            return decode_kt<DT_BF16>(layer, step, q, q_sb, q_sh, q_dt, out, scale, G, nthreads);
        case DT_F16:
            return decode_kt<DT_F16>(layer, step, q, q_sb, q_sh, q_dt, out, scale, G, nthreads);
        default:
            return -1;
    }
}

// The store: k / v [T, H, D] (dtype src_dt, strides (t, head), unit last
// stride) into the layer's rows at slots [T] (int32 / int64), converted to
// the cache's dtype (round to nearest even): index_copy_ of both. Returns 0,
// or -1 (nothing written) when a slot is outside the cache.
int dense_cpu_store(const int64_t* layer, const void* slots, int slots64, int64_t T, const void* k, int64_t k_st,
                    int64_t k_sh, const void* v, int64_t v_st, int64_t v_sh, int src_dt, int nthreads) {
    const int H = (int)layer[L_H], D = (int)layer[L_D], dt = (int)layer[L_DTYPE];
    const int64_t nslots = layer[L_SLOTS];
    for (int64_t t = 0; t < T; t++) {
        const int64_t sl = idx(slots, slots64, t);
        if (sl < 0 || sl >= nslots) return -1;
    }
    if (src_dt < DT_F32 || src_dt > DT_F16 || dt < DT_F32 || dt > DT_F16) return -1;
    void* kc = (void*)layer[L_K];
    void* vc = (void*)layer[L_V];
    const int64_t ss[2] = {layer[L_K_SLOT], layer[L_V_SLOT]}, sh[2] = {layer[L_K_HEAD], layer[L_V_HEAD]};
    const int64_t st[2] = {k_st, v_st}, sht[2] = {k_sh, v_sh};
    const void* src[2] = {k, v};
    void* dst[2] = {kc, vc};
    const size_t esz = dt == DT_F32 ? 4 : 2;
    auto rows = [&](int64_t t) {
        const int64_t sl = idx(slots, slots64, t);
        for (int c = 0; c < 2; c++)
            for (int h = 0; h < H; h++) {
                const int64_t so = t * st[c] + h * sht[c], dof = sl * ss[c] + h * sh[c];
                if (src_dt == dt) {
                    std::memcpy((char*)dst[c] + dof * esz, (const char*)src[c] + so * esz, D * esz);
                } else {
                    for (int d = 0; d < D; d++) store1(dst[c], dof + d, dt, load1(src[c], so + d, src_dt));
                }
            }
    };
    if (T * H * D < (1 << 16) || nthreads <= 1) {     // a decode step's few rows: no thread team
        for (int64_t t = 0; t < T; t++) rows(t);
    } else {
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t t = 0; t < T; t++) rows(t);
    }
    return 0;
}

}  // extern "C"
