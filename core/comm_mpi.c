/* rp_comm over MPI (routepack/mpi.h): the collectives the scheduler's multi-rank plan
 * agreement runs each step. Built only when CMake found MPI. */
#ifdef RP_HAVE_MPI

#include "internal.h"
#include "routepack/mpi.h"

#include <limits.h>
#include <stdint.h>

/* The communicator travels as its Fortran handle (an integer), so that rp_comm needs no
 * storage of its own whatever MPI_Comm is in this MPI (a pointer in Open MPI, an int in
 * MPICH). */
static MPI_Comm comm_of(void *ud) { return MPI_Comm_f2c((MPI_Fint)(intptr_t)ud); }

static rp_status mpi_allgather(void *ud, const void *in, size_t bytes, void *out)
{
    if (bytes > INT_MAX) return RP_ERANGE;
    int rc = MPI_Allgather(in, (int)bytes, MPI_BYTE, out, (int)bytes, MPI_BYTE, comm_of(ud));
    return rc == MPI_SUCCESS ? RP_OK : RP_ETRANSPORT;
}

static rp_status mpi_bcast(void *ud, void *buf, size_t bytes, int32_t root)
{
    if (bytes > INT_MAX) return RP_ERANGE;
    int rc = MPI_Bcast(buf, (int)bytes, MPI_BYTE, root, comm_of(ud));
    return rc == MPI_SUCCESS ? RP_OK : RP_ETRANSPORT;
}

rp_status rp_comm_mpi(rp_comm *c, MPI_Comm comm)
{
    if (!c || comm == MPI_COMM_NULL) return RP_EINVAL;
    int rank = 0, size = 0;
    if (MPI_Comm_rank(comm, &rank) != MPI_SUCCESS || MPI_Comm_size(comm, &size) != MPI_SUCCESS)
        return RP_ETRANSPORT;
    c->rank = rank;
    c->size = size;
    c->ud = (void *)(intptr_t)MPI_Comm_c2f(comm);
    c->allgather = mpi_allgather;
    c->bcast = mpi_bcast;
    return RP_OK;
}

#else
/* Without MPI this file is empty (ISO C wants at least one declaration). */
typedef int rp_comm_mpi_unavailable;
#endif
