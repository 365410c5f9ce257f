-- slime_kk: slime's FLOPs balancing (--use-dynamic-batch-size --balance-by-flops, which
-- turns --balance-data on; THUDM/slime's build_dp_schedule), as a policy. Packing only;
-- the placement stays as it is. slime_ff's steps, with step 1 replaced:
--
-- 1. Each mini-batch (consecutive sequence ids) into ceil(tokens / cap) microbatches by
--    Karmarkar-Karp on slime's FLOPs estimate (linear terms + causal attention L^2),
--    without equal sizes. slime does not check the cap here; where the result breaks
--    it after step 2, the mini-batch is packed again with a cap repair.
-- 2. Aligned to a multiple of the DP ranks x trainer.microbatch_multiple by splitting.
-- 3. Dealt to the DP ranks by Karmarkar-Karp with equal counts on the FLOPs.
-- The loops run in C (rp.kk_packing, docs/baselines.md).

return {
  name = "slime_kk",
  version = "1.0.0",
  api = 1,
  description = "slime-like packing (--balance-by-flops): Karmarkar-Karp microbatches on FLOPs, dealt to DP ranks by Karmarkar-Karp",
  params = {
    num_microbatches = {
      type = "integer", default = 0, min = 0, max = 65536,
      doc = "microbatches per rank; 0: the config's limits.num_microbatches, or slime's rule when that is 0 too",
    },
  },
  plan = function(ctx)
    return rp.kk_packing("slime_kk", {num_microbatches = ctx.params.num_microbatches})
  end,
}
