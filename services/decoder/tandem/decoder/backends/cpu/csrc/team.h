/* This thread's share of a parallel region's work: the kernels split whole units (groups of outputs,
 * sets of groups) evenly over OpenMP's team, each thread a contiguous run, so a unit's sums never
 * depend on the number of threads. Outside a parallel region (or without OpenMP) one thread has all. */
#ifndef TANDEM_NATIVE_TEAM_H
#define TANDEM_NATIVE_TEAM_H

#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#endif

/* [*begin, *end): the calling thread's units of `total`. */
static inline void team_share(int64_t total, int64_t *begin, int64_t *end) {
    int threads = 1, me = 0;
#ifdef _OPENMP
    threads = omp_get_num_threads();
    me = omp_get_thread_num();
#endif
    *begin = total * me / threads;
    *end = total * (me + 1) / threads;
}

/* How many threads the next parallel region runs with (1 without OpenMP): a cost choice may use it,
 * never a sum's order (the team that runs may be smaller). */
static inline int team_size(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

#endif
