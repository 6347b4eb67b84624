/*
 * core/core.h: what the GIL-free staging core shares (no Python.h: plain C11 and pthreads).
 *
 * The core moves bytes between host memory and a device on native threads: jobs cut into chunks and
 * shares (jobs.c), the host copies (copy.c), the driver seam and the driver thread (driver.c), the
 * lanes and cooperative jobs (lanes.c), an engine's start, plans, queueing and stop (engine.c), file jobs
 * (file.c: chunks read from a file into slots, or written to one from them);
 * ../emulated.c is the emulated device behind the same seam. The
 * Python-facing files (engine.c and the rest, through ../native.h) include this header and reach the
 * core only through the functions declared at its end. Nothing here touches a Python object, and no
 * native thread ever takes the GIL: Python hands over addresses and sizes and learns the outcome from
 * a job's completion. The full essay on the engine (threads, chunks, completion, hand-off, failure,
 * invariants) opens lanes.c.
 */
#ifndef FERRY_CORE_H
#define FERRY_CORE_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* as Python.h: monotonic condition variables, clock_nanosleep */
#endif

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
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
extern const char *const DRIVER_NAMES[]; /* core/driver.c */
#define DRIVER_REQUIRED 13 /* the first 13 are required, the two error-text calls optional */
#define N_DRIVER_NAMES 15
/* driver_t is filled by position from DRIVER_NAMES: one pointer per name, in the same order */
_Static_assert(sizeof(driver_t) == N_DRIVER_NAMES * sizeof(void *),
               "driver_t and DRIVER_NAMES must list the same entry points");

#define MAX_DIMS 64
#define MAX_LANES 64
#define MAX_SLOTS 64
#define SLICE_NS 50000000LL /* wait() checks signals at least this often */
#define HANDOFF_EVENTS 16   /* per lane: a posted event is recorded again only 16 posts later */

static inline int is_sticky_cuda(int code) {
    return code == 700 || code == 701 || code == 702 || (code >= 714 && code <= 719) || code == 999;
}

/* -- time ------------------------------------------------------------------------------------- */

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline struct timespec ts_of(int64_t ns) {
    struct timespec ts;
    ts.tv_sec = (time_t)(ns / 1000000000LL);
    ts.tv_nsec = (long)(ns % 1000000000LL);
    return ts;
}

/* A condition variable on CLOCK_MONOTONIC, so timed waits ignore wall-clock jumps. */
static inline int cond_init_monotonic(pthread_cond_t *cv) {
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
    ptrdiff_t shape[MAX_DIMS];
    ptrdiff_t strides[MAX_DIMS];
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
    struct file_job *file;     /* a file job's file side (file.c), or NULL */
    /* a job of many pieces (job_plan_pieces): NULL for a job of one array */
    struct piece *pieces;
    size_t npieces;
    struct lchunk *lchunks; /* nchunks of them: each a device-contiguous run of pieces */
} job_t;

/* One piece of a job of many (core/pieces.c): a host range and the device range it moves to or from. */
typedef struct piece {
    char *host;
    CUdeviceptr dev;
    size_t nbytes;
} piece_t;

/* One chunk of a job of many pieces: `nbytes` from piece `first`, `skip` bytes into it, on through the
 * pieces after it, which follow it on the device without a gap (one DMA at `dev`). */
typedef struct lchunk {
    size_t first;
    size_t skip;
    size_t nbytes;
    CUdeviceptr dev;
} lchunk_t;

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

static inline void at_min(atomic_llong *a, long long v) {
    long long cur = atomic_load_explicit(a, memory_order_relaxed);
    while ((cur == 0 || v < cur) &&
           !atomic_compare_exchange_weak_explicit(a, &cur, v, memory_order_relaxed, memory_order_relaxed)) {
    }
}

