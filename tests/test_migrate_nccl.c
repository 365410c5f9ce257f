/* The NCCL transport on one GPU: a self send/receive of device buffers through the
 * transport, its checksums (the GPU kernel, and the host fallback) against
 * rp_checksum_expert, an injected corruption, and the executor swapping registered
 * device buffers through device staging. Skips without NCCL in the build or without a
 * GPU. */
#include "routepack/routepack.h"
#include "tap.h"

#ifdef RP_HAVE_NCCL
#include "routepack/checksum.h"
#include "routepack/migrate_nccl.h"
#include "transport.h"

#include <stdlib.h>

#define CHECKS 25

static void fill(unsigned char *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)((i * 2654435761u + seed * 40503u) >> 13);
}

static void test_self_transfer(rp_transport *t)
{
    const size_t n = (3u << 20) + 17; /* more than the pinned bounce buffer, odd size */
    unsigned char *host = malloc(n), *back = malloc(n);
    fill(host, n, 7);
    void *src = NULL, *dst = NULL;
    cudaMalloc(&src, n);
    cudaMalloc(&dst, n);
    cudaMemset(dst, 0, n);
    rp_error err;
    double deadline = rp_now_s() + 30.0;
    ok(t->vt->from_host(t, src, host, n, deadline, &err) == RP_OK, "nccl: host to device");
    rp_transport_op ops[2] = {{0, 1, false, true, dst, n}, {0, 1, true, true, src, n}};
    int32_t failed = -1;
    rp_status st = t->vt->start(t, ops, 2, &failed, &err);
    if (st == RP_OK) st = t->vt->wait(t, deadline, &failed, &err);
    if (st != RP_OK) diag("%s", err.text);
    ok(st == RP_OK && t->vt->finish(t), "nccl: grouped self send and receive of a device buffer");
    /* Two experts in one call: the source cut into parts at an odd offset (a block
     * spans them, the second part is misaligned), the received buffer whole. */
    const size_t cut = 5001;
    const void *parts[3] = {src, (unsigned char *)src + cut, dst};
    const size_t part_bytes[3] = {cut, n - cut, n};
    const int32_t begin[3] = {0, 2, 3};
    const uint64_t want = rp_checksum_bytes(host, n);
    uint64_t sums[2] = {0, 0};
    int device_id = 0, pools = 0;
    cudaGetDevice(&device_id);
    cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device_id);
    ok(t->vt->checksum(t, parts, part_bytes, begin, 2, sums, deadline, &err) == RP_OK,
       "nccl: checksums of two experts of device memory in one call");
    /* still set after the call: the kernel ran (it clears on RP_ENOTSUP) */
    ok(t->device_checksum == (pools != 0), "nccl: the checksums ran %s (the device %s memory pools)",
       pools ? "on the GPU (rp_gpu_checksum)" : "through the host", pools ? "has" : "has no");
    is_int(sums[0], want, "nccl: the sent expert's checksum is rp_checksum_expert of its bytes");
    is_int(sums[1], want, "nccl: the received bytes have the sent checksum");
    /* The host fallback gives the same values. */
    bool device = t->device_checksum;
    t->device_checksum = false;
    uint64_t host_sums[2] = {0, 0};
    ok(t->vt->checksum(t, parts, part_bytes, begin, 2, host_sums, deadline, &err) == RP_OK &&
       host_sums[0] == want && host_sums[1] == want, "nccl: the host fallback through the pinned buffer agrees");
    t->device_checksum = device;
    ok(t->vt->to_host(t, back, dst, n, deadline, &err) == RP_OK && memcmp(back, host, n) == 0,
       "nccl: the received bytes are the sent bytes");
    /* A corrupted message: the receiver's kernel checksum sees the flipped byte. */
    cudaMemset(dst, 0, n);
    rp_fault f = {RP_FAULT_CORRUPT, 0, 0, false};
    rp_transport_set_fault(t, &f);
    st = t->vt->start(t, ops, 2, &failed, &err);
    if (st == RP_OK) st = t->vt->wait(t, deadline, &failed, &err);
    if (st != RP_OK) diag("%s", err.text);
    ok(st == RP_OK && t->vt->finish(t), "nccl: a send with an injected corruption completes");
    host[n / 2] ^= 0xff;
    uint64_t got = 0;
    const void *received = dst;
    const int32_t one[2] = {0, 1};
    ok(t->vt->checksum(t, &received, &n, one, 1, &got, deadline, &err) == RP_OK &&
       got == rp_checksum_bytes(host, n) && got != want,
       "nccl: the corrupted bytes' checksum is rp_checksum_expert of them, not the sent one");
    rp_transport_set_fault(t, NULL);
    cudaFree(src);
    cudaFree(dst);
    free(host);
    free(back);
}

