/* bumblebee's streaming summary (Algorithm 2 over summary + batch) in two calls per piece:
 * `_StreamingSummary.append` and `.shrink` in kvchat/compress/bumblebee.py, whose
 * docstrings state the rule (kvchat/native/__init__.py, `summary_append` and
 * `summary_shrink`, check and make the calls).
 *
 * Why native: a flush past greedy_max (a 6k document) streams its held tokens in pieces of
 * 256, each evicted in about five rounds, and in Python a round is some sixty small NumPy
 * calls plus a torch product for the members whose neighbour left: about 0.55 ms of a
 * round's bookkeeping, 110 rounds a layer, 2 s of the 6k document's time to first token
 * (measured on a 2-core AMD EPYC, Zen 5; docs/decisions/0007-c-kernels-with-python-twins.md).
 * Here a head's rounds run in one loop with the GIL released, and the append's cosines
 * are computed as the rounds' are (a torch product costs another 0.6 s of a layer's
 * thread).
 *
 * It computes what the NumPy rounds compute, in the same precisions and, where it
 * matters, in the same order: the sums over a head's members in NumPy's pairwise order
 * (`pairwise_sum`), a candidate's loss in the expression's order, its rank by (loss,
 * position), the neighbour search's cosines in float32 as one chain of fused multiply-adds
 * over the channels (torch's product may sum them otherwise: a near-tie could fall the
 * other way; tests/compress/test_bumblebee.py compares the two). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_kernel.h"

#define TILE 16 /* members per tile of the neighbour search's layout */

/* NumPy's pairwise summation of a contiguous float64 run (`np.sum` along a row): the same
 * additions in the same order, so the same result to the bit. */
static double pairwise_sum(const double *a, int64_t n) {
    if (n < 8) {
        double res = 0.0;
        for (int64_t i = 0; i < n; i++) res += a[i];
        return res;
    }
    if (n <= 128) {
        double r[8];
        int64_t i;
        for (int j = 0; j < 8; j++) r[j] = a[j];
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[i + j];
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i];
        return res;
    }
    int64_t half = n / 2;
    half -= half % 8;
    return pairwise_sum(a, half) + pairwise_sum(a + half, n - half);
}

/* ---- one head's state ----------------------------------------------------------------- */

typedef struct {
    const float *unit;        /* [n, d] unit keys */
    float *tiles;             /* [ceil(n / 16), d, 16]: the unit keys in tiles (scratch) */
    double *count;            /* [n]: tokens each member stands for, 0 once evicted */
    double *mass;             /* [groups, n]: attention mass, 0 once evicted */
    const int64_t *positions; /* [n] */
    uint8_t *alive;           /* [n] */
    float *nn_sim;            /* [n] */
    int64_t *nn_idx;          /* [n] */
    int64_t n, d, budget, block;
    int groups;
    double lam;
    int minmax;
    phi_t phi;
    int vector;
} head_t;

typedef struct {
    double *loss, *diversity, *importance, *total, *phi_total;
    int64_t *order, *rank;
    uint16_t *live; /* [ceil(n / 16)]: each tile's live members, one bit a lane */
    uint8_t *gone;
} scratch_t;

/* ---- the neighbour search: the live member of largest cosine to member i -------------- */

/* The cosine of a query [d] with member x of the tiles: one chain of fused multiply-adds
 * in channel order, as each lane of the vector search computes it. */
static inline float tile_dot(const float *query, const float *tiles, int64_t d, int64_t x) {
    const float *at = tiles + (size_t)(x / TILE) * (size_t)d * TILE + (size_t)(x % TILE);
    float dot = 0.0f;
    for (int64_t j = 0; j < d; j++) dot = fmaf(query[j], at[(size_t)j * TILE], dot);
    return dot;
}

static void nearest_scalar(const head_t *h, int64_t i, float *best_cos, int64_t *best_at) {
    const float *query = h->unit + (size_t)i * (size_t)h->d;
    float best = -INFINITY;
    int64_t at = -1;
    for (int64_t x = 0; x < h->n; x++) {
        if (!h->alive[x] || x == i) continue;
        float dot = tile_dot(query, h->tiles, h->d, x);
        if (dot > best) {
            best = dot;
            at = x;
        }
    }
    *best_cos = best;
    *best_at = at;
}

