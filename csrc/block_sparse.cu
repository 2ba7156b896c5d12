// omnireduce block-sparsity kernels: non-zero block flags, compaction, scaled scatter.
//
// Plain CUDA C++ (CUDA toolkit + CUB only, no torch), so that `nvcc -c block_sparse.cu` builds anywhere
// nvcc does; csrc/bindings.cpp wraps the extern "C" launchers declared in block_sparse.h for torch.
//
// Work split. A *group* of threads owns one tensor block at a time (grid-stride over blocks): a warp
// when the block is at most kWarpBlockBytes, else a whole CUDA block of kThreads threads, so that
// each thread issues a few independent 16-byte loads per block either way. Inside a block the group
// reads a scalar head up to the first 16-byte boundary, then whole 16-byte vectors, then a scalar
// tail, so any element-aligned address works (torch views with a storage offset, short last block).
// Copies use vectors only when source and destination are equally misaligned mod 16, else scalars.
//
// The flags pass has a second, flat form for the common case (a 16-byte aligned tensor whose blocks are
// a power-of-two number of 16-byte vectors, at most kChunkVecs): a warp reads kChunkVecs consecutive
// vectors at a time, kUnroll loads per lane issued before any is used (so a warp has 4 KB in flight
// however small the blocks are), and ballots decide the blocks those vectors make up. The grouped form
// above keeps every other layout (misaligned views, odd block sizes, large blocks).
//
// Compaction is flags pass (reads every element once) + cub::DeviceSelect::Flagged over the nb
// flags (1 byte per block, i.e. 1/1024 of a float32 tensor with blocks of 256) + a gather pass that
// reads only the k non-zero blocks (the host learns k in between, to size the output).
//
// Numerics. Exact mode ORs the raw words and tests the magnitude bits, so NaN/Inf count, -0.0 does not,
// and subnormals count regardless of flush-to-zero settings. Threshold mode widens to float32 (exact
// for float16/bfloat16) and tests !(|x| <= t), so NaN counts. Scaled scatter widens to float32,
// multiplies once (no FMA involved) and rounds once to nearest-even (__float2half_rn,
// __float2bfloat16_rn); scale == 1 copies the bits. Build without --use_fast_math (it flushes
// subnormals).
//
// Errors. A launcher first peeks at the calling thread's pending CUDA error: one left by earlier,
// unrelated work is returned as it is, still pending, and nothing is launched (the caller peeks first to
// tell it apart, as csrc/bindings.cpp does). After its own launch it returns and clears the launch
// status (cudaGetLastError), which is then this launch's alone.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstddef>
#include <cstdint>

#include <cub/device/device_select.cuh>
#include <thrust/iterator/counting_iterator.h>

#include "block_sparse.h"