/* Slots of the registry's device buffers that do not hold `rows`' experts. */
static int device_bad(const unsigned char *dev, const size_t *sizes, const int32_t *rows)
{
    unsigned char host[4096], want[4096];
    size_t off = 0;
    int bad = 0;
    for (int l = 0; l < 2; l++)
        for (int k = 0; k < 4; k++)
            for (int i = 0; i < 2; i++) {
                cudaMemcpy(host, dev + off, sizes[i], cudaMemcpyDeviceToHost);
                fill(want, sizes[i], (unsigned)(l * 100 + rows[4 * l + k] * 10 + i));
                bad += memcmp(host, want, sizes[i]) != 0;
                off += sizes[i];
            }
    return bad;
}

static void test_executor(rp_context *ctx, rp_transport *t)
{
    const char *json = "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 1, \"ep_size\": 1, \"slots_per_gpu\": 4},"
                       " \"model\": {\"num_layers\": 2, \"num_experts\": 4, \"top_k\": 1, \"hidden_size\": 8,"
                       " \"expert_ffn_size\": 4, \"num_heads\": 1, \"head_dim\": 8},"
                       " \"limits\": {\"max_tokens_per_microbatch\": 1024}}";
    rp_config *cfg = NULL;
    rp_config_parse(ctx, json, strlen(json), "<test>", &cfg, NULL);
    int32_t cur[8] = {0, 1, 2, 3, 0, 1, 2, 3}, tgt[8] = {3, 2, 1, 0, 1, 1, 3, 2};
    rp_plan *a = NULL, *b = NULL;
    rp_plan_new(ctx, cfg, 1, &a, NULL);
    rp_plan_new(ctx, cfg, 1, &b, NULL);
    for (int l = 0; l < 2; l++) {
        rp_plan_set_phy2log(a, l, cur + 4 * l, NULL);
        rp_plan_set_phy2log(b, l, tgt + 4 * l, NULL);
    }
    const size_t sizes[2] = {4096, 1000};
    unsigned char *dev = NULL;
    cudaMalloc((void **)&dev, 2 * 4 * (sizes[0] + sizes[1]));
    rp_registry *reg = NULL;
    rp_registry_new(ctx, 2, 4, &reg, NULL);
    unsigned char host[4096];
    size_t off = 0;
    for (int l = 0; l < 2; l++)
        for (int k = 0; k < 4; k++) {
            rp_tensor ts[2];
            for (int i = 0; i < 2; i++) {
                ts[i] = (rp_tensor){dev + off, sizes[i], RP_MEMORY_CUDA};
                fill(host, sizes[i], (unsigned)(l * 100 + cur[4 * l + k] * 10 + i));
                cudaMemcpy(dev + off, host, sizes[i], cudaMemcpyHostToDevice);
                off += sizes[i];
            }
            rp_registry_set(reg, l, k, ts, 2, NULL);
        }
    rp_registry_set_placement(reg, a, 0, 0, NULL);
    int64_t bytes[2] = {(int64_t)(sizes[0] + sizes[1]), (int64_t)(sizes[0] + sizes[1])};
    rp_migration_plan *mp = NULL;
    rp_migration_options o = {bytes, 0};
    rp_error err;
    ok(rp_migration_plan_new(ctx, cfg, a, b, &o, &mp, &err) == RP_OK, "nccl: a one-GPU migration plan");
    rp_migration_result res;
    rp_status st = rp_migration_execute(mp, reg, t, NULL, &res, &err);
    if (st != RP_OK) diag("%s", err.text);
    ok(st == RP_OK, "nccl: the executor swaps device slots through device staging");
    int bad = 0;
    off = 0;
    unsigned char want[4096];
    for (int l = 0; l < 2; l++)
        for (int k = 0; k < 4; k++)
            for (int i = 0; i < 2; i++) {
                cudaMemcpy(host, dev + off, sizes[i], cudaMemcpyDeviceToHost);
                fill(want, sizes[i], (unsigned)(l * 100 + tgt[4 * l + k] * 10 + i));
                bad += memcmp(host, want, sizes[i]) != 0;
                off += sizes[i];
            }
    is_int(bad, 0, "nccl: every device slot holds its target expert's bytes");
    ok(res.slots_written == 7 && res.rounds_committed == 1, "nccl: seven slots written in one round");
    ok(rp_transport_usable(t), "nccl: the transport is still usable");
    rp_slot_identity id;
    ok(rp_registry_identity(reg, 1, 0, &id, NULL) == RP_OK && id.expert == tgt[4],
       "nccl: a written slot's identity names its new expert");
    /* On to a third placement whose layer 1 fills two slots from one staged copy (undo
     * memory); first with staging corrupted after the check, then a failing write: the
     * device slots are written, checked, and swapped back. */
    int32_t next[8] = {0, 1, 2, 3, 2, 3, 1, 1};
    rp_plan *c = NULL;
    rp_plan_new(ctx, cfg, 1, &c, NULL);
    for (int l = 0; l < 2; l++) rp_plan_set_phy2log(c, l, next + 4 * l, NULL);
    rp_migration_plan *mp2 = NULL;
    rp_migration_plan_new(ctx, cfg, b, c, &o, &mp2, NULL);
    rp_transport_set_fault(t, &(rp_fault){RP_FAULT_CORRUPT_STAGING, 0, 0, false});
    st = rp_migration_execute(mp2, reg, t, NULL, &res, &err);
    is_int(st, RP_ECHECKSUM, "nccl: staging corrupted after the check is caught in the written slots");
    if (st != RP_ECHECKSUM) diag("%s", err.text);
    is_int(device_bad(dev, sizes, tgt), 0, "nccl: and every device slot was restored");
    ok(res.staging_bytes > 0 && rp_transport_usable(t), "nccl: the transport is still usable");
    rp_transport_set_fault(t, &(rp_fault){RP_FAULT_COMMIT_FAIL, 3, 0, false});
    st = rp_migration_execute(mp2, reg, t, NULL, &res, &err);
    ok(st == RP_ETRANSPORT && device_bad(dev, sizes, tgt) == 0,
       "nccl: a write failing at the commit's fourth slot: every device slot restored");
    rp_transport_set_fault(t, NULL);
    st = rp_migration_execute(mp2, reg, t, NULL, &res, &err);
    if (st != RP_OK) diag("%s", err.text);
    ok(st == RP_OK && device_bad(dev, sizes, next) == 0, "nccl: then the migration completes on the device");
    rp_migration_plan_free(mp2);
    rp_plan_free(c);
    rp_migration_plan_free(mp);
    rp_registry_free(reg);
    cudaFree(dev);
    rp_plan_free(a);
    rp_plan_free(b);
    rp_config_free(cfg);
}
#endif

