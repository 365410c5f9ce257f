/* Tracking which big blocks of a sandbox's state are strings (core/sandbox_big.h). */
#include "sandbox_big.h"

#include <string.h>

/* LuaJIT 2.1's GCstr with 64-bit GC references (GC64, x86-64): nextgc (8 bytes),
 * marked, gct, reserved, hashalg, sid (4), hash (4), len (4), then the bytes and a NUL.
 * The sandbox checks this layout against a real string when it starts. */
#define STR_GCT_OFFSET 9
#define STR_GCT 4 /* ~LJ_TSTR */
#define STR_LEN_OFFSET 20
#define STR_HEADER 24 /* sizeof(GCstr); the bytes and the NUL follow, rounded up to 4 */

int rp_big_class(size_t size)
{
    int k = -1;
    for (size >>= RP_BIG_SHIFT; size && k < RP_BIG_CLASSES - 1; size >>= 1) k++;
    return k;
}

bool rp_big_is_string(const void *p, size_t size)
{
    const unsigned char *b = p;
    uint32_t len;
    memcpy(&len, b + STR_LEN_OFFSET, sizeof len);
    return b[STR_GCT_OFFSET] == STR_GCT && STR_HEADER + (((size_t)len + 4) & ~(size_t)3) == size;
}

static size_t slot_of(const rp_big_blocks *b, const void *p)
{
    uint64_t h = (uint64_t)((uintptr_t)p >> 4) * 0x9E3779B97F4A7C15ULL;
    return (size_t)(h >> 32) & (b->cap - 1);
}

static bool grow(rp_big_blocks *b)
{
    size_t cap = b->cap ? b->cap * 2 : 64;
    void **keys = rp_calloc(b->ctx, cap, sizeof *keys);
    size_t *sizes = rp_calloc(b->ctx, cap, sizeof *sizes);
    if (!keys || !sizes) {
        rp_free(b->ctx, keys);
        rp_free(b->ctx, sizes);
        return false;
    }
    void **old_keys = b->keys;
    size_t *old_sizes = b->sizes, old_cap = b->cap;
    b->keys = keys;
    b->sizes = sizes;
    b->cap = cap;
    for (size_t i = 0; i < old_cap; i++)
        if (old_keys[i]) {
            size_t s = slot_of(b, old_keys[i]);
            while (b->keys[s]) s = (s + 1) & (cap - 1);
            b->keys[s] = old_keys[i];
            b->sizes[s] = old_sizes[i];
        }
    rp_free(b->ctx, old_keys);
    rp_free(b->ctx, old_sizes);
    return true;
}

/* Count a live big string; with no room to remember it, count it for good (its class
 * then keeps the hook period short: slower, never unsafe). */
static void add_string(rp_big_blocks *b, void *p, size_t size)
{
    int k = rp_big_class(size);
    if ((b->count + 1) * 2 > b->cap && !grow(b)) {
        b->unkeyed[k]++;
        return;
    }
    size_t s = slot_of(b, p);
    while (b->keys[s]) s = (s + 1) & (b->cap - 1);
    b->keys[s] = p;
    b->sizes[s] = size;
    b->count++;
    b->live[k]++;
}

/* Remove p from the set (backward-shift deletion keeps every probe chain intact). */
static void remove_string(rp_big_blocks *b, void *p)
{
    if (!b->cap) return;
    size_t s = slot_of(b, p);
    while (b->keys[s] && b->keys[s] != p) s = (s + 1) & (b->cap - 1);
    if (!b->keys[s]) return;
    b->live[rp_big_class(b->sizes[s])]--;
    b->count--;
    size_t hole = s;
    for (size_t j = (s + 1) & (b->cap - 1); b->keys[j]; j = (j + 1) & (b->cap - 1)) {
        size_t home = slot_of(b, b->keys[j]);
        /* move j into the hole unless its home lies cyclically in (hole, j] */
        bool stays = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
        if (!stays) {
            b->keys[hole] = b->keys[j];
            b->sizes[hole] = b->sizes[j];
            hole = j;
        }
    }
    b->keys[hole] = NULL;
    b->sizes[hole] = 0;
}

void rp_big_added(rp_big_blocks *b, void *p, size_t size)
{
    if (b->num_pending == RP_BIG_PENDING) {
        add_string(b, p, size); /* no room to wait for its header: assume a string */
        return;
    }
    b->pending[b->num_pending] = p;
    b->pending_size[b->num_pending] = size;
    b->num_pending++;
}

void rp_big_removed(rp_big_blocks *b, void *p, size_t size)
{
    (void)size;
    for (int i = 0; i < b->num_pending; i++)
        if (b->pending[i] == p) {
            b->num_pending--;
            b->pending[i] = b->pending[b->num_pending];
            b->pending_size[i] = b->pending_size[b->num_pending];
            return;
        }
    remove_string(b, p);
}

void rp_big_classify(rp_big_blocks *b)
{
    for (int i = 0; i < b->num_pending; i++)
        if (!b->headers_known || rp_big_is_string(b->pending[i], b->pending_size[i]))
            add_string(b, b->pending[i], b->pending_size[i]);
    b->num_pending = 0;
}

int rp_big_largest(const rp_big_blocks *b)
{
    for (int k = RP_BIG_CLASSES - 1; k >= 0; k--)
        if (b->live[k] > 0 || b->unkeyed[k] > 0) return k;
    return -1;
}

void rp_big_release(rp_big_blocks *b)
{
    rp_free(b->ctx, b->keys);
    rp_free(b->ctx, b->sizes);
    b->keys = NULL;
    b->sizes = NULL;
    b->cap = b->count = 0;
}
