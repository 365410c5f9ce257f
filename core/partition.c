/* k-way partitioning primitives: stable argsort and top-k, the shared input checks, LPT
 * and two-criteria partitioning. Karmarkar-Karp as verl computes it is partition_kk.c. */
#include "partition_internal.h"

#include <math.h>
#include <string.h>

/* ---- sorting ---- */

/* Strict total order on indices: by value, then by index (ascending in both
 * directions), which makes any correct sort stable. */
static inline bool sort_before(const double *v, bool desc, int32_t a, int32_t b)
{
    if (v[a] != v[b]) return desc ? v[a] > v[b] : v[a] < v[b];
    return a < b;
}

/* Bottom-up merge sort of idx[0..n) (any permutation of value indices) with scratch
 * tmp[n]. O(n log n). */
static void merge_sort_idx(const double *v, bool desc, int32_t *idx, int32_t *tmp, int32_t n)
{
    int32_t *src = idx, *dst = tmp;
    for (int64_t width = 1; width < n; width *= 2) {
        for (int64_t lo = 0; lo < n; lo += 2 * width) {
            int64_t mid = lo + width < n ? lo + width : n;
            int64_t hi = lo + 2 * width < n ? lo + 2 * width : n;
            int64_t i = lo, j = mid, o = lo;
            while (i < mid && j < hi)
                dst[o++] = sort_before(v, desc, src[j], src[i]) ? src[j++] : src[i++];
            while (i < mid) dst[o++] = src[i++];
            while (j < hi) dst[o++] = src[j++];
        }
        int32_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != idx) memcpy(idx, src, (size_t)n * sizeof *idx);
}

/* Indices 0..n-1 sorted by v (scratch tmp[n]). */
void part_sort_perm(const double *v, int32_t n, bool desc, int32_t *perm, int32_t *tmp)
{
    for (int32_t i = 0; i < n; i++) perm[i] = i;
    merge_sort_idx(v, desc, perm, tmp, n);
}

static rp_status check_no_nan(const char *fn, const double *values, int32_t n, rp_error *err)
{
    for (int32_t i = 0; i < n; i++)
        if (isnan(values[i])) {
            rp_fail(err, RP_EINVAL, "%s: value %d is NaN", fn, i);
            if (err) err->sequence = i;
            return RP_EINVAL;
        }
    return RP_OK;
}

rp_status rp_sort_index(rp_context *ctx, const double *values, int32_t n, bool descending,
                        int32_t *idx, rp_error *err)
{
    if (n < 0) return rp_fail(err, RP_EINVAL, "sort: %d values, must be >= 0", n);
    if (n > 0 && (!values || !idx)) return rp_fail(err, RP_EINVAL, "sort: values and idx are required");
    rp_status st = check_no_nan("sort", values, n, err);
    if (st != RP_OK) return st;
    int32_t *tmp = rp_alloc(ctx, (size_t)n * sizeof *tmp);
    if (!tmp) return rp_fail_nomem(err, "sort scratch");
    part_sort_perm(values, n, descending, idx, tmp);
    rp_free(ctx, tmp);
    return RP_OK;
}

/* Min-heap on "worse": the root is the worst of the kept values (smallest value,
 * largest index among equals). */
static inline bool topk_worse(const double *v, int32_t a, int32_t b)
{
    return sort_before(v, true, b, a);
}

static void topk_sift_down(const double *v, int32_t *heap, int32_t size, int32_t pos)
{
    int32_t item = heap[pos];
    for (;;) {
        int32_t child = 2 * pos + 1;
        if (child >= size) break;
        if (child + 1 < size && topk_worse(v, heap[child + 1], heap[child])) child++;
        if (!topk_worse(v, heap[child], item)) break;
        heap[pos] = heap[child];
        pos = child;
    }
    heap[pos] = item;
}