namespace {

constexpr int kThreads = 256;                // threads per CUDA block, every launch
constexpr int kLog2Warp = 5;
constexpr int kWarp = 1 << kLog2Warp;
constexpr int64_t kWarpBlockBytes = 4096;    // blocks up to this size are handled by one warp
constexpr int64_t kMaxGrid = int64_t(1) << 20;  // grid-stride loops cover the rest
constexpr int kUnroll = 8;                   // flat flags pass: 16-byte loads in flight per lane
constexpr int64_t kChunkVecs = int64_t(kWarp) * kUnroll;  // vectors a warp reads per step of the flat pass

enum class DT { F32, F16, BF16 };

// Element traits, on the raw storage word U of each element type.
template <DT D>
struct Traits;

template <>
struct Traits<DT::F32> {
  using U = uint32_t;
  static constexpr uint32_t kMask32 = 0x7FFFFFFFu;  // magnitude bits of the elements of a 32-bit word
  __device__ __forceinline__ static float widen(U b) { return __uint_as_float(b); }
  __device__ __forceinline__ static U narrow(float f) { return __float_as_uint(f); }
};

template <>
struct Traits<DT::F16> {
  using U = uint16_t;
  static constexpr uint32_t kMask32 = 0x7FFF7FFFu;
  __device__ __forceinline__ static float widen(U b) { return __half2float(__ushort_as_half(b)); }
  __device__ __forceinline__ static U narrow(float f) { return __half_as_ushort(__float2half_rn(f)); }
};

template <>
struct Traits<DT::BF16> {
  using U = uint16_t;
  static constexpr uint32_t kMask32 = 0x7FFF7FFFu;
  __device__ __forceinline__ static float widen(U b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }
  __device__ __forceinline__ static U narrow(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
};

// G threads that own one tensor block at a time: a warp, or the whole CUDA block.
template <int G>
struct Group;

template <>
struct Group<kWarp> {
  __device__ __forceinline__ static int rank() { return static_cast<int>(threadIdx.x) & (kWarp - 1); }
  __device__ __forceinline__ static int64_t first() {
    return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  }
  __device__ __forceinline__ static int64_t stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x / kWarp; }
  // Every lane of the warp must call this (the grid-stride loop is uniform per warp).
  __device__ __forceinline__ static bool any(bool p) { return __any_sync(0xFFFFFFFFu, p) != 0; }
};

template <>
struct Group<kThreads> {
  __device__ __forceinline__ static int rank() { return static_cast<int>(threadIdx.x); }
  __device__ __forceinline__ static int64_t first() { return static_cast<int64_t>(blockIdx.x); }
  __device__ __forceinline__ static int64_t stride() { return static_cast<int64_t>(gridDim.x); }
  // Every thread of the CUDA block must call this (the grid-stride loop is uniform per block).
  __device__ __forceinline__ static bool any(bool p) { return __syncthreads_or(p ? 1 : 0) != 0; }
};

// Elements in block b (block_size, except the short last block).
__device__ __forceinline__ int64_t block_len(int64_t b, int64_t block_size, int64_t numel) {
  const int64_t begin = b * block_size;
  const int64_t end = begin + block_size < numel ? begin + block_size : numel;
  return end - begin;
}

// [p, p + len) as `head` scalars up to the first 16-byte boundary, then `nvec` whole 16-byte vectors,
// then scalars from head + nvec * (16 / ES) to len. p must be aligned to ES.
template <int ES>
__device__ __forceinline__ void split16(const void* p, int64_t len, int64_t& head, int64_t& nvec) {
  const unsigned mis = static_cast<unsigned>(reinterpret_cast<uintptr_t>(p) & 15u);
  int64_t h = static_cast<int64_t>(((16u - mis) & 15u) / ES);
  if (h > len) h = len;
  head = h;
  nvec = (len - h) / (16 / ES);
}

// Accumulates "is some element non-zero": raw OR of the words (exact) or |x| > t or NaN (threshold).
template <DT D, bool kThreshold>
struct NonzeroAcc {
  using T = Traits<D>;
  uint32_t bits = 0;
  bool big = false;
  float t;
  __device__ __forceinline__ explicit NonzeroAcc(float threshold) : t(threshold) {}

