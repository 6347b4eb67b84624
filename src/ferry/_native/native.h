/*
 * native.h: what the Python-facing files of ferry._native._engine share (private to the extension).
 *
 * The extension is one module built from several sources: core/ (no Python.h: the staging engine's
 * jobs, lanes, slots, host copies, driver seam and driver thread), emulated.c (the emulated device's
 * streams), and the Python-facing files that include this header:
 *
 *   engine.c   Engine and Job: the staging engine's Python types (core/ does the work)
 *   calls.c    Calls: the driver entry points of the small-transfer path, called from C
 *   records.c  Record (a transfer's record) and Handle (the compiled base of ferry's handles)
 *   objects.c  the fields of ferry's hot objects (buffer, device array, block, health, extras, slot)
 *   lock.c     RLock: threading.RLock's semantics, takeable from C (the runtime's lock)
 *   fast.c     Fast: Completion's enqueue, wait, settle and pinned submission in C
 *   entries.c  the runtime's compiled upload_pending / download_pending (Entry)
 *   small.c    the small pageable route's compiled upload, and NumPy's array fields
 *   host.c     host copies for Python: copy_in, address_of, memcopy, Leases, the Copier
 *   dlpack.c   DLPack export and import
 *   module.c   the module: its functions, its types, its constants, its state (ferry_state)
 *
 * The rules: native threads (core/, emulated.c, the Copier's helpers) never touch a Python object and
 * never take the GIL; everything declared below is touched with the GIL held. Symbols are hidden
 * (-fvisibility=hidden): only PyInit__engine leaves the shared object.
 */
#ifndef FERRY_NATIVE_H
#define FERRY_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h> /* T_OBJECT_EX, READONLY (members) */

#include "core/core.h"

_Static_assert(sizeof(Py_ssize_t) == sizeof(ptrdiff_t), "the core's ptrdiff_t shapes are Py_ssize_t's");

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

/* -- the fields of ferry's hot objects (objects.c: their Python classes derive from these types) --------- */

typedef struct { /* ferry.PinnedHostBuffer */
    PyObject_HEAD
    PyObject *base, *block, *nbytes, *runtime, *state;
} BufferFields;

typedef struct { /* ferry.DeviceArray */
    PyObject_HEAD
    PyObject *dtype, *leases, *memory, *nbytes, *ptr, *ready, *runtime, *shape, *state;
} ArrayFields;

typedef struct { /* a pinned pool block (ferry._memory._pinned.Block) */
    PyObject_HEAD
    PyObject *capacity, *ptr;
} BlockFields;

typedef struct { /* a runtime's health (ferry._lifecycle.Health) */
    PyObject_HEAD
    PyObject *closed, *exited, *forked, *poisoned, *refusal;
} HealthFields;

typedef struct { /* a record's extras (ferry._completion.Extras) */
    PyObject_HEAD
    PyObject *cleanups, *export_stream, *finish, *handed, *job, *order_after, *progress, *ready_to_order;
} ExtrasFields;

typedef struct { /* a small-route slot (ferry._routes._small.Slot): the extras' fields, then its own */
    ExtrasFields extras;
    PyObject *address, *block, *capacity, *host, *nbytes, *own, *ptr, *record, *ring;
} SlotFields;

/* The exact classes the entries read, by set_hot_types (NULL until then) */
enum { HOT_BUFFER, HOT_ARRAY, HOT_BLOCK, HOT_HEALTH, HOT_SLOT, HOT_TYPES };
/* is_hot, no_views, is_ndarray (below): defined after the module's state */

/* The pinned memory every view of a pinned buffer is made from (objects.c: HostMemory). It exports the
 * memory through the buffer protocol and counts the exports not yet released; NumPy holds one for each
 * array made from it (through a memoryview it keeps as the array's base), and every array, slice or
 * memoryview derived from that array keeps it, so no view is alive exactly when the count is 0. */
typedef struct {
    PyObject_HEAD
    char *ptr;
    Py_ssize_t nbytes;
    atomic_long exports; /* bf_getbuffer adds one, bf_releasebuffer takes it back */
    PyObject *weakreflist;
} HostMemoryObject;


