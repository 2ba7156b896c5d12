// The collective engine's kernel exchange (csrc/exchange.cu) run on the host: the same steps
// (csrc/exchange_steps.h) in loops instead of grids, behind C functions that tests/exchange_host.py
// calls through ctypes. A test build only: it lets machines without a GPU check the kernels' steps.

#include <stdint.h>

#include "exchange_steps.h"

using namespace omr_steps;

namespace {

enum { F32_CODE = 1, F16_CODE = 2, BF16_CODE = 3 };  // block_sparse.h's wire codes

struct PlainAdd {
  int64_t* counts;
  void operator()(int i, int v) { counts[i] += v; }
};

template <class T>
void rows(const void* x, int64_t numel, int64_t B, const uint8_t* bitmap, const int32_t* prefix, const uint8_t* mask,
          int64_t lo, int64_t hi, void* out) {
  using U = typename T::U;
  const int64_t nb = (numel + B - 1) / B;
  for (int64_t b = 0; b < nb; ++b) {
    rows_block<T>(static_cast<const U*>(x), numel, B, bitmap, prefix, mask, lo, hi, static_cast<U*>(out), b, 0, 1);
  }
}

template <class T>
void sums(void* x, int64_t numel, int64_t B, const uint8_t* bits, const int32_t* prefix, int64_t nbytes, int target,
          int src_row, int nsrc, const void* first, int64_t first_stride, int64_t cap, const void* rest,
          int64_t rest_stride, float scale) {
  using U = typename T::U;
  const int64_t nb = (numel + B - 1) / B;
  const Sources<U> in{static_cast<const U*>(first), first_stride, cap, static_cast<const U*>(rest), rest_stride};
  for (int64_t b = 0; b < nb; ++b) {
    sum_block<T>(static_cast<U*>(x), numel, B, bits, prefix, nbytes, target, src_row, nsrc, in, scale, b, 0, 1);
  }
}

}  // namespace

extern "C" {

void host_pack(const uint8_t* flags, int64_t nb, uint8_t* bitmap) {
  for (int64_t j = 0; j < (nb + 7) / 8; ++j) bitmap[j] = pack_byte(flags, nb, j);
}

void host_scan(const uint8_t* bytes, int64_t n, int32_t* prefix) {
  int32_t at = 0;
  for (int64_t i = 0; i <= n; ++i) {
    prefix[i] = at;
    if (i < n) at += popcount(bytes[i]);
  }
}

void host_rows(const void* x, int64_t numel, int64_t B, int dtype, const uint8_t* bitmap, const int32_t* prefix,
               const uint8_t* mask, int64_t lo, int64_t hi, void* out) {
  if (dtype == F32_CODE) rows<F32>(x, numel, B, bitmap, prefix, mask, lo, hi, out);
  if (dtype == F16_CODE) rows<F16Host>(x, numel, B, bitmap, prefix, mask, lo, hi, out);
  if (dtype == BF16_CODE) rows<BF16>(x, numel, B, bitmap, prefix, mask, lo, hi, out);
}

void host_counts(const uint8_t* src, int64_t stride, int W, int64_t nb, int64_t lanes, int pairs, uint8_t* bits,
                 int64_t* counts) {
  const int64_t nbytes = (nb + 7) / 8;
  for (int i = 0; i < counts_len(W, pairs != 0); ++i) counts[i] = 0;
  PlainAdd add{counts};
  for (int64_t j = 0; j < nbytes; ++j) count_byte(src, stride, W, nbytes, nb, lanes, pairs != 0, bits, j, add);
}

void host_sum_blocks(void* x, int64_t numel, int64_t B, int dtype, const uint8_t* bits, const int32_t* prefix,
                     int64_t nbytes, int target, int src_row, int nsrc, const void* first, int64_t first_stride,
                     int64_t cap, const void* rest, int64_t rest_stride, float scale) {
  if (dtype == F32_CODE) sums<F32>(x, numel, B, bits, prefix, nbytes, target, src_row, nsrc, first, first_stride, cap, rest, rest_stride, scale);
  if (dtype == F16_CODE) sums<F16Host>(x, numel, B, bits, prefix, nbytes, target, src_row, nsrc, first, first_stride, cap, rest, rest_stride, scale);
  if (dtype == BF16_CODE) sums<BF16>(x, numel, B, bits, prefix, nbytes, target, src_row, nsrc, first, first_stride, cap, rest, rest_stride, scale);
}

// host_sum_blocks, writing nothing unless each of the first nsrc counts is at most limit (the guard the CUDA
// kernel checks before it writes).
void host_sum_blocks_within(void* x, int64_t numel, int64_t B, int dtype, const uint8_t* bits, const int32_t* prefix,
                            int64_t nbytes, int target, int src_row, int nsrc, const void* first, int64_t first_stride,
                            int64_t cap, const void* rest, int64_t rest_stride, float scale, const int64_t* counts,
                            int64_t limit) {
  if (!within(counts, nsrc, limit)) return;
  host_sum_blocks(x, numel, B, dtype, bits, prefix, nbytes, target, src_row, nsrc, first, first_stride, cap, rest,
                  rest_stride, scale);
}

}  // extern "C"
