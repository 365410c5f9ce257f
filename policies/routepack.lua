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
--    The check runs on the first step, every `fallback_interval` steps, on every step
--    while a baseline won the last check, and on a step whose plan fits its batch worse
--    (step / lower bound) than at the last check by more than `fallback_ratio_rise`.
-- 5. Where the trainer runs Megatron's per-forward virtual-expert balancer (config
--    trainer.per_forward_balancer, default: whether execution.executor runs it; false for
--    the default routepack_torch), the same packing run with it is
--    scored too and returned when it is faster with its migration (`virtual_experts`).
--    After it won a check, the steps until the next one build only it
--    (`balancer_between_checks`): the joint placement is judged again at each check.
--
-- All of it is one C primitive, rp.joint; this file chooses its options and gives it the
-- loads the coming steps are expected to have.

local P = {
  name = "routepack",
  version = "0.7.0",
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
    fallback_interval = {
      type = "integer", default = 8, min = 1, max = 1000000,
      doc = "steps from one fallback check to the next while the joint plan wins them (1: every step); a baseline's win keeps the check on every step until the joint plan wins again",
    },
    fallback_ratio_rise = {
      type = "number", default = 0.005, min = 0, max = 1000000,
      doc = "between checks, check anyway when the joint plan's step / lower bound exceeds the last check's by more than this fraction",
    },
    persistence = {
      type = "number", default = -1, min = -1, max = 1,
      doc = "fraction of a re-placement's saving expected to hold on later steps; -1: measured from the realised savings of earlier moves (prior `persistence_prior`)",
    },
    persistence_prior = {
      type = "number", default = 0, min = 0, max = 1,
      doc = "the persistence assumed before any earlier move has been scored",
    },
    virtual_experts = {
      type = "boolean", default = true,
      doc = "also score this packing run with Megatron's per-forward virtual-expert balancer (where the config's limits allow it) and return it when it scores better; only where the config's trainer.per_forward_balancer says the trainer runs the balancer (its default follows execution.executor: false for the default routepack_torch, true for megatron_balancer): false there turns it off whatever this says",
    },
    persistence_window = {
      type = "integer", default = 16, min = 1, max = 1000,
      doc = "scored steps (realised against predicted saving) the persistence estimate averages over",
    },
    balancer_between_checks = {
      type = "boolean", default = true,
      doc = "after the virtual-expert plan won the last check, return it on the steps until the next check without building the joint placement, unless its step / lower bound rose by more than fallback_ratio_rise (the next check judges the joint placement again)",
    },
  },
}

local FALLBACKS = {"token_kk+contiguous", "token_kk+eplb", "verl_kk+eplb", "attn_kk+eplb"}

