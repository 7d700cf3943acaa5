#!/usr/bin/env bash
# Sets up a venv with one release's pinned stack and builds/installs oneccl_bind_pt into it.
#
#   ./scripts/setup.sh                   the default release (requirements.txt) in .venv
#   ./scripts/setup.sh --torch 2.14.1    another (requirements/torch-2.14.1.txt) in .venv-torch2.14.1
#
# Releases: meta/releases.yaml. Idempotent: a second run only rebuilds what changed
# (objects are kept per torch version, under build/torch-<version>/).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,8s/^# \{0,1\}//p' "$0"; }
torch=
while [ $# -gt 0 ]; do
    case $1 in
        --torch) [ $# -ge 2 ] || { usage >&2; exit 2; }; torch=$2; shift 2 ;;
        --torch=*) torch=${1#--torch=}; shift ;;
        -h | --help) usage; exit 0 ;;
        *) echo "setup: unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done

# requirements.txt is the default release's set: `-r requirements/torch-<default>.txt`.
default=$(sed -n 's|^-r requirements/torch-\(.*\)\.txt$|\1|p' requirements.txt)
torch=${torch:-$default}
reqs=requirements/torch-$torch.txt
if [ ! -f "$reqs" ]; then
    known=$(cd requirements && ls torch-*.txt | sed 's/^torch-//; s/\.txt$//' | paste -sd ' ' -)
    echo "setup: no release for torch $torch; releases: $known (meta/releases.yaml)" >&2
    exit 2
fi
venv=.venv
[ "$torch" = "$default" ] || venv=.venv-torch$torch

python=${PYTHON:-python3}
if ! command -v "$python" >/dev/null 2>&1; then
    echo "setup: $python not found; install Python 3.11 or set PYTHON to an interpreter" >&2
    exit 2
fi
start=$SECONDS
# Creates the venv, or repairs one that cannot work here (a dangling link, a moved
# interpreter, another Python version); stops on anything that is not a venv.
"$python" scripts/ensure_venv.py "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch is pinned: an unpinned torch would pull the CUDA build.
if grep -q '^# lift-pip-constraint:' "$reqs"; then
    # This release's torch is above the torch cap this project's build machines set in pip's
    # global configuration (a constraints file): PIP_CONSTRAINT=/dev/null lifts it,
    # for this one pip command only (meta/releases.yaml: lift_pip_constraint).
    PIP_CONSTRAINT=/dev/null "${pip[@]}" -r "$reqs"
else
    "${pip[@]}" -r "$reqs"
fi
echo "setup: $venv has the torch $torch stack ($((SECONDS - start)) s)" >&2
start=$SECONDS
# --no-build-isolation: build against the torch in the venv, the one it will run with.
"${pip[@]}" --no-build-isolation --no-deps .
echo "setup: oneccl_bind_pt built and installed ($((SECONDS - start)) s)" >&2
# -P: import the installed package, not this source tree.
"$venv/bin/python" -P -c "import oneccl_bind_pt as m; print('oneccl_bind_pt', m.__version__, 'ready in', m.cwd)"
