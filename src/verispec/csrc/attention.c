/* (a vector source: compiled once per ISA, see simd.h) */
#include "common.h"
#include "simd.h"
#include "vexp.h"

/* ======== attention of T new queries per row over the visible cache slots ========
 * One (batch row, kv head): q [T, H, D] (query heads kvh*G .. kvh*G+G-1 share this kv head);
 * keys kc [cap/16, D, 16] (blocks of 16 slots, d-major inside a block, so 16 slots are scored by
 * a stream of contiguous loads), values vc [cap, D], vis [S] (S = start + T; the new tokens sit at
 * slots start .. S-1). Query t sees slot s iff s <= start + t and vis[s]; with a token tree
 * (tree [T, T], tree[t][j] = 1 when new token j is t itself or one of its ancestors), a new slot
 * start + j only when also tree[t][j]: each token then sees its own path, as if decoded alone.
 * Exactness: each score is one chain of multiply-adds over d, whatever lane it sits in. A query's
 * keys are the visible slots in slot order, compacted; its softmax sum runs over that compacted
 * list in lanes j mod L, and its output sums p_j v_j in j order. Holes, padding, batch mates and
 * later tokens of the same pass therefore change nothing in its result. A query that sees no slot
 * (padding) gets zeros, never NaN. */
static void attend(
    const float *q, const float *kc, const float *vc, const uint8_t *vis, const uint8_t *tree, float *out,
    int64_t T, int64_t H, int64_t G, int64_t D, int64_t kvh, int64_t start, float scale,
    float *scores, int64_t *idx, int64_t *seen)
{
    enum { QT = QTILE, VB = SLOT_BLOCK / LANES, DV = DVECS };
    const int64_t S = start + T, Q = T * G;
    /* idx[t * S ..]: the slots token t sees, in slot order; seen[t]: how many */
    int64_t before = 0;
    for (int64_t s = 0; s < start; s++) if (vis[s]) idx[before++] = s;
    for (int64_t t = 0; t < T; t++) {
        int64_t *list = idx + t * S, n = before;
        if (t) for (int64_t j = 0; j < before; j++) list[j] = idx[j];
        for (int64_t j = 0; j <= t; j++)
            if (vis[start + j] && (!tree || tree[t * T + j])) list[n++] = start + j;
        seen[t] = n;
    }

    /* 1. scores[i, s] = (q_i . k_s) * scale for every slot: QT queries x one 16-slot block per tile */
    for (int64_t i0 = 0; i0 < Q; i0 += QT) {
        const int64_t count = Q - i0 < QT ? Q - i0 : QT;
        const float *qp[QT];
        for (int64_t j = 0; j < QT; j++) {
            const int64_t i = i0 + (j < count ? j : 0);  /* spare tile rows recompute query i0, unused */
            qp[j] = q + ((i / G) * H + kvh * G + i % G) * D;
        }
        for (int64_t s0 = 0; s0 < S; s0 += SLOT_BLOCK) {
            const float *block = kc + (s0 / SLOT_BLOCK) * D * SLOT_BLOCK;
            VEC acc[QT][VB];
            for (int j = 0; j < QT; j++) for (int v = 0; v < VB; v++) acc[j][v] = VZERO();
            for (int64_t d = 0; d < D; d++) {
                _Pragma("GCC unroll 2") for (int v = 0; v < VB; v++) {
                    const VEC k = VLOAD(block + d * SLOT_BLOCK + v * LANES);
                    _Pragma("GCC unroll 8") for (int j = 0; j < QT; j++) acc[j][v] = VFMA(VSET1(qp[j][d]), k, acc[j][v]);
                }
            }
            for (int64_t j = 0; j < count; j++)
                for (int v = 0; v < VB; v++) {
                    const int64_t s = s0 + v * LANES, left = S - s < LANES ? S - s : LANES;
                    if (left > 0) VSTOREN(scores + (i0 + j) * S + s, VMUL(acc[j][v], VSET1(scale)), left);
                }
        }
    }
    /* 2. per query: compact its visible causal scores in place (row[j] <- row[idx[j]], j <= idx[j]),
     *    softmax them, keep the probabilities p_j in row[0 .. n) */
    for (int64_t i = 0; i < Q; i++) {
        const int64_t *list = idx + (i / G) * S, n = seen[i / G];
        float *row = scores + i * S;
        float top = -INFINITY;
        int64_t j = 0;
        if (n && list[n - 1] == n - 1) {  /* no holes: the list is 0 .. n-1, nothing to compact; the max by vectors */
            VEC peak = VSET1(-INFINITY);
            for (; j + LANES <= n; j += LANES) peak = VMAX(VLOAD(row + j), peak);  /* NaN lanes keep peak, as below */
            float lanes[LANES];
            VSTORE(lanes, peak);
            for (int l = 0; l < LANES; l++) if (lanes[l] > top) top = lanes[l];
            for (; j < n; j++) if (row[j] > top) top = row[j];
        }
        for (; j < n; j++) {
            row[j] = row[list[j]];
            if (row[j] > top) top = row[j];
        }
        VEC sum = VZERO();
        for (j = 0; j < n; j += LANES) {
            const int64_t left = n - j < LANES ? n - j : LANES;
            const VEC e = VKEEPN(vexp(VSUB(VLOADN(row + j, left), VSET1(top))), left);
            VSTOREN(row + j, e, left);
            sum = VADD(sum, e);
        }
        const float inv = n ? 1.0f / VHSUM(sum) : 0.0f;
        for (j = 0; j + LANES <= n; j += LANES) VSTORE(row + j, VMUL(VLOAD(row + j), VSET1(inv)));
        for (; j < n; j++) row[j] = row[j] * inv;
    }
    /* 3. out_i = sum_j p_j v_idx[j] in j order; tiles of up to 4 query heads of one token (they
     *    share the slot list) x DV vectors of d, so each value vector loaded serves 4 queries */
    for (int64_t t = 0; t < T; t++) {
        const int64_t *list = idx + t * S, n = seen[t];
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
            const int64_t count = G - g0 < 4 ? G - g0 : 4;
            const float *p[4];
            for (int64_t j = 0; j < 4; j++) p[j] = scores + (t * G + g0 + (j < count ? j : 0)) * S;
            for (int64_t d0 = 0; d0 < D; d0 += DV * LANES) {
                const int64_t chunks = (D - d0) / LANES < DV ? (D - d0) / LANES : DV;
                VEC acc[4][DV];
                for (int j = 0; j < 4; j++) for (int c = 0; c < DV; c++) acc[j][c] = VZERO();
                for (int64_t j = 0; j < n; j++) {
                    const float *v = vc + list[j] * D + d0;
                    if (chunks == DV) {
                        _Pragma("GCC unroll 4") for (int c = 0; c < DV; c++) {
                            const VEC vv = VLOAD(v + c * LANES);
                            _Pragma("GCC unroll 4") for (int g = 0; g < 4; g++) acc[g][c] = VFMA(VSET1(p[g][j]), vv, acc[g][c]);
                        }
                    } else {
                        for (int64_t c = 0; c < chunks; c++) {
                            const VEC vv = VLOAD(v + c * LANES);
                            for (int g = 0; g < 4; g++) acc[g][c] = VFMA(VSET1(p[g][j]), vv, acc[g][c]);
                        }
                    }
                }
                for (int64_t g = 0; g < count; g++) {
                    float *o = out + (t * H + kvh * G + g0 + g) * D + d0;
                    for (int64_t c = 0; c < chunks; c++) VSTORE(o + c * LANES, acc[g][c]);
                }
            }
        }
    }
}

/* (batch row, kv head) pairs [begin, end) of an attention_job. */
void VS_FN(attention_range)(const void *arg, int64_t begin, int64_t end)
{
    attention_job *job = (attention_job *)arg;
    const int64_t T = job->T, H = job->H, KVH = job->KVH, D = job->D, G = H / KVH, S = job->start + T;
    int64_t *idx = malloc(sizeof(int64_t) * (size_t)(T * S + T) + sizeof(float) * (size_t)(T * G * S));
    if (!idx) { job->failed = 1; return; }
    int64_t *seen = idx + T * S;
    float *scores = (float *)(seen + T);
    for (int64_t pair = begin; pair < end; pair++) {
        const int64_t b = pair / KVH, kvh = pair % KVH;
        attend(job->q + b * T * H * D, job->kc + pair * D * job->cap, job->vc + pair * job->cap * D,
               job->vis + b * job->vis_stride, job->tree ? job->tree + b * T * T : NULL,
               job->out + b * T * H * D, T, H, G, D, kvh, job->start, job->scale, scores, idx, seen);
    }
    free(idx);
}
