/* The recall tier's per-pass work in one call each (checked and called by
 * kvchat/native/__init__.py):
 * - `top_rows` (kvchat/recall/key_index.py, `NativeKeyIndex`): score every cold row of every KV
 *   head for the pass's queries from its 4-bit key codes, keep the largest over the
 *   queries, add the row bias, and keep the k best rows;
 * - `gather` (kvchat/recall/cold_store.py, `ColdStore.units`): copy those rows' quantised keys
 *   and values out of the memory-mapped files that hold them.
 *
 * Why native: in PyTorch the same work is a chain of ops per layer (the int4 matmul, a
 * max over the queries, the bias, a flip and a top-k; then 6-10 ops a file for the read),
 * each a few µs to tens of µs, in every recalling layer of every decode step; here it is
 * one pass over the codes and one copy per row.
 *
 * Layout of one KV head's codes (`NativeKeyIndex`): rows in blocks of 16; a block holds
 * m/8 vectors of 64 bytes; in vector j, byte 4·lane + c is the code of channel 4j + c of
 * row `lane` in its low nibble and that of channel 4(j + m/8) + c in its high nibble. So
 * one AVX512-VNNI instruction multiplies 4 channels of 16 rows by 4 query numbers and
 * sums them into 16 int32 lanes, one per row.
 *
 * Each row keeps its minimum `lo` and step in bfloat16. Scores: a query q (its m ranking
 * channels) is quantised to int8 per row of queries (scale sq = max|q| / 127), and a row's
 * score is lo·Σq + step·sq·(qi·code): the same integer dot product and the same float
 * operations in the plain loop and the AVX2 and AVX512-VNNI paths, so all give the same
 * numbers (tests/recall/test_keyindex.py).
 *
 * Only the module's functions touch Python; the kernels run with the GIL released. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_kernel.h"

#define BLOCK 16
#define MAX_CHANNELS 256

/* ---- top-k: a min-heap of (score, row) ------------------------------------------- */

typedef struct {
    float *score;
    int64_t *row;
    int n, k;
} heap_t;

static void heap_up(heap_t *h, int i) {
    float s = h->score[i];
    int64_t r = h->row[i];
    while (i > 0) {
        int p = (i - 1) / 2;
        if (!(s < h->score[p])) break;
        h->score[i] = h->score[p];
        h->row[i] = h->row[p];
        i = p;
    }
    h->score[i] = s;
    h->row[i] = r;
}

static void heap_down(heap_t *h, float s, int64_t r) {
    int i = 0, n = h->n;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && h->score[c + 1] < h->score[c]) c++;
        if (!(h->score[c] < s)) break;
        h->score[i] = h->score[c];
        h->row[i] = h->row[c];
        i = c;
    }
    h->score[i] = s;
    h->row[i] = r;
}

/* Offer one row: kept while fewer than k are held (even at -inf: a head with fewer
 * candidates than k still returns k rows, as torch.topk does), then only if it beats
 * the smallest held. */
static inline void heap_offer(heap_t *h, float s, int64_t r) {
    if (h->n < h->k) {
        h->score[h->n] = s;
        h->row[h->n] = r;
        heap_up(h, h->n++);
    } else if (s > h->score[0]) {
        heap_down(h, s, r);
    }
}

/* ---- the query, quantised --------------------------------------------------------- */

/* M query rows of m channels, in one allocation (`query_new`). */
typedef struct {
    int32_t *packed; /* [M, m / 4]: 4 int8 numbers per int32, channel order */
    float *scale;    /* [M]: sq */
    float *sum;      /* [M]: Σq over the ranking channels */
    int8_t *q;       /* [M, m] */
    int m;
} query_t;

static query_t *query_new(int M, int m) {
    size_t bytes = sizeof(query_t) + (size_t)M * ((size_t)m + 2 * sizeof(float)) + (size_t)M * (size_t)m;
    query_t *q = PyMem_Malloc(bytes);
    if (!q) return NULL;
    char *at = (char *)(q + 1);
    q->packed = (int32_t *)at; /* (4-byte aligned: right after the struct) */
    at += (size_t)M * (size_t)m;
    q->scale = (float *)at;
    at += (size_t)M * sizeof(float);
    q->sum = (float *)at;
    at += (size_t)M * sizeof(float);
    q->q = (int8_t *)at;
    q->m = m;
    return q;
}

