/*
 * fake libnccl.so.2: communicators of ranks on this machine. Small
 * collectives (up to 1 MiB: DDP's check that all ranks have the same
 * parameter shapes, its bucket order, barriers) really exchange their data
 * through shared memory named by the communicator's unique id, so the ranks
 * agree as they would on GPUs; larger ones move nothing, since kernels on a
 * fake GPU compute nothing either. Collectives block the calling thread until
 * every rank has reached them (real NCCL blocks the stream instead).
 * With STEPWATCH_FAKE_NCCL_COMM_BYTES each communicator also takes that many
 * device bytes through cudaMalloc, as NCCL's own buffers do (outside PyTorch's
 * allocator); by default it takes none. Functions not written here are
 * generated stubs that return ncclSuccess (build.py).
 */
#define _GNU_SOURCE
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <nccl.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

#define MAX_RANKS 1024

struct ncclComm {
  int nranks;
  int rank;
  int device;
  void *buffers;
  struct slot *slots;        /* the ranks' mailboxes in shared memory, or NULL */
  unsigned long long seq;    /* collectives exchanged so far */
  char shm_name[160];
};

#define SMALL (1u << 20)
#define EXCHANGE_TIMEOUT_NS (120ULL * 1000000000ULL)

/* One rank's mailbox in the communicator's shared memory. */
struct slot {
  _Atomic unsigned long long written; /* sequence number of the data in `data` */
  _Atomic unsigned long long read;    /* last sequence number this rank finished reading */
  unsigned long long len;
  unsigned char data[SMALL];
};

static int debug_level(void) {
  static int level = -1;
  if (level < 0) {
    const char *v = getenv("STEPWATCH_FAKE_CUDA_DEBUG");
    level = v ? atoi(v) : 0;
  }
  return level;
}

static unsigned long long now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
}

/* Maps the communicator's mailboxes: a file in /dev/shm named by its unique id,
 * which every rank of the communicator got from rank 0. */
static void open_mailboxes(struct ncclComm *c, const ncclUniqueId *id) {
  char name[160] = "/stepwatch-fake-nccl-";
  size_t n = strlen(name);
  for (size_t i = 0; i < sizeof id->internal && id->internal[i] && n < sizeof name - 1; i++) {
    char ch = id->internal[i];
    name[n++] = (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '-' ? ch : '_';
  }
  name[n] = 0;
  snprintf(c->shm_name, sizeof c->shm_name, "%s", name);
  size_t size = (size_t)c->nranks * sizeof(struct slot);
  int fd = shm_open(name, O_RDWR | O_CREAT, 0600);
  if (fd < 0) return;
  struct stat st;
  if (fstat(fd, &st) == 0 && (size_t)st.st_size < size && ftruncate(fd, (off_t)size) != 0) {
    close(fd);
    return;
  }
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p != MAP_FAILED) c->slots = p;
}

/* Waits for every rank to reach `seq`: polls at 20 µs, backing off to 1 ms
 * so that a rank waiting on a slow peer does not take a core from it. */
static int wait_for(struct ncclComm *c, int field_written, unsigned long long seq) {
  unsigned long long deadline = now_ns() + EXCHANGE_TIMEOUT_NS;
  long pause_ns = 20000;
  for (int r = 0; r < c->nranks; r++) {
    struct slot *s = &c->slots[r];
    while ((field_written ? atomic_load(&s->written) : atomic_load(&s->read)) < seq) {
      if (now_ns() > deadline) return 0;
      struct timespec ts = {0, pause_ns};
      nanosleep(&ts, NULL);
      if (pause_ns < 1000000) pause_ns *= 2;
    }
  }
  return 1;
}

/* Every rank's `bytes` bytes of this collective, in rank order (pointers into
 * shared memory, valid until done_reading), or NULL when the exchange is not
 * possible: too large, no mailboxes, or a peer that never came. */
