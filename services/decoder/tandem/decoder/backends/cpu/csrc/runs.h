/* Runs of one sequence's consecutive positions in an attention step (runs.c): what attention.c's row
 * kernel and attention_tiles.c's tiled kernel both attend together. Its own file so that each of them
 * calls it and neither calls the other back (attention.c calls attention_tiles.c, only that way). */
#ifndef TANDEM_NATIVE_RUNS_H
#define TANDEM_NATIVE_RUNS_H

#include <stdint.h>

/* Rows of each run for the run's first row, 0 for the others, at most max_rows a run; NULL without
 * memory. The buffer is the calling thread's, valid until its next call. */
const int32_t *tandem_find_runs(const int32_t *block_tables, const int32_t *seq_lens, int64_t num_seqs,
                                int64_t max_blocks, int64_t block_size, int64_t max_rows);

#endif
