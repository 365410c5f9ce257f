/* Karmarkar-Karp (the largest differencing method) as verl computes it, with a repair
 * pass for size caps and item limits (docs/primitives.md). */
#include "partition_internal.h"

#include <math.h>
#include <string.h>

/* ---- Karmarkar-Karp (largest differencing method), as verl computes it ----
 *
 * verl keeps partial solutions ("states") of k sets in a Python heapq. A set holds an
 * item list (insertion order) and its sum; sets compare by (sum, item count, item
 * list), and a state sorts its sets in descending order. A state pops first when its
 * spread (largest sum - smallest) is larger, or, at equal spread, when its largest
 * set compares larger. Merging pairs set i of the first popped state with set k-1-i
 * of the second. We reproduce all of it: item lists are linked lists (O(1) merge),
 * list comparison needs only the first item (items are unique, so two non-empty lists
 * differ there; two empty sets are interchangeable), and the heap is heapq's algorithm
 * step for step, so even full ties resolve as in Python.
 *
 * States made of one item are kept implicit (the item alone) until they are popped
 * first, which keeps memory near O(n + k * live merged states). */

typedef struct kk_set {
    double sum;
    int32_t count;
    int32_t head, tail; /* item list through kk->next; -1 when empty */
} kk_set;

typedef struct kk_ref {
    int32_t state; /* >= 0: a state in the pool; -1: the singleton `item` */
    int32_t item;
} kk_ref;

typedef struct kk {
    rp_context *ctx;
    const double *w;
    int32_t k;
    int32_t *next;       /* [n] item lists */
    kk_set *pool;        /* [pool_cap * k] */
    int32_t pool_cap;
    int32_t *free_list;  /* [pool_cap] */
    int32_t num_free;
    int32_t pool_used;
    kk_set *sort_tmp;    /* [k] */
    kk_ref *heap;
    int32_t heap_size;
} kk;

static inline kk_set kk_top(const kk *s, kk_ref r)
{
    if (r.state < 0) return (kk_set){s->w[r.item], 1, r.item, r.item};
    return s->pool[(size_t)r.state * s->k];
}

static inline double kk_spread(const kk *s, kk_ref r)
{
    if (r.state < 0) return s->k > 1 ? s->w[r.item] : 0.0;
    const kk_set *sets = s->pool + (size_t)r.state * s->k;
    return sets[0].sum - sets[s->k - 1].sum;
}

/* verl's Set.__lt__. */
static inline bool kk_set_lt(const kk_set *a, const kk_set *b)
{
    if (a->sum != b->sum) return a->sum < b->sum;
    if (a->count != b->count) return a->count < b->count;
    if (a->count == 0) return false;
    return a->head < b->head;
}

/* verl's State.__lt__: true when `a` should pop before `b`. */
static inline bool kk_state_lt(const kk *s, kk_ref a, kk_ref b)
{
    double sa = kk_spread(s, a), sb = kk_spread(s, b);
    if (sa != sb) return sa > sb;
    kk_set ta = kk_top(s, a), tb = kk_top(s, b);
    return kk_set_lt(&tb, &ta);
}

/* heapq._siftdown */
static void kk_siftdown(kk *s, int32_t startpos, int32_t pos)
{
    kk_ref item = s->heap[pos];
    while (pos > startpos) {
        int32_t parentpos = (pos - 1) >> 1;
        kk_ref parent = s->heap[parentpos];
        if (kk_state_lt(s, item, parent)) {
            s->heap[pos] = parent;
            pos = parentpos;
            continue;
        }
        break;
    }
    s->heap[pos] = item;
}

/* heapq._siftup: down to a leaf along the smaller children, then back up. */
static void kk_siftup(kk *s, int32_t pos)
{
    int32_t endpos = s->heap_size, startpos = pos;
    kk_ref item = s->heap[pos];
    int32_t childpos = 2 * pos + 1;
    while (childpos < endpos) {
        int32_t rightpos = childpos + 1;
        if (rightpos < endpos && !kk_state_lt(s, s->heap[childpos], s->heap[rightpos]))
            childpos = rightpos;
        s->heap[pos] = s->heap[childpos];
        pos = childpos;
        childpos = 2 * pos + 1;
    }
    s->heap[pos] = item;
    kk_siftdown(s, startpos, pos);
}

static void kk_push(kk *s, kk_ref r)
{
    s->heap[s->heap_size++] = r;
    kk_siftdown(s, 0, s->heap_size - 1);
}

static kk_ref kk_pop(kk *s)
{
    kk_ref last = s->heap[--s->heap_size];
    if (s->heap_size == 0) return last;
    kk_ref top = s->heap[0];
    s->heap[0] = last;
    kk_siftup(s, 0);
    return top;
}

