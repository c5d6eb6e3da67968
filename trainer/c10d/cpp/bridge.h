// tapline's bridge to libtorch's c10d (the engine under torch.distributed): a TCPStore
// rendezvous and one process group, Gloo (CPU tensors) or NCCL (CUDA tensors), with
// the few collectives the trainer needs. Every call blocks until its work is done or
// the group's timeout passes; every c10d error surfaces as a C++ exception, which cxx
// turns into a Rust `Err`.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "rust/cxx.h"

namespace tapline_c10d {

// A process group: the store it met its peers on, and the backend running collectives.
class Group {
 public:
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
  std::chrono::milliseconds timeout;
};

std::unique_ptr<Group> connect(rust::Str backend, rust::Str host, uint16_t port,
                               bool agent_store, rust::Str prefix, int32_t rank,
                               int32_t size, int32_t local_rank, int64_t timeout_ms);
void all_reduce(const Group& group, const at::Tensor* tensor, uint8_t op);
void reduce_scatter(const Group& group, const at::Tensor* output, const at::Tensor* input);
void all_gather(const Group& group, const at::Tensor* output, const at::Tensor* input);
void broadcast(const Group& group, const at::Tensor* tensor, int32_t root);
void barrier(const Group& group);
void store_set(const Group& group, rust::Str key, rust::Slice<const uint8_t> value);
rust::Vec<uint8_t> store_get(const Group& group, rust::Str key);
bool nccl_built();

// nccl.cc when the build found NCCL's headers; else a stub that throws.
c10::intrusive_ptr<c10d::Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>& store,
                                            int rank, int size, int local_rank,
                                            std::chrono::milliseconds timeout);

}  // namespace tapline_c10d
