-- The sandbox's Lua-side wrappers, run once in every policy sandbox before the policy
-- (core/sandbox.c loads this file, compiled into the library by CMake).
--
-- They are Lua so that the library functions they forward to are called (tail calls) from
-- Lua: no C recursion, instructions are counted, and error messages name the function the
-- policy called. `charge` pre-charges a library function's work by the size of its
-- arguments (charge_args in core/sandbox.c): LuaJIT's own functions scan or copy whole
-- strings in one call, where no instruction hook fires. The C side passes the real
-- functions in and installs the wrappers this chunk returns, in this order.
local real_xpcall, handler_for, real_format, format_args, real_sort, sort_check, check_clock,
      charge, real_tonumber, real_sub, real_upper, real_lower, real_reverse, real_rep, real_concat,
      raw_next, type, real_maxn, max = ...
local function xpcall(f, msgh, ...)
  return real_xpcall(f, handler_for(msgh), ...)
end
local function format(fmt, ...)
  return real_format(format_args(fmt, ...))
end
local function sort(t, comp)
  sort_check(t, comp)
  real_sort(t, comp)
  return check_clock()
end
local function tonumber(...) charge(0, ...) return real_tonumber(...) end
local function sub(...) charge(1, ...) return real_sub(...) end
local function upper(...) charge(0, ...) return real_upper(...) end
local function lower(...) charge(0, ...) return real_lower(...) end
local function reverse(...) charge(0, ...) return real_reverse(...) end
local function rep(...) charge(2, ...) return real_rep(...) end
local function concat(...) charge(3, ...) return real_concat(...) end
-- table.maxn in Lua: LuaJIT's scans a table's whole hash part in one C call, uncharged,
-- also when C calls it as a metamethod (__lt under sort ran a step ~77 s against 5 s).
-- Here every key is an instruction the hook counts; the instructions per key depend on
-- its type alone, so the work does not depend on the (per-process) hash order.
local function maxn(t)
  if type(t) ~= "table" then return real_maxn(t) end -- LuaJIT's error message
  local m = 0
  for k in raw_next, t do
    if type(k) == "number" then m = max(m, k) end
  end
  return m
end
return xpcall, format, sort, tonumber, sub, upper, lower, reverse, rep, concat, maxn
