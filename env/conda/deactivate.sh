# shellcheck shell=sh
# oneccl_bind_pt conda deactivation (installed as etc/conda/deactivate.d/oneccl_bind_pt.sh):
# every variable activation set goes back to its previous value, or is unset if it had none.
if [ "${_OBP_ACTIVE:-}" = 1 ]; then
    for _obp_var in I_MPI_ROOT CCL_ROOT FI_PROVIDER_PATH; do
        if eval "[ -n \"\${_OBP_SAVED_$_obp_var+x}\" ]"; then
            eval "export $_obp_var=\"\${_OBP_SAVED_$_obp_var}\""
            eval "unset _OBP_SAVED_$_obp_var"
        else
            unset "$_obp_var"
        fi
    done
    unset _obp_var _OBP_ACTIVE
fi
