-- virtual_experts: Megatron-Core's per-forward expert balancing (--moe-virtual-expert-load-balance,
-- from Moonshot's MoonEP) as a placement policy. Placement only; the packing stays as it is
-- (pair it with a packing policy: "token_kk+virtual_experts").
--
-- The placement is the contiguous one the balancer requires (expert e on EP rank
-- e * ep_size / E, E / ep_size experts each, no replicas), and the plan says
-- per_forward_balancing = "virtual_experts": in every (microbatch, layer) forward and EP
-- group the trainer offloads overloaded ranks' tokens to virtual experts on underloaded
-- ranks, pushing their weights over NVLink. The cost model prices the plan that way
-- (docs/cost-model.md); docs/baselines.md gives the algorithm. Refused, with the limit
-- named, where the balancer cannot run: EP groups spanning nodes, EP size outside 2..64,
-- experts not evenly owned. The same plan as rp.baseline("...+virtual_experts").

local P = {
  name = "virtual_experts",
  version = "1.0.0",
  api = 1,
  description = "contiguous placement balanced per forward by Megatron's virtual experts (MoonEP); never moves",
  params = {},
}

function P.plan(ctx)
  local topo, model = ctx.topology, ctx.model
  local E, ep = model.num_experts, topo.ep_size
  if ep < 2 or ep > 64 then
    error(string.format("virtual_experts: topology.ep_size is %d; the balancer runs on EP groups of 2 to 64 GPUs", ep))
  end
  if ep > topo.gpus_per_node or topo.gpus_per_node % ep ~= 0 then
    error(string.format("virtual_experts: an EP group of %d GPUs spans nodes of %d GPUs; the balancer pushes "
      .. "weights through NVLink, so every EP group must lie inside one node", ep, topo.gpus_per_node))
  end
  if E % ep ~= 0 then
    error(string.format("virtual_experts: model.num_experts %d is not a multiple of topology.ep_size %d; "
      .. "the balancer needs every EP rank to own the same number of experts", E, ep))
  end
  local per_rank = E / ep
  local ranks = {}
  for j = 0, ep - 1 do
    if topo.slots[j] < per_rank then
      error(string.format("virtual_experts: EP rank %d has %d expert slots; owning %d experts evenly needs %d",
        j, topo.slots[j], E, per_rank))
    end
    local list = {}
    for i = 0, per_rank - 1 do list[#list + 1] = j * per_rank + i end
    ranks[j + 1] = list
  end
  local placement = {}
  for layer = 1, model.num_layers do placement[layer] = ranks end
  return {placement = placement, per_forward_balancing = "virtual_experts"}
end

return P
