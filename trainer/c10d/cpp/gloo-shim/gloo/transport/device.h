// See ../context.h: declarations only (held through shared_ptr / unique_ptr).
#pragma once
namespace gloo {
namespace transport {
class Device;
class UnboundBuffer;
}  // namespace transport
}  // namespace gloo
