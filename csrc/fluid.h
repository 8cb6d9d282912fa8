/* netweave: what csrc/fluid.c shares with csrc/fluid_model.c (the same library, libnetweave-fluid.so). */
#ifndef NW_FLUID_H
#define NW_FLUID_H

#include <stdint.h>

#define NW_FLUID_API __attribute__((visibility("default")))
#define NW_FLUID_ABI 4

enum { NW_FLUID_OK = 0, NW_FLUID_EINVAL = -1, NW_FLUID_ENOMEM = -2 };

/* numpy's sum of a[0..n) (np.add.reduce over a contiguous float64 array; below 8 terms Python's sum() too) */
double nw_fluid_pairwise_sum(const double *a, int n);

int nw_fluid_simulate_means(int n, const double *compute, const double *comm, const double *start, const double *own,
                            const unsigned char *watched, int iterations, int nlinks, const double *cap,
                            const int *jl_ptr, const int *jl_link, const double *jl_dem, const int *lu_ptr,
                            const int *lu_job, double *means, int *count, int64_t *stats);

typedef struct nw_fm nw_fm; /* the incremental model (fluid_model.c) */
typedef struct nw_fw nw_fw; /* a thread that runs its updates (fluid_worker.c) */

int nw_fm_update(nw_fm *h, int n_gone, const int64_t *gone, int n_new, const int64_t *ident, const double *compute,
                 const double *comm, const double *start, const int64_t *link_ptr, const int64_t *link_id, const double *dem,
                 int64_t out_size, int64_t *out_serial, double *out_time, int64_t *out_n, int64_t *counters);

#endif
