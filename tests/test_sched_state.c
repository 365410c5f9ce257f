/* Scheduler checkpoints: a scheduler restored from rp_sched_save_state plans the next
 * steps bit for bit as the original (plans and reports), with a stateful policy, a pair,
 * a pending hot swap; save -> load -> save gives the same bytes; ctx.state values JSON
 * cannot hold are refused by path; bad state text is refused and changes nothing. */
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>


#define STEPS 12
static gen_steps fx; /* the fixture (tests/test_util.h); the names below are its parts */
static rp_context *ctx;
static rp_config *cfg;
static rp_batch **batches;
static rp_routing *routings;
static const char *tmp;

static const char *policy_file(const char *name, const char *source)
{
    static char paths[8][512];
    static int files;
    char *p = paths[files++ % 8];
    snprintf(p, 512, "%s/%s.lua", tmp, name);
    FILE *f = fopen(p, "w");
    fputs(source, f);
    fclose(f);
    return p;
}

/* Its plans depend on everything it keeps in ctx.state (a counter, a random walk, the
 * history it saw), and the state holds every kind of value a checkpoint carries. */
static const char *STATEFUL =
    "return {name = 'stateful', version = '1.0.0', api = 1, description = 'keeps state',\n"
    "init = function(ctx)\n"
    "  ctx.state.n = 0; ctx.state.walk = 0; ctx.state.seen = {}\n"
    "  ctx.state.odd = {['two words'] = 1/3, [2.5] = 'half', [true] = -0.0, [-1] = math.huge,\n"
    "                   bytes = 'a\\0b\\255', deep = {{{false}}}, nan = 0/0}\n"
    "end,\n"
    "plan = function(ctx)\n"
    "  local s = ctx.state\n"
    "  s.n = s.n + 1\n"
    "  s.walk = s.walk + math.random()\n"
    "  s.seen[#s.seen + 1] = {step = ctx.step, hist = #ctx.history, load0 = ctx.stats.expert_load(0)[0]}\n"
    "  if (s.n + math.floor(s.walk * 3)) % 3 == 0 then return rp.baseline('attn_kk+eplb') end\n"
    "  return rp.baseline('token_kk+eplb')\n"
    "end}\n";

static rp_sched *make(const char *policy, int32_t history, uint64_t seed)
{
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.history = history;
    o.seed = seed;
    return gen_steps_sched(&fx, policy, NULL, &o);
}

static const rp_step_report *step(rp_sched *s, int t)
{
    const rp_plan *p = NULL;
    const rp_step_report *rep = NULL;
    rp_error err;
    if (!s || rp_sched_step(s, t, batches[t % STEPS], &routings[t % STEPS], &p, &rep, &err) != RP_OK) {
        if (s) diag("step %d: %s", t, err.text);
        return NULL;
    }
    return rep;
}

static char *save(rp_sched *s, size_t *len)
{
    char *text = NULL;
    rp_error err;
    if (rp_sched_save_state(s, &text, len, &err) != RP_OK) {
        diag("save: %s", err.text);
        return NULL;
    }
    return text;
}

/* Everything of a report but the wall-clock figures (and the policy's work units:
 * instruction counts depend on how a table was built, not on what it holds). */
static bool same_report(const rp_step_report *a, const rp_step_report *b)
{
    return a->step == b->step && a->plan_hash == b->plan_hash && a->policy_hash == b->policy_hash &&
           strcmp(a->policy_name, b->policy_name) == 0 && a->fallback == b->fallback &&
           strcmp(a->fallback_reason, b->fallback_reason) == 0 && a->swapped == b->swapped &&
           strcmp(a->swap_error, b->swap_error) == 0 && a->experts_moved == b->experts_moved &&
           memcmp(&a->migration_bytes, &b->migration_bytes, sizeof(double)) == 0 &&
           memcmp(&a->cost.step_s, &b->cost.step_s, sizeof(double)) == 0 &&
           memcmp(&a->cost.ratio, &b->cost.ratio, sizeof(double)) == 0;
}

