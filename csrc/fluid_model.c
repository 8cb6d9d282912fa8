/* netweave: the incremental core of emu.fluid.PeriodicFluidModel, in C, for radius 1 with max_ball (no phase quantum).
 *
 * The Python class stays the reference (and serves every other configuration); this is the same bookkeeping step for
 * step, so that a replay gives the very same answers bit for bit: per link its users (job -> demand, in joining order),
 * whether it binds (several users whose demands sum above the capacity, decided with a running sum and its error bound,
 * summed afresh near the capacity), per job its binding links in the order they became binding; the balls around the
 * changed jobs, cut to max_ball jobs around chunks of centres; the coupling of a ball (its shared binding links, the
 * ones that can saturate, identical ones once); the two caches of answers (by the jobs' identities, and by a name-free
 * signature with values rounded to 9 significant digits), cleared where Python clears them; and the event loop of
 * csrc/fluid.c (nw_fluid_simulate_means) for what they miss.
 *
 * Jobs are numbered by serial (the order they joined, never reused), which is the order of every link's users: a
 * user list stays sorted by serial. Python numbers the links (validation stays there) and registers each with its
 * capacity (nw_fm_add_link); nw_fm_update takes the jobs that left (serials) and the jobs that joined (their
 * identities, timings, start and links) and hands back the answers it refreshed. All state lives in the handle.
 *
 * Errors: NW_FLUID_EINVAL for arguments Python never passes (checked before any change), NW_FLUID_ENOMEM when an
 * allocation fails, after which the handle can only be freed (Python raises MemoryError).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fluid.h"

#define EPS (1.0 / 4503599627370496.0) /* 2**-52: emu.fluid._EPS */
#define R9_SLOTS 65536                 /* direct-mapped cache of 9-digit roundings (exact: keyed by the value's bits) */

typedef struct { int64_t job; double d; } user_t;  /* a link's user: serial and demand */
typedef struct { int lid; double d; } ld_t;        /* a job's link and demand */

typedef struct {
    double cap, sum, err;
    int binding, n;
    size_t size;
    user_t *u; /* sorted by serial (= joining order) */
} link_t;

typedef struct {
    int64_t ident;
    double compute, comm, start, own, time, row[4];
    ld_t *links, *bind; /* all its links; its binding links in the order they became binding */
    int nlinks, nbind;
    size_t bind_size;
    unsigned char alive, has_time, has_row;
} job_t;

typedef struct {
    uint64_t hash;
    uint32_t klen, nval;
    unsigned char data[]; /* nval doubles, then klen key bytes */
} entry_t;

typedef struct {
    entry_t **slot;
    size_t size, count;
} table_t;

typedef struct { double r[4]; int p; } row_t;
typedef struct { const unsigned char *p; size_t len; } span_t;
typedef struct { double w; int64_t k; } ranked_t;

#define VEC(T, name) T *name; size_t name##_size
struct nw_fm {
    int iterations, max_ball;
    int64_t cache_limit;
    link_t *links;
    int nlinks, links_size;
    job_t *jobs;
    int64_t njobs, jobs_size, alive;
    /* per serial: marks of the sets an update keeps (generation numbers), hop distance, coupling weight */
    uint32_t *m_seed, *m_done, *m_ball, *m_ref, *m_inside, *m_w;
    uint32_t g_seed, g_done, g_ball, g_ref, g_inside, g_w;
    int *dist;
    double *weight;
    /* per link: marks of the coupling's seen/shared links and their candidate numbers */
    uint32_t *l_seen, *l_shared, *l_cand;
    uint32_t g_link;
    int *l_index;
    table_t by_identity, by_signature;
    int64_t counters[6]; /* calls, hits, simulations, events, capped; and how often the identity cache was emptied */
    uint64_t r9_key[R9_SLOTS];
    double r9_val[R9_SLOTS];
    unsigned char r9_used[R9_SLOTS];
    /* scratch */
    VEC(int64_t, seeds); VEC(int64_t, live); VEC(int64_t, near); VEC(int64_t, centres); VEC(int64_t, ball);
    VEC(int64_t, refreshed); VEC(ranked_t, ranked); VEC(int, watch); VEC(double, answer);
    VEC(int, cand_lid); VEC(int, ent_c); VEC(int, ent_p); VEC(double, ent_d); VEC(int, bucket);
    VEC(int, kept); VEC(int, jl_ptr); VEC(int, jl_link); VEC(double, jl_dem); VEC(int, lu_ptr); VEC(int, lu_job); VEC(double, lu_dem);
    VEC(double, jfloat); VEC(unsigned char, watched); VEC(int, count); VEC(double, means); VEC(double, capk);
    VEC(row_t, rows); VEC(int, order); VEC(int, rank); VEC(unsigned char, key); VEC(unsigned char, colbuf);
    VEC(span_t, cols); VEC(size_t, coloff); VEC(int, wrank); VEC(double, vals);
    size_t seeds_n, live_n, near_n, centres_n, ball_n, refreshed_n;
};

/* Room for need elements of size elem in *p (of *size elements): grown by doubling. */
static int reserve(void *pp, size_t *size, size_t need, size_t elem) {
    void **p = (void **)pp;
    if (need <= *size) return NW_FLUID_OK;
    size_t cap = *size ? *size : 16;
    while (cap < need) cap *= 2;
    void *q = realloc(*p, cap * elem);
    if (!q) return NW_FLUID_ENOMEM;
    *p = q;
    *size = cap;
    return NW_FLUID_OK;
}
#define RESERVE(h, name, need) reserve(&(h)->name, &(h)->name##_size, (need), sizeof(*(h)->name))

/* ------------------------------------------------------------------ hash tables: key bytes -> doubles -- */

