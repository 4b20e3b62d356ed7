/* ======== a small thread pool that never waits for a thread that has not started ========
 * OpenMP's fork/join makes every parallel region wait at a barrier for all its threads. On a
 * machine shared with other busy processes (2 cores here), a descheduled OpenMP thread costs the
 * region a scheduler time slice, and a forward pass has ~250 regions: measured 8x slower than one
 * thread. Here the caller claims chunks of the range like any worker, and waits only for chunks a
 * worker has actually claimed; a worker that wakes late finds nothing left. Workers spin briefly
 * between jobs (a pass issues them back to back), then sleep.
 *
 * The range is cut in one contiguous part per thread, each a run of chunks its owner claims in order; a
 * thread done with its own part claims what is left of the others'. So each thread reads its weights as one
 * long stream, where chunks handed out first come first served had the threads hop between neighbouring
 * chunks, each hop a new stream for the hardware prefetcher to find (bench/README, "parts of the thread
 * pool"); and a thread that is late still holds up only the chunks it claimed. */
#include <pthread.h>
#include <sched.h>

#include "common.h"

/* A part's cursor, one atomic word: job tag << 40 | the part's end << 20 | its next chunk. A late worker cannot
 * claim a newer job's chunks (the tag), nor take a newer job's end for its own job's (both in the word it claims). */
#define TAG_SHIFT 40
#define END_SHIFT 20
#define MAX_CHUNKS ((1 << END_SHIFT) - 1)
#define MAX_PARTS 64
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static int pool_workers = 0;
static _Atomic uint64_t pool_generation = 0;
/* each part's cursor on a cache line of its own: its owner claims from it without the others' traffic */
static struct { _Alignas(64) _Atomic uint64_t cursor; } pool_part[MAX_PARTS];
static _Atomic int64_t pool_done = 0;
static range_fn pool_fn;
static const void *pool_job;
static int64_t pool_total, pool_grain;
static int pool_helpers, pool_parts;
static _Atomic int pool_busy = 0;  /* ctypes drops the GIL: a second caller thread runs its job alone */

/* Claim and run chunks (of `grain` indices; chunk c is [c * grain, (c + 1) * grain) within total) of part
 * `part` while it has any, as of job `tag`; 0 once a newer job has replaced it. */
static int run_part(uint64_t tag, int part, range_fn fn, const void *job, int64_t total, int64_t grain)
{
    for (;;) {
        uint64_t current = atomic_load(&pool_part[part].cursor);
        if ((current >> TAG_SHIFT) != tag) return 0;
        const int64_t chunk = (int64_t)(current & MAX_CHUNKS), last = (int64_t)(current >> END_SHIFT & MAX_CHUNKS);
        if (chunk >= last) return 1;
        if (!atomic_compare_exchange_weak(&pool_part[part].cursor, &current, current + 1)) continue;
        const int64_t begin = chunk * grain, end = begin + grain < total ? begin + grain : total;
        fn(job, begin, end);
        atomic_fetch_add(&pool_done, end - begin);
    }
}

/* Thread `self`'s part, then the others' in turn from the next one on. */
static void run_ranges(uint64_t generation, int self, int parts, range_fn fn, const void *job, int64_t total, int64_t grain)
{
    const uint64_t tag = generation & 0xFFFFFF;
    for (int i = 0; i < parts; i++)
        if (!run_part(tag, (self + i) % parts, fn, job, total, grain)) return;
}

static void *pool_worker(void *arg)
{
    const int index = (int)(intptr_t)arg;
    uint64_t seen = 0;
    for (;;) {
        for (int spin = 0; spin < 4000 && atomic_load(&pool_generation) == seen; spin++) _mm_pause();
        pthread_mutex_lock(&pool_lock);
        while (atomic_load(&pool_generation) == seen) pthread_cond_wait(&pool_wake, &pool_lock);
        seen = atomic_load(&pool_generation);
        const range_fn fn = pool_fn;
        const void *job = pool_job;
        const int64_t total = pool_total, grain = pool_grain;
        const int helping = index < pool_helpers, parts = pool_parts;
        pthread_mutex_unlock(&pool_lock);
        if (helping) run_ranges(seen, (index + 1) % parts, parts, fn, job, total, grain);
    }
    return 0;
}

