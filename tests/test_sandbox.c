/* The policy sandbox, tested like Redis's scripting tests: the reachable globals equal
 * the whitelist, each known way out of a Lua sandbox is refused, hostile policies are
 * stopped by the limits, and the state stays usable afterwards. */
#include "sandbox.h"
#include "tap.h"
#include "test_util.h"

#include <lauxlib.h>
#include <lualib.h>

#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

static rp_context *ctx;

static const char *status_name(rp_status st)
{
    switch (st) {
    case RP_OK: return "OK";
    case RP_EINVAL: return "EINVAL";
    case RP_ENOMEM: return "ENOMEM";
    case RP_EPOLICY: return "EPOLICY";
    case RP_ELIMIT: return "ELIMIT";
    default: return "E?";
    }
}

/* Run `src` as a policy chunk; "value" for a result, "STATUS: message" for a failure.
 * Converting the result allocates nothing (numbers are formatted in C). */
static char eval_buf[1024];
static rp_status eval_status;
static const char *eval_n(rp_sandbox *sb, const char *src, size_t len)
{
    lua_State *L = rp_sandbox_state(sb);
    int top = lua_gettop(L);
    rp_error err;
    rp_status st = rp_sandbox_load_text(sb, src, len, "policy.lua", &err);
    eval_status = st;
    if (st != RP_OK) {
        snprintf(eval_buf, sizeof eval_buf, "%s: %s", status_name(st), err.text);
        if (lua_gettop(L) != top) snprintf(eval_buf, sizeof eval_buf, "stack left unbalanced");
        return eval_buf;
    }
    switch (lua_type(L, -1)) {
    case LUA_TSTRING: snprintf(eval_buf, sizeof eval_buf, "%s", lua_tostring(L, -1)); break;
    case LUA_TNUMBER: snprintf(eval_buf, sizeof eval_buf, "%.14g", lua_tonumber(L, -1)); break;
    case LUA_TBOOLEAN: snprintf(eval_buf, sizeof eval_buf, "%s", lua_toboolean(L, -1) ? "true" : "false"); break;
    default: snprintf(eval_buf, sizeof eval_buf, "%s", luaL_typename(L, -1)); break;
    }
    lua_settop(L, top);
    return eval_buf;
}

static const char *eval(rp_sandbox *sb, const char *src) { return eval_n(sb, src, strlen(src)); }

/* Limits for a test: 0 keeps the default, except the wall-time limit, which is 60 s so
 * that no test depends on the speed of the machine (or of a sanitizer). */
static rp_sandbox *new_sandbox(int64_t instructions, double wall_s, size_t memory, int32_t depth)
{
    rp_sandbox_limits lim = rp_sandbox_limits_default();
    if (instructions) lim.max_instructions = instructions;
    lim.max_wall_s = wall_s > 0 ? wall_s : 60;
    if (memory) lim.max_memory_bytes = memory;
    if (depth) lim.max_depth = depth;
    rp_sandbox *sb = NULL;
    rp_error err;
    if (rp_sandbox_new(ctx, &lim, &sb, &err) != RP_OK) {
        diag("rp_sandbox_new failed: %s", err.text);
        exit(1);
    }
    return sb;
}

/* ---- creation and limits ------------------------------------------------------------ */