  __device__ __forceinline__ void elem(typename T::U u) {
    if (kThreshold) {
      big |= !(fabsf(T::widen(u)) <= t);
    } else {
      bits |= static_cast<uint32_t>(u);
    }
  }
  __device__ __forceinline__ void word(uint32_t w) {  // 32 bits of consecutive elements, little-endian
    if (kThreshold) {
      if (sizeof(typename T::U) == 4) {
        elem(static_cast<typename T::U>(w));
      } else {
        elem(static_cast<typename T::U>(w & 0xFFFFu));
        elem(static_cast<typename T::U>(w >> 16));
      }
    } else {
      bits |= w;
    }
  }
  __device__ __forceinline__ bool result() const { return kThreshold ? big : (bits & T::kMask32) != 0; }
};

template <DT D, bool kThreshold, int G>
__global__ void __launch_bounds__(kThreads)
    flags_kernel(const typename Traits<D>::U* __restrict__ x, int64_t numel, int64_t block_size, int64_t nb,
                 float threshold, uint8_t* __restrict__ flags) {
  using U = typename Traits<D>::U;
  constexpr int ES = sizeof(U);
  constexpr int PER = 16 / ES;
  const int r = Group<G>::rank();
  for (int64_t b = Group<G>::first(); b < nb; b += Group<G>::stride()) {
    const U* p = x + b * block_size;
    const int64_t len = block_len(b, block_size, numel);
    int64_t head, nvec;
    split16<ES>(p, len, head, nvec);
    NonzeroAcc<D, kThreshold> acc(threshold);
    const uint4* v = reinterpret_cast<const uint4*>(p + head);
#pragma unroll 4
    for (int64_t i = r; i < nvec; i += G) {
      const uint4 w = __ldg(v + i);
      acc.word(w.x);
      acc.word(w.y);
      acc.word(w.z);
      acc.word(w.w);
    }
    for (int64_t i = r; i < head; i += G) acc.elem(p[i]);
    for (int64_t i = head + nvec * PER + r; i < len; i += G) acc.elem(p[i]);
    const bool nz = Group<G>::any(acc.result());
    if (r == 0) flags[b] = nz ? 1 : 0;
  }
}

// Flat flags pass. x is 16-byte aligned and a block is vpb = 2^log2_vpb whole 16-byte vectors,
// vpb <= kChunkVecs; nvec = the whole vectors of x, and the numel - nvec * PER elements after them (fewer
// than PER) belong to the last block; nchunks = the warp steps that cover both. Warp step c reads vectors [c * kChunkVecs, (c + 1) * kChunkVecs),
// which hold whole blocks since vpb divides kChunkVecs: lane l holds vector base + u * kWarp + l for
// u < kUnroll. If vpb >= kWarp a block is vpb / kWarp consecutive u (one __any_sync); else each u holds
// kWarp / vpb blocks of vpb lanes (one ballot, a mask per block).
template <DT D, bool kThreshold>
__global__ void __launch_bounds__(kThreads)
    flags_flat_kernel(const typename Traits<D>::U* __restrict__ x, int64_t numel, int64_t nvec, int64_t nchunks,
                      int log2_vpb, int64_t nb, float threshold, uint8_t* __restrict__ flags) {
  using U = typename Traits<D>::U;
  constexpr int PER = 16 / sizeof(U);
  const uint4* v = reinterpret_cast<const uint4*>(x);
  const int lane = Group<kWarp>::rank();
  const int vpb = 1 << log2_vpb;
  for (int64_t c = Group<kWarp>::first(); c < nchunks; c += Group<kWarp>::stride()) {
    const int64_t base = c * kChunkVecs;
    uint4 w[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kWarp + lane;
      w[u] = i < nvec ? __ldg(v + i) : make_uint4(0u, 0u, 0u, 0u);
    }
    bool nz[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      NonzeroAcc<D, kThreshold> acc(threshold);
      acc.word(w[u].x);
      acc.word(w[u].y);
      acc.word(w[u].z);
      acc.word(w[u].w);
      if (base + u * kWarp + lane == nvec) {  // the elements after the last whole vector
        for (int64_t e = nvec * PER; e < numel; ++e) acc.elem(x[e]);
      }
      nz[u] = acc.result();
    }
    if (vpb >= kWarp) {
      const int log2_steps = log2_vpb - kLog2Warp;  // u-steps per block: vpb / kWarp, a power of two <= kUnroll
      bool any = false;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        any = any || nz[u];
        if ((((u + 1) >> log2_steps) << log2_steps) == u + 1) {  // the last step of a block
          const bool block_nz = Group<kWarp>::any(any);
          const int64_t b = (base >> log2_vpb) + (u >> log2_steps);
          if (lane == 0 && b < nb) flags[b] = block_nz ? 1 : 0;
          any = false;
        }
      }
    } else {
      const unsigned lanes = (1u << vpb) - 1u;  // vpb < 32 lanes, from a multiple of vpb
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const unsigned m = __ballot_sync(0xFFFFFFFFu, nz[u]);
        const int64_t b = (base + u * kWarp + lane) >> log2_vpb;
        if ((lane & (vpb - 1)) == 0 && b < nb) flags[b] = ((m >> lane) & lanes) != 0 ? 1 : 0;
      }
    }
  }
}

// One 32-bit word of consecutive elements times s, each rounded once to the element type.
template <DT D>
__device__ __forceinline__ uint32_t scale_word(uint32_t w, float s) {
  using T = Traits<D>;
  if (sizeof(typename T::U) == 4) {
    return static_cast<uint32_t>(T::narrow(T::widen(static_cast<typename T::U>(w)) * s));
  } else {
    const uint32_t lo = T::narrow(T::widen(static_cast<typename T::U>(w & 0xFFFFu)) * s);
    const uint32_t hi = T::narrow(T::widen(static_cast<typename T::U>(w >> 16)) * s);
    return lo | (hi << 16);
  }
}

