/* What kvchat's C kernels share (`_coldrank.c`: the recall tier's; `_greedy.c`, `_summary.c`:
 * bumblebee's; `_farthest.c`: subgen's): the x86 test, the CPU feature tests, bf16
 * numbers, the `vector` function of the compressors' modules, and bumblebee's concave phi
 * of accumulated attention, computed as `_Objective.concave` in
 * kvchat/compress/bumblebee.py does. Include after Python.h.
 *
 * Every function here is static inline: a module that does not use one compiles without
 * it. The modules take raw addresses; kvchat/native/__init__.py checks every call's
 * buffers before it makes one. */
#ifndef KVCHAT_KERNEL_H
#define KVCHAT_KERNEL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KERNEL_X86 1
#endif

static inline float bf16_to_float(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#ifdef KERNEL_X86
/* The compressors' vector path. */
static inline int cpu_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}

/* The recall ranking's paths: AVX512-VNNI, and AVX2 with FMA. */
static inline int cpu_has_vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
}

static inline int cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#else
static inline int cpu_has_avx512(void) { return 0; }
static inline int cpu_has_vnni(void) { return 0; }
static inline int cpu_has_avx2(void) { return 0; }
#endif

/* vector(): whether this CPU runs the module's AVX-512 path. */
static inline PyObject *py_vector(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyBool_FromLong(cpu_has_avx512());
}

typedef struct {
    int log; /* phi = log(1 + x); else the inverse of alpha y^(1/alpha) + beta y */
    double alpha, beta;
} phi_t;

static inline double phi(const phi_t *p, double x) {
    if (p->log) return log1p(x);
    double a = p->alpha, b = p->beta;
    if (a == 0.5) return sqrt(b * b + 2 * x) - b;
    /* Newton from an upper bound, as `_Objective.concave` does. */
    double y = pow(x / a, a);
    if (b > 0 && x / b < y) y = x / b;
    for (int i = 0; i < 100 && x > 0; i++) {
        double slope = pow(y > 1e-300 ? y : 1e-300, 1 / a - 1) + b;
        double step = (a * pow(y, 1 / a) + b * y - x) / slope;
        y -= step;
        if (fabs(step) <= 1e-14 * (1 + y)) break;
    }
    return y;
}

#endif
