/* SCAFFOLD: replaced by its owner. */
#include "cli.h"
int cmd_trace_info(rp_context *ctx, int argc, char **argv) { (void)ctx; (void)argc; (void)argv; return cli_usage("not built yet"); }
int cmd_trace_validate(rp_context *ctx, int argc, char **argv) { (void)ctx; (void)argc; (void)argv; return cli_usage("not built yet"); }
int cmd_trace_import(rp_context *ctx, int argc, char **argv) { (void)ctx; (void)argc; (void)argv; return cli_usage("not built yet"); }
