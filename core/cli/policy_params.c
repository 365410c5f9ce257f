/* Policy params on the command line: `NAME:KEY=VALUE[:KEY=VALUE]` in --policies, each
 * value typed and checked against what the policy declares (rp_policy_describe), with a
 * "did you mean" for an unknown key; the result is rp_sched_options.params_json. */
#include "cli.h"

#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The declared params of one policy (rp_policy_describe's JSON), or NULL with a message. */
static json_t *declared(rp_context *ctx, const rp_config *cfg, const char *name, const char *spec)
{
    char *text = NULL;
    size_t len = 0;
    rp_error err;
    rp_error_clear(&err);
    if (rp_policy_describe(ctx, cfg, name, &text, &len, &err) != RP_OK) {
        cli_usage("--policies %s: %s", spec, err.text[0] ? err.text : rp_strerror(err.status));
        return NULL;
    }
    json_t *root = json_loadb(text, len, 0, NULL);
    rp_text_free(ctx, text);
    if (!root) cli_usage("--policies %s: cannot read the description of policy '%s'", spec, name);
    return root;
}

static json_t *find_param(json_t *desc, const char *key)
{
    size_t i;
    json_t *p;
    json_array_foreach(json_object_get(desc, "params"), i, p)
        if (!strcmp(json_string_value(json_object_get(p, "name")), key)) return p;
    return NULL;
}

/* VALUE as the JSON of the param's type, within its declared range and values; NULL
 * after a usage message. */
static json_t *typed_value(const char *spec, const char *policy, json_t *param, const char *key, const char *text)
{
    const char *type = json_string_value(json_object_get(param, "type"));
    json_t *v = NULL;
    if (!strcmp(type, "boolean")) {
        if (!strcmp(text, "true")) v = json_true();
        else if (!strcmp(text, "false")) v = json_false();
        else cli_usage("--policies %s: param '%s' of policy '%s' is a boolean: true or false, got '%s'", spec, key,
                       policy, text);
        return v;
    }
    if (!strcmp(type, "integer") || !strcmp(type, "number")) {
        char *end;
        double d = strtod(text, &end);
        bool integer = !strcmp(type, "integer");
        if (!*text || *end || !isfinite(d) || (integer && (d != floor(d) || fabs(d) > 9007199254740992.0))) {
            cli_usage("--policies %s: param '%s' of policy '%s' is %s, got '%s'", spec, key, policy,
                      integer ? "an integer" : "a number", text);
            return NULL;
        }
        json_t *min = json_object_get(param, "min"), *max = json_object_get(param, "max");
        if ((min && d < json_number_value(min)) || (max && d > json_number_value(max))) {
            cli_usage("--policies %s: param '%s' of policy '%s' is %s, outside its range [%.17g, %.17g]", spec, key,
                      policy, text, min ? json_number_value(min) : -INFINITY, max ? json_number_value(max) : INFINITY);
            return NULL;
        }
        return integer ? json_integer((json_int_t)d) : json_real(d);
    }
    json_t *values = json_object_get(param, "values");
    if (json_array_size(values)) {
        size_t i;
        json_t *s;
        char list[400] = "";
        size_t used = 0;
        json_array_foreach(values, i, s) {
            if (!strcmp(json_string_value(s), text)) return json_string(text);
            if (used < sizeof list)
                used += (size_t)snprintf(list + used, sizeof list - used, "%s%s", i ? ", " : "", json_string_value(s));
        }
        cli_usage("--policies %s: param '%s' of policy '%s' is '%s', not one of %s", spec, key, policy, text, list);
        return NULL;
    }
    return json_string(text);
}

/* "unknown param" with the names the components declare, and the closest of them. */
static int unknown_key(const char *spec, const char *key, json_t *const *desc, int n)
{
    const char *names[256];
    size_t count = 0;
    char list[600] = "";
    size_t used = 0;
    for (int c = 0; c < n; c++) {
        size_t i;
        json_t *p;
        json_array_foreach(json_object_get(desc[c], "params"), i, p) {
            const char *name = json_string_value(json_object_get(p, "name"));
            if (count < sizeof names / sizeof names[0]) names[count++] = name;
            if (used < sizeof list)
                used += (size_t)snprintf(list + used, sizeof list - used, "%s%s%s%s", used ? ", " : "",
                                         n > 1 ? json_string_value(json_object_get(desc[c], "name")) : "",
                                         n > 1 ? "." : "", name);
        }
    }
    const char *dot = strchr(key, '.');
    const char *near = cli_closest(dot ? dot + 1 : key, names, count);
    if (!count) return cli_usage("--policies %s: unknown param '%s' (the policy declares no params)", spec, key);
    if (near)
        return cli_usage("--policies %s: unknown param '%s' (did you mean '%s'? declared: %s)", spec, key, near, list);
    return cli_usage("--policies %s: unknown param '%s' (declared: %s)", spec, key, list);
}

