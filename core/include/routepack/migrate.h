/* Expert migration: the registry of expert buffers a trainer owns, the minimal-move
 * migration plan between two placements, the transports, and the one executor that
 * moves the bytes all-or-nothing. The contract (when to call, what a failure leaves
 * behind, staging memory) is in docs/migration.md. The MPI and NCCL transports are
 * created through routepack/migrate_mpi.h and routepack/migrate_nccl.h. */
#ifndef ROUTEPACK_MIGRATE_H
#define ROUTEPACK_MIGRATE_H

#include "routepack/config.h"
#include "routepack/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- registry ----
 * Per MoE layer and per local expert slot of THIS rank, the buffers that make up the
 * expert held there: weights, optimizer moments, master weights. RoutePack never owns
 * them; it reads them to send, and writes them only when a migration commits. */

typedef enum rp_memory {
    RP_MEMORY_HOST = 0,  /* ordinary host memory (in-process and MPI transports) */
    RP_MEMORY_CUDA = 1   /* CUDA device memory of the current device (NCCL transport) */
} rp_memory;

typedef struct rp_tensor {
    void *data;
    size_t bytes;
    rp_memory memory;
} rp_tensor;

typedef struct rp_registry rp_registry;

/* An empty registry for `num_layers` MoE layers and `num_slots` local slots (this
 * rank's slot count: slot_begin[j + 1] - slot_begin[j] for EP rank j). Errors: counts
 * below 1 or so large that the table overflows. */
RP_API rp_status rp_registry_new(rp_context *ctx, int32_t num_layers, int32_t num_slots,
                                 rp_registry **out, rp_error *err);
RP_API void rp_registry_free(rp_registry *reg);
RP_API int32_t rp_registry_num_layers(const rp_registry *reg);
RP_API int32_t rp_registry_num_slots(const rp_registry *reg);

/* Register (or re-register) the `count` tensors of one (layer, local slot); the array
 * is copied, the buffers are borrowed and must stay valid while the registry is used.
 * Every slot of a layer has the same tensors: the first slot registered at a layer sets
 * the count, each tensor's byte size and memory kind, and every later one must match
 * ("registry: layer 3 slot 5 tensor 1 is 4096 bytes, but layer 3's tensor 1 is 8192
 * bytes (as registered for slot 0)"). Errors (nothing changes): ids out of range, a
 * count below 1 or above 64, a NULL pointer, an empty tensor, a layout mismatch. */
RP_API rp_status rp_registry_set(rp_registry *reg, int32_t layer, int32_t slot,
                                 const rp_tensor *tensors, int32_t count, rp_error *err);
/* The tensors of (layer, slot) (borrowed until the next rp_registry_set on it), NULL
 * with *count 0 when it is not registered. */
RP_API const rp_tensor *rp_registry_tensors(const rp_registry *reg, int32_t layer,
                                            int32_t slot, int32_t *count);
/* Bytes of one expert at `layer` (all its tensors); -1 when nothing is registered
 * there. Pass these to rp_migration_options.expert_bytes. */
RP_API int64_t rp_registry_expert_bytes(const rp_registry *reg, int32_t layer);
/* Check that every (layer, slot) is registered and that no two registered tensors
 * overlap. Errors name the first problem. */
RP_API rp_status rp_registry_check(const rp_registry *reg, rp_error *err);

/* ---- slot identity ----
 * What a slot claims to hold: the expert of which layer, at which version of the
 * weights. The executor trusts no byte it cannot name: before moving it checks that
 * every slot of this rank holds what the migration plan's current placement says
 * (rp_migration_plan_slot_expert), so a plan made for other weights, or run again after
 * a migration that did not finish everywhere, is refused before anything moves; after
 * a commit it checks the written slots' bytes against their source checksums and sets
 * their identity. Set it once when the weights are loaded (rp_registry_set_placement
 * from the placement they start in), and the version after every optimizer step that
 * changes them (rp_registry_set_version); the executor keeps it from then on.
 * rp_registry_set does not change it (re-registering reallocated buffers keeps what
 * they hold). */

#define RP_SLOT_UNKNOWN (-2)  /* expert of a slot whose identity was never set */