static void topk_sift_up(const double *v, int32_t *heap, int32_t pos)
{
    int32_t item = heap[pos];
    while (pos > 0) {
        int32_t parent = (pos - 1) / 2;
        if (!topk_worse(v, item, heap[parent])) break;
        heap[pos] = heap[parent];
        pos = parent;
    }
    heap[pos] = item;
}

rp_status rp_sort_topk(rp_context *ctx, const double *values, int32_t n, int32_t k, int32_t *idx,
                       rp_error *err)
{
    (void)ctx; /* the output array is the only storage needed */
    if (n < 0) return rp_fail(err, RP_EINVAL, "topk: %d values, must be >= 0", n);
    if (k < 1) return rp_fail(err, RP_EINVAL, "topk: k = %d, must be >= 1", k);
    if (k > n) return rp_fail(err, RP_ERANGE, "topk: k = %d but there are only %d values", k, n);
    if (!values || !idx) return rp_fail(err, RP_EINVAL, "topk: values and idx are required");
    rp_status st = check_no_nan("topk", values, n, err);
    if (st != RP_OK) return st;
    /* Validation is complete: idx can serve as the heap. */
    int32_t size = 0;
    for (int32_t i = 0; i < n; i++) {
        if (size < k) {
            idx[size] = i;
            topk_sift_up(values, idx, size++);
        } else if (topk_worse(values, idx[0], i)) {
            idx[0] = i;
            topk_sift_down(values, idx, size, 0);
        }
    }
    /* Heap sort: repeatedly move the worst to the end, giving best-first order. */
    for (int32_t end = k - 1; end > 0; end--) {
        int32_t worst = idx[0];
        idx[0] = idx[end];
        idx[end] = worst;
        topk_sift_down(values, idx, end, 0);
    }
    return RP_OK;
}

/* ---- shared validation of partition inputs ---- */


rp_status part_item_error(rp_error *err, rp_status status, int32_t item, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    rp_failv(err, status, fmt, ap);
    va_end(ap);
    if (err) err->sequence = item;
    return status;
}

rp_status part_check_weights(const char *fn, const char *what, const double *w, int32_t n,
                               rp_error *err)
{
    if (n > 0 && !w) return rp_fail(err, RP_EINVAL, "%s: the %s array is required", fn, what);
    for (int32_t i = 0; i < n; i++)
        if (!isfinite(w[i]) || w[i] < 0)
            return part_item_error(err, RP_EINVAL, i, "%s: item %d has %s %g; it must be finite and >= 0",
                              fn, i, what, w[i]);
    return RP_OK;
}

rp_status part_check_shape(const char *fn, int32_t n, int32_t k, const int32_t *part, rp_error *err)
{
    if (k < 1) return rp_fail(err, RP_EINVAL, "%s: k = %d parts, must be >= 1", fn, k);
    if (n < 0) return rp_fail(err, RP_EINVAL, "%s: %d items, must be >= 0", fn, n);
    if (n > 0 && !part) return rp_fail(err, RP_EINVAL, "%s: the part output array is required", fn);
    return RP_OK;
}

