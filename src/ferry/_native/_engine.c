/*
 * ferry._native._engine: the staging engine on native threads, and the small-transfer fast path.
 *
 * Two things live here. The staging engine (most of this essay and of the file) moves large
 * pageable arrays on native threads. The fast path (the last sections: "the fast path" and "host
 * copies for the small pageable route") makes the driver calls of ferry's pinned routes from the
 * caller's thread without a Python wrapper per call: Calls holds the entry points, resolved once,
 * and htod_record/dtoh_record (a copy and its event record in one call), event_record,
 * event_query, event_wait (polls with the GIL released, back in Python every 2 ms so a signal
 * handler's KeyboardInterrupt propagates), event_synchronize and copy_batch (a batch segment's
 * copies in one cuMemcpyBatchAsync, 12.8 or 13.0 ABI, or a loop of copies) are its methods.
 * Handles are raw integer CUstream/CUevent values; a failed call hands its CUresult and its stage
 * (nothing enqueued / copies enqueued, record failed / part of a batch enqueued) to a Python
 * callback, which binds the context and retries or raises. The fast path touches no ferry object:
 * ownership checks and state changes stay in Python. copy_in / address_of / memcopy are the small
 * pageable route's host copies (C-contiguous buffers through the buffer protocol).
 *
 * The staging engine: what it does
 * --------------------------------
 * A pageable NumPy array cannot be the target of a DMA. The engine moves it
 * through a bounded ring of page-locked *slots*: the host copies a chunk of
 * the array into a slot, the copy engine moves the slot to the device (and
 * the reverse for downloads). Python hands the engine a job (addresses,
 * sizes, shape and strides, all plain integers) and learns the outcome from
 * the job's completion. Native threads never touch a Python object and never
 * take the GIL.
 *
 * Threads
 * -------
 * An Engine serves one direction ("upload" or "download"). It owns N lanes.
 * A lane is one pthread with its own stream, `slots_per_lane` slots of
 * `slot_bytes` and one event per slot. The lane allocates all of that itself
 * on its own thread (after cuCtxSetCurrent on the given context) and frees
 * it on its own thread when it exits, so no other thread ever needs the
 * context to be current. The lane sleeps on its condition variable until a
 * *share* (the chunks of one job dealt to it) is queued.
 *
 * With driver_thread=True (the default) the engine also runs one *driver
 * thread*: the lanes only copy, and hand it their enqueues, hand-off records
 * and event waits, because a lane's own driver call right after a chunk's
 * host copy costs several times what a thread that does nothing else pays
 * (the essay above d_enqueue's definition says how much and how it waits).
 * Chunk copies from 64 KiB use streaming stores (copy_bytes).
 *
 * In emulated mode (no GPU), each lane also owns a stream worker: a second
 * pthread that runs the lane's "DMAs" (memcpy, then a sleep that models
 * nbytes / bandwidth + latency) and event records in order, so
 * a stream is asynchronous exactly as a CUDA stream is.
 *
 * Jobs, chunks, shares
 * --------------------
 * submit() cuts the array's C-order byte image into chunks (contiguous: raw
 * byte ranges; strided: sub-arrays along the axes, like plan_chunks in
 * _staging.py) and deals them round-robin to min(lanes, chunks) lanes,
 * starting at a rotating lane. A share is (job, first chunk, stride), so the
 * plan costs O(lanes) at submit time, whatever the array's size; a chunk's
 * geometry is computed by the lane when it gets to it. On an engine with
 * helpers a contiguous job of up to cooperative_max_bytes is one share
 * instead, a lead lane's, whose chunk copies idle lanes help with piece by
 * piece (cooperative jobs: see the essay above wake_helpers).
 *
 * Upload, per chunk: reap the slot (wait for its previous DMA through its
 * event), gather the chunk into the slot, enqueue HtoD, record the slot's
 * event. A share is reported complete when the event after its last DMA is
 * reaped: either when the lane reuses that slot, or, when the lane has no
 * more queued work, by reaping all busy slots before it sleeps. So a lane
 * starts the next job's host copies while the previous job's last DMAs are
 * in flight, and a job is done only once all of its DMAs completed.
 * Download, per share: enqueue DtoH into up to `slots` slots ahead, then for
 * each chunk wait its event, scatter the slot into the array, enqueue the
 * next DtoH into the freed slot. A download share ends with all its slots
 * idle. Either way each payload byte is copied by the host exactly once and
 * staging memory is exactly lanes * slots_per_lane * slot_bytes.
 *
 * Completion
 * ----------
 * job->remaining counts the lanes that still owe their share. The lane that
 * brings it to zero sets job->done (a release store, under the job's mutex)
 * and broadcasts the job's condition variable. done() is one acquire load;
 * wait() sleeps on the condition variable with the GIL released, in slices
 * of at most 5 ms, and checks Python signals between slices
 * (PyErr_CheckSignals: a KeyboardInterrupt raised by the handler propagates
 * out of wait()). With spin_us or wait_spin_us > 0, wait() first polls done (GIL released; with
 * wait_spin_us until the job's expected end and that long more, see Job_wait) and CUDA lanes poll a
 * slot's event (cuEventQuery) spin_us before they sleep: a thread's wake-up costs tens of
 * microseconds on a VM.
 *
 * Stream-order hand-off: posted events
 * ------------------------------------
 * A job submitted with hand_off=True has each of its shares *post*, once, an
 * event its lane records right after the share's last DMA: one of the lane's
 * HANDOFF_EVENTS hand-off events, taken in turn (not the slot's own event,
 * which the lane records again for every later chunk in that slot).
 * job.hand_off() sleeps until every share posted (every lane has *enqueued*
 * its part: the host copies are done, the last DMAs may still run) and lists
 * those events; a consumer stream that waits for each (cuStreamWaitEvent) is
 * ordered after every DMA of the job, on the device. The lane records a
 * hand-off event again only HANDOFF_EVENTS posts later; a wait made after
 * that (a hand-off that late) only waits longer, on the same stream, never
 * less. Events are waited while the engine is open: its lanes free them when
 * they exit, and hand_off() refuses a closed engine. A share that never enqueues its last
 * DMA (its job failed, or never ran) posts nothing, so a hand-off never
 * waits for a failed job: the job's error says what happened. Stream memory
 * operations (cuStreamWaitValue32 on words the lanes write) did this before;
 * they are invisible to the scheduler and can deadlock a consumer stream
 * against a lane's own DMA, which an H200 did.
 *
 * Failure
 * -------
 * The first driver error of a job is kept with its code; job->failed makes
 * every lane skip the job's remaining chunks. A lane that meets an error
 * *recovers*: it waits for every busy slot's event (attributing an error to
 * that slot's job), reports the shares those events end, then abandons all
 * of its slots (never reused, never freed on CUDA; counted in
 * abandoned_bytes) and allocates fresh ones. If that allocation fails the
 * lane is *broken*: every later share on it fails at once with that error.
 * An error is sticky (the context is unusable) for codes 700, 701, 702,
 * 714-719 and 999 on CUDA; in emulated mode sticky iff it came from
 * fail_next_copy(sticky=True) (code 719), after which the emulated device is
 * poisoned: every later emulated driver call fails with 719.
 *
 * Hold (tests)
 * ------------
 * hold() makes "not ready" observable: in emulated mode the stream workers
 * run no op until release() (lanes may still fill their slots, then block
 * on a slot's event); in CUDA mode lanes pause at the next chunk boundary,
 * before its host copy and DMA (DMAs already enqueued still run).
 * fail_next_copy(after, sticky) (emulated only) arms a fault like the
 * emulated backend's: the copy enqueued after the next `after` ones fails
 * when it runs (half of it is copied), and the failure surfaces at the next
 * event recorded on that lane's stream, as an asynchronous CUDA error does:
 * code 999 (not sticky) or, with sticky=True, code 719 and the emulated
 * device is poisoned.
 *
 * What the caller owns
 * --------------------
 * The host array and the device memory of a job must stay alive (and, for a
 * download, the output must not be read) until the job is done: the engine
 * holds addresses, never references. In emulated mode the "device" side is
 * a real host address: the caller translates the emulated backend's fake
 * device pointer to the memory behind it.
 *
 * Invariants
 * ----------
 * - A slot with busy=1 may still be touched by a DMA; it is reused only
 *   after its event was synchronized, and is freed only at close after
 *   every DMA completed. Abandoned slots are never reused.
 * - The lane's slot ring, cursor and busy flags are touched by the lane
 *   thread only (the driver thread reads a slot's event and records on the
 *   lane's stream only while that lane waits for its answer). Queues (and a
 *   lane's `sleeping` flag) are protected by the lane mutex, the driver
 *   thread's queue by its spinlock, job errors by the job mutex, emulated
 *   stream state by the stream mutex; counters that
 *   Python reads (done, failed, host_bytes, held/abandoned bytes) are C11
 *   atomics.
 * - A job is freed when its last reference goes: one for the Python Job
 *   object, one per share. A Python Job keeps its Engine object alive.
 * - close() waits for every queued job (it lifts a hold first), then joins
 *   the lanes, then stops the driver thread (no lane is left to ask it). tp_dealloc of an Engine created in another process (fork)
 *   touches neither threads nor locks: it leaks on purpose.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h> /* T_OBJECT_EX (Record's members) */

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h> /* SSE2: part of x86-64 itself */
#define HAVE_NT_COPY 1
#else
#define HAVE_NT_COPY 0
#endif

/* -- the few driver types, declared locally (no CUDA headers) ----------------------------------- */

typedef int CUresult;
typedef void *CUstream;
typedef void *CUevent;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;

#define CU_MEMHOSTALLOC_PORTABLE 0x01u
#define CU_STREAM_NON_BLOCKING 0x1u
#define CU_EVENT_BLOCKING_SYNC 0x1u
#define CU_EVENT_DISABLE_TIMING 0x2u

#define ERR_INVALID_VALUE 1
#define ERR_OUT_OF_MEMORY 2
#define ERR_NOT_SUPPORTED 801
#define ERR_NOT_READY 600
#define ERR_LAUNCH_FAILED 719
#define ERR_UNKNOWN 999

typedef CUresult (*fn_ctx_set_current)(CUcontext);
typedef CUresult (*fn_mem_host_alloc)(void **, size_t, unsigned int);
typedef CUresult (*fn_mem_free_host)(void *);
typedef CUresult (*fn_stream_create)(CUstream *, unsigned int);
typedef CUresult (*fn_stream_destroy)(CUstream);
typedef CUresult (*fn_event_create)(CUevent *, unsigned int);
typedef CUresult (*fn_event_destroy)(CUevent);
typedef CUresult (*fn_event_record)(CUevent, CUstream);
typedef CUresult (*fn_event_synchronize)(CUevent);
typedef CUresult (*fn_event_query)(CUevent);
typedef CUresult (*fn_memcpy_htod_async)(CUdeviceptr, const void *, size_t, CUstream);
typedef CUresult (*fn_memcpy_dtoh_async)(void *, CUdeviceptr, size_t, CUstream);
typedef CUresult (*fn_stream_wait_event)(CUstream, CUevent, unsigned int);
typedef CUresult (*fn_get_error_text)(CUresult, const char **);
typedef void *CUmemoryPool;
typedef CUresult (*fn_mem_alloc_from_pool_async)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
typedef CUresult (*fn_mem_free_async)(CUdeviceptr, CUstream);
typedef CUresult (*fn_stream_synchronize)(CUstream);

typedef struct {
    fn_ctx_set_current cuCtxSetCurrent;
    fn_mem_host_alloc cuMemHostAlloc;
    fn_mem_free_host cuMemFreeHost;
    fn_stream_create cuStreamCreate;
    fn_stream_destroy cuStreamDestroy;
    fn_event_create cuEventCreate;
    fn_event_destroy cuEventDestroy;
    fn_event_record cuEventRecord;
    fn_event_synchronize cuEventSynchronize;
    fn_memcpy_htod_async cuMemcpyHtoDAsync;
    fn_memcpy_dtoh_async cuMemcpyDtoHAsync;
    fn_event_query cuEventQuery;
    fn_stream_wait_event cuStreamWaitEvent;
    fn_get_error_text cuGetErrorName;   /* optional */
    fn_get_error_text cuGetErrorString; /* optional */
} driver_t;

/* Names Python must hand over (cuGetProcAddress, version >= 12000, so the _v2 ABIs). */
static const char *const DRIVER_NAMES[] = {
    "cuCtxSetCurrent",   "cuMemHostAlloc",    "cuMemFreeHost",     "cuStreamCreate",
    "cuStreamDestroy",   "cuEventCreate",     "cuEventDestroy",    "cuEventRecord",
    "cuEventSynchronize", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuEventQuery",
    "cuStreamWaitEvent", "cuGetErrorName",    "cuGetErrorString",
};
#define DRIVER_REQUIRED 13 /* the first 13 are required, the two error-text calls optional */
#define N_DRIVER_NAMES ((int)(sizeof(DRIVER_NAMES) / sizeof(DRIVER_NAMES[0])))
/* driver_t is filled by position from DRIVER_NAMES: one pointer per name, in the same order */
_Static_assert(sizeof(driver_t) == sizeof(DRIVER_NAMES) / sizeof(DRIVER_NAMES[0]) * sizeof(void *),
               "driver_t and DRIVER_NAMES must list the same entry points");

#define MAX_DIMS 64
#define MAX_LANES 64
#define MAX_SLOTS 64
#define SLICE_NS 50000000LL /* wait() checks signals at least this often */
#define HANDOFF_EVENTS 16   /* per lane: a posted event is recorded again only 16 posts later */

static int is_sticky_cuda(int code) {
    return code == 700 || code == 701 || code == 702 || (code >= 714 && code <= 719) || code == 999;
}

/* -- time ------------------------------------------------------------------------------------- */

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static struct timespec ts_of(int64_t ns) {
    struct timespec ts;
    ts.tv_sec = (time_t)(ns / 1000000000LL);
    ts.tv_nsec = (long)(ns % 1000000000LL);
    return ts;
}

/* A condition variable on CLOCK_MONOTONIC, so timed waits ignore wall-clock jumps. */
static int cond_init_monotonic(pthread_cond_t *cv) {
    pthread_condattr_t attr;
    if (pthread_condattr_init(&attr)) return -1;
    int rc = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    if (!rc) rc = pthread_cond_init(cv, &attr);
    pthread_condattr_destroy(&attr);
    return rc ? -1 : 0;
}

/* -- errors ----------------------------------------------------------------------------------- */

typedef struct {
    int code;
    int sticky;
    char text[200];
} err_t;

/* -- jobs ------------------------------------------------------------------------------------- */

typedef struct job {
    atomic_int refs;
    int upload;
    char *host;             /* the array's element [0, ..., 0] */
    CUdeviceptr dev;        /* device side (emulated: a real host address) */
    size_t nbytes;
    size_t itemsize;
    int ndim;
    int contiguous;
    int nontemporal; /* the engine's: chunk copies stream past the cache (copy_bytes) */
    int coop;        /* one lead share, each chunk's host copy shared with idle lanes (coop_copy) */
    size_t chunk_bytes;
    size_t nchunks;
    /* strided plan (like _staging.plan_chunks): chunks cut along `axis`, `per` indices each */
    int axis;
    size_t per;
    size_t nper; /* chunks per prefix: ceil(shape[axis] / per) */
    Py_ssize_t shape[MAX_DIMS];
    Py_ssize_t strides[MAX_DIMS];
    size_t step[MAX_DIMS]; /* bytes of one index step along each axis in the C-order image */
    /* outcome */
    atomic_int done;
    atomic_int failed;
    atomic_int remaining;
    atomic_size_t host_bytes;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    err_t err; /* under mu; valid once failed */
    /* hand-off (see the essay): shares that have not posted yet, and the events they posted */
    atomic_int unposted;
    int nposted;                /* under mu */
    void *posted[MAX_LANES];    /* under mu */
    int nlanes;
    /* timeline (CLOCK_MONOTONIC ns; 0 = not yet): for Job.timeline(), cheap enough to keep always */
    int64_t t_submit;
    atomic_llong t_start_first, t_start_last, t_copy_last, t_enqueue_last, t_done;
    atomic_llong n_enqueues, enqueue_ns, lock_wait_ns; /* summed over the lanes' d_enqueue calls */
    struct chunk_trace *trace; /* per chunk, for Job.chunk_times(): NULL above TRACE_CHUNKS chunks */
} job_t;

/* One chunk's path through its lane (CLOCK_MONOTONIC ns; each chunk is written by its lane only). An upload:
 * the lane took it up, its copy began (after any wait for the slot) and ended, its enqueue was answered. A
 * download: its DMA was handed over and answered, its copy out began (after the DMA's end) and ended. */
#define TRACE_CHUNKS 1024
typedef struct chunk_trace {
    int lane;
    int64_t t[4];
} chunk_trace_t;

static inline void trace_at(job_t *job, size_t k, int lane, int i) {
    if (!job->trace) return;
    job->trace[k].lane = lane;
    job->trace[k].t[i] = now_ns();
}

static void at_min(atomic_llong *a, long long v) {
    long long cur = atomic_load_explicit(a, memory_order_relaxed);
    while ((cur == 0 || v < cur) &&
           !atomic_compare_exchange_weak_explicit(a, &cur, v, memory_order_relaxed, memory_order_relaxed)) {
    }
}