#ifdef KERNEL_X86
/* ROWS searching members against TILES tiles at a time: ROWS x TILES chains of fused
 * multiply-adds side by side (one chain alone waits on the multiply-add's latency), each
 * loaded tile row serving every searching member. For each of the `rows` (member indices,
 * up to ROWS): the member of largest cosine among those `live` marks in tiles [0, count),
 * one bit a lane, never the row itself (first of equal maxima). With `older_best` (an
 * append), also, for each member x < `older`, its largest cosine to the rows so far and
 * the row (index - `row_base`) that gave it first, the rows taken in order. */
#define ROWS 4
#define TILES 4
__attribute__((target("avx512f"))) static void search_avx512(const float *tiles, const float *unit, int64_t d,
                                                             int64_t count, const int64_t *rows, int count_rows,
                                                             const uint16_t *live, float *best_cos,
                                                             int64_t *best_at, float *older_best,
                                                             int32_t *older_row, int64_t older, int64_t row_base) {
    size_t tile_size = (size_t)d * TILE;
    const float *query[ROWS];
    __m512 top[ROWS];
    __m512i top_tile[ROWS];
    for (int r = 0; r < ROWS; r++) {
        query[r] = unit + (size_t)rows[r < count_rows ? r : 0] * (size_t)d;
        top[r] = _mm512_set1_ps(-INFINITY);
        top_tile[r] = _mm512_setzero_si512();
    }
    for (int64_t first = 0; first < count; first += TILES) {
        int64_t group = count - first < TILES ? count - first : TILES;
        __m512 dot[ROWS][TILES];
        for (int r = 0; r < ROWS; r++)
            for (int g = 0; g < TILES; g++) dot[r][g] = _mm512_setzero_ps();
        const float *base = tiles + (size_t)first * tile_size;
        for (int64_t j = 0; j < d; j++) {
            __m512 tile[TILES];
            for (int g = 0; g < TILES; g++)
                tile[g] = g < group ? _mm512_loadu_ps(base + (size_t)g * tile_size + (size_t)j * TILE)
                                    : _mm512_setzero_ps();
            for (int r = 0; r < ROWS; r++) {
                __m512 q = _mm512_set1_ps(query[r][j]);
                for (int g = 0; g < TILES; g++) dot[r][g] = _mm512_fmadd_ps(q, tile[g], dot[r][g]);
            }
        }
        for (int g = 0; g < group; g++) {
            int64_t t = first + g;
            __mmask16 earlier = 0; /* lanes of members before `older` */
            if (older_best && t * TILE < older)
                earlier = older - t * TILE >= TILE ? (__mmask16)0xffff : (__mmask16)((1u << (older - t * TILE)) - 1);
            for (int r = 0; r < count_rows; r++) {
                __mmask16 usable = live[t];
                if (rows[r] / TILE == t) usable &= (__mmask16)~(1u << (rows[r] % TILE)); /* not itself */
                __m512 value = _mm512_mask_blend_ps(usable, _mm512_set1_ps(-INFINITY), dot[r][g]);
                __mmask16 higher = _mm512_cmp_ps_mask(value, top[r], _CMP_GT_OQ);
                top[r] = _mm512_mask_blend_ps(higher, top[r], value);
                top_tile[r] = _mm512_mask_blend_epi32(higher, top_tile[r], _mm512_set1_epi32((int)t));
                if (earlier) {
                    __m512 held = _mm512_loadu_ps(older_best + t * TILE);
                    __mmask16 closer = _mm512_mask_cmp_ps_mask(earlier, dot[r][g], held, _CMP_GT_OQ);
                    _mm512_storeu_ps(older_best + t * TILE, _mm512_mask_blend_ps(closer, held, dot[r][g]));
                    __m512i row = _mm512_set1_epi32((int)(rows[r] - row_base));
                    _mm512_mask_storeu_epi32(older_row + t * TILE, closer, row);
                }
            }
        }
    }
    for (int r = 0; r < count_rows; r++) {
        float value[TILE];
        int32_t tile_of[TILE];
        _mm512_storeu_ps(value, top[r]);
        _mm512_storeu_si512(tile_of, top_tile[r]);
        float best = -INFINITY;
        int64_t at = -1;
        for (int lane = 0; lane < TILE; lane++) {
            if (!(value[lane] > -INFINITY)) continue;
            int64_t x = (int64_t)tile_of[lane] * TILE + lane;
            if (value[lane] > best || (value[lane] == best && x < at)) {
                best = value[lane];
                at = x;
            }
        }
        best_cos[r] = best;
        best_at[r] = at;
    }
}

