-- eplb: DeepSeek EPLB's expert placement from this step's routing, as a policy.
-- Placement only; the packing stays as it is (pair it: "token_kk+eplb").
--
-- For every MoE layer, from the step's expert loads (ctx.stats.expert_load):
-- 1. replicas: every slot of the EP group filled with a replica, the next replica going
--    to the expert with the largest load per replica (EPLB's replicate_experts);
-- 2. placement: replicas heaviest first, each to the least-loaded GPU of the EP group
--    with a free slot that does not hold the expert yet (EPLB's balanced_packing);
--    hierarchical (expert groups to nodes first, EPLB's rebalance_experts_hierarchical)
--    when the EP group spans whole nodes and the groups divide over them, else global.
-- With the default params it places exactly as rp.baseline("...+eplb")
-- (docs/baselines.md). The engine then renumbers slots so that experts staying on an EP
-- rank keep their slot, so only real moves migrate weights.

local P = {
  name = "eplb",
  version = "1.0.0",
  api = 1,
  description = "EPLB-like placement: replicas from this step's expert loads, hierarchical when it applies, else global",
  params = {
    mode = {
      type = "string", default = "auto", values = {"auto", "global", "hierarchical"},
      doc = "auto: hierarchical when the EP group's nodes divide the expert groups, else global",
    },
    groups = {
      type = "integer", default = 1, min = 1, max = 65536,
      doc = "expert groups (EPLB's num_groups; DeepSeek-V3's n_group); must divide the expert count",
    },
    improve_rounds = {
      type = "integer", default = 0, min = 0, max = 1000,
      doc = "rounds of local improvement after the greedy placement (0: EPLB's greedy alone)",
    },
  },
}

function P.plan(ctx)
  local topo, model = ctx.topology, ctx.model
  local E, ep, gpn = model.num_experts, topo.ep_size, topo.gpus_per_node
  local groups = ctx.params.groups
  if E % groups ~= 0 then
    error(string.format("eplb: %d expert groups do not divide %d experts", groups, E))
  end
  -- nodes one EP group spans (EPLB's num_nodes)
  local nodes = (ep % gpn == 0) and ep / gpn or 1
  local mode = ctx.params.mode
  if mode == "auto" then
    mode = (groups % nodes == 0) and "hierarchical" or "global"
  end
  local placement = {}
  for layer = 0, model.num_layers - 1 do
    local ranks = rp.place(ctx.stats.expert_load(layer), nil, {
      mode = mode, groups = groups, improve_rounds = ctx.params.improve_rounds,
    })
    placement[layer + 1] = ranks
  end
  return {placement = placement}
end

return P