static void at_max(atomic_llong *a, long long v) {
    long long cur = atomic_load_explicit(a, memory_order_relaxed);
    while (v > cur &&
           !atomic_compare_exchange_weak_explicit(a, &cur, v, memory_order_relaxed, memory_order_relaxed)) {
    }
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void job_decref(job_t *job) {
    if (atomic_fetch_sub_explicit(&job->refs, 1, memory_order_acq_rel) == 1) {
        pthread_mutex_destroy(&job->mu);
        pthread_cond_destroy(&job->cv);
        free(job->trace);
        free(job);
    }
}

static void job_fail(job_t *job, const err_t *e) {
    pthread_mutex_lock(&job->mu);
    if (!atomic_load_explicit(&job->failed, memory_order_relaxed)) {
        job->err = *e;
        atomic_store_explicit(&job->failed, 1, memory_order_release);
    }
    pthread_mutex_unlock(&job->mu);
}

static void job_complete(job_t *job) {
    atomic_store_explicit(&job->t_done, now_ns(), memory_order_relaxed);
    pthread_mutex_lock(&job->mu);
    atomic_store_explicit(&job->done, 1, memory_order_release);
    pthread_cond_broadcast(&job->cv);
    pthread_mutex_unlock(&job->mu);
}

typedef struct {
    size_t offset; /* in the C-order image (and on the device) */
    size_t nbytes;
    char *host;    /* strided: the sub-array's first element */
    int nd;        /* strided: the sub-array's dims */
    Py_ssize_t len[MAX_DIMS];
    Py_ssize_t str[MAX_DIMS];
} chunk_t;

static void job_chunk(const job_t *job, size_t k, chunk_t *c) {
    if (job->contiguous) {
        c->offset = k * job->chunk_bytes;
        c->nbytes = job->nbytes - c->offset < job->chunk_bytes ? job->nbytes - c->offset : job->chunk_bytes;
        c->host = job->host + c->offset;
        c->nd = 0;
        return;
    }
    size_t prefix = k / job->nper;
    size_t r = k % job->nper;
    size_t start = r * job->per;
    size_t count = (size_t)job->shape[job->axis] - start;
    if (count > job->per) count = job->per;
    Py_ssize_t host_off = 0;
    size_t image_off = 0;
    for (int a = job->axis - 1; a >= 0; a--) { /* decompose prefix over shape[:axis], C order */
        size_t idx = prefix % (size_t)job->shape[a];
        prefix /= (size_t)job->shape[a];
        host_off += (Py_ssize_t)idx * job->strides[a];
        image_off += idx * job->step[a];
    }
    host_off += (Py_ssize_t)start * job->strides[job->axis];
    image_off += start * job->step[job->axis];
    c->offset = image_off;
    c->nbytes = count * job->step[job->axis];
    c->host = job->host + host_off;
    c->nd = job->ndim - job->axis;
    c->len[0] = (Py_ssize_t)count;
    c->str[0] = job->strides[job->axis];
    for (int a = job->axis + 1; a < job->ndim; a++) {
        c->len[a - job->axis] = job->shape[a];
        c->str[a - job->axis] = job->strides[a];
    }
}

/*
 * A lane's host copy. From NT_MIN_BYTES up, with `nt`, the stores are non-temporal (x86-64: SSE2
 * streaming stores, then a fence): the bytes go to memory without first reading their cache lines and
 * without evicting the lane's working set. A staged chunk is written once and read next by a DMA (or,
 * downloading, by the user much later), so caching it buys nothing; what the cache held instead is the
 * driver's own state, which the chunk's enqueue right after the copy needs (measured on the H200 VM: an
 * enqueue costs 1.7 - 3.5 us from a thread with warm caches, 12 - 24 us right after a 1 MiB memcpy).
 * Elsewhere, and below the threshold, memcpy.
 */
#define NT_MIN_BYTES ((size_t)64 << 10)

static void copy_bytes(char *dst, const char *src, size_t n, int nt) {
#if HAVE_NT_COPY
    if (nt && n >= NT_MIN_BYTES) {
        size_t head = (64 - ((uintptr_t)dst & 63)) & 63; /* aligned, whole cache lines (16 bytes needed) */
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        for (size_t blocks = n / 64; blocks; blocks--) {
            __m128i a = _mm_loadu_si128((const __m128i *)(const void *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(const void *)(src + 48));
            _mm_stream_si128((__m128i *)(void *)dst, a);
            _mm_stream_si128((__m128i *)(void *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(void *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(void *)(dst + 48), d);
            src += 64;
            dst += 64;
        }
        _mm_sfence(); /* the streamed bytes are globally visible before the DMA is enqueued */
        memcpy(dst, src, n % 64);
        return;
    }
#endif
    (void)nt;
    memcpy(dst, src, n);
}

#define COPIER_MIN_PIECE ((size_t)16 << 10) /* the smallest piece of a shared copy */

/* One host copy cut into pieces that several threads claim from one atomic counter (the copier
 * below, and a staging lane with its idle lanes as helpers: coop_copy). */
typedef struct copy_task {
    char *dst;
    const char *src;
    size_t n, piece, pieces;
    int nt;
    unsigned long long seq;
    atomic_size_t next; /* the next piece to claim */
    atomic_size_t done; /* pieces copied */
} copy_task_t;

static void copier_piece(const copy_task_t *t, size_t k) {
    size_t off = k * t->piece;
    size_t len = t->n - off < t->piece ? t->n - off : t->piece;
    copy_bytes(t->dst + off, t->src + off, len, t->nt);
}

/* Claim and copy pieces until none is left; how many this thread copied. */
static size_t copier_drain(copy_task_t *t) {
    size_t k, got = 0;
    while ((k = atomic_fetch_add(&t->next, 1)) < t->pieces) {
        copier_piece(t, k);
        atomic_fetch_add_explicit(&t->done, 1, memory_order_release);
        got++;
    }
    return got;
}

/* The i-th poll of a wait for other threads: spin first, then yield (the awaited one may be preempted). */
static inline void backoff(unsigned i) {
    if (i < 4096) cpu_relax();
    else sched_yield();
}

static void task_init(copy_task_t *t, char *dst, const char *src, size_t n, size_t piece, int nt,
                      unsigned long long seq) {
    t->dst = dst;
    t->src = src;
    t->n = n;
    t->piece = piece;
    t->pieces = (n + piece - 1) / piece;
    t->nt = nt;
    t->seq = seq;
    atomic_init(&t->next, 0);
    atomic_init(&t->done, 0);
}

/* The poster's end of a shared copy: wait until every piece is copied, withdraw the task from
 * `posted`, then wait until no helper may still read it. A helper counts itself in `active` before it
 * loads the task pointer, so once `active` reads 0 after the withdrawal none can reach `t` (it lives on
 * the poster's stack). Both waits yield after a while: a helper may be preempted in its piece. */
static void task_retire(copy_task_t *t, _Atomic(copy_task_t *) *posted, atomic_int *active) {
    for (unsigned i = 0; atomic_load_explicit(&t->done, memory_order_acquire) < t->pieces; i++) backoff(i);
    atomic_store(posted, NULL);
    for (unsigned i = 0; atomic_load(active); i++) backoff(i);
}

/* Copy one run of `e` bytes `m` times, host side stepping by `s`, image side contiguous. */
static inline void copy_row(char *img, char *host, size_t e, Py_ssize_t m, Py_ssize_t s, int gather) {
#define ROW(T)                                                                                  \
    do {                                                                                        \
        for (Py_ssize_t j = 0; j < m; j++) {                                                    \
            T v;                                                                                \
            if (gather) {                                                                       \
                memcpy(&v, host + j * s, sizeof(T));                                            \
                memcpy(img + (size_t)j * sizeof(T), &v, sizeof(T));                             \
            } else {                                                                            \
                memcpy(&v, img + (size_t)j * sizeof(T), sizeof(T));                             \
                memcpy(host + j * s, &v, sizeof(T));                                            \
            }                                                                                   \
        }                                                                                       \
    } while (0)
    switch (e) {
    case 1: ROW(uint8_t); return;
    case 2: ROW(uint16_t); return;
    case 4: ROW(uint32_t); return;
    case 8: ROW(uint64_t); return;
    default: break;
    }
#undef ROW
    for (Py_ssize_t j = 0; j < m; j++) {
        if (gather)
            memcpy(img + (size_t)j * e, host + j * s, e);
        else
            memcpy(host + j * s, img + (size_t)j * e, e);
    }
}

/* Move a chunk between the array and `img` (its C-order bytes): gather=1 array -> img. */
static void chunk_copy(const job_t *job, const chunk_t *c, char *img, int gather) {
    int nt = job->nontemporal;
    if (c->nd == 0) {
        if (gather)
            copy_bytes(img, c->host, c->nbytes, nt);
        else
            copy_bytes(c->host, img, c->nbytes, nt);
        return;
    }
    /* normalize: the innermost host-contiguous run of e bytes, then one row dim (m, s), then outer dims */
    size_t e = job->itemsize;
    int i = c->nd - 1;
    while (i >= 0 && (c->len[i] == 1 || c->str[i] == (Py_ssize_t)e)) {
        e *= (size_t)c->len[i];
        i--;
    }
    Py_ssize_t m = 1, s = 0;
    if (i >= 0) {
        m = c->len[i];
        s = c->str[i];
        i--;
    }
    int outer = 0;
    Py_ssize_t olen[MAX_DIMS], ostr[MAX_DIMS], idx[MAX_DIMS];
    for (int a = 0; a <= i; a++) {
        if (c->len[a] == 1) continue;
        olen[outer] = c->len[a];
        ostr[outer] = c->str[a];
        idx[outer] = 0;
        outer++;
    }
    size_t row_bytes = e * (size_t)m;
    char *host = c->host;
    for (;;) {
        if (m == 1 || s == (Py_ssize_t)e) { /* the row is contiguous too */
            if (gather)
                copy_bytes(img, host, row_bytes, nt);
            else
                copy_bytes(host, img, row_bytes, nt);
        } else {
            copy_row(img, host, e, m, s, gather);
        }
        img += row_bytes;
        int a = outer - 1; /* odometer over the outer dims */
        for (; a >= 0; a--) {
            host += ostr[a];
            if (++idx[a] < olen[a]) break;
            host -= ostr[a] * olen[a];
            idx[a] = 0;
        }
        if (a < 0) break;
    }
}

/* -- shares and slots -------------------------------------------------------------------------- */

typedef struct share {
    struct share *next;
    job_t *job;
    size_t first;
    size_t stride;
    size_t copied;
    int posts;  /* a share of a job submitted with hand_off=True */
    int posted; /* it posted (lane thread only) */
} share_t;

typedef struct emu_event {
    uint64_t recorded;
    uint64_t done;
    int error; /* the failure carried by generation `done`, or 0 */
} emu_event_t;

typedef struct {
    char *ptr;
    void *ev;        /* CUevent, or emu_event_t* */
    int busy;        /* a DMA may touch the slot until the event is reaped */
    job_t *job;      /* whose chunk last used it (not a reference: its share holds one) */
    share_t *ends;   /* the share that completes when this slot's event is reaped */
} slot_t;

typedef struct abandoned {
    struct abandoned *next;
    char *ptr;
    void *ev;
} abandoned_t;

struct engine;

/* -- emulated streams --------------------------------------------------------------------------- */

enum { OP_COPY, OP_RECORD, OP_STOP };

typedef struct emu_op {
    struct emu_op *next;
    int kind;
    char *dst;
    const char *src;
    size_t n;
    int fail; /* 0, or the code this copy fails with */
    emu_event_t *ev;
    uint64_t gen;
} emu_op_t;

typedef struct {
    struct engine *eng;
    pthread_t thread;
    int started;
    pthread_mutex_t mu;
    pthread_cond_t cv;      /* ops queued, hold lifted */
    pthread_cond_t done_cv; /* an event completed */
    emu_op_t *head, *tail;
    emu_op_t *stop_op; /* allocated up front, so that stopping cannot fail */
    int pending_error; /* set by a failed copy, taken by the next record */
} emu_stream_t;

/* -- lanes and the engine ------------------------------------------------------------------------ */

typedef struct lane {
    struct engine *eng;
    int index;
    pthread_t thread;
    int started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    share_t *head, *tail;
    int stopping;
    atomic_int queued; /* shares in the queue, for the idle spin (read without the mutex) */
    int sleeping;      /* in pthread_cond_wait on cv; under mu: a submitter signals only such a lane */
    atomic_int answer_sleeping; /* asleep on cv for the driver thread's answer (set under mu) */
    /* lane-private from here */
    CUstream stream;
    emu_stream_t *es;
    slot_t slots[MAX_SLOTS];
    int nslots;
    size_t cursor;
    slot_t *cur_last; /* the slot of the current share's latest DMA, NULL after a recovery */
    int broken;
    err_t broken_err;
    abandoned_t *abandoned; /* emulated only: freed once the stream worker is joined */
    void *handoff[HANDOFF_EVENTS]; /* CUevent or emu_event_t*: recorded after a posting share's last DMA */
    int nhandoff;                  /* how many were made (all, once set up) */
    unsigned handoff_next;         /* the next to record (lane thread only) */
    /* a cooperative job's lead posts its chunk's copy here for idle lanes (see coop_copy) */
    _Atomic(copy_task_t *) help_task;
    atomic_ullong help_posted; /* the seq of the last copy posted */
    atomic_int help_active; /* helpers that may be reading help_task */
    int help_woken;         /* under mu: a lead woke this sleeping lane to help (one signal is enough) */
} lane_t;

typedef struct engine {
    int emulated;
    int upload;
    int nlanes;
    int slots_per_lane;
    size_t slot_bytes;
    size_t min_chunk_bytes;
    double bandwidth;
    double latency;
    int64_t spin_ns;      /* poll an event (and a job in wait()) this long before sleeping on it */
    int64_t idle_spin_ns; /* an idle lane polls its queue this long before sleeping */
    int min_chunks_per_lane;
    int nontemporal; /* chunk copies with streaming stores (copy_bytes) */
    int serialize; /* CUDA: enqueue through g_driver_lock */
    int64_t wait_spin_ns; /* Job.wait polls done this long before sleeping (the caller's thread) */
    int64_t lane_wait_ns; /* a lane waits this long for the driver thread's answer awake, then sleeps */
    /* cooperative jobs (coop_copy): idle lanes that help a lead copy, piece by piece */
    int helpers;          /* the most lanes a lead wakes to help it (0: no cooperative jobs) */
    int lead_copies;      /* the lead copies pieces too (False only in tests: helpers copy everything) */
    size_t piece_bytes;   /* a piece of a shared chunk copy */
    size_t coop_max_bytes; /* larger jobs are dealt to the lanes (one lead's slots cannot keep the link busy) */
    int64_t help_spin_ns; /* a helper polls for the next posted copy this long, then sleeps */
    atomic_int leads;     /* cooperative jobs submitted whose lead has not finished copying */
    atomic_int idle_sleepers; /* lanes asleep with nothing queued, not yet woken to help */
    atomic_int helping;       /* lanes inside help() */
    atomic_int waking;        /* lanes woken to help that have not woken up yet */
    atomic_ullong task_seq;   /* the last posted copy's seq */
    atomic_ullong helped;     /* pieces copied by helpers */
    atomic_ullong coop_jobs;  /* cooperative jobs submitted */
    /* the driver thread (see the essay above d_enqueue): NULL where the lanes call the driver themselves */
    struct driver_thread *dt;
    CUcontext ctx;
    driver_t drv;
    pid_t pid;
    lane_t lanes[MAX_LANES];
    pthread_mutex_t mu; /* submit/close, lane rotation, ready handshake, faults */
    pthread_cond_t cv;  /* ready handshake, hold */
    int ready;
    int setup_failed;
    err_t setup_err;
    int next_lane;
    int closing;
    int closed;
    atomic_int held;
    atomic_llong held_bytes;
    atomic_llong abandoned_bytes;
    /* emulated faults */
    int fail_armed;
    int fail_after;
    int fail_sticky;
    atomic_int poison;
} engine_t;

/* -- error texts --------------------------------------------------------------------------------- */

static void make_err(const engine_t *eng, int code, const char *op, err_t *e) {
    e->code = code;
    if (eng->emulated) {
        e->sticky = code == ERR_LAUNCH_FAILED;
        const char *what;
        switch (code) {
        case ERR_UNKNOWN: what = "emulated copy failure (injected)"; break;
        case ERR_LAUNCH_FAILED: what = "emulated copy failure (injected, sticky: the emulated device is poisoned)"; break;
        case ERR_OUT_OF_MEMORY: what = "out of host memory"; break;
        default: what = "emulated driver error"; break;
        }
        snprintf(e->text, sizeof e->text, "%s (in %s)", what, op);
        return;
    }
    e->sticky = is_sticky_cuda(code);
    const char *name = NULL, *desc = NULL;
    if (eng->drv.cuGetErrorName && eng->drv.cuGetErrorName(code, &name) != 0) name = NULL;
    if (eng->drv.cuGetErrorString && eng->drv.cuGetErrorString(code, &desc) != 0) desc = NULL;
    if (name && desc)
        snprintf(e->text, sizeof e->text, "%s: %s (in %s)", name, desc, op);
    else
        snprintf(e->text, sizeof e->text, "CUresult %d (in %s)", code, op);
}

/* -- emulated device ------------------------------------------------------------------------------- */

static int emu_push(emu_stream_t *es, emu_op_t *op) {
    op->next = NULL;
    pthread_mutex_lock(&es->mu);
    if (es->tail)
        es->tail->next = op;
    else
        es->head = op;
    es->tail = op;
    pthread_cond_signal(&es->cv);
    pthread_mutex_unlock(&es->mu);
    return 0;
}

static void sleep_until(int64_t deadline) {
    struct timespec ts = ts_of(deadline);
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

static void *emu_stream_main(void *arg) {
    emu_stream_t *es = arg;
    engine_t *eng = es->eng;
    for (;;) {
        pthread_mutex_lock(&es->mu);
        while (!es->head || (atomic_load(&eng->held) && es->head->kind != OP_STOP))
            pthread_cond_wait(&es->cv, &es->mu);
        emu_op_t *op = es->head;
        es->head = op->next;
        if (!es->head) es->tail = NULL;
        pthread_mutex_unlock(&es->mu);
        switch (op->kind) {
        case OP_STOP:
            free(op);
            return NULL;
        case OP_COPY: {
            int64_t start = now_ns();
            if (!op->fail) {
                memcpy(op->dst, op->src, op->n);
            } else {
                memcpy(op->dst, op->src, op->n / 2); /* a torn copy */
                if (op->fail == ERR_LAUNCH_FAILED) atomic_store(&eng->poison, ERR_LAUNCH_FAILED);
                pthread_mutex_lock(&es->mu);
                if (!es->pending_error) es->pending_error = op->fail;
                pthread_mutex_unlock(&es->mu);
            }
            int64_t deadline = start + (int64_t)((eng->latency + (double)op->n / eng->bandwidth) * 1e9);
            if (deadline - now_ns() > 20000) sleep_until(deadline);
            break;
        }
        case OP_RECORD:
            pthread_mutex_lock(&es->mu);
            op->ev->done = op->gen;
            op->ev->error = es->pending_error;
            es->pending_error = 0;
            pthread_cond_broadcast(&es->done_cv);
            pthread_mutex_unlock(&es->mu);
            break;
        default:
            break;
        }
        free(op);
    }
}

static int emu_enqueue_copy(lane_t *L, char *dst, const char *src, size_t n) {
    engine_t *eng = L->eng;
    int poison = atomic_load(&eng->poison);
    if (poison) return poison;
    emu_op_t *op = calloc(1, sizeof *op);
    if (!op) return ERR_OUT_OF_MEMORY;
    op->kind = OP_COPY;
    op->dst = dst;
    op->src = src;
    op->n = n;
    pthread_mutex_lock(&eng->mu);
    if (eng->fail_armed) {
        if (eng->fail_after > 0) {
            eng->fail_after--;
        } else {
            op->fail = eng->fail_sticky ? ERR_LAUNCH_FAILED : ERR_UNKNOWN;
            eng->fail_armed = 0;
        }
    }
    pthread_mutex_unlock(&eng->mu);
    return emu_push(L->es, op);
}

static int emu_record(lane_t *L, emu_event_t *ev) {
    int poison = atomic_load(&L->eng->poison);
    if (poison) return poison;
    emu_op_t *op = calloc(1, sizeof *op);
    if (!op) return ERR_OUT_OF_MEMORY;
    op->kind = OP_RECORD;
    op->ev = ev;
    pthread_mutex_lock(&L->es->mu);
    op->gen = ++ev->recorded;
    pthread_mutex_unlock(&L->es->mu);
    return emu_push(L->es, op);
}

static int emu_sync(lane_t *L, emu_event_t *ev) {
    emu_stream_t *es = L->es;
    pthread_mutex_lock(&es->mu);
    uint64_t want = ev->recorded;
    while (ev->done < want) pthread_cond_wait(&es->done_cv, &es->mu);
    int err = ev->done == want ? ev->error : 0;
    pthread_mutex_unlock(&es->mu);
    if (err) return err;
    return atomic_load(&L->eng->poison);
}

static emu_stream_t *emu_stream_start(engine_t *eng, int *code) {
    emu_stream_t *es = calloc(1, sizeof *es);
    if (!es) {
        *code = ERR_OUT_OF_MEMORY;
        return NULL;
    }
    es->eng = eng;
    es->stop_op = calloc(1, sizeof *es->stop_op);
    if (!es->stop_op) goto fail_mu;
    es->stop_op->kind = OP_STOP;
    if (pthread_mutex_init(&es->mu, NULL)) goto fail_mu;
    if (pthread_cond_init(&es->cv, NULL)) goto fail_cv;
    if (pthread_cond_init(&es->done_cv, NULL)) goto fail_done;
    if (pthread_create(&es->thread, NULL, emu_stream_main, es)) goto fail_thread;
    es->started = 1;
    return es;
fail_thread:
    pthread_cond_destroy(&es->done_cv);
fail_done:
    pthread_cond_destroy(&es->cv);
fail_cv:
    pthread_mutex_destroy(&es->mu);
fail_mu:
    free(es->stop_op);
    free(es);
    *code = ERR_OUT_OF_MEMORY;
    return NULL;
}

/* Runs every queued op first (close lifts a hold before it stops the lanes). */
static void emu_stream_stop(emu_stream_t *es) {
    emu_push(es, es->stop_op); /* the worker frees it */
    pthread_join(es->thread, NULL);
    pthread_cond_destroy(&es->done_cv);
    pthread_cond_destroy(&es->cv);
    pthread_mutex_destroy(&es->mu);
    free(es);
}

/* -- the driver seam: one function per operation, CUDA or emulated ---------------------------------- */

/*
 * CUDA enqueue calls from many lanes at once convoy on the driver's internal lock (measured on an
 * H200 VM: 13-20 us per chunk, serialized). With serialize_driver (the default) every enqueue and
 * poll in this process goes through one spinlock instead, so the driver's lock is never contended
 * and a hand-over costs a cache line, not a futex wake-up. Held for a few microseconds at most.
 */
static atomic_int g_driver_lock;

static inline void driver_lock(const engine_t *eng) {
    if (!eng->serialize) return;
    for (unsigned spins = 0;;) {
        if (!atomic_exchange_explicit(&g_driver_lock, 1, memory_order_acquire)) return;
        while (atomic_load_explicit(&g_driver_lock, memory_order_relaxed)) {
            if (++spins < 4096)
                cpu_relax();
            else
                sched_yield(); /* the holder is stalled in the driver (another thread's long call): back off */
        }
    }
}

static inline void driver_unlock(const engine_t *eng) {
    if (eng->serialize) atomic_store_explicit(&g_driver_lock, 0, memory_order_release);
}

/*
 * The driver thread. A lane's enqueue right after its chunk's host copy is slow: measured on the H200
 * VM (benchmarks/probe_enqueue.py, the job timeline's enqueue_us), a copy and event record cost 12 - 24
 * us from a lane against 2.8 us from a thread that calls the driver all the time, 4.5 - 9 us right
 * after a 1 MiB host copy: the lane's caches and TLB hold the chunk, not the driver's state. Eight
 * lanes' enqueues, serialized, then take 100 - 290 us of an 8 MiB upload. With a driver thread the
 * lanes only copy: each hands its enqueue (and its hand-off record) to this one thread, which makes
 * every enqueue of the engine with its caches warm, and waits for the answer (spinning: the thread
 * answers within microseconds). Requests run in arrival order; a lane's next request waits for its
 * last, so each stream's order is the lane's. While any share runs (and `idle_ns` after the last one)
 * the thread polls its queue; then it sleeps, and a submission or a request wakes it (a submission
 * first: the thread is up before the job's first copy ends). Emulated engines run it too, so the
 * CPU-only tests cover it.
 */
enum { DREQ_ENQUEUE, DREQ_POST, DREQ_SYNC };

#define DT_SPIN_NS 20000LL /* spin this long (a lane for its answer, the thread after its last request), then yield */
#define DT_SYNC_NS 2000000LL /* the thread polls a slot's event this long, then the lane sleeps on it itself */
#define DT_LANE_SLEEP_NS 100000LL /* a lane waits this long for an answer awake (a DMA's tail), then sleeps:
                                    * the default of Engine(lane_wait_us=) */
#define DT_POLL_NS 2000LL /* polled events are queried this often (the driver lock is left to enqueuers between) */
#define DT_ACTIVE_IDLE_NS 1000000LL /* no request this long while shares run: lanes held or asleep, sleep too */
#define DT_NET_NS 1000000000LL /* a sleeping driver thread's safety net (wakes are signalled) */

typedef struct dreq {
    struct dreq *next;
    int kind;
    struct lane *L;
    slot_t *slot;
    char *host_side;
    CUdeviceptr dev;
    size_t n;
    void *ev;       /* DREQ_POST: the event recorded; DREQ_SYNC: the slot's event, polled */
    const char *op; /* the failing call, where rc != 0 */
    int rc;
    int64_t since; /* DREQ_SYNC: when the thread began polling it */
    atomic_int done;
} dreq_t;

typedef struct driver_thread {
    struct engine *eng;
    pthread_t thread;
    atomic_int lock; /* the queue's spinlock: held for a few instructions */
    dreq_t *head, *tail;
    dreq_t *polled; /* DREQ_SYNC requests whose event is not complete yet (the thread's own list) */
    atomic_int queued;
    atomic_int active;   /* shares the lanes run: the thread polls while any does */
    atomic_int sleeping; /* in pthread_cond_wait (set under mu) */
    atomic_int stop;
    int64_t idle_ns;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int ready; /* under mu: 1 up, -1 failed (setup_rc) */
    int setup_rc;
    int one_stream; /* CUDA: every DMA of the engine goes on `stream`, in request order */
    CUstream stream;
} driver_thread_t;

static inline void spin_lock(atomic_int *l) {
    while (atomic_exchange_explicit(l, 1, memory_order_acquire))
        while (atomic_load_explicit(l, memory_order_relaxed)) cpu_relax();
}

static inline void spin_unlock(atomic_int *l) { atomic_store_explicit(l, 0, memory_order_release); }

static void dt_wake(driver_thread_t *dt) {
    if (!atomic_load(&dt->sleeping)) return; /* seq_cst: pairs with the thread's store before it sleeps */
    pthread_mutex_lock(&dt->mu);
    pthread_cond_signal(&dt->cv);
    pthread_mutex_unlock(&dt->mu);
}

static int d_enqueue_now(lane_t *L, slot_t *slot, char *host_side, CUdeviceptr dev, size_t n, const char **op);
static int d_post_record_now(lane_t *L, void **ev);
static int d_query(lane_t *L, void *ev);

static void dt_answer(dreq_t *r, int rc) {
    lane_t *L = r->L; /* read before done: r lives on the lane's stack */
    r->rc = rc;
    atomic_store(&r->done, 1); /* seq_cst: r belongs to the lane again; then read answer_sleeping */
    if (atomic_load(&L->answer_sleeping)) {
        pthread_mutex_lock(&L->mu);
        pthread_cond_broadcast(&L->cv);
        pthread_mutex_unlock(&L->mu);
    }
}

/* Poll every event the lanes wait for: answer the complete ones, and the ones polled too long. */
static void dt_poll(driver_thread_t *dt) {
    dreq_t **at = &dt->polled;
    while (*at) {
        dreq_t *r = *at;
        int rc = d_query(r->L, r->ev);
        if (rc == ERR_NOT_READY && now_ns() - r->since < DT_SYNC_NS) {
            at = &r->next;
            continue;
        }
        *at = r->next;
        dt_answer(r, rc); /* NOT_READY after DT_SYNC_NS: the lane sleeps on the event itself */
    }
}

static void *dt_main(void *arg) {
    driver_thread_t *dt = arg;
    engine_t *eng = dt->eng;
    int rc = eng->emulated ? 0 : eng->drv.cuCtxSetCurrent(eng->ctx);
    if (!rc && dt->one_stream && !eng->emulated) rc = eng->drv.cuStreamCreate(&dt->stream, CU_STREAM_NON_BLOCKING);
    pthread_mutex_lock(&dt->mu);
    dt->setup_rc = rc;
    dt->ready = rc ? -1 : 1;
    pthread_cond_broadcast(&dt->cv);
    pthread_mutex_unlock(&dt->mu);
    if (rc) return NULL;
    int64_t idle_since = now_ns(), last_work = idle_since, last_poll = 0;
    for (;;) {
        dreq_t *r = NULL;
        if (atomic_load_explicit(&dt->queued, memory_order_acquire)) {
            spin_lock(&dt->lock);
            r = dt->head;
            if (r) {
                dt->head = r->next;
                if (!dt->head) dt->tail = NULL;
                atomic_fetch_sub_explicit(&dt->queued, 1, memory_order_relaxed);
            }
            spin_unlock(&dt->lock);
        }
        if (r) {
            if (r->kind == DREQ_ENQUEUE) {
                dt_answer(r, d_enqueue_now(r->L, r->slot, r->host_side, r->dev, r->n, &r->op));
            } else if (r->kind == DREQ_POST) {
                dt_answer(r, d_post_record_now(r->L, &r->ev));
            } else {
                r->since = now_ns();
                r->next = dt->polled;
                dt->polled = r;
            }
            idle_since = last_work = now_ns();
            continue;
        }
        if (dt->polled) { /* a lane waits for a DMA: poll it every ~2 us (and the queue in between) */
            int64_t t = now_ns();
            if (t - last_poll >= DT_POLL_NS) {
                dt_poll(dt);
                last_poll = now_ns();
            } else {
                cpu_relax();
            }
            idle_since = last_work = t;
            continue;
        }
        if (atomic_load(&dt->stop)) break; /* every lane has stopped: nothing can be queued */
        int64_t t = now_ns();
        int active = atomic_load_explicit(&dt->active, memory_order_acquire);
        /* Poll while shares run (a lane's copy ends any time now) or for idle_ns after the last one;
         * but not past DT_ACTIVE_IDLE_NS without a request: the lanes are held, or asleep on events. */
        if ((active || t - idle_since < dt->idle_ns) && t - last_work < DT_ACTIVE_IDLE_NS) {
            if (active) idle_since = t;
            if (t - last_work < DT_SPIN_NS)
                cpu_relax();
            else
                sched_yield(); /* leave CPUs to the lanes */
            continue;
        }
        pthread_mutex_lock(&dt->mu);
        atomic_store(&dt->sleeping, 1);
        int woken = 0;
        if (!atomic_load(&dt->queued) && !atomic_load(&dt->stop)) {
            struct timespec ts = ts_of(now_ns() + DT_NET_NS); /* a safety net: wakes are signalled */
            woken = pthread_cond_timedwait(&dt->cv, &dt->mu, &ts) == 0;
        }
        atomic_store(&dt->sleeping, 0);
        pthread_mutex_unlock(&dt->mu);
        if (woken) idle_since = last_work = now_ns(); /* a submission or a request: poll again */
    }
    if (dt->stream) eng->drv.cuStreamDestroy(dt->stream); /* on the thread that made it (context current) */
    dt->stream = NULL;
    return NULL;
}

/* A lane's request, answered by the driver thread: returns its rc. */
static int dt_call(driver_thread_t *dt, dreq_t *r) {
    r->next = NULL;
    r->rc = 0;
    r->op = "";
    atomic_store_explicit(&r->done, 0, memory_order_relaxed);
    spin_lock(&dt->lock);
    if (dt->tail)
        dt->tail->next = r;
    else
        dt->head = r;
    dt->tail = r;
    spin_unlock(&dt->lock);
    atomic_fetch_add(&dt->queued, 1); /* seq_cst: then read sleeping */
    dt_wake(dt);
    int64_t t0 = now_ns();
    while (!atomic_load_explicit(&r->done, memory_order_acquire)) {
        int64_t t = now_ns() - t0;
        if (t < DT_SPIN_NS) {
            cpu_relax();
        } else if (t < r->L->eng->lane_wait_ns) {
            sched_yield(); /* more runnable threads than CPUs: let the driver thread run */
        } else { /* a long DMA: sleep until the thread answers (it signals a sleeping lane) */
            lane_t *L = r->L;
            pthread_mutex_lock(&L->mu);
            atomic_store(&L->answer_sleeping, 1); /* seq_cst: pairs with dt_answer's store of done */
            if (!atomic_load(&r->done)) {
                struct timespec ts = ts_of(now_ns() + SLICE_NS); /* a safety net: answers are signalled */
                pthread_cond_timedwait(&L->cv, &L->mu, &ts);
            }
            atomic_store(&L->answer_sleeping, 0);
            pthread_mutex_unlock(&L->mu);
        }
    }
    return r->rc;
}

static driver_thread_t *dt_start(engine_t *eng, int64_t idle_ns, int one_stream, int *rc) {
    *rc = 0;
    driver_thread_t *dt = calloc(1, sizeof *dt);
    if (!dt) return NULL;
    dt->eng = eng;
    dt->idle_ns = idle_ns;
    dt->one_stream = one_stream && !eng->emulated;
    if (pthread_mutex_init(&dt->mu, NULL)) {
        free(dt);
        return NULL;
    }
    if (cond_init_monotonic(&dt->cv)) {
        pthread_mutex_destroy(&dt->mu);
        free(dt);
        return NULL;
    }
    if (pthread_create(&dt->thread, NULL, dt_main, dt)) {
        pthread_cond_destroy(&dt->cv);
        pthread_mutex_destroy(&dt->mu);
        free(dt);
        return NULL;
    }
    pthread_mutex_lock(&dt->mu);
    while (!dt->ready) pthread_cond_wait(&dt->cv, &dt->mu);
    pthread_mutex_unlock(&dt->mu);
    if (dt->ready < 0) {
        *rc = dt->setup_rc;
        pthread_join(dt->thread, NULL);
        pthread_cond_destroy(&dt->cv);
        pthread_mutex_destroy(&dt->mu);
        free(dt);
        return NULL;
    }
    return dt;
}

/* After every lane stopped (no request can come). */
static void dt_stop(driver_thread_t *dt) {
    if (!dt) return;
    pthread_mutex_lock(&dt->mu);
    atomic_store(&dt->stop, 1);
    pthread_cond_signal(&dt->cv);
    pthread_mutex_unlock(&dt->mu);
    pthread_join(dt->thread, NULL); /* it destroyed its stream (queued DMAs still complete) */
    pthread_cond_destroy(&dt->cv);
    pthread_mutex_destroy(&dt->mu);
    free(dt);
}

/*
 * The stream a lane's DMAs and records go on: its own, or with Engine(one_stream=True) and the driver
 * thread in CUDA mode one stream for the whole engine, in request order (DMAs on several streams run at
 * once and end together, so a download's lanes all wait for the last of them before copying out; on
 * one stream they end one after the other and the copies out start as each lands). A producer is then
 * ordered before that one stream (Engine.streams()). Off by default: on the H200 VM (2026-11-30) it
 * measured within the run-to-run spread of the lanes' streams (8 MiB download 18.7 against 16.7 GB/s,
 * 64 MiB 34.3 against 37.7), so the tested path stays.
 */
static inline CUstream dma_stream(const lane_t *L) {
    const driver_thread_t *dt = L->eng->dt;
    return dt && dt->stream ? dt->stream : L->stream;
}

/*
 * One chunk's stream work, in order: the copy, the slot's event record. Returns 0, or the failing
 * call's code with *op naming it.
 */
static int d_enqueue_now(lane_t *L, slot_t *slot, char *host_side, CUdeviceptr dev, size_t n, const char **op) {
    engine_t *eng = L->eng;
    int rc;
    int64_t t0 = now_ns(), t1 = t0;
    if (eng->emulated) {
        *op = eng->upload ? "cuMemcpyHtoDAsync" : "cuMemcpyDtoHAsync";
        rc = eng->upload ? emu_enqueue_copy(L, (char *)(uintptr_t)dev, host_side, n)
                         : emu_enqueue_copy(L, host_side, (const char *)(uintptr_t)dev, n);
        if (!rc) {
            *op = "cuEventRecord";
            rc = emu_record(L, slot->ev);
        }
        goto account;
    }
    CUstream stream = dma_stream(L);
    driver_lock(eng);
    t1 = now_ns();
    *op = eng->upload ? "cuMemcpyHtoDAsync" : "cuMemcpyDtoHAsync";
    rc = eng->upload ? eng->drv.cuMemcpyHtoDAsync(dev, host_side, n, stream)
                     : eng->drv.cuMemcpyDtoHAsync(host_side, dev, n, stream);
    if (!rc) {
        *op = "cuEventRecord";
        rc = eng->drv.cuEventRecord(slot->ev, stream);
    }
    driver_unlock(eng);
account:
    if (slot->job) { /* where a chunk's enqueue goes: waiting for the lock, or in the driver */
        atomic_fetch_add_explicit(&slot->job->n_enqueues, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&slot->job->lock_wait_ns, t1 - t0, memory_order_relaxed);
        atomic_fetch_add_explicit(&slot->job->enqueue_ns, now_ns() - t1, memory_order_relaxed);
    }
    return rc;
}

/* A posting share's hand-off event: recorded right after its last DMA, on the lane's stream. */
static int d_post_record_now(lane_t *L, void **ev) {
    engine_t *eng = L->eng;
    *ev = L->handoff[L->handoff_next++ % HANDOFF_EVENTS];
    if (eng->emulated) return emu_record(L, *ev);
    driver_lock(eng);
    int rc = eng->drv.cuEventRecord(*ev, dma_stream(L));
    driver_unlock(eng);
    return rc;
}

/* A chunk's enqueue, through the driver thread where the engine has one. */
static int d_enqueue(lane_t *L, slot_t *slot, char *host_side, CUdeviceptr dev, size_t n, const char **op) {
    driver_thread_t *dt = L->eng->dt;
    if (!dt) return d_enqueue_now(L, slot, host_side, dev, n, op);
    dreq_t r;
    memset(&r, 0, sizeof r);
    r.kind = DREQ_ENQUEUE;
    r.L = L;
    r.slot = slot;
    r.host_side = host_side;
    r.dev = dev;
    r.n = n;
    int rc = dt_call(dt, &r);
    *op = r.op;
    return rc;
}

static int d_post_record(lane_t *L, void **ev) {
    driver_thread_t *dt = L->eng->dt;
    if (!dt) return d_post_record_now(L, ev);
    dreq_t r;
    memset(&r, 0, sizeof r);
    r.kind = DREQ_POST;
    r.L = L;
    int rc = dt_call(dt, &r);
    *ev = r.ev;
    return rc;
}

/* cuEventQuery (emulated: the same on the lane's stream): 0, ERR_NOT_READY, or the failure. */
static int d_query(lane_t *L, void *ev) {
    engine_t *eng = L->eng;
    if (eng->emulated) {
        emu_stream_t *es = L->es;
        emu_event_t *e = ev;
        pthread_mutex_lock(&es->mu);
        int rc = e->done < e->recorded ? ERR_NOT_READY : e->error;
        pthread_mutex_unlock(&es->mu);
        return rc ? rc : atomic_load(&eng->poison);
    }
    driver_lock(eng);
    int rc = eng->drv.cuEventQuery((CUevent)ev);
    driver_unlock(eng);
    return rc;
}

/* Wait for a slot's DMA: the driver thread polls it where there is one (a lane's wake-up from a
 * blocking event costs tens of microseconds on a VM); past DT_SYNC_NS the lane sleeps on it. */
static int d_sync(lane_t *L, slot_t *slot) {
    engine_t *eng = L->eng;
    driver_thread_t *dt = eng->dt;
    if (dt) {
        dreq_t r;
        memset(&r, 0, sizeof r);
        r.kind = DREQ_SYNC;
        r.L = L;
        r.ev = slot->ev;
        int rc = dt_call(dt, &r);
        if (rc != ERR_NOT_READY) return rc;
    }
    if (eng->emulated) return emu_sync(L, slot->ev);
    if (eng->spin_ns > 0) { /* a DMA about to end: polling beats a sleeping thread's wake-up */
        int64_t until = now_ns() + eng->spin_ns;
        for (;;) {
            driver_lock(eng);
            int rc = eng->drv.cuEventQuery(slot->ev);
            driver_unlock(eng);
            if (rc != ERR_NOT_READY) return rc;
            int64_t t = now_ns();
            if (t >= until) break;
            while (now_ns() < t + 2000) cpu_relax(); /* poll every ~2 us, leave the lock to enqueuers */
        }
    }
    return eng->drv.cuEventSynchronize(slot->ev);
}

static int d_slot_alloc(lane_t *L, slot_t *slot) {
    engine_t *eng = L->eng;
    memset(slot, 0, sizeof *slot);
    if (eng->emulated) {
        int poison = atomic_load(&eng->poison);
        if (poison) return poison;
        void *p = NULL;
        if (posix_memalign(&p, 4096, eng->slot_bytes)) return ERR_OUT_OF_MEMORY;
        for (size_t off = 0; off < eng->slot_bytes; off += 4096) ((volatile char *)p)[off] = 0; /* pre-touch */
        emu_event_t *ev = calloc(1, sizeof *ev);
        if (!ev) {
            free(p);
            return ERR_OUT_OF_MEMORY;
        }
        slot->ptr = p;
        slot->ev = ev;
        return 0;
    }
    void *p = NULL;
    CUevent ev = NULL;
    int rc = eng->drv.cuMemHostAlloc(&p, eng->slot_bytes, CU_MEMHOSTALLOC_PORTABLE);
    if (rc) return rc;
    rc = eng->drv.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC);
    if (rc) {
        eng->drv.cuMemFreeHost(p);
        return rc;
    }
    slot->ptr = p;
    slot->ev = ev;
    return 0;
}

static void d_slot_free(lane_t *L, char *ptr, void *ev) {
    engine_t *eng = L->eng;
    if (eng->emulated) {
        free(ptr);
        free(ev);
        return;
    }
    eng->drv.cuEventDestroy(ev);
    eng->drv.cuMemFreeHost(ptr);
}

/* -- lanes ----------------------------------------------------------------------------------------- */

/*
 * A share's hand-off post: `ev` (the event recorded right after its last DMA, on its lane's stream),
 * or NULL for a share that will never enqueue its last DMA (its job failed, or never ran).
 */
static void post_share(share_t *s, void *ev) {
    job_t *job = s->job;
    s->posted = 1;
    pthread_mutex_lock(&job->mu);
    if (ev) job->posted[job->nposted++] = ev;
    if (atomic_fetch_sub_explicit(&job->unposted, 1, memory_order_acq_rel) == 1) pthread_cond_broadcast(&job->cv);
    pthread_mutex_unlock(&job->mu);
}

/* A share is complete: all of its DMAs and host copies are done (or it was abandoned by a failure). */
static void finish_share(lane_t *L, share_t *s) {
    job_t *job = s->job;
    (void)L;
    if (s->posts && !s->posted) post_share(s, NULL);
    atomic_fetch_add_explicit(&job->host_bytes, s->copied, memory_order_relaxed);
    if (atomic_fetch_sub_explicit(&job->remaining, 1, memory_order_acq_rel) == 1) job_complete(job);
    job_decref(job);
    free(s);
}

static int alloc_slots(lane_t *L, err_t *e) {
    engine_t *eng = L->eng;
    for (int i = 0; i < eng->slots_per_lane; i++) {
        int rc = d_slot_alloc(L, &L->slots[i]);
        if (rc) {
            make_err(eng, rc, "allocating a staging slot", e);
            for (int j = 0; j < i; j++) d_slot_free(L, L->slots[j].ptr, L->slots[j].ev);
            L->nslots = 0;
            return -1;
        }
    }
    L->nslots = eng->slots_per_lane;
    atomic_fetch_add(&eng->held_bytes, (long long)eng->slot_bytes * eng->slots_per_lane);
    return 0;
}

/*
 * After an error: wait for every busy slot (oldest first, an error goes to that slot's job), report
 * the shares their events end, abandon every slot, take fresh ones (or mark the lane broken).
 */
static void lane_recover(lane_t *L) {
    engine_t *eng = L->eng;
    int n = L->nslots;
    for (int j = 0; j < n; j++) {
        slot_t *slot = &L->slots[(L->cursor + (size_t)j) % (size_t)n];
        if (!slot->busy) continue;
        int rc = d_sync(L, slot);
        slot->busy = 0;
        if (rc && slot->job) {
            err_t e;
            make_err(eng, rc, "waiting for a staging DMA", &e);
            job_fail(slot->job, &e);
        }
        if (slot->ends) {
            share_t *s = slot->ends;
            slot->ends = NULL;
            finish_share(L, s);
        }
    }
    for (int j = 0; j < n; j++) {
        if (eng->emulated) {
            abandoned_t *a = malloc(sizeof *a);
            if (a) {
                a->ptr = L->slots[j].ptr;
                a->ev = L->slots[j].ev;
                a->next = L->abandoned;
                L->abandoned = a;
            } /* else: leaked, which is what abandoning means on CUDA anyway */
        }
        memset(&L->slots[j], 0, sizeof L->slots[j]);
    }
    if (n) {
        atomic_fetch_sub(&eng->held_bytes, (long long)eng->slot_bytes * n);
        atomic_fetch_add(&eng->abandoned_bytes, (long long)eng->slot_bytes * n);
    }
    L->nslots = 0;
    L->cursor = 0;
    L->cur_last = NULL;
    err_t e;
    if (alloc_slots(L, &e)) {
        L->broken = 1;
        L->broken_err = e;
    }
}

/* Wait for one busy slot; report the share it ends. Returns 0, or -1 after a recovery. */
static int reap(lane_t *L, slot_t *slot) {
    int rc = d_sync(L, slot);
    slot->busy = 0;
    if (rc) {
        err_t e;
        make_err(L->eng, rc, "waiting for a staging DMA", &e);
        if (slot->job) job_fail(slot->job, &e);
        if (slot->ends) {
            share_t *s = slot->ends;
            slot->ends = NULL;
            finish_share(L, s);
        }
        lane_recover(L);
        return -1;
    }
    if (slot->ends) {
        share_t *s = slot->ends;
        slot->ends = NULL;
        finish_share(L, s);
    }
    return 0;
}

static void reap_all(lane_t *L) {
    for (;;) {
        int n = L->nslots, again = 0;
        for (int j = 0; j < n; j++) {
            slot_t *slot = &L->slots[(L->cursor + (size_t)j) % (size_t)n];
            if (slot->busy && reap(L, slot)) {
                again = 1; /* recovered: the ring changed */
                break;
            }
        }
        if (!again) return;
    }
}

static int any_busy(const lane_t *L) {
    for (int j = 0; j < L->nslots; j++)
        if (L->slots[j].busy) return 1;
    return 0;
}

/* CUDA mode: a hold pauses lanes at chunk boundaries (emulated mode holds the stream workers). */
static void hold_wait(engine_t *eng) {
    if (eng->emulated || !atomic_load(&eng->held)) return;
    pthread_mutex_lock(&eng->mu);
    while (atomic_load(&eng->held)) pthread_cond_wait(&eng->cv, &eng->mu);
    pthread_mutex_unlock(&eng->mu);
}

/*
 * Cooperative jobs. A staged job's chunks dealt one per lane are copied side by side and reach the
 * link together: an 8 MiB upload's eight 1 MiB chunks were all copied at ~130 us and the link moved
 * most of the bytes after that (the ninth session's chunk traces), and a lane that wakes late or is
 * preempted holds its chunk up. A cooperative job (a contiguous one, on an engine with helpers) is
 * one share instead: its *lead* lane takes the chunks in order, and each chunk's host copy is cut
 * into pieces of piece_bytes that the lead and idle lanes claim from one counter, as the copier's
 * helpers do (the copier's essay below says why the task on the lead's stack outlives every
 * reader). Chunk k is on the link while chunk k+1 is copied, the lead never waits for a helper to
 * wake (it copies every piece nobody else claimed), and a late helper costs one piece at most.
 *
 * Jobs above cooperative_max_bytes are dealt as before: one lead's slots_per_lane slots cannot keep
 * the link busy through a long job (its wait for a slot to drain, then a sleeping lead's wake-up,
 * leaves the link idle), where every lane's slots can. On the H200 (probe_native.py --helpers,
 * 2026-12-01) cooperative uploads moved 8 MiB at 29 - 33 GB/s against 21 - 24 dealt, tied at
 * 32 MiB, and lost at 256 MiB (25 - 35 against 39 - 40).
 *
 * submit() counts the job in `leads` and wakes up to `helpers` sleeping lanes; an idle lane helps
 * while a lead runs, and goes back to sleep after help_spin_ns without a posted copy (a lead waiting
 * for its slots to drain, or held) or as soon as a share is queued for it: a helper never waits for a
 * lead, so helping cannot deadlock lanes whose queues hold each other's shares. A lead that posts a
 * copy while lanes sleep wakes one per piece it copies, as long as fewer than `helpers` lanes help
 * or are on their way (`helping` + `waking`, counted engine-wide: every lead counts the same ones).
 */
#define COOP_CHUNKS 4 /* a cooperative job is cut in this many chunks (within bounds) */
/* lead_copies=False (a knob for one-job tests: with every lane a lead nobody helps) copies alone after this */
#define LEAD_ALONE_NS ((int64_t)2000000000)

/* Wake up to `k` sleeping lanes to help L's lead, scanning the other lanes once; how many were woken.
 * Each wake-up first checks the engine-wide cap (`helping` + `waking` below `helpers`). */
static int wake_helpers(lane_t *L, int k) {
    engine_t *eng = L->eng;
    int woken = 0;
    for (int j = 1; j < eng->nlanes && woken < k; j++) {
        if (atomic_load(&eng->idle_sleepers) <= 0 ||
            atomic_load(&eng->helping) + atomic_load(&eng->waking) >= eng->helpers)
            break;
        lane_t *M = &eng->lanes[(L->index + j) % eng->nlanes];
        pthread_mutex_lock(&M->mu);
        int go = M->sleeping && !M->help_woken && !M->head;
        if (go) {
            M->help_woken = 1;
            atomic_fetch_sub(&eng->idle_sleepers, 1);
            atomic_fetch_add(&eng->waking, 1);
        }
        pthread_mutex_unlock(&M->mu);
        if (go) {
            pthread_cond_signal(&M->cv);
            woken++;
        }
    }
    return woken;
}

/* Wake one more helper if the lead may: while lanes sleep, and fewer than `helpers` help or are on
 * their way (every lead counts the same ones: the engine never wakes more than `helpers` to help). */
static void maybe_wake(lane_t *L, int *woken) {
    engine_t *eng = L->eng;
    if (*woken >= eng->helpers || atomic_load(&eng->idle_sleepers) <= 0 ||
        atomic_load(&eng->helping) + atomic_load(&eng->waking) >= eng->helpers)
        return; /* two loads per piece: a helper that drops out later frees room for the next piece */
    if (wake_helpers(L, 1))
        (*woken)++;
}

/* The lead's chunk copy, shared with the lanes that help (see above). */
static void coop_copy(lane_t *L, char *dst, const char *src, size_t n, int nt, int *woken) {
    engine_t *eng = L->eng;
    if (n <= eng->piece_bytes && eng->lead_copies) {
        copy_bytes(dst, src, n, nt);
        return;
    }
    if (*woken >= eng->helpers) *woken = 0; /* helpers that slept through a slot wait may be woken again */
    copy_task_t t;
    task_init(&t, dst, src, n, eng->piece_bytes, nt, atomic_fetch_add(&eng->task_seq, 1) + 1);
    atomic_store(&L->help_task, &t);
    atomic_store(&L->help_posted, t.seq);
    if (eng->lead_copies) {
        size_t k;
        for (;;) {
            maybe_wake(L, woken);
            if ((k = atomic_fetch_add(&t.next, 1)) >= t.pieces) break;
            copier_piece(&t, k);
            atomic_fetch_add_explicit(&t.done, 1, memory_order_release);
        }
    } else { /* tests only: the helpers copy; a lead left alone for LEAD_ALONE_NS copies what is left */
        int64_t alone_at = now_ns() + LEAD_ALONE_NS;
        for (unsigned i = 0; atomic_load_explicit(&t.done, memory_order_acquire) < t.pieces; i++) {
            if ((i & 255) == 0) {
                *woken = 0;
                maybe_wake(L, woken);
                if (now_ns() > alone_at) {
                    copier_drain(&t);
                    break;
                }
            }
            backoff(i);
        }
    }
    task_retire(&t, &L->help_task, &L->help_active);
}

/*
 * An idle lane helps the leads of cooperative jobs: it returns when a share is queued for it, when no
 * lead is left, or (1) after help_spin_ns without a posted copy it has not taken part in yet.
 */
static int help(lane_t *L) {
    engine_t *eng = L->eng;
    unsigned long long seen[MAX_LANES]; /* per lane, the last posted copy joined (a copy posted before this
                                         * lane came may still have pieces: every posted copy is new once) */
    memset(seen, 0, sizeof seen);
    atomic_fetch_add(&eng->helping, 1);
    int64_t idle_since = now_ns();
    unsigned polls = 0;
    int timed_out = 0;
    while (atomic_load(&eng->leads) > 0 && !atomic_load_explicit(&L->queued, memory_order_acquire)) {
        int joined = 0;
        for (int j = 1; j < eng->nlanes; j++) {
            int m = (L->index + j) % eng->nlanes;
            lane_t *M = &eng->lanes[m];
            unsigned long long p = atomic_load_explicit(&M->help_posted, memory_order_relaxed);
            if (p == seen[m]) continue;
            atomic_fetch_add(&M->help_active, 1); /* before reading the task: see the copier's essay */
            copy_task_t *t = atomic_load(&M->help_task);
            if (t) {
                size_t g = copier_drain(t);
                /* counted while still counted in help_active: the lead waits for that, so the job
                 * completes (and Engine.helped_pieces is read) after this count */
                if (g) atomic_fetch_add_explicit(&eng->helped, g, memory_order_relaxed);
                if (t->seq > p) p = t->seq;
            }
            atomic_fetch_sub(&M->help_active, 1);
            seen[m] = p;
            joined = 1;
        }
        if (joined) {
            idle_since = now_ns();
            continue;
        }
        if ((++polls & 63) == 0) {
            if (now_ns() - idle_since >= eng->help_spin_ns) {
                timed_out = 1;
                break;
            }
            sched_yield(); /* a machine without CPUs to spare: the lead and the caller come first */
        }
        cpu_relax();
    }
    atomic_fetch_sub(&eng->helping, 1);
    return timed_out;
}

static void fail_with(lane_t *L, job_t *job, int rc, const char *op) {
    err_t e;
    make_err(L->eng, rc, op, &e);
    job_fail(job, &e);
}

static void run_upload(lane_t *L, share_t *s) {
    job_t *job = s->job;
    chunk_t c;
    int woken = 0; /* helpers this lead woke (cooperative jobs) */
    L->cur_last = NULL;
    for (size_t k = s->first; k < job->nchunks;) {
        if (atomic_load_explicit(&job->failed, memory_order_acquire)) break;
        if (L->broken) {
            job_fail(job, &L->broken_err);
            break;
        }
        trace_at(job, k, L->index, 0);
        hold_wait(L->eng);
        slot_t *slot = &L->slots[L->cursor % (size_t)L->nslots];
        if (slot->busy && reap(L, slot)) continue; /* recovered: re-check this chunk's job, fresh slots */
        job_chunk(job, k, &c);
        trace_at(job, k, L->index, 1);
        if (job->coop)
            coop_copy(L, slot->ptr, c.host, c.nbytes, job->nontemporal, &woken);
        else
            chunk_copy(job, &c, slot->ptr, 1);
        trace_at(job, k, L->index, 2);
        s->copied += c.nbytes;
        at_max(&job->t_copy_last, now_ns());
        slot->job = job;
        slot->ends = NULL;
        slot->busy = 1; /* from here on a DMA may touch it */
        const char *op = "";
        int rc = d_enqueue(L, slot, slot->ptr, job->dev + c.offset, c.nbytes, &op);
        trace_at(job, k, L->index, 3);
        if (rc) {
            fail_with(L, job, rc, op);
            lane_recover(L);
            break;
        }
        L->cursor++;
        L->cur_last = slot;
        if (s->posts && k + s->stride >= job->nchunks) { /* its last DMA: hand off */
            void *ev;
            rc = d_post_record(L, &ev);
            if (rc) {
                fail_with(L, job, rc, "cuEventRecord (hand-off)");
                lane_recover(L);
                break;
            }
            post_share(s, ev);
        }
        at_max(&job->t_enqueue_last, now_ns());
        k += s->stride;
    }
    if (L->cur_last) {
        L->cur_last->ends = s; /* reported when that event is reaped */
        L->cur_last = NULL;
        return;
    }
    finish_share(L, s); /* nothing of this share is in flight */
}

static void run_download(lane_t *L, share_t *s) {
    job_t *job = s->job;
    size_t n = job->nchunks > s->first ? (job->nchunks - s->first + s->stride - 1) / s->stride : 0;
    chunk_t c;
    if (L->broken) {
        job_fail(job, &L->broken_err);
        finish_share(L, s);
        return;
    }
    size_t depth = (size_t)L->nslots, issued = 0;
    int broke = 0, woken = 0;
    /* every slot is idle here: download shares end with their slots reaped */
    for (size_t i = 0; i < n && !broke; i++) {
        while (issued < n && issued < i + depth && !atomic_load(&job->failed)) {
            hold_wait(L->eng);
            slot_t *slot = &L->slots[issued % depth];
            job_chunk(job, s->first + issued * s->stride, &c);
            slot->job = job;
            slot->ends = NULL;
            slot->busy = 1;
            const char *op = "";
            trace_at(job, s->first + issued * s->stride, L->index, 0);
            int rc = d_enqueue(L, slot, slot->ptr, job->dev + c.offset, c.nbytes, &op);
            trace_at(job, s->first + issued * s->stride, L->index, 1);
            if (rc) {
                fail_with(L, job, rc, op);
                lane_recover(L);
                broke = 1;
                break;
            }
            issued++;
            if (s->posts && issued == n) { /* its last DMA: hand off */
                void *ev;
                rc = d_post_record(L, &ev);
                if (rc) {
                    fail_with(L, job, rc, "cuEventRecord (hand-off)");
                    lane_recover(L);
                    broke = 1;
                    break;
                }
                post_share(s, ev);
            }
            at_max(&job->t_enqueue_last, now_ns());
        }
        if (broke || i >= issued) break; /* failed elsewhere: nothing more was issued */
        slot_t *slot = &L->slots[i % depth];
        int rc = d_sync(L, slot);
        slot->busy = 0;
        if (rc) {
            fail_with(L, job, rc, "waiting for a staging DMA");
            lane_recover(L);
            broke = 1;
            break;
        }
        if (!atomic_load(&job->failed)) {
            job_chunk(job, s->first + i * s->stride, &c);
            trace_at(job, s->first + i * s->stride, L->index, 2);
            if (job->coop)
                coop_copy(L, c.host, slot->ptr, c.nbytes, job->nontemporal, &woken);
            else
                chunk_copy(job, &c, slot->ptr, 0);
            trace_at(job, s->first + i * s->stride, L->index, 3);
            s->copied += c.nbytes;
            at_max(&job->t_copy_last, now_ns());
        }
    }
    if (!broke) reap_all(L); /* a failure elsewhere may leave issued-but-unreaped slots */
    finish_share(L, s);
}

static int lane_setup(lane_t *L, err_t *e) {
    engine_t *eng = L->eng;
    int rc;
    if (eng->emulated) {
        L->es = emu_stream_start(eng, &rc);
        if (!L->es) {
            make_err(eng, rc, "starting an emulated stream", e);
            return -1;
        }
    } else {
        rc = eng->drv.cuCtxSetCurrent(eng->ctx);
        if (rc) {
            make_err(eng, rc, "cuCtxSetCurrent", e);
            return -1;
        }
        rc = eng->drv.cuStreamCreate(&L->stream, CU_STREAM_NON_BLOCKING);
        if (rc) {
            make_err(eng, rc, "cuStreamCreate", e);
            return -1;
        }
    }
    if (alloc_slots(L, e)) return -1;
    for (; L->nhandoff < HANDOFF_EVENTS; L->nhandoff++) {
        void **ev = &L->handoff[L->nhandoff];
        if (eng->emulated) {
            *ev = calloc(1, sizeof(emu_event_t));
            rc = *ev ? 0 : ERR_OUT_OF_MEMORY;
        } else {
            rc = eng->drv.cuEventCreate((CUevent *)ev, CU_EVENT_DISABLE_TIMING);
        }
        if (rc) {
            make_err(eng, rc, "creating a hand-off event", e);
            return -1;
        }
    }
    return 0;
}

static void lane_teardown(lane_t *L) {
    engine_t *eng = L->eng;
    if (eng->emulated && L->es) {
        emu_stream_stop(L->es); /* every queued op ran: nothing touches a slot any more */
        L->es = NULL;
        while (L->abandoned) {
            abandoned_t *a = L->abandoned;
            L->abandoned = a->next;
            d_slot_free(L, a->ptr, a->ev);
            free(a);
        }
    }
    for (int j = 0; j < L->nslots; j++) d_slot_free(L, L->slots[j].ptr, L->slots[j].ev);
    if (L->nslots) atomic_fetch_sub(&eng->held_bytes, (long long)eng->slot_bytes * L->nslots);
    L->nslots = 0;
    for (int j = 0; j < L->nhandoff; j++) { /* waits made on them keep what they captured */
        if (eng->emulated)
            free(L->handoff[j]);
        else
            eng->drv.cuEventDestroy((CUevent)L->handoff[j]);
    }
    L->nhandoff = 0;
    if (!eng->emulated && L->stream) {
        eng->drv.cuStreamDestroy(L->stream);
        L->stream = NULL;
    }
}

static void *lane_main(void *arg) {
    lane_t *L = arg;
    engine_t *eng = L->eng;
    err_t e;
    memset(&e, 0, sizeof e);
    int failed = lane_setup(L, &e);
    if (failed) lane_teardown(L); /* before reporting: the constructor then stops the other lanes */
    pthread_mutex_lock(&eng->mu);
    if (failed && !eng->setup_failed) {
        eng->setup_failed = 1;
        eng->setup_err = e;
    }
    eng->ready++;
    pthread_cond_broadcast(&eng->cv);
    pthread_mutex_unlock(&eng->mu);
    if (failed) return NULL;
    for (;;) {
        int spun = 0, helped_out = 0;
        pthread_mutex_lock(&L->mu);
        while (!L->head && !L->stopping) {
            if (any_busy(L)) { /* idle: finish what is in flight before sleeping */
                pthread_mutex_unlock(&L->mu);
                reap_all(L);
                pthread_mutex_lock(&L->mu);
                continue;
            }
            if (eng->helpers && !helped_out && atomic_load(&eng->leads) > 0) { /* a lead may post a copy */
                pthread_mutex_unlock(&L->mu);
                helped_out = help(L);
                pthread_mutex_lock(&L->mu);
                continue;
            }
            if (eng->idle_spin_ns > 0 && !spun) { /* back-to-back jobs: poll before paying a wake-up */
                pthread_mutex_unlock(&L->mu);
                int64_t until = now_ns() + eng->idle_spin_ns;
                while (!atomic_load_explicit(&L->queued, memory_order_acquire) && now_ns() < until) cpu_relax();
                spun = 1;
                pthread_mutex_lock(&L->mu);
                continue;
            }
            L->sleeping = 1; /* under mu: a submitter that queues after this signals */
            atomic_fetch_add(&eng->idle_sleepers, 1);
            pthread_cond_wait(&L->cv, &L->mu);
            L->sleeping = 0;
            if (L->help_woken) { /* the waker took this lane off idle_sleepers */
                L->help_woken = 0;
                atomic_fetch_sub(&eng->waking, 1);
            } else
                atomic_fetch_sub(&eng->idle_sleepers, 1);
            helped_out = 0;
        }
        share_t *s = L->head;
        if (!s) {
            pthread_mutex_unlock(&L->mu);
            break;
        }
        L->head = s->next;
        if (!L->head) L->tail = NULL;
        atomic_fetch_sub_explicit(&L->queued, 1, memory_order_relaxed);
        pthread_mutex_unlock(&L->mu);
        long long t = now_ns();
        at_min(&s->job->t_start_first, t);
        at_max(&s->job->t_start_last, t);
        int coop = s->job->coop; /* the share (and maybe the job) is gone once it ran */
        if (eng->upload)
            run_upload(L, s);
        else
            run_download(L, s);
        if (coop) atomic_fetch_sub(&eng->leads, 1); /* copied all it will: helpers may sleep */
        if (eng->dt) atomic_fetch_sub_explicit(&eng->dt->active, 1, memory_order_release); /* enqueued all */
    }
    reap_all(L);
    lane_teardown(L);
    return NULL;
}

/* -- engine lifetime (called with the GIL released where it may block) ---------------------------------- */

static void engine_stop_lanes(engine_t *eng) {
    /* lift a hold first (queued work must finish), while every lane and its stream still exist */
    pthread_mutex_lock(&eng->mu);
    eng->closing = 1;
    atomic_store(&eng->held, 0);
    pthread_cond_broadcast(&eng->cv);
    pthread_mutex_unlock(&eng->mu);
    for (int i = 0; i < eng->nlanes; i++) {
        emu_stream_t *es = eng->lanes[i].started ? eng->lanes[i].es : NULL;
        if (!es) continue;
        pthread_mutex_lock(&es->mu);
        pthread_cond_broadcast(&es->cv);
        pthread_mutex_unlock(&es->mu);
    }
    for (int i = 0; i < eng->nlanes; i++) {
        lane_t *L = &eng->lanes[i];
        if (!L->started) continue;
        pthread_mutex_lock(&L->mu);
        L->stopping = 1;
        pthread_cond_signal(&L->cv);
        pthread_mutex_unlock(&L->mu);
    }
    for (int i = 0; i < eng->nlanes; i++) {
        lane_t *L = &eng->lanes[i];
        if (!L->started) continue;
        pthread_join(L->thread, NULL);
        L->started = 0;
    }
    dt_stop(eng->dt); /* no lane is left to ask it */
    eng->dt = NULL;
}

static void engine_free(engine_t *eng) {
    for (int i = 0; i < eng->nlanes; i++) {
        pthread_mutex_destroy(&eng->lanes[i].mu);
        pthread_cond_destroy(&eng->lanes[i].cv);
    }
    pthread_mutex_destroy(&eng->mu);
    pthread_cond_destroy(&eng->cv);
    free(eng);
}

/* ================================================================================================
 * Python types
 * ================================================================================================ */

static PyObject *DriverError; /* DriverError(code, text) */
static PyTypeObject *EngineType;
static PyTypeObject *JobType;

typedef struct {
    PyObject_HEAD
    engine_t *eng;
    pid_t pid;
    int closed;
} EngineObject;

typedef struct {
    PyObject_HEAD
    job_t *job;
    PyObject *engine; /* keeps the engine alive */
} JobObject;

static int check_process(EngineObject *self) {
    if (self->pid != getpid()) {
        PyErr_SetString(PyExc_RuntimeError,
                        "this staging engine was created in another process (a fork); it cannot be used here");
        return -1;
    }
    return 0;
}

static int check_open(EngineObject *self) {
    if (check_process(self)) return -1;
    if (self->closed || !self->eng) {
        PyErr_SetString(PyExc_RuntimeError, "the staging engine is closed");
        return -1;
    }
    return 0;
}

static void raise_driver_error(const err_t *e) {
    PyObject *args = Py_BuildValue("(is)", e->code, e->text);
    if (args) {
        PyErr_SetObject(DriverError, args);
        Py_DECREF(args);
    }
}

/* -- Engine.__init__ ------------------------------------------------------------------------------- */

static int get_entry_points(PyObject *mapping, driver_t *drv) {
    void **table = (void **)drv;
    for (int i = 0; i < N_DRIVER_NAMES; i++) {
        PyObject *v = PyMapping_GetItemString(mapping, DRIVER_NAMES[i]);
        if (!v) {
            if (i >= DRIVER_REQUIRED && PyErr_ExceptionMatches(PyExc_KeyError)) {
                PyErr_Clear();
                table[i] = NULL;
                continue;
            }
            if (PyErr_ExceptionMatches(PyExc_KeyError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_ValueError, "entry_points lacks %s", DRIVER_NAMES[i]);
            }
            return -1;
        }
        unsigned long long addr = PyLong_AsUnsignedLongLong(v);
        Py_DECREF(v);
        if (PyErr_Occurred()) return -1;
        if (!addr && i < DRIVER_REQUIRED) {
            PyErr_Format(PyExc_ValueError, "entry point %s is NULL (not supported by this driver?)", DRIVER_NAMES[i]);
            return -1;
        }
        table[i] = (void *)(uintptr_t)addr;
    }
    return 0;
}

/* A Python int in [0, 2**64), or (unsigned long long)-1 with an exception. PyLong_AsUnsignedLong loops
 * over the digits where a long has 64 bits; the long long one takes the byte-array path for every
 * pointer-sized value, about 25 ns more a call (a submission converts five). */
static inline unsigned long long as_u64(PyObject *obj) {
#if ULONG_MAX == ULLONG_MAX
    return PyLong_AsUnsignedLong(obj);
#else
    return PyLong_AsUnsignedLongLong(obj);
#endif
}

/* An address: a Python int in [0, 2**64), checked (the "K" format would wrap negative numbers). */
static int address_converter(PyObject *obj, void *out) {
    if (!PyLong_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "an address must be an int");
        return 0;
    }
    unsigned long long v = as_u64(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return 0;
    *(unsigned long long *)out = v;
    return 1;
}

static PyObject *Engine_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"direction",  "mode",    "lanes",     "slots_per_lane", "slot_bytes",
                             "min_chunk_bytes", "context", "entry_points", "bandwidth", "latency", "spin_us",
                             "idle_spin_us", "min_chunks_per_lane", "serialize_driver", "nontemporal",
                             "driver_thread", "wait_spin_us", "one_stream", "lane_wait_us", "helpers",
                             "help_spin_us", "piece_bytes", "lead_copies", "cooperative_max_bytes", NULL};
    const char *direction, *mode = "emulated";
    int lanes = 4, slots = 2;
    Py_ssize_t slot_bytes = 1 << 20, min_chunk = 256 << 10;
    unsigned long long context = 0;
    PyObject *entry_points = Py_None;
    double bandwidth = 25e9, latency = 5e-6, spin_us = 0, idle_spin_us = 0;
    int min_chunks_per_lane = 1, serialize_driver = 1, nontemporal = 1, driver_thread = 1, one_stream = 0;
    double wait_spin_us = 0, lane_wait_us = DT_LANE_SLEEP_NS / 1e3, help_spin_us = 200;
    int helpers = 0, lead_copies = 1;
    Py_ssize_t piece_bytes = 128 << 10, coop_max = PY_SSIZE_T_MAX;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "s|$siinnO&Oddddipppdpdidnpn", kwlist, &direction, &mode, &lanes,
                                     &slots, &slot_bytes, &min_chunk, address_converter, &context, &entry_points,
                                     &bandwidth, &latency, &spin_us, &idle_spin_us, &min_chunks_per_lane,
                                     &serialize_driver, &nontemporal, &driver_thread, &wait_spin_us, &one_stream,
                                     &lane_wait_us, &helpers, &help_spin_us, &piece_bytes, &lead_copies,
                                     &coop_max))
        return NULL;
    int upload;
    if (!strcmp(direction, "upload"))
        upload = 1;
    else if (!strcmp(direction, "download"))
        upload = 0;
    else {
        PyErr_Format(PyExc_ValueError, "direction must be 'upload' or 'download', got '%s'", direction);
        return NULL;
    }
    int emulated;
    if (!strcmp(mode, "emulated"))
        emulated = 1;
    else if (!strcmp(mode, "cuda"))
        emulated = 0;
    else {
        PyErr_SetString(PyExc_ValueError, "mode must be 'cuda' or 'emulated'");
        return NULL;
    }
    if (lanes < 1 || lanes > MAX_LANES || slots < 1 || slots > MAX_SLOTS || slot_bytes < 4096 || min_chunk < 4096) {
        PyErr_Format(PyExc_ValueError,
                     "the engine needs 1 <= lanes <= %d, 1 <= slots_per_lane <= %d, slot_bytes >= 4096 and "
                     "min_chunk_bytes >= 4096",
                     MAX_LANES, MAX_SLOTS);
        return NULL;
    }
    if (!(spin_us >= 0 && spin_us <= 1e6 && idle_spin_us >= 0 && idle_spin_us <= 1e6 && wait_spin_us >= 0 &&
          wait_spin_us <= 1e6 && lane_wait_us >= 0 && lane_wait_us <= 1e6)) {
        PyErr_SetString(PyExc_ValueError, "spin_us, idle_spin_us, wait_spin_us and lane_wait_us must be in [0, 1e6]");
        return NULL;
    }
    if (helpers < 0 || helpers >= lanes || !(help_spin_us >= 0 && help_spin_us <= 1e7) ||
        piece_bytes < (Py_ssize_t)COPIER_MIN_PIECE || (!lead_copies && !helpers) || coop_max < 0) {
        PyErr_Format(PyExc_ValueError,
                     "the engine needs 0 <= helpers < lanes, help_spin_us in [0, 1e7], piece_bytes >= %zu, "
                     "cooperative_max_bytes >= 0, and helpers for lead_copies=False",
                     COPIER_MIN_PIECE);
        return NULL;
    }
    if (min_chunks_per_lane < 1 || min_chunks_per_lane > 64) {
        PyErr_SetString(PyExc_ValueError, "min_chunks_per_lane must be in [1, 64]");
        return NULL;
    }
    if (emulated && !(bandwidth > 0 && latency >= 0)) {
        PyErr_SetString(PyExc_ValueError, "emulated bandwidth must be > 0 and latency >= 0");
        return NULL;
    }
    driver_t drv;
    memset(&drv, 0, sizeof drv);
    if (!emulated) {
        if (entry_points == Py_None || !context) {
            PyErr_SetString(PyExc_ValueError, "mode='cuda' needs context and entry_points");
            return NULL;
        }
        if (get_entry_points(entry_points, &drv)) return NULL;
    }
    engine_t *eng = calloc(1, sizeof *eng);
    if (!eng) return PyErr_NoMemory();
    eng->emulated = emulated;
    eng->upload = upload;
    eng->nlanes = lanes;
    eng->slots_per_lane = slots;
    eng->slot_bytes = (size_t)slot_bytes;
    eng->min_chunk_bytes = (size_t)min_chunk;
    eng->bandwidth = bandwidth;
    eng->latency = latency;
    eng->spin_ns = (int64_t)(spin_us * 1e3);
    eng->idle_spin_ns = (int64_t)(idle_spin_us * 1e3);
    eng->min_chunks_per_lane = min_chunks_per_lane;
    eng->serialize = !emulated && serialize_driver;
    eng->nontemporal = nontemporal;
    eng->wait_spin_ns = (int64_t)(wait_spin_us * 1e3);
    eng->lane_wait_ns = (int64_t)(lane_wait_us * 1e3);
    eng->helpers = helpers;
    eng->lead_copies = lead_copies;
    eng->piece_bytes = (size_t)piece_bytes;
    eng->coop_max_bytes = (size_t)coop_max;
    eng->help_spin_ns = (int64_t)(help_spin_us * 1e3);
    atomic_init(&eng->leads, 0);
    atomic_init(&eng->idle_sleepers, 0);
    atomic_init(&eng->helping, 0);
    atomic_init(&eng->waking, 0);
    atomic_init(&eng->task_seq, 0);
    atomic_init(&eng->helped, 0);
    atomic_init(&eng->coop_jobs, 0);
    eng->ctx = (CUcontext)(uintptr_t)context;
    eng->drv = drv;
    eng->pid = getpid();
    atomic_init(&eng->held, 0);
    atomic_init(&eng->held_bytes, 0);
    atomic_init(&eng->abandoned_bytes, 0);
    atomic_init(&eng->poison, 0);
    if (pthread_mutex_init(&eng->mu, NULL)) {
        free(eng);
        return PyErr_NoMemory();
    }
    if (pthread_cond_init(&eng->cv, NULL)) {
        pthread_mutex_destroy(&eng->mu);
        free(eng);
        return PyErr_NoMemory();
    }
    int inited = 0;
    for (; inited < lanes; inited++) {
        lane_t *L = &eng->lanes[inited];
        L->eng = eng;
        L->index = inited;
        atomic_init(&L->queued, 0);
        atomic_init(&L->help_task, NULL);
        atomic_init(&L->help_posted, 0);
        atomic_init(&L->help_active, 0);
        if (pthread_mutex_init(&L->mu, NULL)) break;
        if (cond_init_monotonic(&L->cv)) { /* dt_call's timed wait uses monotonic deadlines */
            pthread_mutex_destroy(&L->mu);
            break;
        }
    }
    if (inited < lanes) {
        for (int i = 0; i < inited; i++) {
            pthread_mutex_destroy(&eng->lanes[i].mu);
            pthread_cond_destroy(&eng->lanes[i].cv);
        }
        pthread_mutex_destroy(&eng->mu);
        pthread_cond_destroy(&eng->cv);
        free(eng);
        return PyErr_NoMemory();
    }
    if (driver_thread) { /* one that fails to start leaves the lanes calling the driver themselves: slower, not
                          * wrong; Engine.driver_thread reports which runs */
        int dt_rc = 0;
        Py_BEGIN_ALLOW_THREADS
        eng->dt = dt_start(eng, eng->idle_spin_ns > 100000 ? eng->idle_spin_ns : 100000, one_stream, &dt_rc);
        Py_END_ALLOW_THREADS
    }
    int started = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; started < lanes; started++) {
        lane_t *L = &eng->lanes[started];
        if (pthread_create(&L->thread, NULL, lane_main, L)) break;
        L->started = 1;
    }
    pthread_mutex_lock(&eng->mu);
    while (eng->ready < started) pthread_cond_wait(&eng->cv, &eng->mu);
    pthread_mutex_unlock(&eng->mu);
    Py_END_ALLOW_THREADS
    if (started < lanes || eng->setup_failed) {
        err_t e = eng->setup_err;
        int failed = eng->setup_failed;
        Py_BEGIN_ALLOW_THREADS
        engine_stop_lanes(eng);
        Py_END_ALLOW_THREADS
        engine_free(eng);
        if (failed)
            raise_driver_error(&e);
        else
            PyErr_SetString(PyExc_RuntimeError, "could not start the staging threads");
        return NULL;
    }
    PyObject *obj = PyType_GenericAlloc(type, 0);
    if (!obj) {
        Py_BEGIN_ALLOW_THREADS
        engine_stop_lanes(eng);
        Py_END_ALLOW_THREADS
        engine_free(eng);
        return NULL;
    }
    EngineObject *self = (EngineObject *)obj;
    self->eng = eng;
    self->pid = eng->pid;
    self->closed = 0;
    return obj;
}

