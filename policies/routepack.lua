-- routepack: the joint policy. It balances both sides of a step with one cost model
-- (docs/routepack-policy.md):
--
-- 1. Packing: sequences longest first, each into the (rank, microbatch) cell that raises
--    a surrogate of the step least: the slowest GPU's attention and tokens in each
--    microbatch, each EP group's tokens, and the responses of one prompt kept apart
--    (they share routing). Long sequences end up together, every microbatch balanced.
-- 2. Placement per layer from this step's loads, judged per (microbatch, EP group):
--    EPLB-style replicas, node-aware, improved by replica moves; migration-aware: a
--    layer is re-placed only when its saving over `horizon` steps beats the time to
--    migrate it, else the placement in use stays or moves only the replicas that pay.
-- 3. Per microbatch: token shares between replicas (free) and extra replicas copied
--    over NVLink where they pay for the copy.
-- 4. Exact local search within `search_evaluations` tries (work, not time), and the
--    baselines checked: when one scores better under the cost model, it is returned.
--
-- All of it is one C primitive, rp.joint; this file chooses its options and gives it the
-- loads the coming steps are expected to have.

local P = {
  name = "routepack",
  version = "0.4.0",
  api = 1,
  description = "joint policy: attention-, token- and expert-balanced packing, migration-aware placement with per-microbatch shares and replicas, checked against the baselines",
  params = {
    horizon = {
      type = "integer", default = 3, min = 1, max = 1000000,
      doc = "steps over which a new placement must pay back the time its migration takes",
    },
    search_evaluations = {
      type = "integer", default = 0, min = 0, max = 10000000,
      doc = "candidates the exact local search evaluates (a work budget; 0: no search)",
    },
    num_microbatches = {
      type = "integer", default = 0, min = 0, max = 65536,
      doc = "microbatches per rank; 0: the config's limits.num_microbatches, or the fewest the token cap allows",
    },
    prompt_spread = {
      type = "number", default = 0.5, min = 0, max = 100,
      doc = "weight of a second response of one prompt in the same microbatch and EP group",
    },
    place_rounds = {
      type = "integer", default = 4, min = 0, max = 1000,
      doc = "placement improvement rounds per layer against the per-microbatch, per-group loads",
    },
    shares = {
      type = "boolean", default = true,
      doc = "set per-microbatch token shares between an expert's replicas",
    },
    max_extra_per_rank = {
      type = "integer", default = 1, min = 0, max = 64,
      doc = "extra replicas an EP rank may receive for one microbatch and layer (0: none)",
    },
    balance_evaluations = {
      type = "integer", default = 0, min = 0, max = 10000000,
      doc = "candidate sequence trades between EP groups (profile mixing; a work budget)",
    },
    fallbacks = {
      type = "boolean", default = true,
      doc = "check the plan against the four baselines and return the best under the cost model",
    },
    persistence = {
      type = "number", default = -1, min = -1, max = 1,
      doc = "fraction of a re-placement's saving expected to hold on later steps; -1: measured from the realised savings of earlier moves (prior `persistence_prior`)",
    },
    persistence_prior = {
      type = "number", default = 0, min = 0, max = 1,
      doc = "the persistence assumed before any earlier move has been scored",
    },
    persistence_window = {
      type = "integer", default = 16, min = 1, max = 1000,
      doc = "scored steps (realised against predicted saving) the persistence estimate averages over",
    },
  },
}

local FALLBACKS = {"token_kk+contiguous", "token_kk+eplb", "verl_kk+eplb", "attn_kk+eplb"}

-- The loads a new placement will meet over the coming steps: the mean of the past
-- steps' loads (ctx.history), each step weighted alike. A placement fitted to this
-- step's own noise gains nothing on them; one that follows a lasting shift does. nil
-- without history (the planner then takes this step's loads).
local function expected_loads(ctx)
  local hist = ctx.history
  if not hist or #hist == 0 then return nil end
  local L, E = ctx.model.num_layers, ctx.model.num_experts
  local sum = {}
  for i = 1, L * E do sum[i] = 0 end
  for k = 1, #hist do
    local entry = hist[k]
    for l = 0, L - 1 do
      local load = entry.expert_load(l)
      local total = load:sum()
      if total > 0 then
        local base = l * E
        for e = 0, E - 1 do sum[base + e + 1] = sum[base + e + 1] + load[e] / total end
      end
    end
  end
  return sum
end

-- ---- persistence from history (docs/routepack-policy.md, "Persistence from history") ----
-- ctx.state.move: the last placement change this policy made: the placement before it,
-- the one after it, and what it saved on its own step's batch (both scored by the cost
-- model with that step's packing, no levers). On every later step (up to `horizon`) the
-- two placements are scored again with that step's packing: the realised saving. The
-- estimate is sum(realised) / sum(predicted) over the last `persistence_window` scored
-- steps, within [0, 1]; before any, `persistence_prior`.

local function score(packing, placement)
  return rp.evaluate(rp.plan({packing = packing, placement = placement})).step_s
end

local function estimate(ctx)
  local p, obs = ctx.params, ctx.state.observed
  if p.persistence >= 0 then return p.persistence, 0 end
  if not obs or #obs == 0 then return p.persistence_prior, 0 end
  local r, q = 0, 0
  for i = 1, #obs do r = r + obs[i][1]; q = q + obs[i][2] end
  if q <= 0 then return p.persistence_prior, #obs end
  return math.max(0, math.min(1, r / q)), #obs
end

local function observe(ctx, realised, predicted)
  local obs = ctx.state.observed or {}
  obs[#obs + 1] = {realised, predicted}
  while #obs > ctx.params.persistence_window do table.remove(obs, 1) end
  ctx.state.observed = obs
end

-- Score the open move on this step's batch, and open a new one when `plan` changes the
-- placement in use. Returns the realised saving (nil when nothing was scored) and the
-- predicted saving of this step's change (0 when none).
local function measure(ctx, plan)
  local st, packing = ctx.state, plan:packing()
  local realised
  local move = st.move
  if move and move.age < ctx.params.horizon then
    realised = score(packing, move.before) - score(packing, move.after)
    observe(ctx, realised, move.predicted)
    move.age = move.age + 1
  end
  local predicted = 0
  local _, bytes = rp.migration(plan)
  if bytes > 0 then
    local before, after = ctx.placement.table(), plan:placement()
    predicted = score(packing, before) - score(packing, after)
    -- a change that does not even pay on its own batch is not a prediction to test
    st.move = predicted > 0 and {before = before, after = after, predicted = predicted, age = 0} or nil
  end
  return realised, predicted
end

local function joint(ctx)
  local p = ctx.params
  local persistence, observations = estimate(ctx)
  local plan = rp.joint({
    num_microbatches = p.num_microbatches,
    prompt_spread = p.prompt_spread,
    place_rounds = p.place_rounds,
    shares = p.shares,
    max_extra_per_rank = p.max_extra_per_rank,
    balance_evaluations = p.balance_evaluations,
    horizon = p.horizon,
    refine_evaluations = p.search_evaluations,
    fallbacks = p.fallbacks and FALLBACKS or {},
    expected_loads = expected_loads(ctx),
    persistence = persistence,
  })
  local realised, predicted = measure(ctx, plan)
  rp.decision({persistence = persistence, observations = observations, predicted_saving_s = predicted,
               realised_saving_s = realised})
  return plan
end

function P.plan(ctx)
  return joint(ctx)
end

return P
