/* `routepack trace import | info | validate`, run as a user would: .npy files written by
 * rp_npy_write (and by real NumPy, tests/data/npy) imported, inspected and checked;
 * exit status 1 for bad input, 2 for usage errors. */
#include "internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <dirent.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define BIN RP_BINARY_DIR "/routepack"
#define DATA RP_SOURCE_DIR "/tests/data/npy/"

static char tmpdir[64];
static char out[65536];

static const char *tmp(const char *name) { return temp_path(tmpdir, name); }

/* Run `routepack ARGS` with stderr joined to stdout into `out`; its exit status. */
#define rp(...) run_routepack(out, sizeof out, __VA_ARGS__)

static int leftover_temp_files(void)
{
    int n = 0;
    DIR *d = opendir(tmpdir);
    struct dirent *e;
    while (d && (e = readdir(d))) n += strstr(e->d_name, ".tmp.") != NULL;
    if (d) closedir(d);
    return n;
}

/* 4 sequences (one empty), 19 tokens, 4 layers, top-2 */
enum { NSEQ = 4, T = 19, L = 4, K = 2 };
static const int32_t prompt[NSEQ] = {3, 0, 2, 1}, response[NSEQ] = {5, 0, 2, 6}, groups[NSEQ] = {7, 7, 8, 8};

static int64_t id_at(int64_t i, int salt, int64_t E) { return (i * 7 + salt * 13) % E; }

static void write_npy(const char *name, rp_npy_dtype dtype, int32_t ndim, const int64_t *shape,
                      const void *data)
{
    rp_error err;
    if (rp_npy_write(tmp(name), dtype, ndim, shape, data, &err) != RP_OK) diag("%s", err.text);
}

/* Routing [T, L, K] of `dtype` holding id_at(i, salt, E). */
static void write_routing(const char *name, rp_npy_dtype dtype, int salt, int64_t E)
{
    static const int bytes[] = {1, 1, 2, 2, 4, 4, 8, 8};
    unsigned char buf[T * L * K * 8];
    for (int64_t i = 0; i < T * L * K; i++) {
        int64_t v = id_at(i, salt, E);
        memcpy(buf + i * bytes[dtype], &v, (size_t)bytes[dtype]); /* little-endian low bytes */
    }
    int64_t shape[3] = {T, L, K};
    write_npy(name, dtype, 3, shape, buf);
}

/* Step `step` of the trace at `path` holds id_at(salt, E) and the lengths above. */
static int check_step(rp_context *ctx, const char *path, int32_t step, int salt, int64_t E,
                      rp_id_width width, bool split)
{
    rp_trace *t;
    rp_error err;
    if (rp_trace_open(ctx, path, 0, &t, &err) != RP_OK) {
        diag("%s", err.text);
        return 0;
    }
    rp_batch *b = NULL;
    rp_routing r;
    int good = rp_trace_read_step(t, step, &b, &r, &err) == RP_OK;
    if (!good) diag("%s", err.text);
    good = good && r.width == width && r.num_layers == L && r.top_k == K &&
           rp_trace_step(t, step)->num_experts == E && rp_batch_num_tokens(b) == T;
    for (int64_t i = 0; good && i < T * L * K; i++) good &= rp_id_load(r.base, r.width, i) == id_at(i, salt, E);
    for (int s = 0; good && s < NSEQ; s++)
        good &= split ? rp_batch_prompt_lens(b)[s] == prompt[s] && rp_batch_response_lens(b)[s] == response[s]
                      : rp_batch_seq_len(b, s) == prompt[s] + response[s];
    rp_batch_free(b);
    rp_trace_close(t);
    return good;
}

