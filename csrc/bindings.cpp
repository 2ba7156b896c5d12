// torch bindings of the block-sparsity launchers (block_sparse.h): torch::Tensor in, kernels on the
// current CUDA stream of the tensor's device. Compiled only on machines with a CUDA build of torch, by
// omnireduce/cuda_kernels.py through torch.utils.cpp_extension.load.
//
// Scratch memory (flags, CUB workspace, candidate indices) comes from torch's caching allocator, so no
// call reaches cudaMalloc once the allocator holds blocks of these sizes; it is returned to the cache
// stream-ordered at the end of each call. compact() synchronises the stream once, to learn k.
//
// Every binding runs without the GIL (py::call_guard<py::gil_scoped_release>): pybind11 converts the
// arguments before releasing it and the results after taking it back, and in between only torch's C++
// API and the CUDA runtime are used, neither of which needs it. So compact()'s stream synchronisation
// never blocks the other Python threads (DDP's autograd thread, data loaders, the main thread).
//
// CUDA errors: an error left pending on this host thread by earlier, unrelated work (a kernel launch
// nobody checked) is reported as such before anything is launched (check_no_pending_error), so that an
// error reported after a launch is that launch's own (see block_sparse.h).

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <limits>
#include <string>
#include <tuple>

#include "block_sparse.h"
#include "exchange.h"

namespace {

// Integers in error messages are formatted here, never streamed by c10::str: on an H200 machine
// (torch 2.11.0+cu130, the extension built by that machine's g++) streaming an int64 through the
// ostringstream c10::str builds in this library crashed the process (SIGSEGV inside
// basic_ostream::_M_insert<long>, instantiated in this .so), where strings streamed fine.
std::string num(int64_t v) { return std::to_string(v); }

int dtype_code(const torch::Tensor& x) {
  switch (x.scalar_type()) {
    case torch::kFloat32: return OMR_FLOAT32;
    case torch::kFloat16: return OMR_FLOAT16;
    case torch::kBFloat16: return OMR_BFLOAT16;
    default: TORCH_CHECK(false, "omnireduce: float32, float16 or bfloat16 tensor expected, got ", x.scalar_type());
  }
  return 0;
}

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "omnireduce: ", what, " failed: ", cudaGetErrorName(err), ": ",
              cudaGetErrorString(err));
}

// Raises if an error from earlier CUDA work is pending on this thread, naming it as such, and clears it
// (so it is reported once; a sticky error stays, but then every CUDA call fails and says so).
void check_no_pending_error(const char* before) {
  const cudaError_t err = cudaPeekAtLastError();
  if (err == cudaSuccess) return;
  (void)cudaGetLastError();
  TORCH_CHECK(false, "omnireduce: a CUDA error from earlier work was pending before ", before,
              " (not raised by omnireduce: some earlier kernel launch or CUDA call went unchecked): ",
              cudaGetErrorName(err), ": ", cudaGetErrorString(err));
}

void check_input(const torch::Tensor& x, int64_t block_size) {
  TORCH_CHECK(x.is_cuda(), "omnireduce: CUDA tensor expected");
  TORCH_CHECK(x.is_contiguous(), "omnireduce: contiguous tensor expected");
  TORCH_CHECK(block_size >= 1, "omnireduce: block_size must be >= 1, got ", num(block_size));
  dtype_code(x);
}

int64_t num_blocks(int64_t numel, int64_t block_size) { return (numel + block_size - 1) / block_size; }

constexpr int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

// The threshold as float32, rounded to nearest like numpy's float32(t) (no UB for huge values);
// <= 0 selects exact mode.
float threshold_f32(double threshold) {
  if (!(threshold > 0.0)) return 0.0f;
  if (threshold >= 0x1.ffffffp127) return std::numeric_limits<float>::infinity();  // rounds up past FLT_MAX
  return static_cast<float>(threshold);
}

torch::Tensor block_flags(const torch::Tensor& x, int64_t block_size, double threshold) {
  check_input(x, block_size);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t nb = num_blocks(x.numel(), block_size);
  auto flags = torch::empty({nb}, x.options().dtype(torch::kBool));
  if (nb == 0) return flags;
  const float t = threshold_f32(threshold);
  check_no_pending_error("omr_block_flags");
  check_cuda(omr_block_flags(x.data_ptr(), x.numel(), block_size, dtype_code(x), t,
                             static_cast<uint8_t*>(flags.data_ptr()), c10::cuda::getCurrentCUDAStream()),
             "omr_block_flags");
  return flags;
}

