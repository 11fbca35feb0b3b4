// Storage that refuses reads once its memory is freed: a resharded unit's unsharded
// parameters keep their shapes while their memory is gone, so a read must raise our
// message rather than dereference a null pointer.
#pragma once

#include <c10/core/StorageImpl.h>

#include <string>

namespace mfsdp {

// Whether this build's torch lets freed unsharded storage refuse reads with our message
// (StorageImpl's custom data-pointer error, with a way to clear it). Without it, a
// tensor kept from an unsharded parameter past reshard() points at freed memory.
bool freed_storage_guard();

// Every data access of `impl` raises `why` from now on (what memory it still has is
// released); a no-op without freed_storage_guard().
void refuse_access(c10::StorageImpl* impl, const std::string& why);
// Lifts refuse_access(), before the storage gets memory again.
void allow_access(c10::StorageImpl* impl);

}  // namespace mfsdp