/* Check the limits and the caps that no partition can meet. */
rp_status part_check_limits(const char *fn, const rp_part_limits *lim, int32_t n, int32_t k,
                              limits_view *lv, rp_error *err)
{
    memset(lv, 0, sizeof *lv);
    lv->cap = INFINITY;
    if (!lim) return RP_OK;
    if (lim->max_items < 0)
        return rp_fail(err, RP_EINVAL, "%s: max_items = %d, must be >= 0", fn, lim->max_items);
    lv->max_items = lim->max_items;
    if (lim->speed)
        for (int32_t p = 0; p < k; p++)
            if (!isfinite(lim->speed[p]) || lim->speed[p] <= 0)
                return rp_fail(err, RP_EINVAL, "%s: part %d has speed %g; it must be finite and > 0",
                               fn, p, lim->speed[p]);
    lv->speed = lim->speed;
    if (lv->max_items > 0 && (int64_t)lv->max_items * k < n)
        return rp_fail(err, RP_ERANGE, "%s: %d items do not fit in %d parts of at most %d items",
                       fn, n, k, lv->max_items);
    if (!lim->size) return RP_OK;
    rp_status st = part_check_weights(fn, "size", lim->size, n, err);
    if (st != RP_OK) return st;
    lv->size = lim->size;
    lv->part_cap = lim->part_size_cap;
    lv->cap = lim->size_cap;
    double max_cap = -1, total_cap = 0, total_size = 0;
    for (int32_t p = 0; p < k; p++) {
        double c = part_cap_of(lv, p);
        if (isnan(c) || c < 0)
            return rp_fail(err, RP_EINVAL, "%s: part %d has size cap %g; it must be >= 0", fn, p, c);
        if (c > max_cap) max_cap = c;
        total_cap += c;
    }
    for (int32_t i = 0; i < n; i++) {
        if (lv->size[i] > max_cap)
            return part_item_error(err, RP_ERANGE, i, "%s: item %d has size %g, over every part's cap (largest %g)",
                              fn, i, lv->size[i], max_cap);
        total_size += lv->size[i];
    }
    if (total_size > total_cap)
        return rp_fail(err, RP_ERANGE, "%s: the items' total size %g exceeds the parts' total cap %g",
                       fn, total_size, total_cap);
    return RP_OK;
}


/* ---- LPT ---- */

/* Min-heap of parts keyed by (load, index). */
static inline bool part_less(const double *load, int32_t a, int32_t b)
{
    return load[a] < load[b] || (load[a] == load[b] && a < b);
}

static void part_sift_down(const double *load, int32_t *heap, int32_t size, int32_t pos)
{
    int32_t item = heap[pos];
    for (;;) {
        int32_t child = 2 * pos + 1;
        if (child >= size) break;
        if (child + 1 < size && part_less(load, heap[child + 1], heap[child])) child++;
        if (!part_less(load, heap[child], item)) break;
        heap[pos] = heap[child];
        pos = child;
    }
    heap[pos] = item;
}

rp_status rp_partition_lpt(rp_context *ctx, const double *weight, int32_t n, int32_t k,
                           const rp_part_limits *limits, int32_t *part, rp_error *err)
{
    static const char fn[] = "lpt";
    limits_view lv;
    rp_status st = part_check_shape(fn, n, k, part, err);
    if (st == RP_OK) st = part_check_weights(fn, "weight", weight, n, err);
    if (st == RP_OK) st = part_check_limits(fn, limits, n, k, &lv, err);
    if (st != RP_OK) return st;

    size_t nz = (size_t)n, kz = (size_t)k;
    int32_t *order = rp_alloc(ctx, 2 * nz * sizeof(int32_t));
    int32_t *out = rp_alloc(ctx, nz * sizeof(int32_t));
    double *load = rp_calloc(ctx, 2 * kz, sizeof(double));
    int32_t *pcount = rp_calloc(ctx, kz, sizeof(int32_t));
    int32_t *heap = rp_alloc(ctx, kz * sizeof(int32_t));
    if (!order || !out || !load || !pcount || !heap) {
        st = rp_fail_nomem(err, "lpt scratch");
        goto out;
    }
    double *psize = load + k;
    part_sort_perm(weight, n, true, order, order + n);

    if (!lv.size && !lv.speed) {
        /* Least load first, ties by index: a heap gives the same choice as a scan. */
        int32_t size = k;
        for (int32_t p = 0; p < k; p++) heap[p] = p; /* all loads 0: already a heap */
        for (int32_t j = 0; j < n; j++) {
            int32_t item = order[j];
            if (size == 0) { /* unreachable: k * max_items >= n was checked */
                st = part_item_error(err, RP_ERANGE, item, "lpt: item %d fits in no part: every part is full", item);
                goto out;
            }
            int32_t p = heap[0];
            out[item] = p;
            load[p] += weight[item];
            if (lv.max_items > 0 && ++pcount[p] >= lv.max_items) heap[0] = heap[--size];
            if (size > 0) part_sift_down(load, heap, size, 0);
        }
    } else {
        for (int32_t j = 0; j < n; j++) {
            int32_t item = order[j];
            int32_t best = -1;
            double best_val = 0;
            for (int32_t p = 0; p < k; p++) {
                if (!part_fits(&lv, psize, pcount, p, item)) continue;
                double val = lv.speed ? (load[p] + weight[item]) / lv.speed[p] : load[p];
                if (best < 0 || val < best_val) {
                    best = p;
                    best_val = val;
                }
            }
            if (best < 0) {
                st = part_item_error(err, RP_ERANGE, item,
                                "lpt: item %d (weight %g, size %g) fits in no part: every part is full "
                                "or too close to its size cap",
                                item, weight[item], lv.size ? lv.size[item] : 0.0);
                goto out;
            }
            out[item] = best;
            load[best] += weight[item];
            if (lv.size) psize[best] += lv.size[item];
            pcount[best]++;
        }
    }
    if (n) memcpy(part, out, nz * sizeof *part);
out:
    rp_free(ctx, order);
    rp_free(ctx, out);
    rp_free(ctx, load);
    rp_free(ctx, pcount);
    rp_free(ctx, heap);
    return st;
}