-- The loads a new placement will meet over the coming steps: the mean of the past
-- steps' loads (ctx.history), each step weighted alike (each layer's loads over their
-- total, summed over the steps: ctx.history.share_sum(), one C call where a Lua loop read
-- every element through its view). A placement fitted to this step's own noise gains
-- nothing on them; one that follows a lasting shift does. nil without history (the
-- planner then takes this step's loads).
local function expected_loads(ctx)
  local hist = ctx.history
  if not hist or #hist == 0 then return nil end
  return hist.share_sum()
end

-- ---- persistence from history (docs/routepack-policy.md, "Persistence from history") ----
-- ctx.state.move: the last placement change this policy made: the placement before it,
-- the one after it, and what it saved on its own step's batch (both scored by the cost
-- model with that step's packing, no levers). On every later step (up to `horizon`) the
-- two placements are scored again with that step's packing: the realised saving. The
-- estimate is sum(realised) / sum(predicted) over the last `persistence_window` scored
-- steps, within [0, 1]; before any, `persistence_prior`.

-- A placement is scored as it runs: with the per-forward balancer when it ran with it.
local function score(packing, placed)
  return rp.evaluate(rp.plan({packing = packing, placement = placed.placement,
                              per_forward_balancing = placed.balancing})).step_s
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
local function measure(ctx, plan, report)
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
    local before = {placement = ctx.placement.table(), balancing = ctx.placement.per_forward_balancing}
    local after = {placement = plan:placement(),
                   balancing = report.per_forward_balancing and "virtual_experts" or "none"}
    predicted = score(packing, before) - score(packing, after)
    -- a change that does not even pay on its own batch is not a prediction to test
    st.move = predicted > 0 and {before = before, after = after, predicted = predicted, age = 0} or nil
  end
  return realised, predicted
end

-- ---- recurring migration (docs/routepack-policy.md, "Beside the per-forward balancer") ----
-- ctx.state.refits: the migration (seconds) of each joint placement that followed a joint
-- placement of this policy: what staying on the joint placement costs a step. Its mean over
-- the last `persistence_window` is passed as recurring_migration_s (0 before any).
local function recurring(ctx)
  local r = ctx.state.refits
  if not r or #r == 0 then return 0 end
  local sum = 0
  for i = 1, #r do sum = sum + r[i] end
  return sum / #r
end

local function own_placement(report)
  return report.chosen == "joint" and not report.per_forward_balancing
end

local function note_refit(ctx, report)
  local st = ctx.state
  if st.joint_placed and own_placement(report) then
    local r = st.refits or {}
    r[#r + 1] = report.migration_s
    while #r > ctx.params.persistence_window do table.remove(r, 1) end
    st.refits = r
  end
  st.joint_placed = own_placement(report)
end

-- ---- when to check the baselines (docs/routepack-policy.md, section 7, "When the policy checks") ----
-- ctx.state.check: the last check's `ratio` (the joint plan's step / lower bound, or the
-- balancer's plan's under `balancer`), `age` (steps since it), `lost` (a baseline won it)
-- and `balancer` (the balancer's plan won it, and the steps until the next check build
-- only it: rp.joint's balancer_first). Steps count policy calls, not clocks,
-- so every rank decides alike. Returns rp.joint's fallback_above_ratio: 0 checks
-- unconditionally, a ratio checks only a joint plan above it.
local function check_gate(ctx)
  local p, last = ctx.params, ctx.state.check
  if not last or last.lost or last.age + 1 >= p.fallback_interval then return 0 end
  local above = last.ratio * (1 + p.fallback_ratio_rise)
  -- a ratio without a finite bound behind it gates nothing
  if above > 0 and above < math.huge then return above end
  return 0
end

local function note_check(ctx, report)
  local st = ctx.state
  if report.fallbacks_checked then
    -- the ratio the gate compares until the next check: the joint plan's, or, where the
    -- balancer's plan won and the steps until then build only it, that plan's
    local balancer = report.chosen == "joint" and report.per_forward_balancing and
                     ctx.params.balancer_between_checks
    st.check = {ratio = balancer and report.ratio or report.joint_ratio, age = 0,
                lost = report.chosen ~= "joint", balancer = balancer}
  elseif st.check then
    st.check.age = st.check.age + 1
  end
end

local function joint(ctx)
  local p = ctx.params
  local persistence, observations = estimate(ctx)
  local gate = check_gate(ctx)
  local plan, report = rp.joint({
    num_microbatches = p.num_microbatches,
    prompt_spread = p.prompt_spread,
    place_rounds = p.place_rounds,
    shares = p.shares,
    max_extra_per_rank = p.max_extra_per_rank,
    balance_evaluations = p.balance_evaluations,
    horizon = p.horizon,
    refine_evaluations = p.search_evaluations,
    fallbacks = p.fallbacks and FALLBACKS or {},
    fallback_above_ratio = gate,
    -- between checks after the balancer's plan won: it alone, unless the gate opens
    balancer_first = gate > 0 and ctx.state.check.balancer,
    expected_loads = expected_loads(ctx),
    persistence = persistence,
    -- the trainer says whether it runs the balancer at all (trainer.per_forward_balancer)
    virtual_experts = p.virtual_experts and ctx.trainer.per_forward_balancer,
    recurring_migration_s = recurring(ctx),
  })
  note_refit(ctx, report)
  note_check(ctx, report)
  local realised, predicted = measure(ctx, plan, report)
  rp.decision({persistence = persistence, observations = observations, predicted_saving_s = predicted,
               realised_saving_s = realised})
  return plan
end

function P.plan(ctx)
  return joint(ctx)
end

return P
