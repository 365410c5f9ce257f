-- eplb_periodic: EPLB as production inference and training systems run it. Placement
-- only; the packing stays as it is (pair it: "token_kk+eplb_periodic").
--
-- vLLM (`eplb_config.window_size`, `step_interval`) and SGLang
-- (`--eplb-rebalance-num-iterations`) record every step's expert loads and re-place only
-- every `interval` steps, from the loads summed over a window of recent steps, keeping
-- resident experts where they are. Between rebalances the placement in use stays: nothing
-- migrates.
--
-- 1. Every step this step's per-layer expert loads go into a window kept in ctx.state
--    (the scheduler's ctx.history is shorter than a long window).
-- 2. At a rebalance (the first step when `at_start`, then every `interval` steps), each
--    layer is placed by DeepSeek EPLB (rp.place: replicas apportioned by load per
--    replica, balanced packing, hierarchical when it applies, as the `eplb` policy) from
--    the window's summed loads (this step's included when `current`).
-- 3. Residents kept: EPLB numbers EP ranks arbitrarily, so each new rank's experts are
--    relabelled onto the EP rank of the placement in use that already holds most of them
--    (greedy on the overlap, only between ranks with the same slot count and the same
--    node position, so the node layout is unchanged); the engine then renumbers slots so
--    that every expert that stays on its rank keeps its slot.
-- docs/baselines.md, "Placement: eplb_periodic".

local P = {
  name = "eplb_periodic",
  version = "1.0.0",
  api = 1,
  description = "EPLB every `interval` steps from a window of recorded loads, residents kept (vLLM / SGLang style)",
  params = {
    interval = {
      type = "integer", default = 10, min = 1, max = 1000000,
      doc = "steps between rebalances (vLLM step_interval, SGLang eplb-rebalance-num-iterations)",
    },
    window = {
      type = "integer", default = 10, min = 1, max = 1000,
      doc = "past steps whose expert loads are summed at a rebalance (vLLM window_size)",
    },
    current = {
      type = "boolean", default = true,
      doc = "count this step's loads in the window (routing replay knows them before the step)",
    },
    at_start = {
      type = "boolean", default = true,
      doc = "rebalance at the first step too (from the loads seen so far); false: first after `interval` steps",
    },
    mode = {
      type = "string", default = "auto", values = {"auto", "global", "hierarchical"},
      doc = "EPLB's mode; auto: hierarchical when the EP group's nodes divide the expert groups, else global",
    },
    groups = {
      type = "integer", default = 1, min = 1, max = 65536,
      doc = "expert groups (EPLB's num_groups); must divide the expert count",
    },
  },
}

function P.init(ctx)
  -- calls: steps planned; since: steps since the last rebalance; loads: the window, a
  -- ring of {L * E} lists (1-based: layer l expert e at l * E + e + 1); head: next slot
  ctx.state.calls = 0
  ctx.state.since = 0
  ctx.state.loads = {}
  ctx.state.head = 1
end

local function record(ctx, L, E)
  local st, w = ctx.state, ctx.params.window
  local flat = {}
  for l = 0, L - 1 do
    local load, base = ctx.stats.expert_load(l), l * E
    for e = 0, E - 1 do flat[base + e + 1] = load[e] end
  end
  st.loads[st.head] = flat
  st.head = st.head % w + 1
end

-- The loads of the window, summed: the last `window` recorded steps (this one last when
-- it was recorded).
local function window_sum(ctx, L, E)
  local sum = {}
  for i = 1, L * E do sum[i] = 0 end
  for _, flat in pairs(ctx.state.loads) do
    for i = 1, L * E do sum[i] = sum[i] + flat[i] end
  end
  return sum
end

-- EP rank positions that may swap labels: equal slot counts and the same node position
-- inside the EP group, so the node layout (hierarchical placement) is unchanged.
local function rank_class(topo, j)
  local gpn, ep = topo.gpus_per_node, topo.ep_size
  local node = ep > gpn and math.floor(j / gpn) or 0
  return topo.slots[j] * 65536 + node
end

-- Relabel `ranks` (one layer: ranks[j + 1] = experts of EP rank j) so that each list
-- lands on the rank in use that holds most of its experts: greedy on the overlap,
-- largest first, ties to the lower new rank, then the lower old rank.
local function relabel(ctx, layer, ranks)
  local topo, ep = ctx.topology, ctx.topology.ep_size
  local where = {} -- expert -> list of old ranks holding it
  for j = 0, ep - 1 do
    for _, e in ipairs(ctx.placement.experts(layer, j)) do
      local w = where[e + 1]
      if not w then w = {}; where[e + 1] = w end
      w[#w + 1] = j
    end
  end
  local pairs_list = {}
  for a = 0, ep - 1 do
    local overlap = {}
    for _, e in ipairs(ranks[a + 1]) do
      local w = where[e + 1]
      if w then for _, b in ipairs(w) do overlap[b + 1] = (overlap[b + 1] or 0) + 1 end end
    end
    local ca = rank_class(topo, a)
    for b = 0, ep - 1 do
      local o = overlap[b + 1]
      if o and rank_class(topo, b) == ca then pairs_list[#pairs_list + 1] = {o, a, b} end
    end
  end
  table.sort(pairs_list, function(x, y)
    if x[1] ~= y[1] then return x[1] > y[1] end
    if x[2] ~= y[2] then return x[2] < y[2] end
    return x[3] < y[3]
  end)
  local to, taken = {}, {}
  for _, p in ipairs(pairs_list) do
    local a, b = p[2], p[3]
    if not to[a + 1] and not taken[b + 1] then to[a + 1] = b; taken[b + 1] = true end
  end
  -- ranks with no overlap: free ranks of the same class, in order
  for a = 0, ep - 1 do
    if not to[a + 1] then
      local ca = rank_class(topo, a)
      for b = 0, ep - 1 do
        if not taken[b + 1] and rank_class(topo, b) == ca then to[a + 1] = b; taken[b + 1] = true; break end
      end
    end
  end
  local out = {}
  for a = 0, ep - 1 do out[to[a + 1] + 1] = ranks[a + 1] end
  return out
end

function P.plan(ctx)
  local st, p = ctx.state, ctx.params
  local topo, model = ctx.topology, ctx.model
  local L, E = model.num_layers, model.num_experts
  local first = st.calls == 0
  st.calls = st.calls + 1
  st.since = st.since + 1
  local due = (first and p.at_start) or (not first and st.since > p.interval)
  -- this step's loads join the window before the rebalance when `current`, else after
  if p.current then record(ctx, L, E) end
  if due and next(st.loads) == nil then due = false end -- nothing recorded to place from
  local sum = due and window_sum(ctx, L, E) or nil
  if not p.current then record(ctx, L, E) end
  if not due then return nil end -- the placement in use stays: nothing migrates
  st.since = 1
  if E % p.groups ~= 0 then
    error(string.format("eplb_periodic: %d expert groups do not divide %d experts", p.groups, E))
  end
  local nodes = (topo.ep_size % topo.gpus_per_node == 0) and topo.ep_size / topo.gpus_per_node or 1
  local mode = p.mode
  if mode == "auto" then mode = (p.groups % nodes == 0) and "hierarchical" or "global" end
  local placement = {}
  for layer = 0, L - 1 do
    local loads, base = {}, layer * E
    for e = 1, E do loads[e] = sum[base + e] end
    local ranks = rp.place(loads, nil, {mode = mode, groups = p.groups})
    placement[layer + 1] = relabel(ctx, layer, ranks)
  end
  return {placement = placement}
end

return P
