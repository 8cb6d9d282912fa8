/* netweave: the event loop of emu.fluid.simulate_periodic, in C.
 *
 * Same model, same event order, same filling tolerances as the Python loop
 * (emu/fluid.py), which stays the reference: periodic jobs alternate compute
 * and a communication phase; while communicating, the jobs coupled through
 * overloaded links progress at their max-min fair rates (progressive filling
 * with per-entry demands as coefficients). Python prepares the inputs (the
 * binding links, deduplicated, as CSR tables) and turns the iteration ends
 * into answers. The Python loop memoises rates because a solve costs it
 * ~0.3 ms; here a solve costs microseconds, so every one is recomputed.
 *
 * nw_fluid_simulate_means() runs the same loop and returns each job's mean
 * iteration time (emu.fluid._mean_after_first, with numpy's pairwise sum):
 * what the incremental model needs, without a retry when a fast job outruns
 * the ends buffer (it grows) and without handing every iteration end back.
 *
 * Versioned like NCCL's plugin tables: nw_fluid_version() names the ABI of
 * nw_fluid_simulate(), nw_fluid_simulate_means() and the incremental model's
 * nw_fm_* (csrc/fluid_model.c, same library); emu.fluid refuses a library of
 * another version.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fluid.h"

typedef struct {
    double t;
    int64_t seq;
    int64_t ver;
    int job;
} event_t;

typedef struct {
    /* inputs */
    int n, nlinks, iterations;
    const double *compute, *comm, *own, *cap;
    const int *jl_ptr, *jl_link, *lu_ptr, *lu_job;
    const double *jl_dem;
    /* job state */
    int *state, *in_comm, *count, *comp_mark, *done_mark;
    double *x, *rem, *last;
    int64_t *ver;
    /* link state and solver scratch */
    double *comm_load, *residual, *load;
    int *load_mark, *sat_mark;
    /* work lists */
    int *comp, *stack, *seeds, *active, *still, *touched;
    double *rates, *own_local;
    int *act_ptr, *act_link;
    double *act_dem;
    int comp_gen, done_gen, load_gen, sat_gen;
    /* iteration ends: ends[i * ends_cap + c]; grown (and owned) when grow is set, else ends past ends_cap are only counted */
    double *ends;
    int ends_cap, grow;
    /* event heap */
    event_t *heap;
    size_t heap_len, heap_cap;
    int64_t seq;
    int64_t solves;
} sim_t;

static int heap_push(sim_t *s, double t, int job) {
    if (s->heap_len == s->heap_cap) {
        size_t cap = s->heap_cap ? 2 * s->heap_cap : 64;
        event_t *h = realloc(s->heap, cap * sizeof(*h));
        if (!h) return NW_FLUID_ENOMEM;
        s->heap = h;
        s->heap_cap = cap;
    }
    event_t e = {t, s->seq++, s->ver[job], job};
    size_t i = s->heap_len++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        event_t *q = &s->heap[p];
        if (q->t < e.t || (q->t == e.t && q->seq < e.seq)) break;
        s->heap[i] = *q;
        i = p;
    }
    s->heap[i] = e;
    return NW_FLUID_OK;
}

static event_t heap_pop(sim_t *s) {
    event_t top = s->heap[0];
    event_t e = s->heap[--s->heap_len];
    size_t i = 0, n = s->heap_len;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && (s->heap[c + 1].t < s->heap[c].t || (s->heap[c + 1].t == s->heap[c].t && s->heap[c + 1].seq < s->heap[c].seq))) c++;
        if (e.t < s->heap[c].t || (e.t == s->heap[c].t && e.seq < s->heap[c].seq)) break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    if (n) s->heap[i] = e;
    return top;
}

/* Record the end of job i's iteration at t. */
static int record_end(sim_t *s, int i, double t) {
    if (s->count[i] >= s->ends_cap && s->grow) {
        int cap = s->ends_cap > 0 ? 2 * s->ends_cap : 2 * s->iterations + 2;
        double *e = malloc((size_t)s->n * (size_t)cap * sizeof(double));
        if (!e) return NW_FLUID_ENOMEM;
        for (int q = 0; q < s->n; q++) {
            int c = s->count[q] < s->ends_cap ? s->count[q] : s->ends_cap;
            if (c) memcpy(e + (size_t)q * (size_t)cap, s->ends + (size_t)q * (size_t)s->ends_cap, (size_t)c * sizeof(double));
        }
        free(s->ends);
        s->ends = e;
        s->ends_cap = cap;
    }
    if (s->count[i] < s->ends_cap) s->ends[(size_t)i * (size_t)s->ends_cap + (size_t)s->count[i]] = t;
    s->count[i]++;
    return NW_FLUID_OK;
}

