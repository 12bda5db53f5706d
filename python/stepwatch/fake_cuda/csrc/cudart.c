/*
 * fake libcudart.so.13: the CUDA runtime as far as PyTorch's memory behaviour
 * needs it, on fake-nvml's GPUs. Kernels do nothing; device memory is counted,
 * never touched. See ../README.md for what is real and what is not.
 *
 * Device memory is real address space of this process, reserved PROT_NONE and
 * made readable and writable while allocated, so a stray access faults and
 * small transfers keep their bytes (DDP's shape checks gather them). Pages
 * are only backed when written: kernels write nothing, and writes to the
 * device larger than STEPWATCH_FAKE_CUDA_WRITE_LIMIT (1 MiB) are dropped, so
 * host memory stays small. Reads of never-written memory give zeros.
 *
 * Every allocation is charged to the calling process's slot on its fake-nvml
 * GPU (the CUDA context plus device allocations rounded to the driver's 2 MiB
 * page), so the agent reads through NVML what PyTorch really reserved, and a
 * request beyond what the GPU has left fails as cudaMalloc does. Functions not
 * written here are generated stubs that return cudaSuccess (build.py).
 */
#define _GNU_SOURCE
#include <cuda_runtime_api.h>
#include <cuda.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
#define MIB (1ULL << 20)
#define PAGE (2 * MIB)          /* the driver's allocation granularity */
#define MAX_DEVICES 16
#define VA_SIZE (1ULL << 44)    /* 16 TiB of PROT_NONE address space */

/* ------------------------------------------------------------- NVML binding */

typedef void *nvml_device;
typedef struct {
  unsigned version;
  unsigned long long total, reserved, free, used;
} nvml_memory_v2;
#define NVML_MEMORY_V2 ((unsigned)sizeof(nvml_memory_v2) | (2u << 24))

static struct {
  int (*init)(void);
  int (*count)(unsigned *);
  int (*handle)(unsigned, nvml_device *);
  int (*handle_by_uuid)(const char *, nvml_device *);
  int (*index)(nvml_device, unsigned *);
  int (*mig_parent)(nvml_device, nvml_device *);
  int (*name)(nvml_device, char *, unsigned);
  int (*uuid)(nvml_device, char *, unsigned);
  int (*memory)(nvml_device, nvml_memory_v2 *);
  int (*set_process)(nvml_device, unsigned, unsigned long long);
  int (*release_process)(nvml_device, unsigned);
} nvml;

/* ------------------------------------------------------------------- state */

struct device {
  nvml_device handle;
  int nvml_index;
  char uuid[96];
  char name[96];
  /* What CUDA calls the device's total (cudaMemGetInfo, totalGlobalMem):
   * NVML's total minus the memory the driver reserves, as NVIDIA GPUs
   * appear to report it (PyTorch's OOM message gives a T4 "a total capacity
   * of 14.75 GiB", below the 15360 MiB nvidia-smi shows; not checked on a
   * GPU here). */
  unsigned long long total;
  unsigned long long allocated; /* device bytes this process holds, page-rounded */
  int context;                  /* the context has been created (and charged) */
};

