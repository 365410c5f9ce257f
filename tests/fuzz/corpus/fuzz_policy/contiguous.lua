-- contiguous: the placement trainers start from and keep without a balancer (Megatron's
-- layout), as a policy. Placement only; the packing stays as it is.
--
-- At every layer expert e goes to EP rank floor(e * ep_size / E), in ascending order,
-- one replica each; where a rank has fewer slots than its block, the overflow goes to
-- the next rank with a free slot (wrapping around to rank 0). Spare slots stay empty.
-- The placement never changes, so nothing ever migrates. The same placement as
-- rp.baseline("...+contiguous") (rp_plan_set_contiguous); tests/test_policies.c checks.

local P = {
  name = "contiguous",
  version = "1.0.0",
  api = 1,
  description = "contiguous placement: expert e on EP rank e * ep_size / E, no replicas, never moves",
  params = {},
}

function P.plan(ctx)
  local topo, model = ctx.topology, ctx.model
  local E, ep = model.num_experts, topo.ep_size
  if topo.total_slots < E then
    error(string.format("contiguous: %d slots cannot hold %d experts", topo.total_slots, E))
  end
  local ranks, free = {}, {}
  for j = 0, ep - 1 do ranks[j + 1] = {}; free[j + 1] = topo.slots[j] end
  for e = 0, E - 1 do
    local j = math.floor(e * ep / E)
    while free[j + 1] == 0 do j = (j + 1) % ep end
    local list = ranks[j + 1]
    list[#list + 1] = e
    free[j + 1] = free[j + 1] - 1
  end
  local placement = {}
  for layer = 1, model.num_layers do placement[layer] = ranks end
  return {placement = placement}
end

return P
