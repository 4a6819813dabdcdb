/* The blockwise codecs' arithmetic in one pass per array (dtrain/codecs/native.py loads it).
 *
 * Same numbers as the torch path of dtrain/codecs/blockwise.py, bit for bit (tests compare
 * them): scale_b = max|x_b| / qmax in float32, nudged down one ulp where qmax * scale_b >
 * max|x_b| in a chunk of `step` elements whose largest |x| is above 1e37; code = x / scale_b
 * (a zero scale divides by 1) rounded half to even and clamped to [-qmax, qmax]; decoding is
 * code * scale_b. Built with -ffp-contract=off so that no multiply and add fuse.
 *
 * Settling in place (error feedback, dtrain/rounds/error_feedback.py): bw_encode can leave
 * x[i] - code * scale in x (the value and rounding of bw_decode's subtraction), and bw_decode
 * undoes that exactly (BW_UNSETTLE: x[i] + code * scale where code != 0). Exact because the
 * encode rounds to nearest: for code q != 0, x / scale lies within q +- 1/2 (|q| >= 1), so x and
 * d = fl(q * scale) are within a factor 2 of each other and x - d is exact (Sterbenz's
 * lemma, subnormals included); (x - d) + d is then x itself. For q = 0, d = +0 and x - d is x
 * (bit for bit, -0 too), so it is left alone. ef_accumulate_encode is ef_accumulate and then
 * bw_encode in one pass over memory, with the same numbers (the engine encodes in the
 * pseudo-gradient's pass: dtrain/rounds/reduce.py).
 *
 * The outer step (bw_decode_sgd): torch._fused_sgd_'s float32 CPU arithmetic (torch 2.13,
 * aten/src/ATen/native/cpu/FusedSGDKernel.cpp `sgd_math`) with the gradient decoded in the same
 * pass instead of read from a tensor. torch steps a tensor of n elements in two forms, found by
 * comparing bits: its vector loop (n - n % 16 elements) and the part of its scalar tail that
 * its compiler vectorized (8 at a time) both round as buf' = fma(1 - dampening, g, buf *
 * momentum), Nesterov g' = fma(buf', momentum, g), θ' = fma(g', -lr, θ), weight decay g =
 * fma(θ, wd, g); the last n % 8 elements as buf' = fma(buf, momentum, g * (1 - dampening)),
 * the rest alike. So this takes the first n - n % width elements in the first form and the rest
 * in the second; width is the caller's (dtrain/codecs/native.py finds the one that gives
 * torch's bits on this machine, or uses torch). fmaf is exact (one rounding) whether or not the
 * clone has FMA instructions.
 *
 * Codes: int8 (qmax 127), one byte each; int4 (qmax 7), nibble = code + 8, element 2i in the
 * low nibble of byte i and 2i+1 in the high one, an odd tail padded with nibble 8.
 *
 * Payload rows (bw_seal_rows, bw_check_headers): a payload is a 32-byte header (the 28-byte
 * prefix dtrain/codecs/base.py `_HEADER` packs, then the crc32 of the body, little-endian)
 * and its body. The crc32 is zlib's, computed by the function the caller passes (zlib-ng's
 * `zng_crc32`, the one dtrain/codecs/base.py calls from Python), so that no second crc32
 * implementation exists.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BW_VERSION 8
#define NUDGE_ABOVE 1e37 /* blockwise._NUDGE_ABOVE */
#define ROUND_MAGIC 12582912.0f /* 1.5 * 2^23: (q + M) - M is q rounded half to even for |q| < 2^22 */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(BW_BASELINE_ONLY)
/* an AVX2 copy of each kernel beside the baseline one, picked at load time by the CPU */
#define BW_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define BW_CLONES
#endif

int bw_version(void) { return BW_VERSION; }

/* max |x[i]| over n floats as its bit pattern; >= 0x7f800000 when one is inf or NaN. */
static int32_t absmax_bits(const int32_t *u, int64_t n) {
    int32_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t v = u[i] & 0x7fffffff;
        m = v > m ? v : m;
    }
    return m;
}