int main(void)
{
    if (!temp_dir_make(tmpdir, sizeof tmpdir, "cli")) {
        printf("Bail out! mkdtemp failed\n");
        return 1;
    }
    if (access(BIN, X_OK) != 0) {
        ok(0, "the routepack binary exists at %s (build the routepack_cli target)", BIN);
        temp_dir_remove(tmpdir);
        return tap_done();
    }
    rp_context *ctx;
    rp_context_new(NULL, NULL, &ctx);
    char trace[512], want[2048];
    snprintf(trace, sizeof trace, "%s", tmp("t.rpt"));

    int64_t pairs[NSEQ * 2], totals[NSEQ], s1[1] = {NSEQ}, s2[2] = {NSEQ, 2};
    uint16_t p16[NSEQ], r16[NSEQ];
    for (int s = 0; s < NSEQ; s++) {
        pairs[2 * s] = prompt[s], pairs[2 * s + 1] = response[s];
        totals[s] = prompt[s] + response[s];
        p16[s] = (uint16_t)prompt[s], r16[s] = (uint16_t)response[s];
    }
    write_npy("lens.npy", RP_NPY_I64, 2, s2, pairs);
    write_npy("total.npy", RP_NPY_I64, 1, s1, totals);
    write_npy("prompt.npy", RP_NPY_U16, 1, s1, p16);
    write_npy("response.npy", RP_NPY_U16, 1, s1, r16);
    write_npy("groups.npy", RP_NPY_I32, 1, s1, groups);
    write_routing("r64.npy", RP_NPY_I64, 0, 64);

    /* import, info, validate */
    is_int(rp("trace import --routing %s --lens %s --group-ids %s --experts 64 --out %s", tmp("r64.npy"),
              tmp("lens.npy"), tmp("groups.npy"), trace), 0, "import int64 routing with (prompt, response) pairs");
    like(out, "wrote step 0 (4 sequences, 19 tokens, 4 layers, top-2, 64 experts, 1-byte ids); the trace has 1 step",
         "import says what it wrote");
    ok(check_step(ctx, trace, 0, 0, 64, RP_ID_U8, true), "the trace holds the ids, narrowed to 1 byte, and the lengths");
    {
        rp_trace *t = NULL;
        rp_batch *b = NULL;
        rp_routing r;
        int good = rp_trace_open(ctx, trace, 0, &t, NULL) == RP_OK;
        good = good && rp_trace_read_step(t, 0, &b, &r, NULL) == RP_OK;
        for (int s = 0; good && s < NSEQ; s++) good &= rp_batch_group_ids(b)[s] == groups[s];
        ok(good, "group ids imported");
        char hex[17];
        snprintf(hex, sizeof hex, "%016llx", good ? (unsigned long long)rp_trace_step(t, 0)->checksum : 0ULL);
        rp_batch_free(b);
        rp_trace_close(t);

        is_int(rp("trace info %s", trace), 0, "info");
        like(out, "t.rpt: 1 step,", "info counts the steps");
        const char *row = strstr(out, "\n    0 ");
        int idx = -1, seqs = 0, layers = 0, experts = 0, topk = 0, width = 0;
        long long step = -1, tokens = 0, payload = 0;
        char sum[32] = "";
        ok(row && sscanf(row, "%d %lld %d %lld %d %d %d %d %lld %31s", &idx, &step, &seqs, &tokens, &layers,
                         &experts, &topk, &width, &payload, sum) == 10 &&
           idx == 0 && step == 0 && seqs == NSEQ && tokens == T && layers == L && experts == 64 &&
           topk == K && width == 1 && payload % 64 == 0 && !strcmp(sum, hex),
           "info's row: index, step, sequences, tokens, layers, experts, top-k, width, payload bytes, checksum");

        is_int(rp("trace info --json %s", trace), 0, "info --json");
        json_error_t jerr;
        json_t *j = json_loads(out, 0, &jerr);
        ok(j != NULL, "info --json prints valid JSON");
        json_t *st0 = json_array_get(json_object_get(j, "steps"), 0);
        ok(json_integer_value(json_object_get(j, "num_steps")) == 1 &&
           json_integer_value(json_object_get(st0, "num_tokens")) == T &&
           json_integer_value(json_object_get(st0, "num_seqs")) == NSEQ &&
           json_integer_value(json_object_get(st0, "num_layers")) == L &&
           json_integer_value(json_object_get(st0, "num_experts")) == 64 &&
           json_integer_value(json_object_get(st0, "top_k")) == K &&
           json_integer_value(json_object_get(st0, "id_width")) == 1 &&
           json_integer_value(json_object_get(st0, "step")) == 0 &&
           json_integer_value(json_object_get(j, "file_bytes")) == file_size(trace) &&
           json_string_value(json_object_get(st0, "checksum")) &&
           !strcmp(json_string_value(json_object_get(st0, "checksum")), hex),
           "the JSON has the shape, file size and checksum");
        json_decref(j);
    }
    is_int(rp("trace validate %s", trace), 0, "validate");
    snprintf(want, sizeof want, "%s: 1 step, OK", trace);
    like(out, want, "validate says OK");

    /* --append: separate prompt/response arrays, 2-byte input, default step index */
    write_routing("r16.npy", RP_NPY_U16, 1, 64);
    is_int(rp("trace import --routing %s --prompt-lens %s --response-lens %s --experts 64 --append --out %s",
              tmp("r16.npy"), tmp("prompt.npy"), tmp("response.npy"), trace), 0, "append a step");
    like(out, "appended step 1", "the appended step follows the last step index");
    like(out, "the trace has 2 steps", "append reports the step count");
    ok(check_step(ctx, trace, 1, 1, 64, RP_ID_U8, true), "the appended step reads back");
    write_routing("r8.npy", RP_NPY_U8, 2, 64);
    is_int(rp("trace import --routing %s --lens %s --experts 64 --step 7 --append --out %s", tmp("r8.npy"),
              tmp("total.npy"), trace), 0, "append with --step and whole-sequence lengths");
    ok(check_step(ctx, trace, 2, 2, 64, RP_ID_U8, false), "1-d lengths: the sequence lengths are kept");
    is_int(rp("trace info --json %s", trace), 0, "info of 3 steps");
    {
        json_t *j = json_loads(out, 0, NULL);
        json_t *steps = json_object_get(j, "steps");
        ok(json_array_size(steps) == 3 &&
           json_integer_value(json_object_get(json_array_get(steps, 2), "step")) == 7 &&
           json_integer_value(json_object_get(json_array_get(steps, 2), "index")) == 2,
           "step indexes 0, 1, 7");
        json_decref(j);
    }
    is_int(rp("trace validate %s", trace), 0, "the 3-step trace validates");

    int64_t size = file_size(trace);
    {
        int64_t shape[3] = {T, L - 1, K};
        int64_t ids[T * (L - 1) * K];
        memset(ids, 0, sizeof ids);
        write_npy("r3.npy", RP_NPY_I64, 3, shape, ids);
    }
    is_int(rp("trace import --routing %s --lens %s --experts 64 --append --out %s", tmp("r3.npy"),
              tmp("lens.npy"), trace), 1, "append a step of another shape");
    like(out, "cannot append: the trace has 4 layers, top-2 and 64 experts; the new step has 3 layers",
         "shape mismatch message");
    is_int(rp("trace import --routing %s --lens %s --experts 65 --append --out %s", tmp("r64.npy"),
              tmp("lens.npy"), trace), 1, "append with another expert count");
    is_int(file_size(trace), size, "failed appends leave the trace as it was");
    is_int(rp("trace import --routing %s --lens %s --experts 64 --append --out %s", tmp("r64.npy"),
              tmp("lens.npy"), tmp("none.rpt")), 0, "append to a missing trace creates it");
    like(out, "wrote step 0", "as a new trace of one step");
    ok(check_step(ctx, tmp("none.rpt"), 0, 0, 64, RP_ID_U8, true), "which reads back");

    /* never replace or duplicate silently */
    size = file_size(trace);
    is_int(rp("trace import --routing %s --lens %s --experts 64 --out %s", tmp("r64.npy"),
              tmp("lens.npy"), trace), 1, "import onto an existing trace without --append");
    like(out, "t.rpt exists: pass --append to add to it, or --force to replace it",
         "the message says how to add or replace");
    is_int(file_size(trace), size, "the existing trace is untouched");
    is_int(rp("trace import --routing %s --lens %s --experts 64 --step 1 --append --out %s",
              tmp("r64.npy"), tmp("lens.npy"), trace), 1, "append a step index the trace holds");
    like(out, "t.rpt already holds step 1 (its step #1): pass another --step, or leave --step out "
         "to append step 8", "the duplicate message names the step and the next free index");
    is_int(file_size(trace), size, "the trace is untouched");
    is_int(rp("trace import --routing %s --lens %s --experts 64 --append --force --out %s",
              tmp("r64.npy"), tmp("lens.npy"), trace), 2, "--append with --force");
    is_int(rp("trace import --routing %s --lens %s --experts 64 --force --out %s", tmp("r64.npy"),
              tmp("lens.npy"), tmp("none.rpt")), 0, "--force replaces a trace");
    like(out, "the trace has 1 step", "with the one new step");

    /* Megatron's per-layer [layers, tokens, k] layout */
    {
        uint8_t per_layer[L * T * K];
        for (int64_t t = 0; t < T; t++)
            for (int64_t l = 0; l < L; l++)
                for (int64_t k = 0; k < K; k++)
                    per_layer[(l * T + t) * K + k] = (uint8_t)id_at((t * L + l) * K + k, 0, 64);
        int64_t shape[3] = {L, T, K};
        write_npy("ltk.npy", RP_NPY_U8, 3, shape, per_layer);
        per_layer[(2 * T + 6) * K + 1] = 70; /* layer 2, token 6 (sequence 0 token 6), choice 1 */
        write_npy("ltk_bad.npy", RP_NPY_U8, 3, shape, per_layer);
        int16_t wide[L * T * K];
        for (int64_t i = 0; i < L * T * K; i++) wide[i] = per_layer[i];
        wide[(2 * T + 6) * K + 1] = (int16_t)id_at((6 * L + 2) * K + 1, 0, 64);
        write_npy("ltk16.npy", RP_NPY_I16, 3, shape, wide);
    }
    is_int(rp("trace import --routing %s --lens %s --experts 64 --out %s", tmp("ltk.npy"),
              tmp("lens.npy"), tmp("ltk.rpt")), 1, "a per-layer array read as packed");
    like(out, "has 4 tokens, but the sequence lengths sum to 19; its second dimension matches: is it "
         "[layers, tokens, k]? pass --layout per_layer", "the message suggests --layout per_layer");
    is_int(rp("trace import --routing %s --lens %s --experts 64 --layout per_layer --out %s",
              tmp("ltk.npy"), tmp("lens.npy"), tmp("ltk.rpt")), 0, "--layout per_layer");
    ok(check_step(ctx, tmp("ltk.rpt"), 0, 0, 64, RP_ID_U8, true),
       "the trace holds the ids in [tokens, layers, k] order");
    is_int(rp("trace import --routing %s --lens %s --experts 64 --layout per_layer --out %s",
              tmp("ltk16.npy"), tmp("lens.npy"), tmp("ltk16.rpt")), 0, "--layout per_layer, 2-byte input");
    ok(check_step(ctx, tmp("ltk16.rpt"), 0, 0, 64, RP_ID_U8, true), "read in place with strides");
    is_int(rp("trace import --routing %s --lens %s --experts 64 --layout per_layer --out %s",
              tmp("ltk_bad.npy"), tmp("lens.npy"), tmp("ltk2.rpt")), 1, "a bad id in a per-layer array");
    like(out, "token 6 (sequence 0 token 6) layer 2 choice 1 has expert id 70",
         "its position is named in tokens and layers");
    is_int(rp("trace import --routing %s --lens %s --experts 64 --layout tokens --out %s",
              tmp("ltk.npy"), tmp("lens.npy"), tmp("ltk3.rpt")), 2, "an unknown layout");

    /* id widths: narrowest for the expert count, from any input width */
    write_routing("w300.npy", RP_NPY_U8, 3, 256);
    is_int(rp("trace import --routing %s --lens %s --experts 300 --out %s", tmp("w300.npy"), tmp("lens.npy"),
              tmp("w16.rpt")), 0, "1-byte input, 300 experts");
    like(out, "2-byte ids", "widened to 2-byte ids");
    {
        rp_trace *t = NULL;
        rp_batch *b = NULL;
        rp_routing r;
        int good = rp_trace_open(ctx, tmp("w16.rpt"), 0, &t, NULL) == RP_OK &&
                   rp_trace_read_step(t, 0, &b, &r, NULL) == RP_OK && r.width == RP_ID_U16 &&
                   rp_trace_step(t, 0)->num_experts == 300;
        for (int64_t i = 0; good && i < T * L * K; i++) good &= rp_id_load(r.base, r.width, i) == id_at(i, 3, 256);
        ok(good, "widened ids read back");
        rp_batch_free(b);
        rp_trace_close(t);
    }
    write_routing("big64.npy", RP_NPY_I64, 4, 70000);
    is_int(rp("trace import --routing %s --lens %s --experts 70000 --out %s", tmp("big64.npy"), tmp("lens.npy"),
              tmp("w32.rpt")), 0, "int64 input, 70000 experts");
    ok(check_step(ctx, tmp("w32.rpt"), 0, 4, 70000, RP_ID_I32, true), "4-byte ids from int64, read in place");
    write_routing("u32.npy", RP_NPY_U32, 5, 1000);
    is_int(rp("trace import --routing %s --lens %s --experts 1000 --out %s", tmp("u32.npy"), tmp("lens.npy"),
              tmp("w2.rpt")), 0, "uint32 input, 1000 experts");
    ok(check_step(ctx, tmp("w2.rpt"), 0, 5, 1000, RP_ID_U16, true), "2-byte ids from uint32");

    /* real NumPy files */
    is_int(rp("trace import --routing " DATA "routing_i8.npy --lens " DATA "lens_pairs.npy --group-ids " DATA
              "groups.npy --experts 64 --out %s", tmp("np.rpt")), 0, "import files written by NumPy");
    is_int(rp("trace validate %s", tmp("np.rpt")), 0, "and validate the result");
    {
        /* docs/formats.md shows this trace's header and first bytes: keep it true */
        FILE *f = fopen(RP_SOURCE_DIR "/docs/formats.md", "rb");
        static char doc[65536];
        size_t n = f ? fread(doc, 1, sizeof doc - 1, f) : 0;
        if (f) fclose(f);
        doc[n] = '\0';
        unsigned char head[512] = {0};
        f = fopen(tmp("np.rpt"), "rb");
        size_t got = f ? fread(head, 1, sizeof head, f) : 0;
        if (f) fclose(f);
        uint32_t hb;
        memcpy(&hb, head + 8, 4);
        char header[512] = "", line[160];
        if (got >= 16 + hb && hb < sizeof header) memcpy(header, head + 16, hb);
        const char *block = strstr(doc, "```json\n");
        ok(block && header[0] && !strncmp(block + 8, header, hb) && block[8 + hb] == '\n',
           "the header example in docs/formats.md is what the writer emits");
        snprintf(line, sizeof line, "00000000: %02x%02x %02x%02x %02x%02x %02x%02x %02x%02x %02x%02x %02x%02x %02x%02x",
                 head[0], head[1], head[2], head[3], head[4], head[5], head[6], head[7], head[8], head[9],
                 head[10], head[11], head[12], head[13], head[14], head[15]);
        like(doc, line, "the hex dump's first line in docs/formats.md is the file's");
        snprintf(line, sizeof line, "00000100: %02x%02x %02x%02x %02x%02x %02x%02x %02x%02x %02x%02x",
                 head[256], head[257], head[258], head[259], head[260], head[261], head[262], head[263],
                 head[264], head[265], head[266], head[267]);
        like(doc, line, "and so is its first payload line");
    }

    /* bad input: exit status 1, the destination untouched */
    int64_t before = file_size(trace);
    {
        int64_t ids[T * L * K];
        for (int64_t i = 0; i < T * L * K; i++) ids[i] = id_at(i, 0, 64);
        ids[(5 * L + 1) * K + 0] = 64; /* token 5 = sequence 0 token 5, layer 1, choice 0 */
        int64_t shape[3] = {T, L, K};
        write_npy("bad64.npy", RP_NPY_I64, 3, shape, ids);
        ids[(5 * L + 1) * K + 0] = 0;
        ids[(14 * L + 3) * K + 1] = -1; /* token 14 = sequence 3 token 2 */
        write_npy("neg64.npy", RP_NPY_I64, 3, shape, ids);
        ids[(14 * L + 3) * K + 1] = 0;
        memcpy(&ids[0], &(uint64_t){UINT64_MAX}, 8);
        write_npy("huge.npy", RP_NPY_U64, 3, shape, ids);
    }
    is_int(rp("trace import --routing %s --lens %s --experts 64 --force --out %s", tmp("bad64.npy"),
              tmp("lens.npy"), trace), 1, "an id out of range (even with --force)");
    like(out, "bad64.npy: token 5 (sequence 0 token 5) layer 1 choice 0 has expert id 64, but --experts is 64",
         "the message gives the position and the id");
    is_int(file_size(trace), before, "a failed import does not touch an existing trace");
    is_int(rp("trace validate %s", trace), 0, "which still validates");
    is_int(rp("trace import --routing %s --lens %s --experts 64 --out %s", tmp("neg64.npy"), tmp("lens.npy"),
              tmp("x.rpt")), 1, "a negative id");
    like(out, "token 14 (sequence 3 token 2) layer 3 choice 1 has expert id -1", "negative id message");
    is_int(rp("trace import --routing %s --lens %s --experts 64 --out %s", tmp("huge.npy"), tmp("lens.npy"),
              tmp("x.rpt")), 1, "a uint64 id above 2^63");
    like(out, "has expert id 18446744073709551615", "printed unsigned");
    ok(file_size(tmp("x.rpt")) < 0, "failed imports create no file");
    {
        int64_t wrong[NSEQ * 2];
        memcpy(wrong, pairs, sizeof wrong);
        wrong[7] += 1;
        write_npy("wrong.npy", RP_NPY_I64, 2, s2, wrong);
        wrong[7] = -2;
        write_npy("negl.npy", RP_NPY_I64, 2, s2, wrong);
        int64_t three[1] = {3};
        write_npy("three.npy", RP_NPY_I64, 1, three, totals);
        int64_t two[2] = {T, L * K};
        int64_t flat[T * L * K] = {0};
        write_npy("flat.npy", RP_NPY_I64, 2, two, flat);
    }
    is_int(rp("trace import --routing %s --lens %s --experts 64 --out %s", tmp("r64.npy"), tmp("wrong.npy"),
              tmp("x.rpt")), 1, "lengths that do not sum to the token count");
    like(out, "r64.npy: routing of shape (19, 4, 2) read as [tokens, layers, k] (--layout packed) "
         "has 19 tokens, but the sequence lengths sum to 20", "sum message");
    is_int(rp("trace import --routing %s --lens %s --experts 64 --out %s", tmp("r64.npy"), tmp("negl.npy"),
              tmp("x.rpt")), 1, "a negative length");
    like(out, "negl.npy: the response length of sequence 3 is -2, must be in [0, 2147483647]", "negative length message");
    is_int(rp("trace import --routing %s --prompt-lens %s --response-lens %s --experts 64 --out %s", tmp("r64.npy"),
              tmp("prompt.npy"), tmp("three.npy"), tmp("x.rpt")), 1, "prompt and response arrays of different lengths");
    like(out, "three.npy has 3 sequences, the other length arrays 4", "sequence count message");
    is_int(rp("trace import --routing %s --lens %s --experts 64 --out %s", tmp("flat.npy"), tmp("lens.npy"),
              tmp("x.rpt")), 1, "a 2-d routing array");
    like(out, "routing must have shape [tokens, layers, k] (--layout packed), got (19, 8)", "shape message");
    is_int(rp("trace import --routing " DATA "float32.npy --lens %s --experts 64 --out %s", tmp("lens.npy"),
              tmp("x.rpt")), 1, "a float routing array");
    like(out, "floating-point", "float message");
    is_int(rp("trace import --routing %s --lens %s --experts 1 --out %s", tmp("r64.npy"), tmp("lens.npy"),
              tmp("x.rpt")), 1, "top-k above the expert count");
    is_int(rp("trace import --routing %s --lens %s --experts 64 --out %s/nodir/x.rpt", tmp("r64.npy"),
              tmp("lens.npy"), tmpdir), 2, "an output directory that does not exist: a usage error");
    like(out, "nodir does not exist (No such file or directory); create it first", "named before any work");
    ok(file_size(tmp("x.rpt")) < 0 && leftover_temp_files() == 0, "no output and no temporary files left behind");

    /* corrupt traces */
    {
        FILE *f = fopen(trace, "r+b");
        fseek(f, -70, SEEK_END);
        int c = fgetc(f);
        fseek(f, -70, SEEK_END);
        fputc(c ^ 0x10, f);
        fclose(f);
    }
    is_int(rp("trace validate %s", trace), 1, "validate a corrupt trace");
    like(out, "payload checksum mismatch", "checksum message");
    is_int(rp("trace info %s", trace), 0, "info reads headers only");
    is_int(rp("trace info %s", tmp("missing.rpt")), 1, "info of a missing file");
    like(out, "missing.rpt: cannot open", "missing file message");
    is_int(rp("trace validate %s %s", tmp("np.rpt"), trace), 1, "validate several traces: one bad");
    like(out, "np.rpt: 1 step, OK", "the good one is reported");
    is_int(rp("trace info %s %s", tmp("np.rpt"), tmp("w2.rpt")), 0, "info of two traces");
    ok(strstr(out, "np.rpt: 1 step") && strstr(out, "w2.rpt: 1 step"), "both are listed");

    /* usage errors: exit status 2 */
    static const char *const usage[] = {
        "trace import",
        "trace import --routing r.npy --lens l.npy --out t.rpt",
        "trace import --routing r.npy --lens l.npy --experts abc --out t.rpt",
        "trace import --routing r.npy --lens l.npy --experts 0 --out t.rpt",
        "trace import --routing r.npy --lens l.npy --prompt-lens p.npy --experts 8 --out t.rpt",
        "trace import --routing r.npy --prompt-lens p.npy --experts 8 --out t.rpt",
        "trace import --routing r.npy --lens l.npy --experts 8 --step -1 --out t.rpt",
        "trace import --routing r.npy --lens l.npy --experts 8 --out t.rpt --frobnicate",
        "trace import --routing",
        "trace info",
        "trace info --bogus t.rpt",
        "trace validate",
        "trace validate --json t.rpt",
    };
    for (size_t u = 0; u < sizeof usage / sizeof usage[0]; u++)
        is_int(rp("%s", usage[u]), 2, "usage error: routepack %s", usage[u]);
    rp("trace import --routing r.npy --lens l.npy --experts abc --out t.rpt");
    like(out, "--experts expects an integer, got 'abc'", "usage message");

    rp_context_free(ctx);
    temp_dir_remove(tmpdir);
    return tap_done();
}
