#!/usr/bin/env bash
# prove --exec helper of scripts/test.sh: runs one TAP program with its output passed to
# prove unchanged and a copy kept in $RP_TAP_LOG_DIR/<program>.tap, from which
# scripts/test_summary.py counts the skipped checks. Exits with the program's status.
set -o pipefail
"$@" | tee "${RP_TAP_LOG_DIR:?}/$(basename "$1").tap"
