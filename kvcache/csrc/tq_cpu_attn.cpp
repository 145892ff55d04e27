// CPU attention over TurboQuant / int8 / f16 paged KV blocks: the compiled
// counterpart of TQLayerCache._attend_torch (same math, tested against it).
//
// One work item = (sequence, KV head, tile of query rows). It walks the
// sequence's blocks through the block table, decodes each block of keys and
// values once into a small float buffer shared by all rows of the tile (a
// byte -> centroids lookup for 2/4-bit codes, a 24-bit word for 3-bit), and
// keeps an online softmax per row, returning each row's output and
// log-sum-exp (so a hot-token cache's CODED and HOT passes can be merged).
// Nothing larger than one block is ever decoded. Plain C ABI (called through
// ctypes): no torch headers, so it builds in about a second.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

extern "C" {

struct TQComp {
    int32_t kind;    // 0 f16, 1 int8, 2 tq
    int32_t bits;
    int32_t group;   // values per scale (tq); head_dim for int8
    int32_t pad;
    const void* data;          // [slots, H, row] f16 / int8 / packed uint8
    int64_t d_slot, d_head;    // element strides
    const uint16_t* scale;     // [slots, H, D / group] fp16 (int8, tq)
    int64_t s_slot, s_head;
    const float* codebook;     // [2**bits] (tq)
};

// One pass over a set of keys: which keys (part), from which stores, through
// which block tables and columns. A call runs one or more passes over
// disjoint key sets into the same online softmax (a hot-token cache's CODED
// and HOT passes in one call).
struct TQPass {
    const TQComp* k;
    const TQComp* v;
    const int64_t* k_tables;   // [B, width]
    const int64_t* v_tables;   // [B, width] (the same pointer unless hot keys sit beside coded values)
    int64_t width;
    const int64_t* cols;       // [B, ncols] block-table columns to read
    int64_t ncols;
    int32_t part;              // PART_*
    int32_t pad;
};

}  // extern "C"

namespace {

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
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
#endif
}

// Per-component decoder: lookup tables built once per call.
struct Decoder {
    TQComp c;
    int D;
    std::vector<float> lut;   // 2/4-bit: [256][8 / bits] centroids of one byte's codes

    Decoder(const TQComp& comp, int head_dim) : c(comp), D(head_dim) {
#ifdef __AVX2__
        const bool byte_lut = c.kind == 2 && c.bits == 2;   // 3 / 4 bits decode in registers
#else
        const bool byte_lut = c.kind == 2 && (c.bits == 2 || c.bits == 4);
#endif
        if (byte_lut) {
            int per = 8 / c.bits, mask = (1 << c.bits) - 1;
            lut.resize(256 * per);
            for (int b = 0; b < 256; b++)
                for (int i = 0; i < per; i++) lut[b * per + i] = c.codebook[(b >> (c.bits * i)) & mask];
        }
    }

    // Rotated vector of (slot, head) -> out[D].
    template <int DD>
    inline void decode(int64_t slot, int h, float* __restrict out) const {
        if (c.kind == 0) {
            const uint16_t* x = (const uint16_t*)c.data + slot * c.d_slot + h * c.d_head;
            for (int d = 0; d < DD; d++) out[d] = h2f(x[d]);
            return;
        }
        const uint16_t* sc = c.scale + slot * c.s_slot + h * c.s_head;
        if (c.kind == 1) {
            const int8_t* x = (const int8_t*)c.data + slot * c.d_slot + h * c.d_head;
            float s = h2f(sc[0]);
            for (int d = 0; d < DD; d++) out[d] = (float)x[d] * s;
            return;
        }
        const uint8_t* p = (const uint8_t*)c.data + slot * c.d_slot + h * c.d_head;
        if (c.bits == 4) {
#ifdef __AVX2__
            // 16 centroids in two registers: 8 codes (one 32-bit word) per
            // shift, two permutes and a blend on the code's bit 3.
            const __m256 lo = _mm256_loadu_ps(c.codebook), hi = _mm256_loadu_ps(c.codebook + 8);
            const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
            for (int j = 0; j < DD / 8; j++) {
                uint32_t w;
                std::memcpy(&w, p + 4 * j, 4);
                const __m256i idx = _mm256_srlv_epi32(_mm256_set1_epi32((int)w), shifts);
                const __m256 sel = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));   // bit 3 -> sign
                _mm256_storeu_ps(out + 8 * j, _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx),
                                                               _mm256_permutevar8x32_ps(hi, idx), sel));
            }
