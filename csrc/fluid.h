/* netweave: what csrc/fluid.c shares with csrc/fluid_model.c (the same library, libnetweave-fluid.so). */
#ifndef NW_FLUID_H
#define NW_FLUID_H

#include <stdint.h>

#define NW_FLUID_API __attribute__((visibility("default")))
#define NW_FLUID_ABI 3

enum { NW_FLUID_OK = 0, NW_FLUID_EINVAL = -1, NW_FLUID_ENOMEM = -2 };

/* numpy's sum of a[0..n) (np.add.reduce over a contiguous float64 array; below 8 terms Python's sum() too) */
double nw_fluid_pairwise_sum(const double *a, int n);

int nw_fluid_simulate_means(int n, const double *compute, const double *comm, const double *start, const double *own,
                            const unsigned char *watched, int iterations, int nlinks, const double *cap,
                            const int *jl_ptr, const int *jl_link, const double *jl_dem, const int *lu_ptr,
                            const int *lu_job, double *means, int *count, int64_t *stats);

#endif
