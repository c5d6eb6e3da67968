// See bridge.h. Tensors arrive as `const at::Tensor*` from tch (its `C_tensor` is an
// `at::Tensor*`): each is copied into a local handle (a reference count, not the data)
// before the collective, so the work item keeps the storage alive even if Rust drops
// its tensor after a timeout.
#include "tapline-c10d/cpp/bridge.h"

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "tapline-c10d/src/lib.rs.h"

namespace tapline_c10d {

namespace {

void finish(const Group& group, const c10::intrusive_ptr<c10d::Work>& work,
            const char* what) {
  // Gloo and NCCL raise on a peer's failure or the timeout; a `false` is a timeout too.
  if (!work->wait(group.timeout)) {
    throw std::runtime_error(std::string(what) + " timed out after " +
                             std::to_string(group.timeout.count()) + " ms");
  }
}

c10d::ReduceOp reduce_op(uint8_t op) {
  switch (op) {
    case 0:
      return c10d::ReduceOp(c10d::ReduceOp::SUM);
    case 1:
      return c10d::ReduceOp(c10d::ReduceOp::MAX);
    case 2:
      return c10d::ReduceOp(c10d::ReduceOp::MIN);
    default:
      throw std::invalid_argument("unknown reduce op " + std::to_string(op));
  }
}

}  // namespace

std::unique_ptr<Group> connect(rust::Str backend, rust::Str host, uint16_t port,
                               bool agent_store, rust::Str prefix, int32_t rank,
                               int32_t size, int32_t local_rank, int64_t timeout_ms) {
  auto timeout = std::chrono::milliseconds(timeout_ms);
  c10d::TCPStoreOptions options;
  options.port = port;
  // Under torchrun the agent already serves the store (TORCHELASTIC_USE_AGENT_STORE):
  // every rank is a client, as torch.distributed's own rendezvous does it. Otherwise
  // rank 0 serves it and waits for the others.
  options.isServer = !agent_store && rank == 0;
  options.numWorkers = static_cast<size_t>(size);
  options.waitWorkers = !agent_store;
  options.timeout = timeout;
  auto tcp = c10::make_intrusive<c10d::TCPStore>(std::string(host), options);
  auto group = std::make_unique<Group>();
  group->store = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), tcp);
  group->timeout = timeout;
  std::string name(backend);
  if (name == "gloo") {
    auto gloo_options = c10d::ProcessGroupGloo::Options::create(timeout);
    // As torch.distributed: the interfaces GLOO_SOCKET_IFNAME names (comma-separated),
    // else this host's address, or loopback when its name does not resolve.
    const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
    if (ifname != nullptr && *ifname != '\0') {
      std::string names(ifname);
      size_t start = 0;
      while (start <= names.size()) {
        size_t end = names.find(',', start);
        if (end == std::string::npos) end = names.size();
        if (end > start) {
          gloo_options->devices.push_back(
              c10d::ProcessGroupGloo::createDeviceForInterface(names.substr(start, end - start)));
        }
        start = end + 1;
      }
    }
    if (gloo_options->devices.empty()) {
      gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    group->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(
        group->store, rank, size, gloo_options);
  } else if (name == "nccl") {
    group->backend = make_nccl(group->store, rank, size, local_rank, timeout);
  } else {
    throw std::invalid_argument("unknown backend " + name + " (gloo or nccl)");
  }
  return group;
}

void all_reduce(const Group& group, const at::Tensor* tensor, uint8_t op) {
  std::vector<at::Tensor> tensors{*tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = reduce_op(op);
  options.timeout = group.timeout;
  finish(group, group.backend->allreduce(tensors, options), "all_reduce");
}

void reduce_scatter(const Group& group, const at::Tensor* output, const at::Tensor* input) {
  at::Tensor out = *output;
  at::Tensor in = *input;
  c10d::ReduceScatterOptions options;
  options.timeout = group.timeout;
  finish(group, group.backend->_reduce_scatter_base(out, in, options), "reduce_scatter");
}

void all_gather(const Group& group, const at::Tensor* output, const at::Tensor* input) {
  at::Tensor out = *output;
  at::Tensor in = *input;
  c10d::AllgatherOptions options;
  options.timeout = group.timeout;
  finish(group, group.backend->_allgather_base(out, in, options), "all_gather");
}

void broadcast(const Group& group, const at::Tensor* tensor, int32_t root) {
  std::vector<at::Tensor> tensors{*tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  options.timeout = group.timeout;
  finish(group, group.backend->broadcast(tensors, options), "broadcast");
}

void barrier(const Group& group) {
  c10d::BarrierOptions options;
  options.timeout = group.timeout;
  finish(group, group.backend->barrier(options), "barrier");
}

void store_set(const Group& group, rust::Str key, rust::Slice<const uint8_t> value) {
  group.store->set(std::string(key), std::vector<uint8_t>(value.begin(), value.end()));
}

rust::Vec<uint8_t> store_get(const Group& group, rust::Str key) {
  std::string k(key);
  group.store->wait({k}, group.timeout);
  auto value = group.store->get(k);
  rust::Vec<uint8_t> out;
  out.reserve(value.size());
  for (auto b : value) {
    out.push_back(b);
  }
  return out;
}

#ifndef TAPLINE_WITH_NCCL
bool nccl_built() { return false; }

c10::intrusive_ptr<c10d::Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>&, int, int,
                                            int, std::chrono::milliseconds) {
  throw std::runtime_error(
      "this trainer was built without NCCL (its libtorch has no CUDA, or NCCL's headers "
      "were not found at build time): use the gloo backend");
}
#endif

}  // namespace tapline_c10d