#else
            const float* t = lut.data();
            for (int j = 0; j < DD / 2; j++) {
                const float* e = t + 2 * p[j];
                out[2 * j] = e[0];
                out[2 * j + 1] = e[1];
            }
#endif
        } else if (c.bits == 2) {
            const float* t = lut.data();
            for (int j = 0; j < DD / 4; j++) {
                const float* e = t + 4 * p[j];
                out[4 * j] = e[0]; out[4 * j + 1] = e[1]; out[4 * j + 2] = e[2]; out[4 * j + 3] = e[3];
            }
        } else if (c.bits == 3) {   // 8 codes in each little-endian 24-bit word
            const float* cb = c.codebook;
#ifdef __AVX2__
            // The 8 centroids fit one register: one shift, mask and permute per word.
            const __m256 cbv = _mm256_loadu_ps(cb);
            const __m256i shifts = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21), m7 = _mm256_set1_epi32(7);
            for (int j = 0; j < DD / 8; j++) {
                uint32_t w = p[3 * j] | (uint32_t)p[3 * j + 1] << 8 | (uint32_t)p[3 * j + 2] << 16;
                const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), shifts), m7);
                _mm256_storeu_ps(out + 8 * j, _mm256_permutevar8x32_ps(cbv, idx));
            }
#else
            for (int j = 0; j < DD / 8; j++) {
                uint32_t w = p[3 * j] | (uint32_t)p[3 * j + 1] << 8 | (uint32_t)p[3 * j + 2] << 16;
                for (int i = 0; i < 8; i++) out[8 * j + i] = cb[(w >> (3 * i)) & 7];
            }
#endif
        } else {   // any other width <= 8: 8 codes in each `bits`-byte word
            const float* cb = c.codebook;
            const int nb = c.bits;
            const uint64_t mask = (1u << nb) - 1;
            for (int j = 0; j < DD / 8; j++) {
                uint64_t w = 0;
                for (int i = 0; i < nb; i++) w |= (uint64_t)p[nb * j + i] << (8 * i);
                for (int i = 0; i < 8; i++) out[8 * j + i] = cb[(w >> (nb * i)) & mask];
            }
        }
        const int g = c.group, ng = DD / g;
        for (int k = 0; k < ng; k++) {
            float s = h2f(sc[k]);
            for (int d = 0; d < g; d++) out[k * g + d] *= s;
        }
    }
};

// Which keys a pass reads (TQLayerCache's ALL / CODED / HOT), for a query at
// position p with own-block start o = p / bs * bs: ALL every key, CODED keys in
// [sink, o), HOT the rest (keys < sink or >= o): CODED narrows a row's key
// range, HOT punches the hole [sink, o) into it. sink is a block start too,
// so a hole is whole blocks: a row skips a block, never tests single keys.
enum { PART_ALL = 0, PART_CODED = 1, PART_HOT = 2 };

struct PassDec {     // a TQPass with its decoders built
    TQPass p;
    Decoder kd, vd;
    PassDec(const TQPass& pass, int D) : p(pass), kd(*pass.k, D), vd(*pass.v, D) {}
};

