/*
 * omnireduce: the per-item steps of the collective engine's kernel exchange (exchange.cu), written
 * once for the device and the host. The CUDA kernels run each step for every item of a grid; a host
 * build runs the same steps in loops (the tests compare that build with the engine's torch ops, on
 * machines without a GPU). No CUDA or torch header is needed outside nvcc.
 *
 * Bitmaps. A bucket of nb blocks has a bitmap of nbytes = ceil(nb / 8) bytes, block b in bit
 * 7 - b % 8 of byte b / 8 (the first block in the high bit: numpy's packbits order); the padding bits
 * of the last byte are 0. Rows of W + 1 bitmaps (every rank's, then their union) sit one after the
 * other in a [W + 1, nbytes] array, and `prefix` holds the exclusive prefix sums of their bytes'
 * popcounts over that whole array: block b's place among row r's set blocks is
 * prefix[r * nbytes + b / 8] - prefix[r * nbytes] + (the set bits before it in its byte).
 *
 * Sums. A block's sum is taken in float32 from -0.0 over the rows that have it, in row (rank) order,
 * rounded once to the element type (bfloat16 by the bit arithmetic of omnireduce.cuda.ops.narrow),
 * then times `scale` in float32 and rounded again when scale != 1: the bits of the engine's torch ops.
 */
#ifndef OMNIREDUCE_EXCHANGE_STEPS_H_
#define OMNIREDUCE_EXCHANGE_STEPS_H_

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define OMR_HD __host__ __device__ __forceinline__
#else
#define OMR_HD inline
#endif

namespace omr_steps {

OMR_HD int popcount(uint32_t v) {
#ifdef __CUDA_ARCH__
  return __popc(v);
#else
  return __builtin_popcount(v);
#endif
}

OMR_HD int64_t block_len(int64_t b, int64_t block_size, int64_t numel) {
  const int64_t begin = b * block_size;
  return (begin + block_size < numel ? begin + block_size : numel) - begin;
}

// Whether block b is set in a bitmap row.
OMR_HD bool bit(const uint8_t* row, int64_t b) { return ((row[b >> 3] >> (7 - (b & 7))) & 1u) != 0; }

// The bits of byte j that stand for blocks (the last byte's padding cleared).
OMR_HD uint32_t valid_bits(int64_t j, int64_t nb) {
  const int64_t rest = nb - 8 * j;
  return rest >= 8 ? 0xFFu : (0xFFu << (8 - rest)) & 0xFFu;
}

// Byte j of the bitmap of nb one-byte flags.
OMR_HD uint8_t pack_byte(const uint8_t* flags, int64_t nb, int64_t j) {
  uint32_t v = 0;
  for (int k = 0; k < 8; ++k) {
    const int64_t b = 8 * j + k;
    if (b < nb && flags[b] != 0) v |= 0x80u >> k;
  }
  return static_cast<uint8_t>(v);
}

// Block b's place among the set blocks of `row`, whose prefix sums start at `prefix` (see the top).
OMR_HD int64_t position(const uint8_t* row, const int32_t* prefix, int64_t b) {
  const int64_t j = b >> 3;
  const uint32_t before = static_cast<uint32_t>(row[j]) >> (8 - (b & 7));  // (b % 8 == 0: nothing before)
  return static_cast<int64_t>(prefix[j]) - prefix[0] + popcount(before);
}

// Whether each of the first n counts is at most limit: a fused all-gather of `limit` rows a rank carried
// every rank's blocks. A sum launched before the host has read the counts (a CUDA graph's) runs only then.
OMR_HD bool within(const int64_t* counts, int n, int64_t limit) {
  for (int r = 0; r < n; ++r) {
    if (counts[r] > limit) return false;
  }
  return true;
}

// The counts vector's layout (omnireduce.engines.plan.Counts.from_flat): W non-zero counts, the union's,
// whether the last block is in the union, then with pairs W * W (source, owner) pairs and W owned counts.
OMR_HD int counts_len(int W, bool pairs) { return W + 2 + (pairs ? W * W + W : 0); }

// Byte j of every rank's bitmap (row r at src + r * stride) copied into bits[r * nbytes + j], their union
// into bits[W * nbytes + j], and its counts given to add(index into the counts vector, amount). Block
// b's owner is (b % lanes) % W.
template <class Add>
OMR_HD void count_byte(const uint8_t* src, int64_t stride, int W, int64_t nbytes, int64_t nb, int64_t lanes,
                       bool pairs, uint8_t* bits, int64_t j, Add& add) {
  const uint32_t valid = valid_bits(j, nb);
  uint32_t u = 0;
  for (int r = 0; r < W; ++r) {
    const uint32_t v = src[r * stride + j] & valid;
    bits[r * nbytes + j] = static_cast<uint8_t>(v);
    u |= v;
    if (v != 0) add(r, popcount(v));
  }
  bits[W * nbytes + j] = static_cast<uint8_t>(u);
  if (u != 0) add(W, popcount(u));
  if (j == nbytes - 1 && ((u >> (7 - ((nb - 1) & 7))) & 1u) != 0) add(W + 1, 1);
  if (!pairs || u == 0) return;
  for (int k = 0; k < 8; ++k) {
    const uint32_t m = 0x80u >> k;
    if ((u & m) == 0) continue;
    const int64_t b = 8 * j + k;
    const int o = static_cast<int>((b % lanes) % W);
    add(W + 2 + W * W + o, 1);
    for (int s = 0; s < W; ++s) {
      if ((bits[s * nbytes + j] & m) != 0) add(W + 2 + s * W + o, 1);
    }
  }
}

// Element types by their storage word U: widen to float32, and round a float32 back once, to nearest
// even. The device and the host differ only in how (intrinsics, or bit arithmetic here).
struct F32 {
  using U = uint32_t;
  OMR_HD static float widen(U u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
  OMR_HD static U narrow(float f) {
    U u;
    memcpy(&u, &f, 4);
    return u;
  }
};

// bfloat16: the top half of a float32, rounded to nearest even; a NaN keeps its sign and payload's
// top bits, made quiet (omnireduce.cuda.ops.narrow's arithmetic, the same bits on host and device).
struct BF16 {
  using U = uint16_t;
  OMR_HD static float widen(U u) { return F32::widen(static_cast<uint32_t>(u) << 16); }
  OMR_HD static U narrow(float f) {
    const uint32_t bits = F32::narrow(f);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<U>((bits >> 16) | 0x0040u);
    return static_cast<U>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  }
};

// float16 by bit arithmetic (the host's; the device build uses __float2half_rn and __half2float).
struct F16Host {
  using U = uint16_t;
  static float widen(U h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t man = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0x1Fu) {
      bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
      bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      bits = sign | ((112u - e) << 23) | ((man & 0x3FFu) << 13);
    }
    return F32::widen(bits);
  }
  static U narrow(float f) {
    const uint32_t bits = F32::narrow(f);
    const uint32_t sign = (bits >> 16) & 0x8000u;
    const uint32_t abs = bits & 0x7FFFFFFFu;
    if (abs > 0x7F800000u) return static_cast<U>(sign | 0x7E00u);  // NaN: torch's CPU conversion's
    if (abs >= 0x477FF000u) return static_cast<U>(sign | 0x7C00u);  // rounds to or past 65520: Inf
    if (abs < 0x38800000u) {  // below 2^-14: a subnormal half (or 0), rounded to nearest even
      if (abs < 0x33000000u) return static_cast<U>(sign);  // at most 2^-25: rounds to 0
      const uint32_t exp = abs >> 23;
      const uint32_t man = (abs & 0x7FFFFFu) | 0x800000u;
      const uint32_t shift = 126u - exp;  // man * 2^(exp - 150) in units of 2^-24
      const uint32_t q = man >> shift;
      const uint32_t rem = man & ((1u << shift) - 1u);
      const uint32_t half = 1u << (shift - 1);
      return static_cast<U>(sign | (q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u)));
    }
    const uint32_t rebased = abs - (112u << 23);  // exponent rebased to half's bias
    const uint32_t q = rebased >> 13;
    const uint32_t rem = rebased & 0x1FFFu;
    return static_cast<U>(sign | (q + ((rem > 0x1000u || (rem == 0x1000u && (q & 1u))) ? 1u : 0u)));
  }
};