struct range {
  uintptr_t start;
  size_t size;        /* bytes of address space */
  size_t charged;     /* bytes charged to the device (0 for reservations) */
  int device;
  int host;           /* host memory from cudaHostAlloc/cudaHostRegister */
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static int init_error = cudaSuccess;
static struct device devices[MAX_DEVICES];
static int device_count;
static unsigned long long context_bytes = 512 * MIB;
static uintptr_t va_base, va_low; /* va_low: lowest address handed out so far */
/* Address ranges given back (cudaFree, cuMemAddressFree), sorted by start, merged. */
static struct hole { uintptr_t start; size_t size; } *holes;
static size_t nholes, cap_holes;
static struct range *ranges; /* sorted by start */
static size_t nranges, cap_ranges;
static int usage_log_fd = -1;
static pid_t usage_log_pid;
static char usage_log_dir[4096];
static int debug;
static size_t write_limit = MIB;
static unsigned long long kernel_ns; /* emulated time per kernel; 0: kernels take none */
static unsigned long long busy_until[MAX_DEVICES]; /* when each device's queued work is done */

static void wait_idle(void);

static __thread int current_device;
static __thread cudaError_t last_error = cudaSuccess;

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (n > 0) {
    ssize_t w = write(2, "fake-cuda: ", 11);
    w = write(2, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
    (void)w;
  }
}

static unsigned long long parse_size(const char *s, unsigned long long dflt) {
  if (!s || !*s) return dflt;
  char *end;
  unsigned long long v = strtoull(s, &end, 10);
  return *end ? dflt : v;
}

static cudaError_t fail(cudaError_t e) {
  last_error = e;
  return e;
}

static void load(void) {
  debug = getenv("STEPWATCH_FAKE_CUDA_DEBUG") != NULL;
  context_bytes = parse_size(getenv("STEPWATCH_FAKE_CUDA_CONTEXT_BYTES"), context_bytes);
  write_limit = parse_size(getenv("STEPWATCH_FAKE_CUDA_WRITE_LIMIT"), write_limit);
  kernel_ns = parse_size(getenv("STEPWATCH_FAKE_CUDA_KERNEL_NS"), 0);
  const char *dir = getenv("STEPWATCH_FAKE_CUDA_USAGE_LOG");
  if (dir && *dir) snprintf(usage_log_dir, sizeof usage_log_dir, "%s", dir);

  const char *lib = getenv("STEPWATCH_FAKE_NVML_LIB");
  if (!lib || !*lib) lib = "libnvidia-ml.so.1";
  void *h = dlopen(lib, RTLD_NOW | RTLD_GLOBAL);
  if (!h) {
    say("cannot load %s (%s); run under `fake-cuda run`\n", lib, dlerror());
    init_error = cudaErrorNoDevice;
    return;
  }
  nvml.init = (int (*)(void))dlsym(h, "nvmlInit_v2");
  nvml.count = (int (*)(unsigned *))dlsym(h, "nvmlDeviceGetCount_v2");
  nvml.handle = (int (*)(unsigned, nvml_device *))dlsym(h, "nvmlDeviceGetHandleByIndex_v2");
  nvml.handle_by_uuid = (int (*)(const char *, nvml_device *))dlsym(h, "nvmlDeviceGetHandleByUUID");
  nvml.index = (int (*)(nvml_device, unsigned *))dlsym(h, "nvmlDeviceGetIndex");
  nvml.mig_parent = (int (*)(nvml_device, nvml_device *))dlsym(
      h, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle");
  nvml.name = (int (*)(nvml_device, char *, unsigned))dlsym(h, "nvmlDeviceGetName");
  nvml.uuid = (int (*)(nvml_device, char *, unsigned))dlsym(h, "nvmlDeviceGetUUID");
  nvml.memory = (int (*)(nvml_device, nvml_memory_v2 *))dlsym(h, "nvmlDeviceGetMemoryInfo_v2");
  nvml.set_process = (int (*)(nvml_device, unsigned, unsigned long long))dlsym(
      h, "stepwatchFakeNvmlSetProcessMemory");
  nvml.release_process = (int (*)(nvml_device, unsigned))dlsym(h, "stepwatchFakeNvmlReleaseProcess");
  if (!nvml.set_process || !nvml.release_process || !nvml.init || !nvml.count || !nvml.handle ||
      !nvml.memory || !nvml.uuid || !nvml.name) {
    say("%s is not stepwatch's fake-nvml (no stepwatchFakeNvml* functions); "
        "fake-cuda only runs on fake GPUs\n", lib);
    init_error = cudaErrorNoDevice;
    return;
  }
  int rc = nvml.init();
  unsigned n = 0;
  if (rc == 0) rc = nvml.count(&n);
  if (rc != 0) {
    say("fake-nvml did not initialise (NVML error %d): is STEPWATCH_FAKE_NVML_DIR a fake GPU "
        "state (`stepwatch fake-gpu --dir DIR init`)?\n", rc);
    init_error = cudaErrorNoDevice;
    return;
  }

  /* CUDA_VISIBLE_DEVICES: a comma-separated list of fake-nvml indices, or of
   * UUIDs (`GPU-…`, or `MIG-…` to place the process on a MIG slice, which it
   * then sees with the slice's memory, as CUDA does). */
  nvml_device order[MAX_DEVICES];
  int k = 0;
  const char *vis = getenv("CUDA_VISIBLE_DEVICES");
  if (vis) {
    const char *p = vis;
    while (*p && k < MAX_DEVICES) {
      const char *comma = strchr(p, ',');
      size_t len = comma ? (size_t)(comma - p) : strlen(p);
      char entry[128];
      if (len == 0 || len >= sizeof entry) break;
      memcpy(entry, p, len);
      entry[len] = 0;
      nvml_device handle = NULL;
      if (strncmp(entry, "GPU-", 4) == 0 || strncmp(entry, "MIG-", 4) == 0) {
        if (!nvml.handle_by_uuid || nvml.handle_by_uuid(entry, &handle) != 0) break;
      } else {
        char *end;
        long idx = strtol(entry, &end, 10);
        if (*end || idx < 0 || idx >= (long)n) break; /* CUDA stops at the first bad entry */
        if (nvml.handle((unsigned)idx, &handle) != 0) break;
      }
      order[k++] = handle;
      if (!comma) break;
      p = comma + 1;
    }
  } else {
    for (unsigned i = 0; i < n && i < MAX_DEVICES; i++) {
      if (nvml.handle(i, &order[k]) == 0) k++;
    }
  }
  for (int i = 0; i < k; i++) {
    struct device *d = &devices[device_count];
    d->handle = order[i];
    /* The bus is the GPU's; a MIG slice is on its parent's. */
    nvml_device gpu = d->handle;
    if (nvml.mig_parent) nvml.mig_parent(d->handle, &gpu);
    unsigned index = 0;
    if (nvml.index) nvml.index(gpu, &index);
    d->nvml_index = (int)index;
    nvml.uuid(d->handle, d->uuid, sizeof d->uuid);
    nvml.name(d->handle, d->name, sizeof d->name);
    nvml_memory_v2 m = {.version = NVML_MEMORY_V2};
    nvml.memory(d->handle, &m);
    d->total = m.total > m.reserved ? m.total - m.reserved : 0;
    device_count++;
  }
  if (device_count == 0) {
    init_error = cudaErrorNoDevice;
    say("no fake GPUs visible (fake-nvml has %u, CUDA_VISIBLE_DEVICES=%s)\n", n, vis ? vis : "");
    return;
  }
  void *va = mmap(NULL, VA_SIZE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (va == MAP_FAILED) {
    say("cannot reserve device address space: %s\n", strerror(errno));
    init_error = cudaErrorInitializationError;
    return;
  }
  va_base = ((uintptr_t)va + PAGE - 1) & ~(uintptr_t)(PAGE - 1);
  /* The first page holds device globals (cudaGetSymbolAddress): its own, so
   * that a copy to a symbol never lands in an allocation. */
  mprotect((void *)va_base, PAGE, PROT_READ | PROT_WRITE);
  /* Device addresses are handed out from the top down (see take_va). */
  va_low = va_base + VA_SIZE - PAGE;
  if (debug) say("%d fake GPU(s), context %llu bytes\n", device_count, context_bytes);
}

static int ready(void) {
  pthread_once(&once, load);
  return init_error == cudaSuccess;
}

/* ------------------------------------------------------------ accounting */

static unsigned long long now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
}

/* Publishes device `dev`'s usage to fake-nvml and the usage log. Lock held. */
static void publish(int dev) {
  struct device *d = &devices[dev];
  unsigned long long used = (d->context ? context_bytes : 0) + d->allocated;
  pid_t pid = getpid();
  nvml.set_process(d->handle, (unsigned)pid, used);
  if (!usage_log_dir[0]) return;
  if (usage_log_fd < 0 || usage_log_pid != pid) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%d.tsv", usage_log_dir, (int)pid);
    usage_log_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    usage_log_pid = pid;
  }
  if (usage_log_fd >= 0) {
    char line[256];
    int n = snprintf(line, sizeof line, "%llu\t%d\t%s\t%llu\n", now_ns(), dev, d->uuid, used);
    ssize_t w = write(usage_log_fd, line, (size_t)n);
    (void)w;
  }
}

/* The primary context of `dev` exists from the first call that needs it. */
static void ensure_context(int dev) {
  if (dev < 0 || dev >= device_count) return;
  pthread_mutex_lock(&lock);
  if (!devices[dev].context) {
    devices[dev].context = 1;
    publish(dev);
  }
  pthread_mutex_unlock(&lock);
}

/* For the fake libcuda.so.1 (not CUDA): whether `dev` has a primary context,
 * creating it first when `create` is set. PyTorch asks the driver before it
 * switches device (c10::cuda::MaybeSetDevice), so that it makes no context on
 * a GPU the process does not use; answering "yes" everywhere would charge a
 * context on GPU 0 to every rank. */
EXPORT int stepwatchFakeCudaPrimaryContext(int dev, int create) {
  if (!ready() || dev < 0 || dev >= device_count) return 0;
  if (create) ensure_context(dev);
  pthread_mutex_lock(&lock);
  int active = devices[dev].context;
  pthread_mutex_unlock(&lock);
  return active;
}

static void release_all(void) __attribute__((destructor));
static void release_all(void) {
  if (init_error != cudaSuccess || !nvml.release_process) return;
  for (int i = 0; i < device_count; i++)
    if (devices[i].context || devices[i].allocated) nvml.release_process(devices[i].handle, (unsigned)getpid());
}

/* What the GPU still has for anyone: fake-nvml's free (total - reserved - used). */
static unsigned long long device_free(int dev) {
  nvml_memory_v2 m = {.version = NVML_MEMORY_V2};
  if (nvml.memory(devices[dev].handle, &m) != 0) return 0;
  return m.free;
}

static size_t find_range(uintptr_t p) { /* index of the last range starting <= p, or nranges */
  size_t lo = 0, hi = nranges;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (ranges[mid].start <= p) lo = mid + 1; else hi = mid;
  }
  return lo == 0 ? nranges : lo - 1;
}