static float as_float(int32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* codes of x[0:n) with divisor d (q = x / d, rounded half to even, clamped) as floats in q[] */
static void quantize(const float *x, int64_t n, float d, float qmax, float *q) {
    for (int64_t i = 0; i < n; i++) {
        float v = (x[i] / d + ROUND_MAGIC) - ROUND_MAGIC;
        v = v > qmax ? qmax : v;
        q[i] = v < -qmax ? -qmax : v;
    }
}

/* quantize, and x[i] -= q[i] * sc: bw_decode's subtraction, q[i] being its (float)code */
static void quantize_settle(float *x, int64_t n, float d, float qmax, float sc, float *q) {
    for (int64_t i = 0; i < n; i++) {
        float v = (x[i] / d + ROUND_MAGIC) - ROUND_MAGIC;
        v = v > qmax ? qmax : v;
        v = v < -qmax ? -qmax : v;
        q[i] = v;
        x[i] = x[i] - v * sc;
    }
}

/* The second half of one step [s, t) of bw_encode: scales[] holds each block's max |x| (as
 * absmax_bits gives it), top the largest; each block's scale (nudged as the header says), then its
 * codes (settle: and x settled). */
static inline void quantize_step(float *x, int64_t s, int64_t t, int64_t bs, int int4, float *scales, uint8_t *codes,
                                 float *q, int settle, int32_t top) {
    const float qmax = int4 ? 7.0f : 127.0f;
    int64_t b0 = s / bs, nb = (t - s + bs - 1) / bs;
    int nudge = (double)as_float(top) > NUDGE_ABOVE;
    for (int64_t b = 0; b < nb; b++) {
        int64_t o = s + b * bs, e = o + bs < t ? bs : t - o;
        float absmax = scales[b0 + b], sc = absmax / qmax;
        if (nudge && sc * qmax > absmax) sc = nextafterf(sc, 0.0f);
        scales[b0 + b] = sc;
        if (settle)
            quantize_settle(x + o, e, sc == 0.0f ? 1.0f : sc, qmax, sc, q);
        else
            quantize(x + o, e, sc == 0.0f ? 1.0f : sc, qmax, q);
        if (!int4) {
            int8_t *c = (int8_t *)codes + o;
            for (int64_t i = 0; i < e; i++) c[i] = (int8_t)(int32_t)q[i];
        } else { /* o is even: block sizes are */
            uint8_t *c = codes + o / 2;
            int64_t i = 0;
            for (; i + 1 < e; i += 2) c[i / 2] = (uint8_t)((int32_t)q[i] + 8 + 16 * ((int32_t)q[i + 1] + 8));
            if (i < e) c[i / 2] = (uint8_t)((int32_t)q[i] + 8 + 16 * 8);
        }
    }
}

/* Encode n floats (xv: float32) into scales[ceil(n / bs)] and codes (n bytes for int8,
 * ceil(n / 2) for int4). step: a multiple of bs (the torch path's chunk). q: scratch of
 * bs floats. settle != 0: x is left settled (x[i] - code[i] * scale, block by block; see the
 * header). Returns 0, or -1 when x holds inf or NaN (nothing else is promised then; with
 * settle, the blocks before the first such chunk of `step` elements are settled). */
BW_CLONES int bw_encode(void *xv, int64_t n, int64_t bs, int64_t step, int int4, float *scales, uint8_t *codes,
                        float *q, int settle) {
    float *x = (float *)xv;
    for (int64_t s = 0; s < n; s += step) {
        int64_t t = s + step < n ? s + step : n;
        int32_t top = 0;
        for (int64_t o = s; o < t; o += bs) {
            int32_t m = absmax_bits((const int32_t *)x + o, o + bs < t ? bs : t - o);
            if (m >= 0x7f800000) return -1;
            top = m > top ? m : top;
            scales[o / bs] = as_float(m);
        }
        quantize_step(x, s, t, bs, int4, scales, codes, q, settle, top);
    }
    return 0;
}

/* r[i] = r[i] * decay + (theta[i] - x[i]) for i < n (ef_accumulate's arithmetic, below);
 * returns max |r[i]| afterwards as absmax_bits gives it */
static inline int32_t accumulate_absmax(float *r, const float *theta, const float *x, int64_t n, float decay) {
    int32_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        float v = (decay == 1.0f ? r[i] : r[i] * decay) + (theta[i] - x[i]);
        int32_t b;
        memcpy(&b, &v, 4);
        b &= 0x7fffffff;
        m = b > m ? b : m;
        r[i] = v;
    }
    return m;
}

