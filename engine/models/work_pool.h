// The threads of the native kernels: a job is a list of phases (a GEMM, the attention, a row's norm),
// each a set of items that any thread may compute, and no thread ever waits for one that lost its core.
//
// Why not OpenMP: with ~240 parallel regions a forward, a thread that the OS preempts for a
// scheduler slice (milliseconds: the browser of the playground, any other process) held the other
// at the end of every region it had a share of. Beside a process that kept half a core busy, the
// 2-thread engine lost 30 % and ran slower than one thread (AMD EPYC Zen 3, session 36). Here:
//   - items are claimed one at a time, so a running thread takes whatever the other has not started;
//   - an item that another thread claimed and has not finished after a grace period is computed
//     again by the waiting thread ("stolen"). Every item computes into its thread's own buffer and is
//     published by whoever commits first (a compare-and-swap on the item's state); the loser drops
//     its copy. Items are pure functions of the phase's inputs, so both copies are the same bits;
//   - the phase after the last commit starts at once, whichever thread commits it; a thread that
//     wakes up in a phase that has moved on finds its item's tag changed and drops its result.
// So all of a forward goes on at one thread's speed while the other is away, and at two threads'
// otherwise. A late thread may still be reading a phase's inputs after the job returned: the
// inputs a job hands to its items live in the pool's arena (`job_arena`) or are freed only after
// `kernel_quiesce` (weights, KV caches: cpu_kernels.py calls it before releasing them).
//
// cpu_kernels.c defines `Phase` (with `items`, `per`) and `phase_run`, `phase_commit`,
// `phase_result_floats` before including this file.
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define POOL_THREADS 64
#define POOL_PHASES 1024             // phases a job may have (a decoder layer takes 8)
#define ITEMS_PER_THREAD 2           // a phase's items: this many for each thread
#define POOL_ITEMS (ITEMS_PER_THREAD * POOL_THREADS)
#define PHASE_END 2047               // the phase field of a finished job's tag
#define COUNT_BITS 20                // claim and done words: tag << COUNT_BITS | count
#define IDLE_SPIN_NS 2000000         // a helper spins this long for the next job, then sleeps
#define STEAL_GRACE_NS 30000         // a thread waits at least this long before stealing an item
#define RETIRED_MAX 64               // replaced arenas kept until no late helper can read them

// A grow-only buffer of floats, 64-byte aligned.
typedef struct { float *p; int64_t cap; } Buffer;

static float *buffer_at_least(Buffer *b, int64_t floats) {
    if (floats > b->cap) {
        free(b->p);
        b->cap = (floats + floats / 2 + 15) / 16 * 16;
        b->p = aligned_alloc(64, b->cap * sizeof(float));
    }
    return b->p;
}

// A thread's own buffers: an item's result, attention scores, a widened weight panel.
typedef struct { Buffer result, scores, panel; } Own;

static int64_t phase_result_floats(const Phase *p);
static void phase_run(const Phase *p, int64_t item, float *result, Own *own);
static void phase_commit(const Phase *p, int64_t item, const float *result);

static struct {
    pthread_mutex_t lock;             // held by the one caller whose job the helpers work on
    int helpers;                      // helper threads started
    _Atomic int wanted;               // how many of them join the current job
    _Atomic uint32_t job;             // bumped when a job starts (the helpers' futex word)
    _Atomic int sleepers, inside;     // helpers asleep on `job`; helpers working on some job
    _Atomic uint64_t cur;             // the current phase's tag: job << 11 | phase
    _Atomic uint64_t claim, done;     // items claimed and committed in the current phase
    _Atomic uint64_t state[POOL_ITEMS];  // tag << 2 | 0 open, 2 committing, 3 done
    int64_t phases_used;
    Phase phases[POOL_PHASES];
    Buffer arena;                     // the job's activations; replaced ones wait in `retired`
    float *retired[RETIRED_MAX];
    int nretired;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .cur = PHASE_END};

static _Atomic int64_t steal_grace_ns = STEAL_GRACE_NS;
static _Atomic int64_t stolen, lost, joined;  // items stolen; stolen copies that lost the commit; helper joins

// Set the grace before stealing (tests set 0: every open item is stolen at once); returns the old one.
int64_t kernel_steal_grace(int64_t ns) { return atomic_exchange(&steal_grace_ns, ns); }

// Into out[3]: items stolen, stolen copies that lost the commit, jobs a helper joined (since loading).
void kernel_pool_counts(int64_t *out) {
    out[0] = atomic_load(&stolen), out[1] = atomic_load(&lost), out[2] = atomic_load(&joined);
}

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static inline uint64_t tag_of(uint64_t job, int64_t phase) { return (job & 0xffffffffu) << 11 | (uint64_t)phase; }

// Raise an item's state to `tag`'s open state unless it already carries that tag or a later one:
// several threads may start the same phase, and none may reopen an item another has committed.
static void open_item(int64_t i, uint64_t tag) {
    uint64_t v = atomic_load(&pool.state[i]);
    while ((v >> 2) < tag && !atomic_compare_exchange_weak(&pool.state[i], &v, tag << 2)) {}
}