static struct range *range_of(const void *ptr) {
  uintptr_t p = (uintptr_t)ptr;
  size_t i = find_range(p);
  if (i == nranges) return NULL;
  return p < ranges[i].start + ranges[i].size ? &ranges[i] : NULL;
}

static int add_range(struct range r) {
  if (nranges == cap_ranges) {
    size_t cap = cap_ranges ? cap_ranges * 2 : 1024;
    struct range *n = realloc(ranges, cap * sizeof *n);
    if (!n) return 0;
    ranges = n;
    cap_ranges = cap;
  }
  size_t i = nranges;
  while (i > 0 && ranges[i - 1].start > r.start) i--;
  memmove(&ranges[i + 1], &ranges[i], (nranges - i) * sizeof *ranges);
  ranges[i] = r;
  nranges++;
  return 1;
}

static void drop_range(struct range *r) {
  size_t i = (size_t)(r - ranges);
  memmove(&ranges[i], &ranges[i + 1], (nranges - i - 1) * sizeof *ranges);
  nranges--;
}

/*
 * Takes address space for `size` bytes (no charge). Lock held.
 *
 * As CUDA's driver was seen to place allocations (README.md, "Where
 * allocations land"): from the top down, each new range just below the lowest
 * one handed out so far, unless a range given back leaves a hole that fits:
 * then at the top of the highest such hole. PyTorch's best fit breaks ties by
 * address, so this order decides which of two equal cached blocks it reuses.
 */
static uintptr_t take_va(size_t size) {
  size_t rounded = (size + PAGE - 1) & ~(size_t)(PAGE - 1);
  if (rounded == 0) rounded = PAGE;
  for (size_t i = nholes; i-- > 0;) {
    if (holes[i].size < rounded) continue;
    holes[i].size -= rounded;
    uintptr_t p = holes[i].start + holes[i].size;
    if (holes[i].size == 0) {
      memmove(&holes[i], &holes[i + 1], (nholes - i - 1) * sizeof *holes);
      nholes--;
    }
    return p;
  }
  if (va_low - va_base < rounded + PAGE) return 0; /* the first page holds device globals */
  va_low -= rounded;
  return va_low;
}

/* Gives address space taken by take_va back, merging it with neighbouring holes. Lock held. */
static void give_va(uintptr_t p, size_t size) {
  size_t rounded = (size + PAGE - 1) & ~(size_t)(PAGE - 1);
  if (rounded == 0) rounded = PAGE;
  size_t i = 0;
  while (i < nholes && holes[i].start < p) i++;
  int joins_prev = i > 0 && holes[i - 1].start + holes[i - 1].size == p;
  int joins_next = i < nholes && p + rounded == holes[i].start;
  if (joins_prev && joins_next) {
    holes[i - 1].size += rounded + holes[i].size;
    memmove(&holes[i], &holes[i + 1], (nholes - i - 1) * sizeof *holes);
    nholes--;
  } else if (joins_prev) {
    holes[i - 1].size += rounded;
  } else if (joins_next) {
    holes[i].start = p;
    holes[i].size += rounded;
  } else {
    if (nholes == cap_holes) {
      size_t cap = cap_holes ? cap_holes * 2 : 256;
      struct hole *n = realloc(holes, cap * sizeof *n);
      if (!n) return; /* the range is lost, not reused: harmless */
      holes = n;
      cap_holes = cap;
    }
    memmove(&holes[i + 1], &holes[i], (nholes - i) * sizeof *holes);
    holes[i] = (struct hole){p, rounded};
    nholes++;
  }
}

static size_t page_round(size_t n) { return (n + PAGE - 1) & ~(size_t)(PAGE - 1); }

/* Makes [p, p+size) usable memory, or gives its pages back and faults on access. */
static int map_pages(uintptr_t p, size_t size) {
  return mprotect((void *)p, page_round(size), PROT_READ | PROT_WRITE) == 0;
}

static void unmap_pages(uintptr_t p, size_t size) {
  madvise((void *)p, page_round(size), MADV_DONTNEED);
  mprotect((void *)p, page_round(size), PROT_NONE);
}

/* Charges `bytes` (page-rounded) to `dev` if the GPU has them; 0 when it does not. */
static int charge(int dev, size_t bytes) {
  unsigned long long rounded = (bytes + PAGE - 1) & ~(unsigned long long)(PAGE - 1);
  if (rounded > device_free(dev)) return 0;
  devices[dev].allocated += rounded;
  publish(dev);
  return 1;
}

static void uncharge(int dev, size_t bytes) {
  unsigned long long rounded = (bytes + PAGE - 1) & ~(unsigned long long)(PAGE - 1);
  devices[dev].allocated -= rounded < devices[dev].allocated ? rounded : devices[dev].allocated;
  publish(dev);
}

static cudaError_t device_alloc(void **out, size_t size, int dev) {
  if (!out) return fail(cudaErrorInvalidValue);
  if (!ready()) return fail((cudaError_t)init_error);
  if (size == 0) {
    *out = NULL;
    return cudaSuccess;
  }
  ensure_context(dev);
  pthread_mutex_lock(&lock);
  uintptr_t p = 0;
  if (charge(dev, size)) {
    p = take_va(size);
    if (!p || !map_pages(p, size) || !add_range((struct range){p, size, size, dev, 0})) {
      uncharge(dev, size);
      p = 0;
    }
  }
  pthread_mutex_unlock(&lock);
  if (debug) say("cudaMalloc(%zu) on %d -> %p\n", size, dev, (void *)p);
  if (!p) {
    *out = NULL;
    return fail(cudaErrorMemoryAllocation);
  }
  *out = (void *)p;
  return cudaSuccess;
}

static cudaError_t device_free_ptr(void *ptr) {
  if (!ptr) return cudaSuccess;
  pthread_mutex_lock(&lock);
  struct range *r = range_of(ptr);
  cudaError_t e = cudaSuccess;
  if (!r || r->host || r->start != (uintptr_t)ptr) {
    e = cudaErrorInvalidValue;
  } else {
    int dev = r->device;
    size_t charged = r->charged;
    unmap_pages(r->start, r->size);
    give_va(r->start, r->size);
    drop_range(r);
    if (charged) uncharge(dev, charged);
  }
  pthread_mutex_unlock(&lock);
  return e == cudaSuccess ? e : fail(e);
}