static void engine_close(EngineObject *self) {
    if (self->closed || !self->eng) return;
    self->closed = 1;
    engine_t *eng = self->eng;
    Py_BEGIN_ALLOW_THREADS
    engine_stop_lanes(eng);
    Py_END_ALLOW_THREADS
    eng->closed = 1;
}

static void Engine_dealloc(PyObject *obj) {
    EngineObject *self = (EngineObject *)obj;
    PyTypeObject *tp = Py_TYPE(obj);
    if (self->eng) {
        if (self->pid == getpid()) {
            engine_close(self);
            engine_free(self->eng);
        } /* else: a forked child: the threads do not exist here; leak on purpose */
        self->eng = NULL;
    }
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(obj);
    Py_DECREF(tp);
}

static PyObject *Engine_close(PyObject *obj, PyObject *Py_UNUSED(ignored)) {
    EngineObject *self = (EngineObject *)obj;
    if (check_process(self)) return NULL;
    engine_close(self);
    Py_RETURN_NONE;
}

static size_t auto_chunk(const engine_t *eng, size_t nbytes) {
    size_t lanes = (size_t)eng->nlanes;
    size_t per_lane = (nbytes + lanes * eng->slot_bytes - 1) / (lanes * eng->slot_bytes);
    if (per_lane < (size_t)eng->min_chunks_per_lane) per_lane = (size_t)eng->min_chunks_per_lane;
    size_t chunk = (nbytes + lanes * per_lane - 1) / (lanes * per_lane);
    chunk = (chunk + 65535) / 65536 * 65536;
    if (chunk < eng->min_chunk_bytes) chunk = eng->min_chunk_bytes;
    if (chunk > eng->slot_bytes) chunk = eng->slot_bytes;
    return chunk;
}

/* A cooperative job's chunk: a quarter of the job (so that the link starts after a quarter's copy),
 * whole 64 KiB, at least two pieces and min_chunk_bytes, at most a slot. */
static size_t coop_chunk(const engine_t *eng, size_t nbytes) {
    size_t chunk = (nbytes + COOP_CHUNKS - 1) / COOP_CHUNKS;
    chunk = (chunk + 65535) / 65536 * 65536;
    if (chunk < eng->min_chunk_bytes) chunk = eng->min_chunk_bytes;
    if (chunk < 2 * eng->piece_bytes) chunk = 2 * eng->piece_bytes;
    if (chunk > eng->slot_bytes) chunk = eng->slot_bytes;
    return chunk;
}

static int is_coop(const engine_t *eng, int contiguous, size_t nbytes) {
    return eng->helpers > 0 && contiguous && nbytes >= 2 * eng->piece_bytes && nbytes <= eng->coop_max_bytes;
}

static PyObject *Engine_chunk_bytes(PyObject *obj, PyObject *arg) {
    EngineObject *self = (EngineObject *)obj;
    if (check_open(self)) return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "nbytes must be >= 0");
        return NULL;
    }
    engine_t *eng = self->eng;
    return PyLong_FromSize_t(is_coop(eng, 1, (size_t)n) ? coop_chunk(eng, (size_t)n) : auto_chunk(eng, (size_t)n));
}

static int seq_to_ssize(PyObject *seq, Py_ssize_t *out, Py_ssize_t *n, const char *what) {
    Py_ssize_t len = PySequence_Size(seq);
    if (len < 0) return -1;
    if (len > MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "%s has more than %d dimensions", what, MAX_DIMS);
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        PyObject *item = PySequence_GetItem(seq, i);
        if (!item) return -1;
        out[i] = PyLong_AsSsize_t(item);
        Py_DECREF(item);
        if (out[i] == -1 && PyErr_Occurred()) return -1;
    }
    *n = len;
    return 0;
}

static PyObject *Engine_submit(PyObject *obj, PyObject *args, PyObject *kwds) {
    EngineObject *self = (EngineObject *)obj;
    static char *kwlist[] = {"host_ptr", "device_ptr", "nbytes", "shape", "strides", "itemsize", "chunk_bytes",
                             "hand_off", NULL};
    unsigned long long host_ptr, dev_ptr;
    Py_ssize_t nbytes, itemsize, chunk_bytes = 0;
    PyObject *shape_obj, *strides_obj;
    int hand_off = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&O&nOOn|n$p", kwlist, address_converter, &host_ptr,
                                     address_converter, &dev_ptr, &nbytes, &shape_obj, &strides_obj, &itemsize,
                                     &chunk_bytes, &hand_off))
        return NULL;
    if (check_open(self)) return NULL;
    engine_t *eng = self->eng;
    job_t *job = calloc(1, sizeof *job);
    if (!job) return PyErr_NoMemory();
    job->nontemporal = eng->nontemporal;
    Py_ssize_t nd_shape = 0, nd_strides = 0;
    if (seq_to_ssize(shape_obj, job->shape, &nd_shape, "shape") ||
        seq_to_ssize(strides_obj, job->strides, &nd_strides, "strides"))
        goto fail;
    if (nd_shape != nd_strides) {
        PyErr_SetString(PyExc_ValueError, "shape and strides differ in length");
        goto fail;
    }
    if (itemsize < 1 || nbytes < 0 || chunk_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "itemsize must be >= 1, nbytes and chunk_bytes >= 0");
        goto fail;
    }
    if ((size_t)itemsize > eng->slot_bytes) {
        PyErr_SetString(PyExc_ValueError, "itemsize is larger than a staging slot");
        goto fail;
    }
    if ((!host_ptr || !dev_ptr) && nbytes) {
        PyErr_SetString(PyExc_ValueError, "host_ptr and device_ptr must not be NULL");
        goto fail;
    }
    job->ndim = (int)nd_shape;
    job->itemsize = (size_t)itemsize;
    size_t count = 1;
    for (int a = 0; a < job->ndim; a++) {
        if (job->shape[a] < 0) {
            PyErr_SetString(PyExc_ValueError, "shape entries must be >= 0");
            goto fail;
        }
        if (job->shape[a] && count > SIZE_MAX / (size_t)job->shape[a]) {
            PyErr_SetString(PyExc_OverflowError, "the array is too large");
            goto fail;
        }
        count *= (size_t)job->shape[a];
    }
    if (count > SIZE_MAX / job->itemsize || count * job->itemsize != (size_t)nbytes) {
        PyErr_SetString(PyExc_ValueError, "nbytes does not equal prod(shape) * itemsize");
        goto fail;
    }
    job->upload = eng->upload;
    job->host = (char *)(uintptr_t)host_ptr;
    job->dev = (CUdeviceptr)dev_ptr;
    job->nbytes = (size_t)nbytes;
    /* contiguous in C order? (dims of length 1 do not matter) */
    size_t step = job->itemsize;
    job->contiguous = 1;
    for (int a = job->ndim - 1; a >= 0; a--) {
        job->step[a] = step;
        if (job->shape[a] != 1 && job->strides[a] != (Py_ssize_t)step) job->contiguous = 0;
        step *= (size_t)job->shape[a];
    }
    job->coop = is_coop(eng, job->contiguous, job->nbytes);
    size_t chunk = chunk_bytes ? (size_t)chunk_bytes
                   : job->coop ? coop_chunk(eng, job->nbytes)
                               : auto_chunk(eng, job->nbytes);
    if (chunk > eng->slot_bytes) chunk = eng->slot_bytes;
    if (chunk < 1) chunk = 1;
    job->chunk_bytes = chunk;
    if (job->nbytes == 0) {
        job->nchunks = 0;
    } else if (job->contiguous) {
        job->nchunks = (job->nbytes + chunk - 1) / chunk;
    } else {
        int axis = job->ndim - 1;
        for (int a = 0; a < job->ndim; a++)
            if (job->step[a] <= chunk) {
                axis = a;
                break;
            }
        size_t per = chunk / job->step[axis];
        if (per < 1) per = 1;
        job->axis = axis;
        job->per = per;
        job->nper = ((size_t)job->shape[axis] + per - 1) / per;
        size_t prefixes = 1;
        for (int a = 0; a < axis; a++) prefixes *= (size_t)job->shape[a];
        job->nchunks = prefixes * job->nper;
    }
    if (job->nchunks && job->nchunks <= TRACE_CHUNKS) job->trace = calloc(job->nchunks, sizeof(chunk_trace_t));
    int nl = job->nchunks < (size_t)eng->nlanes ? (int)job->nchunks : eng->nlanes;
    if (job->coop && nl > 1) nl = 1; /* the lead takes every chunk; helpers copy with it */
    if (!nl) job->coop = 0;
    job->nlanes = nl;
    atomic_init(&job->done, nl == 0);
    atomic_init(&job->failed, 0);
    atomic_init(&job->remaining, nl);
    atomic_init(&job->unposted, hand_off ? nl : 0);
    atomic_init(&job->host_bytes, 0);
    atomic_init(&job->refs, 1 + nl);
    job->t_submit = now_ns();
    atomic_init(&job->t_start_first, 0);
    atomic_init(&job->t_start_last, 0);
    atomic_init(&job->t_copy_last, 0);
    atomic_init(&job->t_enqueue_last, 0);
    atomic_init(&job->t_done, nl == 0 ? job->t_submit : 0);
    if (pthread_mutex_init(&job->mu, NULL)) {
        PyErr_NoMemory();
        goto fail;
    }
    if (cond_init_monotonic(&job->cv)) {
        pthread_mutex_destroy(&job->mu);
        PyErr_NoMemory();
        goto fail;
    }
    share_t *shares[MAX_LANES];
    for (int i = 0; i < nl; i++) {
        shares[i] = calloc(1, sizeof(share_t));
        if (!shares[i]) {
            for (int j = 0; j < i; j++) free(shares[j]);
            pthread_mutex_destroy(&job->mu);
            pthread_cond_destroy(&job->cv);
            PyErr_NoMemory();
            goto fail;
        }
    }
    JobObject *jo = (JobObject *)PyType_GenericAlloc(JobType, 0);
    if (!jo) {
        for (int j = 0; j < nl; j++) free(shares[j]);
        pthread_mutex_destroy(&job->mu);
        pthread_cond_destroy(&job->cv);
        goto fail;
    }
    jo->job = job;
    Py_INCREF(obj);
    jo->engine = obj;
    pthread_mutex_lock(&eng->mu);
    if (eng->closing) { /* another thread closed it since check_open */
        pthread_mutex_unlock(&eng->mu);
        for (int j = 0; j < nl; j++) free(shares[j]);
        atomic_store(&job->refs, 1);
        Py_DECREF(jo); /* frees the job */
        PyErr_SetString(PyExc_RuntimeError, "the staging engine is closed");
        return NULL;
    }
    int start = eng->next_lane;
    eng->next_lane = (int)(((size_t)start + (job->coop ? 1 : job->nchunks)) % (size_t)eng->nlanes);
    if (job->coop) { /* before the lead can run (and count down): helpers look for it */
        atomic_fetch_add(&eng->leads, 1);
        atomic_fetch_add_explicit(&eng->coop_jobs, 1, memory_order_relaxed);
    }
    if (eng->dt) atomic_fetch_add(&eng->dt->active, nl); /* before a lane can run (and count down) one */
    for (int i = 0; i < nl; i++) {
        share_t *s = shares[i];
        s->job = job;
        s->first = (size_t)i;
        s->stride = (size_t)nl;
        s->posts = hand_off;
    }
    /* Queue every share, then wake the lanes that sleep, outside their mutexes (a lane woken while
     * its mutex is held would only block on it again: a second wake-up, costly on a VM). A lane
     * that is busy or polling finds its share without a signal. */
    lane_t *sleepers[MAX_LANES];
    int nsleep = 0;
    for (int i = 0; i < nl; i++) {
        lane_t *L = &eng->lanes[(start + i) % eng->nlanes];
        pthread_mutex_lock(&L->mu);
        if (L->tail)
            L->tail->next = shares[i];
        else
            L->head = shares[i];
        L->tail = shares[i];
        atomic_fetch_add_explicit(&L->queued, 1, memory_order_release);
        if (L->sleeping) sleepers[nsleep++] = L;
        pthread_mutex_unlock(&L->mu);
    }
    pthread_mutex_unlock(&eng->mu);
    for (int i = 0; i < nsleep; i++) pthread_cond_signal(&sleepers[i]->cv);
    if (job->coop) /* helpers wake while the lead does: a wake-up costs 50 - 200 us on the H200's VM */
        wake_helpers(&eng->lanes[start], eng->helpers);
    if (eng->dt) dt_wake(eng->dt); /* up and polling before the job's first copy ends */
    return (PyObject *)jo;
fail:
    free(job->trace);
    free(job);
    return NULL;
}

static PyObject *Engine_streams(PyObject *obj, PyObject *Py_UNUSED(ignored)) {
    EngineObject *self = (EngineObject *)obj;
    if (check_open(self)) return NULL;
    engine_t *eng = self->eng;
    PyObject *list = PyList_New(0);
    if (!list) return NULL;
    if (eng->dt && eng->dt->stream) { /* one_stream: every DMA is on it */
        PyObject *v = PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)eng->dt->stream);
        if (!v || PyList_Append(list, v)) {
            Py_XDECREF(v);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(v);
        return list;
    }
    for (int i = 0; i < eng->nlanes; i++) {
        uintptr_t h = eng->emulated ? (uintptr_t)eng->lanes[i].es : (uintptr_t)eng->lanes[i].stream;
        PyObject *v = PyLong_FromUnsignedLongLong((unsigned long long)h);
        if (!v || PyList_Append(list, v)) {
            Py_XDECREF(v);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(v);
    }
    return list;
}

static PyObject *Engine_hold(PyObject *obj, PyObject *Py_UNUSED(ignored)) {
    EngineObject *self = (EngineObject *)obj;
    if (check_open(self)) return NULL;
    atomic_store(&self->eng->held, 1);
    Py_RETURN_NONE;
}

static PyObject *Engine_release(PyObject *obj, PyObject *Py_UNUSED(ignored)) {
    EngineObject *self = (EngineObject *)obj;
    if (check_open(self)) return NULL;
    engine_t *eng = self->eng;
    atomic_store(&eng->held, 0);
    pthread_mutex_lock(&eng->mu);
    pthread_cond_broadcast(&eng->cv);
    pthread_mutex_unlock(&eng->mu);
    if (eng->emulated) {
        for (int i = 0; i < eng->nlanes; i++) {
            emu_stream_t *es = eng->lanes[i].es;
            if (!es) continue;
            pthread_mutex_lock(&es->mu);
            pthread_cond_broadcast(&es->cv);
            pthread_mutex_unlock(&es->mu);
        }
    }
    Py_RETURN_NONE;
}

static PyObject *Engine_fail_next_copy(PyObject *obj, PyObject *args, PyObject *kwds) {
    EngineObject *self = (EngineObject *)obj;
    static char *kwlist[] = {"after", "sticky", NULL};
    int after = 0, sticky = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|i$p", kwlist, &after, &sticky)) return NULL;
    if (check_open(self)) return NULL;
    if (!self->eng->emulated) {
        PyErr_SetString(PyExc_RuntimeError, "fail_next_copy is for emulated engines only");
        return NULL;
    }
    if (after < 0) {
        PyErr_SetString(PyExc_ValueError, "after must be >= 0");
        return NULL;
    }
    engine_t *eng = self->eng;
    pthread_mutex_lock(&eng->mu);
    eng->fail_armed = 1;
    eng->fail_after = after;
    eng->fail_sticky = sticky;
    pthread_mutex_unlock(&eng->mu);
    Py_RETURN_NONE;
}

static PyObject *Engine_get_held_bytes(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyLong_FromLongLong(self->eng ? atomic_load(&self->eng->held_bytes) : 0);
}

static PyObject *Engine_get_abandoned_bytes(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyLong_FromLongLong(self->eng ? atomic_load(&self->eng->abandoned_bytes) : 0);
}

static PyObject *Engine_get_closed(PyObject *obj, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(((EngineObject *)obj)->closed);
}

static PyObject *Engine_get_lanes(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyLong_FromLong(self->eng ? self->eng->nlanes : 0);
}

static PyObject *Engine_get_slots_per_lane(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyLong_FromLong(self->eng ? self->eng->slots_per_lane : 0);
}

static PyObject *Engine_get_slot_bytes(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyLong_FromSize_t(self->eng ? self->eng->slot_bytes : 0);
}

static PyObject *Engine_get_direction(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyUnicode_FromString(self->eng && self->eng->upload ? "upload" : "download");
}

static PyObject *Engine_get_driver_thread(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyBool_FromLong(self->eng && self->eng->dt);
}

static PyObject *Engine_get_wait_spin_us(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyFloat_FromDouble(self->eng ? (double)self->eng->wait_spin_ns / 1e3 : 0.0);
}

static PyObject *Engine_get_lane_wait_us(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyFloat_FromDouble(self->eng ? (double)self->eng->lane_wait_ns / 1e3 : 0.0);
}

static PyObject *Engine_get_spin_us(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyFloat_FromDouble(self->eng ? (double)self->eng->spin_ns / 1e3 : 0.0);
}

static PyObject *Engine_get_helpers(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyLong_FromLong(self->eng ? self->eng->helpers : 0);
}

static PyObject *Engine_get_piece_bytes(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyLong_FromSize_t(self->eng ? self->eng->piece_bytes : 0);
}

static PyObject *Engine_get_cooperative_max_bytes(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyLong_FromSize_t(self->eng ? self->eng->coop_max_bytes : 0);
}

static PyObject *Engine_get_helped_pieces(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyLong_FromUnsignedLongLong(self->eng ? atomic_load(&self->eng->helped) : 0);
}

static PyObject *Engine_get_cooperative_jobs(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyLong_FromUnsignedLongLong(self->eng ? atomic_load(&self->eng->coop_jobs) : 0);
}

static PyObject *Engine_get_mode(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyUnicode_FromString(self->eng && self->eng->emulated ? "emulated" : "cuda");
}

