-- token_kk: verl's sequence balancing (verl <= 0.6.0) as a policy. Packing only; the
-- placement stays as it is (pair it with a placement policy: "token_kk+eplb").
--
-- 1. DP ranks: Karmarkar-Karp over the ranks on token counts with equal sequence counts
--    per rank (verl's _balance_batch); a batch that does not divide over the ranks is
--    padded with weightless dummy sequences, so ranks differ by at most one sequence.
-- 2. Microbatches (verl's dynamic batch size): M = the largest over ranks of
--    ceil(rank tokens / cap), at most the rank's sequence count (or a fixed count);
--    each rank splits its sequences into M parts by Karmarkar-Karp on token counts
--    within the token cap; if a rank cannot fit, every rank gets one more microbatch.
--    Microbatches are ordered by descending sum of L^2, sequences inside one by id.
-- The loops run in C (rp.kk_packing, the packing of rp.baseline("token_kk+contiguous"),
-- docs/baselines.md); verl_kk and attn_kk are the same call with another workload key.

return {
  name = "token_kk",
  version = "1.1.0",
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
  plan = function(ctx)
    return rp.kk_packing("token_kk", {equal_size = ctx.params.equal_size,
                                      num_microbatches = ctx.params.num_microbatches})
  end,
}
