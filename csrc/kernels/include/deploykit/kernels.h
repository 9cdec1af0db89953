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

typedef enum dk_dtype { DK_FLOAT32 = 0, DK_FLOAT16 = 1, DK_BFLOAT16 = 2 } dk_dtype;

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