template <DT D, bool kScale>
__device__ __forceinline__ typename Traits<D>::U scale_elem(typename Traits<D>::U u, float s) {
  return kScale ? Traits<D>::narrow(Traits<D>::widen(u) * s) : u;
}

// dst[0..len) = src[0..len) (times s if kScale), by the G threads of a group (this one is rank r).
template <DT D, bool kScale, int G>
__device__ __forceinline__ void copy_span(typename Traits<D>::U* __restrict__ dst,
                                          const typename Traits<D>::U* __restrict__ src, int64_t len, int r,
                                          float s) {
  using U = typename Traits<D>::U;
  constexpr int ES = sizeof(U);
  constexpr int PER = 16 / ES;
  const uintptr_t mis = (reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src)) & 15u;
  if (mis != 0) {  // never both 16-byte aligned at once: element by element (still coalesced)
    for (int64_t i = r; i < len; i += G) dst[i] = scale_elem<D, kScale>(src[i], s);
    return;
  }
  int64_t head, nvec;
  split16<ES>(src, len, head, nvec);  // same split for dst: equally misaligned
  const uint4* vs = reinterpret_cast<const uint4*>(src + head);
  uint4* vd = reinterpret_cast<uint4*>(dst + head);
#pragma unroll 4
  for (int64_t i = r; i < nvec; i += G) {
    uint4 w = __ldg(vs + i);
    if (kScale) {
      w.x = scale_word<D>(w.x, s);
      w.y = scale_word<D>(w.y, s);
      w.z = scale_word<D>(w.z, s);
      w.w = scale_word<D>(w.w, s);
    }
    vd[i] = w;
  }
  for (int64_t i = r; i < head; i += G) dst[i] = scale_elem<D, kScale>(src[i], s);
  for (int64_t i = head + nvec * PER + r; i < len; i += G) dst[i] = scale_elem<D, kScale>(src[i], s);
}

// out[i] = block idx[i] of x, zero-padded to block_size; out_idx[i] = idx[i] if out_idx.
template <DT D, int G>
__global__ void __launch_bounds__(kThreads)
    gather_kernel(const typename Traits<D>::U* __restrict__ x, int64_t numel, int64_t block_size, int64_t nb,
                  const int64_t* __restrict__ idx, int64_t k, typename Traits<D>::U* __restrict__ out,
                  int64_t* __restrict__ out_idx) {
  using U = typename Traits<D>::U;
  const int r = Group<G>::rank();
  for (int64_t i = Group<G>::first(); i < k; i += Group<G>::stride()) {
    const int64_t b = idx[i];
    if (out_idx != nullptr && r == 0) out_idx[i] = b;
    U* dst = out + i * block_size;
    int64_t len = 0;
    if (b >= 0 && b < nb) {
      len = block_len(b, block_size, numel);
      copy_span<D, false, G>(dst, x + b * block_size, len, r, 1.0f);
    }
    for (int64_t j = len + r; j < block_size; j += G) dst[j] = 0;
  }
}

// Block idx[i] of x = blocks[i] (times s if kScale), real elements only.
template <DT D, bool kScale, int G>
__global__ void __launch_bounds__(kThreads)
    scatter_kernel(typename Traits<D>::U* __restrict__ x, int64_t numel, int64_t block_size, int64_t nb,
                   const int64_t* __restrict__ idx, int64_t k, const typename Traits<D>::U* __restrict__ blocks,
                   float s) {
  const int r = Group<G>::rank();
  for (int64_t i = Group<G>::first(); i < k; i += Group<G>::stride()) {
    const int64_t b = idx[i];
    if (b < 0 || b >= nb) continue;
    copy_span<D, kScale, G>(x + b * block_size, blocks + i * block_size, block_len(b, block_size, numel), r, s);
  }
}

int64_t num_blocks(int64_t numel, int64_t block_size) { return numel / block_size + (numel % block_size != 0); }

int elem_size(int dtype) { return dtype == OMR_FLOAT32 ? 4 : (dtype == OMR_FLOAT16 || dtype == OMR_BFLOAT16) ? 2 : 0; }

// Sizes far beyond any real tensor are refused so that no index arithmetic can overflow int64.
constexpr int64_t kMaxElems = int64_t(1) << 56;

bool valid_args(int64_t numel, int64_t block_size, int dtype) {
  return numel >= 0 && numel <= kMaxElems && block_size >= 1 && block_size <= kMaxElems && elem_size(dtype) != 0;
}