/* --------------------------------------------------------------- errors */

EXPORT cudaError_t cudaGetLastError(void) {
  cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}

EXPORT cudaError_t cudaPeekAtLastError(void) { return last_error; }

EXPORT const char *cudaGetErrorString(cudaError_t e) {
  switch (e) {
  case cudaSuccess: return "no error";
  case cudaErrorInvalidValue: return "invalid argument";
  case cudaErrorMemoryAllocation: return "out of memory";
  case cudaErrorInitializationError: return "initialization error";
  case cudaErrorNoDevice: return "no CUDA-capable device is detected";
  case cudaErrorInvalidDevice: return "invalid device ordinal";
  case cudaErrorNotSupported: return "operation not supported";
  default: return "unknown error (fake-cuda)";
  }
}

EXPORT const char *cudaGetErrorName(cudaError_t e) {
  switch (e) {
  case cudaSuccess: return "cudaSuccess";
  case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
  case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
  case cudaErrorInitializationError: return "cudaErrorInitializationError";
  case cudaErrorNoDevice: return "cudaErrorNoDevice";
  case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
  case cudaErrorNotSupported: return "cudaErrorNotSupported";
  default: return "cudaErrorUnknown";
  }
}

/* --------------------------------------------------------------- devices */

EXPORT cudaError_t cudaGetDeviceCount(int *count) {
  if (!count) return fail(cudaErrorInvalidValue);
  if (!ready()) {
    *count = 0;
    return fail((cudaError_t)init_error);
  }
  *count = device_count;
  return cudaSuccess;
}

EXPORT cudaError_t cudaGetDevice(int *dev) {
  if (!dev) return fail(cudaErrorInvalidValue);
  if (!ready()) return fail((cudaError_t)init_error);
  *dev = current_device;
  return cudaSuccess;
}

EXPORT cudaError_t cudaSetDevice(int dev) {
  if (!ready()) return fail((cudaError_t)init_error);
  if (dev < 0 || dev >= device_count) return fail(cudaErrorInvalidDevice);
  current_device = dev;
  ensure_context(dev); /* CUDA 12+: cudaSetDevice creates the primary context */
  return cudaSuccess;
}

EXPORT cudaError_t cudaDriverGetVersion(int *v) {
  if (!v) return fail(cudaErrorInvalidValue);
  *v = CUDART_VERSION;
  return cudaSuccess;
}

EXPORT cudaError_t cudaRuntimeGetVersion(int *v) {
  if (!v) return fail(cudaErrorInvalidValue);
  *v = CUDART_VERSION;
  return cudaSuccess;
}

static int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/* "GPU-xxxxxxxx-xxxx-..." into the 16 bytes of cudaUUID_t. */
static void uuid_bytes(const char *s, char out[16]) {
  memset(out, 0, 16);
  if (strncmp(s, "GPU-", 4) == 0) s += 4;
  int n = 0;
  for (; *s && n < 32; s++) {
    int v = hexval(*s);
    if (v < 0) continue;
    if (n % 2 == 0) out[n / 2] = (char)(v << 4); else out[n / 2] |= (char)v;
    n++;
  }
}

EXPORT cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int dev) {
  if (!p) return fail(cudaErrorInvalidValue);
  if (!ready()) return fail((cudaError_t)init_error);
  if (dev < 0 || dev >= device_count) return fail(cudaErrorInvalidDevice);
  struct device *d = &devices[dev];
  memset(p, 0, sizeof *p);
  snprintf(p->name, sizeof p->name, "%s", d->name);
  uuid_bytes(d->uuid, p->uuid.bytes);
  /* What cudaMemGetInfo calls total: NVML's total less the driver-reserved memory. */
  p->totalGlobalMem = d->total;
  p->sharedMemPerBlock = 48 * 1024;
  p->regsPerBlock = 65536;
  p->warpSize = 32;
  p->memPitch = 2147483647;
  p->maxThreadsPerBlock = 1024;
  p->maxThreadsDim[0] = 1024; p->maxThreadsDim[1] = 1024; p->maxThreadsDim[2] = 64;
  p->maxGridSize[0] = 2147483647; p->maxGridSize[1] = 65535; p->maxGridSize[2] = 65535;
  p->totalConstMem = 65536;
  p->major = 9;
  p->minor = 0;
  p->textureAlignment = 512;
  p->texturePitchAlignment = 32;
  p->multiProcessorCount = 132;
  p->canMapHostMemory = 1;
  p->concurrentKernels = 1;
  p->ECCEnabled = 1;
  p->pciBusID = d->nvml_index + 1;
  p->pciDeviceID = 0;
  p->pciDomainID = 0;
  p->asyncEngineCount = 2;
  p->unifiedAddressing = 1;
  p->memoryBusWidth = 5120;
  p->l2CacheSize = 50 * 1024 * 1024;
  p->persistingL2CacheMaxSize = 32 * 1024 * 1024;
  p->maxThreadsPerMultiProcessor = 2048;
  p->streamPrioritiesSupported = 1;
  p->globalL1CacheSupported = 1;
  p->localL1CacheSupported = 1;
  p->sharedMemPerMultiprocessor = 233472;
  p->regsPerMultiprocessor = 65536;
  p->managedMemory = 1;
  p->hostNativeAtomicSupported = 0;
  p->concurrentManagedAccess = 1;
  p->computePreemptionSupported = 1;
  p->cooperativeLaunch = 1;
  p->sharedMemPerBlockOptin = 232448;
  p->maxBlocksPerMultiProcessor = 32;
  p->accessPolicyMaxWindowSize = 134213632;
  p->reservedSharedMemPerBlock = 1024;
  p->hostRegisterSupported = 1;
  p->memoryPoolsSupported = 1;
  p->clusterLaunch = 1;
  return cudaSuccess;
}

