/* The run finder of attention.c and attention_tiles.c (runs.h).
 *
 * Row s continues the run before it when its length is one more and its blocks are the run's first
 * row's (a verification step's or a prefill's rows; the engine gives each its own copy of the
 * sequence's table), up to max_rows rows a run. Grows a per-thread buffer. */
#include <stdlib.h>
#include <string.h>

#include "runs.h"

static __thread int32_t *run_rows = NULL;
static __thread int64_t run_rows_size = 0;

const int32_t *tandem_find_runs(const int32_t *block_tables, const int32_t *seq_lens, int64_t num_seqs,
                                int64_t max_blocks, int64_t block_size, int64_t max_rows) {
    if (num_seqs > run_rows_size) {
        int32_t *grown = realloc(run_rows, (size_t)num_seqs * sizeof(int32_t));
        if (grown == NULL) return NULL;
        run_rows = grown;
        run_rows_size = num_seqs;
    }
    int64_t first = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        run_rows[s] = 0;
        const int64_t blocks = (seq_lens[s] + block_size - 1) / block_size;
        if (s > 0 && s - first < max_rows && seq_lens[s] == seq_lens[s - 1] + 1 &&
            memcmp(block_tables + s * max_blocks, block_tables + first * max_blocks,
                   (size_t)blocks * sizeof(int32_t)) == 0) {
            run_rows[first]++;
        } else {
            first = s;
            run_rows[s] = 1;
        }
    }
    return run_rows;
}
