/* copy_blocks: copy whole KV cache blocks inside one cache tensor, for copy-on-write (the twin of
 * kernels/cuda/copy_blocks.cu and kernels/metal/copy_blocks.metal: same arguments, same layout).
 *
 * Why a kernel: when sequences that share a partly filled block (n > 1 completions of one prompt, or the beams of a
 * beam search) each write their next token, every writer but the last first gets its own copy of the block
 * (tinyvllm/core/block_manager.py, append_slots). The copy has to be on the device, in the step, before the forward
 * pass writes: a copy through the host would move the block out and back in. For the default model (SmolLM2-135M:
 * 30 layers, 3 KV heads, head_dim 64, float32, block_size 16) one block is
 *     16 tokens x 3 x 64 x 4 B = 12 KB per K (or V) tensor,  x 2 x 30 layers = 737 KB per block copied,
 * one launch per cache tensor (60 per step that copies, none in the steps that do not).
 *
 * The kernel copies bits, not numbers: TV_T is an unsigned integer type of the element's size, so one source serves
 * float32, float16 and 8-bit caches alike, and the per-token scales beside a quantized cache (any tensor whose first
 * dimension is the block).
 *
 * Arguments (row-major):
 *   cache:         (num_blocks, block_numel) TV_T   written in place: block dst := block src for every pair
 *   block_mapping: (num_pairs, 2)            int32  [src, dst] per pair; a pair with src == dst or an index outside
 *                                                   [0, num_blocks) is skipped (padding to a fixed number of pairs)
 * Pairs never overlap: no block is both a source and a destination, no destination appears twice (the block manager
 * sees to it), so the order they run in does not matter (a GPU runs them at the same time).
 * Compile-time constants: TV_NUM_PAIRS, TV_NUM_BLOCKS, TV_BLOCK_NUMEL, TV_T; TV_KERNEL (tinygrad's kernel_typedef).
 */

TV_KERNEL copy_blocks(TV_T* restrict cache, const int* restrict block_mapping) {
  for (int p = 0; p < TV_NUM_PAIRS; p++) {
    const int src = block_mapping[2 * p], dst = block_mapping[2 * p + 1];
    if (src == dst || src < 0 || dst < 0 || src >= TV_NUM_BLOCKS || dst >= TV_NUM_BLOCKS) continue;
    const TV_T* restrict from = cache + (long)src * TV_BLOCK_NUMEL;
    TV_T* restrict to = cache + (long)dst * TV_BLOCK_NUMEL;
    for (long j = 0; j < TV_BLOCK_NUMEL; j++) to[j] = from[j];
  }
}
