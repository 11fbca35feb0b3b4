// The multi-tensor launch planner of the fused kernels (pack_kernels.cu, fp8_kernels.cu):
// many tensors (or pieces of one) are cut into chunks of kChunkElems elements, one thread
// block a chunk, and launched as few times as the chunk table allows. The table travels
// by value as a kernel argument, so a launch needs no host-to-device copy.
//
// A kernel takes ChunkTable<Desc> as its first argument, where Desc describes one tensor
// (anything trivially copyable with an int64_t `numel`), and finds its work with
// block_chunk(table). The host side calls launch(kernel, descs, stream, args...).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <vector>

namespace mfsdp {
namespace multi_tensor {

constexpr int kMaxTensors = 48;   // tensor descriptors in one launch
constexpr int kMaxBlocks = 256;   // chunks (thread blocks) in one launch
constexpr int64_t kChunkElems = 16384;
constexpr int kThreads = 512;     // threads per block

// One launch's work: block b covers chunk block_chunk[b] of tensors[block_tensor[b]].
template <typename Desc>
struct ChunkTable {
  static_assert(std::is_same_v<decltype(Desc::numel), int64_t>, "a descriptor needs an int64_t numel");
  static_assert(std::is_trivially_copyable_v<Desc>, "a descriptor is copied into the kernel's arguments");
  Desc tensors[kMaxTensors];
  int16_t block_tensor[kMaxBlocks];
  int32_t block_chunk[kMaxBlocks];
};

// The elements [begin, end) of tensors[tensor] that one block works on.
struct BlockChunk {
  int tensor;
  int64_t begin;
  int64_t end;
};

template <typename Desc>
__device__ __forceinline__ BlockChunk block_chunk(const ChunkTable<Desc>& table) {
  const int t = table.block_tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(table.block_chunk[blockIdx.x]) * kChunkElems;
  return BlockChunk{t, begin, min(table.tensors[t].numel, begin + kChunkElems)};
}

// Fills chunk tables with every chunk of `tensors`, in order, and calls
// `run(table, blocks)` whenever one is full (kMaxBlocks chunks, or kMaxTensors tensors
// and another to add) and once for the rest. A tensor split across launches takes a
// slot in each; empty tensors take none.
template <typename Desc, typename Run>
void for_each_chunk_table(const std::vector<Desc>& tensors, Run&& run) {
  // The classic limit on a kernel's arguments, which the table shares with a few pointers.
  static_assert(sizeof(ChunkTable<Desc>) < 4000, "the chunk table must fit a kernel's 4 KiB of arguments");
  ChunkTable<Desc> table;
  int n_tensors = 0, n_blocks = 0;
  auto flush = [&] {
    if (n_blocks > 0) run(table, n_blocks);
    n_tensors = 0;
    n_blocks = 0;
  };
  for (const Desc& desc : tensors) {
    const int64_t chunks = (desc.numel + kChunkElems - 1) / kChunkElems;
    int slot = -1;  // this tensor's slot in the current table
    for (int64_t c = 0; c < chunks; ++c) {
      if (n_blocks == kMaxBlocks) {
        flush();
        slot = -1;
      }
      if (slot < 0) {
        if (n_tensors == kMaxTensors) flush();
        slot = n_tensors++;
        table.tensors[slot] = desc;
      }
      table.block_tensor[n_blocks] = static_cast<int16_t>(slot);
      table.block_chunk[n_blocks] = static_cast<int32_t>(c);
      ++n_blocks;
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