#define BUFFER(o) ((BufferFields *)(o))
#define ARRAY(o) ((ArrayFields *)(o))
#define BLOCK(o) ((BlockFields *)(o))
#define HEALTH(o) ((HealthFields *)(o))
#define SLOT(o) ((SlotFields *)(o))

PyObject *mod_set_hot_types(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *mod_leaf_pieces(PyObject *mod, PyObject *const *args, Py_ssize_t nargs); /* tree.c */
PyObject *mod_device_pieces(PyObject *mod, PyObject *const *args, Py_ssize_t nargs); /* tree.c */
PyObject *mod_slab_views(PyObject *mod, PyObject *const *args, Py_ssize_t nargs); /* tree.c */
PyObject *mod_mark_leaves(PyObject *mod, PyObject *const *args, Py_ssize_t nargs); /* tree.c */
PyObject *mod_merge_runs(PyObject *mod, PyObject *const *args, Py_ssize_t nargs); /* tree.c */
PyObject *mod_host_sizes(PyObject *mod, PyObject *const *args, Py_ssize_t nargs); /* tree.c */
PyObject *mod_flat_leaves(PyObject *mod, PyObject *const *args, Py_ssize_t nargs); /* tree.c */
PyObject *mod_device_specs(PyObject *mod, PyObject *arg); /* tree.c */

/* -- NumPy's array struct ----------------------------------------------------------------------------
 * PyArrayObject_fields of numpy/ndarraytypes.h, declared here as the driver types are in core/core.h:
 * NumPy's ABI, which every extension compiled against NumPy reads directly (PyArray_DATA, PyArray_FLAGS
 * and the rest are macros over these fields), unchanged since NumPy 1.7 and kept by NumPy 2. Read only
 * for an exact numpy.ndarray, and only once ferry._native.array_layout() found NumPy's own answers for a
 * few arrays agree with these fields (the offsets it checks come from here: array_fields()). */
typedef struct {
    PyObject_HEAD
    char *data;
    int nd;
    Py_ssize_t *dimensions;
    Py_ssize_t *strides;
    PyObject *base;
    PyObject *descr;
    int flags;
    PyObject *weakreflist;
} NumpyArray;

#define NPY_C_CONTIGUOUS_FLAG 0x0001
#define NPY_WRITEABLE_FLAG 0x0400

/* -- the module's state (module.c: its essay says what lives here and why the rest is process-wide) -- */
typedef struct ferry_state {
    allocfunc record_alloc; /* Record's tp_alloc */
    /* from here on: strong references only (module.c visits and releases them as one array) */
    PyObject *DriverError; /* DriverError(code, text) */
    PyTypeObject *EngineType, *JobType, *CallsType, *RLockType, *FastType, *EntryType, *LeasesType, *CopierType,
        *HandleType, *RecordType, *HostMemoryType;
    PyTypeObject *BufferFieldsType, *ArrayFieldsType, *BlockFieldsType, *HealthFieldsType, *ExtrasFieldsType,
        *SlotFieldsType;
    PyObject *sys_is_finalizing; /* sys.is_finalizing */
    PyObject *S_wait, *S_detach;
    PyObject *S_count, *S_deferred, *S_doomed, *S_refusal, *S_event_wait, *S_own_event, *S_state, *S_leases;
    PyObject *S_htod_record, *S_dtoh_record;
    PyObject *S_give, *S_free, *S_host_copied;
    PyObject *S_transfers;
    PyObject *S_flags, *S_writeable, *S_setflags, *S_base, *S_write;
    PyObject *S_segments, *S_records, *S_last, *S_copy, *S_seen, *S_dsts, *S_srcs, *S_sizes, *S_done, *S_users,
        *S_event;
    /* set from Python after the import; every reader tolerates NULL (m_clear releases these) */
    PyObject *hot_types[HOT_TYPES];  /* set_hot_types: PinnedHostBuffer, DeviceArray, Block, Health, Slot */
    PyObject *ndarray_type;          /* set_array_type: numpy.ndarray, once array_layout() verified NumpyArray */
    PyObject *handle_waited_error;   /* set_handle_errors: FerryError */
} ferry_state;

#define FERRY_STATE_REFS ((sizeof(ferry_state) - offsetof(ferry_state, DriverError)) / sizeof(PyObject *))
static inline PyObject **state_refs(ferry_state *st) { return (PyObject **)&st->DriverError; }
#define FERRY_STATE_KEPT ((size_t)(offsetof(ferry_state, hot_types) - offsetof(ferry_state, DriverError)) / sizeof(PyObject *))

extern struct PyModuleDef ferry_module_def; /* module.c */

/* The state of a module function's module (mod is ferry's). */
static inline ferry_state *mod_state(PyObject *mod) { return (ferry_state *)PyModule_GetState(mod); }

/* The state of the module that made tp or one of its bases (a Python subclass of Handle or of a field type
 * has no module; its compiled base has): NULL with an exception when none is found (a type torn down by
 * the collector). Walks tp_base: the limited API of 3.11 has no PyType_GetModuleByDef. */
ferry_state *state_of_type(PyTypeObject *tp);

/* the types' specs (module.c makes the types) */
extern PyType_Spec Engine_spec; /* engine.c */
extern PyType_Spec Job_spec; /* engine.c */
extern PyType_Spec Calls_spec; /* calls.c */
extern PyType_Spec BufferFields_spec, ArrayFields_spec, BlockFields_spec, HealthFields_spec, ExtrasFields_spec,
    SlotFields_spec, HostMemory_spec; /* objects.c */
extern PyType_Spec Record_spec; /* records.c */
extern PyType_Spec Handle_spec; /* records.c */
extern PyType_Spec RLock_spec; /* lock.c */
extern PyType_Spec Fast_spec; /* fast.c */
extern PyType_Spec Entry_spec; /* entries.c */
extern PyType_Spec Leases_spec; /* host.c */
extern PyType_Spec Copier_spec; /* host.c */


/* Whether obj's exact type is the hot class `which` of st (then its fields are read as that struct's) */
static inline int is_hot(ferry_state *st, PyObject *obj, int which) {
    return st->hot_types[which] && (PyObject *)Py_TYPE(obj) == st->hot_types[which];
}

/* Whether base, a pinned buffer's `_base`, is a HostMemory with no export alive: the count is read at its
 * offsetof, atomically (exports are taken and released wherever a view is made or dropped). */
static inline int no_views(ferry_state *st, PyObject *base) {
    return Py_TYPE(base) == st->HostMemoryType &&
           atomic_load_explicit(&((HostMemoryObject *)base)->exports, memory_order_acquire) == 0;
}

typedef CUresult (*fn_memcpy_batch_13000)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, void *, size_t *, size_t,
                                          CUstream);
