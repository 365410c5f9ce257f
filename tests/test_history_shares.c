/* ctx.history.share_sum() (core/lua_views.c): each layer's loads over their total, summed
 * over the history's entries, in one C call. A probe policy compares it, every element
 * with ==, to the Lua loop over the views that the shipped routepack policy ran before
 * (so rp.joint gets the same numbers and routepack plans as it did), on steps with 0 to 3
 * entries of history, and compares the work charged for each way. */
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <stdio.h>
#include <string.h>

#define STEPS 4

/* The probe: `mode` 0 compares the two ways and errors on a difference; 1 runs the
 * Lua loop alone; 2 calls share_sum alone (for their work). */
static const char *probe(const gen_steps *g, int mode)
{
    char body[4096];
    snprintf(body, sizeof body,
             "local mode = %d\n"
             "local hist = ctx.history\n"
             "local L, E = ctx.model.num_layers, ctx.model.num_experts\n"
             "local function lua_loop()\n"
             "  local sum = {}\n"
             "  for i = 1, L * E do sum[i] = 0 end\n"
             "  for k = 1, #hist do\n"
             "    local entry = hist[k]\n"
             "    for l = 0, L - 1 do\n"
             "      local load = entry.expert_load(l)\n"
             "      local total = load:sum()\n"
             "      if total > 0 then\n"
             "        local base = l * E\n"
             "        for e = 0, E - 1 do sum[base + e + 1] = sum[base + e + 1] + load[e] / total end\n"
             "      end\n"
             "    end\n"
             "  end\n"
             "  return sum\n"
             "end\n"
             "if mode == 1 then lua_loop() return nil end\n"
             "local got = hist.share_sum()\n"
             "if mode == 2 then return nil end\n"
             "if #got ~= L * E then error('share_sum has ' .. #got .. ' numbers, want ' .. L * E) end\n"
             "local want = lua_loop()\n"
             "local any = false\n"
             "for i = 0, L * E - 1 do\n"
             "  if got[i] ~= want[i + 1] then\n"
             "    error(string.format('element %%d: %%.17g, the Lua loop %%.17g', i, got[i], want[i + 1]))\n"
             "  end\n"
             "  any = any or got[i] > 0\n"
             "end\n"
             "if (#hist > 0) ~= any then error('history of ' .. #hist .. ' entries, share_sum nonzero: ' .. tostring(any)) end\n"
             "return nil",
             mode);
    return gen_steps_body_policy(g, body);
}

/* The policy's work on each step (-1 where a step failed or fell back). */
static void run(const gen_steps *g, const char *policy, int64_t work[STEPS], bool *fine)
{
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.history = 3;
    rp_sched *s = gen_steps_sched(g, policy, NULL, &o);
    for (int t = 0; t < STEPS; t++) {
        const rp_plan *p = NULL;
        const rp_step_report *rep = NULL;
        rp_error err;
        work[t] = -1;
        if (!s || rp_sched_step(s, t, g->batches[t], &g->routings[t], &p, &rep, &err) != RP_OK) {
            diag("step %d: %s", t, s ? err.text : "no scheduler");
            *fine = false;
            continue;
        }
        if (rep->fallback) {
            diag("step %d: %s", t, rep->fallback_reason);
            *fine = false;
            continue;
        }
        work[t] = rep->policy_work;
    }
    rp_sched_free(s);
}

int main(void)
{
    gen_steps g;
    rp_error err;
    if (!gen_steps_load(&g, "history_shares", STEPS, &err)) {
        ok(0, "setup: %s", err.text);
        return tap_done();
    }
    bool fine = true;
    int64_t both[STEPS], loop[STEPS], call[STEPS];
    run(&g, probe(&g, 0), both, &fine);
    ok(fine, "on %d steps (0 to 3 entries of history) share_sum equals the Lua loop over the views bit for bit",
       STEPS);
    bool cheaper = true;
    run(&g, probe(&g, 1), loop, &cheaper);
    run(&g, probe(&g, 2), call, &cheaper);
    for (int t = 1; t < STEPS; t++) {
        /* the work of the calls alone: less the probe's own (step 0 has no history) */
        int64_t l = loop[t] - loop[0], c = call[t] - call[0];
        diag("step %d: the Lua loop %lld work units, share_sum %lld", t, (long long)l, (long long)c);
        cheaper &= c > 0 && 4 * c < l;
    }
    ok(cheaper, "and is charged under a quarter of the loop's work");

    /* a view like the others: indexed from 0, read-only */
    fine = true;
    run(&g,
        gen_steps_body_policy(&g, "if #ctx.history > 0 then\n"
                                  "  local v = ctx.history.share_sum()\n"
                                  "  if v[-1] ~= nil or v[#v] ~= nil or v[0] == nil then error('bounds') end\n"
                                  "  local ok = pcall(function() v[0] = 1 end)\n"
                                  "  if ok then error('writable') end\n"
                                  "end\n"
                                  "return nil"),
        both, &fine);
    ok(fine, "it is a read-only view indexed from 0");
    gen_steps_free(&g);
    return tap_done();
}