/* Error feedback's accumulation and bw_encode in one pass over a bucket's n elements: block by
 * block, r[i] = r[i] * decay + (theta[i] - x[i]) (ef_accumulate's numbers) and the block's max
 * |r|; then each step (`step` elements, in cache) encoded from r (bw_encode's numbers; settle: r
 * left settled). x is the model's tensors piecewise: segment k is xs[k][0 : offs[k + 1] - offs[k])
 * at bucket elements [offs[k], offs[k + 1]), offs[0] = 0, offs[nseg] = n. Returns 0, or -1 when r
 * holds inf or NaN after the accumulation (nothing else is promised then). */
BW_CLONES int ef_accumulate_encode(float *r, const float *theta, const float *const *xs, const int64_t *offs,
                                   int64_t nseg, int64_t n, float decay, int64_t bs, int64_t step, int int4,
                                   float *scales, uint8_t *codes, float *q, int settle) {
    int64_t k = 0;
    for (int64_t s = 0; s < n; s += step) {
        int64_t t = s + step < n ? s + step : n;
        int32_t top = 0;
        for (int64_t o = s; o < t; o += bs) {
            int64_t e = o + bs < t ? o + bs : t;
            int32_t m = 0;
            for (int64_t a = o; a < e;) { /* the segments that cover this block */
                while (k + 1 < nseg && offs[k + 1] <= a) k++;
                int64_t b = offs[k + 1] < e ? offs[k + 1] : e;
                int32_t mm = accumulate_absmax(r + a, theta + a, xs[k] + (a - offs[k]), b - a, decay);
                m = mm > m ? mm : m;
                a = b;
            }
            if (m >= 0x7f800000) return -1;
            top = m > top ? m : top;
            scales[o / bs] = as_float(m);
        }
        quantize_step(r, s, t, bs, int4, scales, codes, q, settle, top);
    }
    return 0;
}

/* 0 when every scale and code of the k bodies is one the encoder makes; else 1 (a scale that
 * is negative or NaN, or qmax * scale not finite) or 2 (int8 -128, int4 nibble 0, an int4
 * padding nibble other than 8). */
static int check_rows(const uint8_t *bodies, int64_t k, int64_t stride, int64_t numel, int64_t bs, int int4) {
    const float qmax = int4 ? 7.0f : 127.0f;
    const int64_t nb = (numel + bs - 1) / bs;
    for (int64_t r = 0; r < k; r++) {
        const uint8_t *body = bodies + r * stride, *codes = body + 4 * nb;
        for (int64_t b = 0; b < nb; b++) {
            float sc;
            memcpy(&sc, body + 4 * b, 4);
            if (!(sc >= 0.0f) || !isfinite(sc * qmax)) return 1;
        }
        int bad = 0;
        if (!int4) {
            for (int64_t i = 0; i < numel; i++) bad |= codes[i] == 0x80;
        } else {
            for (int64_t i = 0; i < numel / 2; i++) bad |= (codes[i] & 15) == 0 || (codes[i] >> 4) == 0;
            if (numel % 2) bad |= (codes[numel / 2] & 15) == 0 || (codes[numel / 2] >> 4) != 8;
        }
        if (bad) return 2;
    }
    return 0;
}

/* check_rows, exported: the rows of several runs are checked before any is decoded in place */
int bw_check(const uint8_t *bodies, int64_t k, int64_t stride, int64_t numel, int64_t bs, int int4) {
    return check_rows(bodies, k, stride, numel, bs, int4);
}

#define BW_WRITE 0
#define BW_SUBTRACT 1
#define BW_UNSETTLE 2
#define BW_ADD 3

/* Decode k bodies (row r at bodies + r * stride: ceil(numel / bs) float32 scales, then the
 * codes) into out[k * numel] (sub == BW_WRITE), subtract the decoded values from out
 * (BW_SUBTRACT), or add them back where the code is not 0 (BW_UNSETTLE: undoes bw_encode's
 * settle exactly), or add them to out (BW_ADD: an owner's running sum, out + decoded with
 * one rounding, as torch's add_ of the decoded values). Every body is checked first (check_rows; on a nonzero return out is
 * untouched) unless checked != 0: the caller has had these rows pass bw_check already. */