/* Query rows [M, d] (float32 or bfloat16) -> their m ranking channels in int8. */
static void quantise_queries(query_t *out, const void *query, int bf16, int d, int M, const int64_t *channels, int m) {
    for (int i = 0; i < M; i++) {
        float qf[MAX_CHANNELS], amax = 0.0f, sum = 0.0f;
        for (int c = 0; c < m; c++) {
            int64_t at = (int64_t)i * d + channels[c];
            float v = bf16 ? bf16_to_float(((const uint16_t *)query)[at]) : ((const float *)query)[at];
            qf[c] = v;
            sum += v;
            float a = fabsf(v);
            if (a > amax) amax = a;
        }
        float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
        for (int c = 0; c < m; c++) {
            long v = lrintf(qf[c] / scale);
            out->q[(size_t)i * m + c] = (int8_t)(v > 127 ? 127 : (v < -127 ? -127 : v));
        }
        for (int g = 0; g < m / 4; g++) {
            uint32_t word = 0;
            for (int t = 0; t < 4; t++) word |= (uint32_t)(uint8_t)out->q[(size_t)i * m + 4 * g + t] << (8 * t);
            out->packed[(size_t)i * (m / 4) + g] = (int32_t)word;
        }
        out->scale[i] = scale;
        out->sum[i] = sum;
    }
}

/* ---- one KV head: scalar ------------------------------------------------------------ */

static inline int code_of(const uint8_t *block, int m, int lane, int channel) {
    int half = m / 8; /* vectors per block */
    int group = channel / 4, t = channel % 4;
    int high = group >= half;
    uint8_t byte = block[(size_t)(group - (high ? half : 0)) * 64 + 4 * lane + t];
    return high ? byte >> 4 : byte & 15;
}

/* Each row's score into `out` [rows] when it is given, else offered to the heap. */
static void head_scalar(heap_t *h, float *out, const uint8_t *codes, const uint16_t *lo, const uint16_t *step,
                        const float *bias, int64_t rows, int m, const query_t *q, int M) {
    int64_t blocks = (rows + BLOCK - 1) / BLOCK;
    size_t block_bytes = (size_t)m * BLOCK / 2;
    for (int64_t b = blocks - 1; b >= 0; b--) { /* newest first: fewer rows enter the heap */
        const uint8_t *block = codes + (size_t)b * block_bytes;
        int lanes = (int)(rows - b * BLOCK < BLOCK ? rows - b * BLOCK : BLOCK);
        for (int lane = lanes - 1; lane >= 0; lane--) {
            int64_t r = b * BLOCK + lane;
            float best = -INFINITY;
            for (int i = 0; i < M; i++) {
                int32_t acc = 0;
                for (int c = 0; c < m; c++) acc += code_of(block, m, lane, c) * (int32_t)q->q[(size_t)i * m + c];
                float s = fmaf(bf16_to_float(step[r]) * q->scale[i], (float)acc, bf16_to_float(lo[r]) * q->sum[i]);
                best = s > best ? s : best;
            }
            if (bias) best += bias[r];
            if (out)
                out[r] = best;
            else
                heap_offer(h, best, r);
        }
    }
}

/* ---- one KV head: AVX512-VNNI ------------------------------------------------------- */

