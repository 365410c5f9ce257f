"""Finding and loading libroutepack, and the ctypes declarations of the C API it uses
(core/include/routepack/*.h are the contract; the structs below mirror them field by field,
every field, which python/tests/test_struct_mirrors.py checks against rp_struct_size). The
one table of the binding's C functions: the required ones, then the scheduler's and the
migration executor's (each checked by the module that needs it) and the optional ones."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from ctypes import (POINTER, Structure, c_bool, c_char, c_char_p, c_double, c_int, c_int32,
                    c_int64, c_size_t, c_uint32, c_uint64, c_void_p)
from pathlib import Path

from . import errors

RP_ERROR_TEXT = 512

# ---- structs (field order and types exactly as in the headers) ----


class rp_error(Structure):
    _fields_ = [("status", c_int), ("line", c_int32), ("column", c_int32),
                ("offset", c_int64), ("sequence", c_int64), ("expert", c_int64),
                ("text", c_char * RP_ERROR_TEXT)]


class rp_routing(Structure):
    _fields_ = [("layout", c_int), ("width", c_int), ("num_layers", c_int32),
                ("top_k", c_int32), ("token_stride", c_int64), ("layer_stride", c_int64),
                ("k_stride", c_int64), ("base", c_void_p), ("bases", POINTER(c_void_p)),
                ("num_bases", c_int32)]


class rp_topology(Structure):
    _fields_ = [("num_nodes", c_int32), ("gpus_per_node", c_int32), ("num_gpus", c_int32),
                ("dp_size", c_int32), ("ep_size", c_int32), ("num_ep_groups", c_int32),
                ("slots", POINTER(c_int32)), ("speed", POINTER(c_double)),
                ("nvlink_bytes_per_s", c_double), ("nvlink_latency_s", c_double),
                ("net_bytes_per_s", c_double), ("net_latency_s", c_double),
                ("tensor_parallel_size", c_int32), ("expert_tensor_parallel_size", c_int32),
                ("expert_parallel_size", c_int32), ("physical_gpus_per_node", c_int32),
                ("physical_num_nodes", c_int32), ("pipeline_parallel_size", c_int32),
                ("virtual_pipeline_size", c_int32), ("pipeline_schedule", c_int),
                ("layers_per_stage", POINTER(c_int32)), ("stage_layer_begin", POINTER(c_int32)),
                ("context_parallel_size", c_int32)]


class rp_model(Structure):
    _fields_ = [("num_layers", c_int32), ("num_experts", c_int32), ("top_k", c_int32),
                ("hidden_size", c_int32), ("expert_ffn_size", c_int32),
                ("num_heads", c_int32), ("num_kv_heads", c_int32), ("head_dim", c_int32),
                ("bytes_per_param", c_int32), ("bytes_per_optimizer_state", c_int32),
                ("bytes_per_grad", c_int32), ("dense_params", c_int64),
                ("vocab_size", c_int32), ("dense_layers", c_int32), ("dense_ffn_size", c_int32)]


class rp_execution(Structure):
    # routepack/config.h: the enums are C ints.
    _fields_ = [("sync", c_int), ("overlap", c_int), ("dispatch_dedup", c_int),
                ("dispatch_bytes_per_element", c_int32), ("optimizer_sharding", c_int),
                ("staging_budget_bytes", c_int64), ("per_forward_balancing", c_int),
                ("combine_bytes_per_element", c_int32), ("executor", c_int),
                ("replica_grad_reduce", c_int), ("replica_grad_bytes_per_element", c_int32),
                ("host_s_per_layer", c_double), ("levers", c_uint32), ("extras_stacked", c_bool),
                ("extras_once", c_bool), ("extras_ahead", c_bool), ("expert_gemm", c_int)]


class rp_trainer(Structure):
    _fields_ = [("equal_sequences_per_rank", c_bool), ("microbatch_multiple", c_int32),
                ("nonempty_microbatches", c_bool), ("per_forward_balancer", c_bool),
                ("mini_batches", c_int32), ("epochs", c_int32), ("logprob_forwards", c_int32)]


class rp_limits(Structure):
    _fields_ = [("max_tokens_per_microbatch", c_int64), ("num_microbatches", c_int32),
                ("max_activation_bytes", c_double), ("activation_bytes_per_token", c_double)]


class rp_sched_options(Structure):
    # Only ever passed by pointer and filled by rp_sched_options_default: the reserved
    # tail keeps a library with fields appended after these (the header's append-only
    # rule) from writing past the end.
    _fields_ = [("policy", c_char_p), ("split", c_int), ("num_threads", c_int32),
                ("history", c_int32), ("max_instructions", c_int64), ("max_wall_s", c_double),
                ("max_memory_bytes", c_size_t), ("max_depth", c_int32), ("comm", c_void_p),
                ("params_json", c_char_p), ("seed", c_uint64),
                ("initial_placement", c_char_p), ("demote_after", c_int32),
                ("_tail_padding", c_int32),  # the C struct's, after demote_after
                ("_reserved", c_char * 504)]


class rp_cost_summary(Structure):
    _fields_ = [("step_s", c_double), ("lower_bound_s", c_double), ("ratio", c_double),
                ("attention_s", c_double), ("dispatch_s", c_double), ("expert_s", c_double),
                ("combine_s", c_double), ("grad_reduce_s", c_double),
                ("extra_copy_s", c_double), ("attention_imbalance", c_double),
                ("expert_imbalance", c_double), ("straggler_gpu", c_int32),
                ("straggler_mb", c_int32), ("straggler_layer", c_int32),
                ("straggler_side", c_int)]


class rp_shift_summary(Structure):
    _fields_ = [("choices", c_int64), ("changed", c_int64), ("fraction", c_double),
                ("max_layer_fraction", c_double), ("max_layer", c_int32),
                ("max_seq_fraction", c_double), ("max_seq", c_int32),
                ("max_expert_lost_fraction", c_double), ("max_expert_layer", c_int32),
                ("max_expert", c_int32)]


class rp_step_outside(Structure):
    _fields_ = [("lm_head_s", c_double), ("dense_layers_s", c_double), ("optimizer_s", c_double),
                ("dp_grad_s", c_double), ("logprob_s", c_double), ("total_s", c_double)]


class rp_step_report(Structure):
    _fields_ = [("step", c_int64), ("cost", rp_cost_summary), ("plan_wall_s", c_double),
                ("policy_work", c_int64), ("fallback", c_bool),
                ("fallback_reason", c_char * RP_ERROR_TEXT), ("swapped", c_bool),
                ("swap_error", c_char * RP_ERROR_TEXT), ("policy_name", c_char * 64),
                ("policy_version", c_char * 32), ("policy_hash", c_uint64),
                ("plan_hash", c_uint64), ("plan_from_rank", c_int32),
                ("ranks_disagreed", c_bool), ("experts_moved", c_int32),
                ("migration_bytes", c_double), ("migration_s", c_double),
                ("policy_wall_s", c_double), ("ranks_fell_back", c_int32),
                ("policy_cpu_s", c_double), ("has_decision", c_bool), ("persistence", c_double),
                ("persistence_observations", c_int32), ("predicted_saving_s", c_double),
                ("realised_scored", c_bool), ("realised_saving_s", c_double),
                ("fallback_checks", c_int32), ("fallback_check_changes", c_int32),
                ("has_shift", c_bool), ("shift", rp_shift_summary),
                ("failed_steps", c_int32), ("demoted", c_bool), ("demoted_to", c_char * 64),
                ("demote_error", c_char * RP_ERROR_TEXT), ("forward_s", c_double),
                ("outside", rp_step_outside)]


# migrate.h: RP_NUM_LINKS links, indexed by rp_link (an int-sized enum).
RP_NUM_LINKS = 3
LINK_NAMES = ("local", "nvlink", "net")   # RP_LINK_LOCAL, RP_LINK_NVLINK, RP_LINK_NET


class rp_migration_transfer(Structure):
    _fields_ = [("round", c_int32), ("layer", c_int32), ("expert", c_int32),
                ("src_gpu", c_int32), ("src_slot", c_int32), ("dst_gpu", c_int32),
                ("link", c_int), ("bytes", c_int64)]


class rp_migration_write(Structure):
    _fields_ = [("layer", c_int32), ("gpu", c_int32), ("slot", c_int32),
                ("transfer", c_int64)]


class rp_migration_summary(Structure):
    _fields_ = [("bytes", c_int64 * RP_NUM_LINKS), ("moved_bytes", c_int64),
                ("min_bytes", c_int64), ("transfers", c_int64), ("local_copies", c_int64),
                ("writes", c_int64), ("num_rounds", c_int32), ("layers_moved", c_int32),
                ("max_staging_bytes", c_int64), ("min_budget_bytes", c_int64),
                ("predicted_s", c_double)]


class rp_gpu_memory(Structure):
    # routepack/memory.h
    _fields_ = [("gpu", c_int32), ("expert_weight_bytes", c_double), ("expert_grad_bytes", c_double),
                ("expert_optimizer_bytes", c_double), ("dense_weight_bytes", c_double),
                ("dense_grad_bytes", c_double), ("dense_optimizer_bytes", c_double),
                ("extra_replicas", c_int64), ("extra_replica_bytes", c_double), ("staging_bytes", c_double),
                ("total_bytes", c_double), ("capacity_bytes", c_double), ("expert_optimizer_shards", c_int32),
                ("dense_optimizer_shards", c_int32), ("pipeline_stage", c_int32), ("stage_layers", c_int32),
                ("context_parallel_size", c_int32), ("activation_tokens", c_int64), ("activation_bytes", c_double)]


class rp_policy_info(Structure):
    _fields_ = [("name", c_char * 64), ("version", c_char * 32), ("api", c_int32),
                ("description", c_char * 256), ("path", c_char * 1024), ("hash", c_uint64),
                ("shadowed", c_bool)]


class rp_trace_step_info(Structure):
    _fields_ = [("step", c_int64), ("num_seqs", c_int32), ("num_tokens", c_int64),
                ("num_layers", c_int32), ("num_experts", c_int32), ("top_k", c_int32),
                ("width", c_int), ("checksum", c_uint64), ("offset", c_int64),
                ("payload_offset", c_int64), ("payload_bytes", c_int64)]


# ---- the migration executor (routepack/migrate.h; routepack.executor) ----


class rp_tensor(Structure):
    _fields_ = [("data", c_void_p), ("bytes", c_size_t), ("memory", c_int)]


class rp_transport_message(Structure):
    _fields_ = [("peer", c_int32), ("tag", c_int32), ("send", c_int32), ("payload", c_int32),
                ("buf", c_void_p), ("bytes", c_size_t)]


START_FN = ctypes.CFUNCTYPE(c_int32, c_void_p, POINTER(rp_transport_message), c_int32,
                            POINTER(c_int32), c_void_p, c_size_t)
WAIT_FN = ctypes.CFUNCTYPE(c_int32, c_void_p, c_double, POINTER(c_int32), c_void_p, c_size_t)
WAIT_ONE_FN = ctypes.CFUNCTYPE(c_int32, c_void_p, c_int32, c_double, POINTER(c_int32), c_void_p, c_size_t)
FINISH_FN = ctypes.CFUNCTYPE(c_int32, c_void_p)
ALLGATHER_FN = ctypes.CFUNCTYPE(c_int32, c_void_p, c_void_p, c_void_p, c_size_t, c_double,
                                c_void_p, c_size_t)
ALLOC_FN = ctypes.CFUNCTYPE(c_void_p, c_void_p, c_size_t)
FREE_FN = ctypes.CFUNCTYPE(None, c_void_p, c_void_p)
COPY_FN = ctypes.CFUNCTYPE(c_int32, c_void_p, c_void_p, c_void_p, c_size_t, c_int, c_double,
                           c_void_p, c_size_t)
CHECKSUM_FN = ctypes.CFUNCTYPE(c_int32, c_void_p, POINTER(c_void_p), POINTER(c_size_t), POINTER(c_int32),
                               c_int32, POINTER(c_uint64), c_double, c_void_p, c_size_t)


class rp_transport_callbacks(Structure):
    _fields_ = [("start", START_FN), ("wait", WAIT_FN), ("finish", FINISH_FN),
                ("allgather", ALLGATHER_FN), ("alloc", ALLOC_FN), ("free", FREE_FN),
                ("copy", COPY_FN), ("max_message_bytes", c_size_t), ("stream", c_void_p),
                ("checksum", CHECKSUM_FN), ("wait_one", WAIT_ONE_FN)]


class rp_migration_exec_options(Structure):
    _fields_ = [("timeout_s", c_double), ("staging", c_void_p), ("staging_bytes", c_size_t),
                ("ep_group", c_int32), ("exchange_timeout_s", c_double)]


class rp_migration_result(Structure):
    _fields_ = [("num_rounds", c_int32), ("rounds_committed", c_int32),
                ("bytes_sent", c_int64), ("bytes_received", c_int64), ("bytes_local", c_int64),
                ("slots_written", c_int64), ("staging_bytes", c_int64), ("seconds", c_double),
                ("failed_rank", c_int32), ("failed_layer", c_int32), ("failed_expert", c_int32),
                ("failed_peer", c_int32)]


class rp_slot_identity(Structure):
    _fields_ = [("layer", c_int32), ("expert", c_int32), ("version", c_uint64)]


class rp_migration_options(Structure):
    _fields_ = [("expert_bytes", POINTER(c_int64)), ("staging_budget_bytes", c_int64)]


LOG_FN = ctypes.CFUNCTYPE(None, c_void_p, c_int, c_char_p)

P = c_void_p          # opaque handles
PI32 = POINTER(c_int32)
PI64 = POINTER(c_int64)
PERR = POINTER(rp_error)

# name: (restype, argtypes). Every function the binding calls; a library without one of
# these is refused at load with the missing names.
_REQUIRED = {
    "rp_strerror": (c_char_p, [c_int]),
    "rp_error_clear": (None, [PERR]),
    "rp_struct_size": (c_size_t, [c_char_p]),
    "rp_context_new": (c_int, [c_void_p, c_void_p, POINTER(P)]),
    "rp_context_free": (None, [P]),
    "rp_context_set_log": (None, [P, LOG_FN, c_void_p, c_int]),
    "rp_text_free": (None, [P, c_void_p]),
    "rp_hash64": (c_uint64, [c_void_p, c_size_t, c_uint64]),
    # whether routing in GPU memory can be handed over (routepack/gpu.h)
    "rp_gpu_built": (c_int, []),
    "rp_gpu_count": (c_int, []),
    "rp_id_width_capacity": (c_int64, [c_int]),
    # virtual experts (per-forward balancing)
    "rp_vexp_new": (c_int, [P, c_int32, c_int32, POINTER(P), PERR]),
    "rp_vexp_free": (None, [P]),
    "rp_vexp_plan": (c_int, [P, PI32, PI32, PERR]),
    "rp_vexp_rank_load": (PI64, [P]),
    "rp_vexp_allocation": (PI64, [P]),
    "rp_vexp_slot_expert": (PI32, [P]),
    "rp_vexp_traffic": (PI64, [P]),
    "rp_vexp_num_virtual": (c_int32, [P]),
    "rp_vexp_pushes_out": (PI32, [P]),
    "rp_vexp_pushes_in": (PI32, [P]),
    # config
    "rp_config_load": (c_int, [P, c_char_p, POINTER(P), PERR]),
    "rp_config_parse": (c_int, [P, c_char_p, c_size_t, c_char_p, POINTER(P), PERR]),
    "rp_config_free": (None, [P]),
    "rp_config_topology": (POINTER(rp_topology), [P]),
    "rp_config_model": (POINTER(rp_model), [P]),
    "rp_config_execution": (POINTER(rp_execution), [P]),
    "rp_config_limits": (POINTER(rp_limits), [P]),
    "rp_config_trainer": (POINTER(rp_trainer), [P]),
    # batch
    "rp_batch_new": (c_int, [P, c_int32, PI32, PI32, PI32, POINTER(P), PERR]),
    "rp_batch_free": (None, [P]),
    "rp_batch_num_seqs": (c_int32, [P]),
    "rp_batch_num_tokens": (c_int64, [P]),
    "rp_batch_cu_seqlens": (PI64, [P]),
    "rp_batch_prompt_lens": (PI32, [P]),
    "rp_batch_response_lens": (PI32, [P]),
    "rp_batch_group_ids": (PI32, [P]),
    "rp_routing_check": (c_int, [POINTER(rp_routing), P, c_int32, PERR]),
    # plan
    "rp_plan_num_gpus": (c_int32, [P]),
    "rp_plan_num_microbatches": (c_int32, [P]),
    "rp_plan_ep_size": (c_int32, [P]),
    "rp_plan_num_layers": (c_int32, [P]),
    "rp_plan_num_experts": (c_int32, [P]),
    "rp_plan_context": (P, [P]),
    "rp_plan_has_packing": (c_bool, [P]),
    "rp_plan_num_seqs": (c_int32, [P]),
    "rp_plan_microbatch": (PI32, [P, c_int32, c_int32, PI32]),
    "rp_plan_microbatch_at": (c_int32, [P, c_int32, c_int32]),
    "rp_plan_has_microbatch_order": (c_bool, [P]),
    "rp_plan_has_placement": (c_bool, [P]),
    "rp_plan_total_slots": (c_int32, [P]),
    "rp_plan_slot_begin": (PI32, [P]),
    "rp_plan_logcnt": (c_int32, [P, c_int32, PI32]),
    "rp_plan_eplb_arrays": (c_int, [P, c_int32, PI32, PI32, PI32, PERR]),
    "rp_plan_num_extra_replicas": (c_int32, [P]),
    "rp_memory_gpu": (c_int, [P, P, c_int32, POINTER(rp_gpu_memory), PERR]),
    "rp_plan_extra_replica": (None, [P, c_int32, PI32, PI32, PI32, PI32]),
    "rp_plan_num_share_sets": (c_int32, [P]),
    "rp_plan_share_set": (POINTER(c_double), [P, c_int32, PI32, PI32, PI32, PI32]),
    "rp_plan_to_json": (c_int, [P, POINTER(c_void_p), POINTER(c_size_t), PERR]),
    "rp_plan_hash": (c_uint64, [P]),
}

# The scheduler's functions: required by Scheduler and list_policies (checked there, so
# that traces can be read with a library built without the scheduler).
_SCHED = {
    "rp_sched_options_default": (None, [POINTER(rp_sched_options)]),
    "rp_sched_new": (c_int, [P, P, POINTER(rp_sched_options), POINTER(P), PERR]),
    "rp_sched_free": (None, [P]),
    "rp_sched_errmsg": (c_char_p, [P]),
    "rp_sched_step": (c_int, [P, c_int64, P, POINTER(rp_routing), POINTER(P),
                              POINTER(POINTER(rp_step_report)), PERR]),
    "rp_sched_stage_policy": (c_int, [P, c_char_p, c_char_p, c_int64, PERR]),
    "rp_sched_plan": (P, [P]),
    "rp_sched_report_json": (c_int, [P, POINTER(c_void_p), POINTER(c_size_t), PERR]),
    "rp_policy_list": (c_int, [P, P, POINTER(POINTER(rp_policy_info)), PI32, PERR]),
    # a step's physical routing: the result keeps a copy of the borrowed plan
    "rp_plan_copy": (c_int, [P, POINTER(P), PERR]),
    "rp_plan_free": (None, [P]),
    "rp_remap": (c_int, [P, P, c_int32, P, POINTER(rp_routing), c_int, c_int32, PI32, PI64,
                         PERR]),
    "rp_remap_num_physical": (c_int32, [P, c_int32]),
    "rp_remap_physical_ep_rank": (c_int32, [P, c_int32, c_int32, c_int32]),
    # the distributed step (docs/distributed.md): statistics as bytes, a step from them,
    # one rank's remap
    "rp_stats_compute": (c_int, [P, P, POINTER(rp_routing), c_int32, c_int32, POINTER(P), PERR]),
    "rp_stats_free": (None, [P]),
    "rp_stats_num_seqs": (c_int32, [P]),
    "rp_stats_num_layers": (c_int32, [P]),
    "rp_stats_num_experts": (c_int32, [P]),
    "rp_stats_top_k": (c_int32, [P]),
    "rp_stats_num_tokens": (c_int64, [P]),
    "rp_stats_expert_load": (PI64, [P, c_int32]),
    "rp_stats_seq_hist": (None, [P, c_int32, c_int32, POINTER(c_uint32)]),
    "rp_stats_serialized_bytes": (c_size_t, [P]),
    "rp_stats_serialize": (c_int, [P, c_void_p, c_size_t, PERR]),
    "rp_stats_deserialize": (c_int, [P, c_void_p, c_size_t, POINTER(P), PERR]),
    "rp_stats_merge_serialized": (c_int, [P, c_int32, POINTER(c_void_p), POINTER(c_size_t),
                                          POINTER(PI32), c_int32, POINTER(P), PERR]),
    "rp_stats_merge_serialized_reusing": (c_int, [P, c_int32, POINTER(c_void_p), POINTER(c_size_t),
                                                  POINTER(PI32), c_int32, POINTER(P), PERR]),
    "rp_sched_step_stats": (c_int, [P, c_int64, P, P, POINTER(P),
                                    POINTER(POINTER(rp_step_report)), PERR]),
    "rp_sched_step_stats_take": (c_int, [P, c_int64, P, POINTER(P), POINTER(P),
                                         POINTER(POINTER(rp_step_report)), PERR]),
    "rp_remap_rank": (c_int, [P, P, c_int32, c_int32, P, POINTER(rp_routing), c_int, PI32, PI64,
                              PERR]),
    # the step's migration plan (migrate.h), copied into StepResult.migration
    "rp_sched_migration": (P, [P]),
    "rp_migration_plan_hash": (c_uint64, [P]),
    "rp_migration_plan_summary": (None, [P, POINTER(rp_migration_summary)]),
    "rp_migration_plan_num_layers": (c_int32, [P]),
    "rp_migration_plan_expert_bytes": (c_int64, [P, c_int32]),
    "rp_migration_plan_num_rounds": (c_int32, [P]),
    "rp_migration_plan_layer_round": (c_int32, [P, c_int32]),
    "rp_migration_plan_num_transfers": (c_int64, [P]),
    "rp_migration_plan_transfer": (c_int, [P, c_int64, POINTER(rp_migration_transfer), PERR]),
    "rp_migration_plan_num_writes": (c_int64, [P]),
    "rp_migration_plan_write": (c_int, [P, c_int64, POINTER(rp_migration_write), PERR]),
}

# The executor's functions: required by routepack.executor (require_executor), so that a
# library built without the callback executor still plans.
_EXECUTOR = {
    "rp_registry_new": (c_int, [P, c_int32, c_int32, POINTER(P), PERR]),
    "rp_registry_free": (None, [P]),
    "rp_registry_set": (c_int, [P, c_int32, c_int32, POINTER(rp_tensor), c_int32, PERR]),
    "rp_registry_expert_bytes": (c_int64, [P, c_int32]),
    "rp_registry_check": (c_int, [P, PERR]),
    "rp_registry_set_identity": (c_int, [P, c_int32, c_int32, POINTER(rp_slot_identity), PERR]),
    "rp_registry_identity": (c_int, [P, c_int32, c_int32, POINTER(rp_slot_identity), PERR]),
    "rp_registry_set_version": (None, [P, c_uint64]),
    "rp_transport_callback_new": (c_int, [P, POINTER(rp_transport_callbacks), c_void_p, c_int32,
                                          c_int32, c_int, POINTER(P), PERR]),
    "rp_transport_free": (None, [P]),
    "rp_transport_usable": (c_bool, [P]),
    "rp_migration_exec_defaults": (None, [POINTER(rp_migration_exec_options)]),
    "rp_migration_execute": (c_int, [P, P, P, POINTER(rp_migration_exec_options),
                                     POINTER(rp_migration_result), PERR]),
    "rp_sched_migration_failed": (c_int, [P, POINTER(rp_migration_result), PERR]),
    "rp_sched_set_migration_options": (c_int, [P, POINTER(rp_migration_options), PERR]),
}

_REQUIRED_MORE = {
    # traces
    "rp_trace_open": (c_int, [P, c_char_p, c_uint32, POINTER(P), PERR]),
    "rp_trace_close": (None, [P]),
    "rp_trace_num_steps": (c_int32, [P]),
    "rp_trace_step": (POINTER(rp_trace_step_info), [P, c_int32]),
    "rp_trace_read_step": (c_int, [P, c_int32, POINTER(P), POINTER(rp_routing), PERR]),
    "rp_trace_writer_open": (c_int, [P, c_char_p, c_int32, POINTER(P), PERR]),
    "rp_trace_writer_open_append": (c_int, [P, c_char_p, c_int32, POINTER(P), PERR]),
    "rp_trace_writer_append": (c_int, [P, c_int64, P, POINTER(rp_routing), PERR]),
    "rp_trace_writer_close": (c_int, [P, PERR]),
}

# Functions used when the library has them (checkpoint/resume of the scheduler state).
_OPTIONAL = {
    "rp_policy_describe": (c_int, [P, P, c_char_p, POINTER(c_void_p), POINTER(c_size_t), PERR]),
    "rp_sched_save_state": (c_int, [P, POINTER(c_void_p), POINTER(c_size_t), PERR]),
    "rp_sched_load_state": (c_int, [P, c_char_p, c_size_t, PERR]),
    # the placement a scheduler starts from (Scheduler.initial_placement)
    "rp_plan_new": (c_int, [P, P, c_int32, POINTER(P), PERR]),
    "rp_plan_set_contiguous": (c_int, [P, PERR]),
    "rp_plan_phy2log": (PI32, [P, c_int32]),
    # router shift (routepack/shift.h; routepack.shift)
    "rp_shift_compute": (c_int, [P, P, POINTER(rp_routing), POINTER(rp_routing), c_int32, c_int32,
                                 POINTER(P), PERR]),
    "rp_shift_free": (None, [P]),
    "rp_shift_num_seqs": (c_int32, [P]),
    "rp_shift_num_layers": (c_int32, [P]),
    "rp_shift_num_experts": (c_int32, [P]),
    "rp_shift_top_k": (c_int32, [P]),
    "rp_shift_choices": (c_int64, [P]),
    "rp_shift_changed": (c_int64, [P]),
    "rp_shift_layer_changed": (PI64, [P]),
    "rp_shift_seq_changed": (PI64, [P]),
    "rp_shift_seq_choices": (PI64, [P]),
    "rp_shift_expert_old": (PI64, [P]),
    "rp_shift_expert_lost": (PI64, [P]),
    "rp_shift_expert_arrived": (PI64, [P]),
    "rp_shift_summarize": (rp_shift_summary, [P]),
    "rp_sched_attach_shift": (c_int, [P, P, PERR]),
}

_lock = threading.Lock()
_loaded = None   # (CDLL, path) once loaded


def _package_dir():
    return Path(__file__).resolve().parent


def candidates():
    """The places searched for libroutepack, in order, as (where, path) pairs.

    1. $ROUTEPACK_LIBRARY, a path to the shared library (only it, when set).
    2. Next to this package: the copy `pip install` puts there from the CMake build.
    3. The repository's build/core/: found from the package's own location (a source
       checkout or an editable install) or the repository recorded at install time.
    4. The system's library path (`cmake --install` puts it in PREFIX/lib).
    """
    env = os.environ.get("ROUTEPACK_LIBRARY")
    if env:
        return [("$ROUTEPACK_LIBRARY", env)]
    here = _package_dir()
    out = []
    for name in ("libroutepack.so", "libroutepack.so.0"):
        out.append(("next to the package", str(here / name)))
    repos = []
    if (here.parent.parent / "core" / "include" / "routepack").is_dir():
        repos.append(here.parent.parent)      # a source checkout or an editable install
    try:
        from . import _build_info   # written by setup.py at install time
        if _build_info.SOURCE_DIR:
            repos.append(Path(_build_info.SOURCE_DIR))
    except ImportError:
        pass
    seen = set()
    for repo in repos:
        lib = repo / "build" / "core" / "libroutepack.so"
        if str(lib) not in seen:
            seen.add(str(lib))
            out.append(("the repository's build/core", str(lib)))
    found = ctypes.util.find_library("routepack")
    out.append(("the system library path", found or "libroutepack.so.0"))
    return out


def _declare(lib, table, optional):
    missing = []
    for name, (restype, argtypes) in table.items():
        fn = getattr(lib, name, None)
        if fn is None:
            if not optional:
                missing.append(name)
            continue
        fn.restype = restype
        fn.argtypes = argtypes
    return missing


def _prefer_torch_nccl():
    """Load the NCCL that PyTorch uses, if its wheel (nvidia-nccl) is installed, before
    libroutepack. A library built with the NCCL transport depends on libnccl.so.2, and the
    dynamic loader binds that name to whichever libnccl.so.2 the process loaded first: the
    toolkit's, loaded for libroutepack, made a later `import torch` fail (undefined
    symbol ncclCommResume, its NCCL being newer), and RoutePack's NCCL transport must in
    any case drive the trainer's communicators with the trainer's NCCL. Torch itself is
    not imported; nothing happens without the wheel."""
    try:
        import importlib.util
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "lib", "libnccl.so.2")
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                pass     # then the toolkit's NCCL serves libroutepack, as without torch
            return


def load():
    """The loaded library (a ctypes.CDLL); raises LibraryError naming every place tried."""
    global _loaded
    if _loaded is not None:
        return _loaded[0]
    with _lock:
        if _loaded is not None:
            return _loaded[0]
        _prefer_torch_nccl()
        # The first candidate that exists is the one: a library that is there but does
        # not load (a missing dependency, an undefined symbol, too old) is reported, not
        # silently replaced by another copy found later.
        tried = []
        for where, path in candidates():
            if "/" in path and not os.path.exists(path):
                tried.append("%s: %s (not there)" % (where, path))
                continue
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                tried.append("%s: %s (%s)" % (where, path, e))
                break
            missing = _declare(lib, {**_REQUIRED, **_REQUIRED_MORE}, optional=False)
            if missing:
                tried.append("%s: %s (too old or not RoutePack's: lacks %s)"
                             % (where, path, ", ".join(sorted(missing)[:5])))
                break
            _declare(lib, _OPTIONAL, optional=True)
            _declare(lib, _SCHED, optional=True)
            _declare(lib, _EXECUTOR, optional=True)
            _loaded = (lib, path)
            return lib
        raise errors.LibraryError(
            "libroutepack could not be loaded; build it first (cmake -S . -B build && cmake "
            "--build build) or set ROUTEPACK_LIBRARY to its path. Tried:\n  " + "\n  ".join(tried))


def path():
    """Path of the loaded library."""
    load()
    return _loaded[1]


def require_scheduler():
    """Raise LibraryError unless the loaded library has the scheduler."""
    lib = load()
    missing = sorted(n for n in _SCHED if getattr(lib, n, None) is None)
    if missing:
        raise errors.LibraryError("libroutepack at %s has no scheduler (lacks %s): rebuild it "
                                  "from a tree with core/sched.c and core/remap.c"
                                  % (_loaded[1], ", ".join(missing)))
    return lib


def require_executor():
    """Raise LibraryError unless the loaded library has the callback migration executor."""
    lib = load()
    missing = sorted(n for n in _EXECUTOR if getattr(lib, n, None) is None)
    if missing:
        raise errors.LibraryError("libroutepack at %s has no callback migration executor (lacks "
                                  "%s): rebuild it from this tree" % (_loaded[1], ", ".join(missing)))
    return lib


def has(name):
    """Whether the loaded library exports `name`."""
    return getattr(load(), name, None) is not None


def text(buf):
    """A NUL-terminated char array or pointer from C as str (errors replaced)."""
    if buf is None:
        return ""
    if isinstance(buf, bytes):
        return buf.decode("utf-8", "replace")
    return bytes(buf).split(b"\0", 1)[0].decode("utf-8", "replace")


def raise_error(status, err=None, message=None, cls=None):
    """Raise the exception for a failed call: `cls` if given (it keeps the status),
    else the class of the status; the text is err.text, else `message`, else
    rp_strerror(status)."""
    lib = load()
    msg = message
    where = {}
    if err is not None:
        if err.text[:1] != b"\0" and err.text:
            msg = text(err.text)
        where = dict(sequence=err.sequence if err.sequence >= 0 else None,
                     expert=err.expert if err.expert >= 0 else None,
                     line=err.line if err.line >= 0 else None,
                     column=err.column if err.column >= 0 else None,
                     offset=err.offset if err.offset >= 0 else None)
    if not msg:
        msg = text(lib.rp_strerror(int(status)))
    cls = cls or errors.class_for_status(status)
    raise cls(msg, int(status), **where)


def new_error():
    e = rp_error()
    load().rp_error_clear(ctypes.byref(e))
    return e


def take_text(ctx, ptr, length):
    """Copy text the library allocated through `ctx`, then free it."""
    try:
        return ctypes.string_at(ptr.value, length.value).decode("utf-8")
    finally:
        load().rp_text_free(ctx, ptr)
