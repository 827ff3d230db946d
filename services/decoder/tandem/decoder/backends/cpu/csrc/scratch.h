/* The kernels' per-thread scratch: a buffer that grows to the largest size asked of it and is kept
 * for the next call, so a step allocates nothing once the largest step has run. */
#ifndef TANDEM_NATIVE_SCRATCH_H
#define TANDEM_NATIVE_SCRATCH_H

#include <stddef.h>
#include <stdlib.h>

typedef struct {
    void *data;
    size_t bytes;
} ThreadBuffer;

/* At least `bytes` of `s` (its contents not kept when it grows), or NULL without memory. */
static inline void *buffer_of_at_least(ThreadBuffer *s, size_t bytes) {
    if (bytes > s->bytes) {
        void *grown = realloc(s->data, bytes);
        if (grown == NULL) return NULL;
        s->data = grown;
        s->bytes = bytes;
    }
    return s->data;
}

#endif
