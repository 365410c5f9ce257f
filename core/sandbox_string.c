/* Bounded string.find/match/gmatch/gsub for the sandbox: LuaJIT 2.1's pattern matcher
 * (lib_string.c, MIT; itself from Lua 5.1) with every loop charged to the call's budget. */
#define _GNU_SOURCE /* memmem */
#include "sandbox.h"

#include <lauxlib.h>

#include <string.h>

/* A backtracking matcher can take exponential time ('(.-)(.-)(.-)b' on a long subject)
 * inside one C call, where no count hook fires. Every loop iteration below is one work
 * unit; units are charged to the running call every STEP_CHUNK, so a runaway match ends
 * with the instruction limit like a Lua loop would. Character classes are ASCII, as in
 * LuaJIT, independent of the C locale (so every rank agrees). */
#define STEP_CHUNK 4096
#define MAX_MATCH_DEPTH 200 /* LuaJIT's LJ_MAX_XLEVEL */
#define CAP_UNFINISHED (-1)
#define CAP_POSITION (-2)
#define L_ESC '%'
#define SPECIALS "^$*+?.([%-"

typedef struct match_state {
    const char *src_init;
    const char *src_end;
    lua_State *L;
    int level;
    int depth;
    int64_t steps;
    struct {
        const char *init;
        ptrdiff_t len;
    } capture[LUA_MAXCAPTURES];
} match_state;

static void steps_flush(match_state *ms)
{
    int64_t n = ms->steps;
    ms->steps = 0;
    rp_sandbox_charge(ms->L, n);
}

static inline void step(match_state *ms)
{
    if (++ms->steps >= STEP_CHUNK) steps_flush(ms);
}

static void match_init(match_state *ms, lua_State *L, const char *s, size_t len)
{
    ms->L = L;
    ms->src_init = s;
    ms->src_end = s + len;
    ms->level = ms->depth = 0;
    ms->steps = 0;
}

static int class_is(int c, int cl)
{
    switch (cl) {
    case 'a': return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
    case 'c': return c < 32 || c == 127;
    case 'd': return c >= '0' && c <= '9';
    case 'g': return c >= 33 && c <= 126;
    case 'l': return c >= 'a' && c <= 'z';
    case 'p':
        return (c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) ||
               (c >= 123 && c <= 126);
    case 's': return c == ' ' || (c >= 9 && c <= 13);
    case 'u': return c >= 'A' && c <= 'Z';
    case 'w': return class_is(c, 'a') || class_is(c, 'd');
    case 'x': return class_is(c, 'd') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
    default: return -1;
    }
}

static int match_class(int c, int cl)
{
    if ((cl >= 'a' && cl <= 'z') || (cl >= 'A' && cl <= 'Z')) {
        int lower = cl | 0x20, is = class_is(c, lower);
        if (is >= 0) return cl == lower ? is : !is;
        if (lower == 'z') return cl == 'z' ? c == 0 : c != 0;
    }
    return cl == c;
}

static const char *classend(match_state *ms, const char *p)
{
    switch (*p++) {
    case L_ESC:
        if (*p == '\0') luaL_error(ms->L, "malformed pattern (ends with '%%')");
        return p + 1;
    case '[':
        if (*p == '^') p++;
        do {
            step(ms);
            if (*p == '\0') luaL_error(ms->L, "malformed pattern (missing ']')");
            if (*(p++) == L_ESC && *p != '\0') p++;
        } while (*p != ']');
        return p + 1;
    default: return p;
    }
}

static int matchbracketclass(match_state *ms, int c, const char *p, const char *ec)
{
    int sig = 1;
    if (*(p + 1) == '^') {
        sig = 0;
        p++;
    }
    while (++p < ec) {
        step(ms);
        if (*p == L_ESC) {
            p++;
            if (match_class(c, (unsigned char)*p)) return sig;
        } else if (*(p + 1) == '-' && p + 2 < ec) {
            p += 2;
            if ((unsigned char)*(p - 2) <= c && c <= (unsigned char)*p) return sig;
        } else if ((unsigned char)*p == c) {
            return sig;
        }
    }
    return !sig;
}

static int singlematch(match_state *ms, int c, const char *p, const char *ep)
{
    switch (*p) {
    case '.': return 1;
    case L_ESC: return match_class(c, (unsigned char)*(p + 1));
    case '[': return matchbracketclass(ms, c, p, ep - 1);
    default: return (unsigned char)*p == c;
    }
}

static const char *match(match_state *ms, const char *s, const char *p);