std::tuple<torch::Tensor, torch::Tensor> compact(const torch::Tensor& x, int64_t block_size, double threshold) {
  check_input(x, block_size);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  const int64_t nb = num_blocks(n, block_size);
  const auto long_opts = x.options().dtype(torch::kInt64);
  if (nb == 0) return {torch::empty({0}, long_opts), torch::empty({0, block_size}, x.options())};
  TORCH_CHECK(nb <= INT32_MAX, "omnireduce: compact supports at most 2^31-1 blocks, got ", num(nb));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int code = dtype_code(x);
  const float t = threshold_f32(threshold);

  // One scratch buffer: [candidate indices: nb int64][count: int64][flags: nb bytes][CUB workspace].
  // The count comes back through pinned memory (torch's caching host allocator): a copy into pageable
  // memory is staged and waits for the device inside cudaMemcpyAsync, ~10 us on an H200.
  check_no_pending_error("compact");
  size_t cub_bytes = 0;
  check_cuda(omr_select_workspace_bytes(nb, &cub_bytes), "omr_select_workspace_bytes");
  const int64_t off_count = nb * 8;
  const int64_t off_flags = off_count + 8;
  const int64_t off_cub = round_up(off_flags + nb, 256);
  auto scratch = torch::empty({off_cub + static_cast<int64_t>(cub_bytes)}, x.options().dtype(torch::kUInt8));
  uint8_t* base = scratch.data_ptr<uint8_t>();
  auto* cand = reinterpret_cast<int64_t*>(base);
  auto* count = reinterpret_cast<int64_t*>(base + off_count);
  auto host_count = torch::empty({1}, torch::TensorOptions().dtype(torch::kInt64).pinned_memory(true));
  int64_t* k_host = host_count.data_ptr<int64_t>();

  check_cuda(omr_flags_and_select(x.data_ptr(), n, block_size, code, t, base + off_flags, cand, count, base + off_cub,
                                  cub_bytes, stream),
             "omr_flags_and_select");
  check_cuda(cudaMemcpyAsync(k_host, count, sizeof(int64_t), cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  const int64_t k = *k_host;
  TORCH_CHECK(k >= 0 && k <= nb, "omnireduce: bad non-zero block count ", num(k), " of ", num(nb));

  auto indices = torch::empty({k}, long_opts);
  auto blocks = torch::empty({k, block_size}, x.options());
  if (k > 0) {  // (nothing else ran on this thread since the check above)
    check_cuda(omr_gather_blocks(x.data_ptr(), n, block_size, code, cand, k, blocks.data_ptr(),
                                 indices.data_ptr<int64_t>(), stream),
               "omr_gather_blocks");
  }
  return {indices, blocks};
}

void scatter(torch::Tensor x, const torch::Tensor& indices, const torch::Tensor& blocks, double scale) {
  TORCH_CHECK(blocks.dim() == 2, "omnireduce: blocks must be 2-D (k, block_size)");
  const int64_t block_size = blocks.size(1);
  check_input(x, block_size);
  TORCH_CHECK(blocks.is_cuda() && blocks.device() == x.device(), "omnireduce: blocks must be on ", x.device());
  TORCH_CHECK(indices.is_cuda() && indices.device() == x.device(), "omnireduce: indices must be on ", x.device());
  TORCH_CHECK(blocks.scalar_type() == x.scalar_type(), "omnireduce: blocks are ", blocks.scalar_type(),
              ", tensor is ", x.scalar_type());
  TORCH_CHECK(blocks.is_contiguous(), "omnireduce: blocks must be contiguous");
  TORCH_CHECK(indices.scalar_type() == torch::kInt64 && indices.dim() == 1 && indices.is_contiguous(),
              "omnireduce: indices must be a contiguous 1-D int64 tensor");
  const int64_t k = indices.size(0);
  TORCH_CHECK(blocks.size(0) == k, "omnireduce: ", num(k), " indices but ", num(blocks.size(0)), " blocks");
  if (k == 0 || x.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  check_no_pending_error("omr_scatter_blocks");
  check_cuda(omr_scatter_blocks(x.data_ptr(), x.numel(), block_size, dtype_code(x), indices.data_ptr<int64_t>(), k,
                                blocks.data_ptr(), static_cast<float>(scale), c10::cuda::getCurrentCUDAStream()),
             "omr_scatter_blocks");
}

// --- the collective engine's kernel exchange (exchange.h) ------------------------------------------

void check_bytes(const torch::Tensor& t, const torch::Tensor& x, const char* what) {
  TORCH_CHECK(t.is_cuda() && t.device() == x.device(), "omnireduce: ", what, " must be on ", x.device());
  TORCH_CHECK(t.scalar_type() == torch::kUInt8 && t.is_contiguous(), "omnireduce: ", what,
              " must be a contiguous uint8 tensor");
}

void check_ints(const torch::Tensor& t, const torch::Tensor& x, int64_t at_least, const char* what) {
  TORCH_CHECK(t.is_cuda() && t.device() == x.device(), "omnireduce: ", what, " must be on ", x.device());
  TORCH_CHECK(t.scalar_type() == torch::kInt32 && t.is_contiguous() && t.numel() >= at_least, "omnireduce: ", what,
              " must be a contiguous int32 tensor of at least ", num(at_least), " entries");
}

// Rows of x's dtype and block_size columns (a [n, block_size] or [s, n, block_size] tensor whose rows
// are contiguous); its source stride in elements.
int64_t check_rows(const torch::Tensor& t, const torch::Tensor& x, int64_t block_size, const char* what) {
  TORCH_CHECK(t.is_cuda() && t.device() == x.device(), "omnireduce: ", what, " must be on ", x.device());
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), "omnireduce: ", what, " are ", t.scalar_type(), ", tensor is ",
              x.scalar_type());
  TORCH_CHECK(t.dim() >= 2 && t.dim() <= 3 && t.size(-1) == block_size && t.stride(-1) == 1 &&
                  (t.size(-2) <= 1 || t.stride(-2) == block_size),
              "omnireduce: ", what, " must be [rows, ", num(block_size), "] or [sources, rows, ",
              num(block_size), "] with contiguous rows");
  return t.dim() == 3 ? t.stride(0) : 0;
}

size_t prefix_workspace(int64_t n) {
  size_t bytes = 0;
  check_cuda(omr_prefix_workspace_bytes(n, &bytes), "omr_prefix_workspace_bytes");
  return bytes;
}

torch::Tensor record(const torch::Tensor& x, int64_t block_size, double threshold, torch::Tensor out,
                     int64_t head, int64_t cap) {
  check_input(x, block_size);
  check_bytes(out, x, "the record");
  const int64_t nb = num_blocks(x.numel(), block_size);
  TORCH_CHECK(nb >= 1, "omnireduce: an empty tensor has no record");
  const int64_t nbytes = (nb + 7) / 8;
  TORCH_CHECK(cap >= 0 && head >= nbytes && head % 16 == 0 && out.data_ptr() != nullptr &&
                  reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0 &&
                  out.numel() >= head + cap * block_size * x.element_size(),
              "omnireduce: a record of ", num(out.numel()), " bytes cannot hold a bitmap of ", num(nbytes),
              " bytes and ", num(cap), " rows from byte ", num(head));
  const c10::cuda::CUDAGuard guard(x.device());
  check_no_pending_error("omr_record");
  const size_t ws_bytes = prefix_workspace(nbytes);
  auto scratch = torch::empty({round_up(nb, 256) + static_cast<int64_t>(ws_bytes)}, out.options());
  auto prefix = torch::empty({nbytes + 1}, x.options().dtype(torch::kInt32));
  uint8_t* base = scratch.data_ptr<uint8_t>();
  uint8_t* bytes = static_cast<uint8_t*>(out.data_ptr());
  check_cuda(omr_record(x.data_ptr(), x.numel(), block_size, dtype_code(x), threshold_f32(threshold), base, bytes,
                        prefix.data_ptr<int32_t>(), bytes + head, cap, base + round_up(nb, 256), ws_bytes,
                        c10::cuda::getCurrentCUDAStream()),
             "omr_record");
  return prefix;
}

void rows(const torch::Tensor& x, int64_t block_size, const torch::Tensor& bitmap, const torch::Tensor& prefix,
          const c10::optional<torch::Tensor>& mask, int64_t lo, int64_t hi, torch::Tensor out) {
  check_input(x, block_size);
  const int64_t nbytes = (num_blocks(x.numel(), block_size) + 7) / 8;
  check_bytes(bitmap, x, "the bitmap");
  check_ints(prefix, x, nbytes + 1, "the prefix sums");
  TORCH_CHECK(bitmap.numel() >= nbytes, "omnireduce: a bitmap of ", num(nbytes), " bytes expected");
  if (mask.has_value()) check_bytes(*mask, x, "the mask");
  TORCH_CHECK(0 <= lo && lo <= hi, "omnireduce: bad rows [", num(lo), ", ", num(hi), ")");
  check_rows(out, x, block_size, "the rows");
  TORCH_CHECK(out.dim() == 2 && out.size(0) >= hi - lo, "omnireduce: ", num(hi - lo), " rows expected");
  if (hi == lo) return;
  const c10::cuda::CUDAGuard guard(x.device());
  check_no_pending_error("omr_rows");
  check_cuda(omr_rows(x.data_ptr(), x.numel(), block_size, dtype_code(x), bitmap.data_ptr<uint8_t>(),
                      prefix.data_ptr<int32_t>(), mask.has_value() ? mask->data_ptr<uint8_t>() : nullptr, lo, hi,
                      out.data_ptr(), c10::cuda::getCurrentCUDAStream()),
             "omr_rows");
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> counts(const torch::Tensor& gathered, int64_t nb,
                                                               int64_t lanes, bool pairs) {
  TORCH_CHECK(gathered.is_cuda() && gathered.scalar_type() == torch::kUInt8 && gathered.dim() == 2 &&
                  gathered.stride(1) == 1,
              "omnireduce: the gathered records must be a [world, bytes] uint8 CUDA tensor with contiguous rows");
  const int64_t W = gathered.size(0);
  const int64_t nbytes = (nb + 7) / 8;
  TORCH_CHECK(nb >= 1 && lanes >= 1 && W >= 1 && gathered.size(1) >= nbytes &&
                  W * W + 2 * W + 2 <= OMR_MAX_COUNTS,
              "omnireduce: counts of ", num(nb), " blocks over ", num(W), " ranks from records of ",
              num(gathered.size(1)), " bytes");
  const c10::cuda::CUDAGuard guard(gathered.device());
  check_no_pending_error("omr_counts");
  const int64_t n = (W + 1) * nbytes;
  const size_t ws_bytes = prefix_workspace(n);
  auto bits = torch::empty({W + 1, nbytes}, gathered.options());
  auto prefix = torch::empty({n + 1}, gathered.options().dtype(torch::kInt32));
  auto out = torch::empty({W + 2 + (pairs ? W * W + W : 0)}, gathered.options().dtype(torch::kInt64));
  auto ws = torch::empty({static_cast<int64_t>(ws_bytes)}, gathered.options());
  check_cuda(omr_counts(gathered.data_ptr<uint8_t>(), gathered.stride(0), static_cast<int>(W), nb, lanes,
                        pairs ? 1 : 0, bits.data_ptr<uint8_t>(), out.data_ptr<int64_t>(), prefix.data_ptr<int32_t>(),
                        ws.data_ptr(), ws_bytes, c10::cuda::getCurrentCUDAStream()),
             "omr_counts");
  return {bits, prefix, out};
}

// The sums' arguments checked: the stride of each rows tensor, the rows `first` holds (cap), their pointers.
struct SumArgs {
  int64_t nbytes, first_stride = 0, cap = 0, rest_stride = 0;
  const void* first_ptr = nullptr;
  const void* rest_ptr = nullptr;
};

SumArgs check_sum(const torch::Tensor& x, int64_t block_size, const torch::Tensor& bits, const torch::Tensor& prefix,
                  int64_t target, int64_t src_row, int64_t nsrc, const c10::optional<torch::Tensor>& first,
                  const c10::optional<torch::Tensor>& rest) {
  check_input(x, block_size);
  SumArgs a{(num_blocks(x.numel(), block_size) + 7) / 8};
  check_bytes(bits, x, "the bitmaps");
  TORCH_CHECK(bits.dim() == 2 && bits.size(1) == a.nbytes && 0 <= target && target < bits.size(0) && 0 <= src_row &&
                  0 <= nsrc && src_row + nsrc <= bits.size(0),
              "omnireduce: bitmap rows [", num(src_row), ", ", num(src_row + nsrc), ") and ", num(target), " of ",
              num(bits.dim() == 2 ? bits.size(0) : -1), " rows of ", num(a.nbytes), " bytes");
  check_ints(prefix, x, bits.numel() + 1, "the prefix sums");
  if (first.has_value()) {
    a.first_stride = check_rows(*first, x, block_size, "the first rows");
    a.cap = first->size(-2);
    a.first_ptr = first->data_ptr();
  }
  if (rest.has_value()) {
    a.rest_stride = check_rows(*rest, x, block_size, "the other rows");
    a.rest_ptr = rest->data_ptr();
  }
  return a;
}

void sum_blocks(torch::Tensor x, int64_t block_size, const torch::Tensor& bits, const torch::Tensor& prefix,
                int64_t target, int64_t src_row, int64_t nsrc, const c10::optional<torch::Tensor>& first,
                const c10::optional<torch::Tensor>& rest, double scale) {
  const SumArgs a = check_sum(x, block_size, bits, prefix, target, src_row, nsrc, first, rest);
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  check_no_pending_error("omr_sum_blocks");
  check_cuda(omr_sum_blocks(x.data_ptr(), x.numel(), block_size, dtype_code(x), bits.data_ptr<uint8_t>(),
                            prefix.data_ptr<int32_t>(), a.nbytes, static_cast<int>(target), static_cast<int>(src_row),
                            static_cast<int>(nsrc), a.first_ptr, a.first_stride, a.cap, a.rest_ptr, a.rest_stride,
                            static_cast<float>(scale), c10::cuda::getCurrentCUDAStream()),
             "omr_sum_blocks");
}

// sum_blocks, writing nothing unless each of the first nsrc entries of `counts` (int64, on x's device, read by
// the kernel) is at most `limit`: the sums a CUDA graph enqueues before the host has read the counts.
void sum_blocks_within(torch::Tensor x, int64_t block_size, const torch::Tensor& bits, const torch::Tensor& prefix,
                       int64_t target, int64_t src_row, int64_t nsrc, const c10::optional<torch::Tensor>& first,
                       const c10::optional<torch::Tensor>& rest, double scale, const torch::Tensor& counts,
                       int64_t limit) {
  const SumArgs a = check_sum(x, block_size, bits, prefix, target, src_row, nsrc, first, rest);
  TORCH_CHECK(counts.is_cuda() && counts.device() == x.device() && counts.scalar_type() == torch::kInt64 &&
                  counts.is_contiguous() && counts.numel() >= nsrc,
              "omnireduce: the counts must be a contiguous int64 tensor on ", x.device(), " of at least ", num(nsrc),
              " entries");
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  check_no_pending_error("omr_sum_blocks_within");
  check_cuda(omr_sum_blocks_within(x.data_ptr(), x.numel(), block_size, dtype_code(x), bits.data_ptr<uint8_t>(),
                                   prefix.data_ptr<int32_t>(), a.nbytes, static_cast<int>(target),
                                   static_cast<int>(src_row), static_cast<int>(nsrc), a.first_ptr, a.first_stride,
                                   a.cap, a.rest_ptr, a.rest_stride, static_cast<float>(scale),
                                   counts.data_ptr<int64_t>(), static_cast<int>(nsrc), limit,
                                   c10::cuda::getCurrentCUDAStream()),
             "omr_sum_blocks_within");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using no_gil = py::call_guard<py::gil_scoped_release>;
  m.doc() = "omnireduce block-sparsity CUDA kernels (see omnireduce/cuda_kernels.py)";
  m.def("block_flags", &block_flags, "Per-block non-zero flags (bool, nb)", py::arg("x"), py::arg("block_size"),
        py::arg("threshold") = 0.0, no_gil());
  m.def("compact", &compact, "Indices (int64, ascending) and zero-padded (k, B) copies of the non-zero blocks",
        py::arg("x"), py::arg("block_size"), py::arg("threshold") = 0.0, no_gil());
  m.def("scatter", &scatter, "x[block indices[i]] = blocks[i] * scale, real elements only", py::arg("x"),
        py::arg("indices"), py::arg("blocks"), py::arg("scale") = 1.0, no_gil());
  m.def("record", &record, "This rank's bitmap and first rows into a record; returns the bitmap's prefix sums",
        py::arg("x"), py::arg("block_size"), py::arg("threshold"), py::arg("out"), py::arg("head"), py::arg("cap"),
        no_gil());
  m.def("rows", &rows, "Rows [lo, hi) of the blocks a bitmap has", py::arg("x"), py::arg("block_size"),
        py::arg("bitmap"), py::arg("prefix"), py::arg("mask"), py::arg("lo"), py::arg("hi"), py::arg("out"), no_gil());
  m.def("counts", &counts, "Bitmaps, their union, prefix sums and counts from gathered records",
        py::arg("gathered"), py::arg("nb"), py::arg("lanes"), py::arg("pairs"), no_gil());
  m.def("sum_blocks", &sum_blocks, "Every target block = its rows summed in source order, times scale",
        py::arg("x"), py::arg("block_size"), py::arg("bits"), py::arg("prefix"), py::arg("target"),
        py::arg("src_row"), py::arg("nsrc"), py::arg("first"), py::arg("rest"), py::arg("scale"), no_gil());
  m.def("sum_blocks_within", &sum_blocks_within,
        "sum_blocks, writing nothing unless each of the first nsrc counts is at most limit (read on the device)",
        py::arg("x"), py::arg("block_size"), py::arg("bits"), py::arg("prefix"), py::arg("target"),
        py::arg("src_row"), py::arg("nsrc"), py::arg("first"), py::arg("rest"), py::arg("scale"), py::arg("counts"),
        py::arg("limit"), no_gil());
}