BW_CLONES int bw_decode(const uint8_t *bodies, int64_t k, int64_t stride, int64_t numel, int64_t bs, int int4,
                        float *out, int sub, int checked) {
    int rc = checked ? 0 : check_rows(bodies, k, stride, numel, bs, int4);
    if (rc) return rc;
    const int64_t nb = (numel + bs - 1) / bs;
    for (int64_t r = 0; r < k; r++) {
        const uint8_t *body = bodies + r * stride, *codes = body + 4 * nb;
        float *y = out + r * numel;
        for (int64_t b = 0; b < nb; b++) {
            float sc;
            memcpy(&sc, body + 4 * b, 4);
            int64_t o = b * bs, e = o + bs < numel ? bs : numel - o;
            float *yb = y + o;
            if (!int4) {
                const int8_t *c = (const int8_t *)codes + o;
                if (sub == BW_SUBTRACT)
                    for (int64_t i = 0; i < e; i++) yb[i] = yb[i] - (float)c[i] * sc;
                else if (sub == BW_UNSETTLE)
                    for (int64_t i = 0; i < e; i++) yb[i] = c[i] ? yb[i] + (float)c[i] * sc : yb[i];
                else if (sub == BW_ADD)
                    for (int64_t i = 0; i < e; i++) yb[i] = yb[i] + (float)c[i] * sc;
                else
                    for (int64_t i = 0; i < e; i++) yb[i] = (float)c[i] * sc;
            } else {
                const uint8_t *c = codes + o / 2;
                for (int64_t i = 0; i < e; i++) {
                    int nib = i % 2 ? c[i / 2] >> 4 : c[i / 2] & 15;
                    float v = (float)(nib - 8) * sc;
                    yb[i] = sub == BW_SUBTRACT   ? yb[i] - v
                            : sub == BW_UNSETTLE ? (nib != 8 ? yb[i] + v : yb[i])
                            : sub == BW_ADD      ? yb[i] + v
                                                 : v;
                }
            }
        }
    }
    return 0;
}

/* The step's scalars (see the header): float32 as torch's kernel casts them. */
typedef struct {
    float mom, d1, wd, lr;
    int has_wd, nesterov, first;
} sgd_args;

/* e elements of the step in the header's first form (vec != 0) or second */
static inline void sgd_run(float *p, float *m, const float *g, int64_t e, const sgd_args *a, int vec) {
    for (int64_t i = 0; i < e; i++) {
        float gv = g[i], x = p[i];
        if (a->has_wd) gv = fmaf(x, a->wd, gv);
        float mv = a->first ? gv : vec ? fmaf(a->d1, gv, m[i] * a->mom) : fmaf(m[i], a->mom, gv * a->d1);
        m[i] = mv;
        gv = a->nesterov ? fmaf(mv, a->mom, gv) : mv;
        p[i] = fmaf(-gv, a->lr, x);
    }
}

/* One outer step of torch._fused_sgd_ (momentum != 0, not maximize) on n_total elements of θ and
 * its momentum buffer, the gradient being the k bodies decoded (as bw_decode writes them): row r
 * holds elements [base + r * numel, base + (r + 1) * numel) of the tensor; theta and buf point at
 * element base. width: the last n_total % width elements take the header's second form. g:
 * scratch of bs floats. The rows must have passed bw_check (not checked again). Returns 0. */
BW_CLONES int bw_decode_sgd(const uint8_t *bodies, int64_t k, int64_t stride, int64_t numel, int64_t bs, int int4,
                            float *theta, float *buf, int64_t base, int64_t n_total, int64_t width, float lr,
                            float mom, float dampening1, float wd, int nesterov, int first, float *g) {
    const int64_t nb = (numel + bs - 1) / bs, vec_end = n_total - n_total % width;
    const sgd_args a = {mom, dampening1, wd, lr, wd != 0.0f, nesterov, first};
    for (int64_t r = 0; r < k; r++) {
        const uint8_t *body = bodies + r * stride, *codes = body + 4 * nb;
        for (int64_t b = 0; b < nb; b++) {
            float sc;
            memcpy(&sc, body + 4 * b, 4);
            int64_t o = b * bs, e = o + bs < numel ? bs : numel - o;
            if (!int4) {
                const int8_t *c = (const int8_t *)codes + o;
                for (int64_t i = 0; i < e; i++) g[i] = (float)c[i] * sc;
            } else {
                const uint8_t *c = codes + o / 2;
                for (int64_t i = 0; i < e; i++) g[i] = (float)((i % 2 ? c[i / 2] >> 4 : c[i / 2] & 15) - 8) * sc;
            }
            int64_t at = r * numel + o, gi = base + at; /* at: in this call's arrays; gi: in the tensor */
            int64_t n1 = gi < vec_end ? (gi + e < vec_end ? e : vec_end - gi) : 0;
            if (n1) sgd_run(theta + at, buf + at, g, n1, &a, 1);
            if (e - n1) sgd_run(theta + at + n1, buf + at + n1, g + n1, e - n1, &a, 0);
        }
    }
    return 0;
}