static PyMethodDef Engine_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))Engine_submit, METH_VARARGS | METH_KEYWORDS,
     "submit(host_ptr, device_ptr, nbytes, shape, strides, itemsize, chunk_bytes=0, *, hand_off=False)"
     " -> Job"},
    {"chunk_bytes", Engine_chunk_bytes, METH_O, "chunk_bytes(nbytes) -> the chunk size submit picks"},
    {"streams", Engine_streams, METH_NOARGS, "streams() -> the lanes' stream handles"},
    {"hold", Engine_hold, METH_NOARGS, "hold(): no new DMA starts until release()"},
    {"release", Engine_release, METH_NOARGS, "release(): lift a hold"},
    {"fail_next_copy", (PyCFunction)(void (*)(void))Engine_fail_next_copy, METH_VARARGS | METH_KEYWORDS,
     "fail_next_copy(after=0, *, sticky=False): emulated only"},
    {"close", Engine_close, METH_NOARGS, "close(): wait for every queued job, stop the lanes, free the slots"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Engine_getset[] = {
    {"held_bytes", Engine_get_held_bytes, NULL, "staging memory the lanes hold", NULL},
    {"abandoned_bytes", Engine_get_abandoned_bytes, NULL, "staging memory given up after failures", NULL},
    {"closed", Engine_get_closed, NULL, "whether close() ran", NULL},
    {"lanes", Engine_get_lanes, NULL, "lanes (threads, streams)", NULL},
    {"slots_per_lane", Engine_get_slots_per_lane, NULL, "slots per lane", NULL},
    {"slot_bytes", Engine_get_slot_bytes, NULL, "bytes per slot", NULL},
    {"direction", Engine_get_direction, NULL, "'upload' or 'download'", NULL},
    {"mode", Engine_get_mode, NULL, "'cuda' or 'emulated'", NULL},
    {"spin_us", Engine_get_spin_us, NULL, "how long an event or a job is polled before sleeping on it", NULL},
    {"wait_spin_us", Engine_get_wait_spin_us, NULL, "how long Job.wait polls the job before sleeping", NULL},
    {"lane_wait_us", Engine_get_lane_wait_us, NULL,
     "how long a lane waits awake for the driver thread's answer (a DMA's end) before sleeping (at least "
     "20 us of spinning; no effect without the driver thread)",
     NULL},
    {"helpers", Engine_get_helpers, NULL,
     "the most idle lanes that help one cooperative job's lead copy (0: every job's chunks are dealt to lanes)",
     NULL},
    {"piece_bytes", Engine_get_piece_bytes, NULL, "the pieces a cooperative job's chunk copy is cut into", NULL},
    {"cooperative_max_bytes", Engine_get_cooperative_max_bytes, NULL,
     "the largest cooperative job (larger ones are dealt to the lanes)", NULL},
    {"helped_pieces", Engine_get_helped_pieces, NULL, "pieces of cooperative jobs that helpers copied", NULL},
    {"cooperative_jobs", Engine_get_cooperative_jobs, NULL,
     "jobs submitted as cooperative (contiguous, at least two pieces, on an engine with helpers)", NULL},
    {"driver_thread", Engine_get_driver_thread, NULL,
     "whether a driver thread makes the lanes' enqueues (False: each lane calls the driver, or the engine is closed)",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Engine_slots[] = {
    {Py_tp_new, Engine_new},
    {Py_tp_dealloc, Engine_dealloc},
    {Py_tp_methods, Engine_methods},
    {Py_tp_getset, Engine_getset},
    {Py_tp_doc, "Engine(direction, *, mode='emulated', lanes=4, slots_per_lane=2, slot_bytes=1 MiB, "
                "min_chunk_bytes=256 KiB, context=0, entry_points=None, bandwidth=25e9, latency=5e-6, spin_us=0, "
                "idle_spin_us=0, min_chunks_per_lane=1, serialize_driver=True, nontemporal=True, driver_thread=True, "
                "wait_spin_us=0, one_stream=False, lane_wait_us=100, helpers=0, help_spin_us=200, piece_bytes=128 KiB, "
                "lead_copies=True, cooperative_max_bytes=no limit)"},
    {0, NULL},
};

static PyType_Spec Engine_spec = {
    "ferry._native._engine.Engine",
    sizeof(EngineObject),
    0,
    Py_TPFLAGS_DEFAULT,
    Engine_slots,
};

/* -- Job ------------------------------------------------------------------------------------------- */

static void Job_dealloc(PyObject *obj) {
    JobObject *self = (JobObject *)obj;
    PyTypeObject *tp = Py_TYPE(obj);
    EngineObject *eo = (EngineObject *)self->engine;
    if (self->job) {
        if (!eo || eo->pid == getpid()) job_decref(self->job); /* in a forked child: leak */
        self->job = NULL;
    }
    Py_XDECREF(self->engine);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(obj);
    Py_DECREF(tp);
}

static PyObject *Job_done(PyObject *obj, PyObject *Py_UNUSED(ignored)) {
    JobObject *self = (JobObject *)obj;
    return PyBool_FromLong(atomic_load_explicit(&self->job->done, memory_order_acquire));
}

/* timeout (None or seconds) -> an absolute deadline (0: already passed); -1 with an exception */
static int deadline_of(PyObject *timeout_obj, int64_t *deadline) {
    *deadline = INT64_MAX;
    if (timeout_obj == Py_None) return 0;
    double t = PyFloat_AsDouble(timeout_obj);
    if (t == -1.0 && PyErr_Occurred()) return -1;
    if (t != t) {
        PyErr_SetString(PyExc_ValueError, "timeout must not be NaN");
        return -1;
    }
    *deadline = t <= 0 ? 0 : t > 1e9 ? INT64_MAX : now_ns() + (int64_t)(t * 1e9);
    return 0;
}

static int job_is_done(job_t *job) { return atomic_load_explicit(&job->done, memory_order_acquire); }
static int job_is_posted(job_t *job) { return atomic_load_explicit(&job->unposted, memory_order_acquire) == 0; }

/*
 * Sleep on the job's condition variable (GIL released, in slices of JOB_SLICE_NS, Python signals
 * checked between them) until holds(job) or the deadline: 1 when it holds, 0 at the deadline, -1 with
 * the exception a signal handler raised. Every change of done or unposted broadcasts under job->mu.
 * A signal does not cut a condition variable's wait short, so the slice bounds how late Ctrl-C is seen
 * (it was 50 ms; a sleeping waiter now wakes 200 times a second).
 */
#define JOB_SLICE_NS 5000000LL

static int job_sleep(job_t *job, int (*holds)(job_t *), int64_t deadline) {
    for (;;) {
        int ok;
        int64_t slice_end = now_ns() + JOB_SLICE_NS;
        if (slice_end > deadline) slice_end = deadline;
        Py_BEGIN_ALLOW_THREADS
        struct timespec ts = ts_of(slice_end);
        pthread_mutex_lock(&job->mu);
        while (!(ok = holds(job))) {
            if (pthread_cond_timedwait(&job->cv, &job->mu, &ts) == ETIMEDOUT) {
                ok = holds(job);
                break;
            }
        }
        pthread_mutex_unlock(&job->mu);
        Py_END_ALLOW_THREADS
        if (ok) return 1;
        if (now_ns() >= deadline) return 0;
        if (PyErr_CheckSignals() < 0) return -1;
    }
}

static int job_of_this_process(JobObject *self) {
    if (((EngineObject *)self->engine)->pid == getpid()) return 0;
    PyErr_SetString(PyExc_RuntimeError, "this job belongs to another process (a fork)");
    return -1;
}

/*
 * Job.wait with wait_spin_us > 0 (a roomy machine, see engine_threads) polls the job until its
 * expected end plus the larger of wait_spin_us and spin_us (with spin_us alone: that long). The
 * expected end is its submission plus nbytes at 1 / WAIT_EXPECT_NS_PER_BYTE (16 GB/s, below every
 * staged figure the H200 measured from 8 MiB), at most WAIT_EXPECT_CAP_NS from now.
 * Without that an 8 MiB job (~330 us) outlasted the 200 us poll and paid a sleeping thread's wake-up
 * (30 - 60 us on the H200 VM). The waiting thread has nothing else to do; the GIL is released while
 * it polls. Job.wait(poll=False), the runtime watcher's, sleeps at once.
 */
#define WAIT_EXPECT_NS_PER_BYTE (1.0 / 16.0)
#define WAIT_EXPECT_CAP_NS 5000000LL

static PyObject *Job_wait(PyObject *obj, PyObject *args, PyObject *kwds) {
    JobObject *self = (JobObject *)obj;
    static char *kwlist[] = {"timeout", "poll", NULL};
    PyObject *timeout_obj = Py_None;
    int poll = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O$p", kwlist, &timeout_obj, &poll)) return NULL;
    job_t *job = self->job;
    if (job_is_done(job)) Py_RETURN_TRUE;
    int64_t deadline;
    if (deadline_of(timeout_obj, &deadline)) return NULL;
    if (deadline == 0) Py_RETURN_FALSE;
    if (job_of_this_process(self)) return NULL;
    EngineObject *eo = (EngineObject *)self->engine;
    int64_t spin_ns = 0, wait_spin_ns = 0;
    if (eo->eng && poll) {
        wait_spin_ns = eo->eng->wait_spin_ns;
        spin_ns = wait_spin_ns > eo->eng->spin_ns ? wait_spin_ns : eo->eng->spin_ns;
    }
    if (spin_ns > 0) {
        int done = 0;
        Py_BEGIN_ALLOW_THREADS
        int64_t now = now_ns(), until = now + spin_ns;
        if (wait_spin_ns > 0) { /* a job that should end soon: poll until then, not a wake-up past it */
            int64_t expected = job->t_submit + (int64_t)((double)job->nbytes * WAIT_EXPECT_NS_PER_BYTE);
            if (expected > WAIT_EXPECT_CAP_NS + now) expected = now + WAIT_EXPECT_CAP_NS;
            if (expected + spin_ns > until) until = expected + spin_ns;
        }
        if (until > deadline) until = deadline;
        while (!(done = job_is_done(job)) && now_ns() < until) cpu_relax();
        Py_END_ALLOW_THREADS
        if (done) Py_RETURN_TRUE;
    }
    int rc = job_sleep(job, job_is_done, deadline);
    if (rc < 0) return NULL;
    return PyBool_FromLong(rc);
}

/*
 * The hand-off: sleep until every share of the job posted, then list the events they posted. Each
 * was recorded on its lane's stream right after the share's last DMA, so a stream that waits for
 * all of them (cuStreamWaitEvent) runs after every DMA of the job. A share that never enqueued its
 * last DMA (the job failed) posts nothing: check the job's error.
 */
static PyObject *Job_hand_off(PyObject *obj, PyObject *args, PyObject *kwds) {
    JobObject *self = (JobObject *)obj;
    static char *kwlist[] = {"timeout", NULL};
    PyObject *timeout_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O", kwlist, &timeout_obj)) return NULL;
    job_t *job = self->job;
    int64_t deadline;
    if (deadline_of(timeout_obj, &deadline) || job_of_this_process(self)) return NULL;
    int rc = job_sleep(job, job_is_posted, deadline);
    if (rc < 0) return NULL;
    if (rc == 0) Py_RETURN_NONE;
    EngineObject *eo = (EngineObject *)self->engine;
    if (eo->closed || !eo->eng) { /* its lanes freed the events: a closed engine ran every job to the end */
        PyErr_SetString(PyExc_RuntimeError, "the staging engine is closed");
        return NULL;
    }
    void *events[MAX_LANES];
    pthread_mutex_lock(&job->mu);
    int n = job->nposted;
    memcpy(events, job->posted, (size_t)n * sizeof events[0]);
    pthread_mutex_unlock(&job->mu);
    PyObject *list = PyList_New(n);
    if (!list) return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *v = PyLong_FromVoidPtr(events[i]);
        if (!v || PyList_SetItem(list, i, v)) { /* steals v */
            Py_DECREF(list);
            return NULL;
        }
    }
    return list;
}

static PyObject *Job_get_error(PyObject *obj, void *Py_UNUSED(closure)) {
    job_t *job = ((JobObject *)obj)->job;
    if (!atomic_load_explicit(&job->failed, memory_order_acquire)) Py_RETURN_NONE;
    err_t e;
    pthread_mutex_lock(&job->mu);
    e = job->err;
    pthread_mutex_unlock(&job->mu);
    return Py_BuildValue("(isO)", e.code, e.text, e.sticky ? Py_True : Py_False);
}

static PyObject *Job_get_host_bytes(PyObject *obj, void *Py_UNUSED(closure)) {
    job_t *job = ((JobObject *)obj)->job;
    return PyLong_FromSize_t(atomic_load_explicit(&job->host_bytes, memory_order_acquire));
}

static PyObject *Job_get_nbytes(PyObject *obj, void *Py_UNUSED(closure)) {
    return PyLong_FromSize_t(((JobObject *)obj)->job->nbytes);
}

static PyObject *Job_get_chunks(PyObject *obj, void *Py_UNUSED(closure)) {
    return PyLong_FromSize_t(((JobObject *)obj)->job->nchunks);
}

static PyObject *Job_get_chunk_bytes(PyObject *obj, void *Py_UNUSED(closure)) {
    return PyLong_FromSize_t(((JobObject *)obj)->job->chunk_bytes);
}

static PyObject *Job_get_lanes(PyObject *obj, void *Py_UNUSED(closure)) {
    return PyLong_FromLong(((JobObject *)obj)->job->nlanes);
}

static PyObject *Job_timeline(PyObject *obj, PyObject *Py_UNUSED(ignored)) {
    job_t *job = ((JobObject *)obj)->job;
    const char *names[] = {"start_first", "start_last", "copy_last", "enqueue_last", "done"};
    atomic_llong *values[] = {&job->t_start_first, &job->t_start_last, &job->t_copy_last, &job->t_enqueue_last,
                              &job->t_done};
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    for (int i = 0; i < 5; i++) {
        long long t = atomic_load_explicit(values[i], memory_order_relaxed);
        PyObject *v = t ? PyFloat_FromDouble((double)(t - job->t_submit) / 1e3) : Py_NewRef(Py_None);
        if (!v || PyDict_SetItemString(d, names[i], v)) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(v);
    }
    const char *sums[] = {"enqueues", "enqueue_us", "lock_wait_us"};
    atomic_llong *sum_values[] = {&job->n_enqueues, &job->enqueue_ns, &job->lock_wait_ns};
    for (int i = 0; i < 3; i++) {
        long long t = atomic_load_explicit(sum_values[i], memory_order_relaxed);
        PyObject *v = i ? PyFloat_FromDouble((double)t / 1e3) : PyLong_FromLongLong(t);
        if (!v || PyDict_SetItemString(d, sums[i], v)) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(v);
    }
    return d;
}

static PyObject *Job_chunk_times(PyObject *obj, PyObject *Py_UNUSED(ignored)) {
    job_t *job = ((JobObject *)obj)->job;
    if (!job_is_done(job)) {
        PyErr_SetString(PyExc_RuntimeError, "chunk_times() needs a finished job");
        return NULL;
    }
    PyObject *list = PyList_New(0);
    if (!list || !job->trace) return list;
    for (size_t k = 0; k < job->nchunks; k++) {
        const chunk_trace_t *t = &job->trace[k];
        PyObject *row = Py_BuildValue("(idddd)", t->lane, (double)(t->t[0] - job->t_submit) / 1e3,
                                      (double)(t->t[1] - job->t_submit) / 1e3, (double)(t->t[2] - job->t_submit) / 1e3,
                                      (double)(t->t[3] - job->t_submit) / 1e3);
        if (!row || PyList_Append(list, row)) {
            Py_XDECREF(row);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(row);
    }
    return list;
}

static PyObject *Job_chunk_sizes(PyObject *obj, PyObject *Py_UNUSED(ignored)) {
    job_t *job = ((JobObject *)obj)->job;
    PyObject *list = PyList_New((Py_ssize_t)job->nchunks);
    if (!list) return NULL;
    chunk_t c;
    for (size_t k = 0; k < job->nchunks; k++) {
        job_chunk(job, k, &c);
        PyObject *v = PyLong_FromSize_t(c.nbytes);
        if (!v || PyList_SetItem(list, (Py_ssize_t)k, v)) { /* steals v */
            Py_DECREF(list);
            return NULL;
        }
    }
    return list;
}

static PyMethodDef Job_methods[] = {
    {"done", Job_done, METH_NOARGS, "done() -> bool: one atomic load, never blocks"},
    {"wait", (PyCFunction)(void (*)(void))Job_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(timeout=None) -> bool: sleep (GIL released) until done; False on timeout"},
    {"hand_off", (PyCFunction)(void (*)(void))Job_hand_off, METH_VARARGS | METH_KEYWORDS,
     "hand_off(timeout=None) -> [event handle] or None on timeout: sleep (GIL released) until every lane "
     "enqueued its share's last DMA, then the events recorded after them (submit(..., hand_off=True))"},
    {"timeline", Job_timeline, METH_NOARGS,
     "timeline() -> {event: microseconds after submit or None}: start_first, start_last, copy_last, "
     "enqueue_last, done; and the chunks' enqueues: enqueues (count), enqueue_us (summed time in the driver's "
     "copy and record calls), lock_wait_us (summed time waiting for the process's driver lock)"},
    {"chunk_sizes", Job_chunk_sizes, METH_NOARGS,
     "chunk_sizes() -> [bytes of chunk k]: the job's plan (chunk k goes to share k mod lanes)"},
    {"chunk_times", Job_chunk_times, METH_NOARGS,
     "chunk_times() -> [(lane, t0, t1, t2, t3)] per chunk, microseconds after submit, of a finished job (up to "
     "1024 chunks, else []): an upload's chunk taken up, its copy begun and ended, its enqueue answered; a "
     "download's DMA handed over and answered, its copy out begun and ended. A chunk a failure skipped reads "
     "negative times"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Job_getset[] = {
    {"error", Job_get_error, NULL, "(code, text, sticky) of the first failure, or None", NULL},
    {"host_bytes", Job_get_host_bytes, NULL, "bytes the host copied so far", NULL},
    {"nbytes", Job_get_nbytes, NULL, "the payload's size", NULL},
    {"chunks", Job_get_chunks, NULL, "how many chunks the payload was cut into", NULL},
    {"chunk_bytes", Job_get_chunk_bytes, NULL, "the chunk size limit used", NULL},
    {"lanes", Job_get_lanes, NULL, "how many lanes took a share", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyObject *Job_new_refused(PyTypeObject *Py_UNUSED(type), PyObject *Py_UNUSED(a), PyObject *Py_UNUSED(k)) {
    PyErr_SetString(PyExc_TypeError, "Job objects come from Engine.submit()");
    return NULL;
}

static PyType_Slot Job_slots[] = {
    {Py_tp_new, Job_new_refused},
    {Py_tp_dealloc, Job_dealloc},
    {Py_tp_methods, Job_methods},
    {Py_tp_getset, Job_getset},
    {Py_tp_doc, "One staged transfer (from Engine.submit)."},
    {0, NULL},
};

static PyType_Spec Job_spec = {
    "ferry._native._engine.Job",
    sizeof(JobObject),
    0,
    Py_TPFLAGS_DEFAULT,
    Job_slots,
};

/* -- the fast path: one driver call sequence per Python call, on the caller's thread ---------------- */

/*
 * Calls holds the driver entry points of ferry's small-transfer path, resolved once, and calls them
 * directly: a copy and its event record are one C call from Python (no cuda.bindings wrapper, no
 * result tuple, no enum object per call). Handles are the raw integer CUstream / CUevent values.
 * Nothing here touches ferry's Python objects: the ownership checks and state changes stay in
 * Python. A non-zero CUresult is handed to on_error(op, code, stage, args), whose return value (or
 * exception) becomes the call's: Python binds the context and retries, or raises DeviceError.
 * stage: 0 nothing was enqueued; 1 the copies are enqueued, the event record failed; 2 some of a
 * batch's copies were enqueued before one failed.
 *
 * Single copies keep the GIL (the driver returns in about a microsecond; handing the GIL over and
 * back would cost as much and lets another thread delay the caller). A batch of many copies and
 * every wait release it. event_wait polls cuEventQuery with the GIL released and comes back to
 * Python every WAIT_SLICE_NS to run signal handlers (a KeyboardInterrupt raised there propagates).
 */

typedef CUresult (*fn_memcpy_batch_13000)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, void *, size_t *, size_t,
                                          CUstream);
typedef CUresult (*fn_memcpy_batch_12080)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, void *, size_t *, size_t,
                                          size_t *, CUstream);

#define CU_MEMCPY_SRC_ACCESS_ORDER_STREAM 1
#define MEMCPY_ATTR_BYTES 64   /* CUmemcpyAttributes is 24-28 bytes in CUDA 12.8-13.x: zeroed room to spare */
#define BATCH_FREE_GIL 32      /* batches of at least this many copies release the GIL in the driver */
#define WAIT_SLICE_NS 2000000LL /* event_wait checks Python signals at least this often */

static PyTypeObject *CallsType;

typedef struct {
    PyObject_HEAD
    fn_memcpy_htod_async htod;
    fn_memcpy_dtoh_async dtoh;
    fn_event_record record;
    fn_event_query query;
    fn_event_synchronize synchronize;
    fn_stream_wait_event wait_event;
    /* the device pool's calls (rt.empty and a dropped array), all three or none: see Calls_mem_pool_alloc */
    fn_mem_alloc_from_pool_async pool_alloc;
    fn_mem_free_async free_async;
    fn_stream_synchronize stream_sync;
    void *batch;   /* cuMemcpyBatchAsync, or NULL: a batch is a loop of single copies */
    int batch_abi; /* 12080 (with failIdx) or 13000 (without), when batch is set */
    int batch_refused; /* the CUresult with which the driver refused a batch's description (then batch is NULL) */
    PyObject *on_error;
    long long waits, copies, batches, batched; /* touched with the GIL held */
} CallsObject;

/* An address or handle: a Python int in [0, 2**64) (None for an absent event when none_ok). */
static int int_arg(PyObject *obj, unsigned long long *out, int none_ok) {
    if (none_ok && obj == Py_None) {
        *out = 0;
        return 0;
    }
    *out = as_u64(obj);
    return (*out == (unsigned long long)-1 && PyErr_Occurred()) ? -1 : 0;
}

static int nargs_is(Py_ssize_t nargs, Py_ssize_t want, const char *name) {
    if (nargs == want) return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, nargs);
    return -1;
}

static PyObject *calls_failed(CallsObject *self, const char *op, int code, int stage, PyObject *const *args,
                              Py_ssize_t nargs) {
    PyObject *tuple = PyTuple_New(nargs);
    if (!tuple) return NULL;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        Py_INCREF(args[i]);
        PyTuple_SetItem(tuple, i, args[i]);
    }
    PyObject *result = PyObject_CallFunction(self->on_error, "siiO", op, code, stage, tuple);
    Py_DECREF(tuple);
    return result;
}

static int entry(PyObject *mapping, const char *name, void **out, int required) {
    PyObject *v = PyMapping_GetItemString(mapping, name);
    if (!v) {
        if (!PyErr_ExceptionMatches(PyExc_KeyError)) return -1;
        PyErr_Clear();
        if (required) {
            PyErr_Format(PyExc_ValueError, "entry_points lacks %s", name);
            return -1;
        }
        *out = NULL;
        return 0;
    }
    unsigned long long addr = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    if (PyErr_Occurred()) return -1;
    if (!addr && required) {
        PyErr_Format(PyExc_ValueError, "entry point %s is NULL", name);
        return -1;
    }
    *out = (void *)(uintptr_t)addr;
    return 0;
}

static PyObject *Calls_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"entry_points", "on_error", "batch_abi", NULL};
    PyObject *points, *on_error;
    int batch_abi = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|i", kwlist, &points, &on_error, &batch_abi)) return NULL;
    if (!PyCallable_Check(on_error)) {
        PyErr_SetString(PyExc_TypeError, "on_error must be callable");
        return NULL;
    }
    if (batch_abi != 0 && batch_abi != 12080 && batch_abi != 13000) {
        PyErr_SetString(PyExc_ValueError, "batch_abi must be 0, 12080 or 13000");
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    CallsObject *self = (CallsObject *)alloc(type, 0);
    if (!self) return NULL;
    void *batch = NULL;
    if (entry(points, "cuMemcpyHtoDAsync", (void **)&self->htod, 1) ||
        entry(points, "cuMemcpyDtoHAsync", (void **)&self->dtoh, 1) ||
        entry(points, "cuEventRecord", (void **)&self->record, 1) ||
        entry(points, "cuEventQuery", (void **)&self->query, 1) ||
        entry(points, "cuEventSynchronize", (void **)&self->synchronize, 1) ||
        entry(points, "cuStreamWaitEvent", (void **)&self->wait_event, 1) ||
        entry(points, "cuMemcpyBatchAsync", &batch, 0) ||
        entry(points, "cuMemAllocFromPoolAsync", (void **)&self->pool_alloc, 0) ||
        entry(points, "cuMemFreeAsync", (void **)&self->free_async, 0) ||
        entry(points, "cuStreamSynchronize", (void **)&self->stream_sync, 0)) {
        Py_DECREF(self);
        return NULL;
    }
    if (!self->pool_alloc || !self->free_async || !self->stream_sync) { /* all or none */
        self->pool_alloc = NULL;
        self->free_async = NULL;
        self->stream_sync = NULL;
    }
    self->batch = batch_abi ? batch : NULL;
    self->batch_abi = self->batch ? batch_abi : 0;
    Py_INCREF(on_error);
    self->on_error = on_error;
    return (PyObject *)self;
}

static void Calls_dealloc(PyObject *obj) {
    CallsObject *self = (CallsObject *)obj;
    PyTypeObject *tp = Py_TYPE(obj);
    Py_CLEAR(self->on_error);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(obj);
    Py_DECREF(tp);
}

/* One copy (skipped when n is 0), then the event record (skipped when event is 0). */
static CUresult calls_copy_record(CallsObject *self, int upload, unsigned long long dst, unsigned long long src,
                                  size_t n, CUstream stream, CUevent event, int *stage) {
    CUresult rc = 0;
    *stage = 0;
    if (n) {
        rc = upload ? self->htod((CUdeviceptr)dst, (const void *)(uintptr_t)src, n, stream)
                    : self->dtoh((void *)(uintptr_t)dst, (CUdeviceptr)src, n, stream);
        if (rc) return rc;
        self->copies++;
    }
    if (event) {
        *stage = 1;
        rc = self->record(event, stream);
    }
    return rc;
}

static PyObject *calls_copy(CallsObject *self, PyObject *const *args, Py_ssize_t nargs, int upload) {
    const char *op = upload ? "htod_record" : "dtoh_record";
    unsigned long long dst, src, n, stream, event;
    if (nargs_is(nargs, 5, op) || int_arg(args[0], &dst, 0) || int_arg(args[1], &src, 0) ||
        int_arg(args[2], &n, 0) || int_arg(args[3], &stream, 0) || int_arg(args[4], &event, 1))
        return NULL;
    int stage;
    CUresult rc = calls_copy_record(self, upload, dst, src, (size_t)n, (CUstream)(uintptr_t)stream,
                                    (CUevent)(uintptr_t)event, &stage);
    if (rc) return calls_failed(self, op, rc, stage, args, nargs);
    Py_RETURN_NONE;
}

static PyObject *Calls_htod_record(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
    return calls_copy((CallsObject *)obj, args, nargs, 1);
}

static PyObject *Calls_dtoh_record(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
    return calls_copy((CallsObject *)obj, args, nargs, 0);
}

static PyObject *Calls_event_record(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
    CallsObject *self = (CallsObject *)obj;
    unsigned long long event, stream;
    if (nargs_is(nargs, 2, "event_record") || int_arg(args[0], &event, 0) || int_arg(args[1], &stream, 0))
        return NULL;
    CUresult rc = self->record((CUevent)(uintptr_t)event, (CUstream)(uintptr_t)stream);
    if (rc) return calls_failed(self, "event_record", rc, 0, args, nargs);
    Py_RETURN_NONE;
}

static PyObject *Calls_event_query(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
    CallsObject *self = (CallsObject *)obj;
    unsigned long long event;
    if (nargs_is(nargs, 1, "event_query") || int_arg(args[0], &event, 0)) return NULL;
    CUresult rc = self->query((CUevent)(uintptr_t)event);
    if (!rc) Py_RETURN_TRUE;
    if (rc == ERR_NOT_READY) Py_RETURN_FALSE;
    return calls_failed(self, "event_query", rc, 0, args, nargs);
}

/*
 * stream_wait_events(stream, events): cuStreamWaitEvent(stream, event, 0) for each event of a list
 * (a staged job's posted events: one per lane). A failure is reported with stage 0: waiting for an
 * event again is harmless, so a retry waits for the whole list.
 */
static PyObject *Calls_stream_wait_events(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
    CallsObject *self = (CallsObject *)obj;
    unsigned long long stream;
    if (nargs_is(nargs, 2, "stream_wait_events") || int_arg(args[0], &stream, 0)) return NULL;
    if (!PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "stream_wait_events needs a list of event handles");
        return NULL;
    }
    Py_ssize_t n = PyList_Size(args[1]);
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long event;
        if (int_arg(PyList_GetItem(args[1], i), &event, 0)) return NULL; /* borrowed */
        CUresult rc = self->wait_event((CUstream)(uintptr_t)stream, (CUevent)(uintptr_t)event, 0);
        if (rc) return calls_failed(self, "stream_wait_events", rc, 0, args, nargs);
    }
    Py_RETURN_NONE;
}

/* event_wait(event, timeout): poll until complete or timeout seconds passed; whether it completed. */
static PyObject *Calls_event_wait(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
    CallsObject *self = (CallsObject *)obj;
    unsigned long long event;
    if (nargs_is(nargs, 2, "event_wait") || int_arg(args[0], &event, 0)) return NULL;
    double timeout = PyFloat_AsDouble(args[1]);
    if (timeout == -1.0 && PyErr_Occurred()) return NULL;
    CUevent ev = (CUevent)(uintptr_t)event;
    self->waits++;
    CUresult rc = self->query(ev);
    if (rc == ERR_NOT_READY && timeout > 0) {
        int64_t deadline = timeout > 1e9 ? INT64_MAX : now_ns() + (int64_t)(timeout * 1e9);
        for (;;) {
            int64_t slice_end = now_ns() + WAIT_SLICE_NS;
            if (slice_end > deadline) slice_end = deadline;
            Py_BEGIN_ALLOW_THREADS
            while ((rc = self->query(ev)) == ERR_NOT_READY && now_ns() < slice_end) cpu_relax();
            Py_END_ALLOW_THREADS
            if (rc != ERR_NOT_READY || now_ns() >= deadline) break;
            if (PyErr_CheckSignals() < 0) return NULL;
        }
    }
    if (!rc) Py_RETURN_TRUE;
    if (rc == ERR_NOT_READY) Py_RETURN_FALSE;
    return calls_failed(self, "event_wait", rc, 0, args, nargs);
}

static PyObject *Calls_event_synchronize(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
    CallsObject *self = (CallsObject *)obj;
    unsigned long long event;
    if (nargs_is(nargs, 1, "event_synchronize") || int_arg(args[0], &event, 0)) return NULL;
    self->waits++;
    CUresult rc;
    Py_BEGIN_ALLOW_THREADS
    rc = self->synchronize((CUevent)(uintptr_t)event);
    Py_END_ALLOW_THREADS
    if (rc) return calls_failed(self, "event_synchronize", rc, 0, args, nargs);
    Py_RETURN_NONE;
}

static int list_of_ints(PyObject *list, unsigned long long *out, Py_ssize_t n, const char *what) {
    if (!PyList_Check(list) || PyList_Size(list) != n) {
        PyErr_Format(PyExc_TypeError, "%s must be a list as long as dsts", what);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (int_arg(PyList_GetItem(list, i), &out[i], 0)) return -1;
    }
    return 0;
}

/*
 * copy_batch(upload, dsts, srcs, sizes, stream, event): every copy in list order on the stream (one
 * cuMemcpyBatchAsync, source accessed in stream order, where the driver has it; else one copy call
 * each), then the event record (unless event is None).
 */
static PyObject *Calls_copy_batch(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
    CallsObject *self = (CallsObject *)obj;
    unsigned long long stream_v, event_v;
    if (nargs_is(nargs, 6, "copy_batch") || int_arg(args[4], &stream_v, 0) || int_arg(args[5], &event_v, 1))
        return NULL;
    int upload = PyObject_IsTrue(args[0]);
    if (upload < 0) return NULL;
    if (!PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "dsts must be a list");
        return NULL;
    }
    Py_ssize_t n = PyList_Size(args[1]);
    unsigned long long *mem = n ? PyMem_Malloc((size_t)n * 3 * sizeof(unsigned long long)) : NULL;
    if (n && !mem) return PyErr_NoMemory();
    unsigned long long *dsts = mem, *srcs = mem + n, *sizes = mem + 2 * n;
    if (n && (list_of_ints(args[1], dsts, n, "dsts") || list_of_ints(args[2], srcs, n, "srcs") ||
              list_of_ints(args[3], sizes, n, "sizes"))) {
        PyMem_Free(mem);
        return NULL;
    }
    CUstream stream = (CUstream)(uintptr_t)stream_v;
    CUresult rc = 0;
    int stage = 0;
    if (self->batch && n > 1) {
        unsigned char attrs[MEMCPY_ATTR_BYTES];
        memset(attrs, 0, sizeof(attrs));
        int order = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
        memcpy(attrs, &order, sizeof(order));
        size_t first = 0, fail = (size_t)-1;
        int free_gil = n >= BATCH_FREE_GIL;
        PyThreadState *ts = free_gil ? PyEval_SaveThread() : NULL;
        if (self->batch_abi == 13000)
            rc = ((fn_memcpy_batch_13000)self->batch)((CUdeviceptr *)dsts, (CUdeviceptr *)srcs, (size_t *)sizes,
                                                      (size_t)n, attrs, &first, 1, stream);
        else
            rc = ((fn_memcpy_batch_12080)self->batch)((CUdeviceptr *)dsts, (CUdeviceptr *)srcs, (size_t *)sizes,
                                                      (size_t)n, attrs, &first, 1, &fail, stream);
        if (ts) PyEval_RestoreThread(ts);
        if (!rc) {
            self->batches++;
            self->batched += n;
        } else if (rc == ERR_INVALID_VALUE || rc == ERR_NOT_SUPPORTED) {
            /* the driver refused the batch's description (checked before anything is queued): use the loop
             * from now on, and say why (Calls.batch_refused; the backend's fast_path) */
            self->batch_refused = rc;
            self->batch = NULL;
            self->batch_abi = 0;
            rc = 0;
        }
    }
    if (!self->batch || n <= 1) {
        for (Py_ssize_t i = 0; i < n && !rc; i++) {
            if (!sizes[i]) continue;
            rc = upload ? self->htod((CUdeviceptr)dsts[i], (const void *)(uintptr_t)srcs[i], (size_t)sizes[i], stream)
                        : self->dtoh((void *)(uintptr_t)dsts[i], (CUdeviceptr)srcs[i], (size_t)sizes[i], stream);
            if (rc && i > 0) stage = 2;
            if (!rc) self->copies++;
        }
    }
    PyMem_Free(mem);
    if (!rc && event_v) {
        stage = 1;
        rc = self->record((CUevent)(uintptr_t)event_v, stream);
    }
    if (rc) return calls_failed(self, "copy_batch", rc, stage, args, nargs);
    Py_RETURN_NONE;
}

static PyObject *Calls_counts(PyObject *obj, PyObject *Py_UNUSED(ignored)) {
    CallsObject *self = (CallsObject *)obj;
    return Py_BuildValue("{sLsLsLsL}", "waits", self->waits, "copies", self->copies, "batches", self->batches,
                         "batched_copies", self->batched);
}

static PyObject *Calls_get_batch_abi(PyObject *obj, void *Py_UNUSED(closure)) {
    return PyLong_FromLong(((CallsObject *)obj)->batch_abi);
}

static PyObject *Calls_get_batch_refused(PyObject *obj, void *Py_UNUSED(closure)) {
    return PyLong_FromLong(((CallsObject *)obj)->batch_refused);
}

/*
 * The device pool's hot calls (ferry's stream-ordered allocator: src/ferry/_memory/_device.py).
 * mem_pool_alloc(pool, nbytes, stream) -> int: cuMemAllocFromPoolAsync on `stream`, then
 * cuStreamSynchronize(stream): ferry's allocation stream holds only allocations and frees that wait
 * for nothing, so the synchronization returns at once, and from it on the memory is usable on every
 * stream. If the synchronization fails the allocation is freed again (cuMemFreeAsync) before the
 * failure goes to on_error with stage 0 (nothing is left allocated: a retry may allocate afresh); if
 * that free fails too, with stage 2 (no retry: a second allocation would leak the first as well). mem_free_async(ptr, stream):
 * cuMemFreeAsync. `pool` is an int handle or an object int() takes (a cuda.bindings CUmemoryPool).
 * Both keep the GIL: the driver answers in about a microsecond.
 */
static int handle_arg(PyObject *obj, unsigned long long *out) {
    if (PyLong_Check(obj)) return int_arg(obj, out, 0);
    PyObject *as_int = NULL;
    if (PyIndex_Check(obj)) {
        as_int = PyNumber_Index(obj);
    } else if (PyObject_HasAttrString(obj, "__int__") && !PyObject_HasAttrString(obj, "__float__")) {
        as_int = PyNumber_Long(obj); /* a handle object (cuda.bindings' CUmemoryPool has __int__ only) */
    } else {
        PyErr_Format(PyExc_TypeError, "a handle must be an int or a handle object, not %R", obj);
    }
    if (!as_int) return -1;
    int rc = int_arg(as_int, out, 0);
    Py_DECREF(as_int);
    return rc;
}

static int pool_calls_present(CallsObject *self) {
    if (self->pool_alloc) return 1;
    PyErr_SetString(PyExc_RuntimeError, "this driver lacks the stream-ordered allocator's entry points");
    return 0;
}

static PyObject *Calls_mem_pool_alloc(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
    CallsObject *self = (CallsObject *)obj;
    unsigned long long pool, nbytes, stream;
    if (nargs_is(nargs, 3, "mem_pool_alloc") || !pool_calls_present(self) || handle_arg(args[0], &pool) ||
        int_arg(args[1], &nbytes, 0) || int_arg(args[2], &stream, 0))
        return NULL;
    CUdeviceptr ptr = 0;
    CUstream s = (CUstream)(uintptr_t)stream;
    CUresult rc = self->pool_alloc(&ptr, (size_t)nbytes, (CUmemoryPool)(uintptr_t)pool, s);
    if (rc) return calls_failed(self, "mem_pool_alloc", rc, 0, args, nargs);
    rc = self->stream_sync(s);
    if (rc) { /* freed again: stage 0; where the free fails too, stage 2, so that nothing retries it (the
               * DeviceError's `enqueued` then says True, which no allocation path reads) */
        int kept = self->free_async(ptr, s) != 0;
        return calls_failed(self, "mem_pool_alloc", rc, kept ? 2 : 0, args, nargs);
    }
    return PyLong_FromUnsignedLongLong(ptr);
}

static PyObject *Calls_mem_free_async(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
    CallsObject *self = (CallsObject *)obj;
    unsigned long long ptr, stream;
    if (nargs_is(nargs, 2, "mem_free_async") || !pool_calls_present(self) || int_arg(args[0], &ptr, 0) ||
        int_arg(args[1], &stream, 0))
        return NULL;
    CUresult rc = self->free_async((CUdeviceptr)ptr, (CUstream)(uintptr_t)stream);
    if (rc) return calls_failed(self, "mem_free_async", rc, 0, args, nargs);
    Py_RETURN_NONE;
}

