/* subgen's farthest-first selection (greedy k-center, Gonzalez) in one call per layer, a
 * KV head at a time (kvchat/compress/_kcenter.py, `farthest_first`, whose docstring states
 * the rule; kvchat/native/__init__.py, `farthest_centres`, checks and makes the call).
 *
 * Why native: a step is a pass over the head's points (the new centre's distance to each,
 * the running minimum, the next centre at its maximum), but in torch it is five small calls
 * whose dispatch, plus reading the float32 points of three heads (4.5 MB at a 6k prefill,
 * past the core's L2) per step, takes 60 us; a 6k prefill's flush runs 772 steps a layer,
 * 1.5 s of subgen's time to first token (measured on a 2-core AMD EPYC, Zen 5;
 * docs/decisions/0007-c-kernels-with-python-twins.md). Here one
 * head's points stay in bf16 when the layer is bf16 (0.75 MB: they stay in L2 from step to
 * step) and a step is one pass plus a scan of the minima, with the GIL released.
 *
 * It computes the same quantity in the same precision as the torch loop: the half squared
 * distance (|x|^2 + |c|^2)/2 - <c, x> in float32 from the points' own values (bf16 to
 * float32 is exact), the products' sums in another order than torch's, so a near-tie may
 * fall the other way (tests/compress/test_subgen.py compares the two). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_kernel.h"

/* The points are in tiles of 16: [tiles, d, 16], coordinate j of point x at
 * (x / 16) * d * 16 + j * 16 + x % 16, so a step reads each tile's 16 points' coordinates
 * in one run of memory. A last tile's unused slots hold zeros and are never candidates. */
#define TILE 16

static inline float coord(const void *tiles, int bf16, int64_t d, int64_t j, int64_t x) {
    size_t at = (size_t)(x / TILE) * (size_t)d * TILE + (size_t)j * TILE + (size_t)(x % TILE);
    return bf16 ? bf16_to_float(((const uint16_t *)tiles)[at]) : ((const float *)tiles)[at];
}

/* ---- one step's pass: distance to the new centre, running minimum, owner, next centre -- */

/* dist = (half_sq[x] - <c, x>) + half_sq_c, as torch's baddbmm then add_; `centre` holds
 * the centre's d coordinates in float32. The dot product is a chain of fused multiply-adds
 * in coordinate order, as each lane of the vector pass computes it: both paths give the
 * same numbers. Returns the first point of largest running minimum (as torch's argmax).
 * The centre's own minimum is already -inf, so it stays out. */
static int64_t pass_scalar(const void *tiles, int bf16, int64_t n, int64_t d, const float *centre, float half_sq_c,
                           const float *half_sq, float *nearest, int64_t *owner, int64_t step) {
    int64_t best = 0;
    for (int64_t x = 0; x < n; x++) {
        float dot = 0.0f;
        for (int64_t j = 0; j < d; j++) dot = fmaf(centre[j], coord(tiles, bf16, d, j, x), dot);
        float dist = (half_sq[x] - dot) + half_sq_c;
        if (dist < nearest[x]) {
            if (owner) owner[x] = step;
            nearest[x] = dist;
        }
        if (nearest[x] > nearest[best]) best = x;
    }
    return best;
}

#ifdef KERNEL_X86
__attribute__((target("avx512f"))) static inline __m512 load_tile_row(const void *tiles, int bf16, size_t at) {
    if (bf16) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)tiles + at));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    return _mm512_loadu_ps((const float *)tiles + at);
}

/* GROUP tiles at a time: each tile's 16 dot products are one chain of fused multiply-adds
 * over the d coordinates, and GROUP chains run side by side (one chain alone waits on the
 * multiply-add's latency at every coordinate). `nearest`, `half_sq` and `owner` are padded
 * to whole tiles, the padding's minimum -inf. */
#define GROUP 8
__attribute__((target("avx512f"))) static int64_t pass_avx512(const void *tiles, int bf16, int64_t n, int64_t d,
                                                              const float *centre, float half_sq_c,
                                                              const float *half_sq, float *nearest, int64_t *owner,
                                                              int64_t step) {
    __m512 hc = _mm512_set1_ps(half_sq_c);
    __m512i step_v = _mm512_set1_epi64(step);
    __m512 top = _mm512_set1_ps(-INFINITY);
    __m512i top_tile = _mm512_setzero_si512();
    int64_t count = (n + TILE - 1) / TILE;
    size_t tile_size = (size_t)d * TILE;
    for (int64_t first = 0; first < count; first += GROUP) {
        int64_t group = count - first < GROUP ? count - first : GROUP;
        __m512 dot[GROUP];
        for (int g = 0; g < GROUP; g++) dot[g] = _mm512_setzero_ps();
        size_t base = (size_t)first * tile_size;
        if (group == GROUP) {
            for (int64_t j = 0; j < d; j++) {
                __m512 c = _mm512_set1_ps(centre[j]);
                for (int g = 0; g < GROUP; g++)
                    dot[g] = _mm512_fmadd_ps(c, load_tile_row(tiles, bf16, base + g * tile_size + (size_t)j * TILE),
                                             dot[g]);
            }
        } else {
            for (int64_t j = 0; j < d; j++) {
                __m512 c = _mm512_set1_ps(centre[j]);
                for (int g = 0; g < group; g++)
                    dot[g] = _mm512_fmadd_ps(c, load_tile_row(tiles, bf16, base + g * tile_size + (size_t)j * TILE),
                                             dot[g]);
            }
        }
        for (int g = 0; g < group; g++) {
            int64_t t = first + g;
            size_t x = (size_t)t * TILE;
            __m512 dist = _mm512_add_ps(_mm512_sub_ps(_mm512_loadu_ps(half_sq + x), dot[g]), hc);
            __m512 near = _mm512_loadu_ps(nearest + x);
            __mmask16 closer = _mm512_cmp_ps_mask(dist, near, _CMP_LT_OQ);
            if (owner && closer) {
                _mm512_mask_storeu_epi64(owner + x, (__mmask8)(closer & 0xff), step_v);
                _mm512_mask_storeu_epi64(owner + x + 8, (__mmask8)(closer >> 8), step_v);
            }
            near = _mm512_mask_blend_ps(closer, near, dist);
            _mm512_storeu_ps(nearest + x, near);
            /* each lane's largest minimum and the first tile that held it */
            __mmask16 higher = _mm512_cmp_ps_mask(near, top, _CMP_GT_OQ);
            top = _mm512_mask_blend_ps(higher, top, near);
            top_tile = _mm512_mask_blend_epi32(higher, top_tile, _mm512_set1_epi32((int)t));
        }
    }
    float value[TILE];
    int32_t tile_of[TILE];
    _mm512_storeu_ps(value, top);
    _mm512_storeu_si512(tile_of, top_tile);
    int64_t best = -1;
    float high = -INFINITY;
    for (int lane = 0; lane < TILE; lane++) {
        int64_t x = (int64_t)tile_of[lane] * TILE + lane;
        if (value[lane] > high || (value[lane] == high && value[lane] > -INFINITY && x < best)) {
            high = value[lane];
            best = x;
        }
    }
    return best < 0 ? 0 : best;
}