bool warp_groups(int64_t block_size, int64_t elem_bytes) { return block_size * elem_bytes <= kWarpBlockBytes; }

// CUDA blocks for `items` tensor blocks: one per 8 (warp groups) or one per block (CTA groups).
dim3 grid_for(int64_t items, bool warp) {
  const int64_t per_cta = warp ? kThreads / kWarp : 1;
  int64_t ctas = (items + per_cta - 1) / per_cta;
  if (ctas > kMaxGrid) ctas = kMaxGrid;
  return dim3(static_cast<unsigned>(ctas));
}

// log2 of the 16-byte vectors per block if the flat flags pass applies to x, else -1.
int flat_log2_vpb(const void* x, int64_t block_size, int64_t elem_bytes) {
  if ((reinterpret_cast<uintptr_t>(x) & 15u) != 0) return -1;
  const int64_t bytes = block_size * elem_bytes;  // <= 2^58 (valid_args)
  const int64_t vpb = bytes / 16;
  if (bytes % 16 != 0 || vpb > kChunkVecs || (vpb & (vpb - 1)) != 0) return -1;
  int log2 = 0;
  while ((int64_t(1) << log2) < vpb) ++log2;
  return log2;
}

template <DT D>
cudaError_t launch_flags(const void* x, int64_t numel, int64_t block_size, int64_t nb, float t, uint8_t* flags,
                         cudaStream_t stream) {
  using U = typename Traits<D>::U;
  const U* p = static_cast<const U*>(x);
  if (const int log2_vpb = flat_log2_vpb(x, block_size, sizeof(U)); log2_vpb >= 0) {
    constexpr int64_t per = 16 / sizeof(U);
    const int64_t nvec = numel / per;
    const int64_t vectors = nvec + (numel % per != 0 ? 1 : 0);  // + a partial last vector
    const int64_t chunks = (vectors + kChunkVecs - 1) / kChunkVecs;
    const dim3 grid = grid_for(chunks, true);
    if (t > 0.0f) {
      flags_flat_kernel<D, true><<<grid, kThreads, 0, stream>>>(p, numel, nvec, chunks, log2_vpb, nb, t, flags);
    } else {
      flags_flat_kernel<D, false><<<grid, kThreads, 0, stream>>>(p, numel, nvec, chunks, log2_vpb, nb, t, flags);
    }
    return cudaGetLastError();  // nothing was pending before (omr_* checked): this launch's status
  }
  const bool warp = warp_groups(block_size, sizeof(U));
  const dim3 grid = grid_for(nb, warp);
  if (t > 0.0f) {
    if (warp) {
      flags_kernel<D, true, kWarp><<<grid, kThreads, 0, stream>>>(p, numel, block_size, nb, t, flags);
    } else {
      flags_kernel<D, true, kThreads><<<grid, kThreads, 0, stream>>>(p, numel, block_size, nb, t, flags);
    }
  } else if (warp) {
    flags_kernel<D, false, kWarp><<<grid, kThreads, 0, stream>>>(p, numel, block_size, nb, t, flags);
  } else {
    flags_kernel<D, false, kThreads><<<grid, kThreads, 0, stream>>>(p, numel, block_size, nb, t, flags);
  }
  return cudaGetLastError();  // nothing was pending before (omr_* checked): this launch's status
}

template <DT D>
cudaError_t launch_gather(const void* x, int64_t numel, int64_t block_size, int64_t nb, const int64_t* idx,
                          int64_t k, void* out, int64_t* out_idx, cudaStream_t stream) {
  using U = typename Traits<D>::U;
  const U* p = static_cast<const U*>(x);
  U* o = static_cast<U*>(out);
  const bool warp = warp_groups(block_size, sizeof(U));
  const dim3 grid = grid_for(k, warp);
  if (warp) {
    gather_kernel<D, kWarp><<<grid, kThreads, 0, stream>>>(p, numel, block_size, nb, idx, k, o, out_idx);
  } else {
    gather_kernel<D, kThreads><<<grid, kThreads, 0, stream>>>(p, numel, block_size, nb, idx, k, o, out_idx);
  }
  return cudaGetLastError();  // nothing was pending before (omr_* checked): this launch's status
}

