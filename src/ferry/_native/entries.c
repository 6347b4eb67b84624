/*
 * entries.c: the runtime's compiled upload_pending / download_pending, and the Entry they are bound to.
 */
#include "native.h"

/*
 * Runtime.upload_pending / download_pending in one C call (bound as the runtime's own attributes by
 * Runtime.__init__ where the extension, its RLock and the hot classes are there). The checks are the
 * Python method's common-case expression, read from the arguments' fields (objects.c: their classes
 * derive from the compiled field types, read at offsetof once the exact class is checked); the
 * submission is then Fast_pinned's, under the runtime lock taken in C. Anything else (another type, a
 * check that fails, keywords, a dead runtime's entry) calls the Python method, which names the
 * problem: nothing is changed before.
 */

/* obj._state = state written straight into the field where obj is a PinnedHostBuffer or DeviceArray
 * (what the descriptor does, without the attribute lookup): 1, else 0 (the caller sets the attribute).
 * Never fails. */
int set_state_slot(ferry_state *st, PyObject *obj, PyObject *state) {
    PyObject **field = is_hot(st, obj, HOT_BUFFER) ? &BUFFER(obj)->state : is_hot(st, obj, HOT_ARRAY) ? &ARRAY(obj)->state : NULL;
    if (!field) return 0;
    PyObject *old = *field;
    *field = Py_NewRef(state);
    Py_XDECREF(old);
    return 1;
}

/* Whether extra is a small-route Slot whose record its own event proves (not handed off): Completion.settle's
 * one-call case, which fast_settle_slot does in C. */
int is_small_slot(ferry_state *st, PyObject *extra) {
    return is_hot(st, extra, HOT_SLOT) && SLOT(extra)->extras.handed == Py_None;
}


/* Completion.settle for a small-route slot (the record's extras), lock held: a download's copy-out (Slot.copy_out:
 * the slot's bytes into the caller's array, counted), Slot.release(False) (the array's lease given back, the
 * slot back to its ring), the event back to the pool, the objects handed back. */
