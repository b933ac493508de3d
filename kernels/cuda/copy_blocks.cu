/* copy_blocks: copy whole KV cache blocks inside one cache tensor, for copy-on-write, in CUDA: the twin of
 * kernels/cpu/copy_blocks.c and kernels/metal/copy_blocks.metal (same arguments, same layout). Compiled by
 * tinygrad's CUDA compiler (nvrtc) from this text.
 *
 * Why a kernel: when sequences that share a partly filled block (n > 1 completions of one prompt, or beams) each
 * write their next token, every writer but the last first gets its own copy (tinyvllm/core/block_manager.py,
 * append_slots). The copy stays on the device, in the step, before the forward pass writes. vLLM's `copy_blocks`
 * (csrc/cache_kernels.cu) takes every layer's cache at once through a table of pointers; tinygrad hands a kernel
 * buffers, not pointer tables, so here one launch copies the pairs of one cache tensor (60 launches for SmolLM2's
 * 30 layers of K and V, only in a step that copies). For the default model one block is 16 x 3 x 64 x 4 B = 12 KB
 * per tensor: one thread block of NUM_THREADS threads per pair, each thread every NUM_THREADS-th element.
 *
 *     grid (num_pairs)     thread block p: cache[dst_p, :] = cache[src_p, :]   (threads stride over block_numel)
 *
 * TV_T is an unsigned integer type of the element's size: bits are copied, whatever the cache's dtype (float32,
 * float16, int8 or fp8 codes, and the per-token scales of a quantized cache).
 *
 * Arguments (row-major):
 *   cache:         (num_blocks, block_numel) TV_T   written in place: block dst := block src for every pair
 *   block_mapping: (num_pairs, 2)            int32  [src, dst] per pair; src == dst or an index outside
 *                                                   [0, num_blocks) is skipped (padding)
 * No block is both a source and a destination, and no destination repeats (the block manager sees to it): the
 * thread blocks run in any order, at the same time.
 * Compile-time constants: TV_NUM_PAIRS, TV_NUM_BLOCKS, TV_BLOCK_NUMEL, TV_T, TV_NUM_THREADS; TV_KERNEL.
 */

TV_KERNEL __launch_bounds__(TV_NUM_THREADS)
copy_blocks(TV_T* __restrict__ cache, const int* __restrict__ block_mapping) {
  const int p = blockIdx.x;
  const int src = block_mapping[2 * p], dst = block_mapping[2 * p + 1];
  if (src == dst || src < 0 || dst < 0 || src >= TV_NUM_BLOCKS || dst >= TV_NUM_BLOCKS) return;
  const TV_T* from = cache + (long)src * TV_BLOCK_NUMEL;
  TV_T* to = cache + (long)dst * TV_BLOCK_NUMEL;
  for (long j = threadIdx.x; j < TV_BLOCK_NUMEL; j += TV_NUM_THREADS) to[j] = from[j];
}