typedef struct rp_slot_identity {
    int32_t layer;     /* the MoE layer whose expert the slot's bytes are */
    int32_t expert;    /* the logical expert; -1: no expert (junk); RP_SLOT_UNKNOWN */
    uint64_t version;  /* the caller's version of the weights (e.g. the optimizer step;
                          0 if unused); every slot holding an expert must be at the same
                          version on every rank when a migration starts, and a slot a
                          migration writes takes its source's */
} rp_slot_identity;

/* Set what (layer, slot) holds. Errors (nothing changes): indices out of range, an
 * identity layer out of range, an expert below RP_SLOT_UNKNOWN. */
RP_API rp_status rp_registry_set_identity(rp_registry *reg, int32_t layer, int32_t slot,
                                          const rp_slot_identity *id, rp_error *err);
/* What (layer, slot) holds now (RP_SLOT_UNKNOWN before it was set). Errors: indices out
 * of range. */
RP_API rp_status rp_registry_identity(const rp_registry *reg, int32_t layer, int32_t slot,
                                      rp_slot_identity *out, rp_error *err);
/* Every slot of this rank (EP rank `ep_rank`) holds the expert `plan` places there,
 * at `version`. Errors (nothing changes): a plan without placement or of another
 * shape than the registry. */
RP_API rp_status rp_registry_set_placement(rp_registry *reg, const rp_plan *plan, int32_t ep_rank,
                                           uint64_t version, rp_error *err);
/* Every slot's version becomes `version` (after an optimizer step). */
RP_API void rp_registry_set_version(rp_registry *reg, uint64_t version);

/* ---- migration plan ---- */

/* The link a copy uses. */
typedef enum rp_link {
    RP_LINK_LOCAL = 0,   /* inside one GPU: a slot-to-slot copy through staging */
    RP_LINK_NVLINK = 1,  /* another GPU of the same node */
    RP_LINK_NET = 2      /* a GPU of another node */
} rp_link;
#define RP_NUM_LINKS 3

typedef struct rp_migration_options {
    /* [num_layers] bytes of one expert at each layer (every tensor the registry holds
     * for it: rp_registry_expert_bytes). NULL: the model's at every layer, its weights
     * and the receiver's shard of its optimizer state (rp_memory_expert_move_bytes). */
    const int64_t *expert_bytes;
    /* Staging memory each GPU may use at once, in bytes; 0: no limit (one round, the
     * whole migration all-or-nothing). A round holds whole layers, so the budget must
     * be at least the largest staging one layer needs on one GPU (RP_ERANGE). */
    int64_t staging_budget_bytes;
} rp_migration_options;

/* One copy of one expert. Copies between GPUs and copies inside one GPU both stage the
 * bytes at the destination; a staged copy may fill several slots of its GPU. */
typedef struct rp_migration_transfer {
    int32_t round;
    int32_t layer;
    int32_t expert;
    int32_t src_gpu, src_slot;   /* local slot index on the source GPU */
    int32_t dst_gpu;
    rp_link link;
    int64_t bytes;
} rp_migration_transfer;

/* One slot written at commit: local slot `slot` of GPU `gpu` at `layer` receives the
 * bytes staged by transfer `transfer`. */
typedef struct rp_migration_write {
    int32_t layer;
    int32_t gpu, slot;
    int64_t transfer;
} rp_migration_write;

/* Figures of a migration plan. Bytes count every EP group and layer. */
typedef struct rp_migration_summary {
    int64_t bytes[RP_NUM_LINKS];  /* bytes copied, by link (RP_LINK_LOCAL: inside a GPU) */
    int64_t moved_bytes;          /* bytes between GPUs: bytes[NVLINK] + bytes[NET] */
    int64_t min_bytes;            /* the least bytes between GPUs any migration to the
                                     target needs (docs/migration.md); moved == min */
    int64_t transfers;            /* copies between GPUs */
    int64_t local_copies;         /* copies inside a GPU */
    int64_t writes;               /* slots written at commit */
    int32_t num_rounds;
    int32_t layers_moved;         /* layers with at least one slot written */
    int64_t max_staging_bytes;    /* the most staging one GPU uses in one round */
    int64_t min_budget_bytes;     /* the smallest staging budget this migration admits */
    double predicted_s;           /* docs/migration.md, "Predicted time" */
} rp_migration_summary;

