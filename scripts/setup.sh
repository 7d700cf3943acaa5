#!/usr/bin/env bash
# Sets up .venv with the pinned stack and builds/installs oneccl_bind_pt into it.
# Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if ! command -v "$python" >/dev/null 2>&1; then
    echo "setup: $python not found; install Python 3.11 or set PYTHON to an interpreter" >&2
    exit 2
fi
# Creates .venv, or repairs one that cannot work here (a dangling link, a moved
# interpreter, another Python version); stops on anything that is not a venv.
"$python" scripts/ensure_venv.py .venv
# torch is pinned: an unpinned torch would pull the CUDA build.
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
# --no-build-isolation: build against the torch in .venv, the one it will run with.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps .
# -P: import the installed package, not this source tree.
.venv/bin/python -P -c "import oneccl_bind_pt as m; print('oneccl_bind_pt', m.__version__, 'ready in', m.cwd)"