static const char *matchbalance(match_state *ms, const char *s, const char *p)
{
    if (*p == 0 || *(p + 1) == 0) luaL_error(ms->L, "unbalanced pattern");
    if (s >= ms->src_end || *s != *p) return NULL;
    int b = *p, e = *(p + 1), cont = 1;
    while (++s < ms->src_end) {
        step(ms);
        if (*s == e) {
            if (--cont == 0) return s + 1;
        } else if (*s == b) {
            cont++;
        }
    }
    return NULL;
}

static const char *max_expand(match_state *ms, const char *s, const char *p, const char *ep)
{
    ptrdiff_t i = 0;
    while (s + i < ms->src_end && singlematch(ms, (unsigned char)*(s + i), p, ep)) {
        step(ms);
        i++;
    }
    while (i >= 0) {
        step(ms);
        const char *res = match(ms, s + i, ep + 1);
        if (res) return res;
        i--;
    }
    return NULL;
}

static const char *min_expand(match_state *ms, const char *s, const char *p, const char *ep)
{
    for (;;) {
        step(ms);
        const char *res = match(ms, s, ep + 1);
        if (res) return res;
        if (s < ms->src_end && singlematch(ms, (unsigned char)*s, p, ep)) s++;
        else return NULL;
    }
}

static const char *start_capture(match_state *ms, const char *s, const char *p, int what)
{
    int level = ms->level;
    if (level >= LUA_MAXCAPTURES) luaL_error(ms->L, "too many captures");
    ms->capture[level].init = s;
    ms->capture[level].len = what;
    ms->level = level + 1;
    const char *res = match(ms, s, p);
    if (!res) ms->level--;
    return res;
}

static const char *end_capture(match_state *ms, const char *s, const char *p)
{
    int l = -1;
    for (int level = ms->level - 1; level >= 0; level--)
        if (ms->capture[level].len == CAP_UNFINISHED) {
            l = level;
            break;
        }
    if (l < 0) luaL_error(ms->L, "invalid pattern capture");
    ms->capture[l].len = s - ms->capture[l].init;
    const char *res = match(ms, s, p);
    if (!res) ms->capture[l].len = CAP_UNFINISHED;
    return res;
}

static const char *match_capture(match_state *ms, const char *s, int l)
{
    l -= '1';
    if (l < 0 || l >= ms->level || ms->capture[l].len == CAP_UNFINISHED)
        luaL_error(ms->L, "invalid capture index");
    size_t len = (size_t)ms->capture[l].len;
    ms->steps += (int64_t)(len / 64);
    step(ms);
    if ((size_t)(ms->src_end - s) >= len && memcmp(ms->capture[l].init, s, len) == 0)
        return s + len;
    return NULL;
}

static const char *match(match_state *ms, const char *s, const char *p)
{
    if (++ms->depth > MAX_MATCH_DEPTH) luaL_error(ms->L, "pattern too complex");
init:
    step(ms);
    switch (*p) {
    case '(':
        if (*(p + 1) == ')') s = start_capture(ms, s, p + 2, CAP_POSITION);
        else s = start_capture(ms, s, p + 1, CAP_UNFINISHED);
        break;
    case ')': s = end_capture(ms, s, p + 1); break;
    case L_ESC:
        switch (*(p + 1)) {
        case 'b':
            s = matchbalance(ms, s, p + 2);
            if (s == NULL) break;
            p += 4;
            goto init;
        case 'f': {
            p += 2;
            if (*p != '[') luaL_error(ms->L, "missing '[' after '%%f' in pattern");
            const char *ep = classend(ms, p);
            char previous = (s == ms->src_init) ? '\0' : *(s - 1);
            char current = (s < ms->src_end) ? *s : '\0';
            if (matchbracketclass(ms, (unsigned char)previous, p, ep - 1) ||
                !matchbracketclass(ms, (unsigned char)current, p, ep - 1)) {
                s = NULL;
                break;
            }
            p = ep;
            goto init;
        }
        default:
            if (*(p + 1) >= '0' && *(p + 1) <= '9') {
                s = match_capture(ms, s, (unsigned char)*(p + 1));
                if (s == NULL) break;
                p += 2;
                goto init;
            }
            goto dflt;
        }
        break;
    case '\0': break;
    case '$':
        if (*(p + 1) != '\0') goto dflt;
        if (s != ms->src_end) s = NULL;
        break;
    default:
    dflt: {
        const char *ep = classend(ms, p);
        int m = s < ms->src_end && singlematch(ms, (unsigned char)*s, p, ep);
        switch (*ep) {
        case '?': {
            const char *res;
            if (m && (res = match(ms, s + 1, ep + 1)) != NULL) {
                s = res;
                break;
            }
            p = ep + 1;
            goto init;
        }
        case '*': s = max_expand(ms, s, p, ep); break;
        case '+': s = m ? max_expand(ms, s + 1, p, ep) : NULL; break;
        case '-': s = min_expand(ms, s, p, ep); break;
        default:
            if (m) {
                s++;
                p = ep;
                goto init;
            }
            s = NULL;
            break;
        }
        break;
    }
    }
    ms->depth--;
    return s;
}

