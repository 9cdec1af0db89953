// The two deploykit ops as ONNX Runtime kernels (specs: docs/ops.md). Each validates shapes
// and types, then calls the C ABI in csrc/kernels on the CPU or on ORT's CUDA compute stream.
#pragma once

#include "common.h"

namespace dk_ort {

class FusedBatchNormKernel : public KernelBase<FusedBatchNormKernel> {
 public:
  static constexpr const char* kName = "FusedBatchNorm";
  static constexpr size_t kInputCount = 3;  // X, scale, bias
  static bool IsOptionalInput(size_t) { return false; }

  FusedBatchNormKernel(const Ort::ConstKernelInfo& info, OpConfig config);
  void Compute(Ort::KernelContext& ctx) const;

 private:
  OpConfig config_;
  dk_activation activation_;
};

class MatMulReluKernel : public KernelBase<MatMulReluKernel> {
 public:
  static constexpr const char* kName = "MatMulRelu";
  static constexpr size_t kInputCount = 3;  // A, B, optional bias
  static bool IsOptionalInput(size_t index) { return index == 2; }

  MatMulReluKernel(const Ort::ConstKernelInfo& info, OpConfig config);
  void Compute(Ort::KernelContext& ctx) const;

 private:
  void RunCuda(Ort::KernelContext& ctx, const Ort::ConstValue& a, const void* bias, void* y,
               int64_t m, int64_t k, int64_t n) const;
  OpConfig config_;
};

}  // namespace dk_ort