#endif

/* ---- one head -------------------------------------------------------------------------- */

/* Scratch: half_sq, nearest [padded n], centre [d]; owner padded too (its padding unused). */
static void run_head(const void *tiles, int bf16, int64_t n, int64_t d, int64_t k, float *half_sq, float *nearest,
                     float *centre, int64_t *chosen, int64_t *owner, int vector) {
    (void)vector; /* (read only where the vector path is compiled) */
    int64_t padded = (n + TILE - 1) / TILE * TILE;
    for (int64_t x = 0; x < padded; x++) {
        float sq = 0.0f;
        for (int64_t j = 0; j < d && x < n; j++) {
            float v = coord(tiles, bf16, d, j, x);
            sq += v * v;
        }
        half_sq[x] = sq * 0.5f;
        nearest[x] = x < n ? INFINITY : -INFINITY;
        if (owner) owner[x] = 0;
    }
    int64_t current = 0;
    for (int64_t step = 0; step < k; step++) {
        chosen[step] = current;
        for (int64_t j = 0; j < d; j++) centre[j] = coord(tiles, bf16, d, j, current);
        /* The centre itself: -inf, so it is never chosen again (and owns itself). */
        nearest[current] = -INFINITY;
        if (owner) owner[current] = step;
#ifdef KERNEL_X86
        if (vector)
            current = pass_avx512(tiles, bf16, n, d, centre, half_sq[current], half_sq, nearest, owner, step);
        else
#endif
            current = pass_scalar(tiles, bf16, n, d, centre, half_sq[current], half_sq, nearest, owner, step);
    }
}

/* farthest(tiles, bf16, heads, n, d, k, chosen, owner, vector): every head's centres.
 * Pointers are addresses of contiguous buffers:
 *   tiles  [heads, ceil(n / 16), d, 16] bf16 (bf16 = 1) or float32: each head's points in
 *          tiles of 16 (above), a last tile's unused slots zero
 *   chosen int64 [heads, k]: the centres' indices, in the order they were chosen
 *   owner  int64 [heads, ceil(n / 16) * 16], or 0: the step whose centre is each point's
 *          nearest (the padding's entries are written too). */
static PyObject *py_farthest(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long tiles, chosen, owner;
    long long heads, n, d, k;
    int bf16, vector;
    if (!PyArg_ParseTuple(args, "KpLLLLKKp", &tiles, &bf16, &heads, &n, &d, &k, &chosen, &owner, &vector))
        return NULL;
    if (heads < 0 || n <= 0 || d <= 0 || k < 0 || k > n) {
        PyErr_SetString(PyExc_ValueError, "_farthest: shapes out of range");
        return NULL;
    }
    if (vector && !cpu_has_avx512()) {
        PyErr_SetString(PyExc_RuntimeError, "_farthest: this CPU has no AVX-512");
        return NULL;
    }
    size_t padded = (size_t)(n + TILE - 1) / TILE * TILE;
    float *scratch = PyMem_Malloc((padded * 2 + (size_t)d) * sizeof(float));
    if (!scratch) return PyErr_NoMemory();
    size_t head_bytes = padded * (size_t)d * (bf16 ? 2 : 4);
    Py_BEGIN_ALLOW_THREADS
    for (long long h = 0; h < heads; h++) {
        run_head((const char *)(uintptr_t)tiles + (size_t)h * head_bytes, bf16, n, d, k, scratch, scratch + padded,
                 scratch + 2 * padded, (int64_t *)(uintptr_t)chosen + (size_t)h * (size_t)k,
                 owner ? (int64_t *)(uintptr_t)owner + (size_t)h * padded : NULL, vector);
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(scratch);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"farthest", py_farthest, METH_VARARGS, "subgen's farthest-first centres of every KV head of a layer."},
    {"vector", py_vector, METH_NOARGS, "Whether this CPU has AVX-512 (the vector path)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_farthest", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__farthest(void) { return PyModule_Create(&module); }