/* Run steps [from, to) on both and compare every report; counts the distinct plans. */
static bool same_future(rp_sched *a, rp_sched *b, int from, int to, int *swaps)
{
    bool same = true;
    for (int t = from; t < to; t++) {
        const rp_step_report *ra = step(a, t);
        rp_step_report copy;
        if (ra) copy = *ra;
        const rp_step_report *rb = step(b, t);
        if (!ra || !rb || !same_report(&copy, rb)) {
            if (ra && rb)
                diag("step %d: plan %016llx vs %016llx, swapped %d vs %d", t, (unsigned long long)copy.plan_hash,
                     (unsigned long long)rb->plan_hash, copy.swapped, rb->swapped);
            same = false;
        }
        if (ra && rb && ra->swapped && swaps) (*swaps)++;
    }
    return same;
}

static void test_resume(const char *label, const char *policy, int32_t history)
{
    rp_sched *a = make(policy, history, 7);
    bool ran = true;
    for (int t = 0; t < 5; t++) ran &= step(a, t) != NULL;
    size_t len1 = 0, len2 = 0;
    char *s1 = save(a, &len1);
    /* B starts as another policy with another seed: the state replaces both */
    rp_sched *b = make("contiguous", history, 99);
    rp_error err;
    rp_status st = s1 ? rp_sched_load_state(b, s1, len1, &err) : RP_EINVAL;
    if (st != RP_OK && s1) diag("load: %s", err.text);
    ok(ran && st == RP_OK, "%s: the state of 5 steps loads into a fresh scheduler", label);
    char *s2 = save(b, &len2);
    ok(s1 && s2 && len1 == len2 && memcmp(s1, s2, len1) == 0 && s1[len1 - 1] == '\n' && strlen(s1) == len1,
       "%s: save -> load -> save gives the same bytes (%zu)", label, len1);
    ok(same_future(a, b, 5, STEPS, NULL), "%s: the resumed scheduler plans steps 5..%d as the original, bit for bit",
       label, STEPS - 1);
    rp_text_free(ctx, s1);
    rp_text_free(ctx, s2);
    rp_sched_free(a);
    rp_sched_free(b);
}

static void test_state_matters(void)
{
    /* a scheduler that only shares the policy but not its state plans differently: the
     * comparison above is not trivially true */
    const char *path = policy_file("stateful", STATEFUL);
    rp_sched *a = make(path, 4, 7), *c = make(path, 4, 7);
    for (int t = 0; t < 5; t++) step(a, t);
    bool differ = false;
    for (int t = 5; t < STEPS; t++) {
        const rp_step_report *ra = step(a, t);
        uint64_t ha = ra ? ra->plan_hash : 0;
        const rp_step_report *rc = step(c, t);
        if (ra && rc && ha != rc->plan_hash) differ = true;
    }
    ok(differ, "without the state the same policy plans other steps (the state decides plans)");
    rp_sched_free(a);
    rp_sched_free(c);
}

static void test_staged(void)
{
    const char *path = policy_file("stateful_staged", STATEFUL);
    rp_sched *a = make("token_kk+eplb", 8, 3);
    for (int t = 0; t < 4; t++) step(a, t);
    rp_error err;
    rp_status st = rp_sched_stage_policy(a, path, NULL, 6, &err);
    if (st != RP_OK) diag("stage: %s", err.text);
    size_t len;
    char *text = save(a, &len);
    ok(st == RP_OK && text && strstr(text, "\"at_step\":6"), "a staged policy and its step are saved");
    rp_sched *b = make("token_kk", 8, 3);
    st = text ? rp_sched_load_state(b, text, len, &err) : RP_EINVAL;
    if (st != RP_OK && text) diag("load: %s", err.text);
    int swaps = 0;
    ok(st == RP_OK && same_future(a, b, 4, STEPS, &swaps) && swaps == 1,
       "the staged policy swaps in at the same step on both (dry run on the saved last batch), plans equal after");
    rp_text_free(ctx, text);
    rp_sched_free(a);
    rp_sched_free(b);
}