static void test_limits(void)
{
    rp_sandbox_limits d = rp_sandbox_limits_default();
    ok(d.max_instructions == 200000000 && d.max_wall_s == 5.0 &&
           d.max_memory_bytes == (size_t)256 << 20 && d.max_depth == 200,
       "default limits are 200M instructions, 5 s, 256 MiB, 200 levels");
    struct {
        rp_sandbox_limits lim;
        const char *message;
    } bad[] = {
        {{0, 5, 1 << 26, 200, 0, NULL, NULL}, "max_instructions is 0; it must be at least 1"},
        {{-5, 5, 1 << 26, 200, 0, NULL, NULL}, "max_instructions is -5"},
        {{1000, 0, 1 << 26, 200, 0, NULL, NULL}, "max_wall_s is 0; it must be a positive finite"},
        {{1000, NAN, 1 << 26, 200, 0, NULL, NULL}, "max_wall_s is nan"},
        {{1000, INFINITY, 1 << 26, 200, 0, NULL, NULL}, "max_wall_s is inf"},
        {{1000, 1, 4096, 200, 0, NULL, NULL}, "max_memory_bytes is 4096; it must be at least 1048576"},
        {{1000, 1, 1 << 26, 0, 0, NULL, NULL}, "max_depth is 0; it must be within 1..10000"},
        {{1000, 1, 1 << 26, 10001, 0, NULL, NULL}, "max_depth is 10001"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        rp_sandbox *sb = (rp_sandbox *)&bad; /* must stay untouched */
        rp_error err;
        rp_status st = rp_sandbox_new(ctx, &bad[i].lim, &sb, &err);
        ok(st == RP_EINVAL && strstr(err.text, bad[i].message) && sb == (rp_sandbox *)&bad,
           "invalid limits refused: %s", bad[i].message);
    }
    rp_sandbox *sb;
    rp_error err;
    is_int(rp_sandbox_new(ctx, NULL, &sb, &err), RP_OK, "NULL limits mean the defaults");
    ok(rp_sandbox_limits_of(sb)->max_depth == 200, "the sandbox reports its limits");
    size_t fresh = rp_sandbox_memory_bytes(sb);
    diag("a fresh sandbox holds %zu bytes", fresh);
    ok(fresh > 10000 && fresh < RP_SANDBOX_MIN_MEMORY / 2, "a fresh sandbox fits well within the minimum cap");
    rp_sandbox_free(sb);
    rp_sandbox_free(NULL);

    rp_sandbox_limits small = {1000, 60, RP_SANDBOX_MIN_MEMORY, 200, 0, NULL, NULL};
    is_int(rp_sandbox_new(ctx, &small, &sb, &err), RP_OK, "a sandbox with the minimum memory cap works");
    is_str(eval(sb, "return 6 * 7"), "42", "and runs a policy");
    rp_sandbox_free(sb);
}

/* ---- the whitelist ------------------------------------------------------------------ */

typedef struct name_list {
    char names[512][64];
    int n;
} name_list;

static void walk(lua_State *L, int table, const char *prefix, name_list *out, int visited)
{
    lua_pushvalue(L, table);
    lua_rawget(L, visited);
    bool seen = !lua_isnil(L, -1);
    lua_pop(L, 1);
    if (seen) return;
    lua_pushvalue(L, table);
    lua_pushboolean(L, 1);
    lua_rawset(L, visited);
    if (lua_getmetatable(L, table)) {
        if (out->n < 512) snprintf(out->names[out->n++], 64, "%s<metatable>", prefix);
        walk(L, lua_gettop(L), prefix, out, visited);
        lua_pop(L, 1);
    }
    lua_pushnil(L);
    while (lua_next(L, table)) {
        char name[64];
        if (lua_type(L, -2) == LUA_TSTRING)
            snprintf(name, sizeof name, "%s%s", prefix, lua_tostring(L, -2));
        else
            snprintf(name, sizeof name, "%s[%s]", prefix, luaL_typename(L, -2));
        if (out->n < 512) snprintf(out->names[out->n++], 64, "%s", name);
        if (lua_type(L, -1) == LUA_TTABLE) {
            char sub[80];
            snprintf(sub, sizeof sub, "%s.", name);
            walk(L, lua_gettop(L), sub, out, visited);
        }
        lua_pop(L, 1);
    }
}

static int cmp_names(const void *a, const void *b) { return strcmp(a, b); }

static void test_whitelist(void)
{
    rp_sandbox *sb = new_sandbox(0, 0, 0, 0);
    lua_State *L = rp_sandbox_state(sb);
    lua_newtable(L);
    int visited = lua_gettop(L);
    rp_sandbox_push_env(sb);
    name_list *got = calloc(1, sizeof *got);
    walk(L, lua_gettop(L), "", got, visited);
    lua_settop(L, 0);
    qsort(got->names, (size_t)got->n, 64, cmp_names);

    /* rawlen only exists in LuaJIT builds with 5.2 extensions */
    lua_State *plain = luaL_newstate();
    luaL_openlibs(plain);
    lua_getglobal(plain, "rawlen");
    bool has_rawlen = !lua_isnil(plain, -1);
    lua_close(plain);

    static const char *const expected[] = {
        "_G", "assert", "collectgarbage", "error", "getmetatable", "ipairs", "math",
        "math.abs", "math.acos", "math.asin", "math.atan", "math.atan2", "math.ceil",
        "math.cos", "math.cosh", "math.deg", "math.exp", "math.floor", "math.fmod",
        "math.frexp", "math.huge", "math.ldexp", "math.log", "math.log10", "math.max",
        "math.min", "math.modf", "math.pi", "math.pow", "math.rad", "math.random",
        "math.randomseed", "math.sin", "math.sinh", "math.sqrt", "math.tan", "math.tanh",
        "next", "pairs", "pcall", "rawequal", "rawget", "rawlen", "rawset", "rp", "select",
        "setmetatable", "string", "string.byte", "string.char", "string.find",
        "string.format", "string.gmatch", "string.gsub", "string.len", "string.lower",
        "string.match", "string.rep", "string.reverse", "string.sub", "string.upper",
        "table", "table.concat", "table.insert", "table.maxn", "table.remove", "table.sort",
        "tonumber", "tostring", "type", "unpack", "xpcall", NULL};
    name_list *want = calloc(1, sizeof *want);
    for (int i = 0; expected[i]; i++)
        if (has_rawlen || strcmp(expected[i], "rawlen") != 0)
            snprintf(want->names[want->n++], 64, "%s", expected[i]);
    qsort(want->names, (size_t)want->n, 64, cmp_names);
    bool same = got->n == want->n;
    for (int i = 0; same && i < got->n; i++) same = strcmp(got->names[i], want->names[i]) == 0;
    if (!same) {
        for (int i = 0; i < got->n; i++) diag("reachable: %s", got->names[i]);
    }
    ok(same, "every global reachable from the policy environment is on the whitelist (%d names)", got->n);
    free(got);
    free(want);

    /* The string metatable (shared by every string) points at the policy's string copy,
     * which has no dump, and hides itself. */
    lua_pushliteral(L, "");
    lua_getmetatable(L, -1);
    lua_getfield(L, -1, "__index");
    rp_sandbox_push_env(sb);
    lua_getfield(L, -1, "string");
    ok(lua_rawequal(L, -1, -3), "the string metatable's __index is the policy's string table");
    lua_getfield(L, -4, "__metatable");
    ok(lua_type(L, -1) == LUA_TBOOLEAN && !lua_toboolean(L, -1), "the string metatable's __metatable is false");
    lua_settop(L, 0);
    rp_sandbox_free(sb);
}

/* ---- escape attempts ---------------------------------------------------------------- */

typedef struct escape {
    const char *name;
    const char *source;
    const char *expect; /* exact result, or the start of an error ("EPOLICY: ...") */
} escape;

static int writer(lua_State *L, const void *p, size_t n, void *ud)
{
    (void)L;
    luaL_addlstring(ud, p, n);
    return 0;
}

static void test_escapes(void)
{
    static const escape cases[] = {
        {"io is absent", "return type(io)", "nil"},
        {"os is absent", "return type(os)", "nil"},
        {"require is absent", "return type(require)", "nil"},
        {"package is absent", "return type(package)", "nil"},
        {"debug is absent", "return type(debug)", "nil"},
        {"ffi is absent", "return type(ffi)", "nil"},
        {"jit is absent", "return type(jit)", "nil"},
        {"bit is absent", "return type(bit)", "nil"},
        {"print is absent", "return type(print)", "nil"},
        {"load is absent", "return type(load)", "nil"},
        {"loadstring is absent", "return type(loadstring)", "nil"},
        {"dofile is absent", "return type(dofile)", "nil"},
        {"loadfile is absent", "return type(loadfile)", "nil"},
        {"getfenv is absent", "return type(getfenv)", "nil"},
        {"setfenv is absent", "return type(setfenv)", "nil"},
        {"newproxy is absent", "return type(newproxy)", "nil"},
        {"module is absent", "return type(module)", "nil"},
        {"gcinfo is absent", "return type(gcinfo)", "nil"},
        {"coroutine is absent", "return type(coroutine)", "nil"},
        {"string.dump is absent", "return type(string.dump)", "nil"},
        {"string methods do not reach dump", "return type(('').dump)", "nil"},
        {"calling dump through a string fails", "return ('x'):dump()",
         "EPOLICY: policy.lua:1: attempt to call method 'dump' (a nil value)"},
        {"getmetatable('') hides the string metatable", "return tostring(getmetatable(''))", "false"},
        {"string metatable __index tampering refused", "getmetatable('').__index = {} return 1",
         "EPOLICY: policy.lua:1: attempt to index a boolean value"},
        {"setmetatable on the string metatable refused",
         "setmetatable(getmetatable(''), {}) return 1",
         "EPOLICY: policy.lua:1: bad argument #1 to 'setmetatable' (table expected, got boolean)"},
        {"setmetatable on a string refused", "setmetatable('', {}) return 1",
         "EPOLICY: policy.lua:1: bad argument #1 to 'setmetatable' (table expected, got string)"},
        {"rawset on the string metatable refused", "rawset(getmetatable('x'), '__index', {}) return 1",
         "EPOLICY: policy.lua:1: bad argument #1 to 'rawset' (table expected, got boolean)"},
        {"_G is the policy environment, not the real globals",
         "return tostring(rawget(_G, '_G') == _G and rawget(_G, 'print') == nil and rawget(_G, 'io') == nil)",
         "true"},
        {"rawget(_G, 'load') finds nothing", "return type(rawget(_G, 'load'))", "nil"},
        {"a protected metatable cannot be replaced",
         "local t = setmetatable({}, {__metatable = 'locked'}) "
         "return tostring(getmetatable(t)) .. ' ' .. tostring(pcall(setmetatable, t, {}))",
         "locked false"},
        {"collectgarbage('collect') refused", "collectgarbage('collect') return 1",
         "EPOLICY: policy.lua:1: collectgarbage(\"collect\") is not allowed in a policy (only \"count\")"},
        {"collectgarbage('stop') refused", "collectgarbage('stop') return 1",
         "EPOLICY: policy.lua:1: collectgarbage(\"stop\") is not allowed"},
        {"collectgarbage('step') refused", "collectgarbage('step', 100) return 1",
         "EPOLICY: policy.lua:1: collectgarbage(\"step\") is not allowed"},
        {"collectgarbage('setpause') refused", "collectgarbage('setpause', 0) return 1",
         "EPOLICY: policy.lua:1: collectgarbage(\"setpause\") is not allowed"},
        {"collectgarbage() (a full collection) refused", "collectgarbage() return 1",
         "EPOLICY: policy.lua:1: collectgarbage(\"collect\") is not allowed"},
        {"collectgarbage('count') allowed", "return type(collectgarbage('count'))", "number"},
        {"tostring shows no address", "return tostring({}) .. ' ' .. tostring(print or tostring)",
         "table function"},
        {"string.format %s shows no address", "return string.format('%s|%5s', {}, true)", "table| true"},
        {"string.format %q shows no address",
         "return string.format('%q|%q|%q|%q|%q', {}, print or tostring, true, nil, setmetatable({}, {__tostring = function() return 'mine' end}))",
         "\"table\"|\"function\"|\"true\"|\"nil\"|\"mine\""},
        {"string.format %q of strings and numbers as before", "return string.format('%q %q', 'a\\nb', 42)",
         "\"a\\\nb\" \"42\""},
        {"string.format %p refused", "local s = string.format('%p', {}) return s",
         "EPOLICY: policy.lua:1: bad argument to 'format' (%p is not available to policies"},
        {"a __gc on a table never runs policy code outside a call",
         "setmetatable({}, {__gc = function() while true do end end}) "
         "local t = {} for i = 1, 2000 do t[i] = {i} end return 'done'",
         "done"},
        {"changing the policy's string table stays inside the policy",
         "string.rep = nil return type(('x').rep)", "nil"},
        {"bytecode cannot be smuggled through a string escape",
         "return type(string.char(27) .. 'LJ')", "string"},
    };
    rp_sandbox *sb = new_sandbox(20000000, 0, 64 << 20, 0);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *got = eval(sb, cases[i].source);
        bool pass = strncmp(cases[i].expect, "EPOLICY", 7) == 0
                        ? strncmp(got, cases[i].expect, strlen(cases[i].expect)) == 0
                        : strcmp(got, cases[i].expect) == 0;
        if (!tap_ok_at(pass, __FILE__, __LINE__, "escape: %s", cases[i].name))
            diag("got '%s', expected '%s'", got, cases[i].expect);
    }

    /* Bytecode: a real LuaJIT dump, a Lua 5.1 signature, and bytecode after a #! line. */
    lua_State *plain = luaL_newstate();
    luaL_Buffer b;
    luaL_loadstring(plain, "return 'escaped'");
    luaL_buffinit(plain, &b);
    lua_dump(plain, writer, &b);
    luaL_pushresult(&b);
    size_t blen;
    const char *bc = lua_tolstring(plain, -1, &blen);
    rp_error err;
    lua_State *L = rp_sandbox_state(sb);
    int top = lua_gettop(L);
    ok(blen > 4 && memcmp(bc, "\x1bLJ", 3) == 0, "the test made LuaJIT bytecode");
    ok(rp_sandbox_load_text(sb, bc, blen, "evil.lua", &err) == RP_EPOLICY &&
           strstr(err.text, "evil.lua: precompiled bytecode is refused"),
       "escape: a LuaJIT bytecode chunk is refused");
    ok(rp_sandbox_load_text(sb, "\x1bLua\x51\x00", 6, "evil.lua", &err) == RP_EPOLICY &&
           strstr(err.text, "precompiled bytecode is refused"),
       "escape: a Lua 5.1 bytecode chunk is refused");
    char *shebang = malloc(blen + 16);
    memcpy(shebang, "#!/bin/lua\n", 11);
    memcpy(shebang + 11, bc, blen);
    ok(rp_sandbox_load_text(sb, shebang, blen + 11, "evil.lua", &err) == RP_EPOLICY,
       "escape: bytecode after a #! line is refused (%s)", err.text);
    free(shebang);
    is_int(lua_gettop(L), top, "refused chunks leave the stack as it was");
    lua_close(plain);
    rp_sandbox_free(sb);
}

/* ---- hostile policies and limits ---------------------------------------------------- */

/* Each hostile chunk must fail with `expect` in its message, and the sandbox must run a
 * trivial chunk right after. */
static void hostile(rp_sandbox *sb, const char *name, const char *source, const char *expect)
{
    const char *got = eval(sb, source);
    like(got, expect, "hostile: %s", name);
    is_str(eval(sb, "local t = {} for i = 1, 100 do t[i] = i end return #t"), "100",
           "the sandbox is usable after: %s", name);
}

/* Run `source` in a fresh sandbox with the largest depth limit on a thread whose stack
 * is `stack_bytes`: what a trainer's planning thread may have. */
typedef struct small_stack_job {
    const char *source;
    char *out;
    size_t out_len;
} small_stack_job;

static void *small_stack_main(void *arg)
{
    small_stack_job *job = arg;
    rp_sandbox *sb = new_sandbox(50000000, 0, 64 << 20, RP_SANDBOX_MAX_DEPTH);
    snprintf(job->out, job->out_len, "%s", eval(sb, job->source));
    rp_sandbox_free(sb);
    return NULL;
}

static void run_on_small_stack(const char *source, size_t stack_bytes, char *out, size_t out_len)
{
    small_stack_job job = {source, out, out_len};
    pthread_attr_t attr;
    pthread_t t;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, stack_bytes);
    snprintf(out, out_len, "(thread did not start)");
    if (pthread_create(&t, &attr, small_stack_main, &job) == 0) pthread_join(t, NULL);
    pthread_attr_destroy(&attr);
}

/* One chunk run in an existing sandbox on a thread of its own. */
typedef struct tiny_job {
    rp_sandbox *sb;
    char *out;
    size_t out_len;
} tiny_job;

static void *tiny_main(void *arg)
{
    tiny_job *job = arg;
    snprintf(job->out, job->out_len, "%s", eval(job->sb, "return 1"));
    return NULL;
}

