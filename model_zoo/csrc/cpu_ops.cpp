// Row-wise ops of a decode step on the CPU (model_zoo/cpu_ops.py): RMSNorm,
// rotary embedding, gated activations. Each is one call over the whole
// batch instead of 3-10 torch ops: at decode a row is a few hundred values,
// so torch's per-op dispatch, not the arithmetic, was the cost (~14 us per
// RMSNorm against ~1 us here).
//
// Numerics follow the torch code they replace (model_zoo/layers.py), step
// by step: fp32 arithmetic, rounded to bf16 exactly where torch rounds (a
// bf16 tensor op computes in fp32 and rounds its result once). Sums run in
// a fixed order per row, so a row's result never depends on the batch.
// Plain C ABI called through ctypes: no torch headers.
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float bf2f(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Round to nearest even, as torch's float -> bfloat16 conversion.
inline uint16_t f2bf(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    // A select, not a branch, so that loops over rows vectorise; NaN stays NaN.
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, nan = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : r);
}

// The value a bf16 tensor would hold (identity for fp32).
template <bool BF>
inline float rnd(float f) {
    return BF ? bf2f(f2bf(f)) : f;
}

template <bool BF>
inline float load(const void* p, int64_t i) {
    return BF ? bf2f(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

template <bool BF>
inline void store(void* p, int64_t i, float f) {
    if (BF) ((uint16_t*)p)[i] = f2bf(f);
    else ((float*)p)[i] = f;
}

// exp(x) for the activations: Cody-Waite range reduction and a degree-6
// polynomial (~1 ulp on [-87, 88]); branch-free, so the loops vectorise.
inline float fast_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);   // not fmin / fmax: those do not vectorise
    const float n = std::floor(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t e = ((int32_t)n + 127) << 23;
    float s;
    std::memcpy(&s, &e, 4);
    return p * s;
}

template <bool BF>
void rms_norm_rows(const void* x, int64_t outer, int64_t inner, int64_t so, int64_t si, void* out, int64_t d,
                   const void* w, bool w_bf, float offset, float eps, int mode, int nthreads) {
    const int64_t n = outer * inner;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n * d >= 65536)
    for (int64_t r = 0; r < n; r++) {
        const int64_t base = (r / inner) * so + (r % inner) * si;
        float acc[16] = {0};
        int64_t i = 0;
        for (; i + 16 <= d; i += 16)
            for (int l = 0; l < 16; l++) {
                const float v = load<BF>(x, base + i + l);
                acc[l] += v * v;
            }
        for (; i < d; i++) {
            const float v = load<BF>(x, base + i);
            acc[i & 15] += v * v;
        }
        for (int s = 8; s >= 1; s /= 2)
            for (int l = 0; l < s; l++) acc[l] += acc[l + s];
        const float inv = 1.0f / std::sqrt(acc[0] / (float)d + eps);
        // llama: weight * x_normed.to(dtype); gemma: x_normed * (offset + w) in fp32, rounded once.
        const uint16_t* wb = (const uint16_t*)w;
        const float* wf = (const float*)w;
        if (mode == 0 && w_bf)
#pragma omp simd
            for (int64_t j = 0; j < d; j++) store<BF>(out, r * d + j, rnd<BF>(load<BF>(x, base + j) * inv) * bf2f(wb[j]));
        else if (mode == 0)
#pragma omp simd
            for (int64_t j = 0; j < d; j++) store<BF>(out, r * d + j, rnd<BF>(load<BF>(x, base + j) * inv) * wf[j]);
        else if (w_bf)
#pragma omp simd
            for (int64_t j = 0; j < d; j++) store<BF>(out, r * d + j, load<BF>(x, base + j) * inv * (offset + bf2f(wb[j])));
        else
#pragma omp simd
            for (int64_t j = 0; j < d; j++) store<BF>(out, r * d + j, load<BF>(x, base + j) * inv * (offset + wf[j]));
    }
}