/* A fresh state from the pool (grown by doubling). -1 when out of memory. */
static int32_t kk_new_state(kk *s)
{
    if (s->num_free > 0) return s->free_list[--s->num_free];
    if (s->pool_used == s->pool_cap) {
        int64_t cap = s->pool_cap ? 2 * (int64_t)s->pool_cap : 16, sets;
        if (cap > INT32_MAX) cap = INT32_MAX;
        if (cap <= s->pool_cap || rp_mul_overflow(cap, s->k, &sets)) return -1;
        kk_set *pool = rp_realloc(s->ctx, s->pool, (size_t)sets * sizeof *pool);
        if (!pool) return -1;
        s->pool = pool;
        int32_t *fl = rp_realloc(s->ctx, s->free_list, (size_t)cap * sizeof *fl);
        if (!fl) return -1;
        s->free_list = fl;
        s->pool_cap = (int32_t)cap;
    }
    return s->pool_used++;
}

/* Sort a state's sets in descending order (verl: sorted(sets, reverse=True); only
 * empty sets compare equal, and they are interchangeable). Merge sort, O(k log k). */
static void kk_sort_sets(kk *s, kk_set *sets)
{
    int32_t k = s->k;
    kk_set *src = sets, *dst = s->sort_tmp;
    for (int32_t width = 1; width < k; width *= 2) {
        for (int32_t lo = 0; lo < k; lo += 2 * width) {
            int32_t mid = lo + width < k ? lo + width : k;
            int32_t hi = lo + 2 * width < k ? lo + 2 * width : k;
            int32_t i = lo, j = mid, o = lo;
            while (i < mid && j < hi)
                dst[o++] = kk_set_lt(&src[i], &src[j]) ? src[j++] : src[i++];
            while (i < mid) dst[o++] = src[i++];
            while (j < hi) dst[o++] = src[j++];
        }
        kk_set *t = src;
        src = dst;
        dst = t;
    }
    if (src != sets) memcpy(sets, src, (size_t)k * sizeof *sets);
}

static void kk_set_append(kk *s, kk_set *dst, const kk_set *src)
{
    if (src->count == 0) return;
    if (dst->count == 0) {
        dst->head = src->head;
    } else {
        s->next[dst->tail] = src->head;
    }
    dst->tail = src->tail;
    dst->count += src->count;
    dst->sum += src->sum;
}

/* verl's State.merge: `a` popped first absorbs `b`. Returns the merged state, or a
 * negative state on allocation failure. */
static int32_t kk_merge(kk *s, kk_ref a, kk_ref b)
{
    int32_t k = s->k, id = a.state;
    if (id < 0) {
        id = kk_new_state(s);
        if (id < 0) return -1;
        kk_set *sets = s->pool + (size_t)id * k;
        sets[0] = kk_top(s, a);
        s->next[a.item] = -1;
        for (int32_t i = 1; i < k; i++) sets[i] = (kk_set){0, 0, -1, -1};
    }
    kk_set *sets = s->pool + (size_t)id * k;
    if (b.state < 0) {
        kk_set one = kk_top(s, b);
        s->next[b.item] = -1;
        kk_set_append(s, &sets[k - 1], &one);
    } else {
        const kk_set *other = s->pool + (size_t)b.state * k;
        for (int32_t i = 0; i < k; i++) kk_set_append(s, &sets[i], &other[k - 1 - i]);
        s->free_list[s->num_free++] = b.state;
    }
    kk_sort_sets(s, sets);
    return id;
}

/* Aggregates of a partition per part. */
static void part_sums(const double *w, const double *size, const int32_t *part, int32_t n, int32_t k,
                      double *load, double *psize, int32_t *pcount)
{
    for (int32_t p = 0; p < k; p++) {
        load[p] = 0;
        psize[p] = 0;
        pcount[p] = 0;
    }
    for (int32_t i = 0; i < n; i++) {
        load[part[i]] += w[i];
        if (size) psize[part[i]] += size[i];
        pcount[part[i]]++;
    }
}

static inline bool over_size(const limits_view *lv, const double *psize, int32_t p)
{
    return lv->size && psize[p] > part_cap_of(lv, p);
}

static inline bool over_count(const limits_view *lv, const int32_t *pcount, int32_t p)
{
    return lv->max_items > 0 && pcount[p] > lv->max_items;
}

/* Default-mode repair: move items out of parts over a limit (see primitives.h).
 * Scratch: key[n] doubles, list/perm/tmp[n] ints. */
