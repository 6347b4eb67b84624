/*
 * calls.c: Calls, the driver entry points of the small-transfer path, called straight from C.
 *
 * The entry points are resolved once (Python hands over their addresses); a copy and its event record
 * are then one C call from Python. Invariants: nothing here touches ferry's Python objects (the
 * ownership checks stay in Python); a failed call hands its CUresult and its stage (0 nothing
 * enqueued, 1 copies enqueued but the record failed, 2 part of a batch enqueued) to on_error, whose
 * answer is the call's; a wait releases the GIL and comes back to Python every WAIT_SLICE_NS so a
 * signal handler's exception propagates.
 */
#include "native.h"

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




PyObject *calls_failed(CallsObject *self, const char *op, int code, int stage, PyObject *const *args,
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
CUresult calls_copy_record(CallsObject *self, int upload, unsigned long long dst, unsigned long long src,
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

PyObject *Calls_htod_record(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
    return calls_copy((CallsObject *)obj, args, nargs, 1);
}

PyObject *Calls_dtoh_record(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
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
PyObject *Calls_event_wait(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
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
    int stage = 0, batched = 0;
    /* read once, with the GIL: another thread whose batch the driver refuses resets them meanwhile */
    void *batch = self->batch;
    int batch_abi = self->batch_abi;
    if (batch && n > 1) {
        unsigned char attrs[MEMCPY_ATTR_BYTES];
        memset(attrs, 0, sizeof(attrs));
        int order = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
        memcpy(attrs, &order, sizeof(order));
        size_t first = 0, fail = (size_t)-1;
        int free_gil = n >= BATCH_FREE_GIL;
        PyThreadState *ts = free_gil ? PyEval_SaveThread() : NULL;
        if (batch_abi == 13000)
            rc = ((fn_memcpy_batch_13000)batch)((CUdeviceptr *)dsts, (CUdeviceptr *)srcs, (size_t *)sizes, (size_t)n,
                                                attrs, &first, 1, stream);
        else
            rc = ((fn_memcpy_batch_12080)batch)((CUdeviceptr *)dsts, (CUdeviceptr *)srcs, (size_t *)sizes, (size_t)n,
                                                attrs, &first, 1, &fail, stream);
        if (ts) PyEval_RestoreThread(ts);
        if (!rc) {
            batched = 1;
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
    if (!batched) {
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

PyType_Spec Calls_spec = {
    "ferry._native._engine.Calls",
    sizeof(CallsObject),
    0,
    Py_TPFLAGS_DEFAULT,
    Calls_slots,
};

