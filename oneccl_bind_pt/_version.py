# The torch release this build pairs with, and the CPU flavour.
__version__ = "2.13.0+cpu"
TORCH_VERSION = "2.13.0"
ONECCL_VERSION = "2022.1.2"