static void test_before_first_step(void)
{
    rp_sched *a = make("token_kk+eplb", 8, 1);
    size_t len;
    char *text = save(a, &len);
    rp_sched *b = make("attn_kk+eplb", 8, 1);
    rp_error err;
    rp_status st = text ? rp_sched_load_state(b, text, len, &err) : RP_EINVAL;
    ok(st == RP_OK && text && strstr(text, "\"last_step\":null") && same_future(a, b, 0, 3, NULL),
       "a state saved before the first step loads and plans as the original");
    rp_text_free(ctx, text);
    rp_sched_free(a);
    rp_sched_free(b);
}

/* A policy storing `what` into ctx.state in plan(). */
static void unsaveable(const char *what, const char *want)
{
    char src[2048];
    snprintf(src, sizeof src,
             "return {name = 'bad_state', version = '1.0.0', api = 1, description = 'unsaveable state',\n"
             "plan = function(ctx) local s = ctx.state\n%s\nend}\n",
             what);
    rp_sched *s = make(policy_file("bad_state", src), 8, 0);
    step(s, 0);
    char *text = NULL;
    rp_error err;
    rp_status st = rp_sched_save_state(s, &text, NULL, &err);
    ok(st == RP_EINVAL && text == NULL, "ctx.state with %s cannot be saved", want);
    like(err.text, want, "the error names it: %s", err.text);
    ok(strcmp(rp_sched_errmsg(s), err.text) == 0, "and is kept in rp_sched_errmsg");
    ok(step(s, 1) != NULL, "the scheduler keeps working");
    rp_sched_free(s);
}

static void test_unsaveable(void)
{
    unsaveable("s.cb = {function() end}", "ctx.state.cb[1] is a function");
    unsaveable("s.a = {b = {}}; s.a.b.c = s.a", "ctx.state.a.b.c is a table that ctx.state also holds");
    unsaveable("local t = {}; s.x = t; s.y = {t}", "ctx.state.y[1] is a table that ctx.state also holds");
    unsaveable("s.v = ctx.batch.seq_len", "ctx.state.v is userdata");
    unsaveable("s.m = setmetatable({}, {})", "ctx.state.m has a metatable");
    unsaveable("s[{}] = 1", "has a key that is table");
}

/* CPU seconds of this process: the two cores of the development machine are shared, so
 * wall time measures the neighbours too. */
static double cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A state built by one step (`build`, in plan()) saves and loads, and the loaded
 * scheduler saves the same bytes. Returns the seconds save + load took. */
static double big_state(const char *label, const char *build)
{
    char src[2048];
    snprintf(src, sizeof src,
             "return {name = 'big_state', version = '1.0.0', api = 1, description = 'a big state',\n"
             "plan = function(ctx) local s = ctx.state\nif ctx.step == 0 then %s end\nreturn nil end}\n",
             build);
    rp_sched *a = make(policy_file("big_state", src), 4, 0);
    const rp_step_report *rep = step(a, 0);
    ok(rep && !rep->fallback, "%s: the step that builds it succeeds%s%s", label, rep && rep->fallback ? ": " : "",
       rep && rep->fallback ? rep->fallback_reason : "");
    double t0 = cpu_s();
    size_t len1 = 0, len2 = 0;
    char *s1 = save(a, &len1);
    double t_save = cpu_s() - t0;
    rp_sched *b = make("contiguous", 4, 0);
    rp_error err;
    t0 = cpu_s();
    rp_status st = s1 ? rp_sched_load_state(b, s1, len1, &err) : RP_EINVAL;
    double t_load = cpu_s() - t0;
    if (st != RP_OK && s1) diag("load: %s", err.text);
    ok(s1 && st == RP_OK, "%s: saves (%zu bytes, %.3f CPU s) and loads (%.3f CPU s)", label, len1, t_save, t_load);
    char *s2 = save(b, &len2);
    ok(s1 && s2 && len1 == len2 && memcmp(s1, s2, len1) == 0, "%s: and saves again the same bytes", label);
    ok(step(b, 1) != NULL, "%s: the loaded scheduler steps on", label);
    rp_text_free(ctx, s1);
    rp_text_free(ctx, s2);
    rp_sched_free(a);
    rp_sched_free(b);
    return t_save + t_load;
}

