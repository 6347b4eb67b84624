/*
 * A stand-in libcuda.so.1 for measuring ferry's own overhead on a machine without a GPU.
 *
 * Every call returns at once: "device" memory is host memory, copies are memcpy done inside the
 * call, events are always complete, streams are tokens. cuda.bindings loads it like the real
 * driver (LD_LIBRARY_PATH=<its folder>), so CudaBackend, the compiled fast path and the raw
 * bindings loop all run, and what a timing loop measures is the Python and wrapper cost of each
 * path, nothing of the device. benchmarks/probe_overhead.py builds it and runs the loops.
 *
 * Not a test double for semantics: nothing here is ever "not ready", gates do not hold, and
 * memory pools are reported unsupported (ferry then allocates with cuMemAlloc).
 *
 * FAKECUDA_VERSION (default 13000) is what cuDriverGetVersion says; below 12080 there is no
 * cuMemcpyBatchAsync, from 12080 to 12090 it has the 12.8 signature (with failIdx), from 13000 the
 * 13.0 one. FAKECUDA_NOCOPY=1 makes the three single copies skip their memcpy (host costs of large
 * transfers without the copy's time; the bytes are then wrong). fake_counts() reports how many copies,
 * batches and event calls were made.
 *
 * FAKECUDA_LATENCY_NS=N gives the single copies a device latency: a copy enqueued on a stream
 * "completes" N ns after the later of its enqueue and the stream's previous copy, an event recorded
 * there is ready from then on (cuEventQuery says not ready before), and cuEventSynchronize /
 * cuStreamSynchronize spin until then. A round trip then has a device's shape (the caller's work
 * between the enqueue and the completion overlaps the copy, the work before and after does not),
 * which is what decides a small transfer's latency against the raw driver's loop.
 *
 *   gcc -O2 -shared -fPIC -o libcuda.so.1 fake_cuda.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

static __thread void *current_ctx;
static char ctx_token, stream_tokens[4096];
static unsigned long long next_stream; /* streams handed out (atomic: lanes make theirs in parallel) */
static unsigned long long n_copies, n_batches, n_batched, n_records, n_queries;

static int skip_copies; /* FAKECUDA_NOCOPY, read once when the library loads (before any thread) */
static unsigned long long latency_ns; /* FAKECUDA_LATENCY_NS, likewise */

__attribute__((constructor)) static void read_environment(void) {
    const char *v = getenv("FAKECUDA_NOCOPY");
    skip_copies = v && atoi(v);
    v = getenv("FAKECUDA_LATENCY_NS");
    latency_ns = v ? strtoull(v, NULL, 10) : 0;
}

static unsigned long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (unsigned long long)t.tv_sec * 1000000000ull + (unsigned long long)t.tv_nsec;
}

static unsigned long long stream_done[4097]; /* when each stream's last copy completes (latency mode); [4096]: NULL */

static unsigned long long *done_of(void *s) {
    char *c = s;
    return c >= stream_tokens && c < stream_tokens + 4096 ? &stream_done[c - stream_tokens] : &stream_done[4096];
}

static unsigned long long last_copy_ns, last_done_ns;

/* fake_last_copy(out): when the last single copy was enqueued and when it completes (latency mode,
 * CLOCK_MONOTONIC ns, Python's time.perf_counter_ns clock): a probe's split of a round trip into the
 * caller's work before the enqueue and after the completion */
void fake_last_copy(unsigned long long out[2]) {
    out[0] = __atomic_load_n(&last_copy_ns, __ATOMIC_RELAXED);
    out[1] = __atomic_load_n(&last_done_ns, __ATOMIC_RELAXED);
}