/* Error feedback's accumulation (dtrain/rounds/error_feedback.py add_pseudo_gradient):
 * r[i] = r[i] * decay + (theta[i] - x[i]) over n float32s, the torch path's two roundings
 * (r.mul_(decay) is skipped at decay 1, where r * 1 == r). Returns 1 when every r[i] is
 * finite afterwards, else 0. */
BW_CLONES int ef_accumulate(float *r, const float *theta, const float *x, int64_t n, float decay) {
    return accumulate_absmax(r, theta, x, n, decay) < 0x7f800000;
}

/* zlib-ng's zng_crc32(crc, buf, len): zlib's crc32 */
typedef uint32_t (*crc32_fn)(uint32_t, const uint8_t *, uint32_t);

#define PREFIX_BYTES 28
#define ROW_HEADER_BYTES 32

static uint32_t row_crc(crc32_fn crc, const uint8_t *row, int64_t plen) {
    return crc(0, row + ROW_HEADER_BYTES, (uint32_t)(plen - ROW_HEADER_BYTES));
}

/* Finish k payload rows of plen bytes each (row r at rows + r * plen): its body first when
 * scales != NULL (row r's sbytes of scales from scales + r * sbytes, then its plen - 32 - sbytes
 * bytes of codes from codes + r * (plen - 32 - sbytes): one contiguous body cut into rows);
 * else the bodies are in place at byte 32. Then the 28-byte header prefix and the body's
 * crc32 (little-endian), while the row is in cache. */
void bw_seal_rows(uint8_t *rows, int64_t k, int64_t plen, const uint8_t *prefix, crc32_fn crc, const uint8_t *scales,
                  int64_t sbytes, const uint8_t *codes) {
    const int64_t cbytes = plen - ROW_HEADER_BYTES - sbytes;
    for (int64_t r = 0; r < k; r++) {
        uint8_t *row = rows + r * plen;
        if (scales) {
            memcpy(row + ROW_HEADER_BYTES, scales + r * sbytes, sbytes);
            memcpy(row + ROW_HEADER_BYTES + sbytes, codes + r * cbytes, cbytes);
        }
        memcpy(row, prefix, PREFIX_BYTES);
        uint32_t c = row_crc(crc, row, plen);
        for (int i = 0; i < 4; i++) row[PREFIX_BYTES + i] = (uint8_t)(c >> (8 * i));
    }
}

/* 0 when each of k payload rows (row r at rows + r * plen) has the header `prefix` says
 * (its bytes 0-6 and 8-27 equal; byte 7, the original dtype, one with dtype_ok[byte] != 0)
 * and its body's crc32 in bytes 28-31; else 1 + the first bad row's index. */
int64_t bw_check_headers(const uint8_t *rows, int64_t k, int64_t plen, const uint8_t *prefix, const uint8_t *dtype_ok,
                         crc32_fn crc) {
    for (int64_t r = 0; r < k; r++) {
        const uint8_t *row = rows + r * plen;
        if (memcmp(row, prefix, 7) || !dtype_ok[row[7]] || memcmp(row + 8, prefix + 8, PREFIX_BYTES - 8)) return r + 1;
        uint32_t c = row_crc(crc, row, plen), want = 0;
        for (int i = 0; i < 4; i++) want |= (uint32_t)row[PREFIX_BYTES + i] << (8 * i);
        if (c != want) return r + 1;
    }
    return 0;
}
