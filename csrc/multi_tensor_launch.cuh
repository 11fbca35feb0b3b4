// The multi-tensor launch planner of the fused kernels (pack_kernels.cu, fp8_kernels.cu):
// many tensors (or pieces of one) are cut into chunks of kChunkElems elements, one thread
// block a chunk, and launched once per kMaxTensors tensors: a launch's grid covers every
// chunk of its tensors, so a large unit's gradients are one launch whose blocks fill the
// GPU, not many small launches. The table travels by value as a kernel argument (no
// host-to-device copy); a block finds its tensor by a binary search of the table.
//
// A kernel takes ChunkTable<Desc> as its first argument, where Desc describes one tensor
// (anything trivially copyable with an int64_t `numel`), and finds its work with
// block_chunk(table). The host side calls launch(kernel, descs, stream, args...).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace mfsdp {
namespace multi_tensor {

constexpr int kMaxTensors = 48;           // tensor descriptors in one launch
constexpr int32_t kMaxBlocks = 1 << 24;   // chunks (thread blocks) in one launch: 2^38 elements
constexpr int64_t kChunkElems = 16384;
constexpr int kThreads = 512;             // threads per block

// One launch's work: blocks [block_begin[t], block_begin[t + 1]) cover chunks
// first_chunk[t], first_chunk[t] + 1, ... of tensors[t] (a tensor too large for one
// launch continues in the next).
template <typename Desc>
struct ChunkTable {
  static_assert(std::is_same_v<decltype(Desc::numel), int64_t>, "a descriptor needs an int64_t numel");
  static_assert(std::is_trivially_copyable_v<Desc>, "a descriptor is copied into the kernel's arguments");
  Desc tensors[kMaxTensors];
  int64_t first_chunk[kMaxTensors];
  int32_t block_begin[kMaxTensors + 1];
  int32_t n_tensors;
};

// The elements [begin, end) of tensors[tensor] that one block works on.
struct BlockChunk {
  int tensor;
  int64_t begin;
  int64_t end;
};

template <typename Desc>
__device__ __forceinline__ BlockChunk block_chunk(const ChunkTable<Desc>& table) {
  const int32_t b = static_cast<int32_t>(blockIdx.x);
  int lo = 0, hi = table.n_tensors - 1;  // the last t with block_begin[t] <= b
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table.block_begin[mid] <= b) lo = mid;
    else hi = mid - 1;
  }
  const int64_t begin = (table.first_chunk[lo] + (b - table.block_begin[lo])) * kChunkElems;
  return BlockChunk{lo, begin, min(table.tensors[lo].numel, begin + kChunkElems)};
}

// Fills chunk tables with every chunk of `tensors`, in order, and calls
// `run(table, blocks)` whenever one is full (kMaxTensors tensors and another to add, or
// kMaxBlocks chunks) and once for the rest. Empty tensors take no slot.
template <typename Desc, typename Run>
void for_each_chunk_table(const std::vector<Desc>& tensors, Run&& run) {
  // The classic limit on a kernel's arguments, which the table shares with a few pointers.
  static_assert(sizeof(ChunkTable<Desc>) < 4000, "the chunk table must fit a kernel's 4 KiB of arguments");
  ChunkTable<Desc> table;
  int32_t n_blocks = 0;
  table.n_tensors = 0;
  auto flush = [&] {
    if (n_blocks > 0) {
      table.block_begin[table.n_tensors] = n_blocks;
      run(table, n_blocks);
    }
    table.n_tensors = 0;
    n_blocks = 0;
  };
  for (const Desc& desc : tensors) {
    const int64_t chunks = (desc.numel + kChunkElems - 1) / kChunkElems;
    int64_t done = 0;
    while (done < chunks) {
      if (table.n_tensors == kMaxTensors || n_blocks == kMaxBlocks) flush();
      const int64_t take = std::min<int64_t>(chunks - done, kMaxBlocks - n_blocks);
      const int slot = table.n_tensors++;
      table.tensors[slot] = desc;
      table.first_chunk[slot] = done;
      table.block_begin[slot] = n_blocks;
      n_blocks += static_cast<int32_t>(take);
      done += take;
    }
  }
  flush();
}

// Runs kernel<<<chunks of a table, kThreads, 0, stream>>>(table, args...) for each table
// of `tensors`.
template <typename Desc, typename... KernelArgs, typename... Args>
void launch(void (*kernel)(ChunkTable<Desc>, KernelArgs...), const std::vector<Desc>& tensors, cudaStream_t stream,
            const Args&... args) {
  for_each_chunk_table(tensors, [&](const ChunkTable<Desc>& table, int blocks) {
    kernel<<<blocks, kThreads, 0, stream>>>(table, args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace multi_tensor
}  // namespace mfsdp
