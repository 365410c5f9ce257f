/* A growing text buffer for the library's generated documents (the cost breakdown's
 * JSON, the HTML report): printf-style appends that never fail midway; an allocation
 * failure marks the buffer and makes every later append a no-op, so a writer checks
 * once, at the end. Internal. */
#ifndef RP_TEXTBUF_H
#define RP_TEXTBUF_H

#include "internal.h"

#include <stdbool.h>
#include <stddef.h>

typedef struct text_buf {
    rp_context *ctx;
    char *data; /* NUL-terminated once anything was appended */
    size_t len, cap;
    bool failed; /* an allocation or a format failed: every later append is a no-op */
} text_buf;

void text_put(text_buf *b, const char *fmt, ...) RP_PRINTF(2, 3);

#endif