static const unsigned char *const *exchange(struct ncclComm *c, const void *mine, size_t bytes,
                                            const unsigned char **out) {
  if (!c->slots || bytes > SMALL) return NULL;
  unsigned long long seq = ++c->seq;
  struct slot *me = &c->slots[c->rank];
  /* Everyone has read what this rank wrote last time before it is overwritten. */
  if (!wait_for(c, 0, seq - 1)) goto timeout;
  memcpy(me->data, mine, bytes);
  me->len = bytes;
  atomic_store(&me->written, seq);
  if (!wait_for(c, 1, seq)) goto timeout;
  for (int r = 0; r < c->nranks; r++) out[r] = c->slots[r].data;
  return out;
timeout:
  fprintf(stderr, "fake-nccl: rank %d: a peer did not reach collective %llu within %llus; "
          "going on with this rank's data\n", c->rank, seq, EXCHANGE_TIMEOUT_NS / 1000000000ULL);
  c->slots = NULL; /* out of step: stop exchanging */
  return NULL;
}

static void done_reading(struct ncclComm *c) {
  if (c->slots) atomic_store(&c->slots[c->rank].read, c->seq);
}

static size_t type_size(ncclDataType_t t) {
  switch (t) {
  case ncclInt8: case ncclUint8: return 1;
  case ncclFloat16: case ncclBfloat16: return 2;
  case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
  case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
  default: return 1;
  }
}

#define REDUCE(T)                                                                          \
  for (size_t i = 0; i < count; i++) {                                                     \
    T acc = ((const T *)all[0])[i];                                                        \
    for (int r = 1; r < nranks; r++) {                                                     \
      T v = ((const T *)all[r])[i];                                                        \
      acc = op == ncclMax ? (v > acc ? v : acc) : op == ncclMin ? (v < acc ? v : acc)     \
          : op == ncclProd ? acc * v : acc + v;                                            \
    }                                                                                      \
    ((T *)out)[i] = op == ncclAvg ? (T)(acc / nranks) : acc;                               \
  }

/* Reduces in the types collectives on metadata use; others keep this rank's data. */
static void reduce(void *out, const unsigned char *const *all, int nranks, size_t count,
                   ncclDataType_t t, ncclRedOp_t op, const void *mine) {
  switch (t) {
  case ncclInt32: REDUCE(int32_t); break;
  case ncclUint32: REDUCE(uint32_t); break;
  case ncclInt64: REDUCE(int64_t); break;
  case ncclUint64: REDUCE(uint64_t); break;
  case ncclUint8: REDUCE(uint8_t); break;
  case ncclInt8: REDUCE(int8_t); break;
  case ncclFloat32: REDUCE(float); break;
  case ncclFloat64: REDUCE(double); break;
  default: memmove(out, mine, count * type_size(t));
  }
}

static void trace(const char *what, size_t bytes) {
  if (debug_level() >= 2) fprintf(stderr, "fake-nccl: %s %zu bytes\n", what, bytes);
}

/* One collective call: its arguments, and what it does with every rank's offer. */
struct collective {
  const char *name;
  const void *send;
  void *recv;
  size_t count; /* elements of each rank's part */
  ncclDataType_t type;
  ncclRedOp_t op;
  int root;
  size_t parts;      /* parts each rank offers: 1, or nranks when it sends each its own */
  const void *offer; /* what this rank offers: send, unless said otherwise */
  /* Into recv, from every rank's offer (pointers into shared memory). */
  void (*combine)(ncclComm_t, const struct collective *, const unsigned char *const *all);
  size_t bytes; /* of each part: set by run() */
};

/* Exchanges this rank's offer and, when the data could be exchanged, combines every rank's
 * into recv. */
static ncclResult_t run(ncclComm_t comm, struct collective *op) {
  op->bytes = op->count * type_size(op->type);
  trace(op->name, op->bytes);
  const unsigned char *buf[MAX_RANKS];
  const void *offer = op->offer ? op->offer : op->send;
  const unsigned char *const *all = exchange(comm, offer, op->bytes * op->parts, buf);
  if (!all) return ncclSuccess;
  op->combine(comm, op, all);
  done_reading(comm);
  return ncclSuccess;
}

static void gather(ncclComm_t comm, const struct collective *op,
                   const unsigned char *const *all) {
  for (int r = 0; r < comm->nranks; r++)
    memmove((char *)op->recv + (size_t)r * op->bytes, all[r], op->bytes);
}

static void reduce_all(ncclComm_t comm, const struct collective *op,
                       const unsigned char *const *all) {
  reduce(op->recv, all, comm->nranks, op->count, op->type, op->op, op->send);
}

