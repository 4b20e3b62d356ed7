/* The row tiles of linear.c for one weight storage type: included by linear.c once per type, with
 * W (the type's name: f32, bf16, i8), WT (its element type), WLOAD / WLOADN (LANES weights, or the
 * first n, as float32, exactly) and WSCALE(sum, s) (the finished sum times the row's scale s, or
 * the sum) defined. WFN(name) names this type's functions name_W. */
#define WFN(name) VS_CAT(name, VS_CAT(_, W))

#define TILE(MR, JN)                                                                              \
static void WFN(tile_##MR##x##JN)(                                                                \
    const float *x, const WT *w, VEC *saved, int64_t k0, int64_t k1, int64_t K, const char *next)  \
{                                                                                                 \
    /* continue the accumulators saved [MR][NR] (columns 0 .. JN-1 of them) over k in [k0, k1) (plus \
     * the masked tail at the end); `next`, if set, is the next tile's weights: fetched into cache   \
     * while this one computes */                                                                 \
    VEC acc[MR][JN];                                                                              \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < JN; j++) acc[i][j] = k0 ? saved[i * NR + j] : VZERO(); \
    for (int64_t k = k0; k < k1; k += LANES) {                                                    \
        VEC wv[JN];                                                                               \
        _Pragma("GCC unroll 4") for (int j = 0; j < JN; j++) {                                   \
            wv[j] = WLOAD(w + j * K + k);                                                         \
            if (next) _mm_prefetch(next + (j * K + k) * (int64_t)sizeof(WT), _MM_HINT_T0);        \
        }                                                                                         \
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                   \
            VEC xv = VLOAD(x + i * K + k);                                                        \
            _Pragma("GCC unroll 4") for (int j = 0; j < JN; j++) acc[i][j] = VFMA(xv, wv[j], acc[i][j]); \
        }                                                                                         \
    }                                                                                             \
    if (k1 == K - K % LANES && K > k1) {                                                          \
        VEC wv[JN];                                                                               \
        for (int j = 0; j < JN; j++) wv[j] = WLOADN(w + j * K + k1, K - k1);                      \
        for (int i = 0; i < MR; i++) {                                                            \
            VEC xv = VLOADN(x + i * K + k1, K - k1);                                              \
            for (int j = 0; j < JN; j++) acc[i][j] = VFMA(xv, wv[j], acc[i][j]);                  \
        }                                                                                         \
    }                                                                                             \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < JN; j++) saved[i * NR + j] = acc[i][j];      \
}
/* Tiles of MR activation rows x all NR weight rows, and (for more rows than fit the vector registers
 * that way: MR * NR accumulators + NR weight vectors) MR rows x half the weight rows, called twice. */
typedef void (*WFN(tile_fn))(const float *, const WT *, VEC *, int64_t, int64_t, int64_t, const char *);
TILE(1, 4) TILE(2, 4)
#if FULLMR == 6  /* AVX-512: 32 registers hold 6 x 4 accumulators */
TILE(3, 4) TILE(4, 4) TILE(5, 4) TILE(6, 4)
static const WFN(tile_fn) WFN(tiles)[7] = {0, WFN(tile_1x4), WFN(tile_2x4), WFN(tile_3x4), WFN(tile_4x4),
                                           WFN(tile_5x4), WFN(tile_6x4)};
#else  /* AVX2: 16 registers hold 2 x 4 */
static const WFN(tile_fn) WFN(tiles)[3] = {0, WFN(tile_1x4), WFN(tile_2x4)};
#endif
#if FULLMR < ROWS
TILE(3, 2) TILE(4, 2) TILE(5, 2) TILE(6, 2)
static const WFN(tile_fn) WFN(halves)[7] = {0, 0, 0, WFN(tile_3x2), WFN(tile_4x2), WFN(tile_5x2), WFN(tile_6x2)};
#endif

/* The last N % 4 weight rows: one weight row at a time, the same per-element arithmetic. */
void VS_FN(WFN(linear_edge))(const float *x, const WT *w, const float *s, const float *b, float *y,
                             int64_t M, int64_t N, int64_t K)
{
    (void)s;  /* read by the int8 rows' WSCALE only */
    const int64_t kfull = K - K % LANES;
    for (int64_t i = 0; i < M; i++) {
        VEC acc = VZERO();
        for (int64_t k = 0; k < kfull; k += LANES) acc = VFMA(VLOAD(x + i * K + k), WLOAD(w + k), acc);
        if (K > kfull) acc = VFMA(VLOADN(x + i * K + kfull, K - kfull), WLOADN(w + kfull, K - kfull), acc);
        y[i * N] = WSCALE(VHSUM(acc), s[0]) + (b ? b[0] : 0.0f);
    }
}

/* Weight-row tiles [begin, end) of a linear_job: each weight byte is read by one thread, once per
 * row tile. k runs in blocks of KBLOCK so a tile's weight and activation rows stay in L1 while all
 * row tiles pass over them; the accumulators wait in `saved` between blocks, so every output still
 * sees one unbroken chain of multiply-adds in k order. */
void VS_FN(WFN(linear_range))(const void *arg, int64_t begin, int64_t end)
{
    const linear_job *job = arg;
    const int64_t M = job->M, N = job->N, K = job->K, kfull = K - K % LANES;
    VEC local[64 * NR];
    VEC *saved = M <= 64 ? local : aligned_alloc(64, sizeof(VEC) * (size_t)(M * NR));
    for (int64_t t = begin; t < end; t++) {
        const WT *w = (const WT *)job->w + t * NR * K;
        for (int64_t k0 = 0;; k0 += KBLOCK) {
            const int64_t k1 = k0 + KBLOCK < kfull ? k0 + KBLOCK : kfull;
            for (int64_t m0 = 0; m0 < M;) {
                /* Rows split evenly over the fewest passes: 8 rows -> 4 + 4 rather than 6 + 2. */
                const int64_t passes = (M - m0 + ROWS - 1) / ROWS;
                const int mr = (int)((M - m0 + passes - 1) / passes);
                /* the first row tile also prefetches the next weight tile: the hardware prefetcher
                 * needs a while to pick up 4 new rows, and the tiles' rows are short (6-35 KB) */
                const char *next = m0 == 0 && t + 1 < end ? (const char *)(w + NR * K) : 0;
#if FULLMR < ROWS
                if (mr > FULLMR) {
                    WFN(halves)[mr](job->x + m0 * K, w, saved + m0 * NR, k0, k1, K, next);
                    WFN(halves)[mr](job->x + m0 * K, w + 2 * K, saved + m0 * NR + 2, k0, k1, K,
                                    next ? next + 2 * K * (int64_t)sizeof(WT) : 0);
                } else
#endif
                WFN(tiles)[mr](job->x + m0 * K, w, saved + m0 * NR, k0, k1, K, next);
                m0 += mr;
            }
            if (k1 >= kfull) break;
        }
        for (int64_t m = 0; m < M; m++)
            for (int j = 0; j < NR; j++)
                job->y[m * N + t * NR + j] = WSCALE(VHSUM(saved[m * NR + j]), job->s[t * NR + j]) + (job->b ? job->b[t * NR + j] : 0.0f);
    }
    if (saved != local) free(saved);
}

#undef TILE
#undef WFN
#undef W
#undef WT
#undef WLOAD
#undef WLOADN
#undef WSCALE