// Block b of the tensor x as row (its place among `row`'s set blocks) - lo of `out`, when `row` has
// it and lo <= place < hi; the short last block padded with +0, and a block that `mask` (if not null)
// lacks written as +0. The elements lane, lane + lanes, ... of the block are this call's.
template <class T>
OMR_HD void rows_block(const typename T::U* x, int64_t numel, int64_t B, const uint8_t* row, const int32_t* prefix,
                       const uint8_t* mask, int64_t lo, int64_t hi, typename T::U* out, int64_t b, int lane,
                       int lanes) {
  if (!bit(row, b)) return;
  const int64_t p = position(row, prefix, b);
  if (p < lo || p >= hi) return;
  typename T::U* dst = out + (p - lo) * B;
  const int64_t len = (mask == nullptr || bit(mask, b)) ? block_len(b, B, numel) : 0;
  for (int64_t e = lane; e < B; e += lanes) dst[e] = e < len ? x[b * B + e] : typename T::U(0);
}

// Where the rows a block is summed from live: source s's row p is first[s * first_stride + p * B ...]
// for p < cap, else rest[s * rest_stride + (p - cap) * B ...] (strides in elements).
template <class U>
struct Sources {
  const U* first;
  int64_t first_stride;
  int64_t cap;
  const U* rest;
  int64_t rest_stride;
};

// Block b of x = the sum of its rows over sources s = 0 .. nsrc - 1 (bitmap row src_row + s of `bits`),
// when bitmap row `target` has it (see the top for the sum's rounding). Elements lane, lane + lanes, ...
template <class T>
OMR_HD void sum_block(typename T::U* x, int64_t numel, int64_t B, const uint8_t* bits, const int32_t* prefix,
                      int64_t nbytes, int target, int src_row, int nsrc, Sources<typename T::U> in, float scale,
                      int64_t b, int lane, int lanes) {
  using U = typename T::U;
  if (!bit(bits + target * nbytes, b)) return;
  const int64_t len = block_len(b, B, numel);
  for (int64_t e = lane; e < len; e += lanes) {
    float acc = -0.0f;
    for (int s = 0; s < nsrc; ++s) {
      const int64_t r = src_row + s;
      const uint8_t* row = bits + r * nbytes;
      if (!bit(row, b)) continue;
      const int64_t p = position(row, prefix + r * nbytes, b);
      const U* src = p < in.cap ? in.first + s * in.first_stride + p * B : in.rest + s * in.rest_stride + (p - in.cap) * B;
      acc += T::widen(src[e]);
    }
    U u = T::narrow(acc);
    if (scale != 1.0f) u = T::narrow(T::widen(u) * scale);
    x[b * B + e] = u;
  }
}

}  // namespace omr_steps

#endif  // OMNIREDUCE_EXCHANGE_STEPS_H_
