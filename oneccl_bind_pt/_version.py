# Generated from meta/releases.yaml by scripts/gen_release_files.py: do not edit.
# The torch release this build pairs with, and the CPU flavour.
__version__ = "2.13.0+cpu"
TORCH_VERSION = "2.13.0"
ONECCL_VERSION = "2022.1.2"
IMPI_RT_VERSION = "2021.18.1"
TCMLIB_VERSION = "1.6.0"