#ifdef KERNEL_X86
__attribute__((target("avx512f"), always_inline))
static inline __m512 bf16x16(const uint16_t *at) {
    __m256i raw = _mm256_loadu_si256((const __m256i *)at);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* `half` (m / 8) is a constant where `head_vnni` calls it, so that the unpacked codes stay
 * in registers (with a variable count they went through the stack). */
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline))
static inline void head_vnni_m(heap_t *h, float *out, const uint8_t *codes, const uint16_t *lo, const uint16_t *step,
                               const float *bias, int64_t rows, const int half, const query_t *q, int M) {
    int64_t blocks = (rows + BLOCK - 1) / BLOCK;
    int m = 8 * half;
    size_t block_bytes = (size_t)m * BLOCK / 2;
    const __m512i nibble = _mm512_set1_epi8(15);
    for (int64_t b = blocks - 1; b >= 0; b--) {
        const uint8_t *block = codes + (size_t)b * block_bytes;
        __m512i unpacked[MAX_CHANNELS / 4];
        for (int j = 0; j < half; j++) {
            __m512i v = _mm512_loadu_si512((const void *)(block + (size_t)j * 64));
            unpacked[j] = _mm512_and_si512(v, nibble);
            unpacked[j + half] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        }
        __m512 lo_v = bf16x16(lo + b * BLOCK), step_v = bf16x16(step + b * BLOCK);
        __m512 best = _mm512_set1_ps(-INFINITY);
        for (int i = 0; i < M; i++) {
            /* Four sums in turn: one would wait on each product's latency. */
            __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                              _mm512_setzero_si512()};
            for (int g = 0; g < 2 * half; g++)
                acc[g & 3] = _mm512_dpbusd_epi32(acc[g & 3], unpacked[g],
                                                 _mm512_set1_epi32(q->packed[(size_t)i * 2 * half + g]));
            __m512i total = _mm512_add_epi32(_mm512_add_epi32(acc[0], acc[1]), _mm512_add_epi32(acc[2], acc[3]));
            __m512 sq = _mm512_mul_ps(step_v, _mm512_set1_ps(q->scale[i]));
            __m512 s = _mm512_fmadd_ps(sq, _mm512_cvtepi32_ps(total), _mm512_mul_ps(lo_v, _mm512_set1_ps(q->sum[i])));
            best = _mm512_max_ps(best, s);
        }
        int lanes = (int)(rows - b * BLOCK < BLOCK ? rows - b * BLOCK : BLOCK);
        __mmask16 live = (__mmask16)((1u << lanes) - 1u);
        /* (masked: the bias may end with the rows, inside the last block) */
        if (bias) best = _mm512_add_ps(best, _mm512_maskz_loadu_ps(live, bias + b * BLOCK));
        if (out) {
            _mm512_mask_storeu_ps(out + b * BLOCK, live, best);
            continue;
        }
        if (h->n == h->k) {
            live &= _mm512_cmp_ps_mask(best, _mm512_set1_ps(h->score[0]), _CMP_GT_OQ);
            if (!live) continue;
        }
        float s[BLOCK];
        _mm512_storeu_ps(s, best);
        for (int lane = lanes - 1; lane >= 0; lane--)
            if (live >> lane & 1) heap_offer(h, s[lane], b * BLOCK + lane);
    }
}

__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void head_vnni(heap_t *h, float *out, const uint8_t *codes, const uint16_t *lo, const uint16_t *step,
                      const float *bias, int64_t rows, int m, const query_t *q, int M) {
    switch (m) {
    case 32: head_vnni_m(h, out, codes, lo, step, bias, rows, 4, q, M); break;  /* d = 64: SmolLM2, Llama 3.2 1B */
    case 64: head_vnni_m(h, out, codes, lo, step, bias, rows, 8, q, M); break;  /* d = 128 */
    default: head_vnni_m(h, out, codes, lo, step, bias, rows, m / 8, q, M);
    }
}

/* ---- one KV head: AVX2 ------------------------------------------------------------------- */

/* The same block layout read as two halves of 8 rows (bytes 0-31 and 32-63 of each vector).
 * An AVX2 CPU has no VNNI: a code-by-query product is `maddubs` (two products summed in 16
 * bits: at most 2 * 15 * 127, no saturation), eight of those added in 16 bits, then `madd`
 * by ones (into 32 bits): the same integer sums as the VNNI path's; the float operations
 * are the same too. */