static void test_hostile(void)
{
    rp_sandbox *sb = new_sandbox(5000000, 0, 32 << 20, 0);
    hostile(sb, "while true do end", "while true do end",
            "ELIMIT: policy exceeded the instruction limit (5000000), at policy.lua:1 in the main chunk");
    hostile(sb, "a long numeric for loop", "for i = 1, 1e12 do end",
            "ELIMIT: policy exceeded the instruction limit (5000000)");
    hostile(sb, "repeat until false", "local n = 0 repeat n = n + 1 until false",
            "ELIMIT: policy exceeded the instruction limit");
    hostile(sb, "a goto loop", "::top:: goto top", "ELIMIT: policy exceeded the instruction limit");
    hostile(sb, "an infinite loop in a named function",
            "local function spin() while true do end end spin()",
            "ELIMIT: policy exceeded the instruction limit (5000000), at policy.lua:1 in function 'spin'");
    hostile(sb, "a loop inside pcall is not swallowed",
            "local ok = pcall(function() while true do end end) return 'survived'",
            "ELIMIT: policy exceeded the instruction limit");
    hostile(sb, "pcall inside an endless loop of pcalls",
            "while true do pcall(function() while true do end end) end",
            "ELIMIT: policy exceeded the instruction limit");
    hostile(sb, "pcall around a loop, then a loop",
            "pcall(function() while true do end end) while true do end",
            "ELIMIT: policy exceeded the instruction limit");
    hostile(sb, "a looping xpcall handler runs no code after a trip",
            "xpcall(function() while true do end end, function() while true do end end) return 'survived'",
            "ELIMIT: policy exceeded the instruction limit");
    hostile(sb, "xpcall handlers in an endless loop",
            "while true do xpcall(function() while true do end end, function(e) while true do end end) end",
            "ELIMIT: policy exceeded the instruction limit");
    hostile(sb, "a caught limit error rethrown by the policy",
            "local ok, e = pcall(function() while true do end end) error(e)",
            "ELIMIT: policy exceeded the instruction limit");
    is_str(eval(sb, "local ok, e = xpcall(function() error('first') end, function(m) error('second') end) "
                    "return tostring(ok) .. ' ' .. tostring(e)"),
           "false error in error handling", "an error inside an xpcall handler is contained");
    is_str(eval(sb, "return select(2, xpcall(function() error('boom', 0) end, function(m) return 'handled ' .. m end))"),
           "handled boom", "xpcall handlers still run for ordinary errors");
    is_str(eval(sb, "return select('#', xpcall(function(...) return ... end, print or error, 1, 2, 3))"),
           "4", "xpcall passes extra arguments");
    like(eval(sb, "local ok = xpcall(function() end, 42) return ok"),
         "EPOLICY: policy.lua:1: bad argument #2 to 'xpcall' (function expected, got number)",
         "xpcall checks its handler");
    hostile(sb, "a loop inside an __index metamethod",
            "local t = setmetatable({}, {__index = function() while true do end end}) return t.x",
            "ELIMIT: policy exceeded the instruction limit");
    hostile(sb, "a loop inside a sort comparator",
            "table.sort({3, 2, 1}, function(a, b) while true do end end)",
            "ELIMIT: policy exceeded the instruction limit");
    hostile(sb, "a loop inside a gsub callback",
            "string.gsub('abc', '.', function() while true do end end)",
            "ELIMIT: policy exceeded the instruction limit");
    hostile(sb, "a loop inside __tostring",
            "return tostring(setmetatable({}, {__tostring = function() while true do end end}))",
            "ELIMIT: policy exceeded the instruction limit");
    hostile(sb, "a catastrophic pattern is bounded",
            "local i = string.find(string.rep('a', 1e6), '(.-)(.-)(.-)(.-)b') return i",
            "ELIMIT: policy exceeded the instruction limit (5000000), at policy.lua:1 in the main chunk");
    hostile(sb, "a catastrophic match inside pcall is not swallowed",
            "pcall(string.match, string.rep('a', 1e5), '(.*)(.*)(.*)x') return 'survived'",
            "ELIMIT: policy exceeded the instruction limit");
    hostile(sb, "%b over a long unbalanced subject is bounded",
            "return string.find(string.rep('(', 1e5), '%b()')",
            "ELIMIT: policy exceeded the instruction limit");
    hostile(sb, "a long bracket class is charged per character",
            "local class = '[' .. string.rep('b', 1e5) .. ']' "
            "return string.find(string.rep('a', 1e5), class)",
            "ELIMIT: policy exceeded the instruction limit");
    hostile(sb, "gmatch over a catastrophic pattern is bounded",
            "for a in string.gmatch(string.rep('a', 1e4), '(.-)(.-)(.-)b') do end",
            "ELIMIT: policy exceeded the instruction limit");
    hostile(sb, "gsub over a catastrophic pattern is bounded",
            "return (string.gsub(string.rep('a', 1e4), '(.-)(.-)(.-)b', ''))",
            "ELIMIT: policy exceeded the instruction limit");
    hostile(sb, "sorting a huge array is charged before it runs",
            "local t = {} for i = 1, 300000 do t[i] = -i end table.sort(t)",
            "ELIMIT: policy exceeded the instruction limit");
    hostile(sb, "pairs over a huge table is charged",
            "local t = {} for i = 1, 50000 do t['k' .. i] = i end "
            "for round = 1, 1000 do for k in pairs(t) do break end end",
            "ELIMIT: policy exceeded the instruction limit");
    hostile(sb, "table.insert at position -2^31 is refused",
            "table.insert({}, -2^31, 1)",
            "EPOLICY: policy.lua:1: bad argument #2 to 'insert' (position out of bounds)");
    hostile(sb, "table.insert far past the end is refused",
            "table.insert({1, 2}, 2^31, 1)", "bad argument #2 to 'insert' (position out of bounds)");
    is_str(eval(sb, "local t = {1, 2, 4} table.insert(t, 3, 3) table.insert(t, 5) "
                    "table.insert(t, 1, 0) return table.concat(t, ',')"),
           "0,1,2,3,4,5", "table.insert still inserts and appends");
    hostile(sb, "huge unpack", "local t = {} for i = 1, 1e5 do t[i] = i end local x = unpack(t) return x",
            "EPOLICY: policy.lua:1: too many results to unpack");
    hostile(sb, "select of a huge unpack", "return select('#', unpack({}, 1, 1e8))",
            "too many results to unpack");
    hostile(sb, "unpack with a wrapping range", "return select('#', unpack({}, -2^31, 2^31 - 1))",
            "too many results to unpack");
    hostile(sb, "string.byte of a long slice", "return string.byte(string.rep('x', 1e5), 1, -1)",
            "string slice too long");
    hostile(sb, "deep returns: a recursion returning ever more values",
            "local function many(n) if n == 0 then return end return n, many(n - 1) end return many(1e5)",
            "ELIMIT: policy exceeded the call depth limit of 200");
    rp_sandbox_free(sb);

    sb = new_sandbox(50000000, 0, 32 << 20, 0);
    hostile(sb, "deep recursion", "local function f(n) return 1 + f(n + 1) end return f(1)",
            "ELIMIT: policy exceeded the call depth limit of 200, at policy.lua:1 in function 'f'");
    hostile(sb, "deep recursion through pcall",
            "local function f() pcall(f) end f() return 'survived'",
            "ELIMIT: policy exceeded the call depth limit of 200");
    hostile(sb, "deep recursion through xpcall",
            "local function f() xpcall(f, function(e) return e end) end f() return 'survived'",
            "ELIMIT: policy exceeded the call depth limit of 200");
    hostile(sb, "recursion through a gsub callback",
            "local function f(s) return (string.gsub(s, '.', f)) end return f('ab')",
            "ELIMIT: policy exceeded the call depth limit of 200");
    hostile(sb, "recursion through a sort comparator",
            "local function f() table.sort({1, 2, 3}, function(a, b) f() return a < b end) end f()",
            "ELIMIT: policy exceeded the call depth limit of 200");
    hostile(sb, "recursion through __tostring",
            "local t t = setmetatable({}, {__tostring = function(x) return tostring(x) end}) return tostring(t)",
            "ELIMIT: policy exceeded the call depth limit of 200");
    hostile(sb, "recursion through __index",
            "local t t = setmetatable({}, {__index = function(s, k) return s[k .. 'x'] end}) return t.a",
            "ELIMIT: policy exceeded the call depth limit of 200");
    hostile(sb, "recursion through string.format and __tostring",
            "local t t = setmetatable({}, {__tostring = function(x) return string.format('%s', x) end}) "
            "return tostring(t)",
            "ELIMIT: policy exceeded the call depth limit of 200");
    hostile(sb, "recursion through pairs and __pairs",
            "local t t = setmetatable({}, {__pairs = function(x) return pairs(x) end}) "
            "for k in pairs(t) do end",
            "ELIMIT: policy exceeded the call depth limit of 200");
    is_str(eval(sb, "local function f(n) if n == 0 then return 0 end return 1 + f(n - 1) end return f(150)"),
           "150", "recursion within the depth limit works");
    rp_sandbox_free(sb);

    /* With the deepest depth limit, recursion through C functions (an 8 KiB luaL_Buffer
     * per gsub level) would overflow the C stack long before: the C stack guard trips. */
    sb = new_sandbox(50000000, 0, 64 << 20, RP_SANDBOX_MAX_DEPTH);
    hostile(sb, "C recursion through gsub under the largest depth limit",
            "local function f(s) return (string.gsub(s, '.', f)) end return f('ab')",
            "ELIMIT: policy exceeded the call depth limit of 10000");
    hostile(sb, "C recursion through sort under the largest depth limit",
            "local function f() table.sort({1, 2, 3}, function(a, b) f() return a < b end) end f()",
            "ELIMIT: policy exceeded the call depth limit of 10000");
    hostile(sb, "C recursion through tostring under the largest depth limit",
            "local t t = setmetatable({}, {__tostring = function(x) return tostring(x) end}) return tostring(t)",
            "ELIMIT: policy exceeded the call depth limit of 10000");
    is_str(eval(sb, "local function f(n) if n == 0 then return 0 end return 1 + f(n - 1) end return f(5000)"),
           "5000", "Lua recursion 5000 deep works under the largest depth limit");
    is_str(eval(sb, "local function f(n) if n == 0 then return 'tail' end return f(n - 1) end return f(1e6)"),
           "tail", "tail calls do not count as depth");
    rp_sandbox_free(sb);

    /* The same on a thread with a 1 MiB stack, through every C function that can call a
     * metamethod: format's %q and %s call __tostring from C, sort's default order calls
     * __lt. (%q reached __tostring unguarded and overflowed the stack.) */
    static const char *const c_recursion[] = {
        "local t t = setmetatable({}, {__tostring = function(x) return string.format('%q', x) end}) return tostring(t)",
        "local t t = setmetatable({}, {__tostring = function(x) return string.format('%q', x) end}) "
        "return string.format('%q', t)",
        "local t t = setmetatable({}, {__tostring = function(x) return string.format('%-20s', x) end}) "
        "return string.format('%10s', t)",
        "local mt = {} mt.__lt = function(a, b) table.sort({setmetatable({}, mt), setmetatable({}, mt)}) return false end "
        "table.sort({setmetatable({}, mt), setmetatable({}, mt)})",
        "local mt = {} mt.__tostring = function(x) return (string.gsub('a', 'a', function() return tostring(x) end)) end "
        "return tostring(setmetatable({}, mt))",
    };
    for (size_t i = 0; i < sizeof c_recursion / sizeof c_recursion[0]; i++) {
        char got[512];
        run_on_small_stack(c_recursion[i], (size_t)1 << 20, got, sizeof got);
        like(got, "ELIMIT: policy exceeded the call depth limit of 10000",
             "C recursion on a 1 MiB thread stack trips the depth limit (case %zu)", i + 1);
    }

    /* Smaller thread stacks than the guard's 256 KiB (musl's default is 128 KiB): the
     * guard is sized from what the thread has, or the call is refused; a recursive gsub
     * at the largest depth limit crashed a 256 KiB thread before. */
    static const char gsub_recursion[] =
        "local function f(s) return (string.gsub(s, '.', function(c) return f(c) end)) end return f('x')";
    static const size_t small_stacks[] = {(size_t)128 << 10, (size_t)192 << 10, (size_t)256 << 10};
    for (size_t i = 0; i < sizeof small_stacks / sizeof small_stacks[0]; i++) {
        char got[512];
        run_on_small_stack(gsub_recursion, small_stacks[i], got, sizeof got);
        ok(strstr(got, "ELIMIT: policy exceeded the call depth limit of 10000") ||
               strstr(got, "EINVAL: sandbox: the calling thread has"),
           "recursive gsub on a %zu KiB thread stack trips the depth limit or is refused: %s", small_stacks[i] >> 10,
           got);
    }
    char nested[600] = "return ";
    for (int i = 0; i < 190; i++) strcat(nested, "(");
    strcat(nested, "1");
    for (int i = 0; i < 190; i++) strcat(nested, ")");
    char got_nested[512];
    run_on_small_stack(nested, (size_t)128 << 10, got_nested, sizeof got_nested);
    ok(strcmp(got_nested, "1") == 0 || strstr(got_nested, "EINVAL: sandbox: the calling thread has"),
       "190 nested parentheses compile on a 128 KiB thread stack, or are refused: %s", got_nested);
    /* a stack of our own (glibc would hand out a larger cached one for a small size) */
    char got_tiny[512] = "(thread did not start)";
    rp_sandbox *tiny_sb = new_sandbox(50000000, 0, 64 << 20, 0);
    tiny_job tj = {tiny_sb, got_tiny, sizeof got_tiny};
    void *stack = NULL;
    pthread_attr_t tiny_attr;
    pthread_t tiny_thread;
    pthread_attr_init(&tiny_attr);
    if (posix_memalign(&stack, 4096, (size_t)48 << 10) == 0 &&
        pthread_attr_setstack(&tiny_attr, stack, (size_t)48 << 10) == 0 &&
        pthread_create(&tiny_thread, &tiny_attr, tiny_main, &tj) == 0)
        pthread_join(tiny_thread, NULL);
    pthread_attr_destroy(&tiny_attr);
    free(stack);
    rp_sandbox_free(tiny_sb);
    like(got_tiny, "EINVAL: sandbox: the calling thread has",
         "a call on a 48 KiB thread stack is refused, saying why: %s", got_tiny);

    /* memory: a 16 MiB cap */
    sb = new_sandbox(100000000, 0, 16 << 20, 0);
    size_t baseline = rp_sandbox_memory_bytes(sb);
    hostile(sb, "string.rep memory bomb", "return #string.rep('x', 2^30)",
            "ELIMIT: policy exceeded the memory limit of 16 MiB");
    hostile(sb, "string.rep with a separator", "return #string.rep('xy', 2^28, ',')",
            "ELIMIT: policy exceeded the memory limit of 16 MiB");
    /* over 2 GiB: LuaJIT raises its memory error without asking the allocator; that is
     * the policy's failure (a limit), not the process out of memory */
    hostile(sb, "string.rep past LuaJIT's largest string", "return #string.rep('xx', 2^30)",
            "ELIMIT: policy exceeded the memory limit of 16 MiB (it asked for a string or table larger than LuaJIT can hold)");
    hostile(sb, "the same inside a function", "local function f() return string.rep('xx', 2^30) end return #f()",
            "ELIMIT: policy exceeded the memory limit of 16 MiB");
    is_str(eval(sb, "local ok, e = pcall(string.rep, 'xx', 2^30) return tostring(ok) .. ' ' .. e"),
           "false not enough memory", "a policy may catch that error (nothing was allocated)");
    hostile(sb, "doubling a string", "local s = 'x' while true do s = s .. s end",
            "ELIMIT: policy exceeded the memory limit of 16 MiB");
    hostile(sb, "a table allocation bomb", "local t = {} local i = 0 while true do i = i + 1 t[i] = {i} end",
            "ELIMIT: policy exceeded the memory limit of 16 MiB");
    hostile(sb, "string interning bomb", "local t = {} for i = 1, 1e7 do t[i] = 'key' .. i end",
            "ELIMIT: policy exceeded the memory limit of 16 MiB");
    hostile(sb, "a caught memory error still fails the call",
            "local ok = pcall(string.rep, 'x', 2^30) return 'survived ' .. tostring(ok)",
            "ELIMIT: policy exceeded the memory limit of 16 MiB");
    hostile(sb, "a caught memory error followed by a loop",
            "pcall(string.rep, 'x', 2^30) while true do end",
            "ELIMIT: policy exceeded the memory limit of 16 MiB");
    hostile(sb, "table.concat bomb",
            "local s = string.rep('x', 2^20) local t = {} for i = 1, 64 do t[i] = s end return #table.concat(t)",
            "ELIMIT: policy exceeded the memory limit of 16 MiB");
    hostile(sb, "gsub output bomb",
            "return #string.gsub(string.rep('x', 2^16), 'x', string.rep('y', 1024))",
            "ELIMIT: policy exceeded the memory limit of 16 MiB");
    size_t after = rp_sandbox_memory_bytes(sb);
    diag("memory: %zu bytes fresh, %zu after the bombs", baseline, after);
    /* what stays is mostly LuaJIT's string table, grown by the interning bomb: each
     * collection halves it */
    ok(after < (4 << 20) + (512 << 10), "memory falls back far below the cap after the bombs");
    is_str(eval(sb, "local t = {} for i = 1, 1e5 do t[i] = {i} end return #t"), "100000",
           "a policy using a few MiB still runs under the cap");
    is_str(eval(sb, "local n = 0 for round = 1, 40 do local t = {} for i = 1, 3e4 do t[i] = {i} end n = n + #t end return n"),
           "1200000", "garbage does not count against the cap (emergency collections)");
    rp_sandbox_free(sb);

    /* wall time: an effectively unlimited instruction budget */
    sb = new_sandbox(INT64_MAX, 0.2, 0, 0);
    hostile(sb, "a loop stopped by the wall-time limit", "while true do end",
            "ELIMIT: policy exceeded the wall-time limit of 0.2 s");
    hostile(sb, "a catastrophic pattern stopped by the wall-time limit",
            "return string.find(string.rep('a', 1e6), '(.-)(.-)(.-)(.-)b')",
            "ELIMIT: policy exceeded the wall-time limit of 0.2 s");
    rp_sandbox_free(sb);
}

