/* copy_blocks: copy whole KV cache blocks inside one cache tensor, for copy-on-write, in Metal: the twin of
 * kernels/cuda/copy_blocks.cu and kernels/cpu/copy_blocks.c (same arguments, same layout, line for line where the
 * languages allow). Compiled by tinygrad's Metal compiler.
 *
 * Why a kernel: when sequences that share a partly filled block (n > 1 completions of one prompt, or beams) each
 * write their next token, every writer but the last first gets its own copy (tinyvllm/core/block_manager.py,
 * append_slots). The copy stays on the device, in the step, before the forward pass writes. One launch per cache
 * tensor; one threadgroup of NUM_THREADS threads per pair, each thread every NUM_THREADS-th element:
 *
 *     grid (num_pairs)     threadgroup p: cache[dst_p, :] = cache[src_p, :]
 *
 * TV_T is an unsigned integer type of the element's size (uchar, ushort, uint): bits are copied, whatever the
 * cache's dtype, scales of a quantized cache included.
 *
 * Arguments (row-major), buffers 0-1:
 *   cache:         (num_blocks, block_numel) TV_T   written in place: block dst := block src for every pair
 *   block_mapping: (num_pairs, 2)            int32  [src, dst] per pair; src == dst or an index outside
 *                                                   [0, num_blocks) is skipped (padding)
 * No block is both a source and a destination, and no destination repeats: threadgroups run in any order.
 * Compile-time constants: TV_NUM_PAIRS, TV_NUM_BLOCKS, TV_BLOCK_NUMEL, TV_T, TV_NUM_THREADS; TV_KERNEL (kernel void).
 */
#include <metal_stdlib>
using namespace metal;

TV_KERNEL copy_blocks(device TV_T* cache [[buffer(0)]], const device int* block_mapping [[buffer(1)]],
                      uint3 gid [[threadgroup_position_in_grid]], uint3 lid [[thread_position_in_threadgroup]]) {
  const int p = gid.x;
  const int src = block_mapping[2 * p], dst = block_mapping[2 * p + 1];
  if (src == dst || src < 0 || dst < 0 || src >= TV_NUM_BLOCKS || dst >= TV_NUM_BLOCKS) return;
  const device TV_T* from = cache + (long)src * TV_BLOCK_NUMEL;
  device TV_T* to = cache + (long)dst * TV_BLOCK_NUMEL;
  for (long j = lid.x; j < TV_BLOCK_NUMEL; j += TV_NUM_THREADS) to[j] = from[j];
}