#endif

/* ---- one round: losses, the members to evict, the evictions ----------------------------- */

/* Members in rank order: ascending loss, then position (then slot, as a stable sort). */
static int by_loss_then_age(int64_t a, int64_t b, const double *loss, const int64_t *positions) {
    if (loss[a] < loss[b]) return -1;
    if (loss[a] > loss[b]) return 1;
    if (positions[a] != positions[b]) return positions[a] < positions[b] ? -1 : 1;
    return (a > b) - (a < b);
}

static void swap(int64_t *a, int64_t *b) {
    int64_t t = *a;
    *a = *b;
    *b = t;
}

/* Reorder items[0:count] so that its first k are the k first in rank order (in any
 * order among themselves): quickselect, the pivot a median of three. */
static void select_first(int64_t *items, int64_t count, int64_t k, const double *loss, const int64_t *positions) {
    int64_t low = 0, high = count - 1;
    if (k <= 0 || k >= count) return;
    while (low < high) {
        int64_t mid = low + (high - low) / 2;
        if (by_loss_then_age(items[mid], items[low], loss, positions) < 0) swap(&items[mid], &items[low]);
        if (by_loss_then_age(items[high], items[low], loss, positions) < 0) swap(&items[high], &items[low]);
        if (by_loss_then_age(items[mid], items[high], loss, positions) < 0) swap(&items[mid], &items[high]);
        int64_t pivot = items[high], store = low; /* the median now sits at `high` */
        for (int64_t x = low; x < high; x++)
            if (by_loss_then_age(items[x], pivot, loss, positions) < 0) swap(&items[x], &items[store++]);
        swap(&items[store], &items[high]);
        /* items[low:store] come before the pivot, now at `store`; the rest after it */
        if (store == k - 1 || store == k) return;
        if (store < k) low = store + 1;
        else high = store - 1;
    }
}

/* Insertion sort of a few hundred items in rank order. */
static void sort_ranked(int64_t *items, int64_t count, const double *loss, const int64_t *positions) {
    for (int64_t x = 1; x < count; x++) {
        int64_t item = items[x], y = x;
        while (y > 0 && by_loss_then_age(item, items[y - 1], loss, positions) < 0) {
            items[y] = items[y - 1];
            y--;
        }
        items[y] = item;
    }
}

/* The losses g(i | S - i) of `_StreamingSummary._losses`, +inf for dead members. */
static void losses(const head_t *h, scratch_t *s) {
    int64_t n = h->n;
    double weight = pairwise_sum(h->count, n);
    if (weight < DBL_MIN) weight = DBL_MIN;
    for (int g = 0; g < h->groups; g++) {
        s->total[g] = pairwise_sum(h->mass + (size_t)g * (size_t)n, n);
        s->phi_total[g] = phi(&h->phi, s->total[g]);
    }
    double low_d = INFINITY, high_d = -INFINITY, low_i = INFINITY, high_i = -INFINITY;
    for (int64_t x = 0; x < n; x++) {
        double diversity = h->count[x] * (double)(1.0f - h->nn_sim[x]) / weight;
        double importance = 0.0;
        for (int g = 0; g < h->groups; g++) {
            double rest = s->total[g] - h->mass[(size_t)g * (size_t)n + (size_t)x];
            double loss = s->phi_total[g] - phi(&h->phi, rest > 0 ? rest : 0.0);
            importance = g == 0 ? loss : importance + loss;
        }
        s->diversity[x] = diversity;
        s->importance[x] = importance;
        if (h->alive[x]) {
            if (diversity < low_d) low_d = diversity;
            if (diversity > high_d) high_d = diversity;
            if (importance < low_i) low_i = importance;
            if (importance > high_i) high_i = importance;
        }
    }
    for (int64_t x = 0; x < n; x++) {
        if (!h->alive[x]) {
            s->loss[x] = INFINITY;
            continue;
        }
        double d = s->diversity[x], i = s->importance[x];
        if (h->minmax) {
            d = high_d - low_d > 0 ? (d - low_d) / (high_d - low_d) : 0.0;
            i = high_i - low_i > 0 ? (i - low_i) / (high_i - low_i) : 0.0;
        }
        s->loss[x] = h->lam * d + (1 - h->lam) * i;
    }
}