/* latency mode: a copy on ``s`` completes ``latency_ns`` after the later of now and the stream's last one */
static void enqueue_latency(void *s) {
    if (!latency_ns) return;
    unsigned long long *done = done_of(s), start = now_ns(), prev = __atomic_load_n(done, __ATOMIC_RELAXED);
    unsigned long long end = (prev > start ? prev : start) + latency_ns;
    __atomic_store_n(done, end, __ATOMIC_RELEASE);
    __atomic_store_n(&last_copy_ns, start, __ATOMIC_RELAXED);
    __atomic_store_n(&last_done_ns, end, __ATOMIC_RELAXED);
}

static void spin_until(unsigned long long when) {
    while (when && now_ns() < when) {
    }
}
static int no_copy(void) { return skip_copies; }

static int driver_version(void) {
    const char *v = getenv("FAKECUDA_VERSION");
    return v ? atoi(v) : 13000;
}

/* fake_fail_next(copy_code, record_code): the next single copy (cuMemcpyHtoDAsync / DtoHAsync) and the
 * next cuEventRecord return these codes once (0: succeed). For tests of the refusal paths. */
static int fail_copy, fail_record;
void fake_fail_next(int copy_code, int record_code) {
    __atomic_store_n(&fail_copy, copy_code, __ATOMIC_RELAXED);
    __atomic_store_n(&fail_record, record_code, __ATOMIC_RELAXED);
}

static int take_failure(int *code) { return __atomic_exchange_n(code, 0, __ATOMIC_RELAXED); }

/* Every counter is updated with an atomic add: staging lanes call the driver from several threads at once. */
#define COUNT(n) __atomic_fetch_add(&(n), 1, __ATOMIC_RELAXED)
#define READ(n) __atomic_load_n(&(n), __ATOMIC_RELAXED)

void fake_counts(unsigned long long out[5]) {
    out[0] = READ(n_copies);
    out[1] = READ(n_batches);
    out[2] = READ(n_batched);
    out[3] = READ(n_records);
    out[4] = READ(n_queries);
}

/* fake_streams_made(): how many streams cuStreamCreate handed out (each takes the next token). */
unsigned long long fake_streams_made(void) { return READ(next_stream); }

CUresult cuInit(unsigned int flags) { (void)flags; return 0; }
CUresult cuDriverGetVersion(int *v) { *v = driver_version(); return 0; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return 0; }
CUresult cuDeviceGet(int *dev, int ordinal) { *dev = ordinal; return ordinal == 0 ? 0 : 101; }
CUresult cuDeviceGetName(char *name, int len, int dev) {
    (void)dev;
    strncpy(name, "fake device (benchmarks/fake_cuda.c)", (size_t)len);
    return 0;
}
CUresult cuDeviceTotalMem(size_t *bytes, int dev) { (void)dev; *bytes = (size_t)80 << 30; return 0; }
CUresult cuDeviceGetPCIBusId(char *bus, int len, int dev) {
    (void)dev;
    strncpy(bus, "0000:00:00.0", (size_t)len);
    return 0;
}
CUresult cuDeviceGetAttribute(int *value, int attribute, int dev) {
    (void)dev;
    switch (attribute) {
    case 40: *value = 2; break;  /* ASYNC_ENGINE_COUNT */
    case 75: *value = 9; break;  /* COMPUTE_CAPABILITY_MAJOR */
    default: *value = 0;         /* memory pools (115) and everything else: unsupported */
    }
    return 0;
}
CUresult cuDeviceCanAccessPeer(int *can, int a, int b) { (void)a; (void)b; *can = 0; return 0; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) { (void)dev; *ctx = &ctx_token; return 0; }
CUresult cuDevicePrimaryCtxRelease(int dev) { (void)dev; return 0; }
CUresult cuCtxGetCurrent(void **ctx) { *ctx = current_ctx; return 0; }
CUresult cuCtxSetCurrent(void *ctx) { current_ctx = ctx; return 0; }
CUresult cuCtxSynchronize(void) { return 0; }
CUresult cuCtxEnablePeerAccess(void *ctx, unsigned int flags) { (void)ctx; (void)flags; return 0; }