static void test_big_states(void)
{
    /* more than LuaJIT's 8000 stack slots: the encoder once parked every key there */
    big_state("10,000 entries", "s.h = {} for i = 1, 10000 do s.h[i] = i / 3 end");
    /* per-(layer, expert) history, 64 x 128 numbers, under string keys */
    big_state("64 x 128 history", "for l = 1, 64 do local r = {} for e = 1, 128 do r[e] = l * e end s['l' .. l] = r end");
    /* 100,000 small tables: a scan per table for cycles made this quadratic (3-29 s to
     * save and again to load). The bound is 3 s on the development machine, as
     * CPU time of this process (0.5-0.9 s measured, on two cores shared with a load of
     * 10: jansson's allocations and number formatting), which leaves room for the
     * sanitizer builds. */
    double took = big_state("100,000 tables", "s.t = {} for i = 1, 100000 do s.t[i] = {i} end");
    ok(took < 3.0, "100,000 tables save and load in under 3 CPU s (%.3f s)", took);
}

/* Keeping ctx.state after a call counts against the call's instruction limit: a state
 * that grows by 100,000 entries a step fails the step where keeping it would pass the
 * limit, naming it; the policy is rebuilt from the last state kept, which still saves. */
static void test_state_over_limit(void)
{
    const char *src = "return {name = 'grows', version = '1.0.0', api = 1, description = 'a growing state',\n"
                      "plan = function(ctx) local t = {} for i = 1, 100000 do t[i] = i end\n"
                      "ctx.state[#ctx.state + 1] = t return nil end}\n";
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = policy_file("grows", src);
    o.num_threads = 1;
    o.max_instructions = 12000000;
    rp_sched *s = NULL;
    rp_error err;
    if (rp_sched_new(ctx, cfg, &o, &s, &err) != RP_OK) diag("rp_sched_new: %s", err.text);
    int failed_at = -1, good = 0;
    const rp_step_report *rep = NULL;
    for (int t = 0; s && t < 20 && failed_at < 0; t++) {
        rep = step(s, t);
        if (rep && rep->fallback) failed_at = t;
        else if (rep) good++;
    }
    ok(failed_at > 0 && good == failed_at, "a growing state is kept for %d steps, then its step fails", good);
    like(rep ? rep->fallback_reason : "", "policy exceeded the instruction limit (12000000) saving ctx.state after the call",
         "naming the limit: %s", rep ? rep->fallback_reason : "");
    size_t len = 0;
    char *text = save(s, &len);
    ok(text != NULL, "the checkpoint still saves (the state of the last good step, %zu bytes)", len);
    rp_text_free(ctx, text);
    rp_sched_free(s);
}

/* The copy of ctx.state the engine keeps counts against the memory cap with the state's
 * live bytes: a state that adds a distinct 2 MiB string a step (string.rep holds 4 MiB
 * while it builds it) fails, under an 8 MiB cap, at the second step: the first
 * string, its 2 MiB copy and the 4 MiB being built pass the cap. Before, the copy was
 * not counted and the third step was the first to fail. */
static void test_copy_counts_against_memory(void)
{
    const char *src = "return {name = 'strings', version = '1.0.0', api = 1, description = 'long strings',\n"
                      "plan = function(ctx) ctx.state[#ctx.state + 1] = string.rep(ctx.step .. '-', 2^20)\n"
                      "return nil end}\n";
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = policy_file("strings", src);
    o.num_threads = 1;
    o.max_memory_bytes = (size_t)8 << 20;
    o.demote_after = -1;
    rp_sched *s = NULL;
    rp_error err;
    if (rp_sched_new(ctx, cfg, &o, &s, &err) != RP_OK) diag("rp_sched_new: %s", err.text);
    int failed_at = -1;
    const rp_step_report *rep = NULL;
    for (int t = 0; s && t < 6 && failed_at < 0; t++) {
        rep = step(s, t);
        if (rep && rep->fallback) failed_at = t;
    }
    ok(failed_at == 1, "the step whose strings, kept copy and the string being built pass the 8 MiB cap falls back (step %d)",
       failed_at);
    like(rep ? rep->fallback_reason : "", "exceeded the memory limit of 8 MiB", "naming the memory limit: %s",
         rep ? rep->fallback_reason : "");
    rp_sched_free(s);
}