/* One round: `_cheapest` then `_evict`. */
static void round_once(const head_t *h, scratch_t *s, int64_t excess) {
    int64_t n = h->n, live = 0;
    losses(h, s);
    for (int64_t x = 0; x < n; x++)
        if (h->alive[x]) s->order[live++] = x;
    select_first(s->order, live, excess, s->loss, h->positions);
    sort_ranked(s->order, excess, s->loss, h->positions);
    for (int64_t x = 0; x < n; x++) {
        s->rank[x] = n;
        s->gone[x] = 0;
    }
    for (int64_t r = 0; r < excess; r++) s->rank[s->order[r]] = r;
    /* the cheapest, but not one whose neighbour is a cheaper one of them */
    for (int64_t r = 0; r < excess; r++) {
        int64_t x = s->order[r], nn = h->nn_idx[x];
        if (!(nn >= 0 && s->rank[nn] < r)) s->gone[x] = 1;
    }
    for (int64_t x = 0; x < n; x++) {
        if (!s->gone[x]) continue;
        h->alive[x] = 0;
        h->count[x] = 0.0;
        for (int g = 0; g < h->groups; g++) h->mass[(size_t)g * (size_t)n + (size_t)x] = 0.0;
    }
    /* members whose neighbour left search again among the live ones */
    int64_t lost = 0;
    for (int64_t x = 0; x < n; x++) {
        int64_t nn = h->nn_idx[x];
        if (h->alive[x] && nn >= 0 && s->gone[nn]) s->order[lost++] = x;
    }
    if (!lost) return;
    for (int64_t t = 0; t * TILE < n; t++) {
        uint16_t bits = 0;
        for (int lane = 0; lane < TILE && t * TILE + lane < n; lane++)
            if (h->alive[t * TILE + lane]) bits |= (uint16_t)(1u << lane);
        s->live[t] = bits;
    }
    for (int64_t first = 0; first < lost; first += 4) {
        int count = lost - first < 4 ? (int)(lost - first) : 4;
        float best[4];
        int64_t at[4];
#ifdef KERNEL_X86
        if (h->vector)
            search_avx512(h->tiles, h->unit, h->d, (n + TILE - 1) / TILE, s->order + first, count, s->live, best,
                          at, NULL, NULL, 0, 0);
        else
#endif
            for (int r = 0; r < count; r++) nearest_scalar(h, s->order[first + r], &best[r], &at[r]);
        for (int r = 0; r < count; r++) {
            int64_t x = s->order[first + r];
            h->nn_sim[x] = at[r] >= 0 ? (1.0f + best[r]) / 2.0f : 0.0f;
            h->nn_idx[x] = at[r];
        }
    }
}

/* unit [n, d] -> tiles [ceil(n / 16), d, 16], a last tile's unused slots zero. */
static void make_tiles(const float *unit, int64_t n, int64_t d, float *tiles) {
    int64_t padded = (n + TILE - 1) / TILE * TILE;
    for (int64_t x = 0; x < padded; x++)
        for (int64_t j = 0; j < d; j++)
            tiles[(size_t)(x / TILE) * (size_t)d * TILE + (size_t)j * TILE + (size_t)(x % TILE)] =
                x < n ? unit[(size_t)x * (size_t)d + (size_t)j] : 0.0f;
}

static void shrink_head(const head_t *h, scratch_t *s) {
    int64_t n = h->n;
    make_tiles(h->unit, n, h->d, h->tiles);
    for (;;) {
        int64_t live = 0;
        for (int64_t x = 0; x < n; x++) live += h->alive[x];
        int64_t excess = live - h->budget < h->block ? live - h->budget : h->block;
        if (excess <= 0) break;
        round_once(h, s, excess);
    }
}

/* ---- append: the batch joins the summary ------------------------------------------------ */

/* `_StreamingSummary.append`: members [held, n) join, `block` at a time; each new member's
 * nearest among everyone so far (not itself), and each earlier member adopts a new one
 * that is strictly nearer than its neighbour (the first such new member on a tie). */
