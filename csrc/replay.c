/* netweave: the inner loop of placement.replay's LAS policy, in C.
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
 * Versioned like NCCL's plugin tables: nw_replay_version() names the ABI of
 * the functions below; placement.replay refuses a library of another version.
 */
#include <stdint.h>

#define NW_REPLAY_API __attribute__((visibility("default")))
#define NW_REPLAY_ABI 1

enum { NW_REPLAY_EINVAL = -1 };

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
