# shellcheck shell=sh
# oneccl_bind_pt environment for Intel MPI's mpirun and oneCCL's tools.
#
# Source it (bash, zsh, dash), do not run it:
#     source "$(python -c 'import oneccl_bind_pt as m; print(m.cwd)')/env/setvars.sh"
#
# The ccl backend itself needs none of this: `import oneccl_bind_pt` is enough.
# What it sets, for the environment (venv or conda env) that holds this package:
#     PATH              += <prefix>/bin      mpirun, mpiexec.hydra
#     I_MPI_ROOT        =  <prefix>          Intel MPI finds its tuning files
#     CCL_ROOT          =  <prefix>          oneCCL's tools and headers, if installed
#     FI_PROVIDER_PATH  =  <prefix>/lib      libfabric's providers (only if unset)
# and, when oneCCL's headers and shared library are installed (pip install
# oneccl-devel: what DeepSpeed's CPU op builds and loads against):
#     CPLUS_INCLUDE_PATH += <prefix>/include  oneapi/ccl.hpp for the op's build
#     LD_LIBRARY_PATH    += <prefix>/lib      libccl.so.1, which has no RUNPATH
#                                              (first; last in a conda env)
# Programs started from this shell then take libfabric and hwloc from <prefix>/lib
# too (docs/integrations.md). Sourcing it twice changes nothing more.

_obp_usage() {
    sed -n '2,/^$/p' "$1" | sed -e '/^$/d' -e 's/^# \{0,1\}//'
}

# Where this file is, whichever shell sources it.
if [ -n "${BASH_SOURCE:-}" ]; then
    # shellcheck disable=SC3028,SC3054
    _obp_self="${BASH_SOURCE[0]}"
elif [ -n "${ZSH_VERSION:-}" ]; then
    # shellcheck disable=SC2296
    _obp_self="${(%):-%x}"
else
    _obp_self=""
fi

_obp_executed=0
if [ -n "${BASH_SOURCE:-}" ]; then
    # shellcheck disable=SC3028,SC3054
    [ "${BASH_SOURCE[0]}" = "$0" ] && _obp_executed=1
elif [ -n "${ZSH_VERSION:-}" ]; then
    case "${ZSH_EVAL_CONTEXT:-}" in *:file*) ;; *) _obp_executed=1 ;; esac
else
    # (Not *setvars.sh: a job script named my_setvars.sh may source this one.)
    case "$0" in setvars.sh|*/setvars.sh) _obp_executed=1 ;; esac
fi
if [ "$_obp_executed" = 1 ]; then
    echo "setvars.sh must be sourced, not executed: source $0" >&2
    exit 1
fi

case "${1:-}" in
    -h|--help)
        if [ -n "$_obp_self" ]; then _obp_usage "$_obp_self"; else echo "see the header of setvars.sh"; fi
        unset _obp_self _obp_executed
        unset -f _obp_usage
        return 0
        ;;
esac

if [ -n "$_obp_self" ]; then
    # <prefix>/lib/pythonX.Y/site-packages/oneccl_bind_pt/env/setvars.sh
    _obp_prefix="$(cd "$(dirname "$_obp_self")/../../../../.." 2>/dev/null && pwd)"
else
    # dash cannot tell a sourced file its own path: use the environment of the
    # Python on PATH (the one this package is installed in, once activated).
    _obp_prefix="$(python3 -c 'import sys; print(sys.prefix)' 2>/dev/null)"
fi
if [ -z "$_obp_prefix" ] || [ ! -d "$_obp_prefix/lib" ]; then
    echo "setvars.sh: cannot find the environment this package is installed in" >&2
    unset _obp_self _obp_executed _obp_prefix
    unset -f _obp_usage
    return 1
fi

case ":${PATH:-}:" in
    *":$_obp_prefix/bin:"*) ;;
    *) export PATH="$_obp_prefix/bin${PATH:+:$PATH}" ;;
esac
export I_MPI_ROOT="$_obp_prefix"
export CCL_ROOT="$_obp_prefix"
if [ -z "${FI_PROVIDER_PATH:-}" ]; then
    export FI_PROVIDER_PATH="$_obp_prefix/lib"
fi
if [ -f "$_obp_prefix/include/oneapi/ccl.hpp" ] && [ -f "$_obp_prefix/lib/libccl.so.1" ]; then
    case ":${CPLUS_INCLUDE_PATH:-}:" in
        *":$_obp_prefix/include:"*) ;;
        *) export CPLUS_INCLUDE_PATH="$_obp_prefix/include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}" ;;
    esac
    case ":${LD_LIBRARY_PATH:-}:" in
        *":$_obp_prefix/lib:"*) ;;
        *)
            if [ -d "$_obp_prefix/conda-meta" ]; then
                # A conda env's lib holds its own libstdc++, OpenSSL, ncurses, ...: last, so
                # that the system's programs started from this shell keep the system's.
                export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$_obp_prefix/lib"
            else
                export LD_LIBRARY_PATH="$_obp_prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
            fi
            ;;
    esac
fi

unset _obp_self _obp_executed _obp_prefix
unset -f _obp_usage
