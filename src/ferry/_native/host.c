/*
 * host.c: host copies for Python: the lease table of read-only flags (Leases), copy_in, address_of,
 * data_of, memcopy, and the Copier (one host copy shared with helper threads).
 */
#include "native.h"

/*
 * Leases(ndarray_type): HostLeases' table (ferry/_routes/_base.py) in C. The caller's NumPy arrays are
 * flagged read-only while transfers use them, counted per array, the flag restored by the last one.
 * The leases live in a hash table of the arrays' addresses (each entry a strong reference, a count and the
 * flag to restore); `table` answers a snapshot dict, address -> [array, count, writeable], as the Python
 * class keeps it. take() and give() cost tens of nanoseconds (no Python object made per lease), and
 * take_many() / give_many() do a tree's leaves in one call. An exact ndarray (ndarray_type) has its flag
 * flipped at the verified offset (set_array_layout); any other array goes through array.flags and
 * array.setflags, as in Python (which may run Python code: the table is looked up again afterwards).
 */

/* The table: open addressing on the array's address, linear probing; a free slot has no array, a removed one
 * the TOMB marker. Each used slot holds a strong reference to its array. */
typedef struct {
    PyObject *array;
    Py_ssize_t count;
    int writeable;
} lease_t;

#define TOMB ((PyObject *)1)

typedef struct {
    PyObject_HEAD
    PyObject *ndarray;
    lease_t *slots;
    size_t cap, used, filled; /* cap a power of two (or 0); used: live entries; filled: live and removed */
} LeasesObject;

static size_t lease_hash(PyObject *array) {
    uint64_t x = (uint64_t)(uintptr_t)array >> 4;
    x *= 0x9E3779B97F4A7C15ull;
    return (size_t)(x >> 20);
}

/* The slot of `array`, or NULL when it holds no lease. */
static lease_t *lease_find(LeasesObject *self, PyObject *array) {
    if (!self->cap) return NULL;
    size_t mask = self->cap - 1;
    for (size_t i = lease_hash(array) & mask;; i = (i + 1) & mask) {
        lease_t *e = &self->slots[i];
        if (e->array == array) return e;
        if (!e->array) return NULL;
    }
}

/* Room for one more entry (grown, or cleaned of removed slots, at two thirds): 0, or -1 with MemoryError. */
static int lease_room(LeasesObject *self) {
    if ((self->filled + 1) * 3 < self->cap * 2) return 0;
    size_t cap = 64; /* removed slots are dropped: the live entries alone decide, at most a third full */
    while (cap < 3 * (self->used + 1)) cap *= 2;
    lease_t *slots = calloc(cap, sizeof(lease_t));
    if (!slots) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t k = 0; k < self->cap; k++) {
        lease_t *e = &self->slots[k];
        if (!e->array || e->array == TOMB) continue;
        size_t i = lease_hash(e->array) & (cap - 1);
        while (slots[i].array) i = (i + 1) & (cap - 1);
        slots[i] = *e;
    }
    free(self->slots);
    self->slots = slots;
    self->cap = cap;
    self->filled = self->used;
    return 0;
}

/* A new entry for `array` (not in the table; lease_room called): its reference is taken. */
static void lease_insert(LeasesObject *self, PyObject *array, int writeable) {
    size_t mask = self->cap - 1;
    size_t i = lease_hash(array) & mask;
    while (self->slots[i].array && self->slots[i].array != TOMB) i = (i + 1) & mask;
    if (!self->slots[i].array) self->filled++;
    Py_INCREF(array);
    self->slots[i].array = array;
    self->slots[i].count = 1;
    self->slots[i].writeable = writeable;
    self->used++;
}

static PyObject *Leases_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ndarray_type", NULL};
    PyObject *ndarray;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!", kwlist, &PyType_Type, &ndarray)) return NULL;
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    LeasesObject *self = (LeasesObject *)alloc(type, 0);
    if (!self) return NULL;
    Py_INCREF(ndarray);
    self->ndarray = ndarray;
    self->slots = NULL;
    self->cap = self->used = self->filled = 0;
    return (PyObject *)self;
}

static int Leases_traverse(PyObject *obj, visitproc visit, void *arg) {
    LeasesObject *self = (LeasesObject *)obj;
    Py_VISIT(self->ndarray);
    for (size_t k = 0; k < self->cap; k++)
        if (self->slots[k].array && self->slots[k].array != TOMB) Py_VISIT(self->slots[k].array);
    Py_VISIT((PyObject *)Py_TYPE(obj));
    return 0;
}

static int Leases_clear(PyObject *obj) {
    LeasesObject *self = (LeasesObject *)obj;
    lease_t *slots = self->slots;
    size_t cap = self->cap;
    self->slots = NULL;
    self->cap = self->used = self->filled = 0;
    for (size_t k = 0; k < cap; k++)
        if (slots[k].array && slots[k].array != TOMB) Py_DECREF(slots[k].array);
    free(slots);
    Py_CLEAR(self->ndarray);
    return 0;
}

