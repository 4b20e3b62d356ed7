/* ======== exp, for softmax and SiLU (written once against simd.h) ========
 * e^x = 2^n e^r with n = round(x / ln 2), r = x - n ln 2 (ln 2 split in two parts for precision)
 * and e^r from a degree-6 polynomial on |r| <= ln2/2 (relative error ~1e-7). x is clamped to
 * [-87.3, 88.3]: e^-87.3 ~ 1e-38 stands in for 0. Every lane runs the same operations, so an
 * element's result never depends on its neighbours or its lane. */
#ifndef VS_VEXP_H
#define VS_VEXP_H

#include "simd.h"

static inline VEC vexp(VEC x)
{
    x = VMIN(VMAX(x, VSET1(-87.3f)), VSET1(88.3f));
    const VEC n = VROUND(VMUL(x, VSET1(1.44269504088896341f)));
    VEC r = VFMA(n, VSET1(-0.693359375f), x);
    r = VFMA(n, VSET1(2.12194440e-4f), r);
    VEC p = VSET1(1.9875691500e-4f);
    p = VFMA(p, r, VSET1(1.3981999507e-3f));
    p = VFMA(p, r, VSET1(8.3334519073e-3f));
    p = VFMA(p, r, VSET1(4.1665795894e-2f));
    p = VFMA(p, r, VSET1(1.6666665459e-1f));
    p = VFMA(p, r, VSET1(5.0000001201e-1f));
    p = VFMA(p, VMUL(r, r), VADD(r, VSET1(1.0f)));
    return VPOW2MUL(p, n);
}

#endif
