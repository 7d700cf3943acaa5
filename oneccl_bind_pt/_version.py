# Generated from meta/releases.yaml by scripts/gen_release_files.py: do not edit.
"""The supported releases: one oneccl_bind_pt release per PyTorch minor, keyed by it.

setup.py builds the row of the installed torch (its version, the pins its wheel declares,
the Pythons it supports) and records the row it chose in _build_info.py, which it writes
into the build.
"""

RELEASES = {
    "2.9": {
        "version": "2.9.1",
        "torch": "2.9.1",
        "torch_requirement": "torch>=2.9.1,<2.10",
        "python": ["3.10", "3.11", "3.12", "3.13"],
        "requires_python": ">=3.10,<3.14",
        "oneccl": "2022.1.2",
        "impi_rt": "2021.18.1",
        "tcmlib": "1.6.0",
    },
    "2.10": {
        "version": "2.10.0",
        "torch": "2.10.0",
        "torch_requirement": "torch>=2.10.0,<2.11",
        "python": ["3.10", "3.11", "3.12", "3.13"],
        "requires_python": ">=3.10,<3.14",
        "oneccl": "2022.1.2",
        "impi_rt": "2021.18.1",
        "tcmlib": "1.6.0",
    },
    "2.11": {
        "version": "2.11.0",
        "torch": "2.11.0",
        "torch_requirement": "torch>=2.11.0,<2.12",
        "python": ["3.10", "3.11", "3.12", "3.13"],
        "requires_python": ">=3.10,<3.14",
        "oneccl": "2022.1.2",
        "impi_rt": "2021.18.1",
        "tcmlib": "1.6.0",
    },
    "2.12": {
        "version": "2.12.1",
        "torch": "2.12.1",
        "torch_requirement": "torch>=2.12.1,<2.13",
        "python": ["3.10", "3.11", "3.12", "3.13"],
        "requires_python": ">=3.10,<3.14",
        "oneccl": "2022.1.2",
        "impi_rt": "2021.18.1",
        "tcmlib": "1.6.0",
    },
    "2.13": {
        "version": "2.13.0",
        "torch": "2.13.0",
        "torch_requirement": "torch>=2.13.0,<2.14",
        "python": ["3.10", "3.11", "3.12", "3.13"],
        "requires_python": ">=3.10,<3.14",
        "oneccl": "2022.1.2",
        "impi_rt": "2021.18.1",
        "tcmlib": "1.6.0",
    },
    "2.14": {
        "version": "2.14.1",
        "torch": "2.14.1",
        "torch_requirement": "torch>=2.14.1,<2.15",
        "python": ["3.10", "3.11", "3.12", "3.13"],
        "requires_python": ">=3.10,<3.14",
        "oneccl": "2022.1.2",
        "impi_rt": "2021.18.1",
        "tcmlib": "1.6.0",
    },
    "2.15": {
        "version": "2.15.0",
        "torch": "2.15.0",
        "torch_requirement": "torch>=2.15.0,<2.16",
        "python": ["3.11", "3.12", "3.13"],
        "requires_python": ">=3.11,<3.14",
        "oneccl": "2022.1.2",
        "impi_rt": "2021.18.1",
        "tcmlib": "1.6.0",
    },
}
DEFAULT = "2.13"
DEFAULT_PYTHON = "3.11"


def release_for(torch_version):
    """The row for a torch of the same major.minor (any patch or local tag), else None."""
    return RELEASES.get(".".join(torch_version.split("+")[0].split(".")[:2]))


try:  # the row this build was made for
    from ._build_info import RELEASE as _BUILT
except ImportError:  # a tree nobody built, or setup.py reading this file on its own
    _BUILT = DEFAULT
__version__ = RELEASES[_BUILT]["version"]
TORCH_VERSION = RELEASES[_BUILT]["torch"]
ONECCL_VERSION = RELEASES[_BUILT]["oneccl"]
IMPI_RT_VERSION = RELEASES[_BUILT]["impi_rt"]
TCMLIB_VERSION = RELEASES[_BUILT]["tcmlib"]