/* ---- errors ------------------------------------------------------------------------- */

static void test_errors(void)
{
    rp_sandbox *sb = new_sandbox(5000000, 0, 32 << 20, 0);
    lua_State *L = rp_sandbox_state(sb);
    rp_error err;
    const char *syntax = "return {\n  name = 'x',\n  plan = function( end\n}\n";
    is_int(rp_sandbox_load_text(sb, syntax, strlen(syntax), "policy.lua", &err), RP_EPOLICY,
           "a syntax error is a policy error");
    like(err.text, "policy.lua:3: ", "the syntax error names chunk and line");
    is_int(err.line, 3, "the syntax error's line is in err->line");

    const char *runtime = "local function inner()\n  local x = nil\n  return x.field\nend\n"
                          "local function plan()\n  local v = inner()\n  return v\nend\nlocal r = plan()\nreturn r\n";
    is_int(rp_sandbox_load_text(sb, runtime, strlen(runtime), "policy.lua", &err), RP_EPOLICY,
           "a runtime error is a policy error");
    like(err.text, "policy.lua:3: attempt to index local 'x' (a nil value)", "the runtime error message");
    like(err.text, "(traceback: policy.lua:3 in function 'inner'", "the traceback starts where it failed");
    like(err.text, "; policy.lua:6 in function 'plan'; policy.lua:9 in the main chunk)",
         "the traceback goes up to the chunk");
    is_int(err.line, 3, "the runtime error's line is in err->line");

    like(eval(sb, "error('plain', 0)"), "EPOLICY: plain", "error with level 0 has no position");
    like(eval(sb, "error(42, 0)"), "EPOLICY: 42 (traceback", "a number error object");
    like(eval(sb, "error()"), "EPOLICY: (error object is a nil value)", "a nil error object");
    like(eval(sb, "error(true)"), "EPOLICY: (error object is a boolean value)", "a boolean error object");
    like(eval(sb, "error({code = 7})"), "EPOLICY: (error object is a table value)", "a table error object");
    like(eval(sb, "error(setmetatable({}, {__tostring = function() return 'custom text' end}))"),
         "EPOLICY: custom text", "an error object's __tostring is used");
    like(eval(sb, "error(setmetatable({}, {__tostring = function() error('nested failure', 0) end}))"),
         "EPOLICY: (error object is a table value; its __tostring failed: nested failure)",
         "an error object whose __tostring errors");
    like(eval(sb, "error(setmetatable({}, {__tostring = function() return {} end}))"),
         "EPOLICY: (error object is a table value; its __tostring did not return a string)",
         "an error object whose __tostring returns a table");
    like(eval(sb, "error(setmetatable({}, {__tostring = function() while true do end end}))"),
         "ELIMIT: policy exceeded the instruction limit",
         "an error object whose __tostring loops is stopped by the limit");
    like(eval(sb, "error(setmetatable({}, {__tostring = function() return string.rep('y', 2^30) end}))"),
         "ELIMIT: policy exceeded the memory limit", "an error object whose __tostring eats memory");
    like(eval(sb, "error(string.rep('z', 5000))"), "EPOLICY: policy.lua:1: zzzz",
         "a long error message is cut to fit");
    is_str(eval(sb, "return 1, 2, 3"), "1", "a chunk's first return value is kept");
    is_str(eval(sb, ""), "nil", "an empty chunk returns nil");

    /* rp_sandbox_call: many results, arguments, stack discipline */
    int top = lua_gettop(L);
    const char *many = "return function(n, ...) local t = {} for i = 1, n do t[i] = i end "
                       "return unpack(t) end";
    is_int(rp_sandbox_load_text(sb, many, strlen(many), "many.lua", &err), RP_OK, "load a function");
    lua_pushvalue(L, -1);
    lua_pushnumber(L, 7999);
    is_int(rp_sandbox_call(sb, 1, LUA_MULTRET, &err), RP_OK, "a call returning 7999 values");
    is_int(lua_gettop(L) - top, 1 + 7999, "all 7999 results are on the stack");
    ok(lua_tonumber(L, -1) == 7999 && lua_tonumber(L, top + 2) == 1, "in order");
    lua_settop(L, top + 1);
    lua_pushvalue(L, -1);
    lua_pushnumber(L, 9000);
    is_int(rp_sandbox_call(sb, 1, 2, &err), RP_EPOLICY, "a call returning 9000 values fails");
    like(err.text, "too many results to unpack", "with a clear message");
    is_int(lua_gettop(L), top + 1, "a failed call removes its function and arguments");
    lua_pushvalue(L, -1);
    lua_pushnumber(L, 3);
    is_int(rp_sandbox_call(sb, 1, 2, &err), RP_OK, "nresults trims the results");
    ok(lua_gettop(L) == top + 3 && lua_tonumber(L, -1) == 2, "to the number asked for");
    lua_settop(L, top);
    ok(lua_gethook(L) == NULL, "no hook is left set between calls");
    lua_pushnil(L);
    is_int(rp_sandbox_call(sb, 0, 0, &err), RP_EINVAL, "a call of nil is refused");
    lua_settop(L, top);
    lua_pushnumber(L, 1);
    is_int(rp_sandbox_call(sb, 0, 0, &err), RP_EINVAL, "a call of a number is refused");
    like(err.text, "needs a function and 0 arguments", "with a message");
    lua_settop(L, top);
    is_int(rp_sandbox_load_text(sb, NULL, 5, "x.lua", &err), RP_EINVAL, "NULL source with a length is refused");
    is_int(rp_sandbox_load_text(sb, NULL, 0, NULL, &err), RP_OK, "an empty source loads");
    lua_settop(L, top);
    rp_sandbox_free(sb);
}