static rp_status kk_repair_moves(const double *w, int32_t n, int32_t k, const limits_view *lv,
                                 int32_t *part, double *load, double *psize, int32_t *pcount,
                                 double *key, int32_t *list, int32_t *perm, int32_t *tmp,
                                 rp_error *err)
{
    for (int32_t p = 0; p < k; p++) {
        for (int phase = 0; phase < 2; phase++) {
            bool by_size = phase == 0;
            if (by_size ? !over_size(lv, psize, p) : !over_count(lv, pcount, p)) continue;
            int32_t m = 0;
            for (int32_t i = 0; i < n; i++)
                if (part[i] == p) {
                    list[m] = i;
                    key[m] = by_size ? lv->size[i] : w[i];
                    m++;
                }
            /* Size: largest first; item limit: lightest first. Ties: lower index. */
            part_sort_perm(key, m, by_size, perm, tmp);
            int32_t stuck = -1;
            for (int32_t j = 0; j < m; j++) {
                if (by_size ? !over_size(lv, psize, p) : !over_count(lv, pcount, p)) break;
                int32_t item = list[perm[j]];
                if (by_size && lv->size[item] <= 0) continue;
                int32_t best = -1;
                for (int32_t q = 0; q < k; q++) {
                    if (q == p || over_size(lv, psize, q) || over_count(lv, pcount, q)) continue;
                    if (!part_fits(lv, psize, pcount, q, item)) continue;
                    if (best < 0 || load[q] < load[best]) best = q;
                }
                if (best < 0) {
                    if (stuck < 0) stuck = item;
                    continue;
                }
                part[item] = best;
                load[p] -= w[item];
                load[best] += w[item];
                if (lv->size) {
                    psize[p] -= lv->size[item];
                    psize[best] += lv->size[item];
                }
                pcount[p]--;
                pcount[best]++;
            }
            if (by_size && over_size(lv, psize, p))
                return part_item_error(err, RP_ERANGE, stuck,
                                  "kk: part %d holds size %g, over its cap %g, and item %d (size %g) "
                                  "fits in no other part",
                                  p, psize[p], part_cap_of(lv, p), stuck, stuck >= 0 ? lv->size[stuck] : 0.0);
            if (!by_size && over_count(lv, pcount, p))
                return part_item_error(err, RP_ERANGE, stuck,
                                  "kk: part %d holds %d items, over the limit of %d, and item %d fits "
                                  "in no other part",
                                  p, pcount[p], lv->max_items, stuck);
        }
    }
    return RP_OK;
}

/* Equal-size repair: swap a large item of an over-cap part for a smaller one of
 * another part, keeping every part's item count. At most n swaps in all. */
static rp_status kk_repair_swaps(const double *w, int32_t n, int32_t k, const limits_view *lv,
                                 int32_t *part, double *load, double *psize, double *key,
                                 int32_t *list, int32_t *perm, int32_t *tmp, int32_t *partner,
                                 rp_error *err)
{
    int64_t budget = n;
    for (int32_t p = 0; p < k; p++) {
        while (over_size(lv, psize, p)) {
            if (budget-- == 0)
                return rp_fail(err, RP_ERANGE, "kk: part %d is still over its size cap after %d swaps",
                               p, n);
            int32_t m = 0;
            for (int32_t i = 0; i < n; i++)
                if (part[i] == p) {
                    list[m] = i;
                    key[m] = lv->size[i];
                    m++;
                }
            part_sort_perm(key, m, true, perm, tmp);
            int32_t a = -1, b = -1;
            for (int32_t j = 0; j < m && b < 0; j++) {
                a = list[perm[j]];
                double sa = lv->size[a];
                /* Best partner in each other part: valid swap, closest weight. */
                for (int32_t q = 0; q < k; q++) partner[q] = -1;
                for (int32_t i = 0; i < n; i++) {
                    int32_t q = part[i];
                    if (q == p || over_size(lv, psize, q)) continue;
                    double si = lv->size[i];
                    if (!(si < sa) || psize[q] - si + sa > part_cap_of(lv, q)) continue;
                    int32_t cur = partner[q];
                    if (cur < 0 || fabs(w[a] - w[i]) < fabs(w[a] - w[cur])) partner[q] = i;
                }
                /* The least-loaded part that has a partner. */
                int32_t best_q = -1;
                for (int32_t q = 0; q < k; q++)
                    if (partner[q] >= 0 && (best_q < 0 || load[q] < load[best_q])) best_q = q;
                if (best_q >= 0) b = partner[best_q];
            }
            if (b < 0) {
                int32_t biggest = m > 0 ? list[perm[0]] : -1;
                return part_item_error(err, RP_ERANGE, biggest,
                                  "kk: part %d holds size %g, over its cap %g, and no swap of its items "
                                  "(largest: item %d) with a smaller item of another part fits",
                                  p, psize[p], part_cap_of(lv, p), biggest);
            }
            int32_t q = part[b];
            part[a] = q;
            part[b] = p;
            load[p] += w[b] - w[a];
            load[q] += w[a] - w[b];
            psize[p] += lv->size[b] - lv->size[a];
            psize[q] += lv->size[a] - lv->size[b];
        }
    }
    return RP_OK;
}

