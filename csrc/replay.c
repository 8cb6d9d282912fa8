/* netweave: the inner loops of placement.replay, in C: LAS's walk and the overloaded-link metric's link table.
 *
 * LAS (least attained service, discretised as Tiresias does) orders every job
 * of the cluster, running or waiting, by (queue, arrival, name); walking that
 * order, a job keeps or gets GPUs when its GPU count fits in what the jobs
 * before it left. In a full cluster the order holds a few thousand jobs and an
 * arrival enters it near the front, so the walk is redone at most events: a
 * few microseconds here, milliseconds in Python. placement/replay.py keeps the
 * order (and a Python loop with the same result, for builds without this
 * library) and turns the changed flags into preemptions and starts.
 *
 * The overloaded-link metric (nw_ov_*, below) keeps each link's running jobs,
 * their summed demand and overloaded arcs as jobs start and stop: per started
 * job a hundred links or more, per event a few links above their capacity.
 *
 * Versioned like NCCL's plugin tables: nw_replay_version() names the ABI of
 * the functions below; placement.replay refuses a library of another version.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NW_REPLAY_API __attribute__((visibility("default")))
#define NW_REPLAY_ABI 2

enum { NW_REPLAY_EINVAL = -1, NW_REPLAY_ENOMEM = -2 };

NW_REPLAY_API int nw_replay_version(void) { return NW_REPLAY_ABI; }

/* Walk `n` jobs in order with `budget` GPUs: job i is kept when size[i] <= the
 * GPUs the kept jobs before it left. `on[i]` (0 or 1) says whether job i holds
 * GPUs now; it is overwritten with whether it is kept. The positions whose
 * flag changed are written to `flips` (room for n, ascending).
 *
 * Returns the number of flips, or NW_REPLAY_EINVAL for a negative count or
 * budget, a missing array, or a size below 1.
 */
NW_REPLAY_API int nw_las_walk(int n, const int32_t *size, uint8_t *on, int64_t budget, int32_t *flips)
{
    if (n < 0 || budget < 0 || (n > 0 && (!size || !on || !flips)))
        return NW_REPLAY_EINVAL;
    for (int i = 0; i < n; i++)
        if (size[i] < 1)
            return NW_REPLAY_EINVAL; /* before any flag is touched */
    int nflips = 0;
    for (int i = 0; i < n; i++) {
        uint8_t keep = size[i] <= budget;
        if (keep)
            budget -= size[i];
        if (keep != on[i]) {
            on[i] = keep;
            flips[nflips++] = i;
        }
    }
    return nflips;
}

/* ---- the overloaded-link metric (Replay._overload) ------------------------------------------------------------------
 *
 * A table of the running jobs on each link, for the metric's incremental update: per link its users in the order they
 * joined (a doubly linked list through a pool of entries, so a user leaves in O(1) and the others keep their order),
 * their demands summed as they come and go (the same additions and subtractions, in the same order, as the Python
 * table in placement/replay.py, so the very same floats), the link's overloaded arcs and their total. A job joins with
 * its links and demands and gets one handle per link; it leaves with those handles. Links touched since the last
 * collect are listed once each, in the order first touched; nw_ov_collect hands back those Python must look at (two
 * users or more, demand above or within 1e-6 of the limit) and settles the others (no arcs; a link without users is
 * forgotten, so its next user starts a fresh sum). Python decides those links (its sum() when near the limit, its
 * cache of answers) and settles them with nw_ov_settle; on a cache miss nw_ov_arcs counts the arcs of the users'
 * unified circle in which their summed demand exceeds the limit, as placement.cassini.summed_demand computes it
 * (numpy's remainder, the rows added in the users' order), to the last bit.
 */
typedef struct {
    int32_t link, slot, prev, next; /* link < 0: free (next: the next free entry) */
    double rate;
} ov_user_t;

typedef struct {
    int32_t nlinks, ntouched, epoch, nusers, free_user, nslots;
    double *limit, *load;
    int64_t *arcs, total;
    int32_t *count, *head, *tail, *stamp, *touched;
    uint8_t *present;
    ov_user_t *user;
    double *period, *compute, *ready; /* per slot */
    double *scratch;                  /* nscratch doubles, for nw_ov_arcs */
    int32_t nscratch;
} ov_table_t;

