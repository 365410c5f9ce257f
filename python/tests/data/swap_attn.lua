-- A policy for the binding's hot-swap test: verl-style packing keyed by attention time
-- plus EPLB placement, through the rp.baseline primitive.
return {
  name = "py_swap_attn",
  version = "1.2.3",
  api = 1,
  description = "attn_kk+eplb baseline (Python hot-swap test)",
  params = {},
  plan = function(ctx)
    return rp.baseline("attn_kk+eplb")
  end,
}