static uint64_t hash_bytes(const unsigned char *p, size_t n) {
    uint64_t x = 1469598103934665603ULL ^ n; /* FNV-1a, 8 bytes a step, with a final mix */
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        x = (x ^ w) * 1099511628211ULL;
        x ^= x >> 29;
    }
    for (; i < n; i++) x = (x ^ p[i]) * 1099511628211ULL;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return x;
}

static void table_clear(table_t *t) {
    for (size_t i = 0; i < t->size; i++) free(t->slot[i]);
    free(t->slot);
    t->slot = NULL, t->size = t->count = 0;
}

static const double *table_get(const table_t *t, const unsigned char *key, size_t klen, uint64_t hash) {
    if (!t->size) return NULL;
    for (size_t i = hash & (t->size - 1);; i = (i + 1) & (t->size - 1)) {
        const entry_t *e = t->slot[i];
        if (!e) return NULL;
        if (e->hash == hash && e->klen == klen && !memcmp(e->data + e->nval * sizeof(double), key, klen)) return (const double *)e->data;
    }
}

/* Insert a key that is not in the table. */
static int table_put(table_t *t, const unsigned char *key, size_t klen, uint64_t hash, const double *val, int nval) {
    if (2 * (t->count + 1) > t->size) {
        size_t size = t->size ? 2 * t->size : 1024;
        entry_t **slot = calloc(size, sizeof(*slot));
        if (!slot) return NW_FLUID_ENOMEM;
        for (size_t i = 0; i < t->size; i++) {
            entry_t *e = t->slot[i];
            if (!e) continue;
            size_t j = e->hash & (size - 1);
            while (slot[j]) j = (j + 1) & (size - 1);
            slot[j] = e;
        }
        free(t->slot);
        t->slot = slot, t->size = size;
    }
    entry_t *e = malloc(sizeof(*e) + (size_t)nval * sizeof(double) + klen);
    if (!e) return NW_FLUID_ENOMEM;
    e->hash = hash, e->klen = (uint32_t)klen, e->nval = (uint32_t)nval;
    memcpy(e->data, val, (size_t)nval * sizeof(double));
    memcpy(e->data + (size_t)nval * sizeof(double), key, klen);
    size_t j = hash & (t->size - 1);
    while (t->slot[j]) j = (j + 1) & (t->size - 1);
    t->slot[j] = e;
    t->count++;
    return NW_FLUID_OK;
}

/* ------------------------------------------------------------------ the handle -- */

NW_FLUID_API nw_fm *nw_fm_new(int iterations, int max_ball, int64_t cache_limit) {
    if (iterations < 1 || max_ball < 2) return NULL;
    nw_fm *h = calloc(1, sizeof(*h));
    if (!h) return NULL;
    h->iterations = iterations, h->max_ball = max_ball, h->cache_limit = cache_limit;
    return h;
}

NW_FLUID_API void nw_fm_free(nw_fm *h) {
    if (!h) return;
    for (int l = 0; l < h->nlinks; l++) free(h->links[l].u);
    for (int64_t s = 0; s < h->njobs; s++) free(h->jobs[s].links), free(h->jobs[s].bind);
    free(h->links), free(h->jobs);
    free(h->m_seed), free(h->m_done), free(h->m_ball), free(h->m_ref), free(h->m_inside), free(h->m_w), free(h->dist), free(h->weight);
    free(h->l_seen), free(h->l_shared), free(h->l_cand), free(h->l_index);
    table_clear(&h->by_identity), table_clear(&h->by_signature);
    free(h->seeds), free(h->live), free(h->near), free(h->centres), free(h->ball), free(h->refreshed), free(h->ranked), free(h->lu_dem);
    free(h->watch), free(h->answer), free(h->cand_lid), free(h->ent_c), free(h->ent_p), free(h->ent_d), free(h->bucket);
    free(h->kept), free(h->jl_ptr), free(h->jl_link), free(h->jl_dem), free(h->lu_ptr), free(h->lu_job), free(h->jfloat);
    free(h->watched), free(h->count), free(h->means), free(h->capk), free(h->rows), free(h->order), free(h->rank), free(h->key);
    free(h->colbuf), free(h->cols), free(h->coloff), free(h->wrank), free(h->vals);
    free(h);
}

/* Register link number nlinks with its capacity (> 0); returns its number or an error code. */
NW_FLUID_API int nw_fm_add_link(nw_fm *h, double cap) {
    if (!h || !(cap > 0)) return NW_FLUID_EINVAL;
    if (h->nlinks == h->links_size) {
        int size = h->links_size ? 2 * h->links_size : 256;
        link_t *l = realloc(h->links, (size_t)size * sizeof(*l));
        if (!l) return NW_FLUID_ENOMEM;
        h->links = l;
        uint32_t *m[3] = {h->l_seen, h->l_shared, h->l_cand};
        uint32_t **dst[3] = {&h->l_seen, &h->l_shared, &h->l_cand};
        for (int a = 0; a < 3; a++) {
            uint32_t *q = realloc(m[a], (size_t)size * sizeof(uint32_t));
            if (!q) return NW_FLUID_ENOMEM;
            memset(q + h->links_size, 0, (size_t)(size - h->links_size) * sizeof(uint32_t));
            *dst[a] = q;
        }
        int *ix = realloc(h->l_index, (size_t)size * sizeof(int));
        if (!ix) return NW_FLUID_ENOMEM;
        h->l_index = ix;
        h->links_size = size;
    }
    link_t *l = &h->links[h->nlinks];
    memset(l, 0, sizeof(*l));
    l->cap = cap;
    return h->nlinks++;
}

/* counters: calls, hits, simulations, events, capped, identity cache clearings */
NW_FLUID_API int nw_fm_counters(const nw_fm *h, int64_t *out) {
    if (!h || !out) return NW_FLUID_EINVAL;
    memcpy(out, h->counters, sizeof(h->counters));
    return NW_FLUID_OK;
}

