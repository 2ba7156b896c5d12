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
}
