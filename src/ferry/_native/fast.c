/*
 * fast.c: Fast, Completion's enqueue, wait, settle and pinned submission in C.
 */
#include "native.h"

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
 *   upload here (entries.c, small.c). They check the Python methods' common case by reading the
 *   arguments' fields (objects.c: compiled field types, read at offsetof) and NumPy's array fields
 *   (native.h: NumpyArray), under the lock taken in C, then submit as pinned / SmallRoute.upload do;
 *   anything else calls the Python method.
 * - settle: a plain record, a batched one and a small-route slot's (fast_settle_slot: the copy-out, the
 *   lease, the slot back to its ring) are settled in C; any other extras go to Completion.settle.
 *
 * The runtime lock is taken with rlock_take / rlock_give where it is this module's RLock (the default
 * where the extension loads, ferry._native.runtime_lock), else through its bound methods.
 * The counters seq, submitted and completed live here (Completion.counts is this object).
 */




#define FAST_OBJECTS 41
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
    if (!(self->module = PyType_GetModule(type))) { /* Fast cannot be subclassed: type is its module's Fast */
        Py_DECREF(self);
        return NULL;
    }
    Py_INCREF(self->module);
    self->st = (ferry_state *)PyModule_GetState(self->module);
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
    if (Py_TYPE(lock) == self->st->RLockType) self->rlock = lock; /* the reference from fast_attr */
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
    Py_VISIT(((FastObject *)obj)->module);
    Py_VISIT((PyObject *)Py_TYPE(obj));
    return 0;
}

/* The module stays: self->st is read until the dealloc. */
static int Fast_clear(PyObject *obj) {
    PyObject **f = fast_objects((FastObject *)obj);
    for (int i = 0; i < FAST_OBJECTS; i++) Py_CLEAR(f[i]);
    return 0;
}

static void Fast_dealloc(PyObject *obj) {
    PyTypeObject *tp = Py_TYPE(obj);
    PyObject_GC_UnTrack(obj);
    Fast_clear(obj);
    PyObject *module = ((FastObject *)obj)->module;
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(obj);
    Py_DECREF(tp);
    Py_XDECREF(module);
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
    int t = attr_true(self->retiring, self->st->S_count);
    if (t) return t;
    Py_ssize_t n = PyObject_Size(self->incoming);
    if (n) return n < 0 ? -1 : 1;
    if ((t = attr_true(self->memory, self->st->S_deferred))) return t;
    return attr_true(self->pool, self->st->S_doomed);
}

/* Whether the runtime refuses calls (health.refusal is not None): 1, 0, or -1. */
static int fast_refused(FastObject *self) {
    PyObject *v = PyObject_GetAttr(self->health, self->st->S_refusal);
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
    if (!(record = record_make(self->st, fields))) goto out;
    if (!(segments = PyObject_GetAttr(batch, self->st->S_segments)) || !PyDict_Check(segments)) goto out;
    if (!(key = PyLong_FromVoidPtr(stream))) goto out; /* id(stream) */
    segment = PyDict_GetItem(segments, key);
    if (!segment) goto out;
    Py_INCREF(segment); /* held to the end, whatever the calls below run */
    if (!(records = PyObject_GetAttr(segment, self->st->S_records)) || !PyList_Check(records) ||
        PyList_Size(records) >= self->segment_copies)
        goto out;
    int copies = PyObject_IsTrue(nbytes);
    if (copies < 0) goto out;
    if (copies) {
        if (!(run = PyObject_GetAttr(segment, self->st->S_last)) || run == Py_None) goto out;
        if (!(run_copy = PyObject_GetAttr(run, self->st->S_copy))) goto out;
        int same = run_copy == copy;
        if (!same && (same = PyObject_RichCompareBool(run_copy, copy, Py_EQ)) < 0) goto out;
        if (!same) goto out;
        if (!(seen = PyObject_GetAttr(run, self->st->S_seen)) || !PyAnySet_Check(seen)) goto out;
        int repeated = PySet_Contains(seen, dst);
        if (repeated) goto out; /* a destination twice in a run (or an error): Python starts a new run */
        if (!(dsts = PyObject_GetAttr(run, self->st->S_dsts)) || !(srcs = PyObject_GetAttr(run, self->st->S_srcs)) ||
            !(sizes = PyObject_GetAttr(run, self->st->S_sizes)) || !PyList_Check(dsts) || !PyList_Check(srcs) ||
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
    } else if (Py_TYPE(record) == self->st->RecordType) {
        RecordObject *r = (RecordObject *)record;
        if (r->event != Py_None) fast_prove_untracked(self, r->stream, r->event, 0);
    }
    Py_DECREF(record);
    return NULL;
}

static PyObject *fast_copy_first(FastObject *self, CallsObject *calls, int cu_upload, PyObject *const *e, int upload,
                                 PyObject *host, PyObject *device, PyObject *const *tuples);

PyObject *Fast_enqueue(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
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
    PyObject *record = record_make(self->st, fields);
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
    PyObject *fn = PyObject_GetAttr(self->backend, self->st->S_event_wait);
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
    PyObject *users = PyObject_GetAttr(shared, self->st->S_users);
    long k = users ? PyLong_AsLong(users) : -1;
    Py_XDECREF(users);
    int rc = -1;
    if (k == -1 && PyErr_Occurred()) goto out;
    PyObject *left = PyLong_FromLong(k - 1);
    if (!left) goto out;
    rc = PyObject_SetAttr(shared, self->st->S_users, left);
    Py_DECREF(left);
    if (rc) goto out;
    if (k - 1 == 0) {
        PyObject *event = PyObject_GetAttr(shared, self->st->S_event);
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


/* The objects of a settled record handed back: moved ones owned, leased ones one lease fewer. */
int fast_settle_states(FastObject *self, RecordObject *r) {
    Py_ssize_t n = PyTuple_Size(r->moved);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *obj = PyTuple_GetItem(r->moved, i);
        if (!set_state_slot(self->st, obj, self->owned) && PyObject_SetAttr(obj, self->st->S_state, self->owned)) return -1;
    }
    n = PyTuple_Size(r->leased);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *array = PyTuple_GetItem(r->leased, i);
        PyObject *leases = PyObject_GetAttr(array, self->st->S_leases);
        if (!leases) return -1;
        long k = PyLong_AsLong(leases);
        Py_DECREF(leases);
        if (k == -1 && PyErr_Occurred()) return -1;
        PyObject *v = PyLong_FromLong(k - 1);
        if (!v) return -1;
        int rc = PyObject_SetAttr(array, self->st->S_leases, v);
        Py_DECREF(v);
        if (rc) return -1;
    }
    self->completed++;
    return 0;
}

static PyObject *fast_claim(FastObject *self, RecordObject *r);

/* wait(record, timeout=None) -> the record's result: see the essay above. */
PyObject *Fast_wait(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
    FastObject *self = (FastObject *)obj;
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "wait takes 1 or 2 arguments (%zd given)", nargs);
        return NULL;
    }
    if ((nargs == 2 && args[1] != Py_None) || Py_TYPE(args[0]) != self->st->RecordType)
        return call_args(self->slow_wait, args, nargs);
    RecordObject *r = (RecordObject *)args[0];
    if (r->shared != Py_None && r->batch == Py_None && r->extra == Py_None && r->error == Py_None &&
        r->done == Py_False) {
        /* a batched record whose shared event a batch-mate proved: settle and claim it here */
        int proved = attr_true(r->shared, self->st->S_done);
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
        int own = attr_true(r->extra, self->st->S_own_event);
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
        } else if (ok && r->shared == Py_None && is_small_slot(self->st, r->extra)) {
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
                "enqueue and wait in C (see fast.c)."},
    {0, NULL},
};