/* What one GPU (DP rank) sends and receives, by link (RP_LINK_LOCAL counts in both), the
 * staging it needs (its largest round) and its predicted busy time (per round, its
 * busiest EP rank's: docs/migration.md, "Predicted time"). */
typedef struct rp_migration_gpu {
    int64_t sent[RP_NUM_LINKS];
    int64_t received[RP_NUM_LINKS];
    int64_t staging_bytes;
    double predicted_s;
} rp_migration_gpu;

typedef struct rp_migration_plan rp_migration_plan;

/* Plan the move from the placement of `current` to that of `target` (packings are not
 * read) on the machine of `cfg`: every slot whose expert does not change keeps it; a
 * slot that needs an expert gets it from its own GPU if any slot there holds it, else
 * from a GPU of the same node, else from the least-loaded GPU of another node (load =
 * bytes that GPU already sends over that link in the round; ties to the lowest GPU id),
 * always inside its own EP group; one copy per (GPU, expert) serves every slot of that
 * GPU that needs it. Transfers are grouped into rounds of whole layers that fit the
 * staging budget. Under pipeline parallelism (topology.pipeline_parallel_size PP > 1) the
 * placements are one stage's and the plan spans the pipeline: its GPUs are the DP ranks
 * of every stage, stage s's being [s * num_gpus, (s + 1) * num_gpus) of the config's
 * num_gpus (Megatron's tp-cp-ep-dp-pp order), a layer's copies run between the GPUs of
 * the stage holding it, each stage fills its own rounds with its own layers, and round k
 * of every stage runs at once (its time is the busiest GPU of any stage). Deterministic:
 * the same inputs give the same plan (and hash) on every
 * rank. `opts` NULL: the defaults. Errors (nothing allocated): a plan without placement
 * or shaped for another config, expert ids out of range (RP_EINVAL); a target expert
 * held nowhere in the current placement (RP_EPLAN); non-positive expert bytes
 * (RP_EINVAL); a budget below what one layer needs on one GPU, or sizes that overflow
 * (RP_ERANGE). */
RP_API rp_status rp_migration_plan_new(rp_context *ctx, const rp_config *cfg,
                                       const rp_plan *current, const rp_plan *target,
                                       const rp_migration_options *opts,
                                       rp_migration_plan **out, rp_error *err);
RP_API void rp_migration_plan_free(rp_migration_plan *mp);

/* XXH64 of the plan's whole content; ranks compare it before moving anything. */
RP_API uint64_t rp_migration_plan_hash(const rp_migration_plan *mp);
RP_API void rp_migration_plan_summary(const rp_migration_plan *mp, rp_migration_summary *out);
/* Per-GPU figures. Errors: gpu out of range. */
RP_API rp_status rp_migration_plan_gpu(const rp_migration_plan *mp, int32_t gpu,
                                       rp_migration_gpu *out, rp_error *err);

/* GPUs (DP ranks) of the plan: the config's num_gpus times the pipeline stages. */
RP_API int32_t rp_migration_plan_num_gpus(const rp_migration_plan *mp);
RP_API int32_t rp_migration_plan_ep_size(const rp_migration_plan *mp);
RP_API int32_t rp_migration_plan_num_layers(const rp_migration_plan *mp);
/* Local slots of EP rank `ep_rank` (0 when out of range). */
RP_API int32_t rp_migration_plan_num_slots(const rp_migration_plan *mp, int32_t ep_rank);
RP_API int64_t rp_migration_plan_expert_bytes(const rp_migration_plan *mp, int32_t layer);
RP_API int32_t rp_migration_plan_num_rounds(const rp_migration_plan *mp);
/* The round that moves `layer`; -1 when the layer moves nothing (or is out of range).
 * Layers of one round commit together. */
RP_API int32_t rp_migration_plan_layer_round(const rp_migration_plan *mp, int32_t layer);
/* The expert local slot `slot` of EP rank `ep_rank` holds at `layer` in the current
 * placement (`target` false) or the target one (true); -1 for an empty slot, -2 for
 * indices out of range. Part of the plan's hash. */
RP_API int32_t rp_migration_plan_slot_expert(const rp_migration_plan *mp, int32_t layer, int32_t ep_rank,
                                             int32_t slot, bool target);

/* Added after the first version. Pipeline stages (1 without PP) and the stage holding
 * `layer` (its GPUs are [stage * num_gpus / num_stages, ...); -1 when out of range). A
 * GPU holds, and the executor checks and writes, only its stage's layers. */