template <int DD>
void attend_impl(const std::vector<PassDec>& passes, const float* q, float* out, float* lse, int B, int H,
                 int G, int Lq, int bs, const int64_t* qpos, const int64_t* klim, const int64_t* seq_lens,
                 int64_t window, int64_t sink, int nthreads, int row_tile) {
    // An item takes a tile of query tokens with all G query heads of one KV
    // head, so each decoded block serves G * tile rows.
    const int R = G * Lq;
    const int tiles = (Lq + row_tile - 1) / row_tile;
    const int64_t items = (int64_t)B * H * tiles;
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<float> kb((size_t)bs * DD), vb((size_t)bs * DD), s((size_t)bs);
        const int maxr = G * row_tile;
        std::vector<float> m(maxr), l(maxr), acc((size_t)maxr * DD);
        std::vector<const float*> qrow(maxr);
        // Per query token of the tile: visible keys [lo, hi) minus the blocks in [hlo, hhi).
        std::vector<int64_t> lo(row_tile), hi(row_tile), hlo(row_tile), hhi(row_tile);
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int t = it % tiles;
            const int h = (it / tiles) % H;
            const int b = it / ((int64_t)tiles * H);
            const int l0 = t * row_tile, nt = std::min(row_tile, Lq - l0), nr = G * nt;
            const int64_t* qp = qpos + (int64_t)b * Lq + l0;
            const int64_t* kl = klim ? klim + (int64_t)b * Lq + l0 : qp;   // each row's last key
            const int64_t slen = seq_lens[b];
            int64_t qmax = qp[0], qmin = qp[0], kmax = kl[0];
            for (int i = 1; i < nt; i++) {
                qmax = std::max(qmax, qp[i]);
                qmin = std::min(qmin, qp[i]);
                kmax = std::max(kmax, kl[i]);
            }
            const int64_t base = ((int64_t)b * H + h) * R;
            for (int r = 0; r < nr; r++) {
                const int g = r / nt, lq = l0 + r % nt;
                qrow[r] = q + (base + (int64_t)g * Lq + lq) * DD;
            }
            std::fill(m.begin(), m.begin() + nr, -INFINITY);
            std::fill(l.begin(), l.begin() + nr, 0.f);
            std::fill(acc.begin(), acc.begin() + (size_t)nr * DD, 0.f);
            for (const PassDec& pd : passes) {
                const TQPass& ps = pd.p;
                const int part = ps.part;
                for (int i = 0; i < nt; i++) {
                    const int64_t p = qp[i], own = p / bs * bs;
                    lo[i] = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
                    hi[i] = std::min(slen, kl[i] + 1);
                    hlo[i] = hhi[i] = 0;
                    if (part == PART_CODED) {
                        lo[i] = std::max(lo[i], sink);
                        hi[i] = std::min(hi[i], own);
                    } else if (part == PART_HOT) {
                        hlo[i] = sink;
                        hhi[i] = std::max(own, sink);
                    }
                }
                // Keys [kbeg, kend) may be seen by some row; blocks inside
                // [sink, hole_end) are in every row's HOT hole. CODED keys lie
                // below each row's own block: limits past it do not matter.
                int64_t kend = std::min(slen, kmax + 1);
                int64_t kbeg = window > 0 ? std::max<int64_t>(0, qmin - window + 1) : 0;
                if (part == PART_CODED) {
                    kbeg = std::max(kbeg, sink);
                    kend = std::min(kend, qmax / bs * bs);
                }
                const int64_t hole_end = part == PART_HOT ? qmin / bs * bs : 0;
                for (int64_t ci = 0; ci < ps.ncols; ci++) {
                    const int64_t col = ps.cols[(int64_t)b * ps.ncols + ci];
                    const int64_t p0 = col * bs;
                    if (p0 >= kend || p0 + bs <= kbeg || (p0 >= sink && p0 + bs <= hole_end)) continue;
                    const int64_t tcol = (int64_t)b * ps.width + std::min(col, ps.width - 1);
                    const int64_t kblk = ps.k_tables[tcol] * bs, vblk = ps.v_tables[tcol] * bs;
                    // Only keys [j0, n) of this block can be visible to a row of the tile.
                    const int j0 = (int)std::max<int64_t>(0, kbeg - p0);
                    const int n = (int)std::min<int64_t>(bs, kend - p0);
                    for (int j = j0; j < n; j++) {
                        pd.kd.template decode<DD>(kblk + j, h, kb.data() + (size_t)j * DD);
                        pd.vd.template decode<DD>(vblk + j, h, vb.data() + (size_t)j * DD);
                    }
                    for (int r = 0; r < nr; r++) {
                        const int i = r % nt;
                        const int jlo = (int)std::max<int64_t>(j0, lo[i] - p0);
                        const int jhi = (int)std::min<int64_t>(n, hi[i] - p0);
                        // p0 in [hlo, hhi) as one unsigned compare (never true for an empty hole)
                        if (jlo >= jhi || (uint64_t)(p0 - hlo[i]) < (uint64_t)(hhi[i] - hlo[i])) continue;
                        const float* qr = qrow[r];
                        float mx = -INFINITY;
                        for (int j = jlo; j < jhi; j++) {
                            const float* kr = kb.data() + (size_t)j * DD;
                            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                            for (int d = 0; d < DD; d++) dot += qr[d] * kr[d];
                            s[j] = dot;
                            mx = std::max(mx, dot);
                        }
                        float* a = acc.data() + (size_t)r * DD;
                        if (mx > m[r]) {
                            const float alpha = std::exp(m[r] - mx);   // exp(-inf) = 0 on the first block
                            l[r] *= alpha;
#pragma omp simd
                            for (int d = 0; d < DD; d++) a[d] *= alpha;
                            m[r] = mx;
                        }
                        float sum = 0.f;
                        for (int j = jlo; j < jhi; j++) {
                            const float p = std::exp(s[j] - m[r]);
                            sum += p;
                            const float* vr = vb.data() + (size_t)j * DD;
#pragma omp simd
                            for (int d = 0; d < DD; d++) a[d] += p * vr[d];
                        }
                        l[r] += sum;
                    }
                }
            }
            for (int r = 0; r < nr; r++) {   // a row that saw no key: output 0, lse -inf
                const bool seen = l[r] > 0.f;
                const float inv = seen ? 1.f / l[r] : 0.f;
                const int64_t row = (qrow[r] - q) / DD;
                float* o = out + row * DD;
                for (int d = 0; d < DD; d++) o[d] = acc[(size_t)r * DD + d] * inv;
                lse[row] = seen ? m[r] + std::log(l[r]) : -INFINITY;
            }
        }
    }
}

}  // namespace