static inline void at_max(atomic_llong *a, long long v) {
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
typedef struct {
    size_t offset; /* in the C-order image (and on the device) */
    size_t nbytes;
    char *host;    /* strided: the sub-array's first element */
    CUdeviceptr dev; /* where the chunk's DMA goes on the device (or comes from) */
    const lchunk_t *lc; /* a job of many pieces: the chunk's run of pieces (nd is then -1) */
    int nd;        /* strided: the sub-array's dims */
    ptrdiff_t len[MAX_DIMS];
    ptrdiff_t str[MAX_DIMS];
} chunk_t;
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

/* -- what the core's files define ---------------------------------------------------------------- */

/* jobs.c */
void job_decref(job_t *job);
void job_fail(job_t *job, const err_t *e);
void job_complete(job_t *job);
void job_chunk(const job_t *job, size_t k, chunk_t *c);

/* copy.c: host copies (streaming stores from NT_MIN_BYTES) */
#define NT_MIN_BYTES ((size_t)64 << 10)
void copy_bytes(char *dst, const char *src, size_t n, int nt);
void copier_piece(const copy_task_t *t, size_t k);
size_t copier_drain(copy_task_t *t);
void task_init(copy_task_t *t, char *dst, const char *src, size_t n, size_t piece, int nt, unsigned long long seq);
void task_retire(copy_task_t *t, _Atomic(copy_task_t *) *posted, atomic_int *active);
void chunk_copy(const job_t *job, const chunk_t *c, char *img, int gather);

/* The i-th poll of a wait for other threads: spin first, then yield (the awaited one may be preempted). */
static inline void backoff(unsigned i) {
    if (i < 4096) cpu_relax();
    else sched_yield();
}

/* emulated.c: the emulated device's streams (a worker thread each) */
int emu_enqueue_copy(lane_t *L, char *dst, const char *src, size_t n);
int emu_record(lane_t *L, emu_event_t *ev);
int emu_sync(lane_t *L, emu_event_t *ev);
emu_stream_t *emu_stream_start(engine_t *eng, int *code);
void emu_stream_stop(emu_stream_t *es);

/* driver.c: the driver seam and the driver thread */
void make_err(const engine_t *eng, int code, const char *op, err_t *e);
void dt_wake(driver_thread_t *dt);
driver_thread_t *dt_start(engine_t *eng, int64_t idle_ns, int one_stream, int *rc);
void dt_stop(driver_thread_t *dt);
int d_enqueue(lane_t *L, slot_t *slot, char *host_side, CUdeviceptr dev, size_t n, const char **op);
int d_post_record(lane_t *L, void **ev);
int d_sync(lane_t *L, slot_t *slot);
int d_slot_alloc(lane_t *L, slot_t *slot);
void d_slot_free(lane_t *L, char *ptr, void *ev);

/* lanes.c: the lanes and cooperative jobs */
#define COOP_CHUNKS 4 /* a cooperative job is cut in this many chunks (within bounds) */
void *lane_main(void *arg);
int wake_helpers(lane_t *L, int k);
/* the slot ring's operations, for file.c (lane thread only) */
int lane_reap(lane_t *L, slot_t *slot);
void lane_reap_all(lane_t *L);
void lane_recover_slots(lane_t *L);
void lane_finish_share(lane_t *L, share_t *s);
void lane_hold_wait(engine_t *eng);

/* file.c: file jobs. A chunk reads `length` bytes at file offset `start` into a slot (`need` of them must
 * arrive), or writes `length` bytes there from a slot; its `ndma` DMAs are the next ones of the job's list.
 * Both structs are four or three unsigned 64-bit words, as Python packs them. */
typedef struct file_chunk {
    unsigned long long start, length, need, ndma;
} file_chunk_t;
typedef struct file_dma {
    unsigned long long slot_off, dev, n;
} file_dma_t;
#define FILE_ERROR_CODE (-1) /* err_t.code of a file job failed on the host side (its file_job_t says how) */
enum { FILE_ERR_NONE, FILE_ERR_READ, FILE_ERR_SHORT, FILE_ERR_WRITE, FILE_ERR_NO_PROGRESS, FILE_ERR_CANCELLED };
typedef struct file_job {
    int fd, direct_fd;   /* the caller's, open until the job is done */
    atomic_int direct;   /* reads (aligned writes) through direct_fd, until the filesystem refuses */
    char *name;          /* how errors name the file */
    file_chunk_t *chunks;
    size_t nchunks;
    size_t *first; /* chunk k's first DMA */
    file_dma_t *dmas;
    size_t ndmas;
    atomic_size_t next;   /* the next chunk a lane claims */
    atomic_ullong moved;  /* payload bytes read (or written) so far */
    /* the first failure, when it was the file's (under the job's mutex; valid once failed) */
    int err_kind, err_errno;
    unsigned long long err_offset;
    size_t err_chunk;
    long long inject_chunk; /* tests: chunk whose first read (write) fails with inject_errno (through the
                             * same handling as a real one: EINVAL on O_DIRECT falls back); -1: none */
    int inject_errno;
} file_job_t;
/* A file job (chunks and DMAs copied; fd, direct_fd stay the caller's), planned like job_plan, or NULL. */
job_t *file_job_plan(const engine_t *eng, int fd, int direct_fd, int direct, const char *name,
                     const file_chunk_t *chunks, size_t nchunks, const file_dma_t *dmas, size_t ndmas, int *kind,
                     const char **why);
void file_job_free(file_job_t *fj);
/* Fail a file job on the host side (the first failure wins; a cancel of a job done is ignored): 1 when this
 * one took effect. */
int file_fail(job_t *job, int kind, int errnum, unsigned long long offset, size_t chunk);
/* A lane runs a file job's share (lane_main calls it for jobs with a file side). */
void run_file(lane_t *L, share_t *s);

/* engine.c: an engine's life. engine_start and engine_queue answer 0 or one of these. */
enum { ENGINE_NO_MEMORY = -1, ENGINE_NO_THREADS = -2, ENGINE_SETUP_FAILED = -3, ENGINE_CLOSED = -4 };
/* job_plan's failures: what kind (the message in *why, a static string) */
enum { PLAN_OK, PLAN_VALUE, PLAN_OVERFLOW, PLAN_NO_MEMORY };

/* Start an engine whose parameters are set (every other field zero): its driver thread (when asked; one
 * that cannot start leaves the lanes calling the driver themselves) and its lanes, each set up on its own
 * thread. 0 once every lane is ready; else the engine was stopped and freed: ENGINE_NO_MEMORY,
 * ENGINE_NO_THREADS, or ENGINE_SETUP_FAILED with the lane's error in *e. May block: call it without the GIL. */
int engine_start(engine_t *eng, int driver_thread, int one_stream, err_t *e);
/* A job over a host array of `ndim` axes (shape, strides in bytes, itemsize; nbytes = prod(shape) *
 * itemsize) and a device range, cut into chunks of at most chunk_bytes (0: the engine's choice): the job
 * with two references' worth of owners to come (one for the caller, one per share: see engine_queue),
 * or NULL with *kind and *why. Nothing is queued. */
job_t *job_plan(const engine_t *eng, char *host, CUdeviceptr dev, long long nbytes, int ndim, const ptrdiff_t *shape,
               const ptrdiff_t *strides, long long itemsize, long long chunk_bytes, int hand_off, int *kind,
               const char **why);
/* A job of many pieces (core/pieces.c): each piece a contiguous host range and a device range; pieces
 * that follow each other on the device share chunks (one DMA each), a piece larger than a chunk is cut.
 * The job takes `pieces` (malloc'd, npieces of them) whatever the outcome. As job_plan otherwise. */
job_t *job_plan_pieces(const engine_t *eng, piece_t *pieces, size_t npieces, long long chunk_bytes, int hand_off,
                       int *kind, const char **why);
/* Deal a planned job's shares to the lanes and wake them: 0, or ENGINE_CLOSED / ENGINE_NO_MEMORY with
 * nothing queued (the caller then drops the job: refs to 1, job_decref). */
int engine_queue(engine_t *eng, job_t *job, int hand_off);
/* The chunk a job of nbytes gets (auto_chunk: dealt to the lanes; coop_chunk: a cooperative one) */
size_t auto_chunk(const engine_t *eng, size_t nbytes);
size_t coop_chunk(const engine_t *eng, size_t nbytes);
/* an upload with at least this many chunks per lane copies them through the cache (job_streams) */
#define CACHED_CHUNKS_PER_LANE ((size_t)3)
int job_streams(const engine_t *eng, size_t nchunks, int coop);
int is_coop(const engine_t *eng, int contiguous, size_t nbytes);
/* Let every queued job run, then join the lanes and the driver thread (blocks); then engine_free. */
void engine_stop_lanes(engine_t *eng);
void engine_free(engine_t *eng);

/* Create a thread with every signal blocked: signals go to Python's threads, never to a native one (a
 * handler run on a native thread would find no interpreter state). 0, or pthread_create's error. */
static inline int start_thread(pthread_t *t, void *(*fn)(void *), void *arg) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int rc = pthread_create(t, NULL, fn, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc;
}

#endif /* FERRY_CORE_H */
