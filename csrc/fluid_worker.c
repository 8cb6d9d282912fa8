/* netweave: a thread that runs nw_fm_update (csrc/fluid_model.c) while the caller goes on.
 *
 * The placement replay asks the fluid model for new iteration times at every event and, independently, updates
 * its overloaded-link metric (Python). nw_fw_update_start hands the update to this thread and returns at once;
 * the caller runs its own work and collects the update's return code with nw_fw_update_wait. The thread is C
 * only: it never takes Python's GIL, so the hand-over costs a mutex and a condition variable, not a thread
 * switch of the interpreter. One call at a time per worker; the model and every array passed must stay
 * untouched until the wait returns.
 *
 * In a child forked from the process that made the worker the thread does not exist: there the update runs
 * inline in nw_fw_update_start, and the wait returns its code.
 *
 * Errors: NW_FLUID_EINVAL (a null worker, a start while a call is pending, a wait with none), NW_FLUID_ENOMEM
 * (nw_fw_new returns NULL when it cannot make the thread); otherwise nw_fm_update's own code.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "fluid.h"

enum { IDLE, QUEUED, DONE };

typedef struct {
    nw_fm *h;
    int n_gone, n_new;
    const int64_t *gone, *ident, *link_ptr, *link_id;
    const double *compute, *comm, *start, *dem;
    int64_t out_size, *out_serial, *out_n, *counters;
    double *out_time;
} call_t;

struct nw_fw {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t todo, done;
    atomic_int state; /* IDLE -> QUEUED (start) -> DONE (the thread) -> IDLE (wait) */
    int stop, rc, pending;
    pid_t pid; /* the process the thread runs in */
    call_t call;
};

static int run(const call_t *c) {
    return nw_fm_update(c->h, c->n_gone, c->gone, c->n_new, c->ident, c->compute, c->comm, c->start, c->link_ptr, c->link_id,
                        c->dem, c->out_size, c->out_serial, c->out_time, c->out_n, c->counters);
}

static void *serve(void *arg) {
    nw_fw *w = arg;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->stop && atomic_load_explicit(&w->state, memory_order_relaxed) != QUEUED) pthread_cond_wait(&w->todo, &w->mu);
        if (w->stop) break;
        call_t c = w->call;
        pthread_mutex_unlock(&w->mu);
        int rc = run(&c);
        pthread_mutex_lock(&w->mu);
        w->rc = rc;
        atomic_store_explicit(&w->state, DONE, memory_order_release);
        pthread_cond_signal(&w->done);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

NW_FLUID_API nw_fw *nw_fw_new(void) {
    nw_fw *w = calloc(1, sizeof(*w));
    if (!w) return NULL;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->todo, NULL);
    pthread_cond_init(&w->done, NULL);
    atomic_init(&w->state, IDLE);
    w->pid = getpid();
    if (pthread_create(&w->thread, NULL, serve, w)) {
        pthread_cond_destroy(&w->todo), pthread_cond_destroy(&w->done), pthread_mutex_destroy(&w->mu);
        free(w);
        return NULL;
    }
    return w;
}

/* Stops the thread (after the call it runs, if any) and frees the worker. In a forked child it only frees memory. */
NW_FLUID_API void nw_fw_free(nw_fw *w) {
    if (!w) return;
    if (w->pid == getpid()) {
        pthread_mutex_lock(&w->mu);
        w->stop = 1;
        pthread_cond_signal(&w->todo);
        pthread_mutex_unlock(&w->mu);
        pthread_join(w->thread, NULL);
        pthread_cond_destroy(&w->todo), pthread_cond_destroy(&w->done), pthread_mutex_destroy(&w->mu);
    }
    free(w);
}

/* nw_fm_update's arguments; returns NW_FLUID_OK once the call is handed over (its code comes from nw_fw_update_wait). */
NW_FLUID_API int nw_fw_update_start(nw_fw *w, nw_fm *h, int n_gone, const int64_t *gone, int n_new, const int64_t *ident,
                                    const double *compute, const double *comm, const double *start, const int64_t *link_ptr,
                                    const int64_t *link_id, const double *dem, int64_t out_size, int64_t *out_serial, double *out_time,
                                    int64_t *out_n, int64_t *counters) {
    if (!w || w->pending) return NW_FLUID_EINVAL;
    call_t c = {h, n_gone, n_new, gone, ident, link_ptr, link_id, compute, comm, start, dem, out_size, out_serial, out_n, counters,
                out_time};
    w->pending = 1;
    if (w->pid != getpid()) { /* a forked child: no thread here */
        w->rc = run(&c);
        atomic_store_explicit(&w->state, DONE, memory_order_relaxed);
        return NW_FLUID_OK;
    }
    pthread_mutex_lock(&w->mu);
    w->call = c;
    atomic_store_explicit(&w->state, QUEUED, memory_order_relaxed);
    pthread_cond_signal(&w->todo);
    pthread_mutex_unlock(&w->mu);
    return NW_FLUID_OK;
}

/* Waits for the call handed over by nw_fw_update_start and returns nw_fm_update's code. A short update is usually done
 * within microseconds of the caller's own work: the state is polled for a while before sleeping on the condition. */
NW_FLUID_API int nw_fw_update_wait(nw_fw *w) {
    if (!w || !w->pending) return NW_FLUID_EINVAL;
    w->pending = 0;
    if (w->pid != getpid()) { /* a forked child: done inline, or handed to a thread that is not here (forked mid-call) */
        int done = atomic_load_explicit(&w->state, memory_order_relaxed) == DONE;
        atomic_store_explicit(&w->state, IDLE, memory_order_relaxed);
        return done ? w->rc : NW_FLUID_EINVAL;
    }
    for (int spin = 0; spin < 2000 && atomic_load_explicit(&w->state, memory_order_acquire) != DONE; spin++) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
    pthread_mutex_lock(&w->mu);
    while (atomic_load_explicit(&w->state, memory_order_relaxed) != DONE) pthread_cond_wait(&w->done, &w->mu);
    int rc = w->rc;
    atomic_store_explicit(&w->state, IDLE, memory_order_relaxed);
    pthread_mutex_unlock(&w->mu);
    return rc;
}
