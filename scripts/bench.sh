#!/usr/bin/env bash
# The headline comparison (ccl vs its oneCCL path vs gloo vs raw oneCCL; every op at 8 B, 4 KiB,
# 256 KiB, 4 MiB and 64 MiB; 2 ranks), in under 3 minutes. Extra arguments go
# to the benchmark, e.g. --nprocs 4, or --json/--plot paths.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -P -m oneccl_bind_pt.bench --preset headline "$@"