void parallel_for(range_fn fn, const void *job, int64_t total, int64_t grain, int threads)
{
    if (threads > MAX_PARTS) threads = MAX_PARTS;
    if (threads <= 1 || total <= grain || atomic_exchange(&pool_busy, 1)) { fn(job, 0, total); return; }
    pthread_mutex_lock(&pool_lock);
    while (pool_workers < threads - 1) {
        pthread_t thread;
        if (pthread_create(&thread, 0, pool_worker, (void *)(intptr_t)pool_workers)) break;
        pthread_detach(thread);
        pool_workers++;
    }
    const uint64_t generation = atomic_load(&pool_generation) + 1, tag = generation & 0xFFFFFF;
    const int helpers = threads - 1 < pool_workers ? threads - 1 : pool_workers;
    if ((total + grain - 1) / grain > MAX_CHUNKS) grain = (total + MAX_CHUNKS - 1) / MAX_CHUNKS;
    const int64_t chunks = (total + grain - 1) / grain;
    const int parts = 1 + helpers < chunks ? 1 + helpers : (int)chunks;
    pool_fn = fn; pool_job = job; pool_total = total; pool_grain = grain; pool_helpers = helpers; pool_parts = parts;
    atomic_store(&pool_done, 0);
    for (int part = 0; part < parts; part++)  /* part p: chunks [p * chunks / parts, (p + 1) * chunks / parts) */
        atomic_store(&pool_part[part].cursor, tag << TAG_SHIFT | (uint64_t)((part + 1) * chunks / parts) << END_SHIFT
                                                  | (uint64_t)(part * chunks / parts));
    atomic_store(&pool_generation, generation);
    pthread_cond_broadcast(&pool_wake);
    pthread_mutex_unlock(&pool_lock);
    run_ranges(generation, 0, parts, fn, job, total, grain);
    for (int spin = 0; atomic_load(&pool_done) < total; spin++) {
        if (spin < 20000) _mm_pause(); else sched_yield();  /* a claimed chunk's worker may be descheduled */
    }
    atomic_store(&pool_busy, 0);
}

/* Several products of one x (a layer's q, k and v, or gate and up) as one job over all their weight
 * tiles: one wake of the pool, one rounding of x. */
typedef struct { range_fn fn; const void *jobs[MAX_GROUP]; int64_t first[MAX_GROUP + 1]; int count; } group_job;

#define MIN_CHUNK_WORK (1 << 18)  /* least multiply-adds a chunk of a grouped product carries (see run_group) */

static void group_range(const void *arg, int64_t begin, int64_t end)
{
    const group_job *group = arg;
    for (int i = 0; i < group->count; i++) {
        const int64_t lo = begin > group->first[i] ? begin : group->first[i];
        const int64_t hi = end < group->first[i + 1] ? end : group->first[i + 1];
        if (lo < hi) group->fn(group->jobs[i], lo - group->first[i], hi - group->first[i]);
    }
}

void run_group(range_fn fn, const void *const *jobs, const int64_t *tiles, int count, int64_t work, int threads)
{
    group_job group = {fn, {0}, {0}, count};
    for (int i = 0; i < count; i++) {
        group.jobs[i] = jobs[i];
        group.first[i + 1] = group.first[i] + tiles[i];
    }
    const int64_t total = group.first[count];
    /* ~64 chunks per call balance threads; below ~64k multiply-adds one thread is quicker than waking another.
     * A chunk is claimed and counted done through atomics the threads pass between their cores, so it
     * carries at least MIN_CHUNK_WORK multiply-adds: at one 16-column group a chunk, a one-row pass of a
     * 0.5B draft's 896-wide matrices (8 KB of Q4_0 a chunk, under a microsecond of streaming) spent about
     * a tenth of its time passing those atomics (bench/README, "chunks of the thread pool"). */
    const int64_t chunks = (total + 63) / 64, least = work > 0 ? (MIN_CHUNK_WORK * total + work - 1) / work : total;
    const int64_t grain = work < 65536 ? total : chunks > least ? chunks : least;
    if (total) parallel_for(group_range, &group, total, grain > 0 ? grain : 1, threads);
}