template <DT D>
cudaError_t launch_scatter(void* x, int64_t numel, int64_t block_size, int64_t nb, const int64_t* idx, int64_t k,
                           const void* blocks, float s, cudaStream_t stream) {
  using U = typename Traits<D>::U;
  U* p = static_cast<U*>(x);
  const U* src = static_cast<const U*>(blocks);
  const bool warp = warp_groups(block_size, sizeof(U));
  const dim3 grid = grid_for(k, warp);
  const bool scaled = s != 1.0f;
  if (scaled && warp) {
    scatter_kernel<D, true, kWarp><<<grid, kThreads, 0, stream>>>(p, numel, block_size, nb, idx, k, src, s);
  } else if (scaled) {
    scatter_kernel<D, true, kThreads><<<grid, kThreads, 0, stream>>>(p, numel, block_size, nb, idx, k, src, s);
  } else if (warp) {
    scatter_kernel<D, false, kWarp><<<grid, kThreads, 0, stream>>>(p, numel, block_size, nb, idx, k, src, s);
  } else {
    scatter_kernel<D, false, kThreads><<<grid, kThreads, 0, stream>>>(p, numel, block_size, nb, idx, k, src, s);
  }
  return cudaGetLastError();  // nothing was pending before (omr_* checked): this launch's status
}

// Flagged select over the block numbers 0..n-1. d_temp == nullptr: only computes *temp_bytes. CUB reports
// a launch error with cudaPeekAtLastError, leaving it pending: it is cleared here, like the other launches.
cudaError_t select_flagged(void* d_temp, size_t* temp_bytes, const uint8_t* flags, int64_t* out, int64_t* count,
                           int n, cudaStream_t stream) {
  const cudaError_t err = cub::DeviceSelect::Flagged(d_temp, *temp_bytes, thrust::counting_iterator<int64_t>(0),
                                                     flags, out, count, n, stream);
  const cudaError_t launch = cudaGetLastError();
  return err != cudaSuccess ? err : launch;
}

// Bytes of CUB workspace for n flags (launches nothing, so leaves no status behind).
cudaError_t select_bytes(int n, size_t* temp_bytes) {
  *temp_bytes = 0;
  return cub::DeviceSelect::Flagged(nullptr, *temp_bytes, thrust::counting_iterator<int64_t>(0),
                                    static_cast<const uint8_t*>(nullptr), static_cast<int64_t*>(nullptr),
                                    static_cast<int64_t*>(nullptr), n, cudaStream_t{});
}

// launch_flags for a wire dtype code (valid_args checked it).
cudaError_t launch_flags_for(int dtype, const void* x, int64_t numel, int64_t block_size, int64_t nb, float t,
                             uint8_t* flags, cudaStream_t stream) {
  switch (dtype) {
    case OMR_FLOAT32: return launch_flags<DT::F32>(x, numel, block_size, nb, t, flags, stream);
    case OMR_FLOAT16: return launch_flags<DT::F16>(x, numel, block_size, nb, t, flags, stream);
    default: return launch_flags<DT::BF16>(x, numel, block_size, nb, t, flags, stream);
  }
}

// The flagged select into a caller's workspace, refused (cudaErrorInvalidValue) if it is too small.
cudaError_t select_into(const uint8_t* flags, int n, int64_t* indices, int64_t* count, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream) {
  size_t needed = 0;
  if (const cudaError_t err = select_bytes(n, &needed); err != cudaSuccess) return err;
  if (workspace_bytes < needed) return cudaErrorInvalidValue;
  return select_flagged(workspace, &workspace_bytes, flags, indices, count, n, stream);
}

// An error left pending on this thread by earlier work (returned, not cleared, by the omr_* launchers).
cudaError_t pending_error() { return cudaPeekAtLastError(); }

}  // namespace