static PyObject *Calls_get_pool_calls(PyObject *obj, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(((CallsObject *)obj)->pool_alloc != NULL);
}

static PyObject *Calls_get_waits(PyObject *obj, void *Py_UNUSED(closure)) {
    return PyLong_FromLongLong(((CallsObject *)obj)->waits);
}

static PyMethodDef Calls_methods[] = {
    {"htod_record", (PyCFunction)(void (*)(void))Calls_htod_record, METH_FASTCALL,
     "htod_record(dst, src, nbytes, stream, event): cuMemcpyHtoDAsync (unless nbytes is 0), cuEventRecord "
     "(unless event is None)"},
    {"dtoh_record", (PyCFunction)(void (*)(void))Calls_dtoh_record, METH_FASTCALL,
     "dtoh_record(dst, src, nbytes, stream, event): cuMemcpyDtoHAsync, then cuEventRecord"},
    {"event_record", (PyCFunction)(void (*)(void))Calls_event_record, METH_FASTCALL,
     "event_record(event, stream): cuEventRecord"},
    {"event_query", (PyCFunction)(void (*)(void))Calls_event_query, METH_FASTCALL,
     "event_query(event) -> bool: cuEventQuery (NOT_READY is False)"},
    {"event_wait", (PyCFunction)(void (*)(void))Calls_event_wait, METH_FASTCALL,
     "event_wait(event, timeout) -> bool: poll cuEventQuery (GIL released, signals checked every 2 ms) "
     "until complete or timeout seconds passed"},
    {"event_synchronize", (PyCFunction)(void (*)(void))Calls_event_synchronize, METH_FASTCALL,
     "event_synchronize(event): cuEventSynchronize with the GIL released"},
    {"stream_wait_events", (PyCFunction)(void (*)(void))Calls_stream_wait_events, METH_FASTCALL,
     "stream_wait_events(stream, events): cuStreamWaitEvent(stream, event, 0) for each event of a list"},
    {"copy_batch", (PyCFunction)(void (*)(void))Calls_copy_batch, METH_FASTCALL,
     "copy_batch(upload, dsts, srcs, sizes, stream, event): the copies in one cuMemcpyBatchAsync (or a loop), "
     "then cuEventRecord (unless event is None)"},
    {"mem_pool_alloc", (PyCFunction)(void (*)(void))Calls_mem_pool_alloc, METH_FASTCALL,
     "mem_pool_alloc(pool, nbytes, stream) -> int: cuMemAllocFromPoolAsync, then cuStreamSynchronize(stream) "
     "(the allocation freed again if that fails)"},
    {"mem_free_async", (PyCFunction)(void (*)(void))Calls_mem_free_async, METH_FASTCALL,
     "mem_free_async(ptr, stream): cuMemFreeAsync"},
    {"counts", Calls_counts, METH_NOARGS, "counts() -> dict: waits, copies, batches, batched_copies"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Calls_getset[] = {
    {"batch_abi", Calls_get_batch_abi, NULL, "12080 or 13000: the cuMemcpyBatchAsync in use; 0: none", NULL},
    {"batch_refused", Calls_get_batch_refused, NULL,
     "the CUresult with which the driver refused a batch (batches are loops since); 0: none", NULL},
    {"waits", Calls_get_waits, NULL, "host waits so far (event_wait and event_synchronize calls)", NULL},
    {"pool_calls", Calls_get_pool_calls, NULL,
     "whether mem_pool_alloc and mem_free_async run (the driver has all three of their entry points)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Calls_slots[] = {
    {Py_tp_new, Calls_new},
    {Py_tp_dealloc, Calls_dealloc},
    {Py_tp_methods, Calls_methods},
    {Py_tp_getset, Calls_getset},
    {Py_tp_doc, "Calls(entry_points, on_error, batch_abi=0): ferry's small-transfer driver calls, from C."},
    {0, NULL},
};

static PyType_Spec Calls_spec = {
    "ferry._native._engine.Calls",
    sizeof(CallsObject),
    0,
    Py_TPFLAGS_DEFAULT,
    Calls_slots,
};

/* -- Record: a transfer's record, made in C ----------------------------------------------------------- */

/*
 * The completion part's Record (ferry/_completion.py holds the contract and the Python twin that runs
 * without this extension): the same fields, all plain attributes, made in one C call. A Python class
 * with __slots__ costs a Python __init__ and seventeen attribute stores per transfer; this costs an
 * allocation. The fields and their defaults must match the Python class (tests/test_native_calls.py
 * checks that they do). It is a GC type: a record can sit in a cycle (its signal's listeners hold a
 * future that holds the handle that holds the record).
 */

typedef struct {
    PyObject_HEAD
    PyObject *seq, *event, *stream, *moved, *leased, *result, *nbytes;
    PyObject *done, *error, *extra, *settled, *claimed, *waiters, *spun, *signal, *batch, *shared, *napped;
} RecordObject;

#define RECORD_FIELDS 18

static PyTypeObject *RecordType;

static PyObject **record_fields(RecordObject *self) { return &self->seq; }

static allocfunc record_alloc;

static PyObject *record_make(PyObject *const *args) {
    RecordObject *self = (RecordObject *)record_alloc(RecordType, 0);
    if (!self) return NULL;
    PyObject **f = record_fields(self);
    for (int i = 0; i < 7; i++) {
        f[i] = args[i];
        Py_INCREF(f[i]);
    }
    PyObject *zero = PyLong_FromLong(0);
    if (!zero) {
        Py_DECREF(self);
        return NULL;
    }
    self->done = Py_False;
    self->error = Py_None;
    self->extra = Py_None;
    self->settled = Py_False;
    self->claimed = Py_False;
    self->waiters = zero; /* the reference from PyLong_FromLong */
    self->napped = zero;  /* 0 s napped: the same small int, one more reference */
    Py_INCREF(zero);
    self->spun = Py_False;
    self->signal = Py_None;
    self->batch = Py_None;
    self->shared = Py_None;
    Py_INCREF(Py_False);
    Py_INCREF(Py_False);
    Py_INCREF(Py_False);
    Py_INCREF(Py_False);
    Py_INCREF(Py_None);
    Py_INCREF(Py_None);
    Py_INCREF(Py_None);
    Py_INCREF(Py_None);
    Py_INCREF(Py_None);
    return (PyObject *)self;
}

static PyObject *Record_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if ((kwds && PyDict_Size(kwds)) || PyTuple_Size(args) != 7 || type != RecordType) {
        PyErr_SetString(PyExc_TypeError, "Record(seq, event, stream, moved, leased, result, nbytes)");
        return NULL;
    }
    PyObject *items[7];
    for (int i = 0; i < 7; i++) items[i] = PyTuple_GetItem(args, i);
    return record_make(items);
}

/* new_record(seq, event, stream, moved, leased, result, nbytes): Record(...) without the type call. */
static PyObject *mod_new_record(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs_is(nargs, 7, "new_record")) return NULL;
    return record_make(args);
}

static int Record_traverse(PyObject *obj, visitproc visit, void *arg) {
    PyObject **f = record_fields((RecordObject *)obj);
    for (int i = 0; i < RECORD_FIELDS; i++) Py_VISIT(f[i]);
    Py_VISIT((PyObject *)Py_TYPE(obj));
    return 0;
}

static int Record_clear(PyObject *obj) {
    PyObject **f = record_fields((RecordObject *)obj);
    for (int i = 0; i < RECORD_FIELDS; i++) Py_CLEAR(f[i]);
    return 0;
}

static void Record_dealloc(PyObject *obj) {
    PyTypeObject *tp = Py_TYPE(obj);
    PyObject_GC_UnTrack(obj);
    Record_clear(obj);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(obj);
    Py_DECREF(tp);
}

static PyObject *Record_repr(PyObject *obj) {
    RecordObject *self = (RecordObject *)obj;
    int failed = self->error ? PyObject_IsTrue(self->error) : 0;
    int done = self->done ? PyObject_IsTrue(self->done) : 0;
    if (failed < 0 || done < 0) return NULL;
    const char *status = failed ? "failed" : done ? "done" : "pending";
    return PyUnicode_FromFormat("<transfer record #%R %R bytes %s>", self->seq ? self->seq : Py_None,
                                self->nbytes ? self->nbytes : Py_None, status);
}

#define RECORD_MEMBER(name) {#name, T_OBJECT_EX, offsetof(RecordObject, name), 0, NULL}

static PyMemberDef Record_members[] = {
    RECORD_MEMBER(seq),     RECORD_MEMBER(event),  RECORD_MEMBER(stream),  RECORD_MEMBER(moved),
    RECORD_MEMBER(leased),  RECORD_MEMBER(result), RECORD_MEMBER(nbytes),  RECORD_MEMBER(done),
    RECORD_MEMBER(error),   RECORD_MEMBER(extra),  RECORD_MEMBER(settled), RECORD_MEMBER(claimed),
    RECORD_MEMBER(waiters), RECORD_MEMBER(spun),   RECORD_MEMBER(signal),  RECORD_MEMBER(batch),
    RECORD_MEMBER(shared),  RECORD_MEMBER(napped), {NULL, 0, 0, 0, NULL},
};

static PyType_Slot Record_slots[] = {
    {Py_tp_new, Record_new},
    {Py_tp_dealloc, Record_dealloc},
    {Py_tp_traverse, Record_traverse},
    {Py_tp_clear, Record_clear},
    {Py_tp_repr, Record_repr},
    {Py_tp_members, Record_members},
    {Py_tp_doc, "Record(seq, event, stream, moved, leased, result, nbytes): a transfer's record "
                "(see ferry/_completion.py)."},
    {0, NULL},
};

static PyType_Spec Record_spec = {
    "ferry._native._engine.Record",
    sizeof(RecordObject),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    Record_slots,
};

/* -- RLock: the runtime's lock, takeable from C without a call ------------------------------------- */

/*
 * threading.RLock's semantics (reentrant, owned by a thread, acquire(blocking=True, timeout=-1),
 * release(), the context manager), with what matters on the small-transfer path made cheap: a free
 * lock is taken with one compare-and-swap (threading.RLock's acquire parses its arguments, and
 * PyThread_acquire_lock_timed reads the clock even when it does not wait: about 30 and 20 ns), and
 * the compiled submit and wait take and give it with a C call (rlock_take / rlock_give). A thread that
 * must wait releases the GIL and sleeps on a condition variable in slices of RLOCK_SLICE_NS, running
 * signal handlers between them, so Ctrl-C reaches a blocked acquire within that. The owner and count
 * are read and written with the GIL held; `held` is what threads contend for.
 */
static PyTypeObject *RLockType;

#define RLOCK_SLICE_NS 5000000LL

typedef struct {
    PyObject_HEAD
    atomic_int held;     /* 1 while some thread holds it */
    atomic_int sleepers; /* threads asleep (or about to be) on cv */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int ready;           /* mu and cv were initialized */
    pid_t pid;           /* the process that initialized them (a forked child makes its own: rlock_sleep_ready) */
    unsigned long owner; /* PyThread_get_thread_ident of the holder; meaningful while count > 0 */
    unsigned long count;
    PyObject *weakreflist;
} RLockObject;

static PyObject *RLock_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if ((args && PyTuple_Size(args)) || (kwds && PyDict_Size(kwds))) {
        PyErr_SetString(PyExc_TypeError, "RLock() takes no arguments");
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    RLockObject *self = (RLockObject *)alloc(type, 0);
    if (!self) return NULL;
    atomic_init(&self->held, 0);
    atomic_init(&self->sleepers, 0);
    if (pthread_mutex_init(&self->mu, NULL)) {
        Py_DECREF(self);
        PyErr_SetString(PyExc_MemoryError, "cannot initialize a lock");
        return NULL;
    }
    if (cond_init_monotonic(&self->cv)) {
        pthread_mutex_destroy(&self->mu);
        Py_DECREF(self);
        PyErr_SetString(PyExc_MemoryError, "cannot initialize a lock");
        return NULL;
    }
    self->ready = 1;
    self->pid = getpid();
    return (PyObject *)self;
}

/* The mutex, condition and sleeper count, made again in a forked child (GIL held): the parent's threads do
 * not exist there, and their state (a sleeper count, a mutex one of them held) would block the child. Only
 * the contended paths call it: getpid() is a system call. 0, or -1 with MemoryError. */
static int rlock_sleep_ready(RLockObject *self) {
    pid_t now = getpid();
    if (self->pid == now) return 0;
    if (pthread_mutex_init(&self->mu, NULL) || cond_init_monotonic(&self->cv)) {
        PyErr_SetString(PyExc_MemoryError, "cannot initialize a lock in a forked child");
        return -1;
    }
    atomic_store(&self->sleepers, 0);
    self->pid = now;
    return 0;
}

static void RLock_dealloc(PyObject *obj) {
    RLockObject *self = (RLockObject *)obj;
    PyTypeObject *tp = Py_TYPE(obj);
    if (self->weakreflist) PyObject_ClearWeakRefs(obj);
    if (self->ready) { /* no thread can wait on an object being deallocated */
        pthread_cond_destroy(&self->cv);
        pthread_mutex_destroy(&self->mu);
    }
    freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    f(obj);
    Py_DECREF((PyObject *)tp);
}

static inline int rlock_try(RLockObject *self) {
    int expected = 0;
    return atomic_compare_exchange_strong(&self->held, &expected, 1);
}

/* Take it (GIL held): 1 taken, 0 not within timeout_us (-1: no bound, 0: do not wait), -1 an exception
 * (a signal handler raised while waiting, or the count would overflow). */
static int rlock_take(RLockObject *self, long long timeout_us) {
    unsigned long me = PyThread_get_thread_ident();
    if (self->count && self->owner == me) {
        if (self->count == ULONG_MAX) {
            PyErr_SetString(PyExc_OverflowError, "internal lock count overflowed");
            return -1;
        }
        self->count++;
        return 1;
    }
    int got = rlock_try(self);
    if (!got && timeout_us != 0) {
        if (rlock_sleep_ready(self)) return -1;
        int64_t start = now_ns();
        int64_t deadline = timeout_us < 0 || timeout_us >= (INT64_MAX - start) / 1000 ? INT64_MAX
                                                                                      : start + timeout_us * 1000;
        for (;;) {
            int64_t slice_end = now_ns() + RLOCK_SLICE_NS;
            if (slice_end > deadline) slice_end = deadline;
            struct timespec ts = ts_of(slice_end);
            Py_BEGIN_ALLOW_THREADS
            pthread_mutex_lock(&self->mu);
            atomic_fetch_add(&self->sleepers, 1);
            while (!(got = rlock_try(self)) && now_ns() < slice_end)
                pthread_cond_timedwait(&self->cv, &self->mu, &ts);
            atomic_fetch_sub(&self->sleepers, 1);
            pthread_mutex_unlock(&self->mu);
            Py_END_ALLOW_THREADS
            if (got) break;
            if (PyErr_CheckSignals() < 0) return -1; /* as threading's: a handler that raises ends the wait */
            if (now_ns() >= deadline) break;
        }
    }
    if (!got) return 0;
    self->owner = me;
    self->count = 1;
    return 1;
}

/* Give it back once (GIL held): 0, or -1 with RuntimeError when this thread does not hold it. */
static int rlock_give(RLockObject *self) {
    if (!self->count || self->owner != PyThread_get_thread_ident()) {
        PyErr_SetString(PyExc_RuntimeError, "cannot release un-acquired lock");
        return -1;
    }
    if (--self->count == 0) {
        self->owner = 0;
        atomic_store(&self->held, 0);
        /* a sleeper counted itself before it tried the lock (both sequentially consistent): either it saw
         * the lock free, or this sees it and wakes it */
        if (atomic_load(&self->sleepers) && getpid() == self->pid) { /* a forked child has no sleepers */
            pthread_mutex_lock(&self->mu);
            pthread_cond_signal(&self->cv);
            pthread_mutex_unlock(&self->mu);
        }
    }
    return 0;
}

/* Give the lock back once, a pending exception kept: result, or NULL (result released) if the give failed. */
static PyObject *rlock_give_result(RLockObject *lock, PyObject *result) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (rlock_give(lock)) {
        Py_XDECREF(result);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return NULL;
    }
    PyErr_Restore(type, value, tb);
    return result;
}

/* acquire(blocking=True, timeout=-1) -> bool, as threading.RLock's */
static PyObject *RLock_acquire(PyObject *obj, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *blocking_obj = NULL, *timeout_obj = NULL;
    Py_ssize_t nkw = kwnames ? PyTuple_Size(kwnames) : 0;
    if (nargs > 2) {
        PyErr_Format(PyExc_TypeError, "acquire() takes at most 2 arguments (%zd given)", nargs);
        return NULL;
    }
    if (nargs > 0) blocking_obj = args[0];
    if (nargs > 1) timeout_obj = args[1];
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *name = PyTuple_GetItem(kwnames, i);
        PyObject **slot = PyUnicode_CompareWithASCIIString(name, "blocking") == 0  ? &blocking_obj
                          : PyUnicode_CompareWithASCIIString(name, "timeout") == 0 ? &timeout_obj
                                                                                     : NULL;
        if (!slot) {
            PyErr_Format(PyExc_TypeError, "acquire() got an unexpected keyword argument '%U'", name);
            return NULL;
        }
        if (*slot) {
            PyErr_Format(PyExc_TypeError, "acquire() got multiple values for argument '%U'", name);
            return NULL;
        }
        *slot = args[nargs + i];
    }
    int blocking = 1;
    if (blocking_obj && (blocking = PyObject_IsTrue(blocking_obj)) < 0) return NULL;
    double timeout = -1.0;
    if (timeout_obj && timeout_obj != Py_None) {
        timeout = PyFloat_AsDouble(timeout_obj);
        if (timeout == -1.0 && PyErr_Occurred()) return NULL;
        if (timeout != timeout) {
            PyErr_SetString(PyExc_ValueError, "Invalid value NaN (not a number)");
            return NULL;
        }
    }
    if (!blocking && timeout != -1.0) {
        PyErr_SetString(PyExc_ValueError, "can't specify a timeout for a non-blocking call");
        return NULL;
    }
    if (timeout < 0 && timeout != -1.0) {
        PyErr_SetString(PyExc_ValueError, "timeout value must be a non-negative number");
        return NULL;
    }
    if (timeout > (double)(LLONG_MAX / 1000) / 1e6) { /* PY_TIMEOUT_MAX on Linux (not in the limited API) */
        PyErr_SetString(PyExc_OverflowError, "timeout value is too large");
        return NULL;
    }
    /* rounded up, as threading's: a timeout under a microsecond still waits */
    long long us = !blocking ? 0 : timeout < 0 ? -1 : (long long)(timeout * 1e6);
    if (us > 0 && (double)us < timeout * 1e6) us++;
    else if (us == 0 && blocking && timeout > 0) us = 1;
    int got = rlock_take((RLockObject *)obj, us);
    if (got < 0) return NULL;
    return PyBool_FromLong(got);
}

static PyObject *RLock_release(PyObject *obj, PyObject *Py_UNUSED(arg)) {
    if (rlock_give((RLockObject *)obj)) return NULL;
    Py_RETURN_NONE;
}

static PyObject *RLock_enter(PyObject *obj, PyObject *Py_UNUSED(arg)) {
    if (rlock_take((RLockObject *)obj, -1) < 0) return NULL;
    Py_RETURN_TRUE;
}

static PyObject *RLock_exit(PyObject *obj, PyObject *const *Py_UNUSED(args), Py_ssize_t Py_UNUSED(nargs)) {
    if (rlock_give((RLockObject *)obj)) return NULL;
    Py_RETURN_NONE;
}

/* _is_owned(): whether the calling thread holds it (threading.Condition's protocol) */
static PyObject *RLock_is_owned(PyObject *obj, PyObject *Py_UNUSED(arg)) {
    RLockObject *self = (RLockObject *)obj;
    return PyBool_FromLong(self->count && self->owner == PyThread_get_thread_ident());
}

/* _release_save() -> (count, owner): give it back entirely (threading.Condition's protocol) */
static PyObject *RLock_release_save(PyObject *obj, PyObject *Py_UNUSED(arg)) {
    RLockObject *self = (RLockObject *)obj;
    if (!self->count || self->owner != PyThread_get_thread_ident()) {
        PyErr_SetString(PyExc_RuntimeError, "cannot release un-acquired lock");
        return NULL;
    }
    PyObject *state = Py_BuildValue("(kk)", self->count, self->owner);
    if (!state) return NULL;
    self->count = 1;
    rlock_give(self);
    return state;
}

/* _acquire_restore((count, owner)): take it again as it was (threading.Condition's protocol) */
static PyObject *RLock_acquire_restore(PyObject *obj, PyObject *state) {
    RLockObject *self = (RLockObject *)obj;
    unsigned long count, owner;
    if (!PyArg_ParseTuple(state, "kk:_acquire_restore", &count, &owner)) return NULL;
    if (count == 0) {
        PyErr_SetString(PyExc_ValueError, "_acquire_restore: a count of 0");
        return NULL;
    }
    int got = rlock_take(self, -1);
    if (got != 1) return NULL;
    self->count = count;
    self->owner = owner;
    Py_RETURN_NONE;
}

static PyObject *RLock_repr(PyObject *obj) {
    RLockObject *self = (RLockObject *)obj;
    return PyUnicode_FromFormat("<ferry RLock %s owner=%lu count=%lu>", self->count ? "locked" : "unlocked",
                                self->count ? self->owner : 0UL, self->count);
}

static PyMethodDef RLock_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))RLock_acquire, METH_FASTCALL | METH_KEYWORDS,
     "acquire(blocking=True, timeout=-1) -> bool: take the lock (again, if this thread holds it)"},
    {"release", RLock_release, METH_NOARGS, "release(): give it back once; RuntimeError if not held"},
    {"__enter__", RLock_enter, METH_NOARGS, "acquire()"},
    {"__exit__", (PyCFunction)(void (*)(void))RLock_exit, METH_FASTCALL, "release()"},
    {"_is_owned", RLock_is_owned, METH_NOARGS, "whether the calling thread holds it"},
    {"_release_save", RLock_release_save, METH_NOARGS, "give it back entirely: (count, owner) (Condition's)"},
    {"_acquire_restore", RLock_acquire_restore, METH_O, "take it again as _release_save left it (Condition's)"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef RLock_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(RLockObject, weakreflist), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot RLock_slots[] = {
    {Py_tp_new, RLock_new},
    {Py_tp_dealloc, RLock_dealloc},
    {Py_tp_methods, RLock_methods},
    {Py_tp_members, RLock_members},
    {Py_tp_repr, RLock_repr},
    {Py_tp_doc, "RLock(): threading.RLock's semantics, takeable from C (the runtime's lock)"},
    {0, NULL},
};

static PyType_Spec RLock_spec = {
    "ferry._native._engine.RLock",
    sizeof(RLockObject),
    0,
    Py_TPFLAGS_DEFAULT,
    RLock_slots,
};

/* -- Fast: the pinned routes' submit and wait, in one call each ------------------------------------ */

/*
 * A Completion (ferry/_completion.py, whose essay is the contract) builds one Fast when this extension
 * runs. Fast.enqueue is Completion.enqueue's common case and Fast.wait is Completion.wait's: the same
 * steps, with the record's fields read and written in C and the driver calls made straight through
 * Calls where the backend's hot methods are Calls' bound methods (any other backend's methods, the
 * emulated device's, are called as Python callables). Whatever is not the common case goes to the
 * Python method the Fast was built with, before anything is changed:
 *
 * - enqueue: maintenance due (a retiring record, a deferred free, a doomed pool block) or no pooled
 *   event -> Completion.enqueue. With a batch open on the calling thread, a copy that joins the
 *   stream's open segment in its last run is recorded there in C (Completion._enqueue_batched's common
 *   case); a first copy, a full segment or a new run -> Completion.enqueue. A copy that raises
 *   DeviceError goes to Completion.copy_failed(record, exc) (which raises what enqueue raises);
 *   anything else propagates.
 * - wait: a batched record whose shared event a batch-mate already proved is settled and claimed in C
 *   (its shared event back to the pool after its last user). Otherwise a timeout, a record that is
 *   not a plain one (shared, batched, done, failed, spun on, without an event, with extras that are
 *   not own_event) or a runtime that refuses calls -> Completion.wait.
 *   The spin is the Python one (SPIN_BASE, then the rest of the budget); a record still not complete
 *   after it is marked spun and goes to Completion.wait (which sleeps). A DeviceError from the spin
 *   goes to Completion._failed; the claim then raises as in Python.
 *
 * - pinned (Runtime.upload_pending/download_pending's common case): on CUDA with Calls' compiled copy,
 *   no batch open, no maintenance due and a pooled event, the copy is enqueued before the record and
 *   its tuples are made (fast_copy_first, with garbage collection off until the record is tracked);
 *   otherwise the tuples, then enqueue.
 *
 * - entries (bind_entries, bind_small): Runtime.upload_pending / download_pending, and Runtime.upload's
 *   small pageable case, become the runtime's own attributes bound to upload_pending / download_pending /
 *   upload here. They check the Python methods' common case by reading the arguments' __slots__ (offsets
 *   from ferry._native.slot_layout) and NumPy's fields (array_layout, array_shape_layout), under the lock
 *   taken in C, then submit as pinned / SmallRoute.upload do; anything else calls the Python method.
 * - settle: a plain record, a batched one and a small-route slot's (fast_settle_slot: the copy-out, the
 *   lease, the slot back to its ring) are settled in C; any other extras go to Completion.settle.
 *
 * The runtime lock is taken with rlock_take / rlock_give where it is this module's RLock (the default
 * where the extension loads, ferry._native.runtime_lock), else through its bound methods.
 * The counters seq, submitted and completed live here (Completion.counts is this object).
 */

static PyTypeObject *FastType;

typedef struct {
    PyObject_HEAD
    PyObject *events, *live, *batches, *cross_returns, *incoming; /* containers never replaced */
    PyObject *retiring, *memory, *pool, *health, *backend;        /* objects whose fields are read */
    PyObject *acquire, *release;                                  /* the runtime lock's bound methods */
    PyObject *slow_enqueue, *slow_wait, *copy_failed, *failed, *settle, *claim, *flush_cross;
    PyObject *device_error, *owned, *spin_base_obj, *in_flight, *completion;
    PyObject *rlock; /* the runtime lock when it is an RLock of this module (taken in C), else NULL */
    /* bind_entries: the runtime's Python methods, handle types, streams and backend */
    PyObject *slow_upload, *slow_download, *upload_type, *download_type, *h2d, *d2h, *entry_backend;
    /* bind_small: the small route's upload ring, its free slots and lost(), the lease table's take(), the active
     * registrations, numpy.ndarray, Runtime.upload */
    PyObject *small_ring, *small_free, *small_lost, *small_take, *small_active, *ndarray_type, *slow_upload_any;
    PyObject *small_give; /* the upload ring's give (the lease table's) */
    double spin_base, spin_per_byte, spin_cap;
    long long seq, submitted, completed;
    Py_ssize_t segment_copies; /* Completion.segment_copies: a batch segment this full is flushed (Python) */
} FastObject;

/* f(*args): the limited API of 3.11 has no PyObject_Vectorcall; CallFunctionObjArgs passes a short list on
 * the stack (no tuple) to the callee's vectorcall. */
static PyObject *call_args(PyObject *f, PyObject *const *a, Py_ssize_t n) {
    switch (n) {
    case 0: return PyObject_CallNoArgs(f);
    case 1: return PyObject_CallFunctionObjArgs(f, a[0], NULL);
    case 2: return PyObject_CallFunctionObjArgs(f, a[0], a[1], NULL);
    case 5: return PyObject_CallFunctionObjArgs(f, a[0], a[1], a[2], a[3], a[4], NULL);
    case 8: return PyObject_CallFunctionObjArgs(f, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], NULL);
    default: PyErr_SetString(PyExc_SystemError, "call_args: unsupported count"); return NULL;
    }
}

static PyObject *S_count, *S_deferred, *S_doomed, *S_refusal, *S_event_wait, *S_own_event, *S_state, *S_leases;
static PyObject *S_htod_record, *S_dtoh_record;
static PyObject *S_segments, *S_records, *S_last, *S_copy, *S_seen, *S_dsts, *S_srcs, *S_sizes, *S_done, *S_users,
    *S_event;

#define FAST_OBJECTS 40
static PyObject **fast_objects(FastObject *self) { return &self->events; }

static PyObject *fast_attr(PyObject *obj, const char *name) {
    PyObject *v = PyObject_GetAttrString(obj, name);
    return v;
}

static PyObject *Fast_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"completion", "device_error", "owned", "in_flight", "spin_base", "spin_per_byte",
                             "spin_cap", NULL};
    PyObject *c, *device_error, *owned, *in_flight;
    double spin_base, spin_per_byte, spin_cap;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOddd", kwlist, &c, &device_error, &owned, &in_flight,
                                     &spin_base, &spin_per_byte, &spin_cap))
        return NULL;
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    FastObject *self = (FastObject *)alloc(type, 0);
    if (!self) return NULL;
    PyObject *lock = NULL;
    if (!(self->events = fast_attr(c, "events")) || !(self->live = fast_attr(c, "live")) ||
        !(self->batches = fast_attr(c, "batches")) || !(self->cross_returns = fast_attr(c, "cross_returns")) ||
        !(self->retiring = fast_attr(c, "retiring")) || !(self->incoming = fast_attr(self->retiring, "_incoming")) ||
        !(self->memory = fast_attr(c, "memory")) || !(self->pool = fast_attr(c, "pool")) ||
        !(self->health = fast_attr(c, "health")) || !(self->backend = fast_attr(c, "backend")) ||
        !(lock = fast_attr(c, "lock")) || !(self->acquire = fast_attr(lock, "acquire")) ||
        !(self->release = fast_attr(lock, "release")) || !(self->slow_enqueue = fast_attr(c, "enqueue")) ||
        !(self->slow_wait = fast_attr(c, "wait")) || !(self->copy_failed = fast_attr(c, "copy_failed")) ||
        !(self->failed = fast_attr(c, "_failed")) || !(self->settle = fast_attr(c, "settle")) ||
        !(self->claim = fast_attr(c, "_claim")) || !(self->flush_cross = fast_attr(c, "flush_cross")) ||
        !(self->spin_base_obj = PyFloat_FromDouble(spin_base))) {
        Py_XDECREF(lock);
        Py_DECREF(self);
        return NULL;
    }
    if (Py_TYPE(lock) == RLockType) self->rlock = lock; /* the reference from fast_attr */
    else Py_DECREF(lock);
    PyObject *full = fast_attr(c, "segment_copies");
    self->segment_copies = full ? PyLong_AsSsize_t(full) : -1;
    Py_XDECREF(full);
    if (self->segment_copies < 1) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "Fast: segment_copies must be >= 1");
        Py_DECREF(self);
        return NULL;
    }
    if (!PyList_Check(self->events) || !PyList_Check(self->cross_returns) || !PyDict_Check(self->batches) ||
        !PyAnySet_Check(self->live)) {
        PyErr_SetString(PyExc_TypeError, "Fast: events and cross_returns must be lists, batches a dict, live a set");
        Py_DECREF(self);
        return NULL;
    }
    Py_INCREF(device_error);
    self->device_error = device_error;
    Py_INCREF(owned);
    self->owned = owned;
    Py_INCREF(in_flight);
    self->in_flight = in_flight;
    Py_INCREF(c);
    self->completion = c;
    self->spin_base = spin_base;
    self->spin_per_byte = spin_per_byte;
    self->spin_cap = spin_cap;
    return (PyObject *)self;
}

static int Fast_traverse(PyObject *obj, visitproc visit, void *arg) {
    PyObject **f = fast_objects((FastObject *)obj);
    for (int i = 0; i < FAST_OBJECTS; i++) Py_VISIT(f[i]);
    Py_VISIT((PyObject *)Py_TYPE(obj));
    return 0;
}

static int Fast_clear(PyObject *obj) {
    PyObject **f = fast_objects((FastObject *)obj);
    for (int i = 0; i < FAST_OBJECTS; i++) Py_CLEAR(f[i]);
    return 0;
}

static void Fast_dealloc(PyObject *obj) {
    PyTypeObject *tp = Py_TYPE(obj);
    PyObject_GC_UnTrack(obj);
    Fast_clear(obj);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(obj);
    Py_DECREF(tp);
}

/* Whether obj.name is truthy (-1: error). */
static int attr_true(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (!v) return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

/* Completion.maintenance_due(), read in C: 1 due, 0 not, -1 error. */
static int fast_maintenance_due(FastObject *self) {
    int t = attr_true(self->retiring, S_count);
    if (t) return t;
    Py_ssize_t n = PyObject_Size(self->incoming);
    if (n) return n < 0 ? -1 : 1;
    if ((t = attr_true(self->memory, S_deferred))) return t;
    return attr_true(self->pool, S_doomed);
}

/* Whether the runtime refuses calls (health.refusal is not None): 1, 0, or -1. */
static int fast_refused(FastObject *self) {
    PyObject *v = PyObject_GetAttr(self->health, S_refusal);
    if (!v) return -1;
    int refused = v != Py_None;
    Py_DECREF(v);
    return refused;
}

/* The lock's acquire/release; release keeps a pending exception. */
static int fast_lock(FastObject *self) {
    if (self->rlock) return rlock_take((RLockObject *)self->rlock, -1) == 1 ? 0 : -1;
    PyObject *r = PyObject_CallNoArgs(self->acquire);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

static int fast_unlock(FastObject *self) {
    PyObject *type, *value, *tb;
    if (self->rlock && !PyErr_Occurred()) return rlock_give((RLockObject *)self->rlock);
    PyErr_Fetch(&type, &value, &tb);
    PyObject *r = PyObject_CallNoArgs(self->release);
    if (!r) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return -1;
    }
    Py_DECREF(r);
    PyErr_Restore(type, value, tb);
    return 0;
}

static void set_field(PyObject **field, PyObject *value) {
    PyObject *old = *field;
    Py_INCREF(value);
    *field = value;
    Py_XDECREF(old);
}

/* A DeviceError pending? Then take it (normalized, traceback attached): the exception; else NULL, left pending. */
static PyObject *take_device_error(FastObject *self) {
    if (!PyErr_ExceptionMatches(self->device_error)) return NULL;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb && value) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
}

/*
 * _enqueue_batched of _completion.py, its common case in C: a copy joins this thread's open segment of
 * the stream's batch, in the segment's last run (same copy function, a destination not yet in it).
 * Returns the record, NULL with an error set, or NULL with no error where Python must do it (no
 * segment yet, a full one to flush, a new run, containers of other types); an attribute that cannot
 * be read raises. The record is made first, as in Python: its allocation may collect garbage, and a
 * finalizer may poll a handle of this batch, which flushes (and drops) the segment. Lock held.
 */
static PyObject *fast_batched(FastObject *self, PyObject *batch, PyObject *const *args) {
    PyObject *stream = args[0], *copy = args[1], *dst = args[2], *nbytes = args[4];
    PyObject *segments = NULL, *key = NULL, *records = NULL, *run = NULL, *run_copy = NULL, *seen = NULL;
    PyObject *dsts = NULL, *srcs = NULL, *sizes = NULL, *record = NULL, *seq = NULL;
    PyObject *segment = NULL;
    int ok = 0;
    /* the record first, as in Python: its allocation may collect garbage, whose finalizers may flush */
    if (!(seq = PyLong_FromLongLong(self->seq + 1))) goto out;
    PyObject *fields[7] = {seq, Py_None, stream, args[5], args[6], args[7], nbytes};
    if (!(record = record_make(fields))) goto out;
    if (!(segments = PyObject_GetAttr(batch, S_segments)) || !PyDict_Check(segments)) goto out;
    if (!(key = PyLong_FromVoidPtr(stream))) goto out; /* id(stream) */
    segment = PyDict_GetItem(segments, key);
    if (!segment) goto out;
    Py_INCREF(segment); /* held to the end, whatever the calls below run */
    if (!(records = PyObject_GetAttr(segment, S_records)) || !PyList_Check(records) ||
        PyList_Size(records) >= self->segment_copies)
        goto out;
    int copies = PyObject_IsTrue(nbytes);
    if (copies < 0) goto out;
    if (copies) {
        if (!(run = PyObject_GetAttr(segment, S_last)) || run == Py_None) goto out;
        if (!(run_copy = PyObject_GetAttr(run, S_copy))) goto out;
        int same = run_copy == copy;
        if (!same && (same = PyObject_RichCompareBool(run_copy, copy, Py_EQ)) < 0) goto out;
        if (!same) goto out;
        if (!(seen = PyObject_GetAttr(run, S_seen)) || !PyAnySet_Check(seen)) goto out;
        int repeated = PySet_Contains(seen, dst);
        if (repeated) goto out; /* a destination twice in a run (or an error): Python starts a new run */
        if (!(dsts = PyObject_GetAttr(run, S_dsts)) || !(srcs = PyObject_GetAttr(run, S_srcs)) ||
            !(sizes = PyObject_GetAttr(run, S_sizes)) || !PyList_Check(dsts) || !PyList_Check(srcs) ||
            !PyList_Check(sizes))
            goto out;
    }
    /* from here on the record goes in; nothing above changed anything */
    set_field(&((RecordObject *)record)->batch, segment);
    if (PyList_Append(records, record)) goto out;
    if (copies && (PySet_Add(seen, dst) || PyList_Append(dsts, dst) || PyList_Append(srcs, args[3]) ||
                   PyList_Append(sizes, nbytes))) {
        goto out; /* out of memory mid-append: the record is in the segment, which is what Python does first */
    }
    if (PySet_Add(self->live, record)) goto out;
    self->seq++;
    self->submitted++;
    ok = 1;
out:
    Py_XDECREF(segment);
    Py_XDECREF(segments);
    Py_XDECREF(key);
    Py_XDECREF(records);
    Py_XDECREF(run);
    Py_XDECREF(run_copy);
    Py_XDECREF(seen);
    Py_XDECREF(dsts);
    Py_XDECREF(srcs);
    Py_XDECREF(sizes);
    Py_XDECREF(seq);
    if (ok) return record;
    Py_XDECREF(record);
    return NULL;
}

/* enqueue(stream, copy, dst, src, nbytes, moved, leased, result) -> Record: see the essay above. */
/* A copy that may be queued cannot be tracked (no memory for its record, or an error that is not the
 * driver's while it was made): prove it complete before refusing, keeping the pending error. Its event
 * goes back to the pool if `pool_event` and the proof held, else it is destroyed. The stream is synchronized through the backend
 * (which retries where the context was not current); if even that fails the device is unusable and its
 * health says so (noted by the backend's failure), which refuses every later call. */
