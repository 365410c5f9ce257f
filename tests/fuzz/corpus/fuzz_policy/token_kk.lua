-- token_kk: verl's sequence balancing (verl <= 0.6.0) as a policy. Packing only; the
-- placement stays as it is (pair it with a placement policy: "token_kk+eplb").
--
-- 1. DP ranks: Karmarkar-Karp over the ranks on token counts with equal sequence counts
--    per rank (verl's _balance_batch); a batch that does not divide over the ranks is
--    padded with weightless dummy sequences, so ranks differ by at most one sequence.
-- 2. Microbatches (verl's dynamic batch size): M = the largest over ranks of
--    ceil(rank tokens / cap), at most the rank's sequence count (or the config's fixed
--    count); each rank splits its sequences into M parts by Karmarkar-Karp on token
--    counts within the token cap; if a rank cannot fit, every rank gets one more
--    microbatch. Microbatches are ordered by descending sum of L^2 (ties: descending
--    first local index), sequences inside one in ascending id order.
-- The result is the same packing as rp.baseline("token_kk+contiguous")
-- (docs/baselines.md), which tests/test_policies.c checks.

local P = {
  name = "token_kk",
  version = "1.0.0",
  api = 1,
  description = "verl-like packing: Karmarkar-Karp on token counts, equal sequence counts per DP rank; placement untouched",
  params = {
    equal_size = {
      type = "boolean", default = true,
      doc = "give every DP rank the same number of sequences (verl's _balance_batch); false: plain Karmarkar-Karp",
    },
    num_microbatches = {
      type = "integer", default = 0, min = 0, max = 65536,
      doc = "microbatches per rank; 0: the config's limits.num_microbatches, or verl's rule when that is 0 too",
    },
  },
}

-- The token cap of a microbatch, lowered by the activation memory cap when set.
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

function P.plan(ctx)
  local G = ctx.topology.num_gpus
  local n = ctx.batch.num_seqs
  local len = ctx.batch.seq_len
  local cap = token_cap(ctx.limits)

  -- 1. DP ranks; rp.kk returns each rank's item ids in ascending order
  local weights = len:totable()
  local ranks
  if ctx.params.equal_size then
    local padded = math.ceil(n / G) * G
    for i = n + 1, padded do weights[i] = 0 end
    ranks = rp.kk(weights, G, {equal_size = true})
  else
    ranks = rp.kk(weights, G)
  end
  local mine = {}      -- mine[g + 1]: the real sequence ids of rank g, ascending
  local most = 0
  for g = 1, G do
    local list = {}
    for _, s in ipairs(ranks[g]) do
      if s < n then list[#list + 1] = s end
    end
    mine[g] = list
    if #list > most then most = #list end
  end

  -- 2. microbatch count
  local fixed = ctx.params.num_microbatches
  if fixed == 0 then fixed = ctx.limits.num_microbatches end
  local M = fixed
  if M == 0 then
    for g = 1, G do
      local tokens = 0
      for _, s in ipairs(mine[g]) do tokens = tokens + len[s] end
      local want = math.min(math.ceil(tokens / cap), #mine[g])
      if want > M then M = want end
    end
  end
  if M < 1 then M = 1 end

  -- per rank: Karmarkar-Karp over M microbatches within the cap
  local parts
  while true do
    parts = {}
    local bad
    for g = 1, G do
      local w = {}
      for j, s in ipairs(mine[g]) do w[j] = len[s] end
      local ok, res = pcall(rp.kk, w, M, {sizes = w, cap = cap})
      if not ok then bad = res break end
      parts[g] = res
    end
    if not bad then break end
    if fixed > 0 or M >= most then error("token_kk: " .. bad) end
    M = M + 1
  end

  -- microbatches by descending sum of L^2, ties by descending first local index
  local packing = {}
  for g = 1, G do
    local keys = {}
    for b = 1, M do
      local sum, first = 0, nil
      for _, j in ipairs(parts[g][b]) do
        local l = len[mine[g][j + 1]]
        sum = sum + l * l
        if not first or j < first then first = j end
      end
      keys[b] = {sum = sum, first = first or 0, mb = b}
    end
    table.sort(keys, function(a, b)
      if a.sum ~= b.sum then return a.sum > b.sum end
      if a.first ~= b.first then return a.first > b.first end
      return a.mb < b.mb
    end)
    local rank = {}
    for b = 1, M do
      local list = {}
      for _, j in ipairs(parts[g][keys[b].mb]) do list[#list + 1] = mine[g][j + 1] end
      rank[b] = list
    end
    packing[g] = rank
  end
  return {packing = packing}
end

return P