static void Leases_dealloc(PyObject *obj) {
    PyTypeObject *tp = Py_TYPE(obj);
    PyObject_GC_UnTrack(obj);
    Leases_clear(obj);
    freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    f(obj);
    Py_DECREF((PyObject *)tp);
}

/* array.setflags(write=value): 0, or -1 with the error set. */
static int leases_setflags(ferry_state *st, PyObject *array, int value) {
    PyObject *method = PyObject_GetAttr(array, st->S_setflags);
    if (!method) return -1;
    PyObject *empty = PyTuple_New(0), *kw = PyDict_New();
    PyObject *r = NULL;
    if (empty && kw && PyDict_SetItem(kw, st->S_write, value ? Py_True : Py_False) == 0) r = PyObject_Call(method, empty, kw);
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
    lease_t *e = lease_find(self, array);
    if (e) {
        e->count++;
        Py_RETURN_NONE;
    }
    if (lease_room(self)) return NULL; /* nothing changed */
    ferry_state *st = (ferry_state *)PyType_GetModuleState(Py_TYPE(obj)); /* Leases' module */
    if (!st) return NULL;
    int was;
    if ((PyObject *)Py_TYPE(array) == self->ndarray && is_ndarray(st, array)) {
        int *flags = array_flags(array);
        was = (*flags & NPY_WRITEABLE_FLAG) != 0;
        *flags &= ~NPY_WRITEABLE_FLAG;
    } else {
        Py_INCREF(array);
        if (known == Py_None) {
            PyObject *flags = PyObject_GetAttr(array, st->S_flags);
            PyObject *w = flags ? PyObject_GetAttr(flags, st->S_writeable) : NULL;
            Py_XDECREF(flags);
            was = w ? PyObject_IsTrue(w) : -1;
            Py_XDECREF(w);
        } else {
            was = PyObject_IsTrue(known);
        }
        if (was < 0 || (was && leases_setflags(st, array, 0))) {
            Py_DECREF(array);
            return NULL;
        }
        /* Python ran: another lease of it may have been taken meanwhile, the table may have moved */
        e = lease_find(self, array);
        if (e) {
            e->count++;
            Py_DECREF(array);
            Py_RETURN_NONE;
        }
        if (lease_room(self)) {
            Py_DECREF(array);
            return NULL; /* the flag stays cleared: as in Python, where the table's insert cannot fail */
        }
        lease_insert(self, array, was);
        Py_DECREF(array);
        Py_RETURN_NONE;
    }
    lease_insert(self, array, was);
    Py_RETURN_NONE;
}

/* give(array): end one flight's lease of `array`; the last one restores its flag. */
PyObject *Leases_give(PyObject *obj, PyObject *array) {
    LeasesObject *self = (LeasesObject *)obj;
    lease_t *e = lease_find(self, array);
    if (!e) Py_RETURN_NONE;
    if (--e->count > 0) Py_RETURN_NONE;
    int was = e->writeable;
    e->array = TOMB; /* its reference is ours now */
    self->used--;
    if (!was) {
        Py_DECREF(array);
        Py_RETURN_NONE;
    }
    ferry_state *st = (ferry_state *)PyType_GetModuleState(Py_TYPE(obj)); /* Leases' module */
    if (!st) {
        Py_DECREF(array);
        return NULL;
    }
    if ((PyObject *)Py_TYPE(array) == self->ndarray && is_ndarray(st, array) && !((const NumpyArray *)array)->base) {
        *array_flags(array) |= NPY_WRITEABLE_FLAG; /* it owns its data (its base is None): NumPy would allow it */
        Py_DECREF(array);
        Py_RETURN_NONE;
    }
    int rc = leases_setflags(st, array, 1);
    Py_DECREF(array);
    if (rc) {
        if (!PyErr_ExceptionMatches(PyExc_ValueError)) return NULL;
        PyErr_Clear(); /* its base became read-only meanwhile: it stays so */
    }
    Py_RETURN_NONE;
}

