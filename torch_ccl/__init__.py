"""``import torch_ccl`` is oneccl_bind_pt under the name Intel's torch-ccl used."""

import sys

import oneccl_bind_pt

# The same module object: attributes, __file__ and cwd all point at oneccl_bind_pt.
sys.modules[__name__] = oneccl_bind_pt