NW_REPLAY_API void nw_ov_free(void *table)
{
    ov_table_t *t = table;
    if (!t)
        return;
    free(t->limit), free(t->load), free(t->arcs), free(t->count), free(t->head), free(t->tail), free(t->stamp);
    free(t->touched), free(t->present), free(t->user), free(t->period), free(t->compute), free(t->ready), free(t->scratch);
    free(t);
}

/* A table for `nlinks` links whose users overload link l above limit[l] (copied); NULL for a bad argument or no memory. */
NW_REPLAY_API void *nw_ov_new(int32_t nlinks, const double *limit)
{
    if (nlinks < 0 || (nlinks > 0 && !limit))
        return NULL;
    ov_table_t *t = calloc(1, sizeof(*t));
    if (!t)
        return NULL;
    size_t n = nlinks ? (size_t)nlinks : 1;
    t->nlinks = nlinks;
    t->epoch = 1;
    t->free_user = -1;
    t->limit = malloc(n * sizeof(double)), t->load = calloc(n, sizeof(double)), t->arcs = calloc(n, sizeof(int64_t));
    t->count = calloc(n, sizeof(int32_t)), t->head = malloc(n * sizeof(int32_t)), t->tail = malloc(n * sizeof(int32_t));
    t->stamp = calloc(n, sizeof(int32_t)), t->touched = malloc(n * sizeof(int32_t)), t->present = calloc(n, 1);
    if (!t->limit || !t->load || !t->arcs || !t->count || !t->head || !t->tail || !t->stamp || !t->touched || !t->present) {
        nw_ov_free(t);
        return NULL;
    }
    for (int32_t l = 0; l < nlinks; l++)
        t->limit[l] = limit[l], t->head[l] = t->tail[l] = -1;
    return t;
}

static int ov_grow(void **p, int32_t *cap, int32_t need, size_t size)
{
    if (need <= *cap)
        return 0;
    int64_t room = *cap ? 2 * (int64_t)*cap : 64;
    while (room < need)
        room *= 2;
    if (room > INT32_MAX)
        room = INT32_MAX;
    void *q = realloc(*p, (size_t)room * size);
    if (!q)
        return NW_REPLAY_ENOMEM;
    *p = q;
    *cap = (int32_t)room;
    return 0;
}

static void ov_touch(ov_table_t *t, int32_t l)
{
    if (t->stamp[l] != t->epoch) {
        t->stamp[l] = t->epoch;
        t->touched[t->ntouched++] = l;
    }
}

/* Job `slot` (its period, compute time and the start of its first iteration, for nw_ov_arcs) joins links[0..n) with
 * demands rates[0..n); handles[i] (room for n) is its entry on links[i]. Returns 0, NW_REPLAY_EINVAL (a link out of
 * range, a negative slot or count, a missing array) or NW_REPLAY_ENOMEM, with the table unchanged on an error. */
NW_REPLAY_API int nw_ov_join(void *table, int32_t slot, double period_s, double compute_s, double ready, int32_t n,
                             const int32_t *links, const double *rates, int32_t *handles)
{
    ov_table_t *t = table;
    if (!t || slot < 0 || slot == INT32_MAX || n < 0 || (n > 0 && (!links || !rates || !handles)))
        return NW_REPLAY_EINVAL;
    for (int32_t i = 0; i < n; i++)
        if (links[i] < 0 || links[i] >= t->nlinks)
            return NW_REPLAY_EINVAL;
    int32_t spare = 0;
    for (int32_t u = t->free_user; u >= 0 && spare < n; u = t->user[u].next)
        spare++;
    if (spare < n) { /* more entries, chained onto the free list */
        int32_t used = t->nusers, cap = t->nusers;
        if ((int64_t)used + (n - spare) > INT32_MAX || ov_grow((void **)&t->user, &cap, used + (n - spare), sizeof(ov_user_t)))
            return NW_REPLAY_ENOMEM;
        for (int32_t u = cap - 1; u >= used; u--)
            t->user[u].link = -1, t->user[u].next = t->free_user, t->free_user = u;
        t->nusers = cap;
    }
    if (slot >= t->nslots) { /* the per-slot arrays, all three grown before nslots says so */
        int32_t cap = t->nslots;
        double **arr[3] = {&t->period, &t->compute, &t->ready};
        for (int k = 0; k < 3; k++) {
            cap = t->nslots;
            if (ov_grow((void **)arr[k], &cap, slot + 1, sizeof(double)))
                return NW_REPLAY_ENOMEM;
        }
        t->nslots = cap;
    }
    t->period[slot] = period_s, t->compute[slot] = compute_s, t->ready[slot] = ready;
    for (int32_t i = 0; i < n; i++) {
        int32_t u = t->free_user, l = links[i];
        ov_user_t *e = &t->user[u];
        t->free_user = e->next;
        e->link = l, e->slot = slot, e->rate = rates[i], e->prev = t->tail[l], e->next = -1;
        if (t->tail[l] >= 0)
            t->user[t->tail[l]].next = u;
        else
            t->head[l] = u;
        t->tail[l] = u;
        t->count[l]++;
        if (t->present[l])
            t->load[l] += rates[i];
        else
            t->present[l] = 1, t->load[l] = rates[i];
        ov_touch(t, l);
        handles[i] = u;
    }
    return 0;
}

