// The torch and oneCCL headers most translation units include, compiled once per build
// (setup.py: a gcc precompiled header). Parsing them took ~13 s of every unit's ~16 s.
// pybind11 stays out: its templates would be instantiated again in every unit that loads this.
#pragma once

#include <ATen/ATen.h>
#include <oneapi/ccl.hpp>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
