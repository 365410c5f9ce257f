-- routepack: a first joint policy. It balances both sides of a step with one cost model:
--
-- 1. Packing balanced in attention AND tokens. The sequences are split into M
--    microbatches (the greedy two-criteria split), then each microbatch over the DP
--    ranks with `rounds` improvement rounds (rp.partition2: attention time and tokens at
--    once, within the token cap). Every microbatch runs in lockstep on all ranks, so what matters is
--    that each microbatch's attention is even across ranks; the tokens criterion keeps
--    every rank's expert dispatch even as well. M is the config's count, else the
--    fewest microbatches whose token cap holds the batch (one more while a split fails).
-- 2. Placement EPLB-like from this step's expert loads (rp.replicas + rp.place, per
--    layer), but migration-aware: the placement in use is kept unless the new one saves
--    more step time over `horizon` steps than moving the experts costs (rp.evaluate of
--    both plans, rp.migration of the new one).
-- 3. Local search (rp.local_search) on the cost model, within `search_evaluations`
--    candidate evaluations (work, not time); when the placement in use was kept, the
--    search moves sequences only, so it migrates nothing.
-- The next issue makes this policy strong; this one is sound and simple.

local P = {
  name = "routepack",
  version = "0.1.0",
  api = 1,
  description = "joint policy: attention- and token-balanced packing, migration-aware EPLB placement, local search",
  params = {
    rounds = {
      type = "integer", default = 10, min = 0, max = 1000,
      doc = "improvement rounds of each microbatch's two-criteria split over the ranks (rp.partition2)",
    },
    horizon = {
      type = "integer", default = 10, min = 1, max = 1000000,
      doc = "steps over which a new placement must pay back the time its migration takes",
    },
    search_evaluations = {
      type = "integer", default = 2000, min = 0, max = 10000000,
      doc = "candidates the local search evaluates (a work budget; 0: no search)",
    },
    placement_mode = {
      type = "string", default = "auto", values = {"auto", "global", "hierarchical"},
      doc = "EPLB mode: auto is hierarchical when the EP group spans whole nodes, else global",
    },
    num_microbatches = {
      type = "integer", default = 0, min = 0, max = 65536,
      doc = "microbatches per rank; 0: the config's limits.num_microbatches, or the fewest the token cap allows",
    },
  },
}

local function token_cap(limits)
  local cap = limits.max_tokens_per_microbatch
  local per_token, mem = limits.activation_bytes_per_token, limits.max_activation_bytes
  if mem > 0 and per_token > 0 then
    local t = math.floor(mem / per_token)
    while t > 0 and t * per_token > mem do t = t - 1 end
    if t < cap then cap = t end
  end
  return cap
end

-- packing[rank + 1][mb + 1] for M microbatches, or an error when a split cannot meet
-- the cap.
local function pack_into(ctx, M, attn, tok, cap)
  local G, rounds = ctx.topology.num_gpus, ctx.params.rounds
  -- the split into microbatches is the greedy alone: with few parts an improvement
  -- round scans every pair of items, and what matters is each microbatch's split
  local mbs = rp.partition2(attn, tok, M, {sizes = tok, cap = G * cap, rounds = 0})
  local packing = {}
  for g = 1, G do packing[g] = {} end
  for m = 1, M do
    local ids, a, t = mbs[m], {}, {}
    for j, s in ipairs(ids) do a[j] = attn[s + 1]; t[j] = tok[s + 1] end
    local ranks = rp.partition2(a, t, G, {sizes = t, cap = cap, rounds = rounds})
    for g = 1, G do
      local list = {}
      for _, j in ipairs(ranks[g]) do list[#list + 1] = ids[j + 1] end
      packing[g][m] = list
    end
  end
  return packing
end

local function pack(ctx)
  local G, n = ctx.topology.num_gpus, ctx.batch.num_seqs
  local len = ctx.batch.seq_len
  local cap = token_cap(ctx.limits)
  local attn, tok = {}, len:totable()
  for s = 0, n - 1 do attn[s + 1] = ctx.cost.attention(len[s]) end
  local fixed = ctx.params.num_microbatches
  if fixed == 0 then fixed = ctx.limits.num_microbatches end
  local M = fixed
  if M == 0 then M = math.max(1, math.ceil(ctx.batch.num_tokens / (G * cap))) end
  local most = fixed > 0 and fixed or math.max(M, n)
  while true do
    local ok, packing = pcall(pack_into, ctx, M, attn, tok, cap)
    if ok then return packing end
    if M >= most then error("routepack: no packing within the token cap: " .. tostring(packing)) end
    M = M + 1
  end
end

local function place(ctx)
  local topo, model = ctx.topology, ctx.model
  local ep, gpn = topo.ep_size, topo.gpus_per_node
  local nodes = (ep % gpn == 0) and ep / gpn or 1
  local mode = ctx.params.placement_mode
  if mode == "auto" then mode = (nodes == 1) and "hierarchical" or "global" end
  local placement = {}
  for layer = 0, model.num_layers - 1 do
    placement[layer + 1] = rp.place(ctx.stats.expert_load(layer), nil, {mode = mode, groups = 1})
  end
  return placement
end

function P.plan(ctx)
  local packing = pack(ctx)
  local fresh = rp.plan({packing = packing, placement = place(ctx)})
  local chosen, moved = fresh, true
  if ctx.placement then
    -- keep the placement in use unless the new one pays for its migration
    local keep = rp.plan({packing = packing, placement = ctx.placement.table()})
    local saving = rp.evaluate(keep).step_s - rp.evaluate(fresh).step_s
    local migration_s = rp.migration(fresh)
    if saving * ctx.params.horizon <= migration_s then chosen, moved = keep, false end
  end
  local budget = ctx.params.search_evaluations
  if budget > 0 then
    chosen = rp.local_search(chosen, {evaluations = budget, moves = true, swaps = true, slots = moved})
  end
  return chosen
end

return P
