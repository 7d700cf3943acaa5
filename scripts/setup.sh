#!/usr/bin/env bash
# Sets up a venv with one (torch, Python) pair's pinned stack and builds/installs
# oneccl_bind_pt into it.
#
#   ./scripts/setup.sh                                 the default pair (torch 2.13.0, Python 3.11) in .venv
#   ./scripts/setup.sh --torch 2.14.1                  another release, default Python: .venv-torch2.14.1
#   ./scripts/setup.sh --torch 2.14.1 --python 3.12    any supported pair: .venv-torch2.14.1-py3.12
#
# Pairs: meta/releases.yaml (python3 scripts/releases.py pairs). The interpreter is $PYTHON,
# pythonX.Y on PATH or pyenv's. Idempotent: a second run only rebuilds what changed
# (objects are kept per torch and Python, under build/).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,11s/^# \{0,1\}//p' "$0"; }
args=()
while [ $# -gt 0 ]; do
    case $1 in
        --torch | --python) [ $# -ge 2 ] || { usage >&2; exit 2; }; args+=("$1" "$2"); shift 2 ;;
        --torch=* | --python=*) args+=("${1%%=*}" "${1#*=}"); shift ;;
        -h | --help) usage; exit 0 ;;
        *) echo "setup: unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done

# Any python3 can answer which pair, venv and interpreter: releases.py is standard library only.
bootstrap=${PYTHON:-python3}
command -v "$bootstrap" >/dev/null 2>&1 || bootstrap=python3
resolved=$("$bootstrap" scripts/releases.py resolve ${args[@]+"${args[@]}"}) || exit $?
eval "$resolved"   # torch, python, interpreter, venv, reqs

start=$SECONDS
# Creates the venv, or repairs one that cannot work here (a dangling link, a moved
# interpreter, another Python version); stops on anything that is not a venv.
"$interpreter" scripts/ensure_venv.py "$venv"
# --no-compile: pip compiles one file at a time; compileall below uses every core, and also
# covers a venv made before it.
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile)
# torch is pinned: an unpinned torch would pull the CUDA build.
if grep -q '^# lift-pip-constraint:' "$reqs"; then
    # This release's torch is above the torch cap this project's build machines set in pip's
    # global configuration (a constraints file): PIP_CONSTRAINT=/dev/null lifts it,
    # for this one pip command only (meta/releases.yaml: lift_pip_constraint).
    PIP_CONSTRAINT=/dev/null "${pip[@]}" -r "$reqs"
else
    "${pip[@]}" -r "$reqs"
fi
# Byte-compile the stack once. Where Python does not write bytecode when it imports
# (PYTHONDONTWRITEBYTECODE, common in container images; a read-only site-packages) every
# process otherwise compiles torch's modules again: 3.8 s of CPU per `import torch` here against
# 1.7 s compiled, in every rank of every job and test. Up to date, this takes a few seconds.
# A file or two in the stack is for newer Pythons only (torch's testing helpers): those fail
# to compile, as they fail to import, so its exit status is not ours.
"$venv/bin/python" -m compileall -qq -j 0 "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
echo "setup: $venv has the torch $torch stack on Python $python ($((SECONDS - start)) s)" >&2
start=$SECONDS
# --no-build-isolation: build against the torch in the venv, the one it will run with.
"${pip[@]}" --no-build-isolation --no-deps .
echo "setup: oneccl_bind_pt built and installed ($((SECONDS - start)) s)" >&2
# From /: import the installed package, not this source tree (python -P does that from 3.11 only).
root=$PWD
(cd / && "$root/$venv/bin/python" -c "import oneccl_bind_pt as m; print('oneccl_bind_pt', m.__version__, 'ready in', m.cwd)")