static void from_root(ncclComm_t comm, const struct collective *op,
                      const unsigned char *const *all) {
  memmove(op->recv, all[op->root], op->bytes);
}

/* Each rank reduces every rank's part for it. */
static void reduce_mine(ncclComm_t comm, const struct collective *op,
                        const unsigned char *const *all) {
  size_t at = (size_t)comm->rank * op->bytes;
  const unsigned char *mine[MAX_RANKS];
  for (int r = 0; r < comm->nranks; r++) mine[r] = all[r] + at;
  reduce(op->recv, mine, comm->nranks, op->count, op->type, op->op, (const char *)op->send + at);
}

/* Each rank gathers every rank's part for it. */
static void gather_mine(ncclComm_t comm, const struct collective *op,
                        const unsigned char *const *all) {
  size_t at = (size_t)comm->rank * op->bytes;
  for (int r = 0; r < comm->nranks; r++)
    memmove((char *)op->recv + (size_t)r * op->bytes, all[r] + at, op->bytes);
}

EXPORT ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t t,
                                  ncclComm_t comm, cudaStream_t stream) {
  if (!comm) return ncclInvalidArgument;
  struct collective op = {
      .name = "allgather", .send = send, .recv = recv, .count = count, .type = t, .parts = 1,
      .combine = gather};
  return run(comm, &op);
}

EXPORT ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t t,
                                  ncclRedOp_t redop, ncclComm_t comm, cudaStream_t stream) {
  if (!comm) return ncclInvalidArgument;
  struct collective op = {
      .name = "allreduce", .send = send, .recv = recv, .count = count, .type = t, .op = redop,
      .parts = 1, .combine = reduce_all};
  return run(comm, &op);
}

EXPORT ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t t,
                                  int root, ncclComm_t comm, cudaStream_t stream) {
  if (!comm || root < 0 || root >= comm->nranks) return ncclInvalidArgument;
  /* Non-root ranks may pass no send buffer: they offer their receive buffer. */
  struct collective op = {
      .name = "broadcast", .send = send, .recv = recv, .count = count, .type = t, .root = root,
      .parts = 1, .offer = send ? send : recv, .combine = from_root};
  return run(comm, &op);
}

EXPORT ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t t, int root,
                              ncclComm_t comm, cudaStream_t stream) {
  return ncclBroadcast(buff, buff, count, t, root, comm, stream);
}

EXPORT ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count,
                                      ncclDataType_t t, ncclRedOp_t redop, ncclComm_t comm,
                                      cudaStream_t stream) {
  if (!comm) return ncclInvalidArgument;
  struct collective op = {
      .name = "reduce-scatter", .send = send, .recv = recv, .count = count, .type = t,
      .op = redop, .parts = (size_t)comm->nranks, .combine = reduce_mine};
  return run(comm, &op);
}

EXPORT ncclResult_t ncclAlltoAll(const void *send, void *recv, size_t count, ncclDataType_t t,
                                 ncclComm_t comm, cudaStream_t stream) {
  if (!comm) return ncclInvalidArgument;
  struct collective op = {
      .name = "all-to-all", .send = send, .recv = recv, .count = count, .type = t,
      .parts = (size_t)comm->nranks, .combine = gather_mine};
  return run(comm, &op);
}

EXPORT ncclResult_t ncclGetVersion(int *version) {
  if (!version) return ncclInvalidArgument;
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  if (!id) return ncclInvalidArgument;
  memset(id, 0, sizeof *id);
  static _Atomic int made;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  snprintf(id->internal, sizeof id->internal, "%d-%ld%09ld-%d", (int)getpid(), (long)ts.tv_sec,
           ts.tv_nsec, atomic_fetch_add(&made, 1));
  return ncclSuccess;
}

