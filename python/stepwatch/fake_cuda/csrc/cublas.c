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

#ifndef FAKE_CUBLASLT
#include <cublas_v2.h>

EXPORT cublasStatus_t cublasCreate_v2(cublasHandle_t *h) {
  if (!h) return CUBLAS_STATUS_INVALID_VALUE;
  *h = (cublasHandle_t)new_handle();
  return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasDestroy_v2(cublasHandle_t h) {
  free(h);
  return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasGetMathMode(cublasHandle_t h, cublasMath_t *mode) {
  (void)h;
  if (mode) *mode = CUBLAS_DEFAULT_MATH;
  return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasGetPointerMode_v2(cublasHandle_t h, cublasPointerMode_t *mode) {
  (void)h;
  if (mode) *mode = CUBLAS_POINTER_MODE_HOST;
  return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasGetStream_v2(cublasHandle_t h, cudaStream_t *s) {
  (void)h;
  if (s) *s = NULL;
  return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasGetEmulationSpecialValuesSupport(cublasHandle_t h,
                                                             cudaEmulationSpecialValuesSupport *m) {
  (void)h;
  if (m) memset(m, 0, sizeof *m);
  return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasGetFixedPointEmulationMantissaControl(cublasHandle_t h,
                                                                  cudaEmulationMantissaControl *c) {
  (void)h;
  if (c) memset(c, 0, sizeof *c);
  return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasGetFixedPointEmulationMaxMantissaBitCount(cublasHandle_t h, int *n) {
  (void)h;
  if (n) *n = 0;
  return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasGetFixedPointEmulationMantissaBitOffset(cublasHandle_t h, int *n) {
  (void)h;
  if (n) *n = 0;
  return CUBLAS_STATUS_SUCCESS;
}

#else
#include <cublasLt.h>

EXPORT size_t cublasLtGetVersion(void) { return CUBLAS_VERSION; }

EXPORT cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) {
  if (!h) return CUBLAS_STATUS_INVALID_VALUE;
  *h = (cublasLtHandle_t)new_handle();
  return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
  free(h);
  return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t c,
                                               cudaDataType_t s) {
  (void)c;
  (void)s;
  if (!d) return CUBLAS_STATUS_INVALID_VALUE;
  *d = (cublasLtMatmulDesc_t)new_handle();
  return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  free(d);
  return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType t,
                                                 uint64_t rows, uint64_t cols, int64_t ld) {
  (void)t;
  (void)rows;
  (void)cols;
  (void)ld;
  if (!l) return CUBLAS_STATUS_INVALID_VALUE;
  *l = (cublasLtMatrixLayout_t)new_handle();
  return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasLtMatrixLayoutDestroy(const cublasLtMatrixLayout_t l) {
  free(l);
  return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p) {
  if (!p) return CUBLAS_STATUS_INVALID_VALUE;
  *p = (cublasLtMatmulPreference_t)new_handle();
  return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  free(p);
  return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasLtMatmulAlgoGetHeuristic(
    cublasLtHandle_t h, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
    cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
    cublasLtMatmulPreference_t pref, int requested, cublasLtMatmulHeuristicResult_t results[],
    int *returned) {
  (void)h; (void)op; (void)a; (void)b; (void)c; (void)d; (void)pref;
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
  (void)h; (void)op; (void)a; (void)b; (void)c; (void)d;
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
  (void)algo;
  (void)attr;
  if (buf) memset(buf, 0, size);
  if (written) *written = size;
  return CUBLAS_STATUS_SUCCESS;
}
#endif