int main(void)
{
#ifndef RP_HAVE_NCCL
    ok(!rp_transport_built("nccl"), "the library reports no NCCL transport");
    skip(1, "NCCL transport not built");
    return tap_done();
#else
    ok(rp_transport_built("nccl"), "the library has the NCCL transport");
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1) {
        skip(CHECKS - 1, "no GPU");
        return tap_done();
    }
    cudaSetDevice(0);
    rp_context *ctx;
    rp_context_new(NULL, NULL, &ctx);
    ncclComm_t comm;
    int dev = 0;
    cudaStream_t stream;
    cudaStreamCreate(&stream);
    ok(ncclCommInitAll(&comm, 1, &dev) == ncclSuccess, "nccl: a one-rank communicator");
    rp_transport *t = NULL;
    rp_error err;
    ok(rp_transport_nccl_new(ctx, comm, stream, &t, &err) == RP_OK && rp_transport_size(t) == 1 &&
       strcmp(rp_transport_name(t), "nccl") == 0, "nccl: transport over the communicator and stream");
    if (t) {
        test_self_transfer(t);
        test_executor(ctx, t);
    }
    rp_transport_free(t);
    ncclCommDestroy(comm);
    cudaStreamDestroy(stream);
    rp_context_free(ctx);
    return tap_done();
#endif
}