__attribute__((target("avx2,fma"), always_inline))
static inline __m256 bf16x8(const uint16_t *at) {
    __m128i raw = _mm_loadu_si128((const __m128i *)at);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

__attribute__((target("avx2,fma"), always_inline))
static inline void head_avx2_m(heap_t *h, float *out, const uint8_t *codes, const uint16_t *lo, const uint16_t *step,
                               const float *bias, int64_t rows, const int half, const query_t *q, int M) {
    int64_t blocks = (rows + BLOCK - 1) / BLOCK;
    int m = 8 * half;
    size_t block_bytes = (size_t)m * BLOCK / 2;
    const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (int64_t b = blocks - 1; b >= 0; b--) {
        const uint8_t *block = codes + (size_t)b * block_bytes;
        for (int part = 1; part >= 0; part--) { /* newest first, as the other paths offer rows */
            int64_t first = b * BLOCK + 8 * part;
            int lanes = (int)(rows - first < 8 ? rows - first : 8);
            if (lanes <= 0) continue;
            __m256i unpacked[MAX_CHANNELS / 4];
            for (int j = 0; j < half; j++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(block + (size_t)j * 64 + 32 * part));
                unpacked[j] = _mm256_and_si256(v, nibble);
                unpacked[j + half] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
            }
            __m256 lo_v = bf16x8(lo + first), step_v = bf16x8(step + first);
            __m256 best = _mm256_set1_ps(-INFINITY);
            for (int i = 0; i < M; i++) {
                /* Up to 8 groups' pair sums add up in 16 bits (at most 8 * 3810), then widen. */
                __m256i total = _mm256_setzero_si256();
                for (int first = 0; first < 2 * half; first += 8) {
                    __m256i sums = _mm256_setzero_si256();
                    for (int g = first; g < first + 8 && g < 2 * half; g++)
                        sums = _mm256_add_epi16(sums, _mm256_maddubs_epi16(
                                                          unpacked[g], _mm256_set1_epi32(q->packed[(size_t)i * 2 * half + g])));
                    total = _mm256_add_epi32(total, _mm256_madd_epi16(sums, ones));
                }
                __m256 sq = _mm256_mul_ps(step_v, _mm256_set1_ps(q->scale[i]));
                __m256 s = _mm256_fmadd_ps(sq, _mm256_cvtepi32_ps(total), _mm256_mul_ps(lo_v, _mm256_set1_ps(q->sum[i])));
                best = _mm256_max_ps(best, s);
            }
            /* (masked: the bias and the output may end with the rows, inside this half) */
            __m256i inside = _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            if (bias) best = _mm256_add_ps(best, _mm256_maskload_ps(bias + first, inside));
            if (out) {
                _mm256_maskstore_ps(out + first, inside, best);
                continue;
            }
            int live = (1 << lanes) - 1;
            if (h->n == h->k) {
                live &= _mm256_movemask_ps(_mm256_cmp_ps(best, _mm256_set1_ps(h->score[0]), _CMP_GT_OQ));
                if (!live) continue;
            }
            float s[8];
            _mm256_storeu_ps(s, best);
            for (int lane = lanes - 1; lane >= 0; lane--)
                if (live >> lane & 1) heap_offer(h, s[lane], first + lane);
        }
    }
}

__attribute__((target("avx2,fma")))
static void head_avx2(heap_t *h, float *out, const uint8_t *codes, const uint16_t *lo, const uint16_t *step,
                      const float *bias, int64_t rows, int m, const query_t *q, int M) {
    switch (m) {
    case 32: head_avx2_m(h, out, codes, lo, step, bias, rows, 4, q, M); break;
    case 64: head_avx2_m(h, out, codes, lo, step, bias, rows, 8, q, M); break;
    default: head_avx2_m(h, out, codes, lo, step, bias, rows, m / 8, q, M);
    }
}
#endif

/* ---- Python ------------------------------------------------------------------------- */

static PyObject *py_vnni(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyBool_FromLong(cpu_has_vnni());
}

static PyObject *py_avx2(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyBool_FromLong(cpu_has_avx2());
}

/* The paths `vector` names: the plain loop, AVX2, AVX512-VNNI. */
enum { SCALAR = 0, AVX2 = 1, VNNI = 2 };

/* Shared by `top_rows` and `scores`. Pointers are addresses of contiguous buffers:
 *   codes  uint8  [heads, head_rows / 16, m * 8]  (the block layout above)
 *   lo, step bfloat16 [heads, head_rows]; bias float32 [heads, bias_rows] (bias 0: none)
 *   query  float32 or bfloat16 [heads, M, d]; channels int64 [m]
 *   out_rows int64 [heads, k] (top_rows) or out_scores float32 [heads, rows] (scores). */
typedef struct {
    unsigned long long codes, lo, step, bias, query, channels, out_rows, out_scores;
    long long head_rows, rows, bias_rows;
    int heads, m, bf16, d, M, k, vector;
} rank_args;

