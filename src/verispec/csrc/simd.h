/* The vector vocabulary the per-ISA sources are written in, after llama.cpp's simd-mappings.h:
 * VEC (a vector of LANES floats) and the V* operations on it, mapped per ISA by simd_avx512.h and
 * simd_avx2.h, plus the tile shapes each ISA's register file fits. A vector source is compiled once
 * per ISA (kernels/build.py): with -DVS_ISA_AVX512 -mavx512f, and with -DVS_ISA_AVX2 -mavx2 -mfma;
 * VS_FN(name) names its functions name_512 or name_256, so both live in one library and the caller
 * picks one per call (its `isa` argument).
 *
 * Exactness: every V* operation is one IEEE operation per lane (VFMA one fused multiply-add), so
 * math written once against them rounds the same way on either ISA lane by lane; only which lanes
 * a sum is split over (LANES) differs, and the kernels' comments say where that shows. */
#ifndef VS_SIMD_H
#define VS_SIMD_H

#define VS_CAT_(a, b) a##b
#define VS_CAT(a, b) VS_CAT_(a, b)  /* a and b macro-expanded first, then pasted */

#if defined(VS_ISA_AVX512)
#include "simd_avx512.h"
#define VS_FN(name) VS_CAT(name, _512)
#elif defined(VS_ISA_AVX2)
#include "simd_avx2.h"
#define VS_FN(name) VS_CAT(name, _256)
#else
#error "a vector source: compile it with -DVS_ISA_AVX512 -mavx512f or -DVS_ISA_AVX2 -mavx2 -mfma (see kernels/build.py)"
#endif

#endif
