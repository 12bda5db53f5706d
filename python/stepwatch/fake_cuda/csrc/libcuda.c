/*
 * fake libcuda.so.1: the driver functions torch's NVRTC glue
 * (libcaffe2_nvrtc.so) imports. Contexts exist, devices answer through the
 * fake runtime, modules and functions are opaque handles. The driver
 * functions PyTorch's allocator uses come from the runtime's
 * cudaGetDriverEntryPointByVersion instead (cudart.c). Everything else is a
 * generated stub that returns CUDA_SUCCESS (build.py).
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

static char context[64];

static void *new_handle(void) { return calloc(1, 64); }

/* In fake libcudart.so.13. */
extern int stepwatchFakeCudaPrimaryContext(int dev, int create);

/* The current context: the primary context of the thread's device, if it exists. */
EXPORT CUresult cuCtxGetCurrent(CUcontext *ctx) {
  int dev = 0;
  cudaGetDevice(&dev);
  if (ctx) *ctx = stepwatchFakeCudaPrimaryContext(dev, 0) ? (CUcontext)context : NULL;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
  if (flags) *flags = 0;
  if (active) *active = stepwatchFakeCudaPrimaryContext(dev, 0);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev) {
  if (!stepwatchFakeCudaPrimaryContext(dev, 1)) return CUDA_ERROR_INVALID_DEVICE;
  if (ctx) *ctx = (CUcontext)context;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
  if (!dev) return CUDA_ERROR_INVALID_VALUE;
  *dev = ordinal;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetAttribute(int *value, CUdevice_attribute attr, CUdevice dev) {
  return cudaDeviceGetAttribute(value, (enum cudaDeviceAttr)attr, dev) == cudaSuccess
             ? CUDA_SUCCESS
             : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorString(CUresult e, const char **s) {
  if (s) *s = e == CUDA_SUCCESS ? "no error" : "fake-cuda driver error";
  return CUDA_SUCCESS;
}

EXPORT CUresult cuFuncGetAttribute(int *value, CUfunction_attribute attr, CUfunction fn) {
  if (!value) return CUDA_ERROR_INVALID_VALUE;
  *value = attr == CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK ? 1024 : 0;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, CUfunction fn, int block,
                                                            size_t smem) {
  if (n) *n = 4;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuModuleLoadData(CUmodule *m, const void *image) {
  if (!m) return CUDA_ERROR_INVALID_VALUE;
  *m = (CUmodule)new_handle();
  return CUDA_SUCCESS;
}

EXPORT CUresult cuModuleLoadDataEx(CUmodule *m, const void *image, unsigned int n,
                                   CUjit_option *options, void **values) {
  return cuModuleLoadData(m, image);
}

EXPORT CUresult cuModuleGetFunction(CUfunction *fn, CUmodule m, const char *name) {
  if (!fn) return CUDA_ERROR_INVALID_VALUE;
  *fn = (CUfunction)new_handle();
  return CUDA_SUCCESS;
}

EXPORT CUresult cuLinkCreate_v2(unsigned int n, CUjit_option *options, void **values,
                                CUlinkState *state) {
  if (!state) return CUDA_ERROR_INVALID_VALUE;
  *state = (CUlinkState)new_handle();
  return CUDA_SUCCESS;
}

EXPORT CUresult cuLinkComplete(CUlinkState state, void **cubin, size_t *size) {
  static char empty[16];
  if (cubin) *cubin = empty;
  if (size) *size = sizeof empty;
  return CUDA_SUCCESS;
}
