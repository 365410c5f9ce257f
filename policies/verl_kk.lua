-- verl_kk: verl's sequence balancing from verl 0.6.1 on, as a policy: two-level
-- Karmarkar-Karp keyed by verl's workload 24576 L + L^2 (calculate_workload), with
-- 0.6.1's orderings. Packing only; the placement stays as it is.
--
-- 1. DP ranks: Karmarkar-Karp on the key with equal sequence counts per rank (padded
--    with weightless dummies when the batch does not divide); inside a rank the
--    sequences are sorted by (key, id) and laid out even positions first, then the odd
--    ones reversed (verl 0.6.1's order, small sequences at both ends).
-- 2. Microbatches: the count as verl's dynamic batch size (largest over ranks of
--    ceil(rank tokens / cap), at most the rank's sequence count; or a fixed count),
--    Karmarkar-Karp on the key within the token cap (one more microbatch for every rank
--    when one cannot fit), microbatches sorted by descending (key sum, first local
--    index) then laid out as sorted[::2][::-1] + sorted[1::2].
-- The loops run in C (rp.kk_packing, the packing of rp.baseline("verl_kk+contiguous"),
-- docs/baselines.md).

return {
  name = "verl_kk",
  version = "1.1.0",
  api = 1,
  description = "verl-like packing (verl >= 0.6.1): two-level Karmarkar-Karp on the workload 24576 L + L^2",
  params = {
    num_microbatches = {
      type = "integer", default = 0, min = 0, max = 65536,
      doc = "microbatches per rank; 0: the config's limits.num_microbatches, or verl's rule when that is 0 too",
    },
  },
  plan = function(ctx)
    return rp.kk_packing("verl_kk", {num_microbatches = ctx.params.num_microbatches})
  end,
}
