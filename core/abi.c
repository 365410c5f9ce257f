/* rp_struct_size: the size of each public struct as this build lays it out, so that a
 * binding that mirrors the structs field by field (python/routepack's ctypes classes)
 * can check its mirror against the library it loads instead of reading past a field it
 * lacks. */
#include "routepack/routepack.h"

#include <string.h>

#define RP_STRUCT(name) {#name, sizeof(name)}

static const struct {
    const char *name;
    size_t size;
} structs[] = {
    RP_STRUCT(rp_error),
    RP_STRUCT(rp_hash_state),
    RP_STRUCT(rp_search_params),
    RP_STRUCT(rp_search_result),
    RP_STRUCT(rp_routing),
    RP_STRUCT(rp_topology),
    RP_STRUCT(rp_eff_point),
    RP_STRUCT(rp_backward),
    RP_STRUCT(rp_hardware),
    RP_STRUCT(rp_model),
    RP_STRUCT(rp_limits),
    RP_STRUCT(rp_execution),
    RP_STRUCT(rp_trainer),
    RP_STRUCT(rp_policy_config),
    RP_STRUCT(rp_cost_summary),
    RP_STRUCT(rp_step_outside),
    RP_STRUCT(rp_gen_info),
    RP_STRUCT(rp_joint_params),
    RP_STRUCT(rp_joint_report),
    RP_STRUCT(rp_gpu_memory),
    RP_STRUCT(rp_tensor),
    RP_STRUCT(rp_slot_identity),
    RP_STRUCT(rp_migration_options),
    RP_STRUCT(rp_migration_transfer),
    RP_STRUCT(rp_migration_write),
    RP_STRUCT(rp_migration_summary),
    RP_STRUCT(rp_migration_gpu),
    RP_STRUCT(rp_transport_message),
    RP_STRUCT(rp_transport_callbacks),
    RP_STRUCT(rp_migration_exec_options),
    RP_STRUCT(rp_migration_result),
    RP_STRUCT(rp_part_limits),
    RP_STRUCT(rp_place_input),
    RP_STRUCT(rp_comm),
    RP_STRUCT(rp_sched_options),
    RP_STRUCT(rp_step_report),
    RP_STRUCT(rp_policy_info),
    RP_STRUCT(rp_shift_summary),
    RP_STRUCT(rp_skew),
    RP_STRUCT(rp_trace_step_info),
};

size_t rp_struct_size(const char *name)
{
    if (!name) return 0;
    for (size_t i = 0; i < sizeof structs / sizeof structs[0]; i++)
        if (!strcmp(structs[i].name, name)) return structs[i].size;
    return 0;
}
