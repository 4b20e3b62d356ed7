/* The q8 kernels' k-quant tiles timed alone, on weights that stay in cache or stream from memory: how close a
 * tile of R rows comes to the VNNI unit's rate (one 512-bit vpdpbusd a cycle per core on the AMD and Intel CPUs
 * of these runs), with nothing else of a pass around it. The AVX-512 build; random codes, sane scales.
 *
 *   gcc -O3 -pthread -ffp-contract=off -DVS_Q8_512 -mavx512f -mavx512bw -mavx512vnni -mf16c \
 *       -I src/verispec/csrc -o /tmp/q8_tile bench/q8_tile.c -lm
 *   /tmp/q8_tile N K M REPS KIND THREADS   (KIND 12 = Q4_K, 14 = Q6_K; e.g. 512 1536 8 300 12 1: 444 KB of Q4_K,
 *                                           in L2; 71680 1536 8 3 12 2: 62 MB, from memory, on two threads)
 *
 * It prints the time per call and per vpdpbusd (each tile issues M * N * K / 64 of them). THREADS > 1 split the
 * column groups in equal contiguous parts, one a thread, with no pool: the bound the pool's chunks compare with. */
#include "../src/verispec/csrc/kquant_q8.c"
#include <pthread.h>
#include <stdio.h>
#include <time.h>

int q8_amx = 0;
int q8_amx_range(const q8_job *job, int64_t begin, int64_t end) { (void)job; (void)begin; (void)end; return -1; }
void KQ(q32_range)(const void *arg, int64_t begin, int64_t end) { (void)arg; (void)begin; (void)end; }

typedef struct { const q8_job *job; int64_t begin, end; int reps; pthread_barrier_t *start; } part_job;

static void *run_part(void *arg)
{
    const part_job *part = arg;
    pthread_barrier_wait(part->start);
    for (int r = 0; r < part->reps; r++) KQ(q8_range)(part->job, part->begin, part->end);
    return NULL;
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    const int64_t N = argc > 1 ? atol(argv[1]) : 512, K = argc > 2 ? atol(argv[2]) : 1536;
    const int M = argc > 3 ? atoi(argv[3]) : 8, reps = argc > 4 ? atoi(argv[4]) : 300;
    const int kind = argc > 5 ? atoi(argv[5]) : GGML_Q4_K, threads = argc > 6 ? atoi(argv[6]) : 1;
    const int64_t blocks = K / QK_K, groups = N / Q8G, rows = q8_rows(M), bytes = q8_group_bytes(kind);
    uint8_t *w = aligned_alloc(64, (size_t)(groups * blocks * bytes));
    for (int64_t i = 0; i < groups * blocks * bytes; i++) w[i] = (uint8_t)(i * 2654435761u >> 13);
    for (int64_t g = 0; g < groups * blocks; g++) {  /* the half-precision scales: 1/16 */
        uint16_t *h = (uint16_t *)(w + g * bytes);
        for (int i = 0; i < (kind == GGML_Q6_K ? 16 : 32); i++) h[i] = 0x2c00;
    }
    int8_t *qx = aligned_alloc(64, (size_t)(rows * K));
    for (int64_t i = 0; i < rows * K; i++) qx[i] = (int8_t)(i * 7919 % 255 - 127);
    float *qd = calloc((size_t)(rows * blocks), sizeof(float)), *y = calloc((size_t)(M * N), sizeof(float));
    for (int64_t i = 0; i < rows * blocks; i++) qd[i] = 0.01f;
    int16_t *qb = calloc((size_t)(rows * blocks * 16), 2), *qb32 = calloc((size_t)(rows * blocks * 8), 2);
    q8_job job = {.qx = qx, .qd = qd, .qb = qb, .qb32 = qb32, .w = w, .kind = kind, .y = y, .M = M, .N = N, .K = K};
    KQ(q8_range)(&job, 0, groups);
    double best = 1e9;
    for (int t = 0; t < 30; t++) {  /* the best of 30: the machine is shared */
        pthread_t ids[64];
        part_job parts[64];
        pthread_barrier_t start;
        const int n = threads < 1 ? 1 : threads > 64 ? 64 : threads;
        pthread_barrier_init(&start, NULL, (unsigned)n);
        for (int i = 0; i < n; i++) parts[i] = (part_job){&job, groups * i / n, groups * (i + 1) / n, reps, &start};
        for (int i = 1; i < n; i++) pthread_create(&ids[i], NULL, run_part, &parts[i]);
        pthread_barrier_wait(&start);  /* this thread takes part 0: n threads on n cores, none waiting for a core */
        const double t0 = now();
        for (int r = 0; r < reps; r++) KQ(q8_range)(&job, parts[0].begin, parts[0].end);
        for (int i = 1; i < n; i++) pthread_join(ids[i], NULL);
        const double dt = (now() - t0) / reps;
        pthread_barrier_destroy(&start);
        if (dt < best) best = dt;
    }
    const double dots = (double)groups * blocks * 64 * M;
    printf("N=%ld K=%ld M=%d kind %d, %d threads: %.3f ms a call, %.3f ns a vpdpbusd, %.0f KB of weights at %.1f GB/s\n", (long)N,
           (long)K, M, kind, threads, best * 1e3, best / dots * 1e9, groups * blocks * bytes / 1024.0, groups * blocks * bytes / best / 1e9);
    return y[0] != y[0];  /* keeps the products */
}
