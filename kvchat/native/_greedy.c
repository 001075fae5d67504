/* bumblebee's offline greedy (Algorithm 1, stochastic) in one call per KV head
 * (kvchat/compress/bumblebee.py, `BumbleBee._greedy`, whose docstring states the rule;
 * kvchat/native/__init__.py, `greedy_picks`, checks and makes the call).
 *
 * Why native: the greedy is `budget` dependent steps (1,024 at a 4k prefill), each a few
 * dozen small NumPy and torch calls in Python: about 0.1 s a layer of Python and small
 * ops where the arithmetic is a few milliseconds, and two layers' greedies on two Python
 * threads wait on each other (measured on a 2-core AMD EPYC, Zen 5;
 * docs/decisions/0007-c-kernels-with-python-twins.md). Here a step is one pass over its
 * candidates' rows of cosines, with the GIL released.
 *
 * It takes the same inputs as the Python loop, including the same uniform draws (drawn by
 * torch from the layer's generator before the call), and computes the same quantities in
 * the same precision: a candidate's reach sum_v count_v * max(cos, cover_v) in float32,
 * everything after it in float64. The sums run in another order than torch's, so a
 * near-tie may fall the other way on float32 cosines (tests/compress/test_bumblebee.py
 * compares: on bf16 ones the picks are the same). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_kernel.h"

/* ---- a candidate's reach: sum_v count_v * max(row_v, cover_v) ---------------------- */

static float reach_scalar(const void *row, int bf16, const float *cover, const float *count, int64_t n) {
    float sum = 0.0f;
    for (int64_t v = 0; v < n; v++) {
        float c = bf16 ? bf16_to_float(((const uint16_t *)row)[v]) : ((const float *)row)[v];
        float m = c > cover[v] ? c : cover[v];
        sum += count ? count[v] * m : m;
    }
    return sum;
}

#ifdef KERNEL_X86
__attribute__((target("avx512f")))
static float reach_avx512(const void *row, int bf16, const float *cover, const float *count, int64_t n) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t v = 0;
    for (; v + 32 <= n; v += 32) {
        __m512 a, b;
        if (bf16) {
            const uint16_t *r = (const uint16_t *)row + v;
            a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)r)), 16));
            b = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r + 16))), 16));
        } else {
            a = _mm512_loadu_ps((const float *)row + v);
            b = _mm512_loadu_ps((const float *)row + v + 16);
        }
        a = _mm512_max_ps(a, _mm512_loadu_ps(cover + v));
        b = _mm512_max_ps(b, _mm512_loadu_ps(cover + v + 16));
        if (count) {
            acc0 = _mm512_fmadd_ps(a, _mm512_loadu_ps(count + v), acc0);
            acc1 = _mm512_fmadd_ps(b, _mm512_loadu_ps(count + v + 16), acc1);
        } else {
            acc0 = _mm512_add_ps(acc0, a);
            acc1 = _mm512_add_ps(acc1, b);
        }
    }
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    const char *rest = (const char *)row + v * (bf16 ? 2 : 4);
    return sum + reach_scalar(rest, bf16, cover + v, count ? count + v : NULL, n - v);
}

#endif

/* ---- one head ------------------------------------------------------------------------ */

typedef struct {
    const char *cos;     /* [n, n] of this head, bf16 or float32 */
    int bf16;
    int64_t n, picked, sample, draw_steps, heads, head;
    const float *draws;  /* [draw_steps, heads, sample] */
    const float *count;  /* [n] or NULL (every entry stands for one token) */
    double weight;       /* sum of count */
    const double *mass;  /* [groups, n] */
    int groups;
    double lam;
    int minmax;
    phi_t phi;
    int64_t *out;        /* [picked] */
    int vector;
} head_args;

/* Scratch for one head, in one allocation. */
typedef struct {
    float *cover, *reach;
    double *total, *diversity, *importance;
    int64_t *free_, *slot, *cand;
} scratch_t;