RP_API int32_t rp_migration_plan_num_stages(const rp_migration_plan *mp);
RP_API int32_t rp_migration_plan_layer_stage(const rp_migration_plan *mp, int32_t layer);

/* Transfers in execution order: by round, then layer, EP group, destination EP rank and
 * slot. Writes likewise. Index errors: RP_EINVAL. */
RP_API int64_t rp_migration_plan_num_transfers(const rp_migration_plan *mp);
RP_API rp_status rp_migration_plan_transfer(const rp_migration_plan *mp, int64_t i,
                                            rp_migration_transfer *out, rp_error *err);
RP_API int64_t rp_migration_plan_num_writes(const rp_migration_plan *mp);
RP_API rp_status rp_migration_plan_write(const rp_migration_plan *mp, int64_t i,
                                         rp_migration_write *out, rp_error *err);

/* ---- transports ----
 * A transport connects the ranks that execute a migration: rank r is GPU r (or, for a
 * transport over one EP group, EP rank r of that group). One transport serves one
 * executor call at a time. Freeing it does not free what it was created on (a hub, an
 * MPI communicator, an NCCL communicator). */

typedef struct rp_transport rp_transport;

RP_API void rp_transport_free(rp_transport *t);
RP_API int32_t rp_transport_rank(const rp_transport *t);
RP_API int32_t rp_transport_size(const rp_transport *t);
/* "local", "mpi", "nccl" or "callback". */
RP_API const char *rp_transport_name(const rp_transport *t);
/* Whether this build has the transport of that name (local and callback always; mpi
 * and nccl when the library was built with them). */
RP_API bool rp_transport_built(const char *name);
/* False after a failure that left the transport unusable (a collective that timed
 * out, an aborted NCCL communicator); every later call fails. */
RP_API bool rp_transport_usable(const rp_transport *t);

/* In-process transport: ranks are threads of one process that share a hub. Create one
 * hub for `size` ranks, then one transport per rank (each used by its own thread). The
 * hub must outlive its transports. */
typedef struct rp_local_hub rp_local_hub;
RP_API rp_status rp_local_hub_new(rp_context *ctx, int32_t size, rp_local_hub **out,
                                  rp_error *err);
RP_API void rp_local_hub_free(rp_local_hub *hub);
RP_API rp_status rp_transport_local_new(rp_local_hub *hub, int32_t rank, rp_transport **out,
                                        rp_error *err);

/* Callback transport: the caller's communication library moves the bytes (routepack.torch
 * passes torch.distributed from Python). The executor drives it as any transport, so
 * its agreement, checksums and all-or-nothing rounds apply unchanged. */

/* One point-to-point message of a batch. Messages between one pair of ranks with the
 * same tag must be matched in the order they were started (as MPI, NCCL and gloo do). */
typedef struct rp_transport_message {
    int32_t peer;     /* transport rank */
    int32_t tag;      /* 0 .. 32767 */
    int32_t send;     /* 1: send `bytes` from buf; 0: receive `bytes` into buf */
    int32_t payload;  /* 1: expert bytes; 0: a header (checksums, counts) */
    void *buf;        /* transport memory; valid until finish */
    size_t bytes;     /* >= 1 */
} rp_transport_message;

/* Which way a copy callback moves bytes. */
typedef enum rp_copy_kind {
    RP_COPY_DEVICE = 0,     /* transport memory to transport memory */
    RP_COPY_TO_HOST = 1,    /* transport memory to host memory */
    RP_COPY_FROM_HOST = 2   /* host memory to transport memory */
} rp_copy_kind;

/* The callbacks (`ud` is the pointer given to rp_transport_callback_new). A fallible one
 * returns RP_OK or an rp_status (any other value counts as RP_ETRANSPORT) and may write
 * a NUL-terminated reason into `why` (`why_bytes` bytes), which becomes the error text.
 * Callbacks run on the thread that called rp_migration_execute. */
