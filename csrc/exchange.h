/*
 * omnireduce: the collective engine's kernel exchange, C launchers on raw device pointers (exchange.cu).
 *
 * One reduction of a bucket over W ranks, in four launches the host calls between its collectives
 * (omnireduce/engines/exchange_kernels.py): this rank's record (its bitmap, and its first `cap`
 * non-zero blocks as rows), the all-gather of the records, every rank's counts with the union (and
 * the prefix sums that place each block among a row's), then every union block's sum written into the
 * tensor. The bitmaps, prefix sums and sums are those of exchange_steps.h. Element types are the wire
 * codes of block_sparse.h. Every launcher enqueues its work on `stream`, never synchronises, never
 * allocates, returns cudaErrorInvalidValue for bad arguments and follows block_sparse.h's convention
 * for errors pending from earlier work.
 */
#ifndef OMNIREDUCE_EXCHANGE_H_
#define OMNIREDUCE_EXCHANGE_H_

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes of device workspace the prefix sums over n bitmap bytes need (n + 1 <= INT32_MAX). */
cudaError_t omr_prefix_workspace_bytes(int64_t n, size_t* workspace_bytes);

/* This rank's record: the bitmap of x's non-zero blocks (nbytes = ceil(nb / 8) bytes) into `bitmap`,
 * through `flags` (nb bytes of scratch); the prefix sums of its bytes' popcounts into `prefix`
 * (nbytes + 1 ints); and its non-zero blocks whose place p among them is below `cap` into rows[p]
 * (cap x block_size elements; rows past the last block are left as they were). */
cudaError_t omr_record(const void* x, int64_t numel, int64_t block_size, int dtype, float threshold, uint8_t* flags,
                       uint8_t* bitmap, int32_t* prefix, void* rows, int64_t cap, void* workspace,
                       size_t workspace_bytes, cudaStream_t stream);

/* out[p - lo] = block b of x for the blocks b set in `bitmap` whose place p (from `prefix`, that
 * bitmap's prefix sums) is in [lo, hi); the short last block padded with +0, and a block that `mask`
 * (a bitmap, or NULL) lacks written as +0. */
cudaError_t omr_rows(const void* x, int64_t numel, int64_t block_size, int dtype, const uint8_t* bitmap,
                     const int32_t* prefix, const uint8_t* mask, int64_t lo, int64_t hi, void* out,
                     cudaStream_t stream);

/* From W gathered bitmaps (rank r's at src + r * stride) of nb blocks: the bitmaps and their union
 * as bits[(W + 1) x nbytes], the prefix sums over all of it ((W + 1) * nbytes + 1 ints), and the
 * counts (W + 2 int64s, then with `pairs` W * W + W more: see exchange_steps.h); block b's owner is
 * (b % lanes) % W. W * W + 2 * W + 2 <= OMR_MAX_COUNTS. */
cudaError_t omr_counts(const uint8_t* src, int64_t stride, int world, int64_t nb, int64_t lanes, int pairs,
                       uint8_t* bits, int64_t* counts, int32_t* prefix, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream);

enum { OMR_MAX_COUNTS = 12288 };

/* Every block of x set in bitmap row `target` of bits ((rows) x nbytes) = the sum, in row order, of
 * its rows over the sources s < nsrc (bitmap row src_row + s): source s's row p at
 * first + (s * first_stride + p * block_size) elements for p < cap, else at
 * rest + (s * rest_stride + (p - cap) * block_size); times scale (see exchange_steps.h). */
cudaError_t omr_sum_blocks(void* x, int64_t numel, int64_t block_size, int dtype, const uint8_t* bits,
                           const int32_t* prefix, int64_t nbytes, int target, int src_row, int nsrc,
                           const void* first, int64_t first_stride, int64_t cap, const void* rest,
                           int64_t rest_stride, float scale, cudaStream_t stream);

/* omr_sum_blocks, guarded: nothing is written unless each of the first `ncounts` of `counts` (int64s in device
 * memory, read when the kernel runs) is at most `limit`. A sum enqueued before the host has read the counts (a
 * CUDA graph's, after a fused all-gather of `limit` rows a rank) writes only where that all-gather carried every
 * rank's blocks; otherwise the tensor is left as it was, for the host to finish the reduction another way. */
cudaError_t omr_sum_blocks_within(void* x, int64_t numel, int64_t block_size, int dtype, const uint8_t* bits,
                                  const int32_t* prefix, int64_t nbytes, int target, int src_row, int nsrc,
                                  const void* first, int64_t first_stride, int64_t cap, const void* rest,
                                  int64_t rest_stride, float scale, const int64_t* counts, int ncounts,
                                  int64_t limit, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* OMNIREDUCE_EXCHANGE_H_ */