static void fast_prove_untracked(FastObject *self, PyObject *stream, PyObject *event, int pool_event) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *r = PyObject_CallMethod(self->backend, "stream_synchronize", "O", stream);
    if (!r && PyErr_ExceptionMatches(PyExc_MemoryError)) { /* the call itself found no memory: once more */
        PyErr_Clear();
        r = PyObject_CallMethod(self->backend, "stream_synchronize", "O", stream);
    }
    int pooled = 0;
    if (r) {
        Py_DECREF(r);
        if (pool_event) pooled = PyList_Append(self->events, event) == 0;
    }
    if (!pooled) { /* not proven, maybe what the driver refused, or no room in the pool: destroyed */
        PyErr_Clear();
        PyObject *d = PyObject_CallMethod(self->backend, "event_destroy", "O", event);
        Py_XDECREF(d);
    }
    if (!r) {
        PyObject *exc = take_device_error(self);
        PyObject *h = exc ? PyObject_CallMethod(self->health, "note", "O", exc) : NULL;
        Py_XDECREF(h);
        Py_XDECREF(exc);
        PyErr_Clear();
    }
    PyErr_Restore(type, value, tb);
}

/* A new record's copy raised (the error is set): a DeviceError goes to Completion.copy_failed, which
 * raises what a submission raises; anything else (a MemoryError while the driver's error was made)
 * propagates once the copy, which may be queued, is proven complete. Steals the record; returns NULL. */
static PyObject *fast_refused_copy(FastObject *self, PyObject *record) {
    PyObject *exc = take_device_error(self);
    if (exc) {
        PyObject *r = PyObject_CallFunctionObjArgs(self->copy_failed, record, exc, NULL);
        Py_DECREF(exc);
        Py_XDECREF(r);
        if (r) PyErr_SetString(PyExc_SystemError, "Completion.copy_failed returned");
    } else if (Py_TYPE(record) == RecordType) {
        RecordObject *r = (RecordObject *)record;
        if (r->event != Py_None) fast_prove_untracked(self, r->stream, r->event, 0);
    }
    Py_DECREF(record);
    return NULL;
}

static PyObject *fast_copy_first(FastObject *self, CallsObject *calls, int cu_upload, PyObject *const *e, int upload,
                                 PyObject *host, PyObject *device, PyObject *const *tuples);

static PyObject *Fast_enqueue(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
    FastObject *self = (FastObject *)obj;
    if (nargs_is(nargs, 8, "enqueue")) return NULL;
    if (PyDict_Size(self->batches)) { /* a batch may be open on this thread */
        int due = fast_maintenance_due(self);
        if (due < 0) return NULL;
        if (!due) {
            PyObject *ident = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
            if (!ident) return NULL;
            PyObject *batch = PyDict_GetItem(self->batches, ident); /* borrowed */
            Py_DECREF(ident);
            if (batch) {
                Py_INCREF(batch);
                PyObject *record = fast_batched(self, batch, args);
                Py_DECREF(batch);
                if (record || PyErr_Occurred()) return record;
            }
        }
        return call_args(self->slow_enqueue, args, 8);
    }
    int due = fast_maintenance_due(self);
    if (due < 0) return NULL;
    Py_ssize_t n = PyList_Size(self->events);
    if (due || n < 1 || PyDict_Size(self->batches)) return call_args(self->slow_enqueue, args, 8);
    PyObject *stream = args[0], *copy = args[1];
    PyCFunction fn = PyCFunction_Check(copy) ? PyCFunction_GetFunction(copy) : NULL;
    int cu_upload = fn == (PyCFunction)(void (*)(void))Calls_htod_record;
    if (cu_upload || fn == (PyCFunction)(void (*)(void))Calls_dtoh_record) { /* the copy first, as Fast_pinned's */
        PyObject *record = fast_copy_first(self, (CallsObject *)PyCFunction_GetSelf(copy), cu_upload, args, 0, NULL,
                                           NULL, args + 5);
        if (record != Py_None) return record; /* or NULL: refused, as below */
        Py_DECREF(record); /* the pool emptied: the path below */
        n = PyList_Size(self->events);
        if (n < 1) return call_args(self->slow_enqueue, args, 8);
    }
    PyObject *event = PyList_GetItem(self->events, n - 1);
    Py_INCREF(event);
    if (PyList_SetSlice(self->events, n - 1, n, NULL)) {
        Py_DECREF(event);
        return NULL;
    }
    PyObject *seq = PyLong_FromLongLong(++self->seq);
    if (!seq) {
        PyList_Append(self->events, event);
        Py_DECREF(event);
        return NULL;
    }
    /* new_record(seq, event, stream, moved, leased, result, nbytes) */
    PyObject *fields[7] = {seq, event, stream, args[5], args[6], args[7], args[4]};
    PyObject *record = record_make(fields);
    Py_DECREF(seq);
    if (!record) {
        PyList_Append(self->events, event);
        Py_DECREF(event);
        return NULL;
    }
    PyObject *cargs[5] = {args[2], args[3], args[4], stream, event};
    PyObject *done;
    if (PyCFunction_Check(copy) && PyCFunction_GetFunction(copy) == (PyCFunction)(void (*)(void))Calls_htod_record)
        done = Calls_htod_record(PyCFunction_GetSelf(copy), cargs, 5);
    else if (PyCFunction_Check(copy) &&
             PyCFunction_GetFunction(copy) == (PyCFunction)(void (*)(void))Calls_dtoh_record)
        done = Calls_dtoh_record(PyCFunction_GetSelf(copy), cargs, 5);
    else
        done = call_args(copy, cargs, 5);
    Py_DECREF(event);
    if (!done) {
        return fast_refused_copy(self, record);
    }
    Py_DECREF(done);
    self->submitted++;
    if (PySet_Add(self->live, record)) {
        Py_DECREF(record);
        return NULL;
    }
    return record;
}

/* One wait on the backend's event_wait (Calls' compiled one where it is that): 1 ready, 0 not, -1 error. */
static int fast_event_wait(FastObject *self, PyObject *event, PyObject *seconds) {
    PyObject *fn = PyObject_GetAttr(self->backend, S_event_wait);
    if (!fn) return -1;
    PyObject *a[2] = {event, seconds};
    PyObject *r;
    if (PyCFunction_Check(fn) && PyCFunction_GetFunction(fn) == (PyCFunction)(void (*)(void))Calls_event_wait)
        r = Calls_event_wait(PyCFunction_GetSelf(fn), a, 2);
    else
        r = call_args(fn, a, 2);
    Py_DECREF(fn);
    if (!r) return -1;
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

static int add_waiters(RecordObject *r, long delta) {
    long w = PyLong_AsLong(r->waiters);
    if (w == -1 && PyErr_Occurred()) return -1;
    PyObject *v = PyLong_FromLong(w + delta);
    if (!v) return -1;
    PyObject *old = r->waiters;
    r->waiters = v;
    Py_XDECREF(old);
    return 0;
}

/* The waiters count back down, keeping a pending exception. */
static void drop_waiter(RecordObject *r) {
    if (!PyErr_Occurred()) {
        if (add_waiters(r, -1)) PyErr_Clear();
        return;
    }
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (add_waiters(r, -1)) PyErr_Clear();
    PyErr_Restore(type, value, tb);
}

/* settle(), inline, for a plain pinned record (no extras, no shared event). Lock held. */
static int fast_settle_states(FastObject *self, RecordObject *r);

static int fast_settle_plain(FastObject *self, RecordObject *r) {
    set_field(&r->settled, Py_True);
    if (PyList_Append(self->events, r->event)) return -1;
    set_field(&r->event, Py_None);
    return fast_settle_states(self, r);
}

/* settle() for a batched record (no extras): its shared event goes back to the pool after its last user. */
static int fast_settle_shared(FastObject *self, RecordObject *r) {
    set_field(&r->settled, Py_True);
    PyObject *shared = r->shared;
    Py_INCREF(shared);
    set_field(&r->shared, Py_None);
    PyObject *users = PyObject_GetAttr(shared, S_users);
    long k = users ? PyLong_AsLong(users) : -1;
    Py_XDECREF(users);
    int rc = -1;
    if (k == -1 && PyErr_Occurred()) goto out;
    PyObject *left = PyLong_FromLong(k - 1);
    if (!left) goto out;
    rc = PyObject_SetAttr(shared, S_users, left);
    Py_DECREF(left);
    if (rc) goto out;
    if (k - 1 == 0) {
        PyObject *event = PyObject_GetAttr(shared, S_event);
        rc = event ? PyList_Append(self->events, event) : -1;
        Py_XDECREF(event);
        if (rc) goto out;
    }
    set_field(&r->event, Py_None);
    rc = fast_settle_states(self, r);
out:
    Py_DECREF(shared);
    return rc;
}

static int set_state_slot(PyObject *obj, PyObject *state);

/* The objects of a settled record handed back: moved ones owned, leased ones one lease fewer. */
static int fast_settle_states(FastObject *self, RecordObject *r) {
    Py_ssize_t n = PyTuple_Size(r->moved);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *obj = PyTuple_GetItem(r->moved, i);
        if (!set_state_slot(obj, self->owned) && PyObject_SetAttr(obj, S_state, self->owned)) return -1;
    }
    n = PyTuple_Size(r->leased);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *array = PyTuple_GetItem(r->leased, i);
        PyObject *leases = PyObject_GetAttr(array, S_leases);
        if (!leases) return -1;
        long k = PyLong_AsLong(leases);
        Py_DECREF(leases);
        if (k == -1 && PyErr_Occurred()) return -1;
        PyObject *v = PyLong_FromLong(k - 1);
        if (!v) return -1;
        int rc = PyObject_SetAttr(array, S_leases, v);
        Py_DECREF(v);
        if (rc) return -1;
    }
    self->completed++;
    return 0;
}

static PyObject *fast_claim(FastObject *self, RecordObject *r);

/* wait(record, timeout=None) -> the record's result: see the essay above. */
static PyObject *Fast_wait(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
    FastObject *self = (FastObject *)obj;
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "wait takes 1 or 2 arguments (%zd given)", nargs);
        return NULL;
    }
    if ((nargs == 2 && args[1] != Py_None) || Py_TYPE(args[0]) != RecordType)
        return call_args(self->slow_wait, args, nargs);
    RecordObject *r = (RecordObject *)args[0];
    if (r->shared != Py_None && r->batch == Py_None && r->extra == Py_None && r->error == Py_None &&
        r->done == Py_False) {
        /* a batched record whose shared event a batch-mate proved: settle and claim it here */
        int proved = attr_true(r->shared, S_done);
        if (proved < 0) return NULL;
        if (!proved) return call_args(self->slow_wait, args, nargs);
        int refused = fast_refused(self);
        if (refused) return refused < 0 ? NULL : call_args(self->slow_wait, args, nargs);
        if (add_waiters(r, 1)) return NULL;
        set_field(&r->done, Py_True);
        return fast_claim(self, r);
    }
    if (r->shared != Py_None || r->batch != Py_None || r->done != Py_False || r->error != Py_None ||
        r->spun != Py_False || r->event == Py_None)
        return call_args(self->slow_wait, args, nargs);
    if (r->extra != Py_None) {
        int own = attr_true(r->extra, S_own_event);
        if (own < 0) return NULL;
        if (!own) return call_args(self->slow_wait, args, nargs);
    }
    int refused = fast_refused(self);
    if (refused) return refused < 0 ? NULL : call_args(self->slow_wait, args, nargs);
    if (add_waiters(r, 1)) return NULL;
    PyObject *event = r->event;
    Py_INCREF(event);
    int ready = fast_event_wait(self, event, self->spin_base_obj);
    if (ready == 0) {
        double budget = self->spin_base + PyLong_AsDouble(r->nbytes) * self->spin_per_byte;
        if (budget > self->spin_cap) budget = self->spin_cap;
        PyObject *rest = PyErr_Occurred() ? NULL : PyFloat_FromDouble(budget - self->spin_base);
        ready = rest ? fast_event_wait(self, event, rest) : -1;
        Py_XDECREF(rest);
    }
    Py_DECREF(event);
    if (ready < 0) {
        PyObject *exc = take_device_error(self);
        if (!exc) {
            drop_waiter(r);
            return NULL;
        }
        PyObject *f = PyObject_CallFunctionObjArgs(self->failed, (PyObject *)r, exc, NULL);
        Py_DECREF(exc);
        if (!f) {
            drop_waiter(r);
            return NULL;
        }
        Py_DECREF(f);
        ready = 1;
    }
    if (!ready) { /* spun its whole budget: Completion.wait sleeps on it */
        set_field(&r->spun, Py_True);
        PyObject *res = call_args(self->slow_wait, args, 1); /* still attending: close() settles it for us */
        drop_waiter(r);
        return res;
    }
    set_field(&r->done, Py_True);
    return fast_claim(self, r);
}

static int is_small_slot(PyObject *extra);
static int fast_settle_slot(FastObject *self, RecordObject *r);

/* A done record the caller attends (waiters + 1): settle it if no one did, claim it, under the lock. */
static PyObject *fast_claim(FastObject *self, RecordObject *r) {
    if (fast_lock(self)) {
        drop_waiter(r);
        return NULL;
    }
    PyObject *result = NULL;
    /* taken out of live in the same lookup that finds it there (1), or not there (0: settled elsewhere) */
    int contained = (r->settled == Py_False && r->error == Py_None) ? PySet_Discard(self->live, (PyObject *)r) : 0;
    if (contained > 0) {
        int ok = 1;
        if (ok && r->extra == Py_None && r->shared == Py_None) {
            ok = fast_settle_plain(self, r) == 0;
        } else if (ok && r->extra == Py_None) {
            ok = fast_settle_shared(self, r) == 0;
        } else if (ok && r->shared == Py_None && is_small_slot(r->extra)) {
            ok = fast_settle_slot(self, r) == 0;
        } else if (ok) {
            PyObject *s = PyObject_CallFunctionObjArgs(self->settle, (PyObject *)r, NULL);
            ok = s != NULL;
            Py_XDECREF(s);
        }
        if (ok) {
            set_field(&r->claimed, Py_True);
            result = r->result;
            Py_INCREF(result);
        }
    } else if (contained == 0) {
        result = PyObject_CallFunctionObjArgs(self->claim, (PyObject *)r, NULL);
    }
    if (fast_unlock(self)) Py_CLEAR(result);
    drop_waiter(r);
    if (result && PyList_Size(self->cross_returns)) {
        PyObject *f = PyObject_CallNoArgs(self->flush_cross);
        if (!f) Py_CLEAR(result);
        Py_XDECREF(f);
    }
    return result;
}

static PyObject *Fast_get_counter(PyObject *obj, void *closure) {
    FastObject *self = (FastObject *)obj;
    long long *c = closure == (void *)0 ? &self->seq : closure == (void *)1 ? &self->submitted : &self->completed;
    return PyLong_FromLongLong(*c);
}

static int Fast_set_counter(PyObject *obj, PyObject *value, void *closure) {
    FastObject *self = (FastObject *)obj;
    if (!value) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete a counter");
        return -1;
    }
    long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred()) return -1;
    long long *c = closure == (void *)0 ? &self->seq : closure == (void *)1 ? &self->submitted : &self->completed;
    *c = v;
    return 0;
}

static PyObject *Fast_pinned(PyObject *obj, PyObject *const *args, Py_ssize_t nargs);


/*
 * Runtime.upload_pending / download_pending in one C call (bound as the runtime's own attributes by
 * Runtime.__init__ where the extension, its RLock and the slot layout are there). The checks are
 * the Python method's common-case expression, read from the arguments' __slots__ at the offsets
 * ferry._native.slot_layout() found and verified; the submission is then Fast_pinned's, under the
 * runtime lock taken in C. Anything else (another type, a check that fails, keywords, a dead
 * runtime's entry) calls the Python method, which names the problem: nothing is changed before.
 */
enum { SL_BUF_BASE, SL_BUF_BLOCK, SL_BUF_NBYTES, SL_BUF_RUNTIME, SL_BUF_STATE, SL_DEV_DTYPE, SL_DEV_LEASES,
       SL_DEV_NBYTES, SL_DEV_PTR, SL_DEV_READY, SL_DEV_RUNTIME, SL_DEV_SHAPE, SL_DEV_STATE, SL_BLOCK_PTR, SL_HEALTH_REFUSAL, SL_SLOT_ADDRESS,
       SL_SLOT_CAPACITY, SL_SLOT_CLEANUPS, SL_SLOT_FINISH, SL_SLOT_HANDED, SL_SLOT_HOST, SL_SLOT_NBYTES, SL_SLOT_OWN,
       SL_SLOT_PTR, SL_SLOT_RECORD, SL_SLOT_RING, SL_COUNT };
#define SLOT_TYPES 5
static Py_ssize_t slot_at[SL_COUNT];
static PyObject *slot_types[SLOT_TYPES]; /* PinnedHostBuffer, DeviceArray, Block, Health, Slot; NULL: not set */

/* set_slot_layout((PinnedHostBuffer, DeviceArray, Block, Health, Slot), offsets): found and verified by the
 * caller (ferry._native.slot_layout) */
static PyObject *mod_set_slot_layout(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs_is(nargs, 2, "set_slot_layout")) return NULL;
    if (!PyTuple_Check(args[0]) || PyTuple_Size(args[0]) != SLOT_TYPES || !PyTuple_Check(args[1]) ||
        PyTuple_Size(args[1]) != SL_COUNT) {
        PyErr_Format(PyExc_TypeError, "set_slot_layout(types: %d-tuple, offsets: %d-tuple)", SLOT_TYPES,
                     (int)SL_COUNT);
        return NULL;
    }
    Py_ssize_t at[SL_COUNT];
    for (int i = 0; i < SL_COUNT; i++) {
        at[i] = PyLong_AsSsize_t(PyTuple_GetItem(args[1], i));
        if (at[i] == -1 && PyErr_Occurred()) return NULL;
        if (at[i] < (Py_ssize_t)(2 * sizeof(void *)) || at[i] % (Py_ssize_t)sizeof(void *)) {
            PyErr_SetString(PyExc_ValueError, "set_slot_layout: an offset inside the object header or misaligned");
            return NULL;
        }
    }
    for (int i = 0; i < SLOT_TYPES; i++) {
        PyObject *t = PyTuple_GetItem(args[0], i);
        if (!PyType_Check(t)) {
            PyErr_SetString(PyExc_TypeError, "set_slot_layout: types must be types");
            return NULL;
        }
    }
    for (int i = 0; i < SLOT_TYPES; i++) {
        PyObject *t = PyTuple_GetItem(args[0], i);
        PyObject *old = slot_types[i];
        Py_INCREF(t);
        slot_types[i] = t;
        Py_XDECREF(old);
    }
    memcpy(slot_at, at, sizeof at);
    Py_RETURN_NONE;
}

/* *field = value, the reference to value already taken; the old one released last (it may run code). */
#define Py_XSETREF_LOCAL(field, value)                                                                      \
    do {                                                                                                      \
        PyObject *old_ = (field);                                                                             \
        (field) = (value);                                                                                    \
        Py_XDECREF(old_);                                                                                     \
    } while (0)

/* The object in obj's slot (borrowed; NULL when unset): obj's exact type is the layout's. */
static inline PyObject *slot_of(PyObject *obj, int which) { return *(PyObject **)((char *)obj + slot_at[which]); }

/* obj._state = state written straight into the slot where obj is a PinnedHostBuffer or DeviceArray and
 * the layout is set (what the member descriptor does, without the attribute lookup): 1, else 0 (the
 * caller sets the attribute). Never fails. */
static int set_state_slot(PyObject *obj, PyObject *state) {
    int which = !slot_types[0]                                   ? -1
                : Py_TYPE(obj) == (PyTypeObject *)slot_types[0] ? SL_BUF_STATE
                : Py_TYPE(obj) == (PyTypeObject *)slot_types[1] ? SL_DEV_STATE
                                                                : -1;
    if (which < 0) return 0;
    PyObject **field = (PyObject **)((char *)obj + slot_at[which]);
    PyObject *old = *field;
    Py_INCREF(state);
    *field = state;
    Py_XDECREF(old);
    return 1;
}

/* Whether extra is a small-route Slot whose record its own event proves (not handed off): Completion.settle's
 * one-call case, which fast_settle_slot does in C. */
static int is_small_slot(PyObject *extra) {
    return slot_types[4] && Py_TYPE(extra) == (PyTypeObject *)slot_types[4] && slot_of(extra, SL_SLOT_HANDED) == Py_None;
}

static PyObject *S_give, *S_free, *S_host_copied;
static PyObject *Leases_give(PyObject *obj, PyObject *array); /* the lease table's, below */

/* Completion.settle for a small-route slot (the record's extras), lock held: a download's copy-out (Slot.copy_out:
 * the slot's bytes into the caller's array, counted), Slot.release(False) (the array's lease given back, the
 * slot back to its ring), the event back to the pool, the objects handed back. */
static int fast_settle_slot(FastObject *self, RecordObject *r) {
    PyObject *slot = r->extra, *ring = slot_of(slot, SL_SLOT_RING), *finish = slot_of(slot, SL_SLOT_FINISH);
    PyObject *host = slot_of(slot, SL_SLOT_HOST);
    if (!ring || !finish || !host) {
        PyErr_SetString(PyExc_AttributeError, "a small-route slot without its ring, finish or host");
        return -1;
    }
    Py_INCREF(slot);
    Py_INCREF(ring);
    Py_INCREF(host);
    int rc = -1;
    PyObject *give = NULL, *free_list = NULL;
    set_field(&r->settled, Py_True);
    if (finish != Py_None) { /* a download: the copy is proven complete, the bytes are the caller's now */
        unsigned long long address = as_u64(slot_of(slot, SL_SLOT_ADDRESS)), ptr, nbytes;
        if (address == (unsigned long long)-1 && PyErr_Occurred()) goto out;
        ptr = as_u64(slot_of(slot, SL_SLOT_PTR));
        if (ptr == (unsigned long long)-1 && PyErr_Occurred()) goto out;
        nbytes = as_u64(slot_of(slot, SL_SLOT_NBYTES));
        if (nbytes == (unsigned long long)-1 && PyErr_Occurred()) goto out;
        memcpy((void *)(uintptr_t)address, (const void *)(uintptr_t)ptr, (size_t)nbytes);
        PyObject *copied = PyObject_GetAttr(ring, S_host_copied);
        if (!copied) goto out;
        PyObject *more = PyLong_FromUnsignedLongLong(nbytes), *sum = more ? PyNumber_Add(copied, more) : NULL;
        Py_DECREF(copied);
        Py_XDECREF(more);
        int set = sum ? PyObject_SetAttr(ring, S_host_copied, sum) : -1;
        Py_XDECREF(sum);
        if (set) goto out;
    }
    /* Slot.release(False): the upload ring's give and free list are the ones bind_small kept */
    int up_ring = ring == self->small_ring;
    if (up_ring) {
        give = self->small_give;
        Py_INCREF(give);
    } else if (!(give = PyObject_GetAttr(ring, S_give))) {
        goto out;
    }
    PyObject *gave = PyCFunction_Check(give) && PyCFunction_GetFunction(give) == (PyCFunction)Leases_give
                         ? Leases_give(PyCFunction_GetSelf(give), host)
                         : PyObject_CallFunctionObjArgs(give, host, NULL);
    if (!gave) goto out;
    Py_DECREF(gave);
    PyObject **field = (PyObject **)((char *)slot + slot_at[SL_SLOT_HOST]);
    Py_INCREF(Py_None);
    Py_XSETREF_LOCAL(*field, Py_None);
    if (slot_of(slot, SL_SLOT_RECORD) != Py_None) {
        set_field(&r->extra, Py_None); /* the slot is not that record's any more */
        field = (PyObject **)((char *)slot + slot_at[SL_SLOT_RECORD]);
        Py_INCREF(Py_None);
        Py_XSETREF_LOCAL(*field, Py_None);
    }
    if (up_ring) {
        free_list = self->small_free;
        Py_INCREF(free_list);
    } else if (!(free_list = PyObject_GetAttr(ring, S_free))) {
        goto out;
    }
    if (PyList_Append(free_list, slot)) goto out;
    if (PyList_Append(self->events, r->event)) goto out;
    set_field(&r->event, Py_None);
    rc = fast_settle_states(self, r);
out:
    Py_XDECREF(give);
    Py_XDECREF(free_list);
    Py_DECREF(host);
    Py_DECREF(ring);
    Py_DECREF(slot);
    return rc;
}

static PyTypeObject *HandleType; /* defined with Handle, below */

/* bind_entries(slow_upload, slow_download, upload_type, download_type, h2d, d2h, backend): what the entries
 * (Fast.entries) need of their runtime besides the runtime itself */
static PyObject *Fast_bind_entries(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
    FastObject *self = (FastObject *)obj;
    if (nargs_is(nargs, 7, "bind_entries")) return NULL;
    for (int i = 2; i < 4; i++) {
        if (!PyType_Check(args[i]) || args[i] == (PyObject *)HandleType ||
            !PyType_IsSubtype((PyTypeObject *)args[i], HandleType)) {
            PyErr_SetString(PyExc_TypeError, "bind_entries: the handle types must be Python subclasses of Handle");
            return NULL;
        }
    }
    PyObject **fields = &self->slow_upload;
    for (int i = 0; i < 7; i++) {
        PyObject *old = fields[i];
        Py_INCREF(args[i]);
        fields[i] = args[i];
        Py_XDECREF(old);
    }
    Py_RETURN_NONE;
}

/* The Python method for what the compiled checks do not take: Runtime.<name>(runtime, *args, **kwargs). */
static PyObject *fast_entry_slow(FastObject *self, PyObject *slow, PyObject *runtime, PyObject *const *args,
                                 Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    Py_ssize_t nkw = kwnames ? PyTuple_Size(kwnames) : 0;
    PyObject *tuple = PyTuple_New(nargs + 1);
    if (!tuple) return NULL;
    Py_INCREF(runtime);
    PyTuple_SetItem(tuple, 0, runtime);
    for (Py_ssize_t i = 0; i < nargs; i++) {
        Py_INCREF(args[i]);
        PyTuple_SetItem(tuple, i + 1, args[i]);
    }
    PyObject *kwargs = NULL;
    if (nkw) {
        kwargs = PyDict_New();
        for (Py_ssize_t i = 0; kwargs && i < nkw; i++) {
            if (PyDict_SetItem(kwargs, PyTuple_GetItem(kwnames, i), args[nargs + i])) Py_CLEAR(kwargs);
        }
        if (!kwargs) {
            Py_DECREF(tuple);
            return NULL;
        }
    }
    PyObject *r = PyObject_Call(slow, tuple, kwargs);
    Py_DECREF(tuple);
    Py_XDECREF(kwargs);
    return r;
}