typedef CUresult (*fn_memcpy_batch_12080)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, void *, size_t *, size_t,
                                          size_t *, CUstream);

#define CU_MEMCPY_SRC_ACCESS_ORDER_STREAM 1
#define MEMCPY_ATTR_BYTES 64   /* CUmemcpyAttributes is 24-28 bytes in CUDA 12.8-13.x: zeroed room to spare */
#define BATCH_FREE_GIL 32      /* batches of at least this many copies release the GIL in the driver */
#define WAIT_SLICE_NS 2000000LL /* event_wait checks Python signals at least this often */

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

typedef struct {
    PyObject_HEAD
    PyObject *seq, *event, *stream, *moved, *leased, *result, *nbytes;
    PyObject *done, *error, *extra, *settled, *claimed, *waiters, *spun, *signal, *batch, *shared, *napped;
} RecordObject;

#define RECORD_FIELDS 18

static inline PyObject **record_fields(RecordObject *self) { return &self->seq; }

static inline PyObject *record_make(ferry_state *st, PyObject *const *args) {
    RecordObject *self = (RecordObject *)st->record_alloc(st->RecordType, 0);
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
    unsigned gen;        /* fork_generation when it was taken: a holder of an older one is in another process */
    PyObject *weakreflist;
} RLockObject;

int rlock_sleep_ready(RLockObject *self);

/* How many forks this process descends from (lock.c: a pthread_atfork child handler counts them). A lock
 * taken in an older generation was taken in a parent process: its holder does not exist here. */