extern "C" {

cudaError_t omr_block_flags(const void* x, int64_t numel, int64_t block_size, int dtype, float threshold,
                            uint8_t* flags, cudaStream_t stream) {
  if (!valid_args(numel, block_size, dtype)) return cudaErrorInvalidValue;
  const int64_t nb = num_blocks(numel, block_size);
  if (nb == 0) return cudaSuccess;
  if (x == nullptr || flags == nullptr) return cudaErrorInvalidValue;
  if (const cudaError_t pending = pending_error(); pending != cudaSuccess) return pending;
  return launch_flags_for(dtype, x, numel, block_size, nb, threshold, flags, stream);
}

cudaError_t omr_select_workspace_bytes(int64_t num_blocks, size_t* workspace_bytes) {
  if (workspace_bytes == nullptr || num_blocks < 0 || num_blocks > INT_MAX) return cudaErrorInvalidValue;
  if (const cudaError_t pending = pending_error(); pending != cudaSuccess) return pending;
  return select_bytes(static_cast<int>(num_blocks), workspace_bytes);
}

cudaError_t omr_select_nonzero(const uint8_t* flags, int64_t num_blocks, int64_t* indices, int64_t* count,
                               void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (num_blocks < 0 || num_blocks > INT_MAX || flags == nullptr || indices == nullptr || count == nullptr ||
      workspace == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (const cudaError_t pending = pending_error(); pending != cudaSuccess) return pending;
  return select_into(flags, static_cast<int>(num_blocks), indices, count, workspace, workspace_bytes, stream);
}

cudaError_t omr_flags_and_select(const void* x, int64_t numel, int64_t block_size, int dtype, float threshold,
                                 uint8_t* flags, int64_t* indices, int64_t* count, void* workspace,
                                 size_t workspace_bytes, cudaStream_t stream) {
  if (!valid_args(numel, block_size, dtype)) return cudaErrorInvalidValue;
  const int64_t nb = num_blocks(numel, block_size);
  if (nb == 0 || nb > INT_MAX || x == nullptr || flags == nullptr || indices == nullptr || count == nullptr ||
      workspace == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (const cudaError_t pending = pending_error(); pending != cudaSuccess) return pending;
  size_t needed = 0;  // (refused before anything is launched)
  if (const cudaError_t err = select_bytes(static_cast<int>(nb), &needed); err != cudaSuccess) return err;
  if (workspace_bytes < needed) return cudaErrorInvalidValue;
  if (const cudaError_t err = launch_flags_for(dtype, x, numel, block_size, nb, threshold, flags, stream);
      err != cudaSuccess) {
    return err;
  }
  return select_flagged(workspace, &workspace_bytes, flags, indices, count, static_cast<int>(nb), stream);
}

cudaError_t omr_gather_blocks(const void* x, int64_t numel, int64_t block_size, int dtype, const int64_t* indices,
                              int64_t k, void* out, int64_t* out_indices, cudaStream_t stream) {
  if (!valid_args(numel, block_size, dtype) || k < 0) return cudaErrorInvalidValue;
  if (k == 0) return cudaSuccess;
  if (indices == nullptr || out == nullptr || (x == nullptr && numel > 0)) return cudaErrorInvalidValue;
  if (const cudaError_t pending = pending_error(); pending != cudaSuccess) return pending;
  const int64_t nb = num_blocks(numel, block_size);
  switch (dtype) {
    case OMR_FLOAT32: return launch_gather<DT::F32>(x, numel, block_size, nb, indices, k, out, out_indices, stream);
    case OMR_FLOAT16: return launch_gather<DT::F16>(x, numel, block_size, nb, indices, k, out, out_indices, stream);
    default: return launch_gather<DT::BF16>(x, numel, block_size, nb, indices, k, out, out_indices, stream);
  }
}

cudaError_t omr_scatter_blocks(void* x, int64_t numel, int64_t block_size, int dtype, const int64_t* indices,
                               int64_t k, const void* blocks, float scale, cudaStream_t stream) {
  if (!valid_args(numel, block_size, dtype) || k < 0) return cudaErrorInvalidValue;
  const int64_t nb = num_blocks(numel, block_size);
  if (k == 0 || nb == 0) return cudaSuccess;
  if (x == nullptr || indices == nullptr || blocks == nullptr) return cudaErrorInvalidValue;
  if (const cudaError_t pending = pending_error(); pending != cudaSuccess) return pending;
  switch (dtype) {
    case OMR_FLOAT32: return launch_scatter<DT::F32>(x, numel, block_size, nb, indices, k, blocks, scale, stream);
    case OMR_FLOAT16: return launch_scatter<DT::F16>(x, numel, block_size, nb, indices, k, blocks, scale, stream);
    default: return launch_scatter<DT::BF16>(x, numel, block_size, nb, indices, k, blocks, scale, stream);
  }
}

}  // extern "C"
