/* UTF-8 checks for text the library passes on (core/utf8.c). */
#ifndef RP_UTF8_INTERNAL_H
#define RP_UTF8_INTERNAL_H

#include <stddef.h>

/* The length (2-4) of the well-formed UTF-8 sequence of a non-ASCII character starting
 * at s[0] (at most `len` bytes), or 0 when it is not one: a stray continuation byte, a
 * truncated sequence, an overlong form, a surrogate or a code point past U+10FFFF
 * (RFC 3629). */
size_t utf8_sequence(const unsigned char *s, size_t len);

#endif