CUresult cuMemAlloc(CUdeviceptr *p, size_t n) {
    void *m = aligned_alloc(512, (n + 511) & ~(size_t)511);
    if (!m) return 2;
    *p = (CUdeviceptr)(uintptr_t)m;
    return 0;
}
CUresult cuMemFree(CUdeviceptr p) { free((void *)(uintptr_t)p); return 0; }
CUresult cuMemHostAlloc(void **p, size_t n, unsigned int flags) {
    (void)flags;
    *p = aligned_alloc(4096, (n + 4095) & ~(size_t)4095);
    return *p ? 0 : 2;
}
CUresult cuMemFreeHost(void *p) { free(p); return 0; }
CUresult cuMemHostRegister(void *p, size_t n, unsigned int flags) { (void)p; (void)n; (void)flags; return 0; }
CUresult cuMemHostUnregister(void *p) { (void)p; return 0; }
CUresult cuMemHostGetDevicePointer(CUdeviceptr *d, void *p, unsigned int flags) {
    (void)flags;
    *d = (CUdeviceptr)(uintptr_t)p;
    return 0;
}

CUresult cuStreamCreate(void **s, unsigned int flags) {
    (void)flags;
    *s = &stream_tokens[__atomic_fetch_add(&next_stream, 1, __ATOMIC_RELAXED) % 4096];
    return 0;
}
CUresult cuStreamDestroy(void *s) { (void)s; return 0; }
static unsigned long long n_stream_syncs, n_event_syncs;

/* fake_syncs(out): cuStreamSynchronize and cuEventSynchronize calls so far. */
void fake_syncs(unsigned long long out[2]) {
    out[0] = READ(n_stream_syncs);
    out[1] = READ(n_event_syncs);
}

CUresult cuStreamSynchronize(void *s) {
    COUNT(n_stream_syncs);
    spin_until(__atomic_load_n(done_of(s), __ATOMIC_ACQUIRE));
    return 0;
}
CUresult cuStreamQuery(void *s) { return now_ns() < __atomic_load_n(done_of(s), __ATOMIC_ACQUIRE) ? 600 : 0; }
CUresult cuStreamWaitEvent(void *s, void *e, unsigned int f) { (void)s; (void)e; (void)f; return 0; }
CUresult cuStreamWaitValue32(void *s, CUdeviceptr a, uint32_t v, unsigned int f) {
    (void)s; (void)a; (void)v; (void)f;
    return 0;
}
CUresult cuStreamWriteValue32(void *s, CUdeviceptr a, uint32_t v, unsigned int f) {
    (void)s; (void)f;
    *(volatile uint32_t *)(uintptr_t)a = v;
    return 0;
}

static unsigned long long n_event_creates, n_event_destroys;

/* fake_event_counts(out): events created and destroyed so far (a test's leak check). */
void fake_event_counts(unsigned long long out[2]) {
    out[0] = READ(n_event_creates);
    out[1] = READ(n_event_destroys);
}

/* an event is 16 bytes: when it is ready (latency mode; 0: always) */
CUresult cuEventCreate(void **e, unsigned int flags) {
    (void)flags;
    *e = calloc(1, 16);
    if (*e) COUNT(n_event_creates);
    return *e ? 0 : 2;
}
CUresult cuEventDestroy(void *e) {
    free(e);
    COUNT(n_event_destroys);
    return 0;
}
CUresult cuEventRecord(void *e, void *s) {
    if (__atomic_load_n(&fail_record, __ATOMIC_RELAXED)) return take_failure(&fail_record);
    COUNT(n_records);
    if (latency_ns) __atomic_store_n((unsigned long long *)e, __atomic_load_n(done_of(s), __ATOMIC_ACQUIRE),
                                     __ATOMIC_RELEASE);
    return 0;
}
CUresult cuEventQuery(void *e) {
    COUNT(n_queries);
    return latency_ns && now_ns() < __atomic_load_n((unsigned long long *)e, __ATOMIC_ACQUIRE) ? 600 : 0;
}
CUresult cuEventSynchronize(void *e) {
    COUNT(n_event_syncs);
    if (latency_ns) spin_until(__atomic_load_n((unsigned long long *)e, __ATOMIC_ACQUIRE));
    return 0;
}

