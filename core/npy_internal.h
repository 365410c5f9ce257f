/* .npy parsing shared by core/npy.c (files) and core/npz.c (members of an archive). */
#ifndef RP_NPY_INTERNAL_H
#define RP_NPY_INTERNAL_H

#include "routepack/trace.h"

/* Parse the .npy bytes m[0, size), named `name` in messages. The array borrows the bytes;
 * rp_npy_close unmaps `map` (map_bytes long) when it is not NULL, else the bytes stay
 * their owner's (an archive's mapping, which must outlive the array). */
rp_status rp_npy_parse(rp_context *ctx, const char *name, const unsigned char *m, int64_t size,
                       void *map, size_t map_bytes, rp_npy **out, rp_error *err);

#endif
