# shellcheck shell=sh
# oneccl_bind_pt conda activation (installed as etc/conda/activate.d/oneccl_bind_pt.sh).
# Sets for $CONDA_PREFIX what env/setvars.sh sets (conda already puts <prefix>/bin on
# PATH) and keeps each variable's previous value so deactivation can restore it.
for _obp_var in I_MPI_ROOT CCL_ROOT FI_PROVIDER_PATH; do
    if eval "[ -n \"\${$_obp_var+x}\" ]"; then
        eval "export _OBP_SAVED_$_obp_var=\"\${$_obp_var}\""
    else
        eval "unset _OBP_SAVED_$_obp_var"
    fi
done
unset _obp_var
export _OBP_ACTIVE=1

export I_MPI_ROOT="$CONDA_PREFIX"
export CCL_ROOT="$CONDA_PREFIX"
# A provider path the user chose wins; libfabric's providers live in <prefix>/lib.
if [ -z "${FI_PROVIDER_PATH:-}" ]; then
    export FI_PROVIDER_PATH="$CONDA_PREFIX/lib"
fi
