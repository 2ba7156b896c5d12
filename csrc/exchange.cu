// omnireduce: the collective engine's kernel exchange (exchange.h): each launcher runs a step of
// exchange_steps.h over a grid. Plain CUDA C++ (CUDA toolkit + CUB only, no torch).
//
// Work split. The packing and counting passes give a thread one bitmap byte at a time; the row and
// sum passes give a warp one tensor block at a time (its lanes take every 32nd element), grid-stride
// either way. A block that its bitmap lacks costs a warp one byte read. The counts are added in
// shared memory per CUDA block, then once per CUDA block into the global counts (zeroed first). The
// prefix sums are CUB's exclusive scan over the bytes' popcounts.

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstddef>
#include <cstdint>

#include <cub/device/device_scan.cuh>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>

#include "block_sparse.h"
#include "exchange.h"
#include "exchange_steps.h"

namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int64_t kMaxGrid = int64_t(1) << 20;

// float16 on the device: the CUDA intrinsics (round to nearest even).
struct F16Dev {
  using U = uint16_t;
  __device__ __forceinline__ static float widen(U u) { return __half2float(__ushort_as_half(u)); }
  __device__ __forceinline__ static U narrow(float f) { return __half_as_ushort(__float2half_rn(f)); }
};

int64_t num_blocks(int64_t numel, int64_t block_size) { return numel / block_size + (numel % block_size != 0); }

bool valid_dtype(int dtype) { return dtype == OMR_FLOAT32 || dtype == OMR_FLOAT16 || dtype == OMR_BFLOAT16; }

bool valid_args(int64_t numel, int64_t block_size, int dtype) {
  return numel >= 1 && numel <= (int64_t(1) << 56) && block_size >= 1 && block_size <= (int64_t(1) << 56) &&
         valid_dtype(dtype) && num_blocks(numel, block_size) / 8 < INT_MAX - 1;
}

dim3 grid_for(int64_t items, int64_t per_cta) {
  int64_t ctas = (items + per_cta - 1) / per_cta;
  if (ctas > kMaxGrid) ctas = kMaxGrid;
  if (ctas < 1) ctas = 1;
  return dim3(static_cast<unsigned>(ctas));
}

__device__ __forceinline__ int64_t thread_first() { return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ __forceinline__ int64_t thread_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }
__device__ __forceinline__ int64_t warp_first() { return thread_first() / kWarp; }
__device__ __forceinline__ int64_t warp_stride() { return thread_stride() / kWarp; }
__device__ __forceinline__ int lane() { return static_cast<int>(threadIdx.x) & (kWarp - 1); }

__global__ void __launch_bounds__(kThreads) pack_kernel(const uint8_t* __restrict__ flags, int64_t nb, int64_t nbytes,
                                                        uint8_t* __restrict__ bitmap) {
  for (int64_t j = thread_first(); j < nbytes; j += thread_stride()) bitmap[j] = omr_steps::pack_byte(flags, nb, j);
}

struct SharedAdd {
  unsigned int* acc;
  __device__ __forceinline__ void operator()(int i, int v) { atomicAdd(acc + i, static_cast<unsigned int>(v)); }
};