/* ---- the C side: primitives charge work, no nested calls ---------------------------- */

static int prim_burn(lua_State *L)
{
    rp_sandbox_charge(L, (int64_t)luaL_checknumber(L, 1));
    lua_pushliteral(L, "burned");
    return 1;
}

static int prim_try(lua_State *L)
{
    if (rp_sandbox_try_charge(L, (int64_t)luaL_checknumber(L, 1)) != RP_OK) {
        /* a primitive would free its scratch memory here */
        return rp_sandbox_raise(L);
    }
    lua_pushliteral(L, "charged");
    return 1;
}

static int prim_nested(lua_State *L)
{
    rp_sandbox *sb = rp_sandbox_of(L);
    lua_pushvalue(L, 1);
    rp_error err;
    rp_status st = rp_sandbox_call(sb, 0, 0, &err);
    lua_pushinteger(L, st);
    return 1;
}

static int prim_work(lua_State *L)
{
    lua_pushnumber(L, (lua_Number)rp_sandbox_work(rp_sandbox_of(L)));
    return 1;
}

static int install_rp(lua_State *L)
{
    rp_sandbox *sb = lua_touserdata(L, 1);
    rp_sandbox_push_env(sb);
    lua_newtable(L);
    lua_pushcfunction(L, prim_burn);
    lua_setfield(L, -2, "burn");
    lua_pushcfunction(L, prim_try);
    lua_setfield(L, -2, "try");
    lua_pushcfunction(L, prim_nested);
    lua_setfield(L, -2, "nested");
    lua_pushcfunction(L, prim_work);
    lua_setfield(L, -2, "work");
    lua_setfield(L, -2, "rp");
    return 0;
}

static void test_primitives(void)
{
    rp_sandbox *sb = new_sandbox(1000000, 0, 32 << 20, 0);
    lua_State *L = rp_sandbox_state(sb);
    is_int(lua_cpcall(L, install_rp, sb), 0, "the engine fills `rp` inside a protected call");
    is_str(eval(sb, "return rp.burn(1000)"), "burned", "a primitive charges work within the budget");
    like(eval(sb, "local r = rp.burn(2e6) return r"),
         "ELIMIT: policy exceeded the instruction limit (1000000), at policy.lua:1 in the main chunk",
         "a primitive's charge trips the instruction limit");
    like(eval(sb, "pcall(rp.burn, 2e6) return 'survived'"), "ELIMIT: policy exceeded the instruction limit",
         "a primitive's trip is not swallowed by pcall");
    like(eval(sb, "for i = 1, 1e6 do rp.burn(10) end"), "ELIMIT: policy exceeded the instruction limit",
         "charges add up with the instructions");
    is_str(eval(sb, "return rp.try(10)"), "charged", "try_charge within the budget");
    like(eval(sb, "return rp.try(5e6)"), "ELIMIT: policy exceeded the instruction limit",
         "try_charge then raise");
    is_str(eval(sb, "return rp.nested(function() end)"), "1",
           "rp_sandbox_call from inside a call is refused with RP_EINVAL");
    is_str(eval(sb, "local s = 0 for i = 1, 10000 do s = s + i end return rp.work() > 10000"), "true",
           "work counts the call's instructions");
    ok(rp_sandbox_work(sb) >= 10000, "rp_sandbox_work reports the last call (%lld)",
       (long long)rp_sandbox_work(sb));
    rp_sandbox_charge(L, 1000000000);
    ok(1, "charging outside a call does nothing");
    rp_sandbox_free(sb);
}

/* ---- work inside one call of a library function or one VM instruction ---------------- */

/* The injected clock: time stands still until a policy calls rp.expire(), or a test
 * primitive "runs long" with rp.slow(). */
static double fake_now;
static double fake_clock(void *ud)
{
    (void)ud;
    return fake_now;
}

static int prim_expire(lua_State *L)
{
    (void)L;
    fake_now += 1000;
    return 0;
}

static long ticks;
static int prim_tick(lua_State *L)
{
    (void)L;
    ticks++;
    return 0;
}

/* A host primitive whose C work ran past the wall-time limit, then checks the clock. */
static int prim_slow(lua_State *L)
{
    fake_now += 1000;
    rp_sandbox_check_clock(L);
    lua_pushliteral(L, "returned");
    return 1;
}

static int install_clock_rp(lua_State *L)
{
    rp_sandbox *sb = lua_touserdata(L, 1);
    rp_sandbox_push_env(sb);
    lua_newtable(L);
    lua_pushcfunction(L, prim_expire);
    lua_setfield(L, -2, "expire");
    lua_pushcfunction(L, prim_tick);
    lua_setfield(L, -2, "tick");
    lua_pushcfunction(L, prim_slow);
    lua_setfield(L, -2, "slow");
    lua_pushcfunction(L, prim_work);
    lua_setfield(L, -2, "work");
    lua_setfield(L, -2, "rp");
    return 0;
}

static void test_work_in_one_call(void)
{
    /* library functions pre-charge by argument size (LuaJIT's run in one call, where no
     * hook fires): each of these ran for seconds uncharged */
    rp_sandbox *sb = new_sandbox(5000000, 0, 64 << 20, 0);
    hostile(sb, "sort of long strings by the default order",
            "local s = string.rep('x', 2^18) local t = {} for i = 1, 128 do t[i] = s .. i end table.sort(t)",
            "ELIMIT: policy exceeded the instruction limit (5000000)");
    is_str(eval(sb, "local t = {'b', 'a', 'c'} table.sort(t) return table.concat(t)"), "abc",
           "sorting short strings is cheap");
    hostile(sb, "a C function as sort comparator", "table.sort({'a', 'b', 'c'}, string.find)",
            "EPOLICY: policy.lua:1: bad argument #2 to 'sort' (a C function as comparator is not available to policies");
    hostile(sb, "tonumber of a long string in a loop",
            "local s = ' 1' .. string.rep(' ', 2^20) for i = 1, 1000 do tonumber(s) end",
            "ELIMIT: policy exceeded the instruction limit (5000000)");
    hostile(sb, "plain find over a long string in a loop",
            "local s = string.rep('x', 2^20) for i = 1, 1000 do string.find(s, 'y', 1, true) end",
            "ELIMIT: policy exceeded the instruction limit (5000000)");
    hostile(sb, "re-making an existing long string with sub (no allocation)",
            "local s = string.rep('x', 2^20) for i = 1, 1000 do local t = s:sub(1, -1) end",
            "ELIMIT: policy exceeded the instruction limit (5000000)");
    hostile(sb, "upper of a long string in a loop",
            "local s = string.rep('X', 2^20) for i = 1, 1000 do local t = s:upper() end",
            "ELIMIT: policy exceeded the instruction limit (5000000)");
    hostile(sb, "table.concat of many long strings",
            "local s = string.rep('x', 2^16) local t = {} for i = 1, 100 do t[i] = s end "
            "for i = 1, 100 do table.concat(t) end",
            "ELIMIT: policy exceeded the instruction limit (5000000)");
    hostile(sb, "re-concatenation: allocated bytes are work",
            "local s = string.rep('x', 2^20) for i = 1, 1000 do local t = s .. i end",
            "ELIMIT: policy exceeded the instruction limit (5000000)");
    is_str(eval(sb, "return ('abc'):sub(2) .. tonumber('12') .. ('x'):rep(3, ',') .. table.concat({1, 2}, '-')"),
           "bc12x,x,x1-2", "the charged functions still work");
    rp_sandbox_free(sb);

    /* allocated bytes are counted as work: the same instructions, one concatenation
     * allocating a 1 MiB string more (and growing LuaJIT's buffer) */
    sb = new_sandbox(0, 0, 64 << 20, 0);
    lua_State *L = rp_sandbox_state(sb);
    lua_cpcall(L, install_clock_rp, sb);
    is_str(eval(sb, "local a = string.rep('x', 2^20) local b = 'z' .. 'y' return #b"), "2", "a call that builds a short string");
    int64_t short_work = rp_sandbox_work(sb);
    is_str(eval(sb, "local a = string.rep('x', 2^20) local b = a .. 'y' return #b"), "1048577", "and one that builds a long one");
    int64_t long_work = rp_sandbox_work(sb);
    ok(long_work - short_work >= (1 << 20) / RP_SANDBOX_BYTES_PER_UNIT,
       "the bytes the concatenation allocated are charged (%lld units more)", (long long)(long_work - short_work));
    rp_sandbox_free(sb);

    /* the object cap: the longest string a policy can build */
    sb = new_sandbox(0, 0, 64 << 20, 0);
    hostile(sb, "a string past the object cap", "return #string.rep('x', 2^23 + 1)",
            "ELIMIT: policy exceeded the object size limit of 8 MiB");
    hostile(sb, "concatenation past the object cap", "local s = string.rep('x', 2^22) return #(s .. s .. s)",
            "ELIMIT: policy exceeded the object size limit of 8 MiB");
    hostile(sb, "caught and ignored, it still fails",
            "pcall(string.rep, 'x', 2^23 + 1) return 'survived'", "ELIMIT: policy exceeded the object size limit");
    is_str(eval(sb, "return #string.rep('x', 2^23 - 64)"), "8388544", "a string just under the cap is fine");
    rp_sandbox_free(sb);
    rp_sandbox_limits lim = rp_sandbox_limits_default();
    lim.max_object_bytes = 1000;
    rp_sandbox *bad = NULL;
    rp_error err;
    ok(rp_sandbox_new(ctx, &lim, &bad, &err) == RP_EINVAL && strstr(err.text, "max_object_bytes is 1000"),
       "an object cap below 64 KiB is refused");

    /* the injected clock: time is checked after the call and after host primitives */
    sb = new_sandbox(0, 10, 64 << 20, 0);
    L = rp_sandbox_state(sb);
    lua_cpcall(L, install_clock_rp, sb);
    rp_sandbox_set_clock(sb, fake_clock, NULL);
    fake_now = 0;
    like(eval(sb, "rp.expire() return 'a plan'"), "ELIMIT: policy exceeded the wall-time limit of 10 s, at the end of the call",
         "a call whose time ran out fails even though it returned");
    like(eval(sb, "local ok = pcall(rp.slow) return 'a plan'"), "ELIMIT: policy exceeded the wall-time limit of 10 s",
         "a host primitive that ran long fails the call at once, also inside pcall");
    like(eval(sb, "local t = {} for i = 1, 100 do t[i] = -i end rp.expire() table.sort(t) return 'sorted'"),
         "ELIMIT: policy exceeded the wall-time limit", "the clock is read after table.sort");
    is_str(eval(sb, "return 'in time'"), "in time", "a call within its time passes");

    /* Long strings shorten the hook period, so the instructions after the deadline
     * touch a bounded number of bytes: with two 4 MiB strings alive the loop of
     * comparisons stops within a few instructions of the clock passing the deadline
     * (with the period of 1000 it ran ~200 more 4 MiB comparisons). */
    ticks = 0;
    like(eval(sb, "local a = string.rep('x', 2^22) .. 'a' local b = string.rep('x', 2^22) .. 'b'\n"
                  "rp.expire() for i = 1, 1e6 do if a < b then rp.tick() end end"),
         "ELIMIT: policy exceeded the wall-time limit", "comparisons of long strings stop at the deadline");
    ok(ticks <= 4, "within a few comparisons of it (%ld)", ticks);
    ticks = 0;
    like(eval(sb, "local t = {} for i = 1, 2^18 do t[i] = i end\n"
                  "rp.expire() for i = 1, 1e6 do rp.tick() end"),
         "ELIMIT: policy exceeded the wall-time limit", "a loop next to a big table stops at the deadline");
    ok(ticks > 100, "a big table does not shorten the period (%ld iterations ran: only strings do)", ticks);
    rp_sandbox_set_clock(sb, NULL, NULL);
    is_str(eval(sb, "return 'real clock'"), "real clock", "the real clock is back");
    rp_sandbox_free(sb);
}