EXPORT cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int dev) {
  if (!value) return fail(cudaErrorInvalidValue);
  if (!ready()) return fail((cudaError_t)init_error);
  if (dev < 0 || dev >= device_count) return fail(cudaErrorInvalidDevice);
  switch (attr) {
  case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
  case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
  case cudaDevAttrMultiProcessorCount: *value = 132; break;
  case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
  case cudaDevAttrMaxThreadsPerMultiProcessor: *value = 2048; break;
  case cudaDevAttrWarpSize: *value = 32; break;
  case cudaDevAttrMaxSharedMemoryPerBlock: *value = 48 * 1024; break;
  case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = 232448; break;
  case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = 233472; break;
  case cudaDevAttrL2CacheSize: *value = 50 * 1024 * 1024; break;
  case cudaDevAttrMaxBlockDimX: *value = 1024; break;
  case cudaDevAttrMaxBlockDimY: *value = 1024; break;
  case cudaDevAttrMaxBlockDimZ: *value = 64; break;
  case cudaDevAttrMaxGridDimX: *value = 2147483647; break;
  case cudaDevAttrMaxGridDimY: *value = 65535; break;
  case cudaDevAttrMaxGridDimZ: *value = 65535; break;
  case cudaDevAttrPciBusId: *value = devices[dev].nvml_index + 1; break;
  case cudaDevAttrPciDeviceId: *value = 0; break;
  case cudaDevAttrPciDomainId: *value = 0; break;
  case cudaDevAttrIntegrated: *value = 0; break;
  case cudaDevAttrMemoryPoolsSupported: *value = 1; break;
  case cudaDevAttrMaxBlocksPerMultiprocessor: *value = 32; break;
  default: *value = 1; /* never zero: launch configurations divide by these */
  }
  return cudaSuccess;
}

EXPORT cudaError_t cudaDeviceGetPCIBusId(char *bus, int len, int dev) {
  if (!bus || len <= 0) return fail(cudaErrorInvalidValue);
  if (!ready()) return fail((cudaError_t)init_error);
  if (dev < 0 || dev >= device_count) return fail(cudaErrorInvalidDevice);
  snprintf(bus, (size_t)len, "00000000:%02X:00.0", devices[dev].nvml_index + 1);
  return cudaSuccess;
}

EXPORT cudaError_t cudaDeviceCanAccessPeer(int *can, int dev, int peer) {
  if (!can) return fail(cudaErrorInvalidValue);
  *can = 0;
  return cudaSuccess;
}

EXPORT cudaError_t cudaDeviceGetStreamPriorityRange(int *least, int *greatest) {
  if (least) *least = 0;
  if (greatest) *greatest = -5;
  return cudaSuccess;
}

EXPORT cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total) {
  if (!ready()) return fail((cudaError_t)init_error);
  int dev = current_device;
  ensure_context(dev);
  if (free_bytes) *free_bytes = device_free(dev);
  if (total) *total = devices[dev].total;
  return cudaSuccess;
}

/* ---------------------------------------------------------------- memory */

EXPORT cudaError_t cudaMalloc(void **ptr, size_t size) {
  if (!ready()) return fail((cudaError_t)init_error);
  return device_alloc(ptr, size, current_device);
}

EXPORT cudaError_t cudaMallocAsync(void **ptr, size_t size, cudaStream_t stream) {
  return cudaMalloc(ptr, size);
}

EXPORT cudaError_t cudaMallocManaged(void **ptr, size_t size, unsigned int flags) {
  return cudaMalloc(ptr, size);
}

EXPORT cudaError_t cudaFree(void *ptr) {
  if (!ready()) return fail((cudaError_t)init_error);
  if (!ptr) {
    ensure_context(current_device); /* cudaFree(0): the classic way to create a context */
    return cudaSuccess;
  }
  return device_free_ptr(ptr);
}

EXPORT cudaError_t cudaFreeAsync(void *ptr, cudaStream_t stream) {
  return cudaFree(ptr);
}

static cudaError_t host_alloc(void **ptr, size_t size) {
  if (!ptr) return fail(cudaErrorInvalidValue);
  void *p = NULL;
  if (posix_memalign(&p, 4096, size ? size : 1) != 0) return fail(cudaErrorMemoryAllocation);
  pthread_mutex_lock(&lock);
  int ok = add_range((struct range){(uintptr_t)p, size ? size : 1, 0, -1, 1});
  pthread_mutex_unlock(&lock);
  if (!ok) {
    free(p);
    return fail(cudaErrorMemoryAllocation);
  }
  *ptr = p;
  return cudaSuccess;
}

EXPORT cudaError_t cudaHostAlloc(void **ptr, size_t size, unsigned int flags) {
  return host_alloc(ptr, size);
}

EXPORT cudaError_t cudaMallocHost(void **ptr, size_t size) { return host_alloc(ptr, size); }

EXPORT cudaError_t cudaFreeHost(void *ptr) {
  if (!ptr) return cudaSuccess;
  pthread_mutex_lock(&lock);
  struct range *r = range_of(ptr);
  int ok = r && r->host && r->start == (uintptr_t)ptr;
  if (ok) drop_range(r);
  pthread_mutex_unlock(&lock);
  if (!ok) return fail(cudaErrorInvalidValue);
  free(ptr);
  return cudaSuccess;
}

EXPORT cudaError_t cudaHostRegister(void *ptr, size_t size, unsigned int flags) {
  if (!ptr || !size) return fail(cudaErrorInvalidValue);
  pthread_mutex_lock(&lock);
  int ok = add_range((struct range){(uintptr_t)ptr, size, 0, -1, 2});
  pthread_mutex_unlock(&lock);
  return ok ? cudaSuccess : fail(cudaErrorMemoryAllocation);
}

EXPORT cudaError_t cudaHostUnregister(void *ptr) {
  pthread_mutex_lock(&lock);
  struct range *r = range_of(ptr);
  int ok = r && r->host == 2 && r->start == (uintptr_t)ptr;
  if (ok) drop_range(r);
  pthread_mutex_unlock(&lock);
  return ok ? cudaSuccess : fail(cudaErrorInvalidValue);
}

EXPORT cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *ptr) {
  if (!a) return fail(cudaErrorInvalidValue);
  memset(a, 0, sizeof *a);
  pthread_mutex_lock(&lock);
  struct range *r = range_of(ptr);
  if (!r) {
    a->type = cudaMemoryTypeUnregistered;
    a->device = -2;
  } else if (r->host) {
    a->type = cudaMemoryTypeHost;
    a->device = current_device;
    a->hostPointer = (void *)ptr;
    a->devicePointer = (void *)ptr;
  } else {
    a->type = cudaMemoryTypeDevice;
    a->device = r->device;
    a->devicePointer = (void *)ptr;
  }
  pthread_mutex_unlock(&lock);
  return cudaSuccess;
}

static int is_device(const void *p) {
  return (uintptr_t)p >= va_base && (uintptr_t)p < va_base + VA_SIZE;
}

/* Copies really happen, but writes to the device only up to the write limit. */
static void copy(void *dst, const void *src, size_t n) {
  if (!n || !dst || !src) return;
  if (is_device(dst) && n > write_limit) return;
  memmove(dst, src, n);
}

EXPORT cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind) {
  wait_idle(); /* a blocking copy waits for the work before it */
  copy(dst, src, n);
  return cudaSuccess;
}

EXPORT cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind,
                                   cudaStream_t stream) {
  copy(dst, src, n);
  return cudaSuccess;
}