static int grow_jobs(nw_fm *h, int64_t need) {
    if (need <= h->jobs_size) return NW_FLUID_OK;
    int64_t size = h->jobs_size ? h->jobs_size : 1024, old = h->jobs_size;
    while (size < need) size *= 2;
    job_t *j = realloc(h->jobs, (size_t)size * sizeof(*j));
    if (!j) return NW_FLUID_ENOMEM;
    h->jobs = j;
    uint32_t **m[6] = {&h->m_seed, &h->m_done, &h->m_ball, &h->m_ref, &h->m_inside, &h->m_w};
    for (int a = 0; a < 6; a++) {
        uint32_t *q = realloc(*m[a], (size_t)size * sizeof(uint32_t));
        if (!q) return NW_FLUID_ENOMEM;
        memset(q + old, 0, (size_t)(size - old) * sizeof(uint32_t));
        *m[a] = q;
    }
    int *d = realloc(h->dist, (size_t)size * sizeof(int));
    if (!d) return NW_FLUID_ENOMEM;
    h->dist = d;
    double *w = realloc(h->weight, (size_t)size * sizeof(double));
    if (!w) return NW_FLUID_ENOMEM;
    h->weight = w;
    h->jobs_size = size;
    return NW_FLUID_OK;
}

/* ------------------------------------------------------------------ links and binding (PeriodicFluidModel._update_binding) -- */

static int bind_add(job_t *j, int lid, double d) {
    if (reserve(&j->bind, &j->bind_size, (size_t)j->nbind + 1, sizeof(ld_t))) return NW_FLUID_ENOMEM;
    j->bind[j->nbind++] = (ld_t){lid, d};
    return NW_FLUID_OK;
}

static void bind_remove(job_t *j, int lid) {
    for (int a = 0; a < j->nbind; a++)
        if (j->bind[a].lid == lid) {
            memmove(j->bind + a, j->bind + a + 1, (size_t)(j->nbind - a - 1) * sizeof(ld_t));
            j->nbind--;
            return;
        }
}

/* _saturates: _can_saturate of the link's users' demands in joining order, from the running sum when it is far enough. */
static int saturates(link_t *l) {
    int n = l->n;
    if (n < 2) return 0;
    double total = l->sum, cap = l->cap;
    double tol = 2.0 * l->err + (double)(n + 2) * 8.0 * EPS * (total + cap);
    if (total - cap > tol) return 1;
    if (cap - total > tol) return 0;
    total = 0.0;
    for (int a = 0; a < n; a++) total += l->u[a].d;
    l->sum = total, l->err = (double)n * EPS * total;
    return total > cap;
}

/* joined: the serial of the job that just joined (its last user), or -1 after a leave */
static int update_binding(nw_fm *h, int lid, int64_t joined) {
    link_t *l = &h->links[lid];
    int before = l->binding, now = ((joined >= 0) == before) ? before : saturates(l);
    l->binding = now;
    if (now && !before) {
        for (int a = 0; a < l->n; a++)
            if (bind_add(&h->jobs[l->u[a].job], lid, l->u[a].d)) return NW_FLUID_ENOMEM;
    } else if (before && !now) {
        for (int a = 0; a < l->n; a++) bind_remove(&h->jobs[l->u[a].job], lid);
    } else if (now && joined >= 0) {
        return bind_add(&h->jobs[joined], lid, l->u[l->n - 1].d);
    }
    return NW_FLUID_OK;
}

static void users_remove(link_t *l, int64_t job) {
    int lo = 0, hi = l->n - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (l->u[mid].job < job) lo = mid + 1;
        else if (l->u[mid].job > job) hi = mid - 1;
        else {
            memmove(l->u + mid, l->u + mid + 1, (size_t)(l->n - mid - 1) * sizeof(user_t));
            l->n--;
            return;
        }
    }
}

/* ------------------------------------------------------------------ balls -- */

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* _distances(seeds, 1, limit) into h->ball (in discovery order; h->dist and the ball mark set); 1 when it holds more than limit
 * (limit < 0: no limit), and the walk stopped there. */
static int distances1(nw_fm *h, const int64_t *seeds, size_t nseeds, int64_t limit, int64_t **out, size_t *nout, size_t *out_size) {
    uint32_t g = ++h->g_ball;
    size_t n = 0;
    if (reserve(out, out_size, nseeds + 1, sizeof(int64_t))) return -1;
    for (size_t a = 0; a < nseeds; a++) {
        if (h->m_ball[seeds[a]] == g) continue;
        h->m_ball[seeds[a]] = g, h->dist[seeds[a]] = 0;
        (*out)[n++] = seeds[a];
    }
    *nout = n;
    if (limit >= 0 && (int64_t)n > limit) return 1;
    for (size_t a = 0; a < nseeds; a++) {
        const job_t *j = &h->jobs[seeds[a]];
        for (int b = 0; b < j->nbind; b++) {
            const link_t *l = &h->links[j->bind[b].lid];
            for (int c = 0; c < l->n; c++) {
                int64_t k = l->u[c].job;
                if (h->m_ball[k] == g) continue;
                h->m_ball[k] = g, h->dist[k] = 1;
                if (reserve(out, out_size, n + 1, sizeof(int64_t))) return -1;
                (*out)[n++] = k;
            }
        }
        *nout = n;
        if (limit >= 0 && (int64_t)n > limit) return 1;
    }
    return 0;
}

/* whether a job of the ball (marked g_ball) has a binding-link partner outside it */
static int beyond(const nw_fm *h, const int64_t *ball, size_t n) {
    for (size_t a = 0; a < n; a++) {
        const job_t *j = &h->jobs[ball[a]];
        for (int b = 0; b < j->nbind; b++) {
            const link_t *l = &h->links[j->bind[b].lid];
            for (int c = 0; c < l->n; c++)
                if (h->m_ball[l->u[c].job] != h->g_ball) return 1;
        }
    }
    return 0;
}

