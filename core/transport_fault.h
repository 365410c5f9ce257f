/* Fault injection for the transports and the executor (private; tests only). The code
 * is compiled into every build, but a fault can only be set through this header, which
 * is not installed, so production behaviour is unaffected. */
#ifndef RP_TRANSPORT_FAULT_H
#define RP_TRANSPORT_FAULT_H

#include "routepack/migrate.h"

typedef enum rp_fault_kind {
    RP_FAULT_NONE = 0,
    /* A send (a payload message, or a header with rp_fault.header): */
    RP_FAULT_DROP = 1,       /* the message vanishes: the send completes, nothing arrives */
    RP_FAULT_CORRUPT = 2,    /* one byte in the middle of the message arrives flipped */
    RP_FAULT_DELAY = 3,      /* the message is held back for delay_s (beyond the deadline) */
    RP_FAULT_SEND_FAIL = 4,  /* starting the send fails with RP_ETRANSPORT */
    RP_FAULT_SHORT = 5,      /* the message arrives one byte short (NCCL: not sent) */
    RP_FAULT_LATE = 6,       /* the send completes at once, the message arrives only after
                                delay_s and stays queued past its call, for a later call's
                                receive to find (MPI: sent without waiting after delay_s; NCCL:
                                not sent) */
    RP_FAULT_STALL = 7,      /* the rank stops responding for delay_s at that send (its
                                thread sleeps), then carries on */
    /* The executor's own steps on that rank: */
    RP_FAULT_STALL_DECISION = 8,  /* sleep delay_s before entering the nth decision exchange
                                     (after that round's commit) */
    RP_FAULT_LOSE_DECISION = 9,   /* take part in the nth decision exchange, then behave as if
                                     it had timed out (an exchange that completed on the other
                                     ranks only, as MPI's can) */
    RP_FAULT_COMMIT_FAIL = 11,    /* the nth slot write of a commit fails (RP_ETRANSPORT) */
    RP_FAULT_CORRUPT_STAGING = 12 /* after the nth round's data arrived and its headers passed,
                                     before its commit, one byte of this rank's staging is
                                     flipped */
} rp_fault_kind;

/* Where a fault fires; each site counts its events from when the faults were set. */
typedef enum rp_fault_site {
    RP_FAULT_SITE_PAYLOAD = 0, /* payload sends (messages carrying expert bytes) */
    RP_FAULT_SITE_HEADER,      /* header sends */
    RP_FAULT_SITE_DECISION,    /* decision exchanges (one a round, after its commit) */
    RP_FAULT_SITE_COMMIT_WRITE, /* slot writes at commit */
    RP_FAULT_SITE_STAGED,       /* rounds whose data arrived and headers passed */
    RP_FAULT_NUM_SITES
} rp_fault_site;

/* A fault on one rank's transport: it hits that rank's `nth` event (0-based) of its
 * site, once: for send kinds the nth payload send, or the nth header send when `header`
 * is set; for the executor kinds the nth event of the step they name. */
typedef struct rp_fault {
    rp_fault_kind kind;
    int64_t nth;
    double delay_s;
    bool header;
} rp_fault;

#define RP_MAX_FAULTS 4

/* Set (or, with kind RP_FAULT_NONE or NULL, clear) the faults of a transport: the one
 * given replaces all; every site's count restarts. */
void rp_transport_set_fault(rp_transport *t, const rp_fault *fault);
/* Add one more fault (up to RP_MAX_FAULTS; extra ones are ignored), counts kept. */
void rp_transport_add_fault(rp_transport *t, const rp_fault *fault);

#endif
