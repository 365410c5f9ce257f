/* Status words and error reports. */
#include "internal.h"

#include <stdio.h>
#include <string.h>

const char *rp_strerror(rp_status status)
{
    switch (status) {
    case RP_OK: return "success";
    case RP_EINVAL: return "invalid argument or input";
    case RP_ENOMEM: return "out of memory";
    case RP_EIO: return "input/output error";
    case RP_EFORMAT: return "malformed file or text";
    case RP_ERANGE: return "value out of range";
    case RP_ENOTSUP: return "not supported by this build";
    case RP_EPOLICY: return "policy error";
    case RP_ELIMIT: return "sandbox limit reached";
    case RP_ETRANSPORT: return "transport error";
    case RP_ECHECKSUM: return "checksum mismatch";
    case RP_ETIMEOUT: return "timed out";
    case RP_EPLAN: return "invalid plan";
    }
    return "unknown status";
}

void rp_error_clear(rp_error *err)
{
    if (!err) return;
    err->status = RP_OK;
    err->line = err->column = -1;
    err->offset = err->sequence = err->expert = -1;
    err->text[0] = '\0';
}

rp_status rp_failv(rp_error *err, rp_status status, const char *fmt, va_list ap)
{
    if (err) {
        rp_error_clear(err);
        err->status = status;
        vsnprintf(err->text, sizeof err->text, fmt, ap);
    }
    return status;
}

rp_status rp_fail(rp_error *err, rp_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    rp_failv(err, status, fmt, ap);
    va_end(ap);
    return status;
}

rp_status rp_fail_seq(rp_error *err, rp_status status, int64_t seq, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    rp_failv(err, status, fmt, ap);
    va_end(ap);
    if (err) err->sequence = seq;
    return status;
}

rp_status rp_fail_nomem(rp_error *err, const char *what)
{
    return rp_fail(err, RP_ENOMEM, "out of memory allocating %s", what);
}

int64_t rp_id_width_capacity(rp_id_width width)
{
    switch (width) {
    case RP_ID_U8: return (int64_t)UINT8_MAX + 1;
    case RP_ID_U16: return (int64_t)UINT16_MAX + 1;
    case RP_ID_I32: return (int64_t)INT32_MAX;
    }
    return 0;
}