static int touches(const nw_fm *h, int64_t k) {
    const job_t *j = &h->jobs[k];
    for (int b = 0; b < j->nbind; b++) {
        const link_t *l = &h->links[j->bind[b].lid];
        for (int c = 0; c < l->n; c++)
            if (h->m_ball[l->u[c].job] == h->g_ball) return 1;
    }
    return 0;
}

/* heapq.nsmallest's order of (-weight, serial): largest weight first, then the earliest joined */
static int cmp_ranked(const void *a, const void *b) {
    const ranked_t *x = a, *y = b;
    if (x->w != y->w) return x->w > y->w ? -1 : 1;
    return (x->k > y->k) - (x->k < y->k);
}

/* _nearest(chunk, limit) into h->ball: the chunk and the limit - len(chunk) users of its binding links heaviest on them, sorted */
static int nearest(nw_fm *h, const int64_t *chunk, size_t nchunk, size_t *nball) {
    uint32_t gw = ++h->g_w, gi = ++h->g_inside;
    size_t nk = 0;
    for (size_t a = 0; a < nchunk; a++) h->m_inside[chunk[a]] = gi;
    for (size_t a = 0; a < nchunk; a++) {
        const job_t *j = &h->jobs[chunk[a]];
        for (int b = 0; b < j->nbind; b++) {
            const link_t *l = &h->links[j->bind[b].lid];
            double cap = l->cap;
            for (int c = 0; c < l->n; c++) {
                int64_t k = l->u[c].job;
                if (h->m_w[k] != gw) {
                    h->m_w[k] = gw, h->weight[k] = 0.0 + l->u[c].d / cap;
                    if (h->m_inside[k] != gi) {
                        if (RESERVE(h, ranked, nk + 1)) return NW_FLUID_ENOMEM;
                        h->ranked[nk++].k = k;
                    }
                } else {
                    h->weight[k] = h->weight[k] + l->u[c].d / cap;
                }
            }
        }
    }
    size_t want = (size_t)h->max_ball - nchunk;
    if (nk > want) {
        for (size_t a = 0; a < nk; a++) h->ranked[a].w = h->weight[h->ranked[a].k];
        qsort(h->ranked, nk, sizeof(ranked_t), cmp_ranked);
        nk = want;
    }
    if (RESERVE(h, ball, nchunk + nk)) return NW_FLUID_ENOMEM;
    memcpy(h->ball, chunk, nchunk * sizeof(int64_t));
    for (size_t a = 0; a < nk; a++) h->ball[nchunk + a] = h->ranked[a].k;
    qsort(h->ball, nchunk + nk, sizeof(int64_t), cmp_i64);
    *nball = nchunk + nk;
    return NW_FLUID_OK;
}

/* ------------------------------------------------------------------ answers (PeriodicFluidModel._answer) -- */

static double r9(nw_fm *h, double v) {
    uint64_t bits;
    memcpy(&bits, &v, 8);
    size_t slot = (size_t)((bits * 0x9E3779B97F4A7C15ULL) >> 48) & (R9_SLOTS - 1);
    if (h->r9_used[slot] && h->r9_key[slot] == bits) return h->r9_val[slot];
    char buf[64];
    snprintf(buf, sizeof buf, "%.9g", v); /* float(f"{v:.9g}"): both correctly rounded */
    double r = strtod(buf, NULL) + 0.0;   /* + 0.0: -0.0 as 0.0, equal in Python's keys */
    h->r9_used[slot] = 1, h->r9_key[slot] = bits, h->r9_val[slot] = r;
    return r;
}

static int cmp_row(const void *a, const void *b) {
    const row_t *x = a, *y = b;
    for (int c = 0; c < 4; c++)
        if (x->r[c] != y->r[c]) return x->r[c] < y->r[c] ? -1 : 1;
    return (x->p > y->p) - (x->p < y->p);
}

static int cmp_span(const void *a, const void *b) {
    const span_t *x = a, *y = b;
    if (x->len != y->len) return x->len < y->len ? -1 : 1;
    return memcmp(x->p, y->p, x->len);
}

