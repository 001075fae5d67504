/* The concave phi of accumulated attention, shared by bumblebee's two kernels
 * (`_greedy.c`, `_summary.c`) and computed as `_Objective.concave` in
 * kvchat/compress/bumblebee.py does. */
#ifndef KVCHAT_PHI_H
#define KVCHAT_PHI_H

#include <math.h>

typedef struct {
    int log; /* phi = log(1 + x); else the inverse of alpha y^(1/alpha) + beta y */
    double alpha, beta;
} phi_t;

static double phi(const phi_t *p, double x) {
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