typedef struct rp_transport_callbacks {
    /* Start every message of a batch without waiting for any (at most one batch is in
     * flight). On failure, *failed may name the message (index into msgs). Whatever
     * happens, finish is called before the next batch. */
    int32_t (*start)(void *ud, const rp_transport_message *msgs, int32_t n, int32_t *failed,
                     char *why, size_t why_bytes);
    /* Wait until every message of the batch completed, at most `timeout_s` seconds:
     * RP_ETIMEOUT when one is still pending (*failed: its index, or -1). */
    int32_t (*wait)(void *ud, double timeout_s, int32_t *failed, char *why, size_t why_bytes);
    /* Forget the batch: completed, or abandoned after a failure. Return 1 when no
     * buffer of the batch is written after this returns, 0 when a receive may still
     * write one (the transport is then unusable, and the executor never frees that
     * buffer). */
    int32_t (*finish)(void *ud);
    /* Every rank contributes `bytes` host bytes at `mine`; `all` receives size * bytes,
     * rank-major; at most `timeout_s` seconds. A failure leaves the transport unusable
     * (a collective cannot be taken back). */
    int32_t (*allgather)(void *ud, const void *mine, void *all, size_t bytes, double timeout_s,
                         char *why, size_t why_bytes);
    /* Memory callbacks: all three NULL for host memory (the context's allocator and
     * memcpy); all three set for any other memory (CUDA). alloc returns NULL on failure. */
    void *(*alloc)(void *ud, size_t bytes);
    void (*free)(void *ud, void *ptr);
    int32_t (*copy)(void *ud, void *dst, const void *src, size_t bytes, rp_copy_kind kind,
                    double timeout_s, char *why, size_t why_bytes);
    /* Largest message the callbacks take; larger payloads are split. 0: no limit. */
    size_t max_message_bytes;
    /* CUDA memory: the cudaStream_t the callbacks queue their copies on (NULL: the
     * default stream). Expert checksums then run on the device on this stream, after
     * the copies queued there (rp_gpu_checksum); without a usable device, through host
     * copies. Appended after the first version; ignored for host memory. */
    void *stream;
    /* Optional (NULL: none): the checksums of `n` experts, computed by the caller where
     * the bytes are (routepack.torch: torch ops on the tensors' device, no host copy).
     * Expert i is the concatenation of parts part_begin[i] .. part_begin[i + 1] - 1
     * (part_ptr[p], part_bytes[p] bytes, in the transport's memory); sums[i] (host) must
     * be rp_checksum_expert of those bytes (routepack/checksum.h). Used for CUDA memory
     * where the checksum kernel cannot run (instead of host copies), and for host memory
     * whenever set. Returns RP_OK or a status with `why`. Appended after `stream`. */
    int32_t (*checksum)(void *ud, const void *const *part_ptr, const size_t *part_bytes,
                        const int32_t *part_begin, int32_t n, uint64_t *sums, double timeout_s,
                        char *why, size_t why_bytes);
    /* Optional (NULL: none): wait until message `index` of the batch completed (a
     * receive's bytes are in its buffer), at most `timeout_s` seconds, with the same
     * statuses as wait. With it, and host memory without memory callbacks or checksum
     * callback, the executor commits each received expert as it arrives, while later
     * messages are still on the way; wait is still called for the whole batch after.
     * Appended after `checksum`. */
    int32_t (*wait_one)(void *ud, int32_t index, double timeout_s, int32_t *failed, char *why,
                        size_t why_bytes);
} rp_transport_callbacks;

/* A transport whose messages, exchanges and (optionally) memory go through `cb` (the
 * struct is copied; `ud` is borrowed and passed to every callback). `rank` of `size`
 * ranks; `memory`: the kind of every buffer it moves (the registry's). Checksums of
 * CUDA memory run on the device (rp_gpu_checksum on cb->stream) where it can, else
 * through cb->checksum where set, else on host copies made with the copy callback;
 * every way they equal rp_checksum_expert.
 * rp_transport_free calls finish on a batch still in flight,
 * never anything else. Errors (RP_EINVAL): a required callback missing, memory
 * callbacks only partly set or missing for CUDA memory, rank or size out of range. */
RP_API rp_status rp_transport_callback_new(rp_context *ctx, const rp_transport_callbacks *cb,
                                           void *ud, int32_t rank, int32_t size,
                                           rp_memory memory, rp_transport **out, rp_error *err);

/* ---- executor ---- */