static int cmp_int(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

static int put_bytes(nw_fm *h, size_t *n, const void *p, size_t len) {
    if (RESERVE(h, key, *n + len)) return NW_FLUID_ENOMEM;
    memcpy(h->key + *n, p, len);
    *n += len;
    return NW_FLUID_OK;
}

/* The coupling of comp[0..m) (PeriodicFluidModel._coupling and _Coupling.of): its kept links 0..K-1 with their users as CSR
 * tables (h->jl_*, h->lu_*; capacities in h->capk). Returns K or an error. */
static int coupling(nw_fm *h, const int64_t *comp, int m) {
    uint32_t g = ++h->g_link;
    for (int p = 0; p < m; p++) {
        const job_t *j = &h->jobs[comp[p]];
        for (int b = 0; b < j->nbind; b++) {
            int lid = j->bind[b].lid;
            if (h->l_seen[lid] == g) h->l_shared[lid] = g;
            else h->l_seen[lid] = g;
        }
    }
    /* the shared links' users in first-seen order: entries (candidate, position, demand), bucketed stably */
    int nc = 0, ne = 0;
    for (int p = 0; p < m; p++) {
        const job_t *j = &h->jobs[comp[p]];
        for (int b = 0; b < j->nbind; b++) {
            int lid = j->bind[b].lid;
            if (h->l_shared[lid] != g) continue;
            if (h->l_cand[lid] != g) {
                h->l_cand[lid] = g, h->l_index[lid] = nc;
                if (RESERVE(h, cand_lid, (size_t)nc + 1)) return NW_FLUID_ENOMEM;
                h->cand_lid[nc++] = lid;
            }
            if (RESERVE(h, ent_c, (size_t)ne + 1) || RESERVE(h, ent_p, (size_t)ne + 1) || RESERVE(h, ent_d, (size_t)ne + 1))
                return NW_FLUID_ENOMEM;
            h->ent_c[ne] = h->l_index[lid], h->ent_p[ne] = p, h->ent_d[ne++] = j->bind[b].d;
        }
    }
    /* bucketed by candidate (counting sort, stable: positions in increasing order): positions in lu_job, demands in jfloat */
    if (RESERVE(h, bucket, (size_t)nc + 2) || RESERVE(h, lu_job, (size_t)ne + 1) || RESERVE(h, jfloat, (size_t)ne + 1)
        || RESERVE(h, kept, (size_t)nc + 1))
        return NW_FLUID_ENOMEM;
    memset(h->bucket, 0, ((size_t)nc + 2) * sizeof(int));
    for (int e = 0; e < ne; e++) h->bucket[h->ent_c[e] + 2]++;
    for (int c = 0; c < nc; c++) h->bucket[c + 2] += h->bucket[c + 1];
    for (int e = 0; e < ne; e++) {
        int at = h->bucket[h->ent_c[e] + 1]++;
        h->lu_job[at] = h->ent_p[e], h->jfloat[at] = h->ent_d[e];
    }
    /* now bucket[c] .. bucket[c+1] is candidate c: keep those that can saturate, the first of identical ones */
    int K = 0;
    for (int c = 0; c < nc; c++) {
        int lo = h->bucket[c], hi = h->bucket[c + 1], n = hi - lo;
        double cap = h->links[h->cand_lid[c]].cap;
        if (n < 2) continue;
        double total = 0.0;
        for (int e = lo; e < hi; e++) total += h->jfloat[e];
        if (!(total > cap)) continue;
        int dup = 0;
        for (int q = 0; q < K && !dup; q++) {
            int c2 = h->kept[q], lo2 = h->bucket[c2];
            if (h->bucket[c2 + 1] - lo2 != n || h->links[h->cand_lid[c2]].cap != cap) continue;
            dup = 1;
            for (int e = 0; e < n && dup; e++)
                dup = h->lu_job[lo + e] == h->lu_job[lo2 + e] && h->jfloat[lo + e] == h->jfloat[lo2 + e];
        }
        if (!dup) h->kept[K++] = c;
    }
    /* CSR: per job its kept links in increasing number (jl_*), per kept link its users (lu_ptr into lu_job, already there) */
    int nk = 0;
    for (int q = 0; q < K; q++) nk += h->bucket[h->kept[q] + 1] - h->bucket[h->kept[q]];
    if (RESERVE(h, jl_ptr, (size_t)m + 1) || RESERVE(h, jl_link, (size_t)nk + 1) || RESERVE(h, jl_dem, (size_t)nk + 1)
        || RESERVE(h, lu_ptr, (size_t)K + 1) || RESERVE(h, capk, (size_t)K + 1) || RESERVE(h, ent_c, (size_t)m + 1)
        || RESERVE(h, lu_dem, (size_t)nk + 1))
        return NW_FLUID_ENOMEM;
    memset(h->jl_ptr, 0, ((size_t)m + 1) * sizeof(int));
    for (int q = 0; q < K; q++)
        for (int e = h->bucket[h->kept[q]]; e < h->bucket[h->kept[q] + 1]; e++) h->jl_ptr[h->lu_job[e] + 1]++;
    for (int p = 0; p < m; p++) h->jl_ptr[p + 1] += h->jl_ptr[p];
    memcpy(h->ent_c, h->jl_ptr, (size_t)m * sizeof(int)); /* fill cursors */
    /* lu_job of the kept links, compacted in place (kept candidates are in increasing order, so a copy never overtakes) */
    int at = 0;
    for (int q = 0; q < K; q++) {
        int c = h->kept[q], lo = h->bucket[c], hi = h->bucket[c + 1];
        h->lu_ptr[q] = at;
        h->capk[q] = h->links[h->cand_lid[c]].cap;
        for (int e = lo; e < hi; e++) {
            int p = h->lu_job[e];
            double d = h->jfloat[e];
            int slot = h->ent_c[p]++;
            h->jl_link[slot] = q, h->jl_dem[slot] = d;
            h->lu_dem[at] = d;
            h->lu_job[at++] = p;
        }
    }
    h->lu_ptr[K] = at;
    return K;
}

/* The signature key of comp (with K kept links) into h->key, and h->order (position of each rank); returns its length. */
static int signature(nw_fm *h, const int64_t *comp, int m, int K, const int *watch, int nw, size_t *klen) {
    if (RESERVE(h, rows, (size_t)m) || RESERVE(h, order, (size_t)m) || RESERVE(h, rank, (size_t)m)) return NW_FLUID_ENOMEM;
    for (int p = 0; p < m; p++) {
        job_t *j = &h->jobs[comp[p]];
        if (!j->has_row) {
            j->row[0] = r9(h, j->compute), j->row[1] = r9(h, j->comm), j->row[2] = r9(h, j->start), j->row[3] = r9(h, j->own);
            j->has_row = 1;
        }
        memcpy(h->rows[p].r, j->row, sizeof(j->row));
        h->rows[p].p = p;
    }
    qsort(h->rows, (size_t)m, sizeof(row_t), cmp_row);
    for (int r = 0; r < m; r++) h->order[r] = h->rows[r].p, h->rank[h->rows[r].p] = r;
    size_t n = 0;
    int32_t head[2] = {m, K};
    if (put_bytes(h, &n, head, sizeof(head))) return NW_FLUID_ENOMEM;
    for (int r = 0; r < m; r++)
        if (put_bytes(h, &n, h->rows[r].r, sizeof(h->rows[r].r))) return NW_FLUID_ENOMEM;
    /* the columns: per kept link its users' (rank, rounded demand) by rank and its rounded capacity, as bytes, then sorted */
    size_t cb = 0;
    if (RESERVE(h, coloff, (size_t)K + 1) || RESERVE(h, cols, (size_t)K + 1)) return NW_FLUID_ENOMEM;
    for (int q = 0; q < K; q++) {
        int lo = h->lu_ptr[q], hi = h->lu_ptr[q + 1], cnt = hi - lo;
        size_t len = sizeof(int32_t) + (size_t)cnt * (sizeof(int32_t) + sizeof(double)) + sizeof(double);
        if (RESERVE(h, colbuf, cb + len) || RESERVE(h, wrank, (size_t)cnt)) return NW_FLUID_ENOMEM;
        h->coloff[q] = cb;
        unsigned char *o = h->colbuf + cb;
        int32_t c32 = cnt;
        memcpy(o, &c32, 4), o += 4;
        /* its users by rank (distinct on one link): an insertion sort of their indices, links have few users in a ball */
        for (int a = 0; a < cnt; a++) {
            int b = a, r = h->rank[h->lu_job[lo + a]];
            for (; b > 0 && h->rank[h->lu_job[lo + h->wrank[b - 1]]] > r; b--) h->wrank[b] = h->wrank[b - 1];
            h->wrank[b] = a;
        }
        for (int e = 0; e < cnt; e++) {
            int u = lo + h->wrank[e];
            int32_t rk = h->rank[h->lu_job[u]];
            double rd = r9(h, h->lu_dem[u]);
            memcpy(o, &rk, 4), o += 4;
            memcpy(o, &rd, 8), o += 8;
        }
        double rc = r9(h, h->capk[q]);
        memcpy(o, &rc, 8);
        cb += len;
    }
    for (int q = 0; q < K; q++) h->cols[q].p = h->colbuf + h->coloff[q], h->cols[q].len = (q + 1 < K ? h->coloff[q + 1] : cb) - h->coloff[q];
    qsort(h->cols, (size_t)K, sizeof(span_t), cmp_span);
    for (int q = 0; q < K; q++)
        if (put_bytes(h, &n, h->cols[q].p, h->cols[q].len)) return NW_FLUID_ENOMEM;
    int32_t w32 = watch ? nw : -1;
    if (put_bytes(h, &n, &w32, 4)) return NW_FLUID_ENOMEM;
    if (watch) {
        if (RESERVE(h, wrank, (size_t)nw + 1)) return NW_FLUID_ENOMEM;
        for (int a = 0; a < nw; a++) h->wrank[a] = h->rank[watch[a]];
        qsort(h->wrank, (size_t)nw, sizeof(int), cmp_int);
        if (put_bytes(h, &n, h->wrank, (size_t)nw * sizeof(int))) return NW_FLUID_ENOMEM;
    }
    *klen = n;
    return NW_FLUID_OK;
}

/* The simulation of comp with K kept links (emu.fluid._simulate with means_only, through the C loop) into h->answer. */
static int simulate(nw_fm *h, const int64_t *comp, int m, int K, const int *watch, int nw) {
    if (RESERVE(h, jfloat, 4 * (size_t)m) || RESERVE(h, watched, (size_t)m) || RESERVE(h, count, (size_t)m) || RESERVE(h, means, (size_t)m)
        || RESERVE(h, vals, (size_t)h->iterations + 1))
        return NW_FLUID_ENOMEM;
    double *compute = h->jfloat, *comm = compute + m, *start = comm + m, *own = start + m;
    for (int p = 0; p < m; p++) {
        const job_t *j = &h->jobs[comp[p]];
        compute[p] = j->compute, comm[p] = j->comm, start[p] = j->start, own[p] = j->own;
        h->watched[p] = !watch && j->comm > 0;
    }
    for (int a = 0; watch && a < nw; a++) h->watched[watch[a]] = comm[watch[a]] > 0;
    int64_t stats[2] = {0, 0};
    int rc = nw_fluid_simulate_means(m, compute, comm, start, own, h->watched, h->iterations, K, h->capk, h->jl_ptr, h->jl_link, h->jl_dem,
                                     h->lu_ptr, h->lu_job, h->means, h->count, stats);
    if (rc) return rc;
    for (int p = 0; p < m; p++) {
        if (comm[p] > 0) {
            h->answer[p] = h->means[p];
            continue;
        }
        /* not simulated: its compute-only iterations (_mean_after_first of start + compute * (k + 1)) */
        int it = h->iterations, nd = 0;
        double prev = start[p] + compute[p] * 1.0;
        if (it == 1) h->vals[nd++] = prev - start[p];
        for (int k = 1; k < it; k++) {
            double e = start[p] + compute[p] * (double)(k + 1);
            h->vals[nd++] = e - prev;
            prev = e;
        }
        h->answer[p] = nw_fluid_pairwise_sum(h->vals, nd) / (double)nd;
    }
    h->counters[3] += stats[0];
    return NW_FLUID_OK;
}

/* _answer(comp, watch) into h->answer (aligned with comp). */
static int answer(nw_fm *h, const int64_t *comp, int m, const int *watch, int nw) {
    if (RESERVE(h, answer, (size_t)m)) return NW_FLUID_ENOMEM;
    if (m == 1) {
        const job_t *j = &h->jobs[comp[0]];
        h->answer[0] = j->compute + j->comm / j->own;
        return NW_FLUID_OK;
    }
    h->counters[0]++;
    /* by identity: the jobs' identities (Python's ids, whose objects the caller holds) and the watched positions */
    size_t n = 0;
    int32_t head[2] = {m, watch ? nw : -1};
    if (put_bytes(h, &n, head, sizeof(head))) return NW_FLUID_ENOMEM;
    for (int p = 0; p < m; p++)
        if (put_bytes(h, &n, &h->jobs[comp[p]].ident, 8)) return NW_FLUID_ENOMEM;
    if (watch && put_bytes(h, &n, watch, (size_t)nw * sizeof(int))) return NW_FLUID_ENOMEM;
    size_t ilen = n;
    uint64_t ihash = hash_bytes(h->key, ilen);
    const double *hit = table_get(&h->by_identity, h->key, ilen, ihash);
    if (hit) {
        h->counters[1]++;
        memcpy(h->answer, hit, (size_t)m * sizeof(double));
        return NW_FLUID_OK;
    }
    /* keep the identity key: the signature's key is built in the same buffer */
    unsigned char *ikey = malloc(ilen);
    if (!ikey) return NW_FLUID_ENOMEM;
    memcpy(ikey, h->key, ilen);
    int rc = coupling(h, comp, m);
    if (rc < 0) goto out;
    int K = rc;
    size_t slen;
    if ((rc = signature(h, comp, m, K, watch, nw, &slen))) goto out;
    uint64_t shash = hash_bytes(h->key, slen);
    const double *cached = table_get(&h->by_signature, h->key, slen, shash);
    if (cached) {
        h->counters[1]++;
        for (int r = 0; r < m; r++) h->answer[h->order[r]] = cached[r];
    } else {
        if ((rc = simulate(h, comp, m, K, watch, nw))) goto out;
        h->counters[2]++;
        if ((int64_t)h->by_signature.count >= h->cache_limit) table_clear(&h->by_signature);
        if ((rc = RESERVE(h, vals, (size_t)m))) goto out;
        for (int r = 0; r < m; r++) h->vals[r] = h->answer[h->order[r]];
        if ((rc = table_put(&h->by_signature, h->key, slen, shash, h->vals, m))) goto out;
    }
    if ((int64_t)h->by_identity.count >= h->cache_limit) {
        table_clear(&h->by_identity);
        h->counters[5]++; /* the caller may let go of the jobs it held for the identities it had */
    }
    rc = table_put(&h->by_identity, ikey, ilen, ihash, h->answer, m);
out:
    free(ikey);
    return rc;
}

/* ------------------------------------------------------------------ the update (PeriodicFluidModel.update, radius 1) -- */

/* job k's answer is t now; listed once among the refreshed (h->refreshed holds every job: reserved by nw_fm_update) */
static void refresh(nw_fm *h, int64_t k, double t) {
    job_t *j = &h->jobs[k];
    j->time = t, j->has_time = 1;
    if (h->m_ref[k] != h->g_ref) {
        h->m_ref[k] = h->g_ref;
        h->refreshed[h->refreshed_n++] = k;
    }
}

/* The jobs that left (gone[0..n_gone), serials, increasing) and joined (n_new jobs: identity ident[p], timings, start, links
 * link_id[link_ptr[p]..link_ptr[p+1]) with demands dem[...]; they get the next serials in this order); out: the refreshed
 * jobs' serials and answers (out_size >= the number of jobs after the update), their number, and the counters. */
NW_FLUID_API int nw_fm_update(nw_fm *h, int n_gone, const int64_t *gone, int n_new, const int64_t *ident, const double *compute,
                              const double *comm, const double *start, const int64_t *link_ptr, const int64_t *link_id, const double *dem,
                              int64_t out_size, int64_t *out_serial, double *out_time, int64_t *out_n, int64_t *counters) {
    if (!h || n_gone < 0 || n_new < 0 || !out_n || !counters || (n_gone && !gone)
        || (n_new && (!ident || !compute || !comm || !start || !link_ptr)) || h->alive - n_gone + n_new > out_size
        || (out_size > 0 && (!out_serial || !out_time)))
        return NW_FLUID_EINVAL;
    for (int a = 0; a < n_gone; a++)
        if (gone[a] < 0 || gone[a] >= h->njobs || !h->jobs[gone[a]].alive || (a && gone[a] <= gone[a - 1])) return NW_FLUID_EINVAL;
    for (int p = 0; p < n_new; p++) {
        if (link_ptr[p + 1] < link_ptr[p] || link_ptr[p] < 0 || !(compute[p] >= 0) || !(comm[p] >= 0) || !isfinite(compute[p])
            || !isfinite(comm[p]))
            return NW_FLUID_EINVAL;
        for (int64_t e = link_ptr[p]; e < link_ptr[p + 1]; e++)
            if (!link_id || !dem || link_id[e] < 0 || link_id[e] >= h->nlinks || !(dem[e] > 0) || !isfinite(dem[e])) return NW_FLUID_EINVAL;
    }
    int rc;
    int64_t first = h->njobs;
    if ((rc = grow_jobs(h, h->njobs + n_new)) || (rc = RESERVE(h, refreshed, (size_t)out_size + 1))) return rc;
    h->seeds_n = 0;
    if ((rc = RESERVE(h, seeds, (size_t)n_new + 1))) return rc;
    for (int p = 0; p < n_new; p++) h->seeds[h->seeds_n++] = first + p;
    for (int a = 0; a < n_gone; a++) {
        job_t *j = &h->jobs[gone[a]];
        for (int b = 0; b < j->nlinks; b++) {
            int lid = j->links[b].lid;
            link_t *l = &h->links[lid];
            int bound = l->binding;
            if (bound) { /* its partners there may now be freer (the job itself is filtered out below) */
                if ((rc = RESERVE(h, seeds, h->seeds_n + (size_t)l->n))) return rc;
                for (int c = 0; c < l->n; c++) h->seeds[h->seeds_n++] = l->u[c].job;
            }
            users_remove(l, gone[a]);
            if (!l->n) {
                l->sum = l->err = 0.0;
                continue;
            }
            double left = l->sum - j->links[b].d;
            l->sum = left;
            l->err += fabs(left) * EPS;
            if (bound && (rc = update_binding(h, lid, -1))) return rc;
        }
        free(j->links), free(j->bind);
        j->links = j->bind = NULL, j->nlinks = j->nbind = j->bind_size = 0;
        j->alive = j->has_time = j->has_row = 0;
        h->alive--;
    }
    for (int p = 0; p < n_new; p++) {
        int64_t s = first + p;
        job_t *j = &h->jobs[s];
        memset(j, 0, sizeof(*j));
        j->ident = ident[p], j->compute = compute[p], j->comm = comm[p], j->start = start[p], j->alive = 1;
        int nl = (int)(link_ptr[p + 1] - link_ptr[p]);
        if (nl && !(j->links = malloc((size_t)nl * sizeof(ld_t)))) return NW_FLUID_ENOMEM;
        j->nlinks = nl;
        h->njobs++, h->alive++;
        double own = 1.0;
        for (int b = 0; b < nl; b++) {
            int lid = (int)link_id[link_ptr[p] + b];
            double d = dem[link_ptr[p] + b];
            j->links[b] = (ld_t){lid, d};
            link_t *l = &h->links[lid];
            if (reserve(&l->u, &l->size, (size_t)l->n + 1, sizeof(user_t))) return NW_FLUID_ENOMEM;
            l->u[l->n++] = (user_t){s, d};
            double total = l->sum + d;
            l->sum = total;
            l->err += total * EPS;
            if (l->n > 1) { /* with one user it caps the job but couples nobody */
                if (l->binding) rc = bind_add(j, lid, d);
                else rc = update_binding(h, lid, s);
                if (rc) return rc;
            }
            double x = l->cap / d;
            if (x < own) own = x;
        }
        j->own = own;
    }
    /* the live seeds, once each, in order */
    uint32_t gs = ++h->g_seed, gd = ++h->g_done;
    h->g_ref++;
    h->live_n = h->refreshed_n = 0;
    if ((rc = RESERVE(h, live, h->seeds_n + 1))) return rc;
    for (size_t a = 0; a < h->seeds_n; a++) {
        int64_t s = h->seeds[a];
        if (h->m_seed[s] == gs) continue;
        h->m_seed[s] = gs;
        if (h->jobs[s].alive) h->live[h->live_n++] = s;
    }
    int64_t limit = h->max_ball;
    for (size_t a = 0; a < h->live_n; a++) {
        int64_t s = h->live[a];
        if (h->m_done[s] == gd) continue;
        if ((rc = distances1(h, &s, 1, -1, &h->near, &h->near_n, &h->near_size)) < 0) return NW_FLUID_ENOMEM;
        if ((int64_t)h->near_n <= limit && !beyond(h, h->near, h->near_n)) { /* the whole group lies within the ball: exact */
            qsort(h->near, h->near_n, sizeof(int64_t), cmp_i64);
            for (size_t b = 0; b < h->near_n; b++) h->m_done[h->near[b]] = gd;
            if ((rc = answer(h, h->near, (int)h->near_n, NULL, 0))) return rc;
            for (size_t b = 0; b < h->near_n; b++) refresh(h, h->near[b], h->answer[b]);
            continue;
        }
        /* the centres: the changed jobs not done yet in the ball or next to it */
        h->centres_n = 0;
        if ((rc = RESERVE(h, centres, h->live_n + 1))) return rc;
        for (size_t b = 0; b < h->live_n; b++) {
            int64_t k = h->live[b];
            if (h->m_done[k] != gd && (h->m_ball[k] == h->g_ball || touches(h, k))) h->centres[h->centres_n++] = k;
        }
        for (size_t b = 0; b < h->centres_n; b++) h->m_done[h->centres[b]] = gd;
        rc = distances1(h, h->centres, h->centres_n, limit, &h->ball, &h->ball_n, &h->ball_size);
        if (rc < 0) return NW_FLUID_ENOMEM;
        if (rc == 1) { /* too many to simulate together: each chunk of centres with its nearest */
            qsort(h->centres, h->centres_n, sizeof(int64_t), cmp_i64);
            size_t step = limit / 2 > 1 ? (size_t)(limit / 2) : 1;
            for (size_t c = 0; c < h->centres_n; c += step) {
                size_t nchunk = h->centres_n - c < step ? h->centres_n - c : step, nball;
                const int64_t *chunk = h->centres + c;
                if ((rc = nearest(h, chunk, nchunk, &nball))) return rc;
                h->counters[4]++;
                uint32_t gi = h->g_inside; /* nearest() marked the chunk */
                int nw = 0;
                if ((rc = RESERVE(h, watch, nball + 1))) return rc;
                for (size_t b = 0; b < nball; b++)
                    if (h->m_inside[h->ball[b]] == gi) h->watch[nw++] = (int)b;
                if ((rc = answer(h, h->ball, (int)nball, h->watch, nw))) return rc;
                for (size_t b = 0; b < nball; b++)
                    if (h->m_inside[h->ball[b]] == gi) refresh(h, h->ball[b], h->answer[b]);
            }
            continue;
        }
        qsort(h->ball, h->ball_n, sizeof(int64_t), cmp_i64);
        int nw = 0;
        if ((rc = RESERVE(h, watch, h->ball_n + 1))) return rc;
        for (size_t b = 0; b < h->ball_n; b++)
            if (h->dist[h->ball[b]] < 1) h->watch[nw++] = (int)b;
        if ((rc = answer(h, h->ball, (int)h->ball_n, h->watch, nw))) return rc;
        for (size_t b = 0; b < h->ball_n; b++) {
            int64_t k = h->ball[b];
            if (h->dist[k] < 1 || !h->jobs[k].has_time) refresh(h, k, h->answer[b]);
        }
    }
    for (size_t a = 0; a < h->refreshed_n; a++) out_serial[a] = h->refreshed[a], out_time[a] = h->jobs[h->refreshed[a]].time;
    *out_n = (int64_t)h->refreshed_n;
    memcpy(counters, h->counters, sizeof(h->counters));
    return NW_FLUID_OK;
}