/* An exact int 0 (a device array's read-lease count) */
static inline int is_zero(PyObject *v) {
    if (!v || !PyLong_Check(v)) return 0;
    long k = PyLong_AsLong(v);
    if (k == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return k == 0;
}

/* Whether a's int is >= b's (two sizes; anything odd: no) */
static inline int size_at_least(PyObject *a, PyObject *b) {
    if (!a || !b || !PyLong_Check(a) || !PyLong_Check(b)) return 0;
    Py_ssize_t x = PyLong_AsSsize_t(a), y = PyLong_AsSsize_t(b);
    if ((x == -1 || y == -1) && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return x >= y;
}

/* The entry of upload_pending / download_pending (runtime: the entry's, which the call holds). */
static PyObject *fast_entry(FastObject *self, PyObject *runtime, int upload, PyObject *const *args,
                            Py_ssize_t nargs, PyObject *kwnames) {
    if (!self->slow_upload) {
        PyErr_SetString(PyExc_RuntimeError, "Fast: bind_entries was not called");
        return NULL;
    }
    if (nargs != 2 || (kwnames && PyTuple_Size(kwnames)) || !self->rlock || !slot_types[0])
        return fast_entry_slow(self, upload ? self->slow_upload : self->slow_download, runtime, args, nargs, kwnames);
    Py_INCREF(runtime); /* held across the submission */
    PyObject *host = upload ? args[0] : args[1], *device = upload ? args[1] : args[0];
    RLockObject *lock = (RLockObject *)self->rlock;
    if (rlock_take(lock, -1) != 1) {
        Py_DECREF(runtime);
        return NULL;
    }
    /* the copy call first: an attribute read can run Python, which must not come between the checks and
     * their use */
    PyObject *copy = PyObject_GetAttr(self->entry_backend, upload ? S_htod_record : S_dtoh_record);
    if (!copy) {
        rlock_give_result(lock, NULL);
        Py_DECREF(runtime);
        return NULL;
    }
    PyObject *result = NULL, *block, *base;
    int common = Py_TYPE(self->health) == (PyTypeObject *)slot_types[3] &&
                 slot_of(self->health, SL_HEALTH_REFUSAL) == Py_None &&
                 Py_TYPE(host) == (PyTypeObject *)slot_types[0] && Py_TYPE(device) == (PyTypeObject *)slot_types[1] &&
                 slot_of(host, SL_BUF_RUNTIME) == runtime && slot_of(device, SL_DEV_RUNTIME) == runtime &&
                 slot_of(host, SL_BUF_STATE) == self->owned && slot_of(device, SL_DEV_STATE) == self->owned &&
                 (!upload || is_zero(slot_of(device, SL_DEV_LEASES))) && slot_of(device, SL_DEV_READY) == Py_None &&
                 (base = slot_of(host, SL_BUF_BASE)) != NULL && Py_REFCNT(base) == 1 && /* the buffer's own */
                 size_at_least(slot_of(host, SL_BUF_NBYTES), slot_of(device, SL_DEV_NBYTES)) &&
                 (block = slot_of(host, SL_BUF_BLOCK)) != NULL && Py_TYPE(block) == (PyTypeObject *)slot_types[2] &&
                 slot_of(block, SL_BLOCK_PTR) != NULL && slot_of(device, SL_DEV_PTR) != NULL;
    if (!common) {
        Py_DECREF(copy);
        if (rlock_give(lock) == 0)
            result = fast_entry_slow(self, upload ? self->slow_upload : self->slow_download, runtime, args, nargs,
                                     kwnames);
        Py_DECREF(runtime);
        return result;
    }
    {
        /* held for the call: Fast_pinned reads them after calls that may run Python */
        PyObject *host_ptr = slot_of(block, SL_BLOCK_PTR), *device_ptr = slot_of(device, SL_DEV_PTR);
        PyObject *nbytes = slot_of(device, SL_DEV_NBYTES);
        Py_INCREF(host_ptr);
        Py_INCREF(device_ptr);
        Py_INCREF(nbytes);
        PyObject *a[9] = {upload ? self->upload_type : self->download_type,
                          upload ? self->h2d : self->d2h,
                          copy,
                          upload ? device_ptr : host_ptr,
                          upload ? host_ptr : device_ptr,
                          nbytes,
                          host,
                          device,
                          upload ? Py_True : Py_False};
        result = Fast_pinned((PyObject *)self, a, 9);
        Py_DECREF(copy);
        Py_DECREF(host_ptr);
        Py_DECREF(device_ptr);
        Py_DECREF(nbytes);
    }
    result = rlock_give_result(lock, result);
    Py_DECREF(runtime);
    return result;
}

static PyObject *Fast_bind_small(PyObject *obj, PyObject *const *args, Py_ssize_t nargs);
static PyObject *fast_small_upload(FastObject *self, PyObject *runtime, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames);

/*
 * Entry: what a runtime's compiled methods are bound to, (its Fast, the runtime). Fast.entries(runtime)
 * returns them as builtin methods of one Entry, which the runtime keeps as its own attributes: like a
 * bound method, each holds its runtime (rt.upload_pending kept alone keeps the runtime alive), which makes
 * a reference cycle through the runtime's __dict__ (Entry takes part in garbage collection: a dropped
 * runtime is collected, and closed with its ResourceWarning, by the cyclic collector).
 */
static PyTypeObject *EntryType;

typedef struct { /* a PairObject's shape (defined below; its traverse, clear and dealloc are Pair_*) */
    PyObject_HEAD
    PyObject *fast, *runtime;
} EntryObject;

/* A garbage-collected object whose fields are two object references after its header (Entry, Leases): their
 * traverse, clear and dealloc */
typedef struct {
    PyObject_HEAD
    PyObject *first, *second;
} PairObject;

static int Pair_traverse(PyObject *obj, visitproc visit, void *arg) {
    PairObject *self = (PairObject *)obj;
    Py_VISIT(self->first);
    Py_VISIT(self->second);
    Py_VISIT((PyObject *)Py_TYPE(obj));
    return 0;
}

static int Pair_clear(PyObject *obj) {
    PairObject *self = (PairObject *)obj;
    Py_CLEAR(self->first);
    Py_CLEAR(self->second);
    return 0;
}

static void Pair_dealloc(PyObject *obj) {
    PyTypeObject *tp = Py_TYPE(obj);
    PyObject_GC_UnTrack(obj);
    Pair_clear(obj);
    freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    f(obj);
    Py_DECREF((PyObject *)tp);
}

static PyObject *entry_check(PyObject *obj) {
    EntryObject *self = (EntryObject *)obj;
    if (!self->fast || !self->runtime) {
        PyErr_SetString(PyExc_RuntimeError, "this entry was cleared");
        return NULL;
    }
    return self->fast;
}

static PyObject *Entry_upload_pending(PyObject *obj, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *fast = entry_check(obj);
    return fast ? fast_entry((FastObject *)fast, ((EntryObject *)obj)->runtime, 1, args, nargs, kwnames) : NULL;
}

static PyObject *Entry_download_pending(PyObject *obj, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *fast = entry_check(obj);
    return fast ? fast_entry((FastObject *)fast, ((EntryObject *)obj)->runtime, 0, args, nargs, kwnames) : NULL;
}

static PyObject *Entry_upload(PyObject *obj, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *fast = entry_check(obj);
    return fast ? fast_small_upload((FastObject *)fast, ((EntryObject *)obj)->runtime, args, nargs, kwnames) : NULL;
}

static PyMethodDef entry_defs[] = {
    {"upload_pending", (PyCFunction)(void (*)(void))Entry_upload_pending, METH_FASTCALL | METH_KEYWORDS,
     "upload_pending(buffer, destination) -> PendingUpload: Runtime.upload_pending, checks and all, in one C call "
     "(see ferry.Runtime.upload_pending)"},
    {"download_pending", (PyCFunction)(void (*)(void))Entry_download_pending, METH_FASTCALL | METH_KEYWORDS,
     "download_pending(source, buffer) -> PendingDownload: Runtime.download_pending, checks and all, in one C call "
     "(see ferry.Runtime.download_pending)"},
    {"upload", (PyCFunction)(void (*)(void))Entry_upload, METH_FASTCALL | METH_KEYWORDS,
     "upload(source, destination=None) -> PendingUpload: Runtime.upload, its small pageable case in one C call "
     "(see ferry.Runtime.upload)"},
};

static PyType_Slot Entry_slots[] = {
    {Py_tp_dealloc, Pair_dealloc},
    {Py_tp_traverse, Pair_traverse},
    {Py_tp_clear, Pair_clear},
    {Py_tp_doc, "Entry: a runtime's compiled methods are bound to it (Fast.entries)"},
    {0, NULL},
};

static PyType_Spec Entry_spec = {
    "ferry._native._engine.Entry",
    sizeof(EntryObject),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    Entry_slots,
};

/* entries(runtime) -> (upload_pending, download_pending, upload or None): the runtime's compiled methods
 * (bind_entries first; upload only after bind_small) */
static PyObject *Fast_entries(PyObject *obj, PyObject *runtime) {
    FastObject *self = (FastObject *)obj;
    if (!self->slow_upload) {
        PyErr_SetString(PyExc_RuntimeError, "Fast: bind_entries was not called");
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(EntryType, Py_tp_alloc);
    EntryObject *entry = (EntryObject *)alloc(EntryType, 0);
    if (!entry) return NULL;
    Py_INCREF(obj);
    entry->fast = obj;
    Py_INCREF(runtime);
    entry->runtime = runtime;
    PyObject *up = PyCFunction_NewEx(&entry_defs[0], (PyObject *)entry, NULL);
    PyObject *down = up ? PyCFunction_NewEx(&entry_defs[1], (PyObject *)entry, NULL) : NULL;
    PyObject *small = !down                ? NULL
                      : self->small_ring ? PyCFunction_NewEx(&entry_defs[2], (PyObject *)entry, NULL)
                                         : (Py_INCREF(Py_None), Py_None);
    Py_DECREF(entry);
    PyObject *result = small ? PyTuple_Pack(3, up, down, small) : NULL;
    Py_XDECREF(up);
    Py_XDECREF(down);
    Py_XDECREF(small);
    return result;
}

static PyMethodDef Fast_methods[] = {
    {"enqueue", (PyCFunction)(void (*)(void))Fast_enqueue, METH_FASTCALL,
     "enqueue(stream, copy, dst, src, nbytes, moved, leased, result) -> Record: Completion.enqueue in C"},
    {"wait", (PyCFunction)(void (*)(void))Fast_wait, METH_FASTCALL,
     "wait(record, timeout=None) -> result: Completion.wait in C for a plain record (and a batched one whose "
     "shared event is proved)"},
    {"pinned", (PyCFunction)(void (*)(void))Fast_pinned, METH_FASTCALL,
     "pinned(handle_type, stream, copy, dst, src, nbytes, host, device, upload) -> handle: "
     "Completion.submit_pinned in C"},
    {"bind_entries", (PyCFunction)(void (*)(void))Fast_bind_entries, METH_FASTCALL,
     "bind_entries(slow_upload, slow_download, upload_type, download_type, h2d, d2h, backend)"},
    {"bind_small", (PyCFunction)(void (*)(void))Fast_bind_small, METH_FASTCALL,
     "bind_small(small_route, ndarray, slow_upload): what the upload entry needs of the small pageable route"},
    {"entries", Fast_entries, METH_O,
     "entries(runtime) -> (upload_pending, download_pending, upload or None): the runtime's compiled methods"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Fast_getset[] = {
    {"seq", Fast_get_counter, Fast_set_counter, "the last record's sequence number", (void *)0},
    {"submitted", Fast_get_counter, Fast_set_counter, "transfers submitted", (void *)1},
    {"completed", Fast_get_counter, Fast_set_counter, "transfers completed (settled or retired)", (void *)2},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Fast_slots[] = {
    {Py_tp_new, Fast_new},
    {Py_tp_dealloc, Fast_dealloc},
    {Py_tp_traverse, Fast_traverse},
    {Py_tp_clear, Fast_clear},
    {Py_tp_methods, Fast_methods},
    {Py_tp_getset, Fast_getset},
    {Py_tp_doc, "Fast(completion, device_error, owned, in_flight, spin_base, spin_per_byte, spin_cap): a Completion's "
                "enqueue and wait in C (see _engine.c)."},
    {0, NULL},
};

static PyType_Spec Fast_spec = {
    "ferry._native._engine.Fast",
    sizeof(FastObject),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    Fast_slots,
};

/* -- Handle: the base of the transfer handles (ferry/_pending.py) ------------------------------------- */

/*
 * ferry.Pending derives from this where the extension runs (from its Python twin, _pending._PyHandle,
 * elsewhere): the same five fields (_port, _record, _waited, _claimed, _future), made without a Python
 * __init__, and the two calls every transfer makes: wait() (the port's wait, through Fast.wait in C
 * when it is that) and the finalizer (a handle dropped unwaited detaches its record: port.detach(record),
 * never raising, never during interpreter shutdown; a waited one does nothing). Handle itself is not
 * instantiated: only its Python subclasses are.
 */

static PyTypeObject *HandleType;
static PyObject *handle_waited_error; /* FerryError, set by set_handle_errors */
static PyObject *sys_is_finalizing;   /* sys.is_finalizing */
static PyObject *S_wait, *S_detach;

typedef struct {
    PyObject_HEAD
    PyObject *port, *record, *waited, *claimed, *future;
} HandleObject;

#define HANDLE_FIELDS 5

static PyObject **handle_fields(HandleObject *self) { return &self->port; }

static PyObject *Handle_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *port, *record;
    if (type == HandleType) {
        PyErr_SetString(PyExc_TypeError, "Handle is a base class: handles come from the runtime's submissions");
        return NULL;
    }
    if ((kwds && PyDict_Size(kwds)) || !PyArg_UnpackTuple(args, "Handle", 2, 2, &port, &record)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "Handle(port, record)");
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    HandleObject *self = (HandleObject *)alloc(type, 0);
    if (!self) return NULL;
    Py_INCREF(port);
    self->port = port;
    Py_INCREF(record);
    self->record = record;
    Py_INCREF(Py_False);
    self->waited = Py_False;
    Py_INCREF(Py_False);
    self->claimed = Py_False;
    Py_INCREF(Py_None);
    self->future = Py_None;
    return (PyObject *)self;
}

static int Handle_traverse(PyObject *obj, visitproc visit, void *arg) {
    PyObject **f = handle_fields((HandleObject *)obj);
    for (int i = 0; i < HANDLE_FIELDS; i++) Py_VISIT(f[i]);
    Py_VISIT((PyObject *)Py_TYPE(obj));
    return 0;
}

static int Handle_clear(PyObject *obj) {
    PyObject **f = handle_fields((HandleObject *)obj);
    for (int i = 0; i < HANDLE_FIELDS; i++) Py_CLEAR(f[i]);
    return 0;
}

static void Handle_dealloc(PyObject *obj) {
    PyTypeObject *tp = Py_TYPE(obj);
    PyObject_GC_UnTrack(obj);
    Handle_clear(obj);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(obj);
    Py_DECREF(tp);
}

/* A handle dropped unwaited: its record to the retirement queue (port.detach). Never raises. */
static void Handle_finalize(PyObject *obj) {
    HandleObject *self = (HandleObject *)obj;
    if (!self->waited || self->waited == Py_True || !self->port || !self->record) return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    int waited = PyObject_IsTrue(self->waited);
    PyObject *finalizing = waited == 0 && sys_is_finalizing ? PyObject_CallNoArgs(sys_is_finalizing) : NULL;
    if (finalizing && finalizing == Py_False) {
        PyObject *r = PyObject_CallMethodObjArgs(self->port, S_detach, self->record, NULL);
        Py_XDECREF(r);
    }
    Py_XDECREF(finalizing);
    PyErr_Clear(); /* a finalizer never raises */
    PyErr_Restore(type, value, tb);
}

/* wait(timeout=None): the port's wait, at most once (Pending.wait's contract). */
static PyObject *Handle_wait(PyObject *obj, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    HandleObject *self = (HandleObject *)obj;
    PyObject *timeout = Py_None;
    Py_ssize_t nkw = kwnames ? PyTuple_Size(kwnames) : 0;
    if (nargs + nkw > 1) {
        PyErr_SetString(PyExc_TypeError, "wait() takes at most 1 argument (timeout)");
        return NULL;
    }
    if (nargs == 1) {
        timeout = args[0];
    } else if (nkw == 1) {
        PyObject *name = PyTuple_GetItem(kwnames, 0);
        if (PyUnicode_CompareWithASCIIString(name, "timeout") != 0) {
            PyErr_Format(PyExc_TypeError, "wait() got an unexpected keyword argument '%U'", name);
            return NULL;
        }
        timeout = args[0];
    }
    if (!self->port || !self->record || !self->claimed) {
        PyErr_SetString(PyExc_AttributeError, "this handle's fields were deleted");
        return NULL;
    }
    int claimed = PyObject_IsTrue(self->claimed);
    if (claimed) {
        if (claimed > 0)
            PyErr_SetString(handle_waited_error ? handle_waited_error : PyExc_RuntimeError,
                            "this transfer was already waited; a handle is waited at most once");
        return NULL;
    }
    PyObject *fn = PyObject_GetAttr(self->port, S_wait);
    if (!fn) return NULL;
    PyObject *record = self->record;
    Py_INCREF(record); /* the handle's field may be rebound while the wait releases the GIL */
    PyObject *a[2] = {record, timeout};
    PyObject *result;
    if (PyCFunction_Check(fn) && PyCFunction_GetFunction(fn) == (PyCFunction)(void (*)(void))Fast_wait)
        result = Fast_wait(PyCFunction_GetSelf(fn), a, timeout == Py_None ? 1 : 2);
    else
        result = call_args(fn, a, 2);
    Py_DECREF(fn);
    Py_DECREF(record);
    if (!result) return NULL;
    set_field(&self->waited, Py_True);
    set_field(&self->claimed, Py_True);
    return result;
}

/*
 * Fast_pinned's common case on CUDA (the backend's copy is Calls' compiled one, no batch open, no
 * maintenance due, a pooled event): the copy and its event record go to the driver before the record
 * and its tuples are made, so the copy starts sooner by the time those allocations take (the 16 B
 * round trip's critical path; the Python twin, Completion.enqueue, makes the record first; on the
 * H200 the gain stayed inside the hosts' drift, docs/benchmarks.md, sixth session, run 6). Garbage collection is off from the copy until the
 * record is in `live`: an allocation in between cannot run a finalizer (a dropped handle's, a
 * runtime's) that would find the copy untracked; that window had the first try at this reverted
 * (a358b81). Returns the record (its event taken from the pool, the copy counted as submitted), or
 * NULL with an exception: the driver refused (as Fast_enqueue reports it), or an allocation failed
 * after the copy was queued, which is then waited for (cuEventSynchronize, its event back in the pool)
 * before MemoryError, so that nothing untracked stays in flight.
 */
/* The record's tuples of a pinned submission: moved, leased and result (0, or -1 with none made). */
static int fast_pinned_tuples(int upload, PyObject *host, PyObject *device, PyObject **moved, PyObject **leased,
                              PyObject **result) {
    *moved = upload ? PyTuple_Pack(2, host, device) : PyTuple_Pack(1, host);
    *leased = upload ? PyTuple_New(0) : PyTuple_Pack(1, device);
    *result = upload ? (Py_XINCREF(*moved), *moved) : PyTuple_Pack(2, device, host);
    if (*moved && *leased && *result) return 0;
    Py_CLEAR(*moved);
    Py_CLEAR(*leased);
    Py_CLEAR(*result);
    return -1;
}

/* e: stream, copy, dst, src, nbytes (Fast_pinned's arguments 1 - 5). Py_None (a new reference): not taken
 * (no pooled event), the caller goes through Fast_enqueue. */
static PyObject *fast_copy_first(FastObject *self, CallsObject *calls, int cu_upload, PyObject *const *e, int upload,
                                 PyObject *host, PyObject *device, PyObject *const *tuples) {
    unsigned long long dst, src, n, stream, ev;
    Py_ssize_t ne = PyList_Size(self->events);
    if (ne < 1) Py_RETURN_NONE; /* the pool emptied since the caller looked */
    PyObject *event = PyList_GetItem(self->events, ne - 1); /* borrowed */
    if (!event || int_arg(e[2], &dst, 0) || int_arg(e[3], &src, 0) || int_arg(e[4], &n, 0) ||
        int_arg(e[0], &stream, 0) || int_arg(event, &ev, 0))
        return NULL; /* nothing changed */
    Py_INCREF(event);
    if (PyList_SetSlice(self->events, ne - 1, ne, NULL)) {
        Py_DECREF(event);
        return NULL;
    }
    int gc_was = PyGC_Disable();
    int stage;
    CUresult rc = calls_copy_record(calls, cu_upload, dst, src, (size_t)n, (CUstream)(uintptr_t)stream,
                                    (CUevent)(uintptr_t)ev, &stage);
    PyObject *err_type = NULL, *err_value = NULL, *err_tb = NULL;
    if (rc) { /* Calls' report, as the copy call makes it; an on_error that returns makes it a success */
        PyObject *cargs[5] = {e[2], e[3], e[4], e[0], event};
        PyObject *answered = calls_failed(calls, cu_upload ? "htod_record" : "dtoh_record", rc, stage, cargs, 5);
        if (answered) {
            Py_DECREF(answered);
            rc = 0;
        } else {
            PyErr_Fetch(&err_type, &err_value, &err_tb);
        }
    }
    PyObject *moved = NULL, *leased = NULL, *result = NULL, *record = NULL;
    int made = 0;
    if (tuples) { /* Fast_enqueue's: made by the caller */
        moved = tuples[0], leased = tuples[1], result = tuples[2];
        Py_INCREF(moved);
        Py_INCREF(leased);
        Py_INCREF(result);
    } else {
        made = fast_pinned_tuples(upload, host, device, &moved, &leased, &result);
    }
    if (made == 0) {
        PyObject *seq = PyLong_FromLongLong(++self->seq);
        if (seq) {
            PyObject *fields[7] = {seq, event, e[0], moved, leased, result, e[4]};
            record = record_make(fields);
            Py_DECREF(seq);
        }
    }
    Py_XDECREF(moved);
    Py_XDECREF(leased);
    Py_XDECREF(result);
    if (rc) { /* refused: reported as Fast_enqueue reports it, through the record */
        if (gc_was) PyGC_Enable();
        if (!record) { /* and no memory for a record: MemoryError, with nothing left running untracked */
            /* whether the copy was queued: the error says (an on_error retry may have queued it) */
            PyObject *queued = err_value ? PyObject_GetAttrString(err_value, "enqueued") : NULL;
            int pool_event = queued ? !PyObject_IsTrue(queued) : 0;
            Py_XDECREF(queued);
            Py_XDECREF(err_type);
            Py_XDECREF(err_value);
            Py_XDECREF(err_tb);
            if (!PyErr_ExceptionMatches(PyExc_MemoryError)) PyErr_NoMemory();
            fast_prove_untracked(self, e[0], event, pool_event);
            Py_DECREF(event);
            return NULL;
        }
        Py_DECREF(event);
        PyErr_Restore(err_type, err_value, err_tb);
        return fast_refused_copy(self, record);
    }
    if (record && PySet_Add(self->live, record) == 0) {
        self->submitted++;
        Py_DECREF(event);
        if (gc_was) PyGC_Enable();
        return record;
    }
    /* queued, but no memory to track it: prove it complete, then refuse (its event is sound: pooled) */
    if (gc_was) PyGC_Enable();
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    Py_XDECREF(record);
    PyErr_Restore(type, value, tb);
    fast_prove_untracked(self, e[0], event, 1);
    Py_DECREF(event);
    return NULL;
}

/* pinned(handle_type, stream, copy, dst, src, nbytes, host, device, upload) -> handle: a pinned route's
 * submission after its checks (lock held): enqueue as above, then the states (host in flight; device in
 * flight for an upload, read-leased for a download) and the handle, handle_type(completion, record),
 * made without a type call. Completion.submit_pinned is its Python twin. */
static PyObject *Fast_pinned(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
    FastObject *self = (FastObject *)obj;
    if (nargs_is(nargs, 9, "pinned")) return NULL;
    PyObject *handle_type = args[0], *host = args[6], *device = args[7];
    if (!PyType_Check(handle_type) || handle_type == (PyObject *)HandleType ||
        !PyType_IsSubtype((PyTypeObject *)handle_type, HandleType)) {
        /* Handle itself has no finalizer run on dealloc (only subtype_dealloc calls tp_finalize) */
        PyErr_SetString(PyExc_TypeError, "pinned: handle_type must be a Python subclass of Handle");
        return NULL;
    }
    int upload = PyObject_IsTrue(args[8]);
    if (upload < 0) return NULL;
    PyObject *copy = args[2], *record = NULL;
    PyCFunction fn = PyCFunction_Check(copy) ? PyCFunction_GetFunction(copy) : NULL;
    int cu_upload = fn == (PyCFunction)(void (*)(void))Calls_htod_record;
    if ((cu_upload || fn == (PyCFunction)(void (*)(void))Calls_dtoh_record) && !PyDict_Size(self->batches) &&
        PyList_Size(self->events) > 0) {
        int due = fast_maintenance_due(self);
        if (due < 0) return NULL;
        if (!due) {
            record = fast_copy_first(self, (CallsObject *)PyCFunction_GetSelf(copy), cu_upload, args + 1, upload,
                                     host, device, NULL);
            if (!record) return NULL;
            if (record == Py_None) Py_CLEAR(record); /* not taken: Fast_enqueue below */
        }
    }
    if (!record) { /* anything else: the tuples, then Fast_enqueue (which may take the Python path) */
        PyObject *moved, *leased, *result;
        if (fast_pinned_tuples(upload, host, device, &moved, &leased, &result)) return NULL;
        PyObject *e[8] = {args[1], args[2], args[3], args[4], args[5], moved, leased, result};
        record = Fast_enqueue(obj, e, 8);
        Py_DECREF(moved);
        Py_DECREF(leased);
        Py_DECREF(result);
        if (!record) return NULL;
    }
    /* enqueued: from here nothing fails but an allocation (the states move as in Python) */
    if (PyObject_SetAttr(host, S_state, self->in_flight)) goto fail;
    if (upload) {
        if (PyObject_SetAttr(device, S_state, self->in_flight)) goto fail;
    } else {
        PyObject *leases = PyObject_GetAttr(device, S_leases);
        if (!leases) goto fail;
        long k = PyLong_AsLong(leases);
        Py_DECREF(leases);
        PyObject *v = (k == -1 && PyErr_Occurred()) ? NULL : PyLong_FromLong(k + 1);
        int rc = v ? PyObject_SetAttr(device, S_leases, v) : -1;
        Py_XDECREF(v);
        if (rc) goto fail;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot((PyTypeObject *)handle_type, Py_tp_alloc);
    HandleObject *h = (HandleObject *)alloc((PyTypeObject *)handle_type, 0);
    if (!h) goto fail;
    Py_INCREF(self->completion);
    h->port = self->completion;
    h->record = record; /* the reference from enqueue */
    Py_INCREF(Py_False);
    h->waited = Py_False;
    Py_INCREF(Py_False);
    h->claimed = Py_False;
    Py_INCREF(Py_None);
    h->future = Py_None;
    return (PyObject *)h;
fail:
    Py_DECREF(record);
    return NULL;
}

/* set_handle_errors(waited_error): the exception a second wait() raises (ferry.FerryError). */
static PyObject *mod_set_handle_errors(PyObject *Py_UNUSED(mod), PyObject *arg) {
    PyObject *old = handle_waited_error;
    Py_INCREF(arg);
    handle_waited_error = arg;
    Py_XDECREF(old);
    Py_RETURN_NONE;
}

/* T_OBJECT_EX: a deleted field reads as AttributeError, as a __slots__ one does; the port and the
 * record are never rebound (the C code holds them across calls that release the GIL) */
#define HANDLE_MEMBER(name, field, flags) {name, T_OBJECT_EX, offsetof(HandleObject, field), flags, NULL}

static PyMemberDef Handle_members[] = {
    HANDLE_MEMBER("_port", port, READONLY),      HANDLE_MEMBER("_record", record, READONLY),
    HANDLE_MEMBER("_waited", waited, 0),         HANDLE_MEMBER("_claimed", claimed, 0),
    HANDLE_MEMBER("_future", future, 0),         {NULL, 0, 0, 0, NULL},
};

/* Python subclasses may chain __init__ (super().__init__(port, record)): the fields are set in tp_new */
static int Handle_init(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kwds)) {
    return 0;
}

static PyMethodDef Handle_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))Handle_wait, METH_FASTCALL | METH_KEYWORDS,
     "wait($self, /, timeout=None)\n--\n\n"
     "Block until the copy completed, then hand back what was handed in.\n\n"
     "At most once per handle (a second call raises FerryError). timeout=None waits without bound; "
     "TimeoutError after timeout seconds, and Ctrl-C, leave the handle pending. TransferFailedError: the "
     "device reported a failure, nothing is published, the objects stay abandoned. See ferry.Pending.wait "
     "in ferry/_pending.py for the whole contract."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Handle_slots[] = {
    {Py_tp_new, Handle_new},
    {Py_tp_init, Handle_init},
    {Py_tp_dealloc, Handle_dealloc},
    {Py_tp_traverse, Handle_traverse},
    {Py_tp_clear, Handle_clear},
    {Py_tp_finalize, Handle_finalize},
    {Py_tp_members, Handle_members},
    {Py_tp_methods, Handle_methods},
    {Py_tp_doc, "Handle(port, record): the compiled base of ferry's transfer handles (see ferry/_pending.py)."},
    {0, NULL},
};

static PyType_Spec Handle_spec = {
    "ferry._native._engine.Handle",
    sizeof(HandleObject),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    Handle_slots,
};

/* -- host copies for the small pageable route (any backend) -------------------------------------------- */

/* A C-contiguous buffer (writable when asked) of at most capacity bytes; -1 (no error set) otherwise. */
static int small_view(PyObject *array, Py_buffer *view, unsigned long long capacity, int writable) {
    if (PyObject_GetBuffer(array, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        return -1;
    }
    if ((unsigned long long)view->len > capacity) {
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/*
 * NumPy's array struct (PyArrayObject_fields) keeps the data pointer and the flags at fixed offsets
 * (16 and 64 on 64-bit platforms): NumPy's ABI, which every extension compiled against it reads
 * directly (PyArray_DATA, PyArray_FLAGS). Python checks both offsets against NumPy's own answers for
 * a few arrays before it enables them here (set_array_layout); until then, and for any caller that
 * does not vouch for an exact numpy.ndarray of a known size, the buffer protocol serves. Read that
 * way a small array costs tens of nanoseconds instead of a buffer export.
 */
#define NPY_C_CONTIGUOUS_FLAG 0x0001
#define NPY_WRITEABLE_FLAG 0x0400

static Py_ssize_t array_data_offset = -1, array_flags_offset = -1;

static inline char *array_data(PyObject *a) { return *(char **)((char *)a + array_data_offset); }
static inline int *array_flags(PyObject *a) { return (int *)((char *)a + array_flags_offset); }

static PyObject *mod_set_array_layout(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs_is(nargs, 2, "set_array_layout")) return NULL;
    Py_ssize_t data = PyLong_AsSsize_t(args[0]), flags = PyLong_AsSsize_t(args[1]);
    if ((data == -1 || flags == -1) && PyErr_Occurred()) return NULL;
    array_data_offset = data;
    array_flags_offset = flags;
    Py_RETURN_NONE;
}


/* NumPy's nd, dimensions and descr fields (set_array_shape_layout, verified by the caller; -1: off) */
static Py_ssize_t array_nd_offset = -1, array_dims_offset = -1, array_descr_offset = -1;

static PyObject *mod_set_array_shape_layout(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs_is(nargs, 3, "set_array_shape_layout")) return NULL;
    Py_ssize_t at[3];
    for (int i = 0; i < 3; i++) {
        at[i] = PyLong_AsSsize_t(args[i]);
        if (at[i] == -1 && PyErr_Occurred()) return NULL;
    }
    array_nd_offset = at[0];
    array_dims_offset = at[1];
    array_descr_offset = at[2];
    Py_RETURN_NONE;
}

/* Whether an exact ndarray has the shape ``shape`` (a tuple of ints) and the dtype object ``dtype`` itself
 * (an equal dtype that is another object: no, the caller's Python path compares it). Shape layout set. */
static int array_matches(PyObject *array, PyObject *shape, PyObject *dtype) {
    if (!shape || !dtype || *(PyObject **)((char *)array + array_descr_offset) != dtype || !PyTuple_Check(shape))
        return 0;
    int nd = *(int *)((char *)array + array_nd_offset);
    if (nd != PyTuple_Size(shape)) return 0;
    Py_ssize_t *dims = *(Py_ssize_t **)((char *)array + array_dims_offset);
    for (int i = 0; i < nd; i++) {
        Py_ssize_t d = PyLong_AsSsize_t(PyTuple_GetItem(shape, i));
        if (d == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        if (d != dims[i]) return 0;
    }
    return 1;
}

/* bind_small(small_route, ndarray, slow_upload): what Fast.upload needs of the small pageable route (its
 * upload ring, free slots, lease table, registrations) and Runtime.upload for everything else */
static PyObject *Fast_bind_small(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
    FastObject *self = (FastObject *)obj;
    if (nargs_is(nargs, 3, "bind_small")) return NULL;
    PyObject *route = args[0], *ring = NULL, *leases = NULL, *registrations = NULL, *got[5] = {NULL};
    int ok = (ring = PyObject_GetAttrString(route, "up")) && (got[0] = PyObject_GetAttrString(ring, "free")) &&
             (got[1] = PyObject_GetAttrString(ring, "lost")) && (leases = PyObject_GetAttrString(route, "leases")) &&
             (got[2] = PyObject_GetAttrString(leases, "take")) &&
             (registrations = PyObject_GetAttrString(route, "registrations")) &&
             (got[3] = PyObject_GetAttrString(registrations, "active"));
    Py_XDECREF(leases);
    Py_XDECREF(registrations);
    if (ok && (!PyList_Check(got[0]) || !PyList_Check(got[3]))) {
        PyErr_SetString(PyExc_TypeError, "bind_small: the ring's free slots and the active registrations must be lists");
        ok = 0;
    }
    if (!ok) {
        Py_XDECREF(ring);
        for (int i = 0; i < 4; i++) Py_XDECREF(got[i]);
        return NULL;
    }
    PyObject *give = PyObject_GetAttr(ring, S_give);
    if (!give) {
        Py_DECREF(ring);
        for (int i = 0; i < 4; i++) Py_XDECREF(got[i]);
        return NULL;
    }
    PyObject *values[8] = {ring, got[0], got[1], got[2], got[3], args[1], args[2], give}; /* references taken */
    Py_INCREF(args[1]);
    Py_INCREF(args[2]);
    PyObject **fields = &self->small_ring;
    for (int i = 0; i < 8; i++) {
        PyObject *old = fields[i];
        fields[i] = values[i];
        Py_XDECREF(old);
    }
    Py_RETURN_NONE;
}

/* ring.<name> += delta (an int attribute of the ring, a plain Python object) */
static int ring_add(PyObject *ring, PyObject *name, unsigned long long delta) {
    PyObject *v = PyObject_GetAttr(ring, name);
    if (!v) return -1;
    PyObject *d = PyLong_FromUnsignedLongLong(delta), *sum = d ? PyNumber_Add(v, d) : NULL;
    Py_DECREF(v);
    Py_XDECREF(d);
    int rc = sum ? PyObject_SetAttr(ring, name, sum) : -1;
    Py_XDECREF(sum);
    return rc;
}

static PyObject *S_transfers;

/* field = value (a new reference taken here), in an object of the slot layout */
static void slot_set(PyObject *obj, int which, PyObject *value) {
    PyObject **field = (PyObject **)((char *)obj + slot_at[which]);
    Py_INCREF(value);
    Py_XSETREF_LOCAL(*field, value);
}

/*
 * Runtime.upload's common small case in one C call (bound as the runtime's own attribute, like
 * upload_pending): a C-contiguous exact ndarray of at most one slot into a device array of this runtime
 * with its shape and (identical) dtype object, no batch open, no registration active, a free slot in the
 * ring. SmallRoute.upload's steps: the host copy into the slot, Fast.enqueue (the copy first), the slot
 * as the record's extras, the array's read-only lease, the destination in flight, the ring's counts;
 * then the handle. Anything else is Runtime.upload's, before anything changed.
 */
static PyObject *fast_small_upload(FastObject *self, PyObject *runtime, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames) {
    if (!self->slow_upload || !self->small_ring) {
        PyErr_SetString(PyExc_RuntimeError, "Fast: bind_entries and bind_small were not called");
        return NULL;
    }
    if (nargs != 2 || (kwnames && PyTuple_Size(kwnames)) || !self->rlock || !slot_types[4] ||
        array_descr_offset < 0 || array_data_offset < 0 || Py_TYPE(args[0]) != (PyTypeObject *)self->ndarray_type ||
        Py_TYPE(args[1]) != (PyTypeObject *)slot_types[1])
        return fast_entry_slow(self, self->slow_upload_any, runtime, args, nargs, kwnames);
    PyObject *source = args[0], *device = args[1];
    Py_INCREF(runtime); /* held across the submission */
    RLockObject *lock = (RLockObject *)self->rlock;
    if (rlock_take(lock, -1) != 1) {
        Py_DECREF(runtime);
        return NULL;
    }
    PyObject *copy = PyObject_GetAttr(self->entry_backend, S_htod_record); /* before the checks (it may run Python) */
    if (!copy) {
        rlock_give_result(lock, NULL);
        Py_DECREF(runtime);
        return NULL;
    }
    PyObject *result = NULL, *slot = NULL, *record = NULL, *free_list = self->small_free;
    Py_ssize_t nfree = PyList_Size(free_list), n = -1;
    unsigned long long capacity = 0;
    PyObject *nbytes_obj = slot_of(device, SL_DEV_NBYTES);
    int common = nfree > 0 && Py_TYPE(self->health) == (PyTypeObject *)slot_types[3] &&
                 slot_of(self->health, SL_HEALTH_REFUSAL) == Py_None && !PyDict_Size(self->batches) &&
                 slot_of(device, SL_DEV_RUNTIME) == runtime && slot_of(device, SL_DEV_STATE) == self->owned &&
                 is_zero(slot_of(device, SL_DEV_LEASES)) && slot_of(device, SL_DEV_READY) == Py_None &&
                 PyList_Size(self->small_active) == 0 && nbytes_obj && PyLong_Check(nbytes_obj) &&
                 slot_of(device, SL_DEV_PTR) && (*array_flags(source) & NPY_C_CONTIGUOUS_FLAG) &&
                 array_matches(source, slot_of(device, SL_DEV_SHAPE), slot_of(device, SL_DEV_DTYPE));
    if (common) {
        n = PyLong_AsSsize_t(nbytes_obj);
        slot = PyList_GetItem(free_list, nfree - 1); /* borrowed */
        if (n < 0 || !slot || Py_TYPE(slot) != (PyTypeObject *)slot_types[4] || !slot_of(slot, SL_SLOT_PTR) ||
            !slot_of(slot, SL_SLOT_OWN)) {
            common = 0;
        } else {
            capacity = as_u64(slot_of(slot, SL_SLOT_CAPACITY));
            common = !(capacity == (unsigned long long)-1 && PyErr_Occurred()) && (unsigned long long)n <= capacity;
        }
        PyErr_Clear(); /* anything odd: the Python route says what */
    }
    if (!common) {
        Py_DECREF(copy);
        if (rlock_give(lock) == 0) result = fast_entry_slow(self, self->slow_upload_any, runtime, args, nargs, kwnames);
        Py_DECREF(runtime);
        return result;
    }
    Py_INCREF(slot);
    /* held: read again after Fast_enqueue, which may run Python (maintenance) */
    PyObject *slot_ptr = slot_of(slot, SL_SLOT_PTR), *device_ptr = slot_of(device, SL_DEV_PTR);
    Py_INCREF(slot_ptr);
    Py_INCREF(device_ptr);
    Py_INCREF(nbytes_obj);
    unsigned long long dst = as_u64(slot_ptr);
    PyObject *moved = NULL, *leased = NULL, *res = NULL;
    if ((dst == (unsigned long long)-1 && PyErr_Occurred()) || PyList_SetSlice(free_list, nfree - 1, nfree, NULL))
        goto fail_unchanged;
    /* taken from the ring: from here an error gives it back (nothing enqueued) or loses it (SmallRoute's rule) */
    memcpy((void *)(uintptr_t)dst, array_data(source), (size_t)n);
    if (!(moved = PyTuple_Pack(1, device)) || !(leased = PyTuple_New(0)) || !(res = PyTuple_Pack(2, source, device))) {
        PyList_Append(free_list, slot);
        goto fail_unchanged;
    }
    PyObject *e[8] = {self->h2d, copy, device_ptr, slot_ptr, nbytes_obj, moved, leased, res};
    record = Fast_enqueue((PyObject *)self, e, 8);
    if (!record) { /* ring.lost(slot, exc): back to the ring if nothing was enqueued, else abandoned */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        PyObject *lost = PyObject_CallFunctionObjArgs(self->small_lost, slot, value ? value : Py_None, NULL);
        Py_XDECREF(lost);
        if (lost) PyErr_Restore(type, value, tb);
        else {
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
        }
        goto done;
    }
    if (Py_TYPE(record) == RecordType)
        set_field(&((RecordObject *)record)->extra, slot);
    else if (PyObject_SetAttrString(record, "extra", slot))
        goto done_record;
    slot_set(slot, SL_SLOT_RECORD, record);
    slot_set(slot, SL_SLOT_NBYTES, nbytes_obj);
    slot_set(slot, SL_SLOT_CLEANUPS, slot_of(slot, SL_SLOT_OWN));
    slot_set(slot, SL_SLOT_HOST, source);
    PyObject *took = PyObject_CallFunctionObjArgs(self->small_take, source, NULL);
    if (!took) goto done_record;
    Py_DECREF(took);
    slot_set(device, SL_DEV_STATE, self->in_flight);
    if (ring_add(self->small_ring, S_transfers, 1) || ring_add(self->small_ring, S_host_copied, (unsigned long long)n))
        goto done_record;
    {
        allocfunc alloc = (allocfunc)PyType_GetSlot((PyTypeObject *)self->upload_type, Py_tp_alloc);
        HandleObject *h = (HandleObject *)alloc((PyTypeObject *)self->upload_type, 0);
        if (!h) goto done_record;
        Py_INCREF(self->completion);
        h->port = self->completion;
        h->record = record; /* the reference from enqueue */
        record = NULL;
        Py_INCREF(Py_False);
        h->waited = Py_False;
        Py_INCREF(Py_False);
        h->claimed = Py_False;
        Py_INCREF(Py_None);
        h->future = Py_None;
        result = (PyObject *)h;
    }
done_record: /* an error after the enqueue propagates, as from SmallRoute.upload (the record stays live) */
    Py_XDECREF(record);
    goto done;
fail_unchanged:
    Py_XDECREF(moved);
    Py_XDECREF(leased);
    Py_XDECREF(res);
    moved = leased = res = NULL;
done:
    Py_XDECREF(moved);
    Py_XDECREF(leased);
    Py_XDECREF(res);
    Py_XDECREF(copy);
    Py_DECREF(slot_ptr);
    Py_DECREF(device_ptr);
    Py_DECREF(nbytes_obj);
    Py_DECREF(slot);
    result = rlock_give_result(lock, result);
    Py_DECREF(runtime);
    return result;
}

/* clear_writeable(array) -> whether the array was writeable; it is not now. Layout set; ndarray only. */
static PyObject *mod_clear_writeable(PyObject *Py_UNUSED(mod), PyObject *array) {
    if (array_flags_offset < 0) {
        PyErr_SetString(PyExc_RuntimeError, "the array layout is not set");
        return NULL;
    }
    int *flags = array_flags(array);
    int was = *flags & NPY_WRITEABLE_FLAG;
    *flags &= ~NPY_WRITEABLE_FLAG;
    return PyBool_FromLong(was);
}

/* set_writeable(array): the writeable flag back (an array that owns its data). Layout set; ndarray only. */
static PyObject *mod_set_writeable(PyObject *Py_UNUSED(mod), PyObject *array) {
    if (array_flags_offset < 0) {
        PyErr_SetString(PyExc_RuntimeError, "the array layout is not set");
        return NULL;
    }
    *array_flags(array) |= NPY_WRITEABLE_FLAG;
    Py_RETURN_NONE;
}

/*
 * Leases(ndarray_type): HostLeases' table (ferry/_routes/_base.py) in C. The caller's NumPy arrays are
 * flagged read-only while transfers use them, counted per array, the flag restored by the last one.
 * `table` maps an array's address to [array, count, writeable] as the Python class does; take() and
 * give() are its methods, one C call each where the Python ones cost ~0.2 us apiece (a small pageable
 * transfer makes one of each). An exact ndarray (ndarray_type) has its flag flipped at the verified
 * offset (set_array_layout); any other array goes through array.flags and array.setflags, as in Python.
 */
static PyTypeObject *LeasesType;

typedef struct { /* a PairObject's shape (its traverse, clear and dealloc are Pair_*) */
    PyObject_HEAD
    PyObject *table, *ndarray;
} LeasesObject;

static PyObject *S_flags, *S_writeable, *S_setflags, *S_base, *S_write;

static PyObject *Leases_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ndarray_type", NULL};
    PyObject *ndarray;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!", kwlist, &PyType_Type, &ndarray)) return NULL;
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    LeasesObject *self = (LeasesObject *)alloc(type, 0);
    if (!self) return NULL;
    if (!(self->table = PyDict_New())) {
        Py_DECREF(self);
        return NULL;
    }
    Py_INCREF(ndarray);
    self->ndarray = ndarray;
    return (PyObject *)self;
}


/* array.setflags(write=value): 0, or -1 with the error set. */
static int leases_setflags(PyObject *array, int value) {
    PyObject *method = PyObject_GetAttr(array, S_setflags);
    if (!method) return -1;
    PyObject *empty = PyTuple_New(0), *kw = PyDict_New();
    PyObject *r = NULL;
    if (empty && kw && PyDict_SetItem(kw, S_write, value ? Py_True : Py_False) == 0) r = PyObject_Call(method, empty, kw);
    Py_XDECREF(empty);
    Py_XDECREF(kw);
    Py_DECREF(method);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

/* take(array, writeable=None): flag `array` read-only for one flight (`writeable`: its flag, when the
 * caller knows it; an exact ndarray's is read). give() ends it. */
static PyObject *Leases_take(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
    LeasesObject *self = (LeasesObject *)obj;
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "take takes 1 or 2 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *array = args[0], *known = nargs == 2 ? args[1] : Py_None;
    PyObject *key = PyLong_FromVoidPtr(array);
    if (!key) return NULL;
    PyObject *entry = PyDict_GetItemWithError(self->table, key); /* borrowed */
    if (entry) {
        long count = PyLong_AsLong(PyList_GetItem(entry, 1));
        PyObject *v = (count == -1 && PyErr_Occurred()) ? NULL : PyLong_FromLong(count + 1);
        Py_DECREF(key);
        if (!v || PyList_SetItem(entry, 1, v)) return NULL; /* steals v */
        Py_RETURN_NONE;
    }
    if (PyErr_Occurred()) {
        Py_DECREF(key);
        return NULL;
    }
    int was;
    if ((PyObject *)Py_TYPE(array) == self->ndarray && array_flags_offset >= 0) {
        int *flags = array_flags(array);
        was = (*flags & NPY_WRITEABLE_FLAG) != 0;
        *flags &= ~NPY_WRITEABLE_FLAG;
    } else {
        if (known == Py_None) {
            PyObject *flags = PyObject_GetAttr(array, S_flags);
            PyObject *w = flags ? PyObject_GetAttr(flags, S_writeable) : NULL;
            Py_XDECREF(flags);
            was = w ? PyObject_IsTrue(w) : -1;
            Py_XDECREF(w);
        } else {
            was = PyObject_IsTrue(known);
        }
        if (was < 0 || (was && leases_setflags(array, 0))) {
            Py_DECREF(key);
            return NULL;
        }
    }
    PyObject *one = PyLong_FromLong(1);
    entry = one ? PyList_New(3) : NULL;
    if (!entry) {
        Py_XDECREF(one);
        Py_DECREF(key);
        return NULL; /* the flag stays cleared: as in Python, where the table's insert cannot fail */
    }
    Py_INCREF(array);
    PyList_SetItem(entry, 0, array);
    PyList_SetItem(entry, 1, one);
    PyObject *flag = was ? Py_True : Py_False;
    Py_INCREF(flag);
    PyList_SetItem(entry, 2, flag);
    int rc = PyDict_SetItem(self->table, key, entry);
    Py_DECREF(entry);
    Py_DECREF(key);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

/* give(array): end one flight's lease of `array`; the last one restores its flag. */
static PyObject *Leases_give(PyObject *obj, PyObject *array) {
    LeasesObject *self = (LeasesObject *)obj;
    PyObject *key = PyLong_FromVoidPtr(array);
    if (!key) return NULL;
    PyObject *entry = PyDict_GetItemWithError(self->table, key); /* borrowed */
    if (!entry) {
        Py_DECREF(key);
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    long count = PyLong_AsLong(PyList_GetItem(entry, 1));
    if (count == -1 && PyErr_Occurred()) {
        Py_DECREF(key);
        return NULL;
    }
    if (count > 1) {
        PyObject *v = PyLong_FromLong(count - 1);
        Py_DECREF(key);
        if (!v || PyList_SetItem(entry, 1, v)) return NULL;
        Py_RETURN_NONE;
    }
    Py_INCREF(entry);
    int rc = PyDict_DelItem(self->table, key);
    Py_DECREF(key);
    int was = rc ? -1 : PyObject_IsTrue(PyList_GetItem(entry, 2));
    Py_DECREF(entry);
    if (was <= 0) return was < 0 ? NULL : (Py_INCREF(Py_None), Py_None);
    if ((PyObject *)Py_TYPE(array) == self->ndarray && array_flags_offset >= 0) {
        PyObject *base = PyObject_GetAttr(array, S_base);
        if (!base) return NULL;
        int owns = base == Py_None;
        Py_DECREF(base);
        if (owns) { /* it owns its data: NumPy would allow it */
            *array_flags(array) |= NPY_WRITEABLE_FLAG;
            Py_RETURN_NONE;
        }
    }
    if (leases_setflags(array, 1)) {
        if (!PyErr_ExceptionMatches(PyExc_ValueError)) return NULL;
        PyErr_Clear(); /* its base became read-only meanwhile: it stays so */
    }
    Py_RETURN_NONE;
}

static PyObject *Leases_get_table(PyObject *obj, void *Py_UNUSED(closure)) {
    LeasesObject *self = (LeasesObject *)obj;
    Py_INCREF(self->table);
    return self->table;
}

static PyMethodDef Leases_methods[] = {
    {"take", (PyCFunction)(void (*)(void))Leases_take, METH_FASTCALL,
     "take(array, writeable=None): flag array read-only for one flight (counted)"},
    {"give", Leases_give, METH_O, "give(array): end one flight's lease; the last one restores the flag"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Leases_getset[] = {
    {"table", Leases_get_table, NULL, "address -> [array, count, writeable] (the arrays leased now)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Leases_slots[] = {
    {Py_tp_new, Leases_new},
    {Py_tp_dealloc, Pair_dealloc}, /* a PairObject: table, ndarray */
    {Py_tp_traverse, Pair_traverse},
    {Py_tp_clear, Pair_clear},
    {Py_tp_methods, Leases_methods},
    {Py_tp_getset, Leases_getset},
    {Py_tp_doc, "Leases(ndarray_type): HostLeases' table of read-only flags in flight, in C"},
    {0, NULL},
};

static PyType_Spec Leases_spec = {
    "ferry._native._engine.Leases",
    sizeof(LeasesObject),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    Leases_slots,
};

/* copy_in(dst, capacity, array[, nbytes]) -> bytes copied, or -1 (not a C-contiguous buffer, or too large).
 * nbytes >= 0: the caller vouches that array is a numpy.ndarray of that size (the layout path). */
static PyObject *mod_copy_in(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long dst, capacity;
    if ((nargs != 3 && nargs_is(nargs, 4, "copy_in")) || int_arg(args[0], &dst, 0) || int_arg(args[1], &capacity, 0))
        return NULL;
    if (nargs == 4 && array_data_offset >= 0) {
        Py_ssize_t n = PyLong_AsSsize_t(args[3]);
        if (n == -1 && PyErr_Occurred()) return NULL;
        if (n >= 0) {
            if (!(*array_flags(args[2]) & NPY_C_CONTIGUOUS_FLAG) || (unsigned long long)n > capacity)
                return PyLong_FromLong(-1);
            memcpy((void *)(uintptr_t)dst, array_data(args[2]), (size_t)n);
            return PyLong_FromSsize_t(n);
        }
    }
    Py_buffer view;
    if (small_view(args[2], &view, capacity, 0)) return PyLong_FromLong(-1);
    Py_ssize_t n = view.len;
    memcpy((void *)(uintptr_t)dst, view.buf, (size_t)n);
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(n);
}

/* address_of(array, capacity[, nbytes]) -> the address of a writable C-contiguous buffer of at most
 * capacity bytes, or 0. nbytes >= 0: as for copy_in. */
static PyObject *mod_address_of(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long capacity;
    if ((nargs != 2 && nargs_is(nargs, 3, "address_of")) || int_arg(args[1], &capacity, 0)) return NULL;
    if (nargs == 3 && array_data_offset >= 0) {
        Py_ssize_t n = PyLong_AsSsize_t(args[2]);
        if (n == -1 && PyErr_Occurred()) return NULL;
        if (n >= 0) {
            int flags = *array_flags(args[0]);
            int wanted = NPY_C_CONTIGUOUS_FLAG | NPY_WRITEABLE_FLAG;
            if ((flags & wanted) != wanted || (unsigned long long)n > capacity) return PyLong_FromLong(0);
            return PyLong_FromVoidPtr(array_data(args[0]));
        }
    }
    Py_buffer view;
    if (small_view(args[0], &view, capacity, 1)) return PyLong_FromLong(0);
    void *address = view.buf;
    PyBuffer_Release(&view);
    return PyLong_FromVoidPtr(address);
}

/* data_of(ndarray) -> its data pointer, read from NumPy's array struct: the caller vouches that it is
 * an exact numpy.ndarray (needs set_array_layout; ndarray.ctypes.data costs a microsecond). */
static PyObject *mod_data_of(PyObject *Py_UNUSED(mod), PyObject *array) {
    if (array_data_offset < 0) {
        PyErr_SetString(PyExc_RuntimeError, "data_of needs a verified array layout (set_array_layout)");
        return NULL;
    }
    return PyLong_FromVoidPtr(array_data(array));
}

/* memcopy(dst, src, nbytes): memcpy between two host addresses (the GIL kept: small copies). */
static PyObject *mod_memcopy(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long dst, src, n;
    if (nargs != 3 && nargs != 4) {
        PyErr_Format(PyExc_TypeError, "memcopy takes 3 or 4 arguments (%zd given)", nargs);
        return NULL;
    }
    if (int_arg(args[0], &dst, 0) || int_arg(args[1], &src, 0) || int_arg(args[2], &n, 0)) return NULL;
    int nt = nargs == 4 ? PyObject_IsTrue(args[3]) : 0;
    if (nt < 0) return NULL;
    if (!nt || n < NT_MIN_BYTES) { /* the small route's copies keep the GIL: it holds the runtime's lock */
        memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, (size_t)n);
        Py_RETURN_NONE;
    }
    Py_BEGIN_ALLOW_THREADS
    copy_bytes((char *)(uintptr_t)dst, (const char *)(uintptr_t)src, (size_t)n, nt);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* -- the copier: one host copy shared by the caller and a few helper threads ----------------------- */
/*
 * The direct route copies a pageable array of up to StagingConfig.direct_bytes into one pinned block
 * on the calling thread (and out of it, for a download, when wait() settles). One thread copies about
 * 13 GB/s on the H200's VM, so 1 MiB costs ~80 us: close to all the time the driver's own pageable
 * copy takes. A Copier cuts such a copy into pieces of piece_bytes that the caller and up to
 * COPIER_MAX_HELPERS helper threads claim from one atomic counter. The caller never waits for a
 * helper to wake up: it starts on the first piece at once and copies every piece nobody else claimed,
 * so a copy costs at most what the caller alone costs plus one wake-up call, and helpers that are
 * awake (they poll spin_us after their last piece before they sleep) take a share each.
 *
 * The task lives on the caller's stack. A helper announces itself (active++) before it reads the task
 * pointer and leaves (active--) after its last piece; the caller, once every piece is copied, clears
 * the pointer and waits until no helper is inside. With sequentially consistent operations a helper
 * that read the pointer is counted before the caller reads the count, so the task outlives every
 * reader. One caller at a time owns the copier (busy); a second caller at the same moment, a caller in
 * a forked child (the helpers do not exist there) and a caller after close() copy alone. Helpers never
 * touch a Python object and never take the GIL; copy() releases it.
 */
#define COPIER_MAX_HELPERS 8
static PyTypeObject *CopierType;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cv;
    _Atomic(copy_task_t *) task; /* the caller's task while it runs, else NULL */
    atomic_ullong posted;        /* seq of the last task posted */
    atomic_int active;           /* helpers that may be reading the task */
    atomic_int sleepers;         /* helpers asleep (or about to be) on cv */
    atomic_int stop;
    atomic_int busy;             /* a caller owns the copier (for good after close) */
    atomic_ullong helped;        /* pieces the helpers copied */
    atomic_ullong shared;        /* copies cut into pieces */
    unsigned long long seq;      /* owned by the caller that holds busy */
    int helpers, started, caller_copies, ready;
    size_t piece;
    int64_t spin_ns;
    pid_t pid;
    pthread_t threads[COPIER_MAX_HELPERS];
} CopierObject;

static void *copier_main(void *arg) {
    CopierObject *c = (CopierObject *)arg;
    unsigned long long seen = 0; /* not posted's value: the first task may be posted before this thread runs */
    int64_t idle_since = now_ns();
    unsigned polls = 0;
    while (!atomic_load(&c->stop)) {
        unsigned long long p = atomic_load(&c->posted);
        if (p != seen) {
            atomic_fetch_add(&c->active, 1);
            copy_task_t *t = atomic_load(&c->task);
            if (t) {
                size_t got = copier_drain(t);
                if (got) atomic_fetch_add_explicit(&c->helped, got, memory_order_relaxed);
                p = t->seq > p ? t->seq : p;
            }
            atomic_fetch_sub(&c->active, 1);
            seen = p;
            idle_since = now_ns();
            continue;
        }
        if ((++polls & 63) || now_ns() - idle_since < c->spin_ns) {
            cpu_relax();
            continue;
        }
        pthread_mutex_lock(&c->mu);
        atomic_fetch_add(&c->sleepers, 1);
        while (!atomic_load(&c->stop) && atomic_load(&c->posted) == seen) pthread_cond_wait(&c->cv, &c->mu);
        atomic_fetch_sub(&c->sleepers, 1);
        pthread_mutex_unlock(&c->mu);
        idle_since = now_ns();
    }
    return NULL;
}

/* Start the helpers (GIL held, busy owned). Those that could not start are not counted. */
static void copier_start(CopierObject *c) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old); /* helpers inherit a full mask: signals go to Python's threads */
    int n = 0;
    while (n < c->helpers && !pthread_create(&c->threads[n], NULL, copier_main, c)) n++;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    c->started = n;
}

/* The shared copy (GIL released, busy owned, helpers started). */
static void copier_share(CopierObject *c, char *dst, const char *src, size_t n, int nt) {
    copy_task_t t;
    task_init(&t, dst, src, n, c->piece, nt, ++c->seq);
    atomic_store(&c->task, &t);
    atomic_store(&c->posted, t.seq);
    if (atomic_load(&c->sleepers)) {
        pthread_mutex_lock(&c->mu);
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
    }
    if (c->caller_copies) copier_drain(&t);
    task_retire(&t, &c->task, &c->active);
    atomic_fetch_add_explicit(&c->shared, 1, memory_order_relaxed);
}

static PyObject *Copier_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"helpers", "spin_us", "piece_bytes", "caller_copies", NULL};
    int helpers, caller_copies = 1;
    long long spin_us = 100, piece = 128 << 10;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i|$LLp", kwlist, &helpers, &spin_us, &piece, &caller_copies))
        return NULL;
    if (helpers < 0 || helpers > COPIER_MAX_HELPERS) {
        PyErr_Format(PyExc_ValueError, "Copier needs 0 <= helpers <= %d (got %d)", COPIER_MAX_HELPERS, helpers);
        return NULL;
    }
    if (spin_us < 0 || spin_us > 1000000 || piece < (long long)COPIER_MIN_PIECE || piece > (1LL << 40)) {
        PyErr_Format(PyExc_ValueError, "Copier needs 0 <= spin_us <= 1000000 and piece_bytes >= %zu",
                     COPIER_MIN_PIECE);
        return NULL;
    }
    if (!caller_copies && !helpers) {
        PyErr_SetString(PyExc_ValueError, "Copier(caller_copies=False) needs helpers");
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    CopierObject *self = (CopierObject *)alloc(type, 0);
    if (!self) return NULL;
    if (pthread_mutex_init(&self->mu, NULL)) {
        Py_DECREF(self);
        PyErr_SetString(PyExc_MemoryError, "cannot initialize a copier");
        return NULL;
    }
    if (pthread_cond_init(&self->cv, NULL)) {
        pthread_mutex_destroy(&self->mu);
        Py_DECREF(self);
        PyErr_SetString(PyExc_MemoryError, "cannot initialize a copier");
        return NULL;
    }
    self->ready = 1;
    atomic_init(&self->task, NULL);
    atomic_init(&self->posted, 0);
    atomic_init(&self->active, 0);
    atomic_init(&self->sleepers, 0);
    atomic_init(&self->stop, 0);
    atomic_init(&self->busy, 0);
    atomic_init(&self->helped, 0);
    atomic_init(&self->shared, 0);
    self->helpers = helpers;
    self->caller_copies = caller_copies;
    self->piece = (size_t)piece;
    self->spin_ns = spin_us * 1000;
    self->pid = getpid();
    return (PyObject *)self;
}

/* Stop and join the helpers (the GIL released by the caller when it may wait); the copier then copies
 * alone for good. Only in the process that made it: a forked child has no helpers to join. */
static void copier_close(CopierObject *c) {
    int expected = 0;
    for (unsigned i = 0; !atomic_compare_exchange_weak(&c->busy, &expected, 1); i++) {
        if (expected == 2) return; /* closed already */
        expected = 0;
        if (i > 64) sched_yield(); /* a copy is running: it ends within its pieces */
    }
    atomic_store(&c->stop, 1);
    pthread_mutex_lock(&c->mu);
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    for (int i = 0; i < c->started; i++) pthread_join(c->threads[i], NULL);
    c->started = 0;
    atomic_store(&c->busy, 2);
}

static PyObject *Copier_close(PyObject *obj, PyObject *Py_UNUSED(ignored)) {
    CopierObject *c = (CopierObject *)obj;
    if (c->pid == getpid()) {
        Py_BEGIN_ALLOW_THREADS
        copier_close(c);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static void Copier_dealloc(PyObject *obj) {
    CopierObject *c = (CopierObject *)obj;
    PyTypeObject *tp = Py_TYPE(obj);
    if (c->ready && c->pid == getpid()) { /* a forked child leaks them: the parent's helpers are not here */
        copier_close(c);
        pthread_cond_destroy(&c->cv);
        pthread_mutex_destroy(&c->mu);
    }
    freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    f(obj);
    Py_DECREF((PyObject *)tp);
}

/* copy(dst, src, nbytes, nontemporal=False): dst <- src (host addresses, not overlapping), the GIL
 * released from 64 KiB; shared with the helpers from two pieces. */
static PyObject *Copier_copy(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
    CopierObject *c = (CopierObject *)obj;
    unsigned long long dst, src, n;
    if (nargs != 3 && nargs != 4) {
        PyErr_Format(PyExc_TypeError, "copy takes 3 or 4 arguments (%zd given)", nargs);
        return NULL;
    }
    if (int_arg(args[0], &dst, 0) || int_arg(args[1], &src, 0) || int_arg(args[2], &n, 0)) return NULL;
    int nt = nargs == 4 ? PyObject_IsTrue(args[3]) : 0;
    if (nt < 0) return NULL;
    if (n && (!dst || !src)) {
        PyErr_SetString(PyExc_ValueError, "copy: NULL address");
        return NULL;
    }
    char *d = (char *)(uintptr_t)dst;
    const char *s = (const char *)(uintptr_t)src;
    int expected = 0;
    int share = n >= 2 * c->piece && c->helpers && c->pid == getpid() &&
                atomic_compare_exchange_strong(&c->busy, &expected, 1);
    if (!share) {
        if (n < NT_MIN_BYTES) {
            memcpy(d, s, (size_t)n);
        } else {
            Py_BEGIN_ALLOW_THREADS
            copy_bytes(d, s, (size_t)n, nt);
            Py_END_ALLOW_THREADS
        }
        Py_RETURN_NONE;
    }
    if (!c->started) copier_start(c); /* the first shared copy (or a retry after none could start) */
    Py_BEGIN_ALLOW_THREADS
    if (c->started) copier_share(c, d, s, (size_t)n, nt);
    else copy_bytes(d, s, (size_t)n, nt);
    Py_END_ALLOW_THREADS
    atomic_store(&c->busy, 0);
    Py_RETURN_NONE;
}

static PyObject *Copier_get_helpers(PyObject *obj, void *Py_UNUSED(closure)) {
    return PyLong_FromLong(((CopierObject *)obj)->helpers);
}

static PyObject *Copier_get_started(PyObject *obj, void *Py_UNUSED(closure)) {
    return PyLong_FromLong(((CopierObject *)obj)->started);
}

static PyObject *Copier_get_closed(PyObject *obj, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(atomic_load(&((CopierObject *)obj)->busy) == 2);
}

static PyObject *Copier_get_pieces_helped(PyObject *obj, void *Py_UNUSED(closure)) {
    return PyLong_FromUnsignedLongLong(atomic_load(&((CopierObject *)obj)->helped));
}

static PyObject *Copier_get_shared_copies(PyObject *obj, void *Py_UNUSED(closure)) {
    return PyLong_FromUnsignedLongLong(atomic_load(&((CopierObject *)obj)->shared));
}

static PyObject *Copier_get_piece_bytes(PyObject *obj, void *Py_UNUSED(closure)) {
    return PyLong_FromSize_t(((CopierObject *)obj)->piece);
}

static PyMethodDef Copier_methods[] = {
    {"copy", (PyCFunction)(void (*)(void))Copier_copy, METH_FASTCALL,
     "copy(dst, src, nbytes, nontemporal=False): dst <- src, shared with the helpers from two pieces"},
    {"close", Copier_close, METH_NOARGS, "close(): join the helpers; later copies run on the caller alone"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Copier_getset[] = {
    {"helpers", Copier_get_helpers, NULL, "helper threads asked for", NULL},
    {"started", Copier_get_started, NULL, "helper threads running (they start with the first shared copy)", NULL},
    {"closed", Copier_get_closed, NULL, "whether close() ran", NULL},
    {"pieces_helped", Copier_get_pieces_helped, NULL, "pieces the helpers copied", NULL},
    {"shared_copies", Copier_get_shared_copies, NULL, "copies cut into pieces", NULL},
    {"piece_bytes", Copier_get_piece_bytes, NULL, "the size of a piece", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Copier_slots[] = {
    {Py_tp_new, Copier_new},
    {Py_tp_dealloc, Copier_dealloc},
    {Py_tp_methods, Copier_methods},
    {Py_tp_getset, Copier_getset},
    {Py_tp_doc, "Copier(helpers, *, spin_us=100, piece_bytes=131072, caller_copies=True): one host copy "
                "shared by the caller and helper threads"},
    {0, NULL},
};

static PyType_Spec Copier_spec = {
    "ferry._native._engine.Copier",
    sizeof(CopierObject),
    0,
    Py_TPFLAGS_DEFAULT,
    Copier_slots,
};

/* -- module ---------------------------------------------------------------------------------------- */

static PyObject *mod_is_sticky(PyObject *Py_UNUSED(mod), PyObject *arg) {
    long code = PyLong_AsLong(arg);
    if (code == -1 && PyErr_Occurred()) return NULL;
    return PyBool_FromLong(is_sticky_cuda((int)code));
}

static PyObject *mod_entry_point_names(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(ignored)) {
    PyObject *t = PyTuple_New(N_DRIVER_NAMES);
    if (!t) return NULL;
    for (int i = 0; i < N_DRIVER_NAMES; i++) {
        PyObject *s = PyUnicode_FromString(DRIVER_NAMES[i]);
        if (!s || PyTuple_SetItem(t, i, s)) {
            Py_DECREF(t);
            return NULL;
        }
    }
    return t;
}

/* ---- DLPack capsule destructor ---------------------------------------------------------------
 * A DLPack producer's capsule destructor runs when the capsule dies; if nobody consumed it (its
 * name is still "dltensor") the producer must call the tensor's deleter. A consumer may drop the
 * capsule while an exception is pending (NumPy does when it refuses a CUDA tensor), so the
 * destructor keeps that exception aside while the deleter (a Python callback in ferry) runs and
 * puts it back afterwards: the consumer's error reaches its caller and nothing is printed. */
typedef struct {
    void *data;
    int32_t device_type, device_id;
    int32_t ndim;
    uint8_t code, bits;
    uint16_t lanes;
    int64_t *shape, *strides;
    uint64_t byte_offset;
    void *manager_ctx;
    void (*deleter)(void *);
} dl_managed_tensor;

static void dlpack_capsule_destructor(PyObject *capsule) {
    if (!PyCapsule_IsValid(capsule, "dltensor")) {
        return; /* consumed: the consumer calls the deleter */
    }
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    dl_managed_tensor *managed = (dl_managed_tensor *)PyCapsule_GetPointer(capsule, "dltensor");
    if (managed != NULL && managed->deleter != NULL) {
        managed->deleter(managed);
    }
    PyErr_Clear();
    PyErr_Restore(type, value, traceback);
}

static PyObject *mod_dlpack_capsule_destructor(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromVoidPtr((void *)dlpack_capsule_destructor);
}

/* ---- DLPack deleter ---------------------------------------------------------------------------
 * A consumer calls an exported tensor's deleter when it frees the tensor, from its own thread and
 * at its own time: PyTorch may free a tensor while the interpreter shuts down, or only after it is
 * gone. A ctypes callback would then take a GIL that no longer exists and crash the process at exit.
 * This deleter does nothing once the interpreter is finalized (the process is ending: ferry's
 * bookkeeping goes with it) and otherwise calls ferry's release callback with the tensor's address,
 * keeping aside any exception the consumer left pending. */
static PyObject *dlpack_release; /* ferry's callback: release(address) */

static void dlpack_deleter(void *managed) {
    if (!Py_IsInitialized() || dlpack_release == NULL) return;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *address = PyLong_FromVoidPtr(managed);
    PyObject *result = address ? PyObject_CallFunctionObjArgs(dlpack_release, address, NULL) : NULL;
    Py_XDECREF(address);
    if (result == NULL) {
        PyErr_WriteUnraisable(dlpack_release);
    } else {
        Py_DECREF(result);
    }
    PyErr_Restore(type, value, traceback);
    PyGILState_Release(gil);
}

static PyObject *mod_dlpack_deleter(PyObject *Py_UNUSED(mod), PyObject *release) {
    if (!PyCallable_Check(release)) {
        PyErr_SetString(PyExc_TypeError, "dlpack_deleter(release): release must be callable");
        return NULL;
    }
    PyObject *old = dlpack_release;
    Py_INCREF(release);
    dlpack_release = release;
    Py_XDECREF(old);
    return PyLong_FromVoidPtr((void *)dlpack_deleter);
}

/* ---- DLPack import -----------------------------------------------------------------------------
 * dlpack_import(capsule): a consumer's read of an unused "dltensor" capsule, in one call (ctypes
 * takes a dozen): the description, then the capsule renamed "used_dltensor" so that its producer's
 * destructor leaves the tensor alone; the consumer owes the deleter (dlpack_release). */
static PyObject *int64_tuple(const int64_t *values, int n) {
    PyObject *t = PyTuple_New(n);
    if (!t) return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLongLong(values[i]);
        if (!v || PyTuple_SetItem(t, i, v)) {
            Py_DECREF(t);
            return NULL;
        }
    }
    return t;
}

static PyObject *mod_dlpack_import(PyObject *Py_UNUSED(mod), PyObject *capsule) {
    if (!PyCapsule_IsValid(capsule, "dltensor")) {
        PyErr_SetString(PyExc_ValueError, "not an unused 'dltensor' capsule");
        return NULL;
    }
    dl_managed_tensor *managed = (dl_managed_tensor *)PyCapsule_GetPointer(capsule, "dltensor");
    if (!managed) return NULL;
    int ndim = managed->ndim;
    if (ndim < 0 || ndim > 64 || (ndim && !managed->shape)) {
        PyErr_Format(PyExc_ValueError, "a DLPack tensor with %d dimensions and no shape", ndim);
        return NULL;
    }
    PyObject *shape = int64_tuple(managed->shape, ndim);
    if (!shape) return NULL;
    PyObject *strides = managed->strides ? int64_tuple(managed->strides, ndim) : Py_NewRef(Py_None);
    if (!strides) {
        Py_DECREF(shape);
        return NULL;
    }
    unsigned long long ptr = (unsigned long long)(uintptr_t)managed->data + managed->byte_offset;
    PyObject *address = PyLong_FromVoidPtr(managed);
    if (!address) {
        Py_DECREF(shape);
        Py_DECREF(strides);
        return NULL;
    }
    PyObject *result = Py_BuildValue("(NKiiNNiii)", address, ptr, (int)managed->device_type,
                                     (int)managed->device_id, shape, strides, (int)managed->code,
                                     (int)managed->bits, (int)managed->lanes); /* steals the N references */
    if (!result) return NULL;
    /* renamed last: from here on the caller owes the deleter (nothing can fail before it returns) */
    if (PyCapsule_SetName(capsule, "used_dltensor")) {
        Py_DECREF(result);
        return NULL;
    }
    return result;
}

/* ---- DLPack export -----------------------------------------------------------------------------
 * dlpack_export(owner, ptr, shape, code, bits, device_type, device_id): a "dltensor" capsule over ptr
 * (C-contiguous, no strides) whose tensor holds a reference to owner until its deleter runs. The
 * deleter drops that reference with the GIL (from any thread) and frees the tensor; once the
 * interpreter is finalized it does nothing (a consumer such as PyTorch may free a tensor at exit:
 * the process is ending). An unconsumed capsule's destructor calls the deleter. As for dlpack_deleter
 * above, a deleter on a thread Python does not know that races the interpreter's finalization (past
 * the Py_IsInitialized check as it starts) may be ended by PyGILState_Ensure; the 3.11 limited API
 * offers nothing finer (Py_IsFinalizing is in it from 3.13). */
typedef struct {
    dl_managed_tensor managed;
    int64_t shape[];
} exported_tensor;

static atomic_long exported_live; /* tensors exported and not yet deleted */

static void exported_deleter(void *tensor) {
    exported_tensor *t = (exported_tensor *)tensor;
    if (!Py_IsInitialized()) return;
    PyGILState_STATE gil = PyGILState_Ensure();
    Py_XDECREF((PyObject *)t->managed.manager_ctx);
    PyGILState_Release(gil);
    free(t);
    atomic_fetch_sub(&exported_live, 1);
}

static PyObject *mod_dlpack_exports_live(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLong(atomic_load(&exported_live));
}

static PyObject *mod_dlpack_export(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long ptr, code, bits, device_type, device_id;
    if (nargs_is(nargs, 7, "dlpack_export") || int_arg(args[1], &ptr, 0) || int_arg(args[3], &code, 0) ||
        int_arg(args[4], &bits, 0) || int_arg(args[5], &device_type, 0) || int_arg(args[6], &device_id, 0))
        return NULL;
    PyObject *shape = args[2];
    if (!PyTuple_Check(shape) || PyTuple_Size(shape) > 64) {
        PyErr_SetString(PyExc_TypeError, "dlpack_export: shape must be a tuple of at most 64 ints");
        return NULL;
    }
    if (code > 255 || bits > 255 || bits == 0) {
        PyErr_SetString(PyExc_ValueError, "dlpack_export: a DLPack dtype has a code and 1 - 255 bits");
        return NULL;
    }
    Py_ssize_t ndim = PyTuple_Size(shape);
    exported_tensor *t = calloc(1, sizeof *t + (size_t)(ndim ? ndim : 1) * sizeof(int64_t));
    if (!t) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < ndim; i++) {
        long long d = PyLong_AsLongLong(PyTuple_GetItem(shape, i));
        if (d == -1 && PyErr_Occurred()) {
            free(t);
            return NULL;
        }
        t->shape[i] = d;
    }
    t->managed.data = (void *)(uintptr_t)ptr;
    t->managed.device_type = (int32_t)device_type;
    t->managed.device_id = (int32_t)device_id;
    t->managed.ndim = (int32_t)ndim;
    t->managed.code = (uint8_t)code;
    t->managed.bits = (uint8_t)bits;
    t->managed.lanes = 1;
    t->managed.shape = t->shape;
    t->managed.strides = NULL;
    t->managed.byte_offset = 0;
    t->managed.deleter = exported_deleter;
    PyObject *capsule = PyCapsule_New(&t->managed, "dltensor", dlpack_capsule_destructor);
    if (!capsule) {
        free(t);
        return NULL;
    }
    Py_INCREF(args[0]);
    t->managed.manager_ctx = args[0];
    atomic_fetch_add(&exported_live, 1);
    return capsule;
}

/* dlpack_release(managed): call an imported tensor's deleter (the GIL released, as ctypes would). */
static PyObject *mod_dlpack_release(PyObject *Py_UNUSED(mod), PyObject *arg) {
    dl_managed_tensor *managed = (dl_managed_tensor *)PyLong_AsVoidPtr(arg);
    if (!managed) {
        if (PyErr_Occurred()) return NULL;
        PyErr_SetString(PyExc_ValueError, "dlpack_release: NULL tensor");
        return NULL;
    }
    void (*deleter)(void *) = managed->deleter;
    if (deleter) {
        Py_BEGIN_ALLOW_THREADS
        deleter(managed);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"dlpack_capsule_destructor", mod_dlpack_capsule_destructor, METH_NOARGS,
     "dlpack_capsule_destructor() -> the address of a DLPack capsule destructor that keeps a pending exception"},
    {"dlpack_deleter", mod_dlpack_deleter, METH_O,
     "dlpack_deleter(release) -> the address of a DLManagedTensor deleter that calls release(address) while the "
     "interpreter runs, and does nothing after"},
    {"dlpack_import", mod_dlpack_import, METH_O,
     "dlpack_import(capsule) -> (managed, ptr, device_type, device_id, shape, strides or None, code, bits, lanes) "
     "of an unused 'dltensor' capsule, renamed 'used_dltensor'"},
    {"dlpack_release", mod_dlpack_release, METH_O, "dlpack_release(managed): call an imported tensor's deleter"},
    {"dlpack_export", (PyCFunction)(void (*)(void))mod_dlpack_export, METH_FASTCALL,
     "dlpack_export(owner, ptr, shape, code, bits, device_type, device_id) -> a 'dltensor' capsule (C order) "
     "whose tensor keeps owner alive until its deleter runs"},
    {"dlpack_exports_live", mod_dlpack_exports_live, METH_NOARGS,
     "dlpack_exports_live() -> tensors dlpack_export made whose deleter has not run"},
    {"is_sticky", mod_is_sticky, METH_O, "is_sticky(code) -> whether a CUDA error code poisons the context"},
    {"entry_point_names", mod_entry_point_names, METH_NOARGS,
     "entry_point_names() -> the driver entry points mode='cuda' needs (the last two are optional)"},
    {"copy_in", (PyCFunction)(void (*)(void))mod_copy_in, METH_FASTCALL,
     "copy_in(dst, capacity, array[, nbytes]) -> bytes copied from a C-contiguous array, or -1 (not taken)"},
    {"address_of", (PyCFunction)(void (*)(void))mod_address_of, METH_FASTCALL,
     "address_of(array, capacity[, nbytes]) -> address of a writable C-contiguous array of at most capacity "
     "bytes, or 0"},
    {"set_slot_layout", (PyCFunction)(void (*)(void))mod_set_slot_layout, METH_FASTCALL,
     "set_slot_layout(types, offsets): where ferry's slotted objects keep the fields Fast's entries read"},
    {"set_array_shape_layout", (PyCFunction)(void (*)(void))mod_set_array_shape_layout, METH_FASTCALL,
     "set_array_shape_layout(nd_offset, dimensions_offset, descr_offset): NumPy's, verified by the caller"},
    {"set_array_layout", (PyCFunction)(void (*)(void))mod_set_array_layout, METH_FASTCALL,
     "set_array_layout(data_offset, flags_offset): NumPy's array struct offsets, verified by the caller (-1: off)"},
    {"clear_writeable", mod_clear_writeable, METH_O,
     "clear_writeable(ndarray) -> whether it was writeable (it is not now); needs set_array_layout"},
    {"set_writeable", mod_set_writeable, METH_O, "set_writeable(ndarray): the writeable flag back; needs set_array_layout"},
    {"memcopy", (PyCFunction)(void (*)(void))mod_memcopy, METH_FASTCALL,
     "memcopy(dst, src, nbytes, nontemporal=False): memcpy, the GIL held; nontemporal: the engine's streaming "
     "stores from 64 KiB on x86-64, the GIL released"},
    {"data_of", mod_data_of, METH_O,
     "data_of(ndarray) -> its data pointer (an exact numpy.ndarray, vouched by the caller; needs set_array_layout)"},
    {"set_handle_errors", mod_set_handle_errors, METH_O,
     "set_handle_errors(waited_error): the exception class a handle's second wait() raises"},
    {"new_record", (PyCFunction)(void (*)(void))mod_new_record, METH_FASTCALL,
     "new_record(seq, event, stream, moved, leased, result, nbytes) -> Record, without the type call"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "ferry._native._engine",
    "ferry's staging engine on native threads (see the essay at the top of _engine.c).",
    -1,
    module_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__engine(void) {
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    DriverError = PyErr_NewException("ferry._native._engine.DriverError", PyExc_RuntimeError, NULL);
    if (!DriverError) goto fail;
    Py_INCREF(DriverError); /* one for the module (stolen on success), one kept here */
    if (PyModule_AddObject(m, "DriverError", DriverError)) {
        Py_DECREF(DriverError);
        goto fail;
    }
    EngineType = (PyTypeObject *)PyType_FromSpec(&Engine_spec);
    if (!EngineType) goto fail;
    Py_INCREF((PyObject *)EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)EngineType)) {
        Py_DECREF((PyObject *)EngineType);
        goto fail;
    }
    JobType = (PyTypeObject *)PyType_FromSpec(&Job_spec);
    if (!JobType) goto fail;
    Py_INCREF((PyObject *)JobType);
    if (PyModule_AddObject(m, "Job", (PyObject *)JobType)) {
        Py_DECREF((PyObject *)JobType);
        goto fail;
    }
    RecordType = (PyTypeObject *)PyType_FromSpec(&Record_spec);
    if (!RecordType) goto fail;
    record_alloc = (allocfunc)PyType_GetSlot(RecordType, Py_tp_alloc);
    Py_INCREF((PyObject *)RecordType);
    if (PyModule_AddObject(m, "Record", (PyObject *)RecordType)) {
        Py_DECREF((PyObject *)RecordType);
        goto fail;
    }
    FastType = (PyTypeObject *)PyType_FromSpec(&Fast_spec);
    if (!FastType) goto fail;
    Py_INCREF((PyObject *)FastType);
    if (PyModule_AddObject(m, "Fast", (PyObject *)FastType)) {
        Py_DECREF((PyObject *)FastType);
        goto fail;
    }
    if (!(S_transfers = PyUnicode_InternFromString("transfers"))) goto fail;
    if (!(S_give = PyUnicode_InternFromString("give")) || !(S_free = PyUnicode_InternFromString("free")) ||
        !(S_host_copied = PyUnicode_InternFromString("host_copied")))
        goto fail;
    if (!(S_htod_record = PyUnicode_InternFromString("htod_record")) ||
        !(S_dtoh_record = PyUnicode_InternFromString("dtoh_record")))
        goto fail;
    if (!(S_count = PyUnicode_InternFromString("_count")) || !(S_deferred = PyUnicode_InternFromString("deferred")) ||
        !(S_doomed = PyUnicode_InternFromString("_doomed")) || !(S_refusal = PyUnicode_InternFromString("refusal")) ||
        !(S_event_wait = PyUnicode_InternFromString("event_wait")) ||
        !(S_own_event = PyUnicode_InternFromString("own_event")) || !(S_state = PyUnicode_InternFromString("_state")) ||
        !(S_leases = PyUnicode_InternFromString("_leases")) ||
        !(S_segments = PyUnicode_InternFromString("segments")) ||
        !(S_records = PyUnicode_InternFromString("records")) || !(S_last = PyUnicode_InternFromString("last")) ||
        !(S_copy = PyUnicode_InternFromString("copy")) || !(S_seen = PyUnicode_InternFromString("seen")) ||
        !(S_dsts = PyUnicode_InternFromString("dsts")) || !(S_srcs = PyUnicode_InternFromString("srcs")) ||
        !(S_sizes = PyUnicode_InternFromString("sizes")) || !(S_done = PyUnicode_InternFromString("done")) ||
        !(S_users = PyUnicode_InternFromString("users")) || !(S_event = PyUnicode_InternFromString("event")))
        goto fail;
    HandleType = (PyTypeObject *)PyType_FromSpec(&Handle_spec);
    if (!HandleType) goto fail;
    Py_INCREF((PyObject *)HandleType);
    if (PyModule_AddObject(m, "Handle", (PyObject *)HandleType)) {
        Py_DECREF((PyObject *)HandleType);
        goto fail;
    }
    {
        PyObject *sys = PyImport_ImportModule("sys");
        if (!sys) goto fail;
        sys_is_finalizing = PyObject_GetAttrString(sys, "is_finalizing");
        Py_DECREF(sys);
        if (!sys_is_finalizing) goto fail;
    }
    if (!(S_wait = PyUnicode_InternFromString("wait")) || !(S_detach = PyUnicode_InternFromString("detach")))
        goto fail;
    if (!(S_flags = PyUnicode_InternFromString("flags")) || !(S_writeable = PyUnicode_InternFromString("writeable")) ||
        !(S_setflags = PyUnicode_InternFromString("setflags")) || !(S_base = PyUnicode_InternFromString("base")) ||
        !(S_write = PyUnicode_InternFromString("write")))
        goto fail;
    EntryType = (PyTypeObject *)PyType_FromSpec(&Entry_spec);
    if (!EntryType) goto fail;
    RLockType = (PyTypeObject *)PyType_FromSpec(&RLock_spec);
    if (!RLockType) goto fail;
    Py_INCREF((PyObject *)RLockType);
    if (PyModule_AddObject(m, "RLock", (PyObject *)RLockType)) {
        Py_DECREF((PyObject *)RLockType);
        goto fail;
    }
    LeasesType = (PyTypeObject *)PyType_FromSpec(&Leases_spec);
    if (!LeasesType) goto fail;
    Py_INCREF((PyObject *)LeasesType);
    if (PyModule_AddObject(m, "Leases", (PyObject *)LeasesType)) {
        Py_DECREF((PyObject *)LeasesType);
        goto fail;
    }
    CopierType = (PyTypeObject *)PyType_FromSpec(&Copier_spec);
    if (!CopierType) goto fail;
    Py_INCREF((PyObject *)CopierType);
    if (PyModule_AddObject(m, "Copier", (PyObject *)CopierType)) {
        Py_DECREF((PyObject *)CopierType);
        goto fail;
    }
    CallsType = (PyTypeObject *)PyType_FromSpec(&Calls_spec);
    if (!CallsType) goto fail;
    Py_INCREF((PyObject *)CallsType);
    if (PyModule_AddObject(m, "Calls", (PyObject *)CallsType)) {
        Py_DECREF((PyObject *)CallsType);
        goto fail;
    }
    if (PyModule_AddIntConstant(m, "MAX_LANES", MAX_LANES) || PyModule_AddIntConstant(m, "MAX_SLOTS", MAX_SLOTS) ||
        PyModule_AddIntConstant(m, "INJECTED_FAILURE", ERR_UNKNOWN) ||
        PyModule_AddIntConstant(m, "INJECTED_STICKY_FAILURE", ERR_LAUNCH_FAILED))
        goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