EXPORT cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch,
                                     size_t width, size_t height, enum cudaMemcpyKind kind,
                                     cudaStream_t stream) {
  for (size_t row = 0; row < height; row++)
    copy((char *)dst + row * dpitch, src ? (const char *)src + row * spitch : NULL, width);
  return cudaSuccess;
}

EXPORT cudaError_t cudaMemset(void *dst, int value, size_t n) {
  if (dst && n <= write_limit) memset(dst, value, n);
  return cudaSuccess;
}

EXPORT cudaError_t cudaMemsetAsync(void *dst, int value, size_t n, cudaStream_t stream) {
  return cudaMemset(dst, value, n);
}

EXPORT cudaError_t cudaGetSymbolAddress(void **dev_ptr, const void *symbol) {
  if (!dev_ptr) return fail(cudaErrorInvalidValue);
  if (!ready()) return fail((cudaError_t)init_error);
  *dev_ptr = (void *)va_base; /* the globals page (see load) */
  return cudaSuccess;
}

EXPORT cudaError_t cudaLibraryGetGlobal(void **dptr, size_t *bytes, cudaLibrary_t lib,
                                        const char *name) {
  if (!ready()) return fail((cudaError_t)init_error);
  if (dptr) *dptr = (void *)va_base;
  if (bytes) *bytes = 8;
  return cudaSuccess;
}

/* ------------------------------------------------- streams, events, handles */

/* Distinct, non-null, never dereferenced by callers: opaque handles. */
static void *new_handle(void) {
  void *h = malloc(64);
  if (h) memset(h, 0, 64);
  return h;
}

/* A stream's or an event's Create: a fresh handle, in the current device's context. */
#define CREATE_IN_CONTEXT(create, type)            \
  EXPORT cudaError_t create(type *out) {          \
    if (!out) return fail(cudaErrorInvalidValue); \
    ensure_context(current_device);               \
    *out = (type)new_handle();                    \
    return cudaSuccess;                           \
  }

CREATE_IN_CONTEXT(cudaStreamCreate, cudaStream_t)

EXPORT cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int flags) {
  return cudaStreamCreate(s);
}

EXPORT cudaError_t cudaStreamCreateWithPriority(cudaStream_t *s, unsigned int flags, int priority) {
  return cudaStreamCreate(s);
}

EXPORT cudaError_t cudaStreamGetPriority(cudaStream_t s, int *priority) {
  if (priority) *priority = 0;
  return cudaSuccess;
}

CREATE_IN_CONTEXT(cudaEventCreate, cudaEvent_t)

EXPORT cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int flags) {
  return cudaEventCreate(e);
}

EXPORT cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
  if (ms) *ms = 0.0f;
  return cudaSuccess;
}

EXPORT cudaError_t cudaStreamIsCapturing(cudaStream_t s, enum cudaStreamCaptureStatus *status) {
  if (!status) return fail(cudaErrorInvalidValue);
  *status = cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

EXPORT cudaError_t cudaStreamGetCaptureInfo(cudaStream_t s, enum cudaStreamCaptureStatus *status,
                                            unsigned long long *id, cudaGraph_t *graph,
                                            const cudaGraphNode_t **deps,
                                            const cudaGraphEdgeData **edges, size_t *ndeps) {
  if (status) *status = cudaStreamCaptureStatusNone;
  if (id) *id = 0;
  if (graph) *graph = NULL;
  if (deps) *deps = NULL;
  if (edges) *edges = NULL;
  if (ndeps) *ndeps = 0;
  return cudaSuccess;
}

EXPORT cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void *data) {
  if (fn) fn(data);
  return cudaSuccess;
}

EXPORT cudaError_t cudaStreamAddCallback(cudaStream_t s, cudaStreamCallback_t cb, void *data,
                                         unsigned int flags) {
  if (cb) cb(s, cudaSuccess, data);
  return cudaSuccess;
}

EXPORT cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *pool, int dev) {
  if (!pool) return fail(cudaErrorInvalidValue);
  static char default_pool[64];
  *pool = (cudaMemPool_t)default_pool;
  return cudaSuccess;
}

EXPORT cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, enum cudaMemPoolAttr attr,
                                           void *value) {
  if (!value) return fail(cudaErrorInvalidValue);
  switch (attr) {
  case cudaMemPoolAttrReleaseThreshold:
  case cudaMemPoolAttrReservedMemCurrent:
  case cudaMemPoolAttrReservedMemHigh:
  case cudaMemPoolAttrUsedMemCurrent:
  case cudaMemPoolAttrUsedMemHigh:
    *(unsigned long long *)value = 0;
    break;
  default:
    *(int *)value = 0;
  }
  return cudaSuccess;
}

EXPORT cudaError_t cudaDeviceGetGraphMemAttribute(int dev, enum cudaGraphMemAttributeType attr,
                                                  void *value) {
  if (value) *(unsigned long long *)value = 0;
  return cudaSuccess;
}

EXPORT cudaError_t cudaUserObjectCreate(cudaUserObject_t *obj, void *ptr, cudaHostFn_t destroy,
                                        unsigned int refs, unsigned int flags) {
  if (!obj) return fail(cudaErrorInvalidValue);
  *obj = (cudaUserObject_t)new_handle();
  return cudaSuccess;
}

/* ---------------------------------------------------------------- kernels */
/*
 * Time, when STEPWATCH_FAKE_CUDA_KERNEL_NS is set: each device runs its
 * kernels one after another, each taking that long; launches return at once
 * unless 1024 are already queued (the host then waits, as with a full launch
 * queue), and synchronisations wait for the queue to drain. So a training
 * loop runs at the pace of its "GPU" and its phases last long enough for the
 * agent's NVML sampler to see them.
 */
#define LAUNCH_QUEUE 1024

static void sleep_until(unsigned long long t) {
  struct timespec ts = {(time_t)(t / 1000000000ULL), (long)(t % 1000000000ULL)};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
  }
}

/* For the fake cuBLAS too (not CUDA): one kernel on the current device. */
EXPORT void stepwatchFakeCudaKernel(void) {
  if (!kernel_ns || !ready()) return;
  int dev = current_device;
  unsigned long long now = now_ns(), wait = 0;
  pthread_mutex_lock(&lock);
  unsigned long long start = busy_until[dev] > now ? busy_until[dev] : now;
  busy_until[dev] = start + kernel_ns;
  if (busy_until[dev] > now + LAUNCH_QUEUE * kernel_ns) wait = busy_until[dev] - LAUNCH_QUEUE * kernel_ns;
  pthread_mutex_unlock(&lock);
  if (wait) sleep_until(wait);
}