extern atomic_uint fork_generation;

/* A lock whose holder is a thread of the parent process (taken before a fork, by a thread that did not
 * fork): it counts as free here. Only the contended path asks. */
static inline int rlock_take_dead(RLockObject *self) {
    if (!self->count || self->gen == atomic_load_explicit(&fork_generation, memory_order_relaxed)) return 0;
    self->count = 0;
    self->owner = 0;
    atomic_store(&self->held, 0);
    return 1;
}

static inline int rlock_try(RLockObject *self) {
    int expected = 0;
    return atomic_compare_exchange_strong(&self->held, &expected, 1);
}

/* Take it (GIL held): 1 taken, 0 not within timeout_us (-1: no bound, 0: do not wait), -1 an exception
 * (a signal handler raised while waiting, or the count would overflow). */
static inline int rlock_take(RLockObject *self, long long timeout_us) {
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
    if (!got && rlock_take_dead(self)) got = rlock_try(self); /* held in a parent process, never here */
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
    self->gen = atomic_load_explicit(&fork_generation, memory_order_relaxed);
    return 1;
}

/* Give it back once (GIL held): 0, or -1 with RuntimeError when this thread does not hold it. */
static inline int rlock_give(RLockObject *self) {
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
static inline PyObject *rlock_give_result(RLockObject *lock, PyObject *result) {
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
    PyObject *small_alloc; /* SmallRoute.new_destination: a fresh upload's destination (or None) */
    PyObject *module; /* the module that made Fast: held (and not cleared) until dealloc, so st stays alive */
    ferry_state *st;  /* its state */
    double spin_base, spin_per_byte, spin_cap;
    long long seq, submitted, completed;
    Py_ssize_t segment_copies; /* Completion.segment_copies: a batch segment this full is flushed (Python) */
} FastObject;

/* f(*args): the limited API of 3.11 has no PyObject_Vectorcall; CallFunctionObjArgs passes a short list on
 * the stack (no tuple) to the callee's vectorcall. */
static inline PyObject *call_args(PyObject *f, PyObject *const *a, Py_ssize_t n) {
    switch (n) {
    case 0: return PyObject_CallNoArgs(f);
    case 1: return PyObject_CallFunctionObjArgs(f, a[0], NULL);
    case 2: return PyObject_CallFunctionObjArgs(f, a[0], a[1], NULL);
    case 5: return PyObject_CallFunctionObjArgs(f, a[0], a[1], a[2], a[3], a[4], NULL);
    case 8: return PyObject_CallFunctionObjArgs(f, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], NULL);
    default: PyErr_SetString(PyExc_SystemError, "call_args: unsupported count"); return NULL;
    }
}

static inline void set_field(PyObject **field, PyObject *value) {
    PyObject *old = *field;
    Py_INCREF(value);
    *field = value;
    Py_XDECREF(old);
}

typedef struct {
    PyObject_HEAD
    PyObject *port, *record, *waited, *claimed, *future;
} HandleObject;



/* The object in obj's slot (borrowed; NULL when unset): obj's exact type is the layout's. */

/* A garbage-collected object whose fields are two object references after its header (Entry, Leases): their
 * traverse, clear and dealloc */
typedef struct {
    PyObject_HEAD
    PyObject *first, *second;
} PairObject;


/* Whether obj is exactly a numpy.ndarray (a subclass may keep its data elsewhere: no field is read). */
static inline int is_ndarray(ferry_state *st, PyObject *obj) {
    return st->ndarray_type && (PyObject *)Py_TYPE(obj) == st->ndarray_type;
}

/* TypeError for a helper handed something that is not exactly a numpy.ndarray; NULL */
static inline PyObject *not_ndarray(const char *helper, PyObject *obj) {
    PyErr_Format(PyExc_TypeError, "%s needs a numpy.ndarray, not %R", helper, (PyObject *)Py_TYPE(obj));
    return NULL;
}

static inline char *array_data(PyObject *a) { return ((NumpyArray *)a)->data; }

static inline int *array_flags(PyObject *a) { return &((NumpyArray *)a)->flags; }