// Move from the completed phase `tag` to the next (or to the job's end). Idempotent: whoever
// commits the last item does it, and a thread that finds the phase complete helps.
static void advance(uint64_t tag) {
    const int64_t phase = (int64_t)(tag & 2047), job_bits = (int64_t)(tag >> 11);
    const int last = phase + 1 >= pool.phases_used;
    const uint64_t next = tag_of((uint64_t)job_bits, last ? PHASE_END : phase + 1);
    const int64_t items = pool.phases[phase].items;
    if (!last)
        for (int64_t i = 0; i < pool.phases[phase + 1].items && i < POOL_ITEMS; i++) open_item(i, next);
    uint64_t full = tag << COUNT_BITS | (uint64_t)items;
    atomic_compare_exchange_strong(&pool.claim, &full, next << COUNT_BITS);
    full = tag << COUNT_BITS | (uint64_t)items;
    atomic_compare_exchange_strong(&pool.done, &full, next << COUNT_BITS);
    uint64_t expected = tag;
    atomic_compare_exchange_strong(&pool.cur, &expected, next);
}

static int64_t claim_item(uint64_t tag, int64_t items) {
    uint64_t c = atomic_load(&pool.claim);
    for (;;) {
        if (c >> COUNT_BITS != tag || (int64_t)(c & ((1u << COUNT_BITS) - 1)) >= items) return -1;
        if (atomic_compare_exchange_weak(&pool.claim, &c, c + 1)) return (int64_t)(c & ((1u << COUNT_BITS) - 1));
    }
}

// Publish item i's result unless another thread did; the last commit starts the next phase.
static void commit_item(uint64_t tag, const Phase *p, int64_t i, const float *result, int stole) {
    uint64_t open = tag << 2;
    if (!atomic_compare_exchange_strong(&pool.state[i], &open, tag << 2 | 2)) {
        if (stole) atomic_fetch_add(&lost, 1);
        return;
    }
    phase_commit(p, i, result);
    atomic_store(&pool.state[i], tag << 2 | 3);
    if (atomic_fetch_add(&pool.done, 1) + 1 == (tag << COUNT_BITS | (uint64_t)p->items)) advance(tag);
}

// Work on the pool's current job until it ends (or has moved on to a later job and ended).
static void work(Own *own) {
    uint64_t waiting_in = 0;   // the phase this thread found nothing to claim in, and since when
    int64_t waiting_since = 0, last_item_ns = 0;
    int64_t mark = now_ns();   // this thread's last clock reading: when its next item starts (one reading an item)
    for (;;) {
        const uint64_t tag = atomic_load(&pool.cur);
        const int64_t phase = (int64_t)(tag & 2047);
        if (phase == PHASE_END) return;
        Phase p;
        memcpy(&p, &pool.phases[phase], sizeof p);  // a snapshot, valid if the phase is still current
        if (atomic_load(&pool.cur) != tag) continue;
        float *result = buffer_at_least(&own->result, phase_result_floats(&p));
        int64_t i = claim_item(tag, p.items);
        const int stole = i < 0;
        if (i < 0) {
            if (atomic_load(&pool.done) == (tag << COUNT_BITS | (uint64_t)p.items)) {
                advance(tag);
                continue;
            }
            const int64_t t = mark = now_ns();
            if (waiting_in != tag) waiting_in = tag, waiting_since = t;
            if (t - waiting_since < atomic_load(&steal_grace_ns) + 2 * last_item_ns) {
                _mm_pause();
                continue;
            }
            for (i = 0; i < p.items && atomic_load(&pool.state[i]) != tag << 2; i++) {}
            if (i == p.items) {  // every item is being published: a moment
                _mm_pause();
                continue;
            }
            atomic_fetch_add(&stolen, 1);
        }
        phase_run(&p, i, result, own);
        const int64_t end = now_ns();
        last_item_ns = end - mark;
        mark = end;
        commit_item(tag, &p, i, result, stole);
    }
}