/* Load `text` into b: must fail with `want` in the message and change nothing. */
static void refused(rp_sched *b, const char *good, const char *text, size_t len, rp_status code, const char *want,
                    const char *label)
{
    rp_error err;
    rp_status st = rp_sched_load_state(b, text, len, &err);
    ok(st == code, "%s: refused (%s)", label, rp_strerror(st));
    like(err.text, want, "%s: %s", label, err.text);
    ok(strcmp(rp_sched_errmsg(b), err.text) == 0, "%s: the message is kept in rp_sched_errmsg", label);
    size_t n;
    char *now = save(b, &n);
    ok(now && strcmp(now, good) == 0, "%s: the scheduler is unchanged", label);
    rp_text_free(ctx, now);
}

/* text with the first `from` replaced by `to` (static buffer). */
static const char *edit(const char *text, const char *from, const char *to)
{
    static char *buf;
    free(buf);
    buf = NULL;
    const char *at = strstr(text, from);
    if (!at) {
        diag("edit: '%s' not in the state", from);
        return text;
    }
    size_t pre = (size_t)(at - text);
    buf = malloc(strlen(text) + strlen(to) + 1);
    memcpy(buf, text, pre);
    strcpy(buf + pre, to);
    strcat(buf, at + strlen(from));
    return buf;
}

/* text with the `nth` (0-based) occurrence of `from` cut out, from its start up to
 * (not including) the next occurrence of `upto` after it (static buffer). */
static const char *cut(const char *text, const char *from, int nth, const char *upto)
{
    static char *buf;
    free(buf);
    buf = NULL;
    const char *at = strstr(text, from);
    for (int i = 0; at && i < nth; i++) at = strstr(at + 1, from);
    const char *end = at ? strstr(at + strlen(from), upto) : NULL;
    if (!at || !end) {
        diag("cut: '%s' #%d .. '%s' not in the state", from, nth, upto);
        return text;
    }
    buf = malloc(strlen(text) + 1);
    memcpy(buf, text, (size_t)(at - text));
    strcpy(buf + (at - text), end);
    return buf;
}

/* The first seq_hist quadruple of the state, as text ("0,0,3,7"). */
static const char *first_quad(const char *text)
{
    static char quad[128];
    const char *at = strstr(text, "\"seq_hist\":[");
    if (!at) return "";
    at += strlen("\"seq_hist\":[");
    const char *p = at;
    for (int commas = 0; *p && commas < 4; p++)
        if (*p == ',') commas++;
    snprintf(quad, sizeof quad, "%.*s", (int)(p - at), at); /* "s,l,e,c," */
    return quad;
}

/* Loading is as strict as writing: every key the writer writes is required, every
 * invariant it keeps is checked, and what loads saves again as the same document, so a
 * resumed scheduler can always checkpoint and resume again. */