PyType_Spec Fast_spec = {
    "ferry._native._engine.Fast",
    sizeof(FastObject),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    Fast_slots,
};

/*
 * Fast_pinned's common case on CUDA (the backend's copy is Calls' compiled one, no batch open, no
 * maintenance due, a pooled event): the copy and its event record go to the driver before the record
 * and its tuples are made, so the copy starts sooner by the time those allocations take (the 16 B
 * round trip's critical path; the Python twin, Completion.enqueue, makes the record first; on the
 * H200 the gain stayed inside the hosts' drift). Garbage collection is off from the copy until the
 * record is in `live`: an allocation in between cannot run a finalizer (a dropped handle's, a
 * runtime's) that would find the copy untracked. Returns the record (its event taken from the pool, the copy counted as submitted), or
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
/* Garbage collection off around a window (GIL held), nesting: windows of several threads may overlap (a
 * callback inside one can release the GIL), and collection comes back on only when the last one closes,
 * and only if it was on when the first one opened. gc_hold's result goes to the matching gc_release. */
static int gc_holds, gc_was_on;

static int gc_hold(void) {
    if (gc_holds++ == 0) gc_was_on = PyGC_Disable();
    return 1;
}

static void gc_release(int held) {
    if (held && --gc_holds == 0 && gc_was_on) PyGC_Enable();
}

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
    int gc_was = gc_hold();
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
            record = record_make(self->st, fields);
            Py_DECREF(seq);
        }
    }
    Py_XDECREF(moved);
    Py_XDECREF(leased);
    Py_XDECREF(result);
    if (rc) { /* refused: reported as Fast_enqueue reports it, through the record */
        gc_release(gc_was);
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
        gc_release(gc_was);
        return record;
    }
    /* queued, but no memory to track it: prove it complete, then refuse (its event is sound: pooled) */
    gc_release(gc_was);
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
PyObject *Fast_pinned(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
    FastObject *self = (FastObject *)obj;
    if (nargs_is(nargs, 9, "pinned")) return NULL;
    PyObject *handle_type = args[0], *host = args[6], *device = args[7];
    if (!PyType_Check(handle_type) || handle_type == (PyObject *)self->st->HandleType ||
        !PyType_IsSubtype((PyTypeObject *)handle_type, self->st->HandleType)) {
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
    if (PyObject_SetAttr(host, self->st->S_state, self->in_flight)) goto fail;
    if (upload) {
        if (PyObject_SetAttr(device, self->st->S_state, self->in_flight)) goto fail;
    } else {
        PyObject *leases = PyObject_GetAttr(device, self->st->S_leases);
        if (!leases) goto fail;
        long k = PyLong_AsLong(leases);
        Py_DECREF(leases);
        PyObject *v = (k == -1 && PyErr_Occurred()) ? NULL : PyLong_FromLong(k + 1);
        int rc = v ? PyObject_SetAttr(device, self->st->S_leases, v) : -1;
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