rp_status rp_partition_kk(rp_context *ctx, const double *weight, int32_t n, int32_t k,
                          bool equal_size, const rp_part_limits *limits, int32_t *part,
                          rp_error *err)
{
    static const char fn[] = "kk";
    limits_view lv;
    rp_status st = part_check_shape(fn, n, k, part, err);
    if (st == RP_OK) st = part_check_weights(fn, "weight", weight, n, err);
    if (st == RP_OK) st = part_check_limits(fn, limits, n, k, &lv, err);
    if (st != RP_OK) return st;
    if (lv.speed)
        return rp_fail(err, RP_EINVAL, "kk: part speeds are not supported (differencing assumes "
                                       "identical parts); use LPT");
    if (equal_size && n % k != 0)
        return rp_fail(err, RP_EINVAL, "kk: equal_size needs the %d items to divide into %d parts", n, k);
    if (equal_size && lv.max_items > 0 && lv.max_items < n / k)
        return rp_fail(err, RP_ERANGE, "kk: equal_size puts %d items in each part, over the limit of %d",
                       n / k, lv.max_items);
    if (n == 0) return RP_OK;

    size_t nz = (size_t)n, kz = (size_t)k;
    int32_t num_states = equal_size ? n / k : n;
    kk s = {.ctx = ctx, .w = weight, .k = k};
    int32_t *order = rp_alloc(ctx, 2 * nz * sizeof(int32_t));
    int32_t *out = rp_alloc(ctx, nz * sizeof(int32_t));
    s.next = rp_alloc(ctx, nz * sizeof(int32_t));
    s.heap = rp_alloc(ctx, (size_t)num_states * sizeof(kk_ref));
    s.sort_tmp = rp_alloc(ctx, kz * sizeof(kk_set));
    double *scratch_d = NULL;
    int32_t *scratch_i = NULL;
    if (!order || !out || !s.next || !s.heap || !s.sort_tmp) goto nomem;

    part_sort_perm(weight, n, false, order, order + n);
    if (equal_size) {
        for (int32_t off = 0; off < n; off += k) {
            int32_t id = kk_new_state(&s);
            if (id < 0) goto nomem;
            kk_set *sets = s.pool + (size_t)id * kz;
            for (int32_t i = 0; i < k; i++) {
                int32_t item = order[off + i];
                s.next[item] = -1;
                sets[i] = (kk_set){weight[item], 1, item, item};
            }
            kk_sort_sets(&s, sets);
            kk_push(&s, (kk_ref){id, -1});
        }
    } else {
        for (int32_t j = 0; j < n; j++) kk_push(&s, (kk_ref){-1, order[j]});
    }
    while (s.heap_size > 1) {
        kk_ref a = kk_pop(&s);
        kk_ref b = kk_pop(&s);
        int32_t id = kk_merge(&s, a, b);
        if (id < 0) goto nomem;
        kk_push(&s, (kk_ref){id, -1});
    }
    kk_ref last = s.heap[0];
    if (last.state < 0) {
        out[last.item] = 0;
    } else {
        const kk_set *sets = s.pool + (size_t)last.state * kz;
        for (int32_t p = 0; p < k; p++)
            for (int32_t i = sets[p].head, c = 0; c < sets[p].count; i = s.next[i], c++) out[i] = p;
    }

    if (lv.size || lv.max_items > 0) {
        scratch_d = rp_alloc(ctx, (nz + 2 * kz) * sizeof(double));
        scratch_i = rp_alloc(ctx, (3 * nz + 2 * kz) * sizeof(int32_t));
        if (!scratch_d || !scratch_i) goto nomem;
        double *key = scratch_d, *load = key + n, *psize = load + k;
        int32_t *list = scratch_i, *perm = list + n, *tmp = perm + n, *pcount = tmp + n,
                *partner = pcount + k;
        part_sums(weight, lv.size, out, n, k, load, psize, pcount);
        if (equal_size)
            st = kk_repair_swaps(weight, n, k, &lv, out, load, psize, key, list, perm, tmp, partner, err);
        else
            st = kk_repair_moves(weight, n, k, &lv, out, load, psize, pcount, key, list, perm, tmp, err);
        if (st != RP_OK) goto out;
    }
    memcpy(part, out, nz * sizeof *part);
    goto out;
nomem:
    st = rp_fail_nomem(err, "kk scratch");
out:
    rp_free(ctx, order);
    rp_free(ctx, out);
    rp_free(ctx, s.next);
    rp_free(ctx, s.heap);
    rp_free(ctx, s.sort_tmp);
    rp_free(ctx, s.pool);
    rp_free(ctx, s.free_list);
    rp_free(ctx, scratch_d);
    rp_free(ctx, scratch_i);
    return st;
}