CUresult cuMemcpyHtoDAsync(CUdeviceptr d, const void *h, size_t n, void *s) {
    (void)s;
    if (__atomic_load_n(&fail_copy, __ATOMIC_RELAXED)) return take_failure(&fail_copy);
    if (!no_copy()) memcpy((void *)(uintptr_t)d, h, n);
    COUNT(n_copies);
    enqueue_latency(s);
    return 0;
}
CUresult cuMemcpyDtoHAsync(void *h, CUdeviceptr d, size_t n, void *s) {
    (void)s;
    if (__atomic_load_n(&fail_copy, __ATOMIC_RELAXED)) return take_failure(&fail_copy);
    if (!no_copy()) memcpy(h, (const void *)(uintptr_t)d, n);
    COUNT(n_copies);
    enqueue_latency(s);
    return 0;
}
CUresult cuMemcpyDtoDAsync(CUdeviceptr d, CUdeviceptr s_, size_t n, void *s) {
    (void)s;
    if (!no_copy()) memmove((void *)(uintptr_t)d, (const void *)(uintptr_t)s_, n);
    COUNT(n_copies);
    return 0;
}

static CUresult batch(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, const void *attrs,
                      size_t *idxs, size_t nattrs) {
    if (!count || !attrs || !idxs || !nattrs || idxs[0] != 0 || *(const int *)attrs != 1) return 1;
    for (size_t i = 0; i < count; i++) memcpy((void *)(uintptr_t)dsts[i], (const void *)(uintptr_t)srcs[i], sizes[i]);
    COUNT(n_batches);
    __atomic_fetch_add(&n_batched, count, __ATOMIC_RELAXED);
    return 0;
}
CUresult fake_batch_v12080(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, void *attrs,
                           size_t *idxs, size_t nattrs, size_t *fail, void *s) {
    (void)s;
    *fail = SIZE_MAX;
    return batch(dsts, srcs, sizes, count, attrs, idxs, nattrs);
}
CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, void *attrs,
                            size_t *idxs, size_t nattrs, void *s) {
    (void)s;
    return batch(dsts, srcs, sizes, count, attrs, idxs, nattrs);
}

CUresult cuGetErrorName(CUresult e, const char **s) { (void)e; *s = "CUDA_ERROR_FAKE"; return 0; }
CUresult cuGetErrorString(CUresult e, const char **s) { (void)e; *s = "an error of the fake driver"; return 0; }

static void *self_handle(void) { /* this library, however it was loaded (RTLD_LOCAL included) */
    static void *handle;
    if (!handle) {
        Dl_info info;
        if (dladdr((void *)cuInit, &info)) handle = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    }
    return handle;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags);

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status) {
    (void)flags;
    *pfn = NULL;
    if (strcmp(symbol, "cuMemcpyBatchAsync") == 0) {
        int driver = driver_version();
        if (driver >= 13000 && version >= 13000)
            *pfn = (void *)cuMemcpyBatchAsync;
        else if (driver >= 12080 && version >= 12080)
            *pfn = (void *)fake_batch_v12080;
    } else if (strcmp(symbol, "cuGetProcAddress") == 0) {
        *pfn = version >= 12000 ? (void *)cuGetProcAddress_v2 : (void *)cuGetProcAddress;
    } else if (strncmp(symbol, "fake_", 5) != 0) {
        *pfn = dlsym(self_handle(), symbol);
    }
    if (status) *status = *pfn ? 0 : 1; /* CU_GET_PROC_ADDRESS_SUCCESS / SYMBOL_NOT_FOUND */
    return *pfn ? 0 : 500;              /* CUDA_ERROR_NOT_FOUND */
}
CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}