/* ---- determinism -------------------------------------------------------------------- */

static void test_random(void)
{
    rp_sandbox *a = new_sandbox(0, 0, 0, 0), *b = new_sandbox(0, 0, 0, 0);
    const char *draw = "local t = {} for i = 1, 8 do t[i] = math.random(1, 1000000) end return table.concat(t, ',')";
    char first[256];
    rp_sandbox_seed(a, 42);
    rp_sandbox_seed(b, 42);
    snprintf(first, sizeof first, "%s", eval(a, draw));
    is_str(eval(b, draw), first, "same seed, same sequence in another sandbox");
    rp_sandbox_seed(a, 42);
    is_str(eval(a, draw), first, "reseeding restarts the sequence");
    rp_sandbox_seed(a, 43);
    ok(strcmp(eval(a, draw), first) != 0, "a different seed gives a different sequence");
    rp_sandbox_seed(a, 42);
    rp_sandbox_seed(b, 42);
    eval(a, "for i = 1, 100 do math.random() end return 1");
    is_str(eval(b, draw), first, "draws in one sandbox do not move another's sequence");
    rp_sandbox_seed(a, 0);
    is_str(eval(a, "return string.format('%.17g %d', math.random(), math.random(1, 2^53))"),
           "0.60126299941790484 3975251160876331", "the sequence for seed 0 is pinned (plans are reproducible)");
    is_str(eval(a, "local seen, lo, hi = {}, 1e9, -1e9 for i = 1, 2000 do local x = math.random(3, 7) "
                   "seen[x] = true lo = math.min(lo, x) hi = math.max(hi, x) end "
                   "return lo .. ' ' .. hi .. ' ' .. tostring(seen[3] and seen[5] and seen[7])"),
           "3 7 true", "math.random(m, n) stays in [m, n] and covers it");
    is_str(eval(a, "local ok = true for i = 1, 1000 do local x = math.random() ok = ok and x >= 0 and x < 1 end "
                   "return tostring(ok)"),
           "true", "math.random() is in [0, 1)");
    is_str(eval(a, "math.randomseed(7) local x = math.random(1e6) math.randomseed(7) return tostring(x == math.random(1e6))"),
           "true", "math.randomseed reseeds the policy's own sequence");
    like(eval(a, "local x = math.random(0) return x"), "EPOLICY: policy.lua:1: bad argument #1 to 'random' (interval is empty)",
         "an empty interval is an error");
    like(eval(a, "local x = math.random(1, 2, 3) return x"), "EPOLICY: policy.lua:1: wrong number of arguments",
         "too many arguments is an error");
    like(eval(a, "return math.random(1, 2^60)"), "number out of range", "a range beyond 2^53 is an error");
    rp_sandbox_free(a);
    rp_sandbox_free(b);
}

static void test_iteration_order(void)
{
    /* LuaJIT seeds its string hash per state: raw next() order differs between these two
     * sandboxes, pairs and next must not. */
    const char *order =
        "local t = {} for i = 60, 1, -1 do t['key' .. i] = i end "
        "for i = 10, 1, -1 do t[i] = i end t[2.5] = 1 t[-3] = 1 t[1e9] = 1 t[true] = 1 t[false] = 1 "
        "local out = {} for k in pairs(t) do out[#out + 1] = tostring(k) end "
        "local viaNext, k = {}, next(t) while k ~= nil do viaNext[#viaNext + 1] = tostring(k) k = next(t, k) end "
        "return table.concat(out, ' ') .. '|' .. table.concat(viaNext, ' ')";
    rp_sandbox *a = new_sandbox(0, 0, 0, 0), *b = new_sandbox(0, 0, 0, 0);
    char got_a[2048];
    snprintf(got_a, sizeof got_a, "%s", eval(a, order));
    is_str(eval(b, order), got_a, "pairs and next visit keys in the same order in every state");
    char want[2048] = "-3 1 2 2.5 3 4 5 6 7 8 9 10 1000000000";
    const char *strs[60];
    char names[60][16];
    for (int i = 0; i < 60; i++) {
        snprintf(names[i], sizeof names[i], "key%d", i + 1);
        strs[i] = names[i];
    }
    for (int i = 0; i < 60; i++)
        for (int j = i + 1; j < 60; j++)
            if (strcmp(strs[i], strs[j]) > 0) {
                const char *t = strs[i];
                strs[i] = strs[j];
                strs[j] = t;
            }
    for (int i = 0; i < 60; i++) {
        strcat(want, " ");
        strcat(want, strs[i]);
    }
    strcat(want, " false true");
    char both[4200];
    snprintf(both, sizeof both, "%s|%s", want, want);
    is_str(got_a, both, "the order is numbers, then strings by bytes, then false, true");
    is_str(eval(a, "local t = {a = 1, b = 2, c = 3, d = 4} local seen = {} "
                   "for k in pairs(t) do seen[#seen + 1] = k t[k] = nil end "
                   "return table.concat(seen) .. ' ' .. tostring(next(t))"),
           "abcd nil", "clearing fields during traversal works");
    is_str(eval(a, "local t = {x = 1, y = 2, z = 3} for k in pairs(t) do if k == 'x' then t.y = nil end end "
                   "local s = '' for k, v in pairs(t) do s = s .. k .. v end return s"),
           "x1z3", "a key removed during traversal is skipped");
    like(eval(a, "local t = {[{}] = 1} for k in pairs(t) do end"),
         "EPOLICY: policy.lua:1: pairs: a table key of type table has no deterministic order",
         "pairs refuses keys whose order would depend on addresses");
    like(eval(a, "local k = next({[print or tostring] = 1}) return k"),
         "EPOLICY: policy.lua:1: next: a table key of type function has no deterministic order",
         "next refuses them too");
    is_str(eval(a, "local t = {} t[{}] = 1 return tostring(t[next] == nil)"), "true",
           "tables as keys still work for lookups");
    is_str(eval(a, "return tostring(next({}))"), "nil", "next of an empty table is nil");
    like(eval(a, "local f = pairs(nil) return f"), "EPOLICY: policy.lua:1: bad argument #1 to 'pairs' (table expected, got nil)",
         "pairs checks its argument");
    is_str(eval(a, "local t = setmetatable({}, {__pairs = function(s) return function(_, k) "
                   "if not k then return 1, 'one' end end, s, nil end}) "
                   "local s = '' for k, v in pairs(t) do s = s .. k .. v end return s"),
           "1one", "pairs honours __pairs (for the engine's userdata views)");
    is_str(eval(a, "local t = {10, 20, 30, 40, [0] = 0, [-1] = -1, [2.5] = 2.5, [7] = 7, x = 'x'} "
                   "local s = {} for k in pairs(t) do s[#s + 1] = tostring(k) end return table.concat(s, ' ')"),
           "-1 0 1 2 2.5 3 4 7 x", "numbers that sort inside the array part keep the numeric order");
    is_str(eval(a, "local t = {10, 20, 30, [6] = 6, y = 1, x = 2} "
                   "local s = {} for k in pairs(t) do s[#s + 1] = tostring(k) end return table.concat(s, ' ')"),
           "1 2 3 6 x y", "the array part, then the other keys in order");
    is_str(eval(a, "local t = {1, 2, 3, 4, z = 1} local s = {} "
                   "for k in pairs(t) do s[#s + 1] = tostring(k) if k == 1 then t[2] = nil t[3] = nil end end "
                   "return table.concat(s, ' ')"),
           "1 4 z", "array fields cleared during traversal are skipped");
    is_str(eval(a, "local t = {} for i = 1, 300 do t['k' .. i] = i end local s, prev, sorted = 0, '', true "
                   "for k, v in pairs(t) do s = s + v sorted = sorted and k > prev prev = k end "
                   "return s .. ' ' .. tostring(sorted)"),
           "45150 true", "a large hash part is sorted too");
    is_str(eval(a, "local t = {} for i = 1, 1000 do t[i] = i end local n = 0 for k, v in pairs(t) do "
                   "if k ~= v then return 'bad' end n = n + 1 end return n"),
           "1000", "pairs over an array visits 1..n in order");
    rp_sandbox_free(a);
    rp_sandbox_free(b);
}