/* The job with entries handles[0..n) (as nw_ov_join gave them) leaves its links, in that order. Returns 0, or
 * NW_REPLAY_EINVAL (a handle out of range, free or given twice) with the table unchanged. */
NW_REPLAY_API int nw_ov_leave(void *table, int32_t n, const int32_t *handles)
{
    ov_table_t *t = table;
    if (!t || n < 0 || (n > 0 && !handles))
        return NW_REPLAY_EINVAL;
    int32_t bad = -1;
    for (int32_t i = 0; i < n && bad < 0; i++) { /* mark each entry (its link negated) to find a repeated one */
        int32_t u = handles[i];
        if (u < 0 || u >= t->nusers || t->user[u].link < 0)
            bad = i;
        else
            t->user[u].link = -1 - t->user[u].link;
    }
    for (int32_t i = 0; i < (bad < 0 ? n : bad); i++)
        t->user[handles[i]].link = -1 - t->user[handles[i]].link;
    if (bad >= 0)
        return NW_REPLAY_EINVAL;
    for (int32_t i = 0; i < n; i++) {
        int32_t u = handles[i];
        ov_user_t *e = &t->user[u];
        int32_t l = e->link;
        if (e->prev >= 0)
            t->user[e->prev].next = e->next;
        else
            t->head[l] = e->next;
        if (e->next >= 0)
            t->user[e->next].prev = e->prev;
        else
            t->tail[l] = e->prev;
        t->count[l]--;
        t->load[l] -= e->rate;
        ov_touch(t, l);
        e->link = -1, e->next = t->free_user, t->free_user = u;
    }
    return 0;
}

static void ov_set_arcs(ov_table_t *t, int32_t l, int64_t arcs)
{
    t->total += arcs - t->arcs[l];
    t->arcs[l] = arcs;
}

/* The links touched since the last collect, in the order first touched, that Python decides: two users or more and a
 * summed demand above the limit or within 1e-6 of it (every one with two users or more when `every_shared`), written to
 * out (room for every link). The others get no arcs; a link without users is forgotten. Returns their number. */
NW_REPLAY_API int32_t nw_ov_collect(void *table, int every_shared, int32_t *out)
{
    ov_table_t *t = table;
    if (!t || !out)
        return NW_REPLAY_EINVAL;
    int32_t m = 0;
    for (int32_t i = 0; i < t->ntouched; i++) {
        int32_t l = t->touched[i];
        if (t->count[l] >= 2) {
            double load = t->load[l], limit = t->limit[l];
            if (every_shared || fabs(load - limit) <= 1e-6 * limit || load > limit) {
                out[m++] = l;
                continue;
            }
        } else if (t->count[l] == 0) {
            t->present[l] = 0, t->load[l] = 0.0;
        }
        ov_set_arcs(t, l, 0);
    }
    t->ntouched = 0;
    if (++t->epoch == INT32_MAX) { /* stamps restart */
        memset(t->stamp, 0, (size_t)t->nlinks * sizeof(int32_t));
        t->epoch = 1;
    }
    return m;
}

