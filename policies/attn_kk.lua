-- attn_kk: packing balanced by attention cost. verl >= 0.6.1's two-level
-- Karmarkar-Karp (verl_kk), keyed by each sequence's attention time from the cost model
-- (ctx.cost.attention: the causal L^2 term plus projections) instead of verl's
-- workload 24576 L + L^2. Packing only; the placement stays as it is.
-- The loops run in C (rp.kk_packing, the packing of rp.baseline("attn_kk+contiguous"),
-- which is also the engine's safe default packing; docs/baselines.md).

return {
  name = "attn_kk",
  version = "1.1.0",
  api = 1,
  description = "packing balanced by attention cost: verl 0.6.1's two-level Karmarkar-Karp keyed by attention time",
  params = {
    num_microbatches = {
      type = "integer", default = 0, min = 0, max = 65536,
      doc = "microbatches per rank; 0: the config's limits.num_microbatches, or verl's rule when that is 0 too",
    },
  },
  plan = function(ctx)
    return rp.kk_packing("attn_kk", {num_microbatches = ctx.params.num_microbatches})
  end,
}
