/* The sandbox's small accessors and setters: its work, limits, clock, the window a
 * rebuilt policy's call runs in, and the bytes the engine holds for the policy
 * (core/sandbox_internal.h; docs/sandbox.md). */
#include "sandbox_internal.h"

#include <math.h>

size_t rp_sandbox_memory_bytes(const rp_sandbox *sb) { return sb->mem_live; }

int64_t rp_sandbox_work(const rp_sandbox *sb) { return sb->work; }

const rp_sandbox_limits *rp_sandbox_limits_of(const rp_sandbox *sb) { return &sb->limits; }

void rp_sandbox_set_clock(rp_sandbox *sb, double (*clock_s)(void *ud), void *ud)
{
    sb->limits.clock_s = clock_s;
    sb->limits.clock_ud = ud;
}

void rp_sandbox_set_max_wall_s(rp_sandbox *sb, double max_wall_s)
{
    if (max_wall_s > 0 && isfinite(max_wall_s)) sb->limits.max_wall_s = max_wall_s;
}

double rp_sandbox_now(const rp_sandbox *sb) { return now_s(sb); }

void rp_sandbox_open_window(rp_sandbox *sb, double start)
{
    sb->deadline = start + sb->limits.max_wall_s;
    sb->window = true;
}

bool rp_sandbox_past_deadline(const rp_sandbox *sb) { return now_s(sb) > sb->deadline; }

void rp_sandbox_hold_bytes(rp_sandbox *sb, size_t bytes) { sb->held_bytes = bytes; }

size_t rp_sandbox_held_bytes(const rp_sandbox *sb) { return sb->held_bytes; }

void rp_sandbox_set_max_instructions(rp_sandbox *sb, int64_t max_instructions)
{
    sb->limits.max_instructions = max_instructions > 0 ? max_instructions : 1;
}