/* Link l's users in the order they joined: their slots and demands (room for `room`); returns their number (all of them,
 * also when more than room), or NW_REPLAY_EINVAL. */
NW_REPLAY_API int32_t nw_ov_users(void *table, int32_t l, int32_t room, int32_t *slots, double *rates)
{
    ov_table_t *t = table;
    if (!t || l < 0 || l >= t->nlinks || room < 0 || (room > 0 && (!slots || !rates)))
        return NW_REPLAY_EINVAL;
    int32_t k = 0;
    for (int32_t u = t->head[l]; u >= 0; u = t->user[u].next, k++)
        if (k < room)
            slots[k] = t->user[u].slot, rates[k] = t->user[u].rate;
    return k;
}

/* Link l's summed demand as kept (NaN for a link out of range). */
NW_REPLAY_API double nw_ov_load(void *table, int32_t l)
{
    ov_table_t *t = table;
    return t && l >= 0 && l < t->nlinks ? t->load[l] : NAN;
}

/* Replace link l's summed demand (by a fresh sum, near the limit). Returns 0 or NW_REPLAY_EINVAL. */
NW_REPLAY_API int nw_ov_set_load(void *table, int32_t l, double load)
{
    ov_table_t *t = table;
    if (!t || l < 0 || l >= t->nlinks)
        return NW_REPLAY_EINVAL;
    t->load[l] = load;
    return 0;
}

/* Settle link l (one nw_ov_collect handed back): its overloaded arcs. Returns 0 or NW_REPLAY_EINVAL. */
NW_REPLAY_API int nw_ov_settle(void *table, int32_t l, int64_t arcs)
{
    ov_table_t *t = table;
    if (!t || l < 0 || l >= t->nlinks || arcs < 0)
        return NW_REPLAY_EINVAL;
    ov_set_arcs(t, l, arcs);
    return 0;
}

/* The overloaded arcs summed over all links (-1 without a table). */
NW_REPLAY_API int64_t nw_ov_total(void *table)
{
    ov_table_t *t = table;
    return t ? t->total : -1;
}

/* placement.cassini.effective_period: the perimeter over the period's whole number of turns (Python's round: half to
 * even, as nearbyint in the default rounding mode), at least one. */
static double ov_effective_period(double period, double perimeter)
{
    double turns = nearbyint(perimeter / period);
    return perimeter / (turns < 1.0 ? 1.0 : turns);
}

/* placement.cassini.unified_perimeter with its defaults (tolerance 0.02, at most 8 times the longest period). */
static double ov_unified_perimeter(int32_t n, const double *period)
{
    double longest = 0.0;
    int any = 0;
    for (int32_t j = 0; j < n; j++)
        if (period[j] > 0 && (!any || period[j] > longest))
            longest = period[j], any = 1;
    if (!any)
        return 0.0;
    for (int m = 1; m <= 8; m++) {
        double perimeter = (double)m * longest;
        int all = 1;
        for (int32_t j = 0; j < n && all; j++)
            if (period[j] > 0)
                all = fabs(period[j] - ov_effective_period(period[j], perimeter)) <= 0.02 * period[j];
        if (all)
            return perimeter;
    }
    return 8.0 * longest;
}

/* numpy's remainder: fmod (exact), moved into [0, period) for a positive period. */
static double ov_remainder(double a, double period)
{
    double phase = fmod(a, period);
    if (phase != 0.0) {
        if ((period < 0) != (phase < 0))
            phase += period;
    } else {
        phase = copysign(0.0, period);
    }
    return phase;
}

/* Whether arc phase `a - shift` (a: the arc's middle) is in the communication phase: ov_remainder(a, period) >= start.
 * fmod costs tens of nanoseconds (a loop over the exponents between a and period), so the remainder is first estimated:
 * r = a - trunc(a / period) * period is within 2^-52 (|a| + period) of fmod's exact one when the quotient is fmod's; a
 * quotient one off puts r within that of 0 or of +-period. Away from those and from `start` by eps = 2^-48 (|a| + period)
 * (16 times the error, and the rounding of r + period), r decides as the exact remainder would; else fmod decides. */