static void append_head(const float *unit, int64_t n, int64_t d, int64_t held, int64_t block, float *nn_sim,
                        int64_t *nn_idx, float *tiles, uint16_t *live, float *older_best, int32_t *older_row,
                        int64_t *rows, int vector) {
    (void)vector; /* (read only where the vector path is compiled) */
    make_tiles(unit, n, d, tiles);
    for (int64_t start = held; start < n; start += block) {
        int64_t stop = n - start < block ? n : start + block, tiles_in = (stop + TILE - 1) / TILE;
        for (int64_t x = 0; x < start; x++) {
            older_best[x] = -INFINITY;
            older_row[x] = -1;
        }
        for (int64_t t = 0; t < tiles_in; t++) {
            int64_t lanes = stop - t * TILE < TILE ? stop - t * TILE : TILE;
            live[t] = (uint16_t)(lanes == TILE ? 0xffffu : (1u << lanes) - 1);
        }
        for (int64_t first = start; first < stop; first += 4) {
            int count = stop - first < 4 ? (int)(stop - first) : 4;
            float best[4];
            int64_t at[4];
            for (int r = 0; r < count; r++) rows[r] = first + r;
#ifdef KERNEL_X86
            if (vector) {
                search_avx512(tiles, unit, d, tiles_in, rows, count, live, best, at, older_best, older_row, start,
                              start);
            } else
#endif
            {
                for (int r = 0; r < count; r++) {
                    const float *query = unit + (size_t)rows[r] * (size_t)d;
                    best[r] = -INFINITY;
                    at[r] = -1;
                    for (int64_t x = 0; x < stop; x++) {
                        float dot = tile_dot(query, tiles, d, x);
                        if (x != rows[r] && dot > best[r]) {
                            best[r] = dot;
                            at[r] = x;
                        }
                        if (x < start && dot > older_best[x]) {
                            older_best[x] = dot;
                            older_row[x] = (int32_t)(rows[r] - start);
                        }
                    }
                }
            }
            for (int r = 0; r < count; r++) {
                nn_sim[rows[r]] = at[r] >= 0 ? (1.0f + best[r]) / 2.0f : 0.0f;
                nn_idx[rows[r]] = at[r];
            }
        }
        for (int64_t x = 0; x < start; x++) {
            float sim = (1.0f + older_best[x]) / 2.0f;
            if (older_row[x] >= 0 && sim > nn_sim[x]) {
                nn_sim[x] = sim;
                nn_idx[x] = start + older_row[x];
            }
        }
    }
}

/* append(unit, heads, n, d, held, block, nn_sim, nn_idx, vector): every head's append, in
 * place. unit float32 [heads, n, d]; nn_sim float32 / nn_idx int64 [heads, n], their first
 * `held` entries the summary's (indices into it). */
static PyObject *py_append(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long unit, nn_sim, nn_idx;
    long long heads, n, d, held, block;
    int vector;
    if (!PyArg_ParseTuple(args, "KLLLLLKKp", &unit, &heads, &n, &d, &held, &block, &nn_sim, &nn_idx, &vector))
        return NULL;
    if (heads < 0 || n < 0 || d <= 0 || held < 0 || held > n || block <= 0 || n >= INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "_summary: shapes out of range");
        return NULL;
    }
    if (vector && !cpu_has_avx512()) {
        PyErr_SetString(PyExc_RuntimeError, "_summary: this CPU has no AVX-512");
        return NULL;
    }
    if (n == held) Py_RETURN_NONE;
    size_t padded = (size_t)(n + TILE - 1) / TILE * TILE;
    size_t bytes = padded * (size_t)d * sizeof(float) + padded / TILE * sizeof(uint16_t) +
                   padded * (sizeof(float) + sizeof(int32_t)) + 4 * sizeof(int64_t);
    char *memory = PyMem_Malloc(bytes);
    if (!memory) return PyErr_NoMemory();
    float *tiles = (float *)memory;
    float *older_best = tiles + padded * (size_t)d;
    int32_t *older_row = (int32_t *)(older_best + padded);
    int64_t *rows = (int64_t *)(older_row + padded);
    uint16_t *live = (uint16_t *)(rows + 4);
    Py_BEGIN_ALLOW_THREADS
    for (long long k = 0; k < heads; k++) {
        size_t row = (size_t)k * (size_t)n;
        append_head((const float *)(uintptr_t)unit + row * (size_t)d, n, d, held, block,
                    (float *)(uintptr_t)nn_sim + row, (int64_t *)(uintptr_t)nn_idx + row, tiles, live, older_best,
                    older_row, rows, vector);
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(memory);
    Py_RETURN_NONE;
}