/* ---- two criteria ---- */

/* Each item's two weights normalised by the balanced load per unit speed. */
static void normalise2(const double *w1, const double *w2, int32_t n, int32_t k, const double *speed,
                       double *a, double *b)
{
    double t1 = 0, t2 = 0, ts = 0;
    for (int32_t i = 0; i < n; i++) {
        t1 += w1[i];
        t2 += w2[i];
    }
    for (int32_t p = 0; p < k; p++) ts += speed ? speed[p] : 1.0;
    double inv1 = t1 > 0 ? ts / t1 : 0.0, inv2 = t2 > 0 ? ts / t2 : 0.0;
    for (int32_t i = 0; i < n; i++) {
        a[i] = w1[i] * inv1;
        b[i] = w2[i] * inv2;
    }
}

static inline double obj2(double r1, double r2, const double *speed, int32_t p)
{
    double m = r1 > r2 ? r1 : r2;
    return speed ? m / speed[p] : m;
}

/* max over parts of the normalised objective, summing items in index order (the
 * search reports its result through this too, so both agree to the last bit).
 * r1, r2: scratch [k]. */
static double part_objective2(const double *w1, const double *w2, int32_t n, int32_t k,
                              const double *speed, const int32_t *part, double *r1, double *r2)
{
    double t1 = 0, t2 = 0, ts = 0, best = 0;
    for (int32_t i = 0; i < n; i++) {
        t1 += w1[i];
        t2 += w2[i];
    }
    for (int32_t p = 0; p < k; p++) {
        ts += speed ? speed[p] : 1.0;
        r1[p] = r2[p] = 0;
    }
    double inv1 = t1 > 0 ? ts / t1 : 0.0, inv2 = t2 > 0 ? ts / t2 : 0.0;
    for (int32_t i = 0; i < n; i++) {
        r1[part[i]] += w1[i] * inv1;
        r2[part[i]] += w2[i] * inv2;
    }
    for (int32_t p = 0; p < k; p++) {
        double o = obj2(r1[p], r2[p], speed, p);
        if (o > best) best = o;
    }
    return best;
}

