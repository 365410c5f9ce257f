/* The scheduler's multi-rank agreement over MPI: fills an rp_comm (routepack/sched.h)
 * with MPI_Allgather and MPI_Bcast on a communicator. Not included by routepack.h, since
 * it needs <mpi.h>; available when the library was built with MPI (RP_HAVE_MPI, reported
 * at configure time). */
#ifndef ROUTEPACK_MPI_H
#define ROUTEPACK_MPI_H

#include <mpi.h>

#include "routepack/sched.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Fill `c` for `comm`: rank and size from MPI_Comm_rank/size, operations that run
 * MPI_Allgather / MPI_Bcast on MPI_BYTE (sizes above INT_MAX are refused with
 * RP_ERANGE). `c` keeps only the communicator's handle: the communicator must stay valid
 * while a scheduler uses `c`, and every rank must call rp_sched_step for the same steps,
 * since each step runs collectives. MPI must be initialised. Errors: RP_EINVAL for a NULL
 * `c` or MPI_COMM_NULL, RP_ETRANSPORT when MPI fails. */
RP_API rp_status rp_comm_mpi(rp_comm *c, MPI_Comm comm);

#ifdef __cplusplus
}
#endif
#endif
