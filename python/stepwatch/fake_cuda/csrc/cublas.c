/*
 * fake libcublas.so.13 and libcublasLt.so.13 (one source, built twice with
 * -DFAKE_CUBLASLT for the second): handles are non-null, math does nothing,
 * and cuBLASLt's heuristic offers one algorithm with no workspace, or PyTorch
 * throws. Getters write a default so callers never read garbage. Everything
 * else is a generated stub that returns CUBLAS_STATUS_SUCCESS (build.py).
 */
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

static void *new_handle(void) { return calloc(1, 64); }

/* A handle type's Destroy, and its Create when that takes no settings. */
#define HANDLE_DESTROY(destroy, type)                                    \
  EXPORT cublasStatus_t destroy(type h) {                                \
    free(h);                                                             \
    return CUBLAS_STATUS_SUCCESS;                                        \
  }
#define HANDLE_CREATE_DESTROY(create, destroy, type)                     \
  EXPORT cublasStatus_t create(type *h) {                                \
    if (!h) return CUBLAS_STATUS_INVALID_VALUE;                          \
    *h = (type)new_handle();                                             \
    return CUBLAS_STATUS_SUCCESS;                                        \
  }                                                                      \
  HANDLE_DESTROY(destroy, type)

#ifndef FAKE_CUBLASLT
#include <cublas_v2.h>

HANDLE_CREATE_DESTROY(cublasCreate_v2, cublasDestroy_v2, cublasHandle_t)

/* A handle's setting: `value` is written to the one out-parameter. */
#define GETTER(name, type, value)                                        \
  EXPORT cublasStatus_t name(cublasHandle_t h, type *out) {              \
    if (out) *out = (value);                                             \
    return CUBLAS_STATUS_SUCCESS;                                        \
  }

GETTER(cublasGetMathMode, cublasMath_t, CUBLAS_DEFAULT_MATH)
GETTER(cublasGetPointerMode_v2, cublasPointerMode_t, CUBLAS_POINTER_MODE_HOST)
GETTER(cublasGetStream_v2, cudaStream_t, NULL)
GETTER(cublasGetEmulationSpecialValuesSupport, cudaEmulationSpecialValuesSupport,
       (cudaEmulationSpecialValuesSupport){0})
GETTER(cublasGetFixedPointEmulationMantissaControl, cudaEmulationMantissaControl,
       (cudaEmulationMantissaControl){0})
GETTER(cublasGetFixedPointEmulationMaxMantissaBitCount, int, 0)
GETTER(cublasGetFixedPointEmulationMantissaBitOffset, int, 0)

#else
#include <cublasLt.h>

EXPORT size_t cublasLtGetVersion(void) { return CUBLAS_VERSION; }

HANDLE_CREATE_DESTROY(cublasLtCreate, cublasLtDestroy, cublasLtHandle_t)

EXPORT cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t c,
                                               cudaDataType_t s) {
  if (!d) return CUBLAS_STATUS_INVALID_VALUE;
  *d = (cublasLtMatmulDesc_t)new_handle();
  return CUBLAS_STATUS_SUCCESS;
}

HANDLE_DESTROY(cublasLtMatmulDescDestroy, cublasLtMatmulDesc_t)

EXPORT cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType t,
                                                 uint64_t rows, uint64_t cols, int64_t ld) {
  if (!l) return CUBLAS_STATUS_INVALID_VALUE;
  *l = (cublasLtMatrixLayout_t)new_handle();
  return CUBLAS_STATUS_SUCCESS;
}

HANDLE_DESTROY(cublasLtMatrixLayoutDestroy, cublasLtMatrixLayout_t)

HANDLE_CREATE_DESTROY(cublasLtMatmulPreferenceCreate, cublasLtMatmulPreferenceDestroy,
                      cublasLtMatmulPreference_t)

EXPORT cublasStatus_t cublasLtMatmulAlgoGetHeuristic(
    cublasLtHandle_t h, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
    cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
    cublasLtMatmulPreference_t pref, int requested, cublasLtMatmulHeuristicResult_t results[],
    int *returned) {
  if (!returned || (requested > 0 && !results)) return CUBLAS_STATUS_INVALID_VALUE;
  *returned = 0;
  if (requested > 0) {
    memset(&results[0], 0, sizeof results[0]);
    results[0].workspaceSize = 0;
    results[0].state = CUBLAS_STATUS_SUCCESS;
    results[0].wavesCount = 1.0f;
    *returned = 1;
  }
  return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasLtMatmulAlgoCheck(cublasLtHandle_t h, cublasLtMatmulDesc_t op,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              const cublasLtMatmulAlgo_t *algo,
                                              cublasLtMatmulHeuristicResult_t *result) {
  if (!result) return CUBLAS_STATUS_INVALID_VALUE;
  memset(result, 0, sizeof *result);
  if (algo) result->algo = *algo;
  result->state = CUBLAS_STATUS_SUCCESS;
  result->wavesCount = 1.0f;
  return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasLtMatmulAlgoConfigGetAttribute(const cublasLtMatmulAlgo_t *algo,
                                                           cublasLtMatmulAlgoConfigAttributes_t attr,
                                                           void *buf, size_t size, size_t *written) {
  if (buf) memset(buf, 0, size);
  if (written) *written = size;
  return CUBLAS_STATUS_SUCCESS;
}
#endif
