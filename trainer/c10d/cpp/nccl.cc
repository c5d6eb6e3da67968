// The NCCL backend, compiled only when the build finds NCCL's and CUDA's headers (the
// nvidia-nccl and nvidia-cuda-runtime wheels beside torch): ProcessGroupNCCL.hpp
// includes them. It runs on CUDA tensors only.
#include "tapline-c10d/cpp/bridge.h"

#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

namespace tapline_c10d {

bool nccl_built() { return true; }

c10::intrusive_ptr<c10d::Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>& store,
                                            int rank, int size, int local_rank,
                                            std::chrono::milliseconds timeout) {
  // This process's GPU is its local rank's (torchrun's layout), as
  // torch.cuda.set_device(LOCAL_RANK) makes it in a Python trainer: NCCL's communicator
  // and its barrier use the current device.
  int devices = static_cast<int>(c10::cuda::device_count());
  TORCH_CHECK(devices > 0, "ProcessGroupNCCL is only supported with GPUs, no GPUs found!");
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(local_rank % devices));
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}

}  // namespace tapline_c10d
