// The NCCL backend, compiled only when the build finds NCCL's and CUDA's headers (the
// nvidia-nccl and nvidia-cuda-runtime wheels beside torch): ProcessGroupNCCL.hpp
// includes them. It runs on CUDA tensors only.
#include "tapline-c10d/cpp/bridge.h"

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

namespace tapline_c10d {

bool nccl_built() { return true; }

c10::intrusive_ptr<c10d::Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>& store,
                                            int rank, int size,
                                            std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}

}  // namespace tapline_c10d
