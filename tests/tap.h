/* A tiny TAP producer for RoutePack's test programs (run by prove).
 *
 *   int main(void) { ok(1 + 1 == 2, "adds"); is_int(f(), 3, "f is 3"); return tap_done(); }
 *
 * Every check prints "ok N - name" or "not ok N - name" with a diagnostic; tap_done()
 * prints the plan and returns the exit status. skip() prints "ok N # SKIP reason". */
#ifndef RP_TAP_H
#define RP_TAP_H

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static int tap_count, tap_failed;

static inline int tap_vok(int pass, const char *file, int line, const char *fmt, va_list ap)
{
    tap_count++;
    printf("%sok %d - ", pass ? "" : "not ", tap_count);
    vprintf(fmt, ap);
    printf("\n");
    if (!pass) {
        tap_failed++;
        printf("#   Failed test at %s line %d\n", file, line);
    }
    fflush(stdout);
    return pass;
}

static inline int tap_ok_at(int pass, const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    tap_vok(pass, file, line, fmt, ap);
    va_end(ap);
    return pass;
}

#define ok(cond, ...) tap_ok_at(!!(cond), __FILE__, __LINE__, __VA_ARGS__)

#define is_int(got, want, ...)                                                             \
    do {                                                                                   \
        long long tap_g_ = (long long)(got), tap_w_ = (long long)(want);                   \
        if (!tap_ok_at(tap_g_ == tap_w_, __FILE__, __LINE__, __VA_ARGS__))                  \
            printf("#          got: %lld\n#     expected: %lld\n", tap_g_, tap_w_);        \
    } while (0)

#define is_double(got, want, tol, ...)                                                     \
    do {                                                                                   \
        double tap_g_ = (double)(got), tap_w_ = (double)(want);                            \
        if (!tap_ok_at(fabs(tap_g_ - tap_w_) <= (tol), __FILE__, __LINE__, __VA_ARGS__))    \
            printf("#          got: %.17g\n#     expected: %.17g (tolerance %g)\n", tap_g_, \
                   tap_w_, (double)(tol));                                                 \
    } while (0)

#define is_str(got, want, ...)                                                             \
    do {                                                                                   \
        const char *tap_g_ = (got), *tap_w_ = (want);                                      \
        int tap_p_ = tap_g_ && tap_w_ && strcmp(tap_g_, tap_w_) == 0;                      \
        if (!tap_ok_at(tap_p_, __FILE__, __LINE__, __VA_ARGS__))                            \
            printf("#          got: '%s'\n#     expected: '%s'\n", tap_g_ ? tap_g_ : "(null)", \
                   tap_w_ ? tap_w_ : "(null)");                                            \
    } while (0)

/* Passes when `haystack` contains `needle`; prints both otherwise. */
#define like(haystack, needle, ...)                                                        \
    do {                                                                                   \
        const char *tap_h_ = (haystack), *tap_n_ = (needle);                               \
        int tap_p_ = tap_h_ && tap_n_ && strstr(tap_h_, tap_n_) != NULL;                   \
        if (!tap_ok_at(tap_p_, __FILE__, __LINE__, __VA_ARGS__))                            \
            printf("#          got: '%s'\n#  to contain: '%s'\n", tap_h_ ? tap_h_ : "(null)", \
                   tap_n_ ? tap_n_ : "(null)");                                            \
    } while (0)

static inline void skip(int n, const char *reason)
{
    for (int i = 0; i < n; i++) printf("ok %d # SKIP %s\n", ++tap_count, reason);
    fflush(stdout);
}

static inline void diag(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("# ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
}

static inline int tap_done(void)
{
    printf("1..%d\n", tap_count);
    return tap_failed ? 1 : 0;
}

#endif