static int ov_up(double a, double period, double inverse, double start)
{
    double q = a * inverse, eps = 0x1p-48 * (fabs(a) + period);
    if (fabs(q) < 0x1p40) {
        double r = a - trunc(q) * period;
        if (a >= 0) {
            if (r > eps && r < period - eps && fabs(r - start) > eps)
                return r > start;
        } else if (r < -eps && r > eps - period && fabs(r + period - start) > eps) {
            return r + period > start; /* numpy's phase is r + period, rounded: on the same side of start */
        }
    }
    return ov_remainder(a, period) >= start;
}

/* The count of arcs whose summed demand exceeds `limit`; `sum` has room for `buckets`. Jobs outer, arcs inner: each
 * arc's sum still adds the jobs in order (the first one's demand, then each next), as numpy's sum over axis 0 does. */
static int64_t ov_arcs(int32_t n, const double *period_s, const double *compute_s, const double *shift, const double *rate,
                       double limit, int32_t buckets, double *sum)
{
    double perimeter = ov_unified_perimeter(n, period_s), width = perimeter / buckets;
    for (int32_t j = 0; j < n; j++) {
        double period = ov_effective_period(period_s[j], perimeter), start = compute_s[j] * period / period_s[j];
        double inverse = 1.0 / period;
        for (int32_t b = 0; b < buckets; b++) {
            double v = rate[j] * (ov_up(((double)b + 0.5) * width - shift[j], period, inverse, start) ? 1.0 : 0.0);
            sum[b] = j ? sum[b] + v : v;
        }
    }
    int64_t over = 0;
    for (int32_t b = 0; b < buckets; b++)
        over += sum[b] > limit;
    return over;
}

/* The arcs (of `buckets`) of the jobs' unified circle in which their summed demand exceeds `limit`: job j (period
 * period_s[j], computing for compute_s[j] before communicating at rate[j], its first iteration starting at shift[j]),
 * summed as placement.cassini.summed_demand sums (each arc's phase by numpy's remainder, the jobs added in order), so
 * the same floats. `load` (room for buckets, or NULL) gets the summed demand per arc. Every period must be positive, and
 * there must be two arcs or more (numpy sums the rows of a single arc pairwise, in another order). Returns the count,
 * NW_REPLAY_EINVAL or NW_REPLAY_ENOMEM. */
NW_REPLAY_API int64_t nw_overload_arcs(int32_t n, const double *period_s, const double *compute_s, const double *shift,
                                       const double *rate, double limit, int32_t buckets, double *load)
{
    if (n < 1 || buckets < 2 || !period_s || !compute_s || !shift || !rate)
        return NW_REPLAY_EINVAL;
    for (int32_t j = 0; j < n; j++)
        if (!(period_s[j] > 0))
            return NW_REPLAY_EINVAL;
    double *sum = load ? load : malloc((size_t)buckets * sizeof(double));
    if (!sum)
        return NW_REPLAY_ENOMEM;
    int64_t over = ov_arcs(n, period_s, compute_s, shift, rate, limit, buckets, sum);
    if (!load)
        free(sum);
    return over;
}

/* nw_overload_arcs for the users of link l, in the order they joined, against its limit. */
NW_REPLAY_API int64_t nw_ov_arcs(void *table, int32_t l, int32_t buckets)
{
    ov_table_t *t = table;
    if (!t || l < 0 || l >= t->nlinks || t->count[l] < 1 || buckets < 2)
        return NW_REPLAY_EINVAL;
    int32_t n = t->count[l];
    if ((int64_t)4 * n + buckets > INT32_MAX || ov_grow((void **)&t->scratch, &t->nscratch, 4 * n + buckets, sizeof(double)))
        return NW_REPLAY_ENOMEM;
    double *period = t->scratch, *compute = period + n, *shift = compute + n, *rate = shift + n, *sum = rate + n;
    int32_t k = 0;
    for (int32_t u = t->head[l]; u >= 0; u = t->user[u].next, k++) {
        int32_t s = t->user[u].slot;
        period[k] = t->period[s], compute[k] = t->compute[s], shift[k] = t->ready[s], rate[k] = t->user[u].rate;
    }
    for (int32_t j = 0; j < n; j++)
        if (!(period[j] > 0))
            return NW_REPLAY_EINVAL;
    return ov_arcs(n, period, compute, shift, rate, t->limit[l], buckets, sum);
}
