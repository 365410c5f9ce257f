/* RoutePack: joint packing and expert placement for MoE RL training. One include for
 * the whole public API. */
#ifndef ROUTEPACK_H
#define ROUTEPACK_H

#include "routepack/base.h"
#include "routepack/config.h"
#include "routepack/executor.h"
#include "routepack/batch.h"
#include "routepack/trace.h"
#include "routepack/gen.h"
#include "routepack/stats.h"
#include "routepack/shift.h"
#include "routepack/gpu.h"
#include "routepack/remap.h"
#include "routepack/checksum.h"
#include "routepack/plan.h"
#include "routepack/cost.h"
#include "routepack/primitives.h"
#include "routepack/baseline.h"
#include "routepack/sched.h"
#include "routepack/migrate.h"
#include "routepack/joint.h"
#include "routepack/memory.h"
#include "routepack/virtual_experts.h"

#endif
