-- slime_ff: slime's data balancing as its recipes run it (--use-dynamic-batch-size
-- --balance-data; THUDM/slime's build_dp_schedule), as a policy. Packing only; the
-- placement stays as it is. Pack first, distribute second:
--
-- 1. Each mini-batch (consecutive sequence ids) into microbatches by first fit: in id
--    order, each sequence into the first microbatch it fits under the token cap.
-- 2. The count aligned to a multiple of the DP ranks x trainer.microbatch_multiple by
--    splitting the microbatch with the most tokens in two (longest sequence first into
--    the lighter half), the same count in every mini-batch.
-- 3. Microbatches dealt to the DP ranks by Karmarkar-Karp with equal counts on slime's
--    FLOPs estimate (linear terms + causal attention L^2); a rank runs its microbatches
--    in ascending order. Ranks get equal microbatch counts, not equal sequence counts,
--    so trainer.equal_sequences_per_rank (verl's constraint) rules it out.
-- The loops run in C (rp.kk_packing, the packing of rp.baseline("slime_ff+contiguous"),
-- docs/baselines.md); slime_kk is the same with Karmarkar-Karp microbatches.

return {
  name = "slime_ff",
  version = "1.0.0",
  api = 1,
  description = "slime-like packing (--balance-data): first-fit microbatches under the cap, dealt to DP ranks by Karmarkar-Karp on FLOPs",
  params = {
    num_microbatches = {
      type = "integer", default = 0, min = 0, max = 65536,
      doc = "microbatches per rank; 0: the config's limits.num_microbatches, or slime's rule when that is 0 too",
    },
  },
  plan = function(ctx)
    return rp.kk_packing("slime_ff", {num_microbatches = ctx.params.num_microbatches})
  end,
}