typedef struct rp_migration_exec_options {
    /* Bound on every wait (a round's transfers, each exchange between ranks), seconds;
     * 0: 60. A deadline passed is RP_ETIMEOUT. */
    double timeout_s;
    /* Staging buffer the caller provides (memory of the transport's kind), or NULL to
     * let the transport allocate it (host: the context's allocator; NCCL: cudaMalloc)
     * for the duration of the call. Must hold rp_migration_gpu.staging_bytes of this
     * rank (RP_ERANGE otherwise). */
    void *staging;
    size_t staging_bytes;
    /* For a transport that spans one EP group (its size is ep_size, not num_gpus): that
     * group, counted over the plan's GPUs (under PP group q of stage s is s * groups of a
     * stage + q). Ignored for a transport over every GPU. */
    int32_t ep_group;
    /* Bound on each exchange between ranks (the agreement before anything moves, a
     * round's outcome, its commit), seconds, counted from when this rank was due there;
     * 0: timeout_s. An exchange that times out leaves the transport unusable (a
     * collective cannot be taken back), so this should cover how far apart the ranks
     * reach the call and each exchange (a slower step, a busy host), while timeout_s
     * bounds the transfers, and so how soon a lost message is noticed. */
    double exchange_timeout_s;
} rp_migration_exec_options;

/* Fill the defaults: timeout 60 s, no caller staging, ep_group -1. */
RP_API void rp_migration_exec_defaults(rp_migration_exec_options *opts);

/* What an execution did on this rank. The failure fields are the same on every rank. */
typedef struct rp_migration_result {
    int32_t num_rounds;
    int32_t rounds_committed;   /* rounds < this are in the target placement */
    int64_t bytes_sent, bytes_received, bytes_local;  /* this rank, committed rounds */
    int64_t slots_written;
    int64_t staging_bytes;      /* staging this rank held, with the undo memory of a
                                   staged copy that fills several of its slots */
    double seconds;             /* wall time of the call */
    int32_t failed_rank;        /* -1 when it succeeded */
    int32_t failed_layer, failed_expert, failed_peer;  /* -1 when unknown */
} rp_migration_result;

/* Execute a migration plan. Call on every rank of the transport with the same plan,
 * this rank's registry (its local slots, the plan's expert bytes per layer, the slot
 * identities: rp_registry_set_placement) and the transport. Steps: (1) the ranks
 * exchange the plan hash, registry layout, call count and weights' version, and each
 * checks that its slots hold what the plan's current placement says; any mismatch or
 * local problem (no memory included) is an error on every rank before anything moves
 * ("migration: rank 2 has plan hash 0x..., rank 0 has 0x..."); (2) per round, every
 * expert copy goes into staging, never into a live slot, after a header that carries
 * each copy's identity and source checksum (rp_checksum_expert, routepack/checksum.h; on
 * NCCL by the GPU kernel that equals it) and its own checksum; (3) each destination
 * checks every header; (4) a rank whose round went well so far swaps the staged bytes
 * into its slots (keeping the old ones to undo with) and checks the written slots
 * against the source checksums, its one pass over the received bytes; (5) the ranks
 * exchange that once: the round stays only if every rank wrote and checked it, and the
 * written slots take their new identity; otherwise every rank restores its slots. A
 * failure anywhere in a round (transport error, timeout, checksum mismatch, corrupt or
 * stale header, no memory, a failed write) leaves that round's old bytes on every rank,
 * and the error, the same on every rank, names the rank, layer and expert ("migration:
 * rank 1: layer 3 expert 17 from rank 0: checksum mismatch ..."). With several rounds,
 * rounds before the failed one stay committed (result says how many;
 * rp_migration_plan_layer_round maps layers to rounds). The one exception, a rank that
 * cannot learn the outcome of an exchange, returns RP_ETIMEOUT saying to end the job
 * (docs/migration.md, "The one window"). Under PP transport rank r is the plan's GPU r
 * (every stage's DP ranks), and a rank's registry needs only its stage's layers
 * (rp_migration_plan_layer_stage): the checks, layout and moves skip the others, which
 * it may leave unregistered. `opts` NULL: defaults; `result` may be NULL.
 * Nothing is printed. See docs/migration.md. */
RP_API rp_status rp_migration_execute(const rp_migration_plan *mp, rp_registry *reg,
                                      rp_transport *t, const rp_migration_exec_options *opts,
                                      rp_migration_result *result, rp_error *err);

#ifdef __cplusplus
}
#endif
#endif
