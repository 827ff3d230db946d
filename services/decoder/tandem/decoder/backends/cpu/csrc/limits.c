/* limits.h's values as symbols of the library: backends/cpu/limits.py reads each by name with ctypes
 * when it loads a build, so the Python side never holds a copy that could drift from the C. */
#include <stdint.h>

#include "limits.h"

const int64_t tandem_max_head_dim = TANDEM_MAX_HEAD_DIM;
const int64_t tandem_max_group = TANDEM_MAX_GROUP;
const int64_t tandem_max_block_size = TANDEM_MAX_BLOCK_SIZE;
const int64_t tandem_max_row = TANDEM_MAX_ROW;
const int64_t tandem_tiled_head_dim = TANDEM_TILED_HEAD_DIM;
const int64_t tandem_prefill_max_context = TANDEM_PREFILL_MAX_CONTEXT;