extern "C" {

// q, out: [B, H, G, Lq, D] float32 contiguous (rotated, scaled queries / rotated
// output); lse: [B, H, G, Lq] float32, the log-sum-exp of each row's scores
// (-inf, with output 0, for a row that sees no key), over the union of the
// npasses passes' keys (see TQPass; part: 0 all keys, 1 coded, 2 hot, see
// PART_*); qpos: [B, Lq]; klim: [B, Lq] each query's last visible key (a
// bidirectional span; the window still counts from qpos) or null: causal;
// window 0 = none; sink: tokens of the hot first block (0 or bs). Returns 0,
// or -1 for an unsupported head_dim, part or sink.
int tq_cpu_attend(const TQPass* passes, int npasses, const float* q, float* out, float* lse, int B, int H,
                  int G, int Lq, int D, int bs, const int64_t* qpos, const int64_t* klim, const int64_t* seq_lens,
                  int64_t window, int sink, int nthreads, int row_tile) {
    if (sink % bs) return -1;
    std::vector<PassDec> pd;
    for (int i = 0; i < npasses; i++) {
        if (passes[i].part < PART_ALL || passes[i].part > PART_HOT) return -1;
        pd.emplace_back(passes[i], D);
    }
#define TQ_CASE(DD)                                                                                        \
    case DD:                                                                                               \
        attend_impl<DD>(pd, q, out, lse, B, H, G, Lq, bs, qpos, klim, seq_lens, window, sink, nthreads, row_tile); \
        return 0;
    switch (D) {
        TQ_CASE(8)
        TQ_CASE(16)
        TQ_CASE(32)
        TQ_CASE(64)
        TQ_CASE(128)
        TQ_CASE(256)
        TQ_CASE(512)
        default:
            return -1;
    }
#undef TQ_CASE
}

}  // extern "C"