static PyObject *run(const rank_args *a) {
    if (a->m <= 0 || a->m % 8 || a->m > MAX_CHANNELS || a->M <= 0 || a->head_rows % BLOCK ||
        a->rows <= 0 || a->rows > a->head_rows || (a->out_rows && (a->k <= 0 || a->k > a->rows)) ||
        (a->bias && a->bias_rows < a->rows)) {
        PyErr_SetString(PyExc_ValueError, "_coldrank: shapes out of range");
        return NULL;
    }
    if ((a->vector == VNNI && !cpu_has_vnni()) || (a->vector == AVX2 && !cpu_has_avx2()) || a->vector < 0 ||
        a->vector > VNNI) {
        PyErr_SetString(PyExc_RuntimeError, "_coldrank: this CPU does not run that path");
        return NULL;
    }
    const int64_t *channels = (const int64_t *)(uintptr_t)a->channels;
    for (int c = 0; c < a->m; c++) {
        if (channels[c] < 0 || channels[c] >= a->d) {
            PyErr_SetString(PyExc_ValueError, "_coldrank: a ranking channel outside the query's channels");
            return NULL;
        }
    }
    int k = a->out_rows ? a->k : 1;
    float *heap_scores = PyMem_Malloc(sizeof(float) * (size_t)k);
    query_t *q = query_new(a->M, a->m);
    if (!heap_scores || !q) {
        PyMem_Free(heap_scores);
        PyMem_Free(q);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    size_t head_code_bytes = (size_t)a->head_rows * (size_t)a->m / 2;
    size_t query_bytes = (size_t)a->M * (size_t)a->d * (a->bf16 ? 2 : 4);
    for (int hd = 0; hd < a->heads; hd++) {
        heap_t heap = {heap_scores, a->out_rows ? (int64_t *)(uintptr_t)a->out_rows + (size_t)hd * k : NULL, 0, k};
        float *out = a->out_scores ? (float *)(uintptr_t)a->out_scores + (size_t)hd * a->rows : NULL;
        quantise_queries(q, (const char *)(uintptr_t)a->query + hd * query_bytes, a->bf16, a->d, a->M, channels,
                         a->m);
        const uint8_t *c = (const uint8_t *)(uintptr_t)a->codes + hd * head_code_bytes;
        const uint16_t *l = (const uint16_t *)(uintptr_t)a->lo + (size_t)hd * a->head_rows;
        const uint16_t *s = (const uint16_t *)(uintptr_t)a->step + (size_t)hd * a->head_rows;
        const float *bs = a->bias ? (const float *)(uintptr_t)a->bias + (size_t)hd * a->bias_rows : NULL;
#ifdef KERNEL_X86
        if (a->vector == VNNI)
            head_vnni(&heap, out, c, l, s, bs, a->rows, a->m, q, a->M);
        else if (a->vector == AVX2)
            head_avx2(&heap, out, c, l, s, bs, a->rows, a->m, q, a->M);
        else
#endif
            head_scalar(&heap, out, c, l, s, bs, a->rows, a->m, q, a->M);
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(heap_scores);
    PyMem_Free(q);
    Py_RETURN_NONE;
}

/* top_rows(codes, lo, step, bias, bias_rows, head_rows, rows, heads, m, query, bf16, d, M, channels, k, out_rows,
 *          vector):
 * each head's k best rows (k <= rows), in no order. */
static PyObject *py_top_rows(PyObject *self, PyObject *args) {
    (void)self;
    rank_args a = {0};
    if (!PyArg_ParseTuple(args, "KKKKLLLiiKiiiKiKi", &a.codes, &a.lo, &a.step, &a.bias, &a.bias_rows, &a.head_rows,
                          &a.rows, &a.heads, &a.m, &a.query, &a.bf16, &a.d, &a.M, &a.channels, &a.k, &a.out_rows,
                          &a.vector))
        return NULL;
    if (!a.out_rows) {
        PyErr_SetString(PyExc_ValueError, "_coldrank.top_rows: no output");
        return NULL;
    }
    return run(&a);
}

/* scores(codes, lo, step, head_rows, rows, heads, m, query, bf16, d, M, channels, out_scores, vector):
 * every row's score, the largest over the queries. */
static PyObject *py_scores(PyObject *self, PyObject *args) {
    (void)self;
    rank_args a = {0};
    if (!PyArg_ParseTuple(args, "KKKLLiiKiiiKKi", &a.codes, &a.lo, &a.step, &a.head_rows, &a.rows, &a.heads, &a.m,
                          &a.query, &a.bf16, &a.d, &a.M, &a.channels, &a.out_scores, &a.vector))
        return NULL;
    if (!a.out_scores) {
        PyErr_SetString(PyExc_ValueError, "_coldrank.scores: no output");
        return NULL;
    }
    return run(&a);
}

/* pack(codes, heads, b, m, dest, head_rows, first)
 *   codes uint8 [heads, b, m] (0..15, ranking channel order) -> rows first .. first + b
 *   of dest, uint8 [heads, head_rows / 16, m * 8] (the block layout above). */
static PyObject *py_pack(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long codes, dest;
    long long b, head_rows, first;
    int heads, m;
    if (!PyArg_ParseTuple(args, "KiLiKLL", &codes, &heads, &b, &m, &dest, &head_rows, &first)) return NULL;
    if (m <= 0 || m % 8 || m > MAX_CHANNELS || head_rows % BLOCK || first < 0 || first + b > head_rows) {
        PyErr_SetString(PyExc_ValueError, "coldrank.pack: shapes out of range");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    int half = m / 8;
    size_t block_bytes = (size_t)m * BLOCK / 2;
    for (int hd = 0; hd < heads; hd++) {
        const uint8_t *src = (const uint8_t *)(uintptr_t)codes + (size_t)hd * b * m;
        uint8_t *head = (uint8_t *)(uintptr_t)dest + (size_t)hd * head_rows * m / 2;
        for (long long i = 0; i < b; i++) {
            long long r = first + i;
            uint8_t *block = head + (size_t)(r / BLOCK) * block_bytes;
            int lane = (int)(r % BLOCK);
            const uint8_t *row = src + (size_t)i * m;
            for (int j = 0; j < half; j++)
                for (int t = 0; t < 4; t++)
                    block[(size_t)j * 64 + 4 * lane + t] =
                        (uint8_t)((row[4 * j + t] & 15) | (row[4 * (j + half) + t] & 15) << 4);
        }
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* gather(sources, rows, heads, k, unit, out)
 *   sources: a sequence of (address, first, stop, base): rows [first, stop) of a cold store
 *     are rows r - base of the file mapped at address, each [heads, unit] bytes (each KV
 *     head's quantised key and value, kvchat/recall/row_codec.py); a later source holds the
 *     rows it names (a fork reads its newer rows from its own file);
 *   rows int64 [heads, k]: each head's rows; out uint8 [heads, k, unit]: their heads' units. */
static PyObject *py_gather(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *sources;
    unsigned long long rows_ptr, out_ptr;
    int heads, k, unit;
    if (!PyArg_ParseTuple(args, "OKiiiK", &sources, &rows_ptr, &heads, &k, &unit, &out_ptr)) return NULL;
    PyObject *seq = PySequence_Fast(sources, "_coldrank.gather: sources must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    long long *src = PyMem_Malloc(sizeof(long long) * 4 * (size_t)(n ? n : 1));
    if (!src) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        unsigned long long address;
        if (!PyArg_ParseTuple(item, "KLLL", &address, &src[4 * i + 1], &src[4 * i + 2], &src[4 * i + 3])) {
            PyMem_Free(src);
            Py_DECREF(seq);
            return NULL;
        }
        src[4 * i] = (long long)address;
    }
    Py_DECREF(seq);
    int missing = 0;
    Py_BEGIN_ALLOW_THREADS
    size_t piece = (size_t)unit, row_bytes = (size_t)heads * piece;
    const int64_t *rows = (const int64_t *)(uintptr_t)rows_ptr;
    char *out = (char *)(uintptr_t)out_ptr;
    for (int h = 0; h < heads && !missing; h++) {
        for (int j = 0; j < k; j++) {
            long long r = rows[(size_t)h * k + j];
            Py_ssize_t i = n - 1;
            while (i >= 0 && !(src[4 * i + 1] <= r && r < src[4 * i + 2])) i--;
            if (i < 0) {
                missing = 1;
                break;
            }
            const char *row = (const char *)(uintptr_t)src[4 * i] + (size_t)(r - src[4 * i + 3]) * row_bytes;
            memcpy(out + ((size_t)h * k + j) * piece, row + (size_t)h * piece, piece);
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(src);
    if (missing) {
        PyErr_SetString(PyExc_IndexError, "_coldrank.gather: a row outside the store");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"vnni", py_vnni, METH_NOARGS, "Whether this CPU has AVX512-VNNI (the fastest path)."},
    {"avx2", py_avx2, METH_NOARGS, "Whether this CPU has AVX2 and FMA (the next path)."},
    {"top_rows", py_top_rows, METH_VARARGS, "Each KV head's k best cold rows for the queries."},
    {"scores", py_scores, METH_VARARGS, "Every cold row's score for the queries (the largest over them)."},
    {"pack", py_pack, METH_VARARGS, "Write rows of 4-bit codes into the block layout."},
    {"gather", py_gather, METH_VARARGS, "Copy cold rows' keys and values out of their files."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_coldrank", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__coldrank(void) { return PyModule_Create(&module); }