rp_status rp_partition_objective2(rp_context *ctx, const double *w1, const double *w2, int32_t n,
                                  int32_t k, const double *speed, const int32_t *part,
                                  double *objective, rp_error *err)
{
    static const char fn[] = "objective2";
    rp_status st = part_check_shape(fn, n, k, part, err);
    if (st == RP_OK) st = part_check_weights(fn, "w1", w1, n, err);
    if (st == RP_OK) st = part_check_weights(fn, "w2", w2, n, err);
    if (st != RP_OK) return st;
    if (!objective) return rp_fail(err, RP_EINVAL, "objective2: the objective output is required");
    if (speed)
        for (int32_t p = 0; p < k; p++)
            if (!isfinite(speed[p]) || speed[p] <= 0)
                return rp_fail(err, RP_EINVAL, "objective2: part %d has speed %g; it must be finite and > 0",
                               p, speed[p]);
    for (int32_t i = 0; i < n; i++)
        if (part[i] < 0 || part[i] >= k)
            return part_item_error(err, RP_EINVAL, i, "objective2: item %d is in part %d, outside [0, %d)",
                              i, part[i], k);
    double *r = rp_calloc(ctx, 2 * (size_t)k, sizeof *r);
    if (!r) return rp_fail_nomem(err, "objective2 scratch");
    *objective = part_objective2(w1, w2, n, k, speed, part, r, r + k);
    rp_free(ctx, r);
    return RP_OK;
}

