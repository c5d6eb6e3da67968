// Declarations that ProcessGroupGloo.hpp needs from gloo, whose headers the PyPI torch
// wheel does not ship (the library itself is inside libtorch_cpu.so). Only names and the
// members the header's inline code mentions: tapline never constructs, inherits from or
// calls into a gloo type; it builds a ProcessGroupGloo through its exported constructor
// and createDeviceForHostname, so no gloo code is compiled from these declarations.
#pragma once
#include <chrono>
namespace gloo {
class Context {
 public:
  void setTimeout(std::chrono::milliseconds timeout);
};
}  // namespace gloo
