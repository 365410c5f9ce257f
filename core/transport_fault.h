/* Fault injection for the transports (private; tests only). The code is compiled into
 * every build, but a fault can only be set through this header, which is not
 * installed, so production behaviour is unaffected. */
#ifndef RP_TRANSPORT_FAULT_H
#define RP_TRANSPORT_FAULT_H

#include "routepack/migrate.h"

typedef enum rp_fault_kind {
    RP_FAULT_NONE = 0,
    RP_FAULT_DROP = 1,       /* the message vanishes: the send completes, nothing arrives */
    RP_FAULT_CORRUPT = 2,    /* one byte in the middle of the message arrives flipped */
    RP_FAULT_DELAY = 3,      /* the message is held back for delay_s (beyond the deadline) */
    RP_FAULT_SEND_FAIL = 4   /* starting the send fails with RP_ETRANSPORT */
} rp_fault_kind;

/* A fault on one rank's transport: it hits that rank's `nth` payload send (0-based,
 * counted from when the fault is set; payload = a message carrying expert bytes, not a
 * header), once. */
typedef struct rp_fault {
    rp_fault_kind kind;
    int64_t nth;
    double delay_s;
} rp_fault;

/* Set (or, with kind RP_FAULT_NONE or NULL, clear) the fault of a transport. */
void rp_transport_set_fault(rp_transport *t, const rp_fault *fault);

#endif