static void push_onecapture(match_state *ms, int i, const char *s, const char *e)
{
    if (i >= ms->level) {
        if (i == 0) lua_pushlstring(ms->L, s, (size_t)(e - s));
        else luaL_error(ms->L, "invalid capture index");
    } else {
        ptrdiff_t l = ms->capture[i].len;
        if (l == CAP_UNFINISHED) luaL_error(ms->L, "unfinished capture");
        if (l == CAP_POSITION)
            lua_pushinteger(ms->L, ms->capture[i].init - ms->src_init + 1);
        else
            lua_pushlstring(ms->L, ms->capture[i].init, (size_t)l);
    }
}

static int push_captures(match_state *ms, const char *s, const char *e)
{
    int nlevels = (ms->level == 0 && s) ? 1 : ms->level;
    luaL_checkstack(ms->L, nlevels, "too many captures");
    for (int i = 0; i < nlevels; i++) push_onecapture(ms, i, s, e);
    return nlevels;
}

static int has_pattern(const char *p, size_t len)
{
    for (size_t i = 0; i < len; i++)
        if (p[i] && strchr(SPECIALS, p[i])) return 1;
    return 0;
}

/* LuaJIT's rule for init (truncated): negative counts from the end, before the start
 * clamps to the start, past the end clamps to the end. */
static ptrdiff_t start_index(lua_Number init, size_t ls)
{
    if (!(init == init)) return 0;
    if (init < 0) return init <= -(lua_Number)ls ? 0 : (ptrdiff_t)ls + (ptrdiff_t)init;
    if (init >= (lua_Number)ls + 1) return (ptrdiff_t)ls;
    ptrdiff_t st = (ptrdiff_t)init - 1;
    return st < 0 ? 0 : st;
}

static int str_find_aux(lua_State *L, int find)
{
    size_t ls, lp;
    const char *s = luaL_checklstring(L, 1, &ls);
    const char *p = luaL_checklstring(L, 2, &lp);
    ptrdiff_t st = start_index(luaL_optnumber(L, 3, 1), ls);
    if (find && (lua_toboolean(L, 4) || !has_pattern(p, lp))) {
        /* glibc's memmem is the two-way algorithm: linear, not O(n*m); charged by the
         * bytes it may scan, since it runs in one call */
        rp_sandbox_charge(L, 1 + (int64_t)((ls - (size_t)st + lp) / 4));
        const char *q = memmem(s + st, ls - (size_t)st, p, lp);
        if (q) {
            lua_pushinteger(L, q - s + 1);
            lua_pushinteger(L, q - s + (ptrdiff_t)lp);
            return 2;
        }
    } else {
        match_state ms;
        const char *sp = s + st;
        int anchor = (*p == '^');
        if (anchor) p++;
        match_init(&ms, L, s, ls);
        do {
            ms.level = ms.depth = 0;
            const char *e = match(&ms, sp, p);
            if (e) {
                steps_flush(&ms);
                if (find) {
                    lua_pushinteger(L, sp - s + 1);
                    lua_pushinteger(L, e - s);
                    return push_captures(&ms, NULL, NULL) + 2;
                }
                return push_captures(&ms, sp, e);
            }
        } while (sp++ < ms.src_end && !anchor);
        steps_flush(&ms);
    }
    lua_pushnil(L);
    return 1;
}

static int str_find(lua_State *L) { return str_find_aux(L, 1); }
static int str_match(lua_State *L) { return str_find_aux(L, 0); }

