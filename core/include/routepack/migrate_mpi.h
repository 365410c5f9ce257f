/* The MPI transport for expert migration: host buffers, one process per rank. Not
 * included by routepack.h, since it needs <mpi.h>; available when the library was
 * built with MPI (rp_transport_built("mpi")). */
#ifndef ROUTEPACK_MIGRATE_MPI_H
#define ROUTEPACK_MIGRATE_MPI_H

#include <mpi.h>

#include "routepack/migrate.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A transport over the ranks of `comm` (rank r = GPU r, or EP rank r of one group; see
 * rp_migration_exec_options.ep_group). Collective over `comm`: it duplicates the
 * communicator, so migration traffic never mixes with the trainer's, and makes MPI
 * errors on the copy return instead of abort. MPI must be initialised; the executor
 * calls MPI from the calling thread only. Point-to-point waits poll MPI_Test until the
 * deadline; an exchange between ranks that times out leaves the transport unusable
 * (MPI cannot cancel a collective). rp_transport_free frees the duplicate (before
 * MPI_Finalize). Errors: MPI not initialised, MPI calls that fail (their text). */
RP_API rp_status rp_transport_mpi_new(rp_context *ctx, MPI_Comm comm, rp_transport **out,
                                      rp_error *err);

#ifdef __cplusplus
}
#endif
#endif