rp_status rp_partition_two_criteria(rp_context *ctx, const double *w1, const double *w2, int32_t n,
                                    int32_t k, const rp_part_limits *limits, int32_t max_rounds,
                                    int32_t *part, double *objective, rp_error *err)
{
    static const char fn[] = "two_criteria";
    limits_view lv;
    rp_status st = part_check_shape(fn, n, k, part, err);
    if (st == RP_OK) st = part_check_weights(fn, "w1", w1, n, err);
    if (st == RP_OK) st = part_check_weights(fn, "w2", w2, n, err);
    if (st == RP_OK) st = part_check_limits(fn, limits, n, k, &lv, err);
    if (st != RP_OK) return st;
    if (max_rounds < 0)
        return rp_fail(err, RP_EINVAL, "two_criteria: max_rounds = %d, must be >= 0", max_rounds);

    size_t nz = (size_t)n, kz = (size_t)k;
    double *dbuf = rp_alloc(ctx, (3 * nz + 3 * kz) * sizeof(double));
    int32_t *ibuf = rp_alloc(ctx, (4 * nz + 2 * kz + 1) * sizeof(int32_t));
    if (!dbuf || !ibuf) {
        st = rp_fail_nomem(err, "two_criteria scratch");
        goto out;
    }
    double *a = dbuf, *b = a + n, *key = b + n, *r1 = key + n, *r2 = r1 + k, *psize = r2 + k;
    int32_t *out = ibuf, *order = out + n, *tmp = order + n, *members = tmp + n, *pcount = members + n,
            *start = pcount + k; /* start[k + 1] */
    const double *speed = lv.speed;
    normalise2(w1, w2, n, k, speed, a, b);
    for (int32_t i = 0; i < n; i++) key[i] = a[i] > b[i] ? a[i] : b[i];
    for (int32_t p = 0; p < k; p++) {
        r1[p] = r2[p] = psize[p] = 0;
        pcount[p] = 0;
    }

    /* Greedy, heaviest first. */
    part_sort_perm(key, n, true, order, tmp);
    for (int32_t j = 0; j < n; j++) {
        int32_t item = order[j], best = -1;
        double best_obj = 0, best_sum = 0;
        for (int32_t p = 0; p < k; p++) {
            if (!part_fits(&lv, psize, pcount, p, item)) continue;
            double o = obj2(r1[p] + a[item], r2[p] + b[item], speed, p);
            double sum = (r1[p] + a[item] + r2[p] + b[item]) / (speed ? speed[p] : 1.0);
            if (best < 0 || o < best_obj || (o == best_obj && sum < best_sum)) {
                best = p;
                best_obj = o;
                best_sum = sum;
            }
        }
        if (best < 0) {
            st = part_item_error(err, RP_ERANGE, item,
                            "two_criteria: item %d (w1 %g, w2 %g, size %g) fits in no part: every part "
                            "is full or too close to its size cap",
                            item, w1[item], w2[item], lv.size ? lv.size[item] : 0.0);
            goto out;
        }
        out[item] = best;
        r1[best] += a[item];
        r2[best] += b[item];
        if (lv.size) psize[best] += lv.size[item];
        pcount[best]++;
    }

    /* Improvement rounds on the part with the largest objective. */
    for (int32_t round = 0; round < max_rounds; round++) {
        int32_t pm = 0;
        double om = -1;
        for (int32_t p = 0; p < k; p++) {
            double o = obj2(r1[p], r2[p], speed, p);
            if (o > om) {
                om = o;
                pm = p;
            }
        }
        /* Members of each part in index order (counting sort). */
        for (int32_t p = 0; p <= k; p++) start[p] = 0;
        for (int32_t i = 0; i < n; i++) start[out[i] + 1]++;
        for (int32_t p = 0; p < k; p++) start[p + 1] += start[p];
        for (int32_t p = 0; p < k; p++) tmp[p] = start[p];
        for (int32_t i = 0; i < n; i++) members[tmp[out[i]]++] = i;

        double best_val = om * (1 - 1e-12);
        int32_t bx = -1, bq = -1, by = -1;
        for (int32_t xi = start[pm]; xi < start[pm + 1]; xi++) {
            int32_t x = members[xi];
            double xs = lv.size ? lv.size[x] : 0.0;
            for (int32_t q = 0; q < k; q++) {
                if (q == pm) continue;
                if (part_fits(&lv, psize, pcount, q, x)) {
                    double op = obj2(r1[pm] - a[x], r2[pm] - b[x], speed, pm);
                    double oq = obj2(r1[q] + a[x], r2[q] + b[x], speed, q);
                    double v = op > oq ? op : oq;
                    if (v < best_val) {
                        best_val = v;
                        bx = x;
                        bq = q;
                        by = -1;
                    }
                }
                for (int32_t yi = start[q]; yi < start[q + 1]; yi++) {
                    int32_t y = members[yi];
                    if (lv.size) {
                        double ys = lv.size[y];
                        if (psize[pm] - xs + ys > part_cap_of(&lv, pm)) continue;
                        if (psize[q] - ys + xs > part_cap_of(&lv, q)) continue;
                    }
                    double op = obj2(r1[pm] - a[x] + a[y], r2[pm] - b[x] + b[y], speed, pm);
                    double oq = obj2(r1[q] - a[y] + a[x], r2[q] - b[y] + b[x], speed, q);
                    double v = op > oq ? op : oq;
                    if (v < best_val) {
                        best_val = v;
                        bx = x;
                        bq = q;
                        by = y;
                    }
                }
            }
        }
        if (bx < 0) break;
        out[bx] = bq;
        r1[pm] -= a[bx];
        r2[pm] -= b[bx];
        r1[bq] += a[bx];
        r2[bq] += b[bx];
        if (lv.size) {
            psize[pm] -= lv.size[bx];
            psize[bq] += lv.size[bx];
        }
        if (by >= 0) {
            out[by] = pm;
            r1[bq] -= a[by];
            r2[bq] -= b[by];
            r1[pm] += a[by];
            r2[pm] += b[by];
            if (lv.size) {
                psize[bq] -= lv.size[by];
                psize[pm] += lv.size[by];
            }
        } else {
            pcount[pm]--;
            pcount[bq]++;
        }
    }

    /* Report the objective recomputed from scratch, free of the running sums' drift. */
    double result = part_objective2(w1, w2, n, k, speed, out, r1, r2);
    if (n) memcpy(part, out, nz * sizeof *part);
    if (objective) *objective = result;
out:
    rp_free(ctx, dbuf);
    rp_free(ctx, ibuf);
    return st;
}