static int gmatch_aux(lua_State *L)
{
    size_t ls;
    const char *s = lua_tolstring(L, lua_upvalueindex(1), &ls);
    const char *p = lua_tostring(L, lua_upvalueindex(2));
    lua_Integer pos = lua_tointeger(L, lua_upvalueindex(3));
    match_state ms;
    match_init(&ms, L, s, ls);
    for (const char *src = s + pos; src <= ms.src_end; src++) {
        ms.level = ms.depth = 0;
        const char *e = match(&ms, src, p);
        if (e) {
            lua_Integer next = e - s;
            if (e == src) next++; /* an empty match moves on by one */
            lua_pushinteger(L, next);
            lua_replace(L, lua_upvalueindex(3));
            steps_flush(&ms);
            return push_captures(&ms, src, e);
        }
    }
    steps_flush(&ms);
    return 0;
}

static int str_gmatch(lua_State *L)
{
    luaL_checkstring(L, 1);
    luaL_checkstring(L, 2);
    lua_settop(L, 2);
    lua_pushinteger(L, 0);
    lua_pushcclosure(L, gmatch_aux, 3);
    return 1;
}

static void add_s(match_state *ms, luaL_Buffer *b, const char *s, const char *e)
{
    size_t l;
    const char *news = lua_tolstring(ms->L, 3, &l);
    ms->steps += (int64_t)(l / 16); /* copying the replacement */
    for (size_t i = 0; i < l; i++) {
        if (news[i] != L_ESC) {
            luaL_addchar(b, news[i]);
        } else {
            i++;
            if (!(news[i] >= '0' && news[i] <= '9')) {
                luaL_addchar(b, news[i]);
            } else if (news[i] == '0') {
                luaL_addlstring(b, s, (size_t)(e - s));
            } else {
                push_onecapture(ms, news[i] - '1', s, e);
                luaL_addvalue(b);
            }
        }
    }
}

static void add_value(match_state *ms, luaL_Buffer *b, const char *s, const char *e)
{
    lua_State *L = ms->L;
    switch (lua_type(L, 3)) {
    case LUA_TNUMBER:
    case LUA_TSTRING: add_s(ms, b, s, e); return;
    case LUA_TFUNCTION: {
        steps_flush(ms);
        rp_sandbox_charge_callback(L);
        lua_pushvalue(L, 3);
        int n = push_captures(ms, s, e);
        lua_call(L, n, 1);
        break;
    }
    case LUA_TTABLE: /* an __index may run: a callback */
        steps_flush(ms);
        rp_sandbox_charge_callback(L);
        push_onecapture(ms, 0, s, e);
        lua_gettable(L, 3);
        break;
    }
    if (!lua_toboolean(L, -1)) {
        lua_pop(L, 1);
        lua_pushlstring(L, s, (size_t)(e - s));
    } else if (!lua_isstring(L, -1)) {
        luaL_error(L, "invalid replacement value (a %s)", luaL_typename(L, -1));
    }
    luaL_addvalue(b);
}

static int str_gsub(lua_State *L)
{
    size_t srcl;
    const char *src = luaL_checklstring(L, 1, &srcl);
    const char *p = luaL_checkstring(L, 2);
    int tr = lua_type(L, 3);
    lua_Number max_n = luaL_optnumber(L, 4, (lua_Number)srcl + 1);
    int anchor = (*p == '^');
    if (anchor) p++;
    luaL_argcheck(L, tr == LUA_TNUMBER || tr == LUA_TSTRING || tr == LUA_TFUNCTION || tr == LUA_TTABLE,
                  3, "string/function/table expected");
    /* a function or an __index may call gsub again: C recursion */
    if (tr == LUA_TFUNCTION || tr == LUA_TTABLE) rp_sandbox_check_c_stack(L);
    match_state ms;
    luaL_Buffer b;
    int64_t n = 0;
    luaL_buffinit(L, &b);
    match_init(&ms, L, src, srcl);
    while (n < max_n) {
        ms.level = ms.depth = 0;
        const char *e = match(&ms, src, p);
        if (e) {
            n++;
            add_value(&ms, &b, src, e);
        }
        if (e && e > src) src = e;
        else if (src < ms.src_end) luaL_addchar(&b, *src++);
        else break;
        if (anchor) break;
    }
    steps_flush(&ms);
    luaL_addlstring(&b, src, (size_t)(ms.src_end - src));
    luaL_pushresult(&b);
    lua_pushinteger(L, (lua_Integer)n);
    return 2;
}

void rp_sandbox_open_string(lua_State *L, int table)
{
    static const luaL_Reg fns[] = {{"find", str_find},
                                   {"match", str_match},
                                   {"gmatch", str_gmatch},
                                   {"gsub", str_gsub},
                                   {NULL, NULL}};
    for (const luaL_Reg *r = fns; r->name; r++) {
        lua_pushcfunction(L, r->func);
        lua_setfield(L, table, r->name);
    }
}