template <bool BF>
void rope_rows(const void* x, int64_t t, int64_t xs, int64_t h, int64_t d, const void* cs, const void* sn,
               int64_t cstride, void* out, int nthreads) {
    const int64_t half = d / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (t * h * d >= 65536)
    for (int64_t i = 0; i < t; i++) {
        for (int64_t j = 0; j < h; j++) {
            const int64_t xb = i * xs + j * d, ob = (i * h + j) * d;
            // x * cos + roll(x, d / 2) * sin, sin holding rotate_half's sign (layers.RotaryEmbedding).
#pragma omp simd
            for (int64_t e = 0; e < half; e++)
                store<BF>(out, ob + e, rnd<BF>(load<BF>(x, xb + e) * load<BF>(cs, i * cstride + e)) +
                                       rnd<BF>(load<BF>(x, xb + e + half) * load<BF>(sn, i * cstride + e)));
#pragma omp simd
            for (int64_t e = half; e < d; e++)
                store<BF>(out, ob + e, rnd<BF>(load<BF>(x, xb + e) * load<BF>(cs, i * cstride + e)) +
                                       rnd<BF>(load<BF>(x, xb + e - half) * load<BF>(sn, i * cstride + e)));
        }
    }
}

template <bool BF>
void act_mul_rows(const void* x, int64_t n, int64_t xs, int64_t h, void* out, int act, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n * h >= 65536)
    for (int64_t i = 0; i < n; i++) {
        const int64_t xb = i * xs, ob = i * h;
        if (act == 0) {
#pragma omp simd
            for (int64_t j = 0; j < h; j++) {
                const float g = load<BF>(x, xb + j);
                store<BF>(out, ob + j, rnd<BF>(g / (1.0f + fast_exp(-g))) * load<BF>(x, xb + h + j));   // silu
            }
        } else {
#pragma omp simd
            for (int64_t j = 0; j < h; j++) {
                // gelu, tanh approximation: 0.5 (1 + tanh z) = sigmoid(2z), without 1 + tanh's cancellation.
                const float g = load<BF>(x, xb + j), z = 0.7978845608028654f * (g + 0.044715f * g * g * g);
                store<BF>(out, ob + j, rnd<BF>(g / (1.0f + fast_exp(-2.0f * z))) * load<BF>(x, xb + h + j));
            }
        }
    }
}

}  // namespace

extern "C" {

// Rows r = (o, i) of x at o * so + i * si (elements; o < outer, i < inner),
// each of d values -> out [outer * inner, d] contiguous. w: [d] fp32 or bf16.
// mode 0: w * round(x_normed) (Llama); 1: x_normed * (offset + w) (Gemma).
int cpu_rms_norm(const void* x, int64_t outer, int64_t inner, int64_t so, int64_t si, void* out, int64_t d,
                 int bf16, const void* w, int w_bf16, float offset, float eps, int mode, int nthreads) {
    if (d <= 0 || (mode != 0 && mode != 1)) return 1;
    if (bf16) rms_norm_rows<true>(x, outer, inner, so, si, out, d, w, w_bf16, offset, eps, mode, nthreads);
    else rms_norm_rows<false>(x, outer, inner, so, si, out, d, w, w_bf16, offset, eps, mode, nthreads);
    return 0;
}

// x: t tokens at row stride xs, h heads of d each (contiguous within a token)
// -> out [t, h * d]. cos / sin: [t, d] at row stride cstride, in x's dtype.
int cpu_rope(const void* x, int64_t t, int64_t xs, int64_t h, int64_t d, const void* cs, const void* sn,
             int64_t cstride, void* out, int bf16, int nthreads) {
    if (d <= 0 || d % 2) return 1;
    if (bf16) rope_rows<true>(x, t, xs, h, d, cs, sn, cstride, out, nthreads);
    else rope_rows<false>(x, t, xs, h, d, cs, sn, cstride, out, nthreads);
    return 0;
}

// x: n rows [gate (h) | up (h)] at row stride xs -> out [n, h] = act(gate) * up.
// act 0: silu; 1: gelu (tanh approximation).
int cpu_act_and_mul(const void* x, int64_t n, int64_t xs, int64_t h, void* out, int act, int bf16, int nthreads) {
    if (h <= 0 || (act != 0 && act != 1)) return 1;
    if (bf16) act_mul_rows<true>(x, n, xs, h, out, act, nthreads);
    else act_mul_rows<false>(x, n, xs, h, out, act, nthreads);
    return 0;
}

}  // extern "C"