static void test_strict(rp_sched *b, const char *good, const char *atext)
{
    static const char *const batch_keys[] = {"\"prompt_lens\"", "\"response_lens\"", "\"group_ids\"",
                                             "\"expert_load\"", "\"seq_hist\""};
    char label[128];
    const char *lb = strstr(atext, "\"last_batch\":{");
    for (int i = 0; i < 5 && lb; i++) {
        /* the key with its value, up to the next key of last_batch (or the end) */
        const char *k = strstr(lb, batch_keys[i]);
        const char *next = i < 4 ? strstr(k, batch_keys[i + 1]) : NULL;
        char *t = NULL;
        if (k && (i < 4 ? next != NULL : true)) {
            size_t pre = (size_t)(k - atext);
            const char *rest = i < 4 ? next : strstr(k, "]}") + 1;
            t = malloc(strlen(atext) + 1);
            memcpy(t, atext, pre);
            strcpy(t + pre, rest);
            if (i == 4) t[pre - 1] = ' '; /* the comma before the last key */
        }
        snprintf(label, sizeof label, "last_batch without %s", batch_keys[i]);
        char want[96];
        snprintf(want, sizeof want, "last_batch.%.*s is required", (int)strlen(batch_keys[i]) - 2, batch_keys[i] + 1);
        if (t) refused(b, good, t, strlen(t), RP_EINVAL, want, label);
        else ok(0, "%s: setup", label);
        free(t);
    }
    const char *t = cut(atext, "\"expert_load\":[", 0, "]}");
    t = edit(t, "\"step\":0,]}", "\"step\":0}");
    refused(b, good, t, strlen(t), RP_EINVAL, "history[0].expert_load is required", "a history entry without loads");

    /* seq_hist: a duplicate, the order, counts that do not add up */
    char from[256], to[512];
    const char *q = first_quad(atext);
    snprintf(from, sizeof from, "\"seq_hist\":[%s", q);
    snprintf(to, sizeof to, "\"seq_hist\":[%s%s", q, q);
    t = edit(atext, from, to);
    /* twice the same quadruple: the counts no longer add up either, but the duplicate is named */
    refused(b, good, t, strlen(t), RP_EFORMAT, "is listed twice", "a duplicate seq_hist quadruple");
    int s0, l0, e0;
    unsigned c0;
    if (sscanf(q, "%d,%d,%d,%u", &s0, &l0, &e0, &c0) == 4) {
        snprintf(to, sizeof to, "\"seq_hist\":[%d,%d,%d,%u,", s0, l0, e0, c0 + 1);
        t = edit(atext, from, to);
        refused(b, good, t, strlen(t), RP_EFORMAT, "choices for sequence 0 at layer 0", "a count that does not add up");
        snprintf(to, sizeof to, "\"seq_hist\":[%d,%d,%d,%u,%d,%d,%d,%u,", s0, l0 + 1, e0, c0, s0, l0, e0, c0);
        t = edit(atext, from, to);
        refused(b, good, t, strlen(t), RP_EFORMAT, "comes after a later one", "quadruples out of order");
    } else {
        ok(0, "the first quadruple parses: %s", q);
    }
    /* the last batch's loads moved: an expert's load other than its counts */
    const char *el = strstr(strstr(atext, "\"last_batch\":{"), "\"expert_load\":[");
    if (el) {
        long v0 = strtol(el + strlen("\"expert_load\":["), NULL, 10);
        snprintf(from, sizeof from, "\"expert_load\":[%ld,", v0);
        const char *in_batch = strstr(strstr(atext, "\"last_batch\":{"), from);
        char *u = malloc(strlen(atext) + 32);
        size_t pre = (size_t)(in_batch - atext);
        memcpy(u, atext, pre);
        sprintf(u + pre, "\"expert_load\":[%ld,%s", v0 + 1, in_batch + strlen(from));
        refused(b, good, u, strlen(u), RP_EFORMAT, "last_batch.expert_load", "a last-batch load other than its counts");
        free(u);
    }

    /* every key is written, so every key is required */
    t = edit(atext, "\"staged\":null,", "");
    refused(b, good, t, strlen(t), RP_EFORMAT, "staged is required", "a state without 'staged'");
    t = edit(atext, "\"plan_hash\":", "\"x\":0,\"plan_hash\":");
    refused(b, good, t, strlen(t), RP_EINVAL, "unknown key 'x'", "an unknown key");

    /* the history ends with the last step */
    t = edit(atext, "\"last_step\":2", "\"last_step\":7");
    refused(b, good, t, strlen(t), RP_EFORMAT, "must end with the last step (7)", "a last step the history lacks");

    /* what the writer would not write: found by the round trip */
    t = edit(atext, "[\"n\",3.0]", "[\"n\",3]");
    refused(b, good, t, strlen(t), RP_EFORMAT, "is 3, but what the state holds saves as 3.0", "an integer in ctx.state");
    t = edit(atext, "[\"n\",3.0]", "[\"n\",3.0],[\"n\",3.0]");
    refused(b, good, t, strlen(t), RP_EFORMAT, "saves as", "a duplicate ctx.state key");
    t = edit(atext, "[\"n\",3.0]", "[{\"bytes\":\"6e\"},3.0]");
    refused(b, good, t, strlen(t), RP_EFORMAT, "saves as", "hex bytes for a plain string key");
    t = edit(atext, "\"name\":\"stateful\"", "\"name\":\"another\"");
    refused(b, good, t, strlen(t), RP_EFORMAT, "running.name is \"another\", but what the state holds saves as "
            "\"stateful\"", "a policy set named other than its policies");
}

