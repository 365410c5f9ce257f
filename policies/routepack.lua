-- routepack: the joint policy. It balances both sides of a step with one cost model
-- (docs/routepack-policy.md):
--
-- 1. Packing: sequences longest first, each into the (rank, microbatch) cell that raises
--    a surrogate of the step least: the slowest GPU's attention and tokens in each
--    microbatch, each EP group's tokens, and the responses of one prompt kept apart
--    (they share routing). Long sequences end up together, every microbatch balanced.
-- 2. Placement per layer from this step's loads, judged per (microbatch, EP group):
--    EPLB-style replicas, node-aware, improved by replica moves; migration-aware: a
--    layer is re-placed only when its saving over `horizon` steps beats the time to
--    migrate it, else the placement in use stays or moves only the replicas that pay.
-- 3. Per microbatch: token shares between replicas (free) and extra replicas copied
--    over NVLink where they pay for the copy.
-- 4. Exact local search within `search_evaluations` tries (work, not time), and the
--    baselines checked: when one scores better under the cost model, it is returned.
--
-- All of it is one C primitive, rp.joint. Where the engine does not offer it, the policy
-- composes the same idea from the primitives (two-criteria packing, migration-aware
-- EPLB placement, local search).

local P = {
  name = "routepack",
  version = "0.2.0",
  api = 1,
  description = "joint policy: attention-, token- and expert-balanced packing, migration-aware placement with per-microbatch shares and replicas, checked against the baselines",
  params = {
    rounds = {
      type = "integer", default = 10, min = 0, max = 1000,
      doc = "without rp.joint: improvement rounds of each microbatch's two-criteria split over the ranks (rp.partition2)",
    },
    horizon = {
      type = "integer", default = 10, min = 1, max = 1000000,
      doc = "steps over which a new placement must pay back the time its migration takes",
    },
    search_evaluations = {
      type = "integer", default = 0, min = 0, max = 10000000,
      doc = "candidates the exact local search evaluates (a work budget; 0: no search)",
    },
    placement_mode = {
      type = "string", default = "auto", values = {"auto", "global", "hierarchical"},
      doc = "without rp.joint: EPLB mode; auto is hierarchical when the EP group spans whole nodes, else global",
    },
    num_microbatches = {
      type = "integer", default = 0, min = 0, max = 65536,
      doc = "microbatches per rank; 0: the config's limits.num_microbatches, or the fewest the token cap allows",
    },
    prompt_spread = {
      type = "number", default = 0.5, min = 0, max = 100,
      doc = "weight of a second response of one prompt in the same microbatch and EP group",
    },
    place_rounds = {
      type = "integer", default = 4, min = 0, max = 1000,
      doc = "placement improvement rounds per layer against the per-microbatch, per-group loads",
    },
    shares = {
      type = "boolean", default = true,
      doc = "set per-microbatch token shares between an expert's replicas",
    },
    max_extra_per_rank = {
      type = "integer", default = 1, min = 0, max = 64,
      doc = "extra replicas an EP rank may receive for one microbatch and layer (0: none)",
    },
    balance_evaluations = {
      type = "integer", default = 0, min = 0, max = 10000000,
      doc = "candidate sequence trades between EP groups (profile mixing; a work budget)",
    },
    fallbacks = {
      type = "boolean", default = true,
      doc = "check the plan against the four baselines and return the best under the cost model",
    },
  },
}

local FALLBACKS = {"token_kk+contiguous", "token_kk+eplb", "verl_kk+eplb", "attn_kk+eplb"}

-- The loads a new placement will meet over the coming steps: the mean of the past
-- steps' loads (ctx.history), each step weighted alike. A placement fitted to this
-- step's own noise gains nothing on them; one that follows a lasting shift does. nil
-- without history (the planner then takes this step's loads).
local function expected_loads(ctx)
  local hist = ctx.history
  if not hist or #hist == 0 then return nil end
  local L, E = ctx.model.num_layers, ctx.model.num_experts
  local sum = {}
  for i = 1, L * E do sum[i] = 0 end
  for k = 1, #hist do
    local entry = hist[k]
    for l = 0, L - 1 do
      local load = entry.expert_load(l)
      local total = load:sum()
      if total > 0 then
        local base = l * E
        for e = 0, E - 1 do sum[base + e + 1] = sum[base + e + 1] + load[e] / total end
      end
    end
  end
  return sum
end

local function joint(ctx)
  local p = ctx.params
  local plan = rp.joint({
    num_microbatches = p.num_microbatches,
    prompt_spread = p.prompt_spread,
    place_rounds = p.place_rounds,
    shares = p.shares,
    max_extra_per_rank = p.max_extra_per_rank,
    balance_evaluations = p.balance_evaluations,
    horizon = p.horizon,
    refine_evaluations = p.search_evaluations,
    fallbacks = p.fallbacks and FALLBACKS or {},
    expected_loads = expected_loads(ctx),
  })
  return plan
end

-- ---- without rp.joint: the same idea from the primitives ----

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

local function composed(ctx)
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
  if ctx.params.fallbacks then
    -- never worse than a baseline under the cost model (migration spread over the horizon)
    local function total(plan)
      local s = rp.evaluate(plan).step_s
      if ctx.placement then s = s + rp.migration(plan) / ctx.params.horizon end
      return s
    end
    local best, best_s = chosen, total(chosen)
    for _, name in ipairs(FALLBACKS) do
      local b = rp.baseline(name)
      local s = total(b)
      if s < best_s then best, best_s = b, s end
    end
    chosen = best
  end
  return chosen
end

function P.plan(ctx)
  if rp.joint then return joint(ctx) end
  return composed(ctx)
end

return P