static void wait_idle(void) {
  if (!kernel_ns || !ready()) return;
  pthread_mutex_lock(&lock);
  unsigned long long t = busy_until[current_device];
  pthread_mutex_unlock(&lock);
  if (t > now_ns()) sleep_until(t);
}

EXPORT cudaError_t cudaLaunchKernel(const void *fn, dim3 grid, dim3 block, void **args,
                                    size_t smem, cudaStream_t stream) {
  stepwatchFakeCudaKernel();
  return cudaSuccess;
}

EXPORT cudaError_t cudaLaunchCooperativeKernel(const void *fn, dim3 grid, dim3 block, void **args,
                                               size_t smem, cudaStream_t stream) {
  return cudaLaunchKernel(fn, grid, block, args, smem, stream);
}

/* The CUDA 13 kernel-stub ABI (__cudaGetKernel, then this); arguments unused. */
EXPORT cudaError_t __cudaLaunchKernel(void) {
  stepwatchFakeCudaKernel();
  return cudaSuccess;
}

EXPORT cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t *config, const void *fn,
                                       void **args) {
  return __cudaLaunchKernel();
}

EXPORT cudaError_t cudaDeviceSynchronize(void) {
  wait_idle();
  return cudaSuccess;
}

/* Each device runs one queue: a stream or an event is done when its device is idle. */
EXPORT cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  return cudaDeviceSynchronize();
}

EXPORT cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  return cudaDeviceSynchronize();
}

EXPORT cudaError_t cudaFuncGetAttributes(struct cudaFuncAttributes *a, const void *fn) {
  if (!a) return fail(cudaErrorInvalidValue);
  memset(a, 0, sizeof *a);
  a->maxThreadsPerBlock = 1024;
  a->numRegs = 32;
  a->ptxVersion = 90;
  a->binaryVersion = 90;
  a->maxDynamicSharedSizeBytes = 232448 - 1024;
  a->preferredShmemCarveout = -1;
  return cudaSuccess;
}

EXPORT cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int *n, const void *fn, int block,
                                                                 size_t smem) {
  if (n) *n = 4;
  return cudaSuccess;
}

EXPORT cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *n, const void *fn,
                                                                          int block, size_t smem,
                                                                          unsigned int flags) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, fn, block, smem);
}

EXPORT cudaError_t cudaLibraryLoadData(cudaLibrary_t *lib, const void *code,
                                       enum cudaJitOption *jo, void **jv, unsigned int nj,
                                       enum cudaLibraryOption *lo, void **lv, unsigned int nl) {
  if (!lib) return fail(cudaErrorInvalidValue);
  *lib = (cudaLibrary_t)new_handle();
  return cudaSuccess;
}

EXPORT cudaError_t cudaLibraryGetKernel(cudaKernel_t *k, cudaLibrary_t lib, const char *name) {
  if (!k) return fail(cudaErrorInvalidValue);
  *k = (cudaKernel_t)new_handle();
  return cudaSuccess;
}

EXPORT cudaError_t cudaLibraryGetKernelCount(unsigned int *count, cudaLibrary_t lib) {
  if (count) *count = 0;
  return cudaSuccess;
}

/* The kernel stubs nvcc generates: register, configure, launch. */
static void *fatbin_handle[4];

EXPORT void **__cudaRegisterFatBinary(void *fatbin) {
  return fatbin_handle;
}

struct dim3_ { unsigned x, y, z; };
static __thread struct dim3_ pushed_grid, pushed_block;
static __thread size_t pushed_shmem;
static __thread void *pushed_stream;

EXPORT unsigned __cudaPushCallConfiguration(struct dim3_ grid, struct dim3_ block, size_t shmem,
                                            void *stream) {
  pushed_grid = grid;
  pushed_block = block;
  pushed_shmem = shmem;
  pushed_stream = stream;
  return 0;
}

EXPORT cudaError_t __cudaPopCallConfiguration(struct dim3_ *grid, struct dim3_ *block,
                                              size_t *shmem, void *stream) {
  if (grid) *grid = pushed_grid;
  if (block) *block = pushed_block;
  if (shmem) *shmem = pushed_shmem;
  if (stream) *(void **)stream = pushed_stream;
  return cudaSuccess;
}

EXPORT cudaError_t __cudaGetKernel(void **handle, const void *host_fn) {
  if (handle) *handle = (void *)host_fn;
  return cudaSuccess;
}

/* ------------------------------------------------ driver API entry points */
/*
 * PyTorch looks up driver functions through cudaGetDriverEntryPointByVersion.
 * These serve its expandable segments: physical memory (cuMemCreate) is charged
 * against the same capacity as cudaMalloc; address ranges are reserved from
 * the same PROT_NONE space. Names not served answer "symbol not found".
 */

struct phys { int device; size_t size; };

static CUresult drv_cuMemCreate(CUmemGenericAllocationHandle *h, size_t size,
                                const CUmemAllocationProp *prop, unsigned long long flags) {
  if (!h || !prop) return CUDA_ERROR_INVALID_VALUE;
  if (!ready()) return CUDA_ERROR_NOT_INITIALIZED;
  int dev = prop->location.id;
  if (dev < 0 || dev >= device_count) return CUDA_ERROR_INVALID_DEVICE;
  ensure_context(dev);
  pthread_mutex_lock(&lock);
  int ok = charge(dev, size);
  pthread_mutex_unlock(&lock);
  if (debug) say("cuMemCreate(%zu) on %d -> %s\n", size, dev, ok ? "ok" : "out of memory");
  if (!ok) return CUDA_ERROR_OUT_OF_MEMORY;
  struct phys *p = malloc(sizeof *p);
  if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
  p->device = dev;
  p->size = size;
  *h = (CUmemGenericAllocationHandle)(uintptr_t)p;
  return CUDA_SUCCESS;
}

static CUresult drv_cuMemRelease(CUmemGenericAllocationHandle h) {
  struct phys *p = (struct phys *)(uintptr_t)h;
  if (!p) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&lock);
  uncharge(p->device, p->size);
  pthread_mutex_unlock(&lock);
  free(p);
  return CUDA_SUCCESS;
}

static CUresult drv_cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align,
                                        CUdeviceptr addr, unsigned long long flags) {
  if (!ptr) return CUDA_ERROR_INVALID_VALUE;
  if (!ready()) return CUDA_ERROR_NOT_INITIALIZED;
  pthread_mutex_lock(&lock);
  uintptr_t p = take_va(size);
  int ok = p && add_range((struct range){p, size, 0, current_device, 0});
  pthread_mutex_unlock(&lock);
  if (!ok) return CUDA_ERROR_OUT_OF_MEMORY;
  *ptr = (CUdeviceptr)p;
  return CUDA_SUCCESS;
}

