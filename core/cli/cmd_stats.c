/* SCAFFOLD: replaced by its owner. */
#include "cli.h"
int cmd_stats(rp_context *ctx, int argc, char **argv) { (void)ctx; (void)argc; (void)argv; return cli_usage("not built yet"); }
