/*
 * deploykit kernels: a plain C ABI shared by the ONNX Runtime custom-op library and the
 * TensorRT plugins. No framework types cross this boundary: tensors are raw pointers to
 * contiguous row-major memory, streams are opaque cudaStream_t values passed as void*.
 * Every function returns DK_OK or an error code; dk_status_string() describes it.
 * Specs of the ops: docs/ops.md.
 */
#ifndef DEPLOYKIT_KERNELS_H
#define DEPLOYKIT_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define DK_API __declspec(dllexport)
#else
#define DK_API __attribute__((visibility("default")))
#endif

typedef enum dk_status {
  DK_OK = 0,
  DK_INVALID_ARGUMENT = 1,  /* bad shape, null pointer, unsupported dtype */
  DK_CUDA_ERROR = 2,        /* a CUDA runtime call or launch failed */
  DK_CUBLAS_ERROR = 3,      /* a cuBLASLt call failed */
  DK_NOT_COMPILED = 4       /* this build has no CUDA support */
} dk_status;

typedef enum dk_dtype {
  DK_FLOAT32 = 0,
  DK_FLOAT16 = 1,
  DK_BFLOAT16 = 2,
  DK_FLOAT64 = 3 /* BatchNorm training kernels only (see "BatchNorm for training" below) */
} dk_dtype;

typedef enum dk_activation { DK_ACTIVATION_NONE = 0, DK_ACTIVATION_RELU = 1 } dk_activation;

DK_API const char* dk_status_string(dk_status status);

/*
 * FusedBatchNorm: y[n, c, s] = act(x[n, c, s] * scale[c] + bias[c]).
 * x, y: (batch, channels, spatial) contiguous, `spatial` = product of the dims after the
 * channel axis (1 for 2-D inputs). scale, bias: (channels,), same dtype as x.
 * Computes in fp32; fp16/bf16 are rounded once on store. x and y may alias.
 */
DK_API dk_status dk_fused_batch_norm_cpu(dk_dtype dtype, const void* x, const void* scale,
                                         const void* bias, void* y, int64_t batch,
                                         int64_t channels, int64_t spatial,
                                         dk_activation activation);
DK_API dk_status dk_fused_batch_norm_cuda(dk_dtype dtype, const void* x, const void* scale,
                                          const void* bias, void* y, int64_t batch,
                                          int64_t channels, int64_t spatial,
                                          dk_activation activation, void* stream);

/*
 * MatMulRelu: y[m, n] = max(sum_k a[m, k] * b[k, n] + bias[n], 0).
 * a: (m, k), b: (k, n), y: (m, n), all row-major and contiguous; bias: (n,) or NULL.
 * Leading batch dimensions of the op's A are flattened into m by the caller.
 * Accumulates in fp32. allow_tf32 lets fp32 inputs use TF32 tensor cores (CUDA only).
 */
DK_API dk_status dk_matmul_relu_cpu(dk_dtype dtype, const void* a, const void* b,
                                    const void* bias, void* y, int64_t m, int64_t k,
                                    int64_t n);
DK_API dk_status dk_matmul_relu_cuda(dk_dtype dtype, const void* a, const void* b,
                                     const void* bias, void* y, int64_t m, int64_t k,
                                     int64_t n, int allow_tf32, void* workspace,
                                     size_t workspace_bytes, void* stream);
/* Workspace the CUDA MatMulRelu may use (cuBLASLt); callers may pass less, even 0. */
DK_API size_t dk_matmul_relu_cuda_workspace_bytes(void);
/*
 * The CUDA MatMulRelu runs cuBLASLt (epilogue RELU; a bias enters as a broadcast C matrix with
 * beta = 1, so it is added in fp32 before the single rounding) when it can, else a plain tiled
 * CUDA kernel (also used when cuBLASLt has no algorithm for the shape or alignment). cuBLASLt is
 * not linked: it is loaded with dlopen on first use, from $DEPLOYKIT_CUBLASLT_LIB if set, else
 * "libcublasLt.so.13", else "libcublasLt.so". DEPLOYKIT_DISABLE_CUBLASLT=1 (read once, at that
 * first use) keeps it unloaded, so every call runs the fallback kernel.
 */