int fast_settle_slot(FastObject *self, RecordObject *r) {
    PyObject *slot = r->extra, *ring = SLOT(slot)->ring, *finish = SLOT(slot)->extras.finish;
    PyObject *host = SLOT(slot)->host;
    if (!ring || !finish || !host) {
        PyErr_SetString(PyExc_AttributeError, "a small-route slot without its ring, finish or host");
        return -1;
    }
    unsigned long long address = 0, ptr = 0, nbytes = 0;
    if (finish != Py_None) { /* a download's copy-out: its addresses read (and checked) before anything changes */
        PyObject *a = SLOT(slot)->address, *p = SLOT(slot)->ptr, *n = SLOT(slot)->nbytes;
        if (!a || !p || !n || !PyLong_Check(a) || !PyLong_Check(p) || !PyLong_Check(n)) {
            PyErr_SetString(PyExc_TypeError, "a small-route slot whose address, ptr or nbytes is not an int");
            return -1;
        }
        if (((address = as_u64(a)) == (unsigned long long)-1 || (ptr = as_u64(p)) == (unsigned long long)-1 ||
             (nbytes = as_u64(n)) == (unsigned long long)-1) && PyErr_Occurred())
            return -1;
    }
    Py_INCREF(slot);
    Py_INCREF(ring);
    Py_INCREF(host);
    int rc = -1;
    PyObject *give = NULL, *free_list = NULL;
    set_field(&r->settled, Py_True);
    if (finish != Py_None) { /* a download: the copy is proven complete, the bytes are the caller's now */
        memcpy((void *)(uintptr_t)address, (const void *)(uintptr_t)ptr, (size_t)nbytes);
        PyObject *copied = PyObject_GetAttr(ring, self->st->S_host_copied);
        if (!copied) goto out;
        PyObject *more = PyLong_FromUnsignedLongLong(nbytes), *sum = more ? PyNumber_Add(copied, more) : NULL;
        Py_DECREF(copied);
        Py_XDECREF(more);
        int set = sum ? PyObject_SetAttr(ring, self->st->S_host_copied, sum) : -1;
        Py_XDECREF(sum);
        if (set) goto out;
    }
    /* Slot.release(False): the upload ring's give and free list are the ones bind_small kept */
    int up_ring = ring == self->small_ring;
    if (up_ring) {
        give = self->small_give;
        Py_INCREF(give);
    } else if (!(give = PyObject_GetAttr(ring, self->st->S_give))) {
        goto out;
    }
    PyObject *gave = PyCFunction_Check(give) && PyCFunction_GetFunction(give) == (PyCFunction)Leases_give
                         ? Leases_give(PyCFunction_GetSelf(give), host)
                         : PyObject_CallFunctionObjArgs(give, host, NULL);
    if (!gave) goto out;
    Py_DECREF(gave);
    set_field(&SLOT(slot)->host, Py_None);
    if (SLOT(slot)->record != Py_None) {
        set_field(&r->extra, Py_None); /* the slot is not that record's any more */
        set_field(&SLOT(slot)->record, Py_None);
    }
    if (up_ring) {
        free_list = self->small_free;
        Py_INCREF(free_list);
    } else if (!(free_list = PyObject_GetAttr(ring, self->st->S_free))) {
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


/* bind_entries(slow_upload, slow_download, upload_type, download_type, h2d, d2h, backend): what the entries
 * (Fast.entries) need of their runtime besides the runtime itself */
PyObject *Fast_bind_entries(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
    FastObject *self = (FastObject *)obj;
    if (nargs_is(nargs, 7, "bind_entries")) return NULL;
    for (int i = 2; i < 4; i++) {
        if (!PyType_Check(args[i]) || args[i] == (PyObject *)self->st->HandleType ||
            !PyType_IsSubtype((PyTypeObject *)args[i], self->st->HandleType)) {
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
PyObject *fast_entry_slow(FastObject *self, PyObject *slow, PyObject *runtime, PyObject *const *args,
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
    if (nargs != 2 || (kwnames && PyTuple_Size(kwnames)) || !self->rlock || !self->st->hot_types[HOT_BUFFER])
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
    PyObject *copy = PyObject_GetAttr(self->entry_backend, upload ? self->st->S_htod_record : self->st->S_dtoh_record);
    if (!copy) {
        rlock_give_result(lock, NULL);
        Py_DECREF(runtime);
        return NULL;
    }
    PyObject *result = NULL, *block, *base;
    int common = is_hot(self->st, self->health, HOT_HEALTH) && HEALTH(self->health)->refusal == Py_None &&
                 is_hot(self->st, host, HOT_BUFFER) && is_hot(self->st, device, HOT_ARRAY) && BUFFER(host)->runtime == runtime &&
                 ARRAY(device)->runtime == runtime && BUFFER(host)->state == self->owned &&
                 ARRAY(device)->state == self->owned && (!upload || is_zero(ARRAY(device)->leases)) &&
                 ARRAY(device)->ready == Py_None && (base = BUFFER(host)->base) != NULL && base != Py_None &&
                 no_views(self->st, base) && size_at_least(BUFFER(host)->nbytes, ARRAY(device)->nbytes) &&
                 (block = BUFFER(host)->block) != NULL && is_hot(self->st, block, HOT_BLOCK) && BLOCK(block)->ptr &&
                 ARRAY(device)->ptr; /* a deleted field (NULL) is never the common case */
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
        PyObject *host_ptr = BLOCK(block)->ptr, *device_ptr = ARRAY(device)->ptr;
        PyObject *nbytes = ARRAY(device)->nbytes;
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


/*
 * Entry: what a runtime's compiled methods are bound to, (its Fast, the runtime). Fast.entries(runtime)
 * returns them as builtin methods of one Entry, which the runtime keeps as its own attributes: like a
 * bound method, each holds its runtime (rt.upload_pending kept alone keeps the runtime alive), which makes
 * a reference cycle through the runtime's __dict__ (Entry takes part in garbage collection: a dropped
 * runtime is collected, and closed with its ResourceWarning, by the cyclic collector).
 */

typedef struct { /* a PairObject's shape (defined below; its traverse, clear and dealloc are Pair_*) */
    PyObject_HEAD
    PyObject *fast, *runtime;
} EntryObject;


int Pair_traverse(PyObject *obj, visitproc visit, void *arg) {
    PairObject *self = (PairObject *)obj;
    Py_VISIT(self->first);
    Py_VISIT(self->second);
    Py_VISIT((PyObject *)Py_TYPE(obj));
    return 0;
}

int Pair_clear(PyObject *obj) {
    PairObject *self = (PairObject *)obj;
    Py_CLEAR(self->first);
    Py_CLEAR(self->second);
    return 0;
}

void Pair_dealloc(PyObject *obj) {
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

PyType_Spec Entry_spec = {
    "ferry._native._engine.Entry",
    sizeof(EntryObject),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    Entry_slots,
};

/* entries(runtime) -> (upload_pending, download_pending, upload or None): the runtime's compiled methods
 * (bind_entries first; upload only after bind_small) */
PyObject *Fast_entries(PyObject *obj, PyObject *runtime) {
    FastObject *self = (FastObject *)obj;
    if (!self->slow_upload) {
        PyErr_SetString(PyExc_RuntimeError, "Fast: bind_entries was not called");
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(self->st->EntryType, Py_tp_alloc);
    EntryObject *entry = (EntryObject *)alloc(self->st->EntryType, 0);
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