/* The bounded string functions give what LuaJIT's own give, run in a plain state. */
static void test_string_functions(void)
{
    static const char *const cases[] = {
        "string.find('hello world', 'o w')",
        "string.find('hello world', 'o', 6)",
        "string.find('hello', 'l', -2)",
        "string.find('hello', 'l', -100)",
        "string.find('hello', '', 10)",
        "string.find('hello', '', 6)",
        "string.find('hello', 'xyz', 0)",
        "string.find('a.b', '.', 1, true)",
        "string.find('a+b', '+', 1, true)",
        "string.find('hello', 'l+')",
        "string.find('hello', '^h(e)(l+)')",
        "string.find('hello', '^e')",
        "string.find('hello', 'o$')",
        "string.find('he$llo', '$l')",
        "string.find(12345, 34)",
        "string.find('hello', 'l', 2.7)",
        "string.match('key = value', '(%w+)%s*=%s*(%w+)')",
        "string.match('  trim  ', '^%s*(.-)%s*$')",
        "string.match('2024-01-15', '(%d+)-(%d+)-(%d+)')",
        "string.match('hello', '()ll()')",
        "string.match('f(a(b)c)d', '%b()')",
        "string.match('THE (quick) fox', '%f[%a]%a+', 5)",
        "string.match('abc', '[^%a]')",
        "string.match('a1-b2', '[%d%-]+')",
        "string.match('xyz', '[x-y]+')",
        "string.match('abab', '(ab)%1')",
        "string.match('a\\0b', '%z')",
        "string.match('a\\0b', '[%z]')",
        "string.match('caf\\195\\169', '%a+')",
        "string.match('tab\\there', '%S+%s')",
        "string.match('AbC', '%u%l%u')",
        "string.match('x=ff', '%x+$')",
        "string.match('!?', '%p+')",
        "string.match('abc', 'a?b?c?d?')",
        "string.match('aaab', 'a-b')",
        "string.match('aaa', 'a*$')",
        "string.match('hello', '.-(l+)(.*)')",
        "string.match('[test]', '^%[(.*)%]$')",
        "string.match('x', '%')",
        "string.match('x', '[a')",
        "string.match('x', '(x')",
        "string.match('x', 'x)')",
        "string.match('x', '%1')",
        "string.match('x', '%f')",
        "string.match('x', '%b')",
        "string.match('x', string.rep('()', 33))",
        "string.match(string.rep('a', 300), string.rep('a?', 300))",
        "string.gsub('hello world', 'o', '0')",
        "string.gsub('hello world', 'o', '0', 1)",
        "string.gsub('hello', '', '-')",
        "string.gsub('abc', '%w', '%0%0')",
        "string.gsub('abc', '(%w)', '[%1]')",
        "string.gsub('abc', '%w', '%%')",
        "string.gsub('abc', '%w', '%q')",
        "string.gsub('hello world', '%w+', {hello = 'HI', world = false})",
        "string.gsub('a b', '%w', function(c) if c == 'a' then return 'A' end end)",
        "string.gsub('a b', '%w', function(c) return {} end)",
        "string.gsub('abc', '^a', 'X')",
        "string.gsub('aaa', '^a', 'X')",
        "string.gsub('abc', 'b*', '-')",
        "string.gsub('abc', '%w', '%2')",
        "string.gsub('abc', '.', 5)",
        "string.gsub('abc', '.', true)",
        "string.gsub(123, 2, 9)",
        "(function() local t = {} for a, b in string.gmatch('k=v, x=y', '(%w+)=(%w+)') do "
        "t[#t + 1] = a .. b end return table.concat(t, ';') end)()",
        "(function() local t = {} for w in string.gmatch('one two  three', '%a*') do "
        "t[#t + 1] = '<' .. w .. '>' end return table.concat(t) end)()",
        "(function() local t = {} for p in string.gmatch('abc', '()') do t[#t + 1] = p end "
        "return table.concat(t, ',') end)()",
        "(function() local t = {} for w in string.gmatch('^a^a', '^a') do t[#t + 1] = w end "
        "return table.concat(t, ',') end)()",
        "('%d items, %5.2f%%, %s, %q'):format(3, 12.345, 'x', 'a\\nb')",
        "string.format('%s %s %s', 1, 'two', 3.5)",
        "string.format('%x %X %o %e %g', 255, 255, 8, 12345.678, 0.0001)",
        "string.format('%5s|%-5s|', 'ab', 'cd')",
        "string.format('%d', 'x')",
        "string.format('%y', 1)",
        "string.format('%s')",
        "string.rep('ab', 3, ',')",
        "string.rep('x', 0)",
        "string.rep('x', -1)",
        "('abc'):upper() .. ('ABC'):lower() .. ('abc'):reverse() .. ('abc'):sub(2)",
        "string.byte('abc', 1, -1)",
        "string.char(72, 105)",
        "#'abc' == string.len('abc')",
        "(function() local t = {5, 2, 8, 1} table.sort(t) return table.concat(t, ',') end)()",
        "(function() local t = {5, 2, 8, 1} table.sort(t, function(a, b) return a > b end) "
        "return table.concat(t, ',') end)()",
        "(function() local t = {'b', 'a', 'c'} table.sort(t, nil) return table.concat(t) end)()",
        "table.sort(nil)",
        "table.sort({}, 5)",
        "table.sort({1, 'x'})",
        "table.sort({3, 1, 2}, function(a, b) return true end)",
        "table.insert(nil, 1)",
        "table.insert({}, 1, 2, 3)",
        "table.insert({})",
        "(function() local t = {1, 2, 3} table.insert(t, 2, 'x') table.insert(t, 'y') "
        "return table.concat(t, ',') end)()",
        "(function() local t = {1, 2, 3} return table.remove(t, 1), table.remove(t), #t end)()",
        "table.concat({1, {}, 3})",
        "table.maxn({1, 2, [10] = 3})",
        "select('#', unpack({1, 2, 3}))",
        "xpcall(function() error('e', 0) end, function(m) return 'handled ' .. m end)",
        "tostring(nil) .. tostring(true) .. tostring(12.5) .. tostring('s')",
        "tonumber('0x10') + tonumber('1e2') + tonumber('z', 36)",
        "math.floor(-3.5) .. ' ' .. math.max(1, 5, 3) .. ' ' .. math.fmod(7, 3)",
        "select(-1, 1, 2, 3)",
        "rawequal('a', 'a'), rawget({5}, 1)",
        "type(setmetatable({}, {__index = function() return 1 end}).x)",
    };
    rp_sandbox *sb = new_sandbox(0, 0, 0, 0);
    lua_State *plain = luaL_newstate();
    luaL_openlibs(plain);
    int differ = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char src[1024];
        snprintf(src, sizeof src,
                 "local function ser(...) local out = {} for i = 1, select('#', ...) do "
                 "local v = select(i, ...) "
                 "out[#out + 1] = type(v) == 'string' and string.format('%%q', v) or tostring(v) end "
                 "return table.concat(out, ', ') end "
                 "local function pack(...) return {n = select('#', ...), ...} end "
                 "return ser(pcall(function() local r = pack(%s) return unpack(r, 1, r.n) end))",
                 cases[i]);
        char sandboxed[1024];
        snprintf(sandboxed, sizeof sandboxed, "%s", eval(sb, src));
        const char *native = "(load failed)";
        if (luaL_loadbuffer(plain, src, strlen(src), "=policy.lua") == 0 && lua_pcall(plain, 0, 1, 0) == 0)
            native = lua_tostring(plain, -1);
        else if (lua_isstring(plain, -1))
            native = lua_tostring(plain, -1);
        if (!tap_ok_at(strcmp(sandboxed, native) == 0, __FILE__, __LINE__,
                       "string: %s", cases[i])) {
            diag("sandbox: %s", sandboxed);
            diag("LuaJIT:  %s", native);
            differ++;
        }
        lua_settop(plain, 0);
    }
    lua_close(plain);
    rp_sandbox_free(sb);
}

/* ---- loading under memory pressure, allocation failures ----------------------------- */

static char *big_source(int entries)
{
    size_t cap = (size_t)entries * 80 + 64;
    char *src = malloc(cap);
    size_t n = (size_t)snprintf(src, cap, "local t = {\n");
    for (int i = 0; i < entries; i++)
        n += (size_t)snprintf(src + n, cap - n, "  {'s%d', %d, function() return %d end},\n", i, i, i);
    snprintf(src + n, cap - n, "}\nreturn #t\n");
    return src;
}

static void test_load_pressure(void)
{
    /* GC during load (a Redis CVE class): collect at every chance while compiling. */
    rp_sandbox *sb = new_sandbox(0, 0, 64 << 20, 0);
    lua_State *L = rp_sandbox_state(sb);
    lua_gc(L, LUA_GCSETPAUSE, 0);
    lua_gc(L, LUA_GCSETSTEPMUL, 1000);
    char *src = big_source(3000);
    is_str(eval(sb, src), "3000", "a large chunk compiles and runs with the collector always running");
    free(src);
    rp_sandbox_free(sb);

    sb = new_sandbox(0, 0, RP_SANDBOX_MIN_MEMORY, 0);
    src = big_source(20000);
    like(eval(sb, src), "ELIMIT: policy.lua: policy exceeded the memory limit of 1 MiB while compiling",
         "a chunk too big for the memory cap fails while compiling");
    free(src);
    is_str(eval(sb, "return 'still fine'"), "still fine", "the sandbox is usable after a failed compile");
    rp_sandbox_free(sb);
}