/* An address or handle: a Python int in [0, 2**64) (None for an absent event when none_ok). */
static inline int int_arg(PyObject *obj, unsigned long long *out, int none_ok) {
    if (none_ok && obj == Py_None) {
        *out = 0;
        return 0;
    }
    *out = as_u64(obj);
    return (*out == (unsigned long long)-1 && PyErr_Occurred()) ? -1 : 0;
}

static inline int nargs_is(Py_ssize_t nargs, Py_ssize_t want, const char *name) {
    if (nargs == want) return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, nargs);
    return -1;
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

/* -- functions shared between files (defined in the file named) ------------------------------------ */

/* calls.c */
PyObject *calls_failed(CallsObject *self, const char *op, int code, int stage, PyObject *const *args, Py_ssize_t nargs);
CUresult calls_copy_record(CallsObject *self, int upload, unsigned long long dst, unsigned long long src, size_t n, CUstream stream, CUevent event, int *stage);
PyObject *Calls_htod_record(PyObject *obj, PyObject *const *args, Py_ssize_t nargs);
PyObject *Calls_dtoh_record(PyObject *obj, PyObject *const *args, Py_ssize_t nargs);
PyObject *Calls_event_wait(PyObject *obj, PyObject *const *args, Py_ssize_t nargs);

/* records.c */
PyObject *mod_new_record(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *mod_set_handle_errors(PyObject *mod, PyObject *arg);

/* fast.c */
PyObject *Fast_enqueue(PyObject *obj, PyObject *const *args, Py_ssize_t nargs);
int fast_settle_states(FastObject *self, RecordObject *r);
PyObject *Fast_wait(PyObject *obj, PyObject *const *args, Py_ssize_t nargs);
PyObject *Fast_pinned(PyObject *obj, PyObject *const *args, Py_ssize_t nargs);

/* entries.c */
int set_state_slot(ferry_state *st, PyObject *obj, PyObject *state);
int is_small_slot(ferry_state *st, PyObject *extra);
int fast_settle_slot(FastObject *self, RecordObject *r);
PyObject *Fast_bind_entries(PyObject *obj, PyObject *const *args, Py_ssize_t nargs);
PyObject *fast_entry_slow(FastObject *self, PyObject *slow, PyObject *runtime, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
int Pair_traverse(PyObject *obj, visitproc visit, void *arg);
int Pair_clear(PyObject *obj);
void Pair_dealloc(PyObject *obj);
PyObject *Fast_entries(PyObject *obj, PyObject *runtime);

/* small.c */
int small_view(PyObject *array, Py_buffer *view, unsigned long long capacity, int writable);
PyObject *mod_set_array_type(PyObject *mod, PyObject *arg);
PyObject *mod_array_fields(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(ignored));
PyObject *Fast_bind_small(PyObject *obj, PyObject *const *args, Py_ssize_t nargs);
PyObject *fast_small_upload(FastObject *self, PyObject *runtime, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *mod_clear_writeable(PyObject *mod, PyObject *array);
PyObject *mod_set_writeable(PyObject *mod, PyObject *array);

/* host.c */
PyObject *Leases_give(PyObject *obj, PyObject *array);
PyObject *mod_copy_in(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *mod_address_of(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *mod_data_of(PyObject *mod, PyObject *array);
PyObject *mod_memcopy(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs);

/* dlpack.c */
extern atomic_int dlpack_exiting;
PyObject *dlpack_at_exit(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(ignored));
void dlpack_capsule_destructor(PyObject *capsule);
PyObject *mod_dlpack_capsule_destructor(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(ignored));
void dlpack_deleter(void *managed);
PyObject *mod_dlpack_deleter(PyObject *Py_UNUSED(mod), PyObject *release);
PyObject *mod_dlpack_import(PyObject *Py_UNUSED(mod), PyObject *capsule);
PyObject *mod_dlpack_exports_live(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(ignored));
PyObject *mod_dlpack_export(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs);
PyObject *mod_dlpack_release(PyObject *Py_UNUSED(mod), PyObject *arg);

/* lock.c */
int lock_count_forks(void);

#endif /* FERRY_NATIVE_H */
