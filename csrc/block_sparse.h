/*
 * omnireduce block-sparsity kernels: C launchers on raw device pointers.
 *
 * A flat tensor of `numel` elements is cut into nb = ceil(numel / block_size) blocks; the last block
 * may be short (numel % block_size elements). A block is non-zero iff one of its elements has a
 * magnitude bit set (NaN and +-Inf count, -0.0 and +0.0 do not) or, with threshold > 0, iff one of
 * its elements does not satisfy |x| <= threshold (so NaN counts). See docs/protocol.md.
 *
 * Element types use the wire codes of the protocol (OMR_FLOAT32, OMR_FLOAT16, OMR_BFLOAT16).
 * Pointers must be aligned to their element size; no other alignment is required (16-byte vector
 * loads are used where the addresses allow). Every launcher enqueues its work on `stream`, never
 * synchronises, never allocates, and returns cudaErrorInvalidValue for bad arguments or the launch
 * status otherwise. This header and block_sparse.cu depend on the CUDA toolkit only (no torch).
 *
 * Errors: if an error from earlier, unrelated work is pending on the calling thread
 * (cudaPeekAtLastError() != cudaSuccess), a launcher launches nothing and returns that error, leaving
 * it pending; a caller that peeks before calling can therefore tell it from the launcher's own. Else
 * the launcher returns (and clears) the status of its own launch: a launch error is its own, while an
 * asynchronous fault of its kernels surfaces at the next synchronisation, like any kernel's.
 */
#ifndef OMNIREDUCE_BLOCK_SPARSE_H_
#define OMNIREDUCE_BLOCK_SPARSE_H_

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { OMR_FLOAT32 = 1, OMR_FLOAT16 = 2, OMR_BFLOAT16 = 3 };

/* flags[b] = 1 if block b of x is non-zero, else 0, for b < nb. threshold <= 0: exact mode. */
cudaError_t omr_block_flags(const void* x, int64_t numel, int64_t block_size, int dtype, float threshold,
                            uint8_t* flags, cudaStream_t stream);

/* Bytes of device workspace omr_select_nonzero needs for `num_blocks` flags (num_blocks <= INT32_MAX). */
cudaError_t omr_select_workspace_bytes(int64_t num_blocks, size_t* workspace_bytes);

/* indices[0..k) = the b with flags[b] != 0, ascending; *count = k (both device memory; indices must
 * hold num_blocks entries). */
cudaError_t omr_select_nonzero(const uint8_t* flags, int64_t num_blocks, int64_t* indices, int64_t* count,
                               void* workspace, size_t workspace_bytes, cudaStream_t stream);

/* omr_block_flags into flags (nb bytes), then omr_select_nonzero over them, in one call with one check
 * of the pending error: the first two steps of a compaction (1 <= nb <= INT32_MAX). */
cudaError_t omr_flags_and_select(const void* x, int64_t numel, int64_t block_size, int dtype, float threshold,
                                 uint8_t* flags, int64_t* indices, int64_t* count, void* workspace,
                                 size_t workspace_bytes, cudaStream_t stream);

/* out[i, :] = block indices[i] of x for i < k (out is k x block_size, contiguous); the short last block
 * is zero-padded, and an index outside [0, nb) gives a row of zeros. If out_indices is not NULL,
 * out_indices[i] = indices[i] as well (so indices may live in a scratch buffer). */
cudaError_t omr_gather_blocks(const void* x, int64_t numel, int64_t block_size, int dtype, const int64_t* indices,
                              int64_t k, void* out, int64_t* out_indices, cudaStream_t stream);

/* Block indices[i] of x = blocks[i, :] * scale for i < k (blocks is k x block_size, contiguous), the
 * product in float32 rounded once to the element type (scale == 1: the bits are copied). Only the real
 * elements of the short last block are written; an index outside [0, nb) is skipped. Indices should be
 * distinct. */
cudaError_t omr_scatter_blocks(void* x, int64_t numel, int64_t block_size, int dtype, const int64_t* indices,
                               int64_t k, const void* blocks, float scale, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* OMNIREDUCE_BLOCK_SPARSE_H_ */
