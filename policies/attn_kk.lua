-- attn_kk: packing balanced by attention cost. verl >= 0.6.1's two-level
-- Karmarkar-Karp, keyed by each sequence's attention time from the cost model
-- (ctx.cost.attention: the causal L^2 term plus projections) instead of verl's
-- workload 24576 L + L^2. Packing only; the placement stays as it is.
--
-- 1. DP ranks: Karmarkar-Karp on the key with equal sequence counts per rank (padded
--    with weightless dummies when the batch does not divide); inside a rank the
--    sequences are sorted by (key, id) and laid out even positions first, then the odd
--    ones reversed (verl 0.6.1's order, small sequences at both ends).
-- 2. Microbatches: the count as verl's dynamic batch size (largest over ranks of
--    ceil(rank tokens / cap), at most the rank's sequence count; or the config's fixed
--    count), Karmarkar-Karp on the key within the token cap (one more microbatch for
--    every rank when one cannot fit), microbatches sorted by descending (key sum, first
--    local index) then laid out as sorted[::2][::-1] + sorted[1::2].
-- The result is the same packing as rp.baseline("attn_kk+contiguous"), which is the
-- engine's safe default packing; tests/test_policies.c checks they agree.

local P = {
  name = "attn_kk",
  version = "1.0.0",
  api = 1,
  description = "packing balanced by attention cost: verl 0.6.1's two-level Karmarkar-Karp keyed by attention time",
  params = {
    num_microbatches = {
      type = "integer", default = 0, min = 0, max = 65536,
      doc = "microbatches per rank; 0: the config's limits.num_microbatches, or verl's rule when that is 0 too",
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

function P.plan(ctx)
  local G = ctx.topology.num_gpus
  local n = ctx.batch.num_seqs
  local len = ctx.batch.seq_len
  local cap = token_cap(ctx.limits)
  local key = {}
  for s = 0, n - 1 do key[s + 1] = ctx.cost.attention(len[s]) end

  -- 1. DP ranks with equal counts; dummies (ids >= n) weigh nothing
  local padded = {}
  for i = 1, math.ceil(n / G) * G do padded[i] = key[i] or 0 end
  local ranks = rp.kk(padded, G, {equal_size = true})
  local mine, most = {}, 0
  for g = 1, G do
    local ids, k = {}, {}
    for _, s in ipairs(ranks[g]) do
      if s < n then ids[#ids + 1] = s; k[#k + 1] = key[s + 1] end
    end
    -- by (key, id): a stable argsort of the ascending ids
    local order = rp.argsort(k)
    local laid = {}
    for j = 1, #order, 2 do laid[#laid + 1] = ids[order[j] + 1] end
    local last = (#order % 2 == 0) and #order or #order - 1
    for j = last, 2, -2 do laid[#laid + 1] = ids[order[j] + 1] end
    mine[g] = laid
    if #laid > most then most = #laid end
  end

  -- 2. microbatch count
  local fixed = ctx.params.num_microbatches
  if fixed == 0 then fixed = ctx.limits.num_microbatches end
  local M = fixed
  if M == 0 then
    for g = 1, G do
      local tokens = 0
      for _, s in ipairs(mine[g]) do tokens = tokens + len[s] end
      M = math.max(M, math.min(math.ceil(tokens / cap), #mine[g]))
    end
  end
  if M < 1 then M = 1 end

  local parts
  while true do
    parts = {}
    local bad
    for g = 1, G do
      local w, t = {}, {}
      for j, s in ipairs(mine[g]) do w[j] = key[s + 1]; t[j] = len[s] end
      local ok, res = pcall(rp.kk, w, M, {sizes = t, cap = cap})
      if not ok then bad = res break end
      parts[g] = res
    end
    if not bad then break end
    if fixed > 0 or M >= most then error("attn_kk: " .. bad) end
    M = M + 1
  end

  local packing = {}
  for g = 1, G do
    local keys = {}
    for b = 1, M do
      local sum, first = 0, nil
      for _, j in ipairs(parts[g][b]) do
        sum = sum + key[mine[g][j + 1] + 1]
        if not first or j < first then first = j end
      end
      keys[b] = {sum = sum, first = first or 0, mb = b}
    end
    table.sort(keys, function(a, b)
      if a.sum ~= b.sum then return a.sum > b.sum end
      if a.first ~= b.first then return a.first > b.first end
      return a.mb < b.mb
    end)
    -- sorted[::2][::-1] + sorted[1::2]
    local order = {}
    for b = math.floor((M - 1) / 2) * 2 + 1, 1, -2 do order[#order + 1] = keys[b].mb end
    for b = 2, M, 2 do order[#order + 1] = keys[b].mb end
    local rank = {}
    for b = 1, M do
      local list = {}
      for _, j in ipairs(parts[g][order[b]]) do list[#list + 1] = mine[g][j + 1] end
      rank[b] = list
    end
    packing[g] = rank
  end
  return {packing = packing}
end

return P
