-- Loads and passes its metadata checks, then fails when it plans: a staged swap of it
-- must be refused after the dry run, leaving the running policy in place.
return {
  name = "py_broken_at_plan",
  version = "0.0.1",
  api = 1,
  description = "errors in plan() (Python hot-swap test)",
  params = {},
  plan = function(ctx)
    error("py_broken_at_plan fails on purpose")
  end,
}