static CUresult drv_cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  pthread_mutex_lock(&lock);
  struct range *r = range_of((void *)(uintptr_t)ptr);
  if (r && !r->host && !r->charged) {
    give_va(r->start, r->size);
    drop_range(r);
  }
  pthread_mutex_unlock(&lock);
  return CUDA_SUCCESS;
}

static CUresult drv_cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *prop,
                                                  CUmemAllocationGranularity_flags option) {
  if (!g) return CUDA_ERROR_INVALID_VALUE;
  *g = PAGE;
  return CUDA_SUCCESS;
}

static CUresult drv_cuDeviceGet(CUdevice *d, int ordinal) {
  if (!d) return CUDA_ERROR_INVALID_VALUE;
  *d = ordinal;
  return CUDA_SUCCESS;
}

static CUresult drv_cuCtxGetCurrent(CUcontext *ctx) {
  static char context[64];
  if (ctx) *ctx = stepwatchFakeCudaPrimaryContext(current_device, 0) ? (CUcontext)context : NULL;
  return CUDA_SUCCESS;
}

static CUresult drv_cuCtxGetDevice(CUdevice *d) {
  if (d) *d = current_device;
  return CUDA_SUCCESS;
}

static CUresult drv_cuGetErrorString(CUresult e, const char **s) {
  if (s) *s = e == CUDA_SUCCESS ? "no error" : e == CUDA_ERROR_OUT_OF_MEMORY ? "out of memory"
                                                                          : "fake-cuda driver error";
  return CUDA_SUCCESS;
}

static CUresult drv_cuDeviceGetAttribute(int *v, CUdevice_attribute attr, CUdevice dev) {
  return cudaDeviceGetAttribute(v, (enum cudaDeviceAttr)attr, dev) == cudaSuccess
             ? CUDA_SUCCESS
             : CUDA_ERROR_INVALID_VALUE;
}

static CUresult drv_cuMemGetAddressRange(CUdeviceptr *base, size_t *size, CUdeviceptr ptr) {
  pthread_mutex_lock(&lock);
  struct range *r = range_of((void *)(uintptr_t)ptr);
  int ok = r && !r->host;
  if (ok && base) *base = (CUdeviceptr)r->start;
  if (ok && size) *size = r->size;
  pthread_mutex_unlock(&lock);
  return ok ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

static CUresult drv_cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                           CUmemGenericAllocationHandle h) {
  struct phys *p = (struct phys *)(uintptr_t)h;
  if (!prop || !p) return CUDA_ERROR_INVALID_VALUE;
  memset(prop, 0, sizeof *prop);
  prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop->location.id = p->device;
  return CUDA_SUCCESS;
}

static CUresult drv_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                             CUmemGenericAllocationHandle h, unsigned long long flags) {
  return map_pages((uintptr_t)ptr, size) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult drv_cuMemUnmap(CUdeviceptr ptr, size_t size) {
  unmap_pages((uintptr_t)ptr, size);
  return CUDA_SUCCESS;
}

static CUresult drv_success(void) { return CUDA_SUCCESS; }
static CUresult drv_unsupported(void) { return CUDA_ERROR_NOT_SUPPORTED; }

static const struct { const char *name; void *fn; } driver_table[] = {
    {"cuMemCreate", (void *)drv_cuMemCreate},
    {"cuMemRelease", (void *)drv_cuMemRelease},
    {"cuMemAddressReserve", (void *)drv_cuMemAddressReserve},
    {"cuMemAddressFree", (void *)drv_cuMemAddressFree},
    {"cuMemGetAllocationGranularity", (void *)drv_cuMemGetAllocationGranularity},
    {"cuDeviceGet", (void *)drv_cuDeviceGet},
    {"cuCtxGetCurrent", (void *)drv_cuCtxGetCurrent},
    {"cuCtxGetDevice", (void *)drv_cuCtxGetDevice},
    {"cuGetErrorString", (void *)drv_cuGetErrorString},
    {"cuDeviceGetAttribute", (void *)drv_cuDeviceGetAttribute},
    {"cuMemGetAddressRange", (void *)drv_cuMemGetAddressRange},
    {"cuMemGetAllocationPropertiesFromHandle", (void *)drv_cuMemGetAllocationPropertiesFromHandle},
    /* The charge is at cuMemCreate; mapping makes the pages usable. */
    {"cuMemMap", (void *)drv_cuMemMap},
    {"cuMemUnmap", (void *)drv_cuMemUnmap},
    {"cuMemSetAccess", (void *)drv_success},
    {"cuCtxSetCurrent", (void *)drv_success},
    {"cuCtxSynchronize", (void *)drv_success},
    {"cuStreamWriteValue32", (void *)drv_success},
    {"cuStreamWaitValue32", (void *)drv_success},
    {"cuMemExportToShareableHandle", (void *)drv_success},
    {"cuMemsetD32Async", (void *)drv_success},
    {"cuCtxPushCurrent", (void *)drv_success},
    {"cuCtxPopCurrent", (void *)drv_success},
    {"cuLogsRegisterCallback", (void *)drv_success},
    {"cuLogsUnregisterCallback", (void *)drv_success},
    /* Asked for at start-up and asserted present; only IPC, multicast and green
     * contexts call them, which fake GPUs do not offer. */
    {"cuMemImportFromShareableHandle", (void *)drv_unsupported},
    {"cuMemRetainAllocationHandle", (void *)drv_unsupported},
    {"cuMulticastAddDevice", (void *)drv_unsupported},
    {"cuMulticastBindMem", (void *)drv_unsupported},
    {"cuMulticastCreate", (void *)drv_unsupported},
    {"cuMulticastUnbind", (void *)drv_unsupported},
    {"cuGreenCtxCreate", (void *)drv_unsupported},
    {"cuGreenCtxDestroy", (void *)drv_unsupported},
    {"cuGreenCtxStreamCreate", (void *)drv_unsupported},
    {"cuCtxFromGreenCtx", (void *)drv_unsupported},
    {"cuDevResourceGenerateDesc", (void *)drv_unsupported},
    {"cuDevSmResourceSplitByCount", (void *)drv_unsupported},
    {"cuDeviceGetDevResource", (void *)drv_unsupported},
};

EXPORT cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn,
                                                    unsigned int version,
                                                    unsigned long long flags,
                                                    enum cudaDriverEntryPointQueryResult *status) {
  if (!symbol || !fn) return fail(cudaErrorInvalidValue);
  for (size_t i = 0; i < sizeof driver_table / sizeof driver_table[0]; i++) {
    if (strcmp(symbol, driver_table[i].name) == 0) {
      if (debug) say("driver entry point %s: served\n", symbol);
      *fn = driver_table[i].fn;
      if (status) *status = cudaDriverEntryPointSuccess;
      return cudaSuccess;
    }
  }
  if (debug) say("driver entry point %s: not served\n", symbol);
  *fn = NULL;
  if (status) *status = cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}