static int run_head(const head_args *a, scratch_t *s) {
    int64_t n = a->n;
    size_t row_bytes = (size_t)n * (a->bf16 ? 2 : 4);
    double covered = -a->weight;
    for (int64_t v = 0; v < n; v++) {
        s->cover[v] = -1.0f;
        s->free_[v] = s->slot[v] = v;
    }
    for (int g = 0; g < a->groups; g++) s->total[g] = 0.0;
    for (int64_t step = 0; step < a->picked; step++) {
        int64_t untaken = n - step, r_count;
        if (a->sample >= untaken) {
            r_count = untaken;
            memcpy(s->cand, s->free_, sizeof(int64_t) * (size_t)untaken);
        } else {
            if (step >= a->draw_steps) return -1;
            r_count = a->sample;
            const float *draw = a->draws + ((size_t)step * (size_t)a->heads + (size_t)a->head) * (size_t)a->sample;
            for (int64_t i = 0; i < r_count; i++) {
                int64_t at = (int64_t)(draw[i] * (float)untaken);
                s->cand[i] = s->free_[at < untaken - 1 ? at : untaken - 1];
            }
        }
        double low_d = INFINITY, high_d = -INFINITY, low_i = INFINITY, high_i = -INFINITY;
        for (int64_t r = 0; r < r_count; r++) {
            const char *row = a->cos + (size_t)s->cand[r] * row_bytes;
#ifdef KERNEL_X86
            if (r + 1 < r_count) { /* the next candidate's row, while this one is summed */
                const char *next = a->cos + (size_t)s->cand[r + 1] * row_bytes;
                for (size_t at = 0; at < row_bytes; at += 64) _mm_prefetch(next + at, _MM_HINT_T0);
            }
            s->reach[r] = a->vector ? reach_avx512(row, a->bf16, s->cover, a->count, n)
                                    : reach_scalar(row, a->bf16, s->cover, a->count, n);
#else
            s->reach[r] = reach_scalar(row, a->bf16, s->cover, a->count, n);
#endif
            double diversity = ((double)s->reach[r] - covered) / (2 * a->weight);
            double importance = 0.0;
            for (int g = 0; g < a->groups; g++) {
                double t = s->total[g];
                importance += phi(&a->phi, t + a->mass[(size_t)g * (size_t)n + (size_t)s->cand[r]]) - phi(&a->phi, t);
            }
            s->diversity[r] = diversity;
            s->importance[r] = importance;
            if (diversity < low_d) low_d = diversity;
            if (diversity > high_d) high_d = diversity;
            if (importance < low_i) low_i = importance;
            if (importance > high_i) high_i = importance;
        }
        int64_t choice = 0;
        double best = -INFINITY;
        for (int64_t r = 0; r < r_count; r++) {
            double d = s->diversity[r], i = s->importance[r];
            if (a->minmax) {
                d = high_d - low_d > 0 ? (d - low_d) / (high_d - low_d) : 0.0;
                i = high_i - low_i > 0 ? (i - low_i) / (high_i - low_i) : 0.0;
            }
            double score = a->lam * d + (1 - a->lam) * i;
            if (score > best) { /* the first of equal maxima, as argmax */
                best = score;
                choice = r;
            }
        }
        int64_t pick = s->cand[choice];
        a->out[step] = pick;
        int64_t gone = s->slot[pick], last = s->free_[untaken - 1];
        s->free_[gone] = last;
        s->slot[last] = gone;
        const char *row = a->cos + (size_t)pick * row_bytes;
        for (int64_t v = 0; v < n; v++) {
            float c = a->bf16 ? bf16_to_float(((const uint16_t *)row)[v]) : ((const float *)row)[v];
            if (c > s->cover[v]) s->cover[v] = c;
        }
        covered = (double)s->reach[choice];
        for (int g = 0; g < a->groups; g++) s->total[g] += a->mass[(size_t)g * (size_t)n + (size_t)pick];
    }
    return 0;
}

/* greedy(cos, bf16, n, picked, sample, draws, draw_steps, heads, head, count, weight, mass, groups,
 *        lam, phi_log, alpha, beta, minmax, out, vector): one KV head's picks.
 * Pointers are addresses of contiguous buffers:
 *   cos    [n, n] bf16 (bf16 = 1) or float32: every pair's cosine, of this head
 *   draws  float32 [draw_steps, heads, sample]: the uniform draws of the steps that sample,
 *          of every head of the layer (`head` is this one)
 *   count  float32 [n], or 0: every entry stands for one token
 *   weight: the sum of count; mass float64 [groups, n]
 *   out    int64 [picked]: the picks, in the order they were made. */
static PyObject *py_greedy(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long cos, draws, count, mass, out;
    long long n, picked, sample, draw_steps;
    int bf16, heads, head, groups, phi_log, minmax, vector;
    double weight, lam, alpha, beta;
    if (!PyArg_ParseTuple(args, "KiLLLKLiiKdKidpddpKp", &cos, &bf16, &n, &picked, &sample, &draws, &draw_steps, &heads,
                          &head, &count, &weight, &mass, &groups, &lam, &phi_log, &alpha, &beta, &minmax, &out,
                          &vector))
        return NULL;
    if (heads <= 0 || head < 0 || head >= heads || n <= 0 || picked < 0 || picked > n || sample <= 0 || groups < 0 ||
        draw_steps < 0) {
        PyErr_SetString(PyExc_ValueError, "_greedy: shapes out of range");
        return NULL;
    }
    if (vector && !cpu_has_avx512()) {
        PyErr_SetString(PyExc_RuntimeError, "_greedy: this CPU has no AVX-512");
        return NULL;
    }
    int64_t r_max = sample > n ? n : sample;
    size_t bytes = (size_t)n * (2 * sizeof(float) + 3 * sizeof(int64_t)) + (size_t)r_max * 2 * sizeof(double) +
                   (size_t)groups * sizeof(double) + (size_t)n * sizeof(float);
    char *memory = PyMem_Malloc(bytes);
    if (!memory) return PyErr_NoMemory();
    scratch_t s;
    char *at = memory;
    s.free_ = (int64_t *)at, at += (size_t)n * sizeof(int64_t);
    s.slot = (int64_t *)at, at += (size_t)n * sizeof(int64_t);
    s.cand = (int64_t *)at, at += (size_t)n * sizeof(int64_t);
    s.diversity = (double *)at, at += (size_t)r_max * sizeof(double);
    s.importance = (double *)at, at += (size_t)r_max * sizeof(double);
    s.total = (double *)at, at += (size_t)groups * sizeof(double);
    s.cover = (float *)at, at += (size_t)n * sizeof(float);
    s.reach = (float *)at;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    head_args a = {
        (const char *)(uintptr_t)cos, bf16, n, picked, sample, draw_steps, heads, head,
        (const float *)(uintptr_t)draws, count ? (const float *)(uintptr_t)count : NULL, weight,
        (const double *)(uintptr_t)mass, groups, lam, minmax, {phi_log, alpha, beta}, (int64_t *)(uintptr_t)out,
        vector,
    };
    failed = run_head(&a, &s);
    Py_END_ALLOW_THREADS
    PyMem_Free(memory);
    if (failed) {
        PyErr_SetString(PyExc_ValueError, "_greedy: fewer draws than the steps that sample");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"greedy", py_greedy, METH_VARARGS, "bumblebee's stochastic greedy (Algorithm 1) for one KV head."},
    {"vector", py_vector, METH_NOARGS, "Whether this CPU has AVX-512 (the vector path)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_greedy", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__greedy(void) { return PyModule_Create(&module); }