__global__ void __launch_bounds__(kThreads)
    counts_kernel(const uint8_t* __restrict__ src, int64_t stride, int W, int64_t nbytes, int64_t nb, int64_t lanes,
                  bool pairs, uint8_t* __restrict__ bits, unsigned long long* __restrict__ counts) {
  extern __shared__ unsigned int acc[];
  const int n = omr_steps::counts_len(W, pairs);
  for (int i = threadIdx.x; i < n; i += blockDim.x) acc[i] = 0u;
  __syncthreads();
  SharedAdd add{acc};
  for (int64_t j = thread_first(); j < nbytes; j += thread_stride()) {
    omr_steps::count_byte(src, stride, W, nbytes, nb, lanes, pairs, bits, j, add);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    if (acc[i] != 0u) atomicAdd(counts + i, static_cast<unsigned long long>(acc[i]));
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    rows_kernel(const typename T::U* __restrict__ x, int64_t numel, int64_t B, int64_t nb,
                const uint8_t* __restrict__ row, const int32_t* __restrict__ prefix, const uint8_t* __restrict__ mask,
                int64_t lo, int64_t hi, typename T::U* __restrict__ out) {
  for (int64_t b = warp_first(); b < nb; b += warp_stride()) {
    omr_steps::rows_block<T>(x, numel, B, row, prefix, mask, lo, hi, out, b, lane(), kWarp);
  }
}

cudaError_t pending_error() { return cudaPeekAtLastError(); }

// A guard for the sums: the first n counts of `counts` (device memory), none above `limit` (counts == nullptr:
// no guard). Read by every warp before it writes anything.
struct Guard {
  const int64_t* counts;
  int n;
  int64_t limit;
};

template <class T>
__global__ void __launch_bounds__(kThreads)
    sum_kernel(typename T::U* __restrict__ x, int64_t numel, int64_t B, int64_t nb, const uint8_t* __restrict__ bits,
               const int32_t* __restrict__ prefix, int64_t nbytes, int target, int src_row, int nsrc,
               omr_steps::Sources<typename T::U> in, float scale, Guard guard) {
  if (guard.counts != nullptr && !omr_steps::within(guard.counts, guard.n, guard.limit)) return;
  for (int64_t b = warp_first(); b < nb; b += warp_stride()) {
    omr_steps::sum_block<T>(x, numel, B, bits, prefix, nbytes, target, src_row, nsrc, in, scale, b, lane(), kWarp);
  }
}

// A bitmap byte's popcount, 0 past the last byte (the scan's n + 1st item gives the total).
struct BytePopcount {
  const uint8_t* bytes;
  int64_t n;
  __host__ __device__ int32_t operator()(int64_t i) const { return i < n ? omr_steps::popcount(bytes[i]) : 0; }
};

using PopcountIt = thrust::transform_iterator<BytePopcount, thrust::counting_iterator<int64_t>>;

// The exclusive prefix sums of n bytes' popcounts into prefix[0..n] (d_temp == nullptr: only the bytes).
cudaError_t scan(void* d_temp, size_t* temp_bytes, const uint8_t* bytes, int64_t n, int32_t* prefix,
                 cudaStream_t stream) {
  const PopcountIt in(thrust::counting_iterator<int64_t>(0), BytePopcount{bytes, n});
  const cudaError_t err = cub::DeviceScan::ExclusiveSum(d_temp, *temp_bytes, in, prefix, static_cast<int>(n + 1), stream);
  if (d_temp == nullptr) return err;
  const cudaError_t launch = cudaGetLastError();
  return err != cudaSuccess ? err : launch;
}

cudaError_t scan_into(const uint8_t* bytes, int64_t n, int32_t* prefix, void* workspace, size_t workspace_bytes,
                      cudaStream_t stream) {
  size_t needed = 0;
  if (const cudaError_t err = scan(nullptr, &needed, bytes, n, prefix, stream); err != cudaSuccess) return err;
  if (workspace == nullptr || workspace_bytes < needed) return cudaErrorInvalidValue;
  return scan(workspace, &workspace_bytes, bytes, n, prefix, stream);
}

template <class T>
cudaError_t launch_rows(const void* x, int64_t numel, int64_t B, const uint8_t* bitmap, const int32_t* prefix,
                        const uint8_t* mask, int64_t lo, int64_t hi, void* out, cudaStream_t stream) {
  using U = typename T::U;
  const int64_t nb = num_blocks(numel, B);
  rows_kernel<T><<<grid_for(nb, kThreads / kWarp), kThreads, 0, stream>>>(
      static_cast<const U*>(x), numel, B, nb, bitmap, prefix, mask, lo, hi, static_cast<U*>(out));
  return cudaGetLastError();
}

cudaError_t rows_for(int dtype, const void* x, int64_t numel, int64_t B, const uint8_t* bitmap, const int32_t* prefix,
                     const uint8_t* mask, int64_t lo, int64_t hi, void* out, cudaStream_t stream) {
  switch (dtype) {
    case OMR_FLOAT32: return launch_rows<omr_steps::F32>(x, numel, B, bitmap, prefix, mask, lo, hi, out, stream);
    case OMR_FLOAT16: return launch_rows<F16Dev>(x, numel, B, bitmap, prefix, mask, lo, hi, out, stream);
    default: return launch_rows<omr_steps::BF16>(x, numel, B, bitmap, prefix, mask, lo, hi, out, stream);
  }
}

template <class T>
cudaError_t launch_sum(void* x, int64_t numel, int64_t B, const uint8_t* bits, const int32_t* prefix, int64_t nbytes,
                       int target, int src_row, int nsrc, const void* first, int64_t first_stride, int64_t cap,
                       const void* rest, int64_t rest_stride, float scale, Guard guard, cudaStream_t stream) {
  using U = typename T::U;
  const int64_t nb = num_blocks(numel, B);
  const omr_steps::Sources<U> in{static_cast<const U*>(first), first_stride, cap, static_cast<const U*>(rest),
                                 rest_stride};
  sum_kernel<T><<<grid_for(nb, kThreads / kWarp), kThreads, 0, stream>>>(
      static_cast<U*>(x), numel, B, nb, bits, prefix, nbytes, target, src_row, nsrc, in, scale, guard);
  return cudaGetLastError();
}

cudaError_t sum_blocks(void* x, int64_t numel, int64_t block_size, int dtype, const uint8_t* bits,
                       const int32_t* prefix, int64_t nbytes, int target, int src_row, int nsrc, const void* first,
                       int64_t first_stride, int64_t cap, const void* rest, int64_t rest_stride, float scale,
                       Guard guard, cudaStream_t stream) {
  if (!valid_args(numel, block_size, dtype) || nbytes != (num_blocks(numel, block_size) + 7) / 8 || target < 0 ||
      src_row < 0 || nsrc < 0 || cap < 0 || x == nullptr || bits == nullptr || prefix == nullptr ||
      (nsrc > 0 && cap > 0 && first == nullptr) || (guard.counts != nullptr && guard.n < 0)) {
    return cudaErrorInvalidValue;
  }
  if (const cudaError_t pending = pending_error(); pending != cudaSuccess) return pending;
  switch (dtype) {
    case OMR_FLOAT32:
      return launch_sum<omr_steps::F32>(x, numel, block_size, bits, prefix, nbytes, target, src_row, nsrc, first,
                                        first_stride, cap, rest, rest_stride, scale, guard, stream);
    case OMR_FLOAT16:
      return launch_sum<F16Dev>(x, numel, block_size, bits, prefix, nbytes, target, src_row, nsrc, first,
                                first_stride, cap, rest, rest_stride, scale, guard, stream);
    default:
      return launch_sum<omr_steps::BF16>(x, numel, block_size, bits, prefix, nbytes, target, src_row, nsrc, first,
                                         first_stride, cap, rest, rest_stride, scale, guard, stream);
  }
}

}  // namespace

extern "C" {

cudaError_t omr_prefix_workspace_bytes(int64_t n, size_t* workspace_bytes) {
  if (workspace_bytes == nullptr || n < 0 || n >= INT_MAX) return cudaErrorInvalidValue;
  *workspace_bytes = 0;
  return scan(nullptr, workspace_bytes, nullptr, n, nullptr, cudaStream_t{});
}

cudaError_t omr_record(const void* x, int64_t numel, int64_t block_size, int dtype, float threshold, uint8_t* flags,
                       uint8_t* bitmap, int32_t* prefix, void* rows, int64_t cap, void* workspace,
                       size_t workspace_bytes, cudaStream_t stream) {
  if (!valid_args(numel, block_size, dtype) || cap < 0 || x == nullptr || flags == nullptr || bitmap == nullptr ||
      prefix == nullptr || (cap > 0 && rows == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (const cudaError_t pending = pending_error(); pending != cudaSuccess) return pending;
  const int64_t nb = num_blocks(numel, block_size);
  const int64_t nbytes = (nb + 7) / 8;
  size_t needed = 0;  // (refused before anything is launched)
  if (const cudaError_t err = omr_prefix_workspace_bytes(nbytes, &needed); err != cudaSuccess) return err;
  if (workspace == nullptr || workspace_bytes < needed) return cudaErrorInvalidValue;
  if (const cudaError_t err = omr_block_flags(x, numel, block_size, dtype, threshold, flags, stream);
      err != cudaSuccess) {
    return err;
  }
  pack_kernel<<<grid_for(nbytes, kThreads), kThreads, 0, stream>>>(flags, nb, nbytes, bitmap);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  if (const cudaError_t err = scan_into(bitmap, nbytes, prefix, workspace, workspace_bytes, stream);
      err != cudaSuccess) {
    return err;
  }
  if (cap == 0) return cudaSuccess;
  return rows_for(dtype, x, numel, block_size, bitmap, prefix, nullptr, 0, cap, rows, stream);
}

cudaError_t omr_rows(const void* x, int64_t numel, int64_t block_size, int dtype, const uint8_t* bitmap,
                     const int32_t* prefix, const uint8_t* mask, int64_t lo, int64_t hi, void* out,
                     cudaStream_t stream) {
  if (!valid_args(numel, block_size, dtype) || lo < 0 || hi < lo) return cudaErrorInvalidValue;
  if (hi == lo) return cudaSuccess;
  if (x == nullptr || bitmap == nullptr || prefix == nullptr || out == nullptr) return cudaErrorInvalidValue;
  if (const cudaError_t pending = pending_error(); pending != cudaSuccess) return pending;
  return rows_for(dtype, x, numel, block_size, bitmap, prefix, mask, lo, hi, out, stream);
}

cudaError_t omr_counts(const uint8_t* src, int64_t stride, int world, int64_t nb, int64_t lanes, int pairs,
                       uint8_t* bits, int64_t* counts, int32_t* prefix, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream) {
  const int64_t nbytes = (nb + 7) / 8;
  if (world < 1 || nb < 1 || lanes < 1 || stride < nbytes || src == nullptr || bits == nullptr || counts == nullptr ||
      prefix == nullptr || (world + 1) * nbytes >= INT_MAX ||
      int64_t(world) * world + 2 * int64_t(world) + 2 > OMR_MAX_COUNTS) {
    return cudaErrorInvalidValue;
  }
  if (const cudaError_t pending = pending_error(); pending != cudaSuccess) return pending;
  const int64_t rows_bytes = (world + 1) * nbytes;
  size_t needed = 0;
  if (const cudaError_t err = omr_prefix_workspace_bytes(rows_bytes, &needed); err != cudaSuccess) return err;
  if (workspace == nullptr || workspace_bytes < needed) return cudaErrorInvalidValue;
  const int n = omr_steps::counts_len(world, pairs != 0);
  if (const cudaError_t err = cudaMemsetAsync(counts, 0, sizeof(int64_t) * n, stream); err != cudaSuccess) return err;
  counts_kernel<<<grid_for(nbytes, kThreads), kThreads, sizeof(unsigned int) * n, stream>>>(
      src, stride, world, nbytes, nb, lanes, pairs != 0, bits, reinterpret_cast<unsigned long long*>(counts));
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  return scan_into(bits, rows_bytes, prefix, workspace, workspace_bytes, stream);
}

cudaError_t omr_sum_blocks(void* x, int64_t numel, int64_t block_size, int dtype, const uint8_t* bits,
                           const int32_t* prefix, int64_t nbytes, int target, int src_row, int nsrc,
                           const void* first, int64_t first_stride, int64_t cap, const void* rest,
                           int64_t rest_stride, float scale, cudaStream_t stream) {
  return sum_blocks(x, numel, block_size, dtype, bits, prefix, nbytes, target, src_row, nsrc, first, first_stride, cap,
                    rest, rest_stride, scale, Guard{nullptr, 0, 0}, stream);
}

cudaError_t omr_sum_blocks_within(void* x, int64_t numel, int64_t block_size, int dtype, const uint8_t* bits,
                                  const int32_t* prefix, int64_t nbytes, int target, int src_row, int nsrc,
                                  const void* first, int64_t first_stride, int64_t cap, const void* rest,
                                  int64_t rest_stride, float scale, const int64_t* counts, int ncounts,
                                  int64_t limit, cudaStream_t stream) {
  if (counts == nullptr) return cudaErrorInvalidValue;
  return sum_blocks(x, numel, block_size, dtype, bits, prefix, nbytes, target, src_row, nsrc, first, first_stride, cap,
                    rest, rest_stride, scale, Guard{counts, ncounts, limit}, stream);
}

}  // extern "C"