/* table: a dict of the leases now, address -> [array, count, writeable] (a snapshot). */
static PyObject *Leases_get_table(PyObject *obj, void *Py_UNUSED(closure)) {
    LeasesObject *self = (LeasesObject *)obj;
    PyObject *out = PyDict_New();
    if (!out) return NULL;
    for (size_t k = 0; k < self->cap; k++) {
        lease_t *e = &self->slots[k];
        if (!e->array || e->array == TOMB) continue;
        PyObject *key = PyLong_FromVoidPtr(e->array);
        PyObject *entry = key ? Py_BuildValue("[OnO]", e->array, e->count, e->writeable ? Py_True : Py_False) : NULL;
        int rc = entry ? PyDict_SetItem(out, key, entry) : -1;
        Py_XDECREF(key);
        Py_XDECREF(entry);
        if (rc) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

/* The length of a list or a tuple of arrays, or -1 with TypeError. */
static Py_ssize_t leases_count(PyObject *arrays, const char *what) {
    if (PyList_Check(arrays)) return PyList_Size(arrays);
    if (PyTuple_Check(arrays)) return PyTuple_Size(arrays);
    PyErr_Format(PyExc_TypeError, "%s takes a list or a tuple of arrays", what);
    return -1;
}

/* take_many(arrays): take() for each array of a list or tuple, in order, in one call (a tree's leaves). On an
 * error the leases this call took are given back, so it takes all of them or none. */
static PyObject *Leases_take_many(PyObject *obj, PyObject *arrays) {
    Py_ssize_t n = leases_count(arrays, "take_many");
    if (n < 0) return NULL;
    /* a snapshot: a take may run Python code (array.flags, setflags) that changes a list under us; the
     * tuple keeps every item alive, and the rollback gives back exactly the items taken */
    PyObject *items = PyList_Check(arrays) ? PyList_AsTuple(arrays) : (Py_INCREF(arrays), arrays);
    if (!items) return NULL;
    n = PyTuple_Size(items);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GetItem(items, i);
        PyObject *r = item ? Leases_take(obj, &item, 1) : NULL;
        if (!r) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            for (Py_ssize_t k = i - 1; k >= 0; k--) {
                PyObject *g = Leases_give(obj, PyTuple_GetItem(items, k));
                if (g)
                    Py_DECREF(g);
                else
                    PyErr_Clear();
            }
            PyErr_Restore(type, value, tb);
            Py_DECREF(items);
            return NULL;
        }
        Py_DECREF(r);
    }
    Py_DECREF(items);
    Py_RETURN_NONE;
}

/* give_many(arrays): give() for each array of a list or tuple, in one call. Every array is given back even when
 * one restore fails; the first error is raised once all of them were. */
static PyObject *Leases_give_many(PyObject *obj, PyObject *arrays) {
    Py_ssize_t n = leases_count(arrays, "give_many");
    if (n < 0) return NULL;
    PyObject *items = PyList_Check(arrays) ? PyList_AsTuple(arrays) : (Py_INCREF(arrays), arrays); /* a snapshot */
    if (!items) return NULL;
    n = PyTuple_Size(items);
    PyObject *type = NULL, *value = NULL, *tb = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GetItem(items, i);
        PyObject *r = item ? Leases_give(obj, item) : NULL;
        if (r)
            Py_DECREF(r);
        else if (!type)
            PyErr_Fetch(&type, &value, &tb);
        else
            PyErr_Clear();
    }
    Py_DECREF(items);
    if (type) {
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef Leases_methods[] = {
    {"take", (PyCFunction)(void (*)(void))Leases_take, METH_FASTCALL,
     "take(array, writeable=None): flag array read-only for one flight (counted)"},
    {"give", Leases_give, METH_O, "give(array): end one flight's lease; the last one restores the flag"},
    {"take_many", Leases_take_many, METH_O, "take_many(arrays): take() each array of a list or tuple (all or none)"},
    {"give_many", Leases_give_many, METH_O, "give_many(arrays): give() each array of a list or tuple"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Leases_getset[] = {
    {"table", Leases_get_table, NULL, "address -> [array, count, writeable] of the arrays leased now (a snapshot)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Leases_slots[] = {
    {Py_tp_new, Leases_new},
    {Py_tp_dealloc, Leases_dealloc},
    {Py_tp_traverse, Leases_traverse},
    {Py_tp_clear, Leases_clear},
    {Py_tp_methods, Leases_methods},
    {Py_tp_getset, Leases_getset},
    {Py_tp_doc, "Leases(ndarray_type): HostLeases' table of read-only flags in flight, in C"},
    {0, NULL},
};

PyType_Spec Leases_spec = {
    "ferry._native._engine.Leases",
    sizeof(LeasesObject),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    Leases_slots,
};

/* copy_in(dst, capacity, array[, nbytes]) -> bytes copied, or -1 (not a C-contiguous buffer, or too large).
 * nbytes >= 0: the caller vouches that array is a numpy.ndarray of that size (the layout path). */
PyObject *mod_copy_in(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long dst, capacity;
    if ((nargs != 3 && nargs_is(nargs, 4, "copy_in")) || int_arg(args[0], &dst, 0) || int_arg(args[1], &capacity, 0))
        return NULL;
    if (nargs == 4 && is_ndarray(mod_state(mod), args[2])) {
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
PyObject *mod_address_of(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long capacity;
    if ((nargs != 2 && nargs_is(nargs, 3, "address_of")) || int_arg(args[1], &capacity, 0)) return NULL;
    if (nargs == 3 && is_ndarray(mod_state(mod), args[0])) {
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
PyObject *mod_data_of(PyObject *mod, PyObject *array) {
    if (!is_ndarray(mod_state(mod), array)) return not_ndarray("data_of", array);
    return PyLong_FromVoidPtr(array_data(array));
}

/* memcopy(dst, src, nbytes): memcpy between two host addresses (the GIL kept: small copies). */
PyObject *mod_memcopy(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
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
    int n = 0; /* helpers block every signal (start_thread): signals go to Python's threads */
    while (n < c->helpers && !start_thread(&c->threads[n], copier_main, c)) n++;
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

PyType_Spec Copier_spec = {
    "ferry._native._engine.Copier",
    sizeof(CopierObject),
    0,
    Py_TPFLAGS_DEFAULT,
    Copier_slots,
};