static void test_bad_state(void)
{
    const char *path = policy_file("stateful_bad", STATEFUL);
    rp_sched *a = make(path, 4, 7);
    for (int t = 0; t < 3; t++) step(a, t);
    size_t alen;
    char *atext = save(a, &alen);
    rp_sched *b = make("token_kk+eplb", 4, 5);
    for (int t = 0; t < 2; t++) step(b, t);
    size_t blen;
    char *good = save(b, &blen);
    if (!atext || !good) {
        ok(0, "setup of the bad-state tests");
        return;
    }
    refused(b, good, atext, alen / 2, RP_EFORMAT, "state:1:", "truncated text");
    refused(b, good, "[1, 2]", 6, RP_EFORMAT, "not a RoutePack scheduler state", "an array");
    refused(b, good, "{\"format\": \"something else\"}", 28, RP_EFORMAT, "not a scheduler state", "another format");
    refused(b, good, "{\"not\": \"a state\"}", 18, RP_EFORMAT, "format is missing", "no format field");
    refused(b, good, "{\"format\": 7}", 13, RP_EFORMAT, "format is an integer", "a format that is no string");
    const char *t = edit(atext, "\"version\":1", "\"version\":2");
    refused(b, good, t, strlen(t), RP_ENOTSUP, "this library reads version 1", "a later version");
    t = edit(atext, "\"num_layers\":16", "\"num_layers\":8");
    refused(b, good, t, strlen(t), RP_EINVAL, "config.num_layers is 8 in the state, but this scheduler's config has 16",
            "another number of layers");
    t = edit(atext, "\"slots\":[", "\"slots\":[99,");
    refused(b, good, t, strlen(t), RP_EFORMAT, "config.slots has", "another slot count");
    t = edit(atext, "\"history_length\":4", "\"history_length\":8");
    refused(b, good, t, strlen(t), RP_EINVAL, "this scheduler keeps 4 steps of history", "another history length");
    t = edit(atext, "ctx.state.n = 0", "ctx.state.n = 1");
    refused(b, good, t, strlen(t), RP_EFORMAT, "does not match its hash", "an edited policy source");
    t = edit(atext, "\"state\":{\"table\":", "\"state\":{\"tabel\":");
    refused(b, good, t, strlen(t), RP_EFORMAT, "must be a table", "a damaged ctx.state");
    t = edit(atext, "[\"n\",", "[{\"x\":1},");
    refused(b, good, t, strlen(t), RP_EFORMAT, "a key is a number", "a bad ctx.state key");
    t = edit(atext, "\"placement\":[[[", "\"placement\":[[[1,");
    refused(b, good, t, strlen(t), RP_EINVAL, "plan", "a damaged plan");
    t = edit(atext, "\"seq_hist\":[0,", "\"seq_hist\":[999999,");
    refused(b, good, t, strlen(t), RP_ERANGE, "last_batch.seq_hist[0]", "a sequence out of range in the last batch");
    t = edit(atext, "\"seed\":\"", "\"seed\":\"x");
    refused(b, good, t, strlen(t), RP_EFORMAT, "seed must be 16", "a bad seed");
    /* rejected in the middle of rebuilding (after the running policy was loaded) */
    t = edit(atext, "\"history\":[{\"step\":", "\"history\":[{\"step\":\"zero\",\"x\":");
    refused(b, good, t, strlen(t), RP_EINVAL, "history[0]", "a bad history entry, after the policies were rebuilt");
    test_strict(b, good, atext);
    ok(step(b, 2) != NULL, "the scheduler still steps after every refusal");

    rp_sched *h = make(path, 2, 7);
    rp_error err;
    ok(rp_sched_load_state(h, atext, alen, &err) == RP_EINVAL && strstr(err.text, "keeps 2 steps"),
       "a scheduler with another history length refuses the state: %s", err.text);
    rp_sched_free(h);
    rp_text_free(ctx, atext);
    rp_text_free(ctx, good);
    rp_sched_free(a);
    rp_sched_free(b);
}