/* numpy's sum of a[0..n) (pairwise: below 8 terms one by one, up to 128 in eight interleaved partial sums, else halves):
 * the floats of np.add.reduce over a contiguous float64 array; below 8 terms also those of Python's sum() */
double nw_fluid_pairwise_sum(const double *a, int n) {
    if (n < 8) {
        double r = 0.0;
        for (int i = 0; i < n; i++) r += a[i];
        return r;
    }
    if (n <= 128) {
        double r[8];
        int i;
        for (int j = 0; j < 8; j++) r[j] = a[j];
        for (i = 8; i < n - n % 8; i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[i + j];
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i];
        return res;
    }
    int n2 = n / 2;
    n2 -= n2 % 8;
    return nw_fluid_pairwise_sum(a, n2) + nw_fluid_pairwise_sum(a + n2, n - n2);
}

static int cmp_int(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

/* Sort a[0..m) ascending: insertion sort for the few jobs of a typical component (qsort's calls cost more there). */
static void sort_ints(int *a, int m) {
    if (m > 32) {
        qsort(a, (size_t)m, sizeof(int), cmp_int);
        return;
    }
    for (int i = 1; i < m; i++) {
        int v = a[i], j = i;
        for (; j > 0 && a[j - 1] > v; j--) a[j] = a[j - 1];
        a[j] = v;
    }
}

/* The communicating jobs coupled to seed through links that their current demands overload; sorted. */
static int component(sim_t *s, int seed) {
    int gen = ++s->comp_gen, m = 0, top = 0;
    s->comp_mark[seed] = gen;
    s->comp[m++] = seed;
    s->stack[top++] = seed;
    while (top) {
        int p = s->stack[--top];
        for (int e = s->jl_ptr[p]; e < s->jl_ptr[p + 1]; e++) {
            int k = s->jl_link[e];
            if (!(s->comm_load[k] > s->cap[k])) continue;
            for (int u = s->lu_ptr[k]; u < s->lu_ptr[k + 1]; u++) {
                int q = s->lu_job[u];
                if (s->comp_mark[q] != gen && s->in_comm[q]) {
                    s->comp_mark[q] = gen;
                    s->comp[m++] = q;
                    s->stack[top++] = q;
                }
            }
        }
    }
    sort_ints(s->comp, m);
    return m;
}

/* Max-min progress of the m jobs in s->comp under their overloaded links, into s->rates (emu.fluid._fill_progress). */
static void fill_progress(sim_t *s, int m) {
    int nact = 0, ne = 0, nt = 0;
    for (int p = 0; p < m; p++) {
        int i = s->comp[p];
        s->act_ptr[p] = ne;
        for (int e = s->jl_ptr[i]; e < s->jl_ptr[i + 1]; e++) {
            int k = s->jl_link[e];
            if (s->comm_load[k] > s->cap[k]) {
                s->act_link[ne] = k;
                s->act_dem[ne++] = s->jl_dem[e];
            }
        }
        s->own_local[p] = s->own[i];
        s->rates[p] = 0.0;
        if (ne > s->act_ptr[p]) s->active[nact++] = p;
        else s->rates[p] = s->own[i];
    }
    s->act_ptr[m] = ne;
    for (int e = 0; e < ne; e++) s->residual[s->act_link[e]] = s->cap[s->act_link[e]];
    double level = 0.0;
    while (nact) {
        int lg = ++s->load_gen;
        nt = 0;
        for (int a = 0; a < nact; a++) {
            int p = s->active[a];
            for (int e = s->act_ptr[p]; e < s->act_ptr[p + 1]; e++) {
                int k = s->act_link[e];
                if (s->load_mark[k] != lg) {
                    s->load_mark[k] = lg;
                    s->load[k] = 0.0;
                    s->touched[nt++] = k;
                }
                s->load[k] += s->act_dem[e];
            }
        }
        double step = INFINITY;
        for (int a = 0; a < nact; a++) {
            double r = s->own_local[s->active[a]] - level;
            if (r < step) step = r;
        }
        for (int j = 0; j < nt; j++) {
            int k = s->touched[j];
            double r = s->residual[k] / s->load[k];
            if (r < step) step = r;
        }
        if (step < 0.0) step = 0.0;
        level += step;
        int sg = ++s->sat_gen;
        for (int j = 0; j < nt; j++) {
            int k = s->touched[j];
            s->residual[k] -= step * s->load[k];
            if (s->residual[k] <= 1e-9 * s->cap[k]) {
                s->residual[k] = 0.0;
                s->sat_mark[k] = sg;
            }
        }
        int nstill = 0;
        for (int a = 0; a < nact; a++) {
            int p = s->active[a], frozen = s->own_local[p] - level <= 1e-9 * fabs(s->own_local[p]);
            for (int e = s->act_ptr[p]; !frozen && e < s->act_ptr[p + 1]; e++) frozen = s->sat_mark[s->act_link[e]] == sg;
            if (frozen) s->rates[p] = level;
            else s->still[nstill++] = p;
        }
        if (nstill == nact) { /* no progress (cannot happen with positive capacities): freeze the rest at the level */
            for (int a = 0; a < nact; a++) s->rates[s->active[a]] = level;
            break;
        }
        memcpy(s->active, s->still, (size_t)nstill * sizeof(int));
        nact = nstill;
    }
}

/* Re-solve the components of the seeds among the communicating jobs; reschedule the jobs whose rate changed. */
static int resolve(sim_t *s, const int *seeds, int nseeds, double t, int new_job) {
    int gen = ++s->done_gen;
    for (int a = 0; a < nseeds; a++) {
        int seed = seeds[a];
        if (s->done_mark[seed] == gen || !s->in_comm[seed]) continue;
        int m = component(s, seed);
        for (int p = 0; p < m; p++) s->done_mark[s->comp[p]] = gen;
        if (m == 1) s->rates[0] = s->own[seed];
        else {
            s->solves++;
            fill_progress(s, m);
        }
        for (int p = 0; p < m; p++) {
            int i = s->comp[p];
            double r = s->rates[p];
            if (r == s->x[i] && i != new_job) continue; /* its pending completion stays valid */
            double left = s->rem[i] - s->x[i] * (t - s->last[i]);
            s->rem[i] = left > 0.0 ? left : 0.0;
            s->last[i] = t;
            s->x[i] = r;
            s->ver[i]++;
            if (r > 0) {
                int rc = heap_push(s, t + s->rem[i] / r, i);
                if (rc) return rc;
            }
        }
    }
    return NW_FLUID_OK;
}

NW_FLUID_API int nw_fluid_version(void) { return NW_FLUID_ABI; }

/* Simulate until every watched job has finished `iterations` iterations (see emu.fluid.simulate_periodic).
 *
 * Jobs 0..n-1; only jobs with comm[i] > 0 are simulated. Binding links 0..nlinks-1 with capacity cap[k]:
 * job i's links are jl_link[jl_ptr[i]..jl_ptr[i+1]) with demands jl_dem[...]; link k's users are
 * lu_job[lu_ptr[k]..lu_ptr[k+1]). own[i]: job i's progress cap alone.
 * Out: count[i] iterations finished; ends[i*ends_cap + c] the end of iteration c for c < ends_cap (the caller
 * retries with a larger ends_cap when some count exceeds it); stats[0] events, stats[1] solves.
 */
/* The loop of both entry points. With grow set, *ends and *ends_cap come back as the buffer it allocated (and grew) and
 * its row length, for the caller to free; else *ends (ends_cap entries per job) is the caller's. */
static int simulate(int n, const double *compute, const double *comm, const double *start, const double *own,
                    const unsigned char *watched, int iterations, int nlinks, const double *cap,
                    const int *jl_ptr, const int *jl_link, const double *jl_dem, const int *lu_ptr, const int *lu_job,
                    int *ends_cap, double **ends, int grow, int *count, int64_t *stats) {
    if (n < 0 || nlinks < 0 || iterations < 1 || *ends_cap < 0 || !compute || !comm || !start || !own || !watched || !count || !stats
        || (*ends_cap > 0 && !grow && !*ends) || !jl_ptr || !lu_ptr)
        return NW_FLUID_EINVAL;
    sim_t s;
    memset(&s, 0, sizeof(s));
    s.n = n, s.nlinks = nlinks, s.iterations = iterations;
    s.ends = grow ? NULL : *ends, s.ends_cap = grow ? 0 : *ends_cap, s.grow = grow;
    s.compute = compute, s.comm = comm, s.own = own, s.cap = cap;
    s.jl_ptr = jl_ptr, s.jl_link = jl_link, s.jl_dem = jl_dem, s.lu_ptr = lu_ptr, s.lu_job = lu_job;
    size_t N = (size_t)n + 1, L = (size_t)nlinks + 1, E = (size_t)jl_ptr[n] + 1;
    int rc = NW_FLUID_ENOMEM;
    s.state = calloc(N, sizeof(int)), s.in_comm = calloc(N, sizeof(int)), s.count = count;
    s.comp_mark = calloc(N, sizeof(int)), s.done_mark = calloc(N, sizeof(int));
    s.x = calloc(N, sizeof(double)), s.rem = calloc(N, sizeof(double)), s.last = calloc(N, sizeof(double));
    s.ver = calloc(N, sizeof(int64_t));
    s.comm_load = calloc(L, sizeof(double)), s.residual = calloc(L, sizeof(double)), s.load = calloc(L, sizeof(double));
    s.load_mark = calloc(L, sizeof(int)), s.sat_mark = calloc(L, sizeof(int)), s.touched = calloc(L, sizeof(int));
    s.comp = calloc(N, sizeof(int)), s.stack = calloc(N, sizeof(int)), s.seeds = calloc(N, sizeof(int));
    s.active = calloc(N, sizeof(int)), s.still = calloc(N, sizeof(int)), s.act_ptr = calloc(N, sizeof(int));
    s.rates = calloc(N, sizeof(double)), s.own_local = calloc(N, sizeof(double));
    s.act_link = calloc(E, sizeof(int)), s.act_dem = calloc(E, sizeof(double));
    int *seen = calloc(N, sizeof(int));
    if (!s.state || !s.in_comm || !s.comp_mark || !s.done_mark || !s.x || !s.rem || !s.last || !s.ver || !s.comm_load || !s.residual
        || !s.load || !s.load_mark || !s.sat_mark || !s.touched || !s.comp || !s.stack || !s.seeds || !s.active || !s.still
        || !s.act_ptr || !s.rates || !s.own_local || !s.act_link || !s.act_dem || !seen)
        goto out;
    memset(count, 0, (size_t)n * sizeof(int));
    int remaining = 0, seen_gen = 0;
    for (int i = 0; i < n; i++) {
        if (comm[i] > 0) {
            if ((rc = heap_push(&s, start[i], i))) goto out;
            remaining += watched[i] != 0;
        }
    }
    rc = NW_FLUID_OK;
    if (!remaining) s.heap_len = 0; /* no watched job communicates: nothing to simulate */
    int64_t events = 0;
    double stop = INFINITY; /* once every watched job is done: finish the events of that same instant, then stop */
    while (s.heap_len) {
        event_t ev = heap_pop(&s);
        if (ev.t > stop) break;
        int i = ev.job;
        if (ev.ver != s.ver[i]) continue;
        double t = ev.t;
        events++;
        if (s.state[i] == 2) { /* communication done: the iteration ends, the next compute starts */
            s.in_comm[i] = 0;
            for (int e = jl_ptr[i]; e < jl_ptr[i + 1]; e++) s.comm_load[jl_link[e]] -= jl_dem[e];
            s.x[i] = 0.0;
            if ((rc = record_end(&s, i, t))) goto out;
            if (count[i] == iterations && watched[i] && !--remaining) stop = t + 1e-12;
            s.state[i] = 1;
            s.ver[i]++;
            if ((rc = heap_push(&s, t + compute[i], i))) goto out;
            /* the communicating jobs that share a binding link with it, in index order */
            int ns = 0, g = ++seen_gen;
            seen[i] = g;
            for (int e = jl_ptr[i]; e < jl_ptr[i + 1]; e++) {
                int k = jl_link[e];
                for (int u = lu_ptr[k]; u < lu_ptr[k + 1]; u++) {
                    int q = lu_job[u];
                    if (seen[q] != g) {
                        seen[q] = g;
                        if (s.in_comm[q]) s.seeds[ns++] = q;
                    }
                }
            }
            sort_ints(s.seeds, ns);
            if ((rc = resolve(&s, s.seeds, ns, t, -1))) goto out;
        } else if (s.state[i] == 1) { /* compute done: communicate */
            s.state[i] = 2;
            s.in_comm[i] = 1;
            for (int e = jl_ptr[i]; e < jl_ptr[i + 1]; e++) s.comm_load[jl_link[e]] += jl_dem[e];
            s.rem[i] = comm[i], s.last[i] = t, s.x[i] = 0.0;
            if ((rc = resolve(&s, &i, 1, t, i))) goto out;
        } else { /* first start */
            s.state[i] = 1;
            s.ver[i]++;
            if ((rc = heap_push(&s, t + compute[i], i))) goto out;
        }
    }
    stats[0] = events;
    stats[1] = s.solves;
out:
    free(s.state), free(s.in_comm), free(s.comp_mark), free(s.done_mark), free(s.x), free(s.rem), free(s.last), free(s.ver);
    free(s.comm_load), free(s.residual), free(s.load), free(s.load_mark), free(s.sat_mark), free(s.touched);
    free(s.comp), free(s.stack), free(s.seeds), free(s.active), free(s.still), free(s.act_ptr), free(s.rates), free(s.own_local);
    free(s.act_link), free(s.act_dem), free(seen), free(s.heap);
    if (grow) *ends = s.ends, *ends_cap = s.ends_cap;
    return rc;
}

/* Simulate until every watched job has finished `iterations` iterations (see emu.fluid.simulate_periodic).
 *
 * Jobs 0..n-1; only jobs with comm[i] > 0 are simulated. Binding links 0..nlinks-1 with capacity cap[k]:
 * job i's links are jl_link[jl_ptr[i]..jl_ptr[i+1]) with demands jl_dem[...]; link k's users are
 * lu_job[lu_ptr[k]..lu_ptr[k+1]). own[i]: job i's progress cap alone.
 * Out: count[i] iterations finished; ends[i*ends_cap + c] the end of iteration c for c < ends_cap (the caller
 * retries with a larger ends_cap when some count exceeds it); stats[0] events, stats[1] solves.
 */
NW_FLUID_API int nw_fluid_simulate(int n, const double *compute, const double *comm, const double *start, const double *own,
                                   const unsigned char *watched, int iterations, int nlinks, const double *cap,
                                   const int *jl_ptr, const int *jl_link, const double *jl_dem, const int *lu_ptr, const int *lu_job,
                                   int ends_cap, double *ends, int *count, int64_t *stats) {
    return simulate(n, compute, comm, start, own, watched, iterations, nlinks, cap, jl_ptr, jl_link, jl_dem, lu_ptr, lu_job, &ends_cap, &ends,
                    0, count, stats);
}

/* The same simulation; out: means[i] the mean duration of job i's iterations after the first (its first's when it
 * finished only one; NaN when none), for the jobs with comm[i] > 0 (the others' entries are left alone), count and
 * stats as above. */
NW_FLUID_API int nw_fluid_simulate_means(int n, const double *compute, const double *comm, const double *start, const double *own,
                                         const unsigned char *watched, int iterations, int nlinks, const double *cap,
                                         const int *jl_ptr, const int *jl_link, const double *jl_dem, const int *lu_ptr,
                                         const int *lu_job, double *means, int *count, int64_t *stats) {
    if (!means) return NW_FLUID_EINVAL;
    double *ends = NULL, *d = NULL;
    int ends_cap = 0, rc = simulate(n, compute, comm, start, own, watched, iterations, nlinks, cap, jl_ptr, jl_link, jl_dem, lu_ptr, lu_job,
                                    &ends_cap, &ends, 1, count, stats);
    if (rc == NW_FLUID_OK && ends_cap > 0 && !(d = malloc((size_t)ends_cap * sizeof(double)))) rc = NW_FLUID_ENOMEM;
    for (int i = 0; rc == NW_FLUID_OK && i < n; i++) {
        if (!(comm[i] > 0)) continue;
        int c = count[i], m = 0; /* every end was kept: the buffer grows before a job's count passes it */
        if (c > 0) {
            const double *e = ends + (size_t)i * (size_t)ends_cap;
            if (c > 1)
                for (int k = 1; k < c; k++) d[m++] = e[k] - e[k - 1];
            else
                d[m++] = e[0] - start[i];
        }
        means[i] = m ? nw_fluid_pairwise_sum(d, m) / (double)m : NAN;
    }
    free(d), free(ends);
    return rc;
}