int cli_policy_params(rp_context *ctx, const rp_config *cfg, const char *spec, char **name, char **params_json)
{
    *name = *params_json = NULL;
    const char *colon = strchr(spec, ':');
    /* a policy file whose path holds ':' is taken whole */
    if (!colon || access(spec, R_OK) == 0) {
        *name = strdup(spec);
        return *name ? CLI_OK : CLI_FAIL;
    }
    int rc = CLI_USAGE;
    json_t *desc[2] = {NULL, NULL}, *root = json_object();
    char *copy = strdup(spec);
    if ((*name = malloc((size_t)(colon - spec) + 1)) != NULL) {
        memcpy(*name, spec, (size_t)(colon - spec));
        (*name)[colon - spec] = '\0';
    }
    if (!root || !copy || !*name) {
        rc = CLI_FAIL;
        goto out;
    }
    /* the components: a PACKING+PLACEMENT pair has one params object each */
    char *plus = strchr(*name, '+');
    int n = plus ? 2 : 1;
    char first[512];
    snprintf(first, sizeof first, "%.*s", plus ? (int)(plus - *name) : (int)strlen(*name), *name);
    const char *parts[2] = {first, plus ? plus + 1 : NULL};
    for (int c = 0; c < n; c++)
        if (!(desc[c] = declared(ctx, cfg, parts[c], spec))) goto out;
    char *save = NULL;
    strtok_r(copy, ":", &save); /* the name */
    for (char *item; (item = strtok_r(NULL, ":", &save)) != NULL;) {
        char *eq = strchr(item, '=');
        if (!eq || eq == item) {
            cli_usage("--policies %s: '%s' is not KEY=VALUE (a policy with params is NAME:KEY=VALUE[:KEY=VALUE])",
                      spec, item);
            goto out;
        }
        *eq = '\0';
        const char *key = item, *text = eq + 1;
        /* in a pair, COMPONENT.KEY, or a KEY only one component declares */
        int at = -1;
        const char *bare = key;
        const char *dot = n > 1 ? strchr(key, '.') : NULL;
        for (int c = 0; c < n && dot; c++)
            if (!strncmp(key, json_string_value(json_object_get(desc[c], "name")), (size_t)(dot - key)) &&
                strlen(json_string_value(json_object_get(desc[c], "name"))) == (size_t)(dot - key))
                at = c, bare = dot + 1;
        json_t *param = NULL;
        for (int c = 0; c < n && !param; c++)
            if ((at < 0 || at == c) && (param = find_param(desc[c], bare)) != NULL) at = c;
        if (!param) {
            unknown_key(spec, key, desc, n);
            goto out;
        }
        if (n > 1 && !dot && find_param(desc[1 - at], bare)) {
            cli_usage("--policies %s: both %s and %s declare '%s': write %s.%s or %s.%s", spec,
                      json_string_value(json_object_get(desc[0], "name")),
                      json_string_value(json_object_get(desc[1], "name")), bare,
                      json_string_value(json_object_get(desc[0], "name")), bare,
                      json_string_value(json_object_get(desc[1], "name")), bare);
            goto out;
        }
        const char *policy = json_string_value(json_object_get(desc[at], "name"));
        json_t *v = typed_value(spec, policy, param, bare, text);
        if (!v) goto out;
        json_t *obj = root;
        if (n > 1) {
            obj = json_object_get(root, policy);
            if (!obj) json_object_set_new(root, policy, obj = json_object());
        }
        if (json_object_get(obj, bare)) {
            json_decref(v);
            cli_usage("--policies %s: param '%s' is given twice", spec, bare);
            goto out;
        }
        json_object_set_new(obj, bare, v);
    }
    if (!(*params_json = json_dumps(root, JSON_COMPACT | JSON_SORT_KEYS))) {
        rc = CLI_FAIL;
        goto out;
    }
    rc = CLI_OK;
out:
    json_decref(desc[0]);
    json_decref(desc[1]);
    json_decref(root);
    free(copy);
    if (rc != CLI_OK) {
        free(*name);
        free(*params_json);
        *name = *params_json = NULL;
    }
    return rc;
}
