/* Which big blocks of a sandbox's Lua state are strings (private to core/sandbox*.c).
 * One VM instruction can compare a string or coerce it to a number in time proportional
 * to its length, with no hook in between, so the sandbox shortens its hook period while
 * long strings live (docs/sandbox.md, "Work inside one instruction"). Tables' big parts
 * need no such care, and counting them too would slow down policies that keep a large
 * array: blocks are therefore classified, a few instructions after they are allocated,
 * by LuaJIT's string header (checked once per state against a string of known length;
 * when it does not match, every big block counts as a string: slower, never unsafe). */
#ifndef RP_SANDBOX_BIG_H
#define RP_SANDBOX_BIG_H

#include "internal.h"

/* Blocks of at least 2^RP_BIG_SHIFT bytes are tracked, by size class k: blocks of
 * 2^(RP_BIG_SHIFT + k) .. 2^(RP_BIG_SHIFT + k + 1) - 1 bytes. */
#define RP_BIG_SHIFT 14
#define RP_BIG_CLASSES 48
#define RP_BIG_PENDING 32

typedef struct rp_big_blocks {
    rp_context *ctx; /* the set below lives in the context's memory, not the state's */
    /* blocks allocated since the last classification (their headers are not written
     * when the allocator hands them out) */
    void *pending[RP_BIG_PENDING];
    size_t pending_size[RP_BIG_PENDING];
    int num_pending;
    /* live big strings: an open-addressing set of their addresses (linear probing) */
    void **keys;
    size_t *sizes;
    size_t cap, count;
    int32_t live[RP_BIG_CLASSES];    /* live big strings per size class */
    int32_t unkeyed[RP_BIG_CLASSES]; /* counted with no room in the set: never uncounted */
    bool headers_known;              /* false: every big block counts as a string */
} rp_big_blocks;

/* The size class of a block, or -1 below 2^RP_BIG_SHIFT. */
int rp_big_class(size_t size);
/* A block of `size` >= 2^RP_BIG_SHIFT bytes was handed out at `p` (to classify later). */
void rp_big_added(rp_big_blocks *b, void *p, size_t size);
/* The block at `p` of `size` bytes was freed or moved. */
void rp_big_removed(rp_big_blocks *b, void *p, size_t size);
/* Read the pending blocks' headers: strings join the live set. */
void rp_big_classify(rp_big_blocks *b);
/* Is the block at `p` of `size` bytes a LuaJIT string (header and length agree)? */
bool rp_big_is_string(const void *p, size_t size);
/* The size class of the largest live big string, -1 if none. */
int rp_big_largest(const rp_big_blocks *b);
/* Free the set (after the state is closed). */
void rp_big_release(rp_big_blocks *b);

#endif