/* shrink(unit, heads, n, d, groups, count, mass, positions, alive, nn_sim, nn_idx, budget, block,
 *        lam, phi_log, alpha, beta, minmax, vector): every head's rounds, in place.
 * Pointers are addresses of contiguous buffers:
 *   unit float32 [heads, n, d]; count float64 [heads, n]; mass float64 [heads, groups, n];
 *   positions int64 [heads, n]; alive bool [heads, n]; nn_sim float32 [heads, n];
 *   nn_idx int64 [heads, n]. */
static PyObject *py_shrink(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long unit, count, mass, positions, alive, nn_sim, nn_idx;
    long long heads, n, d, budget, block;
    int groups, phi_log, minmax, vector;
    double lam, alpha, beta;
    if (!PyArg_ParseTuple(args, "KLLLiKKKKKKLLdpddpp", &unit, &heads, &n, &d, &groups, &count, &mass, &positions,
                          &alive, &nn_sim, &nn_idx, &budget, &block, &lam, &phi_log, &alpha, &beta, &minmax,
                          &vector))
        return NULL;
    if (heads < 0 || n < 0 || d <= 0 || groups < 0 || budget < 0 || block <= 0) {
        PyErr_SetString(PyExc_ValueError, "_summary: shapes out of range");
        return NULL;
    }
    if (vector && !cpu_has_avx512()) {
        PyErr_SetString(PyExc_RuntimeError, "_summary: this CPU has no AVX-512");
        return NULL;
    }
    if (n == 0) Py_RETURN_NONE;
    size_t padded = (size_t)(n + TILE - 1) / TILE * TILE;
    size_t bytes = padded * (size_t)d * sizeof(float) + (size_t)n * (3 * sizeof(double) + 2 * sizeof(int64_t) + 1) +
                   (size_t)groups * 2 * sizeof(double) + padded / TILE * sizeof(uint16_t);
    char *memory = PyMem_Malloc(bytes);
    if (!memory) return PyErr_NoMemory();
    scratch_t s;
    char *at = memory;
    float *tiles = (float *)at;
    at += padded * (size_t)d * sizeof(float);
    s.loss = (double *)at, at += (size_t)n * sizeof(double);
    s.diversity = (double *)at, at += (size_t)n * sizeof(double);
    s.importance = (double *)at, at += (size_t)n * sizeof(double);
    s.order = (int64_t *)at, at += (size_t)n * sizeof(int64_t);
    s.rank = (int64_t *)at, at += (size_t)n * sizeof(int64_t);
    s.total = (double *)at, at += (size_t)groups * sizeof(double);
    s.phi_total = (double *)at, at += (size_t)groups * sizeof(double);
    s.live = (uint16_t *)at, at += padded / TILE * sizeof(uint16_t);
    s.gone = (uint8_t *)at;
    Py_BEGIN_ALLOW_THREADS
    for (long long k = 0; k < heads; k++) {
        size_t row = (size_t)k * (size_t)n;
        head_t h = {
            (const float *)(uintptr_t)unit + row * (size_t)d, tiles, (double *)(uintptr_t)count + row,
            (double *)(uintptr_t)mass + row * (size_t)groups, (const int64_t *)(uintptr_t)positions + row,
            (uint8_t *)(uintptr_t)alive + row, (float *)(uintptr_t)nn_sim + row, (int64_t *)(uintptr_t)nn_idx + row,
            n, d, budget, block, groups, lam, minmax, {phi_log, alpha, beta}, vector,
        };
        shrink_head(&h, &s);
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(memory);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"append", py_append, METH_VARARGS, "bumblebee's streaming append (the neighbour cache) for every KV head."},
    {"shrink", py_shrink, METH_VARARGS, "bumblebee's streaming eviction rounds for every KV head of a layer."},
    {"vector", py_vector, METH_NOARGS, "Whether this CPU has AVX-512 (the vector path)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_summary", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__summary(void) { return PyModule_Create(&module); }