static void *helper_main(void *arg) {
    const int index = (int)(intptr_t)arg;
    Own own = {0};
    uint32_t seen = atomic_load(&pool.job);
    for (;;) {
        const int64_t idle_from = now_ns();
        uint32_t job;
        while ((job = atomic_load(&pool.job)) == seen) {
            if (now_ns() - idle_from < IDLE_SPIN_NS) {
                for (int s = 0; s < 64; s++) _mm_pause();
                continue;
            }
            atomic_fetch_add(&pool.sleepers, 1);
            if (atomic_load(&pool.job) == seen) syscall(SYS_futex, &pool.job, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_fetch_sub(&pool.sleepers, 1);
        }
        seen = job;
        if (index >= atomic_load(&pool.wanted)) continue;
        atomic_fetch_add(&pool.inside, 1);
        atomic_fetch_add(&joined, 1);
        work(&own);
        atomic_fetch_sub(&pool.inside, 1);
    }
    return NULL;
}

static void free_retired(void) {  // with the lock held and no helper inside a job
    for (int i = 0; i < pool.nretired; i++) free(pool.retired[i]);
    pool.nretired = 0;
}

static void pool_after_fork(void) {  // a forked child has the calling thread only
    pthread_mutex_init(&pool.lock, NULL);
    pool.helpers = 0;
    atomic_store(&pool.inside, 0);
    atomic_store(&pool.sleepers, 0);
}

// A job: its phases (`phases`, up to POOL_PHASES) and activations (`job_arena`), run by `job_run`.
// `parallel`: the pool's, worked on by its helpers; else the caller's alone (the pool is busy with
// another caller's job, or one thread is wanted), in thread-local buffers nobody else reads.
typedef struct {
    Phase *phases;
    int parallel, threads;
    Buffer *arena;
} Job;

typedef struct { Phase *phases; Buffer arena; Own own; } Local;
static pthread_key_t local_key;
static pthread_once_t local_once = PTHREAD_ONCE_INIT;
static void local_free(void *p) {
    Local *l = p;
    free(l->phases); free(l->arena.p); free(l->own.result.p); free(l->own.scores.p); free(l->own.panel.p);
    free(l);
}
static void local_init(void) {
    pthread_key_create(&local_key, local_free);
    pthread_atfork(NULL, NULL, pool_after_fork);
}
static Local *local(void) {
    pthread_once(&local_once, local_init);
    Local *l = pthread_getspecific(local_key);
    if (l == NULL) {
        l = calloc(1, sizeof *l);
        l->phases = malloc(POOL_PHASES * sizeof(Phase));
        pthread_setspecific(local_key, l);
    }
    return l;
}

static Job job_begin(void) {
    Local *l = local();
    const int threads = omp_get_max_threads() < POOL_THREADS ? omp_get_max_threads() : POOL_THREADS;
    if (threads > 1 && pthread_mutex_trylock(&pool.lock) == 0) {
        while (pool.helpers < threads - 1 && pool.helpers < POOL_THREADS) {
            pthread_t t;
            pthread_attr_t attr;
            pthread_attr_init(&attr);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            if (pthread_create(&t, &attr, helper_main, (void *)(intptr_t)pool.helpers) != 0) break;
            pool.helpers++;
        }
        atomic_store(&pool.wanted, threads - 1);
        if (pool.nretired && atomic_load(&pool.inside) == 0) free_retired();
        return (Job){pool.phases, 1, threads, &pool.arena};
    }
    return (Job){l->phases, 0, 1, &l->arena};
}

// At least `floats` floats of the job's arena (its contents are not kept across calls).
static float *job_arena(Job *j, int64_t floats) {
    if (j->parallel && floats > j->arena->cap && j->arena->p != NULL) {
        if (pool.nretired == RETIRED_MAX)  // rare: wait for the late helpers to leave
            while (atomic_load(&pool.inside) > 0) _mm_pause();
        if (atomic_load(&pool.inside) == 0) {
            free_retired();
            free(j->arena->p);
        } else {
            pool.retired[pool.nretired++] = j->arena->p;  // a late helper may still read it
        }
        j->arena->p = NULL;
        j->arena->cap = 0;
    }
    return buffer_at_least(j->arena, floats);
}

// Run the job's phases 0..n-1 in order, every item of a phase before any of the next.
static void job_run(Job *j, int64_t n) {
    if (n == 0) return;
    Own *own = &local()->own;
    if (!j->parallel) {
        for (int64_t ph = 0; ph < n; ph++) {
            const Phase *p = &j->phases[ph];
            float *result = buffer_at_least(&own->result, phase_result_floats(p));
            for (int64_t i = 0; i < p->items; i++) {
                phase_run(p, i, result, own);
                phase_commit(p, i, result);
            }
        }
        return;
    }
    const uint32_t job = atomic_load(&pool.job) + 1;
    const uint64_t first = tag_of(job, 0);
    pool.phases_used = n;
    for (int64_t i = 0; i < pool.phases[0].items; i++) open_item(i, first);
    atomic_store(&pool.claim, first << COUNT_BITS);
    atomic_store(&pool.done, first << COUNT_BITS);
    atomic_store(&pool.cur, first);
    atomic_store(&pool.job, job);
    if (atomic_load(&pool.sleepers) > 0) syscall(SYS_futex, &pool.job, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
    work(own);
}

// drain: wait until no helper is left inside the job (its inputs may be freed on return).
static void job_end(Job *j, int drain) {
    if (!j->parallel) return;
    if (drain)
        while (atomic_load(&pool.inside) > 0) sched_yield();
    pthread_mutex_unlock(&pool.lock);
}

// Wait until no helper can still be reading a finished job's inputs: for cpu_kernels.py, before it
// frees weights or KV caches a job may have read.
void kernel_quiesce(void) {
    pthread_mutex_lock(&pool.lock);
    while (atomic_load(&pool.inside) > 0) sched_yield();
    free_retired();
    pthread_mutex_unlock(&pool.lock);
}