static ncclResult_t new_comm(ncclComm_t *out, int nranks, int rank, const ncclUniqueId *id) {
  if (!out || nranks <= 0 || nranks > MAX_RANKS || rank < 0 || rank >= nranks)
    return ncclInvalidArgument;
  struct ncclComm *c = calloc(1, sizeof *c);
  if (!c) return ncclSystemError;
  c->nranks = nranks;
  c->rank = rank;
  cudaGetDevice(&c->device);
  const char *bytes = getenv("STEPWATCH_FAKE_NCCL_COMM_BYTES");
  size_t n = bytes ? strtoull(bytes, NULL, 10) : 0;
  if (n && cudaMalloc(&c->buffers, n) != cudaSuccess) {
    cudaGetLastError();
    free(c);
    return ncclUnhandledCudaError;
  }
  if (id && nranks > 1) open_mailboxes(c, id);
  *out = c;
  return ncclSuccess;
}

EXPORT ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
  return new_comm(comm, nranks, rank, &id);
}

EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                           ncclConfig_t *config) {
  return new_comm(comm, nranks, rank, &id);
}

EXPORT ncclResult_t ncclCommInitRankScalable(ncclComm_t *comm, int nranks, int rank, int nids,
                                             ncclUniqueId *ids, ncclConfig_t *config) {
  return new_comm(comm, nranks, rank, nids > 0 ? &ids[0] : NULL);
}

EXPORT ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist) {
  for (int i = 0; i < ndev; i++) {
    ncclResult_t r = new_comm(&comms[i], ndev, i, NULL); /* one process: nothing to exchange */
    if (r != ncclSuccess) return r;
  }
  return ncclSuccess;
}

EXPORT ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                                  ncclConfig_t *config) {
  if (!comm || !newcomm) return ncclInvalidArgument;
  if (color == NCCL_SPLIT_NOCOLOR) {
    *newcomm = NULL;
    return ncclSuccess;
  }
  /* Which ranks chose the same color is not known here: the new communicator
   * keeps the parent's size and rank, and exchanges nothing. */
  return new_comm(newcomm, comm->nranks, comm->rank, NULL);
}

static ncclResult_t drop_comm(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  if (comm->slots) {
    munmap(comm->slots, (size_t)comm->nranks * sizeof(struct slot));
    if (comm->rank == 0) shm_unlink(comm->shm_name);
  }
  if (comm->buffers) cudaFree(comm->buffers);
  free(comm);
  return ncclSuccess;
}

EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm) { return drop_comm(comm); }
EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm) { return drop_comm(comm); }

EXPORT ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
  if (!comm || !count) return ncclInvalidArgument;
  *count = comm->nranks;
  return ncclSuccess;
}

EXPORT ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
  if (!comm || !rank) return ncclInvalidArgument;
  *rank = comm->rank;
  return ncclSuccess;
}

EXPORT ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *err) {
  if (!err) return ncclInvalidArgument;
  *err = ncclSuccess;
  return ncclSuccess;
}

EXPORT ncclResult_t ncclCommMemStats(ncclComm_t comm, ncclCommMemStat_t stat, uint64_t *value) {
  if (value) *value = comm && comm->buffers ? 1 : 0;
  return ncclSuccess;
}

EXPORT const char *ncclGetErrorString(ncclResult_t r) {
  return r == ncclSuccess ? "no error" : "fake-nccl error";
}

EXPORT const char *ncclGetLastError(ncclComm_t comm) {
  return "";
}

EXPORT ncclResult_t ncclCommRegister(const ncclComm_t comm, void *buff, size_t size, void **handle) {
  if (handle) *handle = buff ? buff : (void *)comm;
  return ncclSuccess;
}

EXPORT ncclResult_t ncclCommWindowRegister(ncclComm_t comm, void *buff, size_t size,
                                           ncclWindow_t *win, int flags) {
  if (win) *win = (ncclWindow_t)buff;
  return ncclSuccess;
}

EXPORT ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t *op, void *scalar, ncclDataType_t type,
                                             ncclScalarResidence_t residence, ncclComm_t comm) {
  if (!op) return ncclInvalidArgument;
  *op = (ncclRedOp_t)ncclNumOps;
  return ncclSuccess;
}

EXPORT ncclResult_t ncclMemAlloc(void **ptr, size_t size) {
  return cudaMalloc(ptr, size) == cudaSuccess ? ncclSuccess : ncclUnhandledCudaError;
}

EXPORT ncclResult_t ncclMemFree(void *ptr) {
  return cudaFree(ptr) == cudaSuccess ? ncclSuccess : ncclUnhandledCudaError;
}