/* ---- BatchNorm for training (CUDA): batch statistics, running statistics, backward. ----
 *
 * Tensors x, y, dy, dx: (batch, channels, spatial) contiguous (NCHW with spatial = H * W, or
 * any rank: spatial = product of the dims after the channel axis), dtype `dtype`; storage may
 * start at any element (no 16-byte alignment needed). Per-channel vectors (weight, bias,
 * running_mean, running_var, save_mean, save_invstd, dweight, dbias) are float32, or float64
 * when dtype is DK_FLOAT64. weight / bias may be NULL (1 / 0); so may running_mean / running_var
 * (not updated) and dx, dweight, dbias (not computed).
 *
 * Every call takes a workspace of at least dk_batch_norm_workspace_bytes() bytes, 16-byte
 * aligned, on the current device (its size depends on the shape and the device's number of
 * multiprocessors). The kernels neither allocate nor synchronize: the calls can be captured in
 * a CUDA graph. One workspace must not be used by two calls that may run concurrently.
 */

/* Workspace bytes the calls below need for this shape on the current device; 0 if invalid. */
DK_API size_t dk_batch_norm_workspace_bytes(dk_dtype dtype, int64_t batch, int64_t channels,
                                            int64_t spatial);

/*
 * Training forward. Per channel: mean and biased variance over (batch, spatial) (Welford /
 * Chan merges, no sum-of-squares cancellation); y = (x - mean) * invstd * weight + bias with
 * invstd = 1 / sqrt(var + eps); save_mean = mean, save_invstd = invstd;
 * running_mean = (1 - momentum) * running_mean + momentum * mean and
 * running_var = (1 - momentum) * running_var + momentum * var * n / (n - 1), n = batch * spatial,
 * as torch.nn.functional.batch_norm(training=True). DK_INVALID_ARGUMENT when n < 2.
 * x and y must not overlap unless equal.
 */
DK_API dk_status dk_batch_norm_train_forward_cuda(
    dk_dtype dtype, const void* x, const void* weight, const void* bias, void* running_mean,
    void* running_var, double momentum, double eps, void* y, void* save_mean, void* save_invstd,
    void* workspace, size_t workspace_bytes, int64_t batch, int64_t channels, int64_t spatial,
    void* stream);

/*
 * Forward from running statistics: y = (x - running_mean) / sqrt(running_var + eps) * weight
 * + bias. fold != 0 (float32 / float16 / bfloat16): scale and bias are folded into x's dtype and
 * dk_fused_batch_norm_cuda runs (what an exported model with FusedBatchNorm computes: x * scale
 * + bias, which loses digits when |mean| >> std). fold == 0, and always for float64: the
 * unfolded form (x - mean) * scale + bias in fp32 (fp64).
 */
DK_API dk_status dk_batch_norm_eval_forward_cuda(
    dk_dtype dtype, const void* x, const void* weight, const void* bias, const void* running_mean,
    const void* running_var, double eps, void* y, int fold, void* workspace,
    size_t workspace_bytes, int64_t batch, int64_t channels, int64_t spatial, void* stream);

/*
 * Backward of either forward. mean / invstd: save_mean / save_invstd of the training forward
 * (training != 0), or running_mean and 1 / sqrt(running_var + eps) (training == 0).
 * dbias = sum(dy), dweight = sum(dy * (x - mean) * invstd) per channel;
 * training: dx = weight * invstd * (dy - mean(dy) - (x - mean) * invstd^2 * mean(dy * (x - mean)));
 * else dx = weight * invstd * dy (x is not read unless dweight or dbias is asked for).
 * dx must not overlap dy or x.
 */
DK_API dk_status dk_batch_norm_backward_cuda(
    dk_dtype dtype, const void* dy, const void* x, const void* weight, const void* mean,
    const void* invstd, void* dx, void* dweight, void* dbias, void* workspace,
    size_t workspace_bytes, int64_t batch, int64_t channels, int64_t spatial, int training,
    void* stream);
/* ---- end of BatchNorm for training ---- */

/* ---- Diagnostics: not needed to run the ops; for tests and troubleshooting. ---- */

/* Path taken by the calling thread's last successful dk_matmul_relu_cuda: 0 = cuBLASLt,
 * 1 = fallback kernel, -1 = none yet (or a build without CUDA). */
DK_API int dk_matmul_relu_cuda_last_path(void);
/* 1 if cuBLASLt is loaded and usable (attempts the load on first call), else 0. */
DK_API int dk_cublaslt_available(void);
/* force != 0: every later dk_matmul_relu_cuda (any thread) runs the fallback kernel; 0 undoes. */
DK_API void dk_matmul_relu_cuda_force_fallback(int force);

#ifdef __cplusplus
}
#endif

#endif /* DEPLOYKIT_KERNELS_H */