/* A load that runs out of memory at an allocation fails with RP_ENOMEM, leaves the
 * scheduler exactly as it was (its own saved state unchanged) and leaks nothing; the
 * first run that gets all its memory loads the state. */
static void test_alloc_failures(void)
{
    const char *pol = policy_file("stateful_alloc", STATEFUL);
    rp_sched *a = make(pol, 4, 7);
    for (int t = 0; t < 3; t++) step(a, t);
    size_t len = 0;
    char *want = save(a, &len);
    bool clean = true, done = false;
    long runs = 0;
    /* every allocation of the first 64, then every 7th: each run builds a scheduler */
    for (long n = 1; n < 100000 && !done && want; n += n < 64 ? 1 : 7) {
        counting c;
        memset(&c, 0, sizeof c);
        rp_context *cx = NULL;
        rp_context_new(counting_alloc, &c, &cx);
        long blocks0 = c.blocks;
        rp_sched_options o;
        rp_sched_options_default(&o);
        o.policy = pol;
        o.num_threads = 1;
        o.history = 4;
        o.seed = 9;
        rp_sched *b = NULL;
        rp_error err;
        if (rp_sched_new(cx, cfg, &o, &b, &err) != RP_OK) {
            diag("rp_sched_new: %s", err.text);
            clean = false;
            rp_context_free(cx);
            break;
        }
        size_t blen = 0;
        char *before = save(b, &blen);
        c.fail_at = c.calls + n;
        rp_status st = rp_sched_load_state(b, want, len, &err);
        c.fail_at = 0;
        runs++;
        size_t alen = 0;
        char *after = save(b, &alen);
        if (st == RP_OK) {
            done = true;
            if (!after || alen != len || memcmp(after, want, len) != 0) clean = false;
        } else {
            if (st != RP_ENOMEM) {
                diag("allocation %ld: status %d: %s", n, (int)st, err.text);
                clean = false;
            }
            if (!after || alen != blen || memcmp(after, before, blen) != 0) clean = false;
        }
        if (after) rp_text_free(cx, after);
        if (before) rp_text_free(cx, before);
        rp_sched_free(b);
        /* blocks, not bytes: LuaJIT under-reports the size of a half-built closure it
         * frees after a failed allocation (docs/sandbox.md) */
        if (c.blocks != blocks0) {
            diag("allocation %ld: %ld blocks leaked", n, c.blocks - blocks0);
            clean = false;
        }
        rp_context_free(cx);
    }
    ok(clean && done, "a load failing at an allocation changes nothing and leaks nothing (%ld runs)", runs);
    if (want) rp_text_free(ctx, want);
    rp_sched_free(a);
}

int main(void)
{
    rp_error err;
    if (!gen_steps_load(&fx, "sched-state", STEPS, &err)) {
        ok(0, "setup: %s", err.text);
        return tap_done();
    }
    ctx = fx.ctx, cfg = fx.cfg, batches = fx.batches, routings = fx.routings, tmp = fx.tmp;
    test_resume("a stateful Lua policy", policy_file("stateful_resume", STATEFUL), 4);
    test_resume("a pair (token_kk+eplb)", "token_kk+eplb", 8);
    test_resume("the joint policy (routepack)", "routepack", 8);
    test_state_matters();
    test_staged();
    test_before_first_step();
    test_unsaveable();
    test_big_states();
    test_state_over_limit();
    test_copy_counts_against_memory();
    test_bad_state();
    test_alloc_failures();
    gen_steps_free(&fx);
    return tap_done();
}