static void test_alloc_failures(void)
{
    /* creation: fail each allocation in turn */
    /* Leaks are counted in blocks: when LuaJIT runs out of memory while creating a
     * closure's upvalues it frees the closure reporting 8 bytes less per upvalue than
     * it allocated (lj_func.c sets nupvalues only once they all exist), so byte counts
     * drift up on those failures although every block is freed. */
    counting c = {0};
    rp_context *cctx;
    rp_context_new(counting_alloc, &c, &cctx);
    long base_live = c.live, base_blocks = c.blocks, base_calls = c.calls;
    rp_sandbox *sb;
    rp_error err;
    rp_sandbox_limits lim = rp_sandbox_limits_default();
    lim.max_wall_s = 60;
    rp_sandbox_new(cctx, &lim, &sb, &err);
    long creation_calls = c.calls - base_calls;
    rp_sandbox_free(sb);
    is_int(c.live, base_live, "a sandbox gives back all it took");
    diag("creating a sandbox makes %ld allocations", creation_calls);
    int clean = 1, refusals = 0;
    for (long n = 1; n <= creation_calls; n++) {
        c.fail_at = c.calls + n;
        sb = NULL;
        rp_status st = rp_sandbox_new(cctx, &lim, &sb, &err);
        c.fail_at = 0;
        if (st == RP_OK) rp_sandbox_free(sb);
        else if (st == RP_ENOMEM && strstr(err.text, "out of memory")) refusals++;
        else {
            clean = 0;
            diag("allocation %ld: status %d: %s", n, st, err.text);
        }
        if (c.blocks != base_blocks) {
            clean = 0;
            diag("allocation %ld: %ld blocks leaked", n, c.blocks - base_blocks);
            base_blocks = c.blocks;
        }
    }
    ok(clean && refusals > 0, "creation fails cleanly at each of its %ld allocations (%d refusals)",
       creation_calls, refusals);

    /* load and call: fail each allocation in turn; the sandbox stays usable */
    const char *policy = "local t = {} for i = 1, 50 do t['k' .. i] = {i, tostring(i)} end "
                         "local s = 0 for k, v in pairs(t) do s = s + v[1] end "
                         "return string.format('%d %s', s, (string.gsub('a-b-c', '-', '+')))";
    rp_sandbox_new(cctx, &lim, &sb, &err);
    long before = c.calls;
    is_str(eval(sb, policy), "1275 a+b+c", "the reference policy runs");
    long run_calls = c.calls - before;
    diag("loading and running it makes %ld allocations", run_calls);
    int usable = 1, outcomes_ok = 1;
    for (long n = 1; n <= run_calls; n++) {
        c.fail_at = c.calls + n;
        const char *got = eval(sb, policy);
        c.fail_at = 0;
        if (strcmp(got, "1275 a+b+c") != 0 && strncmp(got, "ENOMEM", 6) != 0 && strncmp(got, "EPOLICY", 7) != 0) {
            outcomes_ok = 0;
            diag("allocation %ld: %s", n, got);
        }
        if (strcmp(eval(sb, "return 1 + 1"), "2") != 0) usable = 0;
    }
    ok(outcomes_ok, "a failed allocation anywhere in load and call gives a clean error");
    ok(usable, "and the sandbox stays usable after each");
    rp_sandbox_free(sb);
    is_int(c.blocks, base_blocks, "nothing leaks across all the failures");
    diag("byte count drift from LuaJIT's closure sizes: %ld", c.live - base_live);
    rp_context_free(cctx);
    is_int(c.blocks, 0, "the context gives every block back");
}

/* ---- threads ------------------------------------------------------------------------ */

typedef struct worker {
    uint64_t seed;
    char draws[256];
    char loop[256];
    char memory[256];
    char count[64];
} worker;

static void *worker_main(void *arg)
{
    worker *w = arg;
    rp_sandbox_limits lim = {20000000, 60, 16 << 20, 200, 0, NULL, NULL};
    rp_sandbox *sb;
    rp_error err;
    if (rp_sandbox_new(ctx, &lim, &sb, &err) != RP_OK) return NULL;
    lua_State *L = rp_sandbox_state(sb);
    const char *srcs[4] = {
        "local t = {} for i = 1, 5 do t[i] = math.random(1, 1000) end return table.concat(t, ',')",
        "while true do end",
        "local t = {} while true do t[#t + 1] = {} end",
        "local n = 0 for i = 1, 3e6 do n = n + i % 7 end return n"};
    char *outs[4] = {w->draws, w->loop, w->memory, w->count};
    size_t sizes[4] = {sizeof w->draws, sizeof w->loop, sizeof w->memory, sizeof w->count};
    for (int round = 0; round < 3; round++) {
        rp_sandbox_seed(sb, w->seed);
        for (int i = 0; i < 4; i++) {
            rp_status st = rp_sandbox_load_text(sb, srcs[i], strlen(srcs[i]), "policy.lua", &err);
            if (st == RP_OK) {
                snprintf(outs[i], sizes[i], "%s", lua_tostring(L, -1));
                lua_pop(L, 1);
            } else {
                snprintf(outs[i], sizes[i], "%s", err.text);
            }
        }
    }
    rp_sandbox_free(sb);
    return NULL;
}

static void test_threads(void)
{
    worker w[2] = {{.seed = 1}, {.seed = 2}};
    pthread_t t[2];
    for (int i = 0; i < 2; i++) pthread_create(&t[i], NULL, worker_main, &w[i]);
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
    rp_sandbox *sb = new_sandbox(0, 0, 0, 0);
    rp_sandbox_seed(sb, 1);
    char expect1[256];
    snprintf(expect1, sizeof expect1, "%s",
             eval(sb, "local t = {} for i = 1, 5 do t[i] = math.random(1, 1000) end return table.concat(t, ',')"));
    rp_sandbox_free(sb);
    is_str(w[0].draws, expect1, "thread 1's random draws match a sandbox seeded alike");
    ok(strcmp(w[0].draws, w[1].draws) != 0, "thread 2's draws follow its own seed");
    like(w[0].loop, "policy exceeded the instruction limit (20000000)", "thread 1's loop was stopped");
    like(w[1].loop, "policy exceeded the instruction limit (20000000)", "thread 2's loop was stopped");
    like(w[0].memory, "policy exceeded the memory limit of 16 MiB", "thread 1's allocation bomb was stopped");
    like(w[1].memory, "policy exceeded the memory limit of 16 MiB", "thread 2's allocation bomb was stopped");
    is_str(w[0].count, "8999997", "thread 1 computed its sum");
    is_str(w[1].count, "8999997", "thread 2 computed its sum");
}

/* ---- the premise: LuaJIT's count hooks are global to the state ---------------------- */

static int run_in_coroutine(lua_State *L)
{
    lua_State *co = lua_newthread(L);
    lua_pushvalue(L, 1);
    lua_xmove(L, co, 1);
    int status = lua_resume(co, 0);
    if (status != 0 && status != LUA_YIELD) {
        lua_xmove(co, L, 1);
        return lua_error(L);
    }
    lua_pushliteral(L, "finished");
    return 1;
}

static int install_coroutine_runner(lua_State *L)
{
    rp_sandbox *sb = lua_touserdata(L, 1);
    rp_sandbox_push_env(sb);
    lua_getfield(L, -1, "rp");
    lua_pushcfunction(L, run_in_coroutine);
    lua_setfield(L, -2, "resume");
    return 0;
}

static void test_coroutine_premise(void)
{
    /* Policies get no coroutine library; the engine might still run Lua in a thread. A
     * hook set on the main state applies to its threads in LuaJIT (in PUC Lua hooks are
     * per thread), so such code is limited too. */
    rp_sandbox *sb = new_sandbox(1000000, 0, 0, 0);
    lua_cpcall(rp_sandbox_state(sb), install_coroutine_runner, sb);
    is_str(eval(sb, "return rp.resume(function() return 1 end)"), "finished", "Lua runs in a coroutine");
    like(eval(sb, "return rp.resume(function() while true do end end)"),
         "ELIMIT: policy exceeded the instruction limit", "an infinite loop inside a coroutine is stopped");
    like(eval(sb, "pcall(rp.resume, function() while true do end end) while true do end"),
         "ELIMIT: policy exceeded the instruction limit", "and the trip outlives the coroutine");
    rp_sandbox_free(sb);
}

/* An engine that opened the jit library and ran a loop compiled it; the same loop in a
 * policy call must still be interpreted, so the count hook fires in it. */
static int warm_up_jit(lua_State *L)
{
    rp_sandbox *sb = lua_touserdata(L, 1);
    lua_pushcfunction(L, luaopen_jit);
    lua_call(L, 0, 0);
    const char *src = "return function(n) local s = 0 for i = 1, n do s = s + i end return s end";
    if (luaL_loadstring(L, src) != 0) return lua_error(L);
    lua_call(L, 0, 1);
    rp_sandbox_push_env(sb);
    lua_pushvalue(L, -2);
    lua_setfield(L, -2, "sum");
    lua_pop(L, 1);
    lua_pushnumber(L, 1e7); /* long enough to be compiled */
    lua_call(L, 1, 1);
    return 1;
}

static void test_jit_stays_off(void)
{
    rp_sandbox *sb = new_sandbox(2000000, 0, 0, 0);
    lua_State *L = rp_sandbox_state(sb);
    ok(lua_cpcall(L, warm_up_jit, sb) == 0, "the engine turned the JIT on and ran a loop outside any call");
    lua_settop(L, 0);
    like(eval(sb, "return sum(1e15)"), "ELIMIT: policy exceeded the instruction limit (2000000)",
         "the same loop in a policy call is interpreted and stopped");
    like(eval(sb, "for i = 1, 1e12 do end"), "ELIMIT: policy exceeded the instruction limit",
         "a fresh numeric for loop too");
    rp_sandbox_free(sb);
}

static void test_memory_accounting(void)
{
    counting c = {0};
    rp_context *cctx;
    rp_context_new(counting_alloc, &c, &cctx);
    long base = c.live;
    rp_sandbox *sb;
    rp_error err;
    rp_sandbox_limits lim = {50000000, 60, 8 << 20, 200, 0, NULL, NULL};
    is_int(rp_sandbox_new(cctx, &lim, &sb, &err), RP_OK, "a sandbox on a counting allocator");
    ok(rp_sandbox_memory_bytes(sb) > 0 && (long)rp_sandbox_memory_bytes(sb) < c.live - base,
       "the state's memory is counted through the context (%zu bytes)", rp_sandbox_memory_bytes(sb));
    like(eval(sb, "local t = {} while true do t[#t + 1] = string.rep('x', 1000) .. #t end"),
         "ELIMIT: policy exceeded the memory limit of 8 MiB", "the cap holds on a counting allocator");
    ok(c.live - base < (12 << 20), "the context never held much more than the cap (%ld bytes now)", c.live - base);
    is_str(eval(sb, "return 'ok'"), "ok", "usable after");
    rp_sandbox_free(sb);
    is_int(c.live, base, "memory returns to the baseline once the sandbox is freed");
    rp_context_free(cctx);
}

/* A limit that fails to stop a policy would hang the test: bail out instead. */
static void on_alarm(int sig)
{
    (void)sig;
    static const char msg[] = "Bail out! the test ran for 300 s: a policy escaped every limit\n";
    ssize_t w = write(STDOUT_FILENO, msg, sizeof msg - 1);
    (void)w;
    _exit(1);
}

int main(void)
{
    signal(SIGALRM, on_alarm);
    alarm(300);
    rp_context_new(NULL, NULL, &ctx);
    test_limits();
    test_whitelist();
    test_escapes();
    test_hostile();
    test_errors();
    test_primitives();
    test_work_in_one_call();
    test_random();
    test_iteration_order();
    test_string_functions();
    test_load_pressure();
    test_alloc_failures();
    test_threads();
    test_coroutine_premise();
    test_jit_stays_off();
    test_memory_accounting();
    rp_context_free(ctx);
    return tap_done();
}
