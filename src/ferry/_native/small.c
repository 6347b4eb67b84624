/*
 * small.c: the small pageable route's compiled upload, and the NumPy array fields it reads.
 */
#include "native.h"

/* -- host copies for the small pageable route (any backend) -------------------------------------------- */

/* A C-contiguous buffer (writable when asked) of at most capacity bytes; -1 (no error set) otherwise. */
int small_view(PyObject *array, Py_buffer *view, unsigned long long capacity, int writable) {
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
 * NumPy's array fields (NumpyArray in native.h: PyArrayObject_fields, NumPy's ABI) are read only for an
 * exact numpy.ndarray, and only once ferry._native.array_layout() checked them against NumPy's own
 * answers for a few arrays and set the type (set_array_type); until then, and for anything else, the
 * buffer protocol serves. Read that way a small array costs tens of nanoseconds instead of a buffer export.
 */
/* array_fields() -> {field: offset} of NumpyArray: what array_layout() checks against NumPy's answers */
PyObject *mod_array_fields(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(ignored)) {
    return Py_BuildValue("{snsnsnsnsnsnsn}", "data", (Py_ssize_t)offsetof(NumpyArray, data), "nd",
                         (Py_ssize_t)offsetof(NumpyArray, nd), "dimensions", (Py_ssize_t)offsetof(NumpyArray, dimensions),
                         "strides", (Py_ssize_t)offsetof(NumpyArray, strides), "base",
                         (Py_ssize_t)offsetof(NumpyArray, base), "descr", (Py_ssize_t)offsetof(NumpyArray, descr),
                         "flags", (Py_ssize_t)offsetof(NumpyArray, flags));
}

/* set_array_type(numpy.ndarray or None): enable (or disable) the reads of NumpyArray for its exact instances */
PyObject *mod_set_array_type(PyObject *mod, PyObject *arg) {
    if (arg != Py_None && !PyType_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "set_array_type: numpy.ndarray or None");
        return NULL;
    }
    ferry_state *st = mod_state(mod);
    PyObject *old = st->ndarray_type;
    st->ndarray_type = arg == Py_None ? NULL : Py_NewRef(arg);
    Py_XDECREF(old);
    Py_RETURN_NONE;
}

/* Whether an exact ndarray has the shape ``shape`` (a tuple of ints) and the dtype object ``dtype`` itself
 * (an equal dtype that is another object: no, the caller's Python path compares it). Shape layout set. */
static int array_matches(PyObject *array, PyObject *shape, PyObject *dtype) {
    const NumpyArray *a = (const NumpyArray *)array;
    if (!shape || !dtype || a->descr != dtype || !PyTuple_Check(shape)) return 0;
    int nd = a->nd;
    if (nd != PyTuple_Size(shape)) return 0;
    Py_ssize_t *dims = a->dimensions;
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
PyObject *Fast_bind_small(PyObject *obj, PyObject *const *args, Py_ssize_t nargs) {
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
    PyObject *give = PyObject_GetAttr(ring, self->st->S_give);
    if (!give) {
        Py_DECREF(ring);
        for (int i = 0; i < 4; i++) Py_XDECREF(got[i]);
        return NULL;
    }
    PyObject *alloc = PyObject_GetAttrString(route, "new_destination");
    if (!alloc) {
        Py_DECREF(give);
        Py_DECREF(ring);
        for (int i = 0; i < 4; i++) Py_XDECREF(got[i]);
        return NULL;
    }
    PyObject *values[9] = {ring, got[0], got[1], got[2], got[3], args[1], args[2], give, alloc}; /* taken */
    Py_INCREF(args[1]);
    Py_INCREF(args[2]);
    PyObject **fields = &self->small_ring;
    for (int i = 0; i < 9; i++) {
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


/*
 * Runtime.upload's common small case in one C call (bound as the runtime's own attribute, like
 * upload_pending): a C-contiguous exact ndarray of at most one slot into a device array of this runtime
 * with its shape and (identical) dtype object, no batch open, no registration active, a free slot in the
 * ring. SmallRoute.upload's steps: the host copy into the slot, Fast.enqueue (the copy first), the slot
 * as the record's extras, the array's read-only lease, the destination in flight, the ring's counts;
 * then the handle. Anything else is Runtime.upload's, before anything changed.
 */
static PyObject *fresh_small_upload(FastObject *self, PyObject *runtime, PyObject *source);

PyObject *fast_small_upload(FastObject *self, PyObject *runtime, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames) {
    if (!self->slow_upload || !self->small_ring) {
        PyErr_SetString(PyExc_RuntimeError, "Fast: bind_entries and bind_small were not called");
        return NULL;
    }
    if ((nargs == 1 || (nargs == 2 && args[1] == Py_None)) && !(kwnames && PyTuple_Size(kwnames)) &&
        self->small_alloc && self->rlock && self->st->hot_types[HOT_SLOT] && self->st->hot_types[HOT_ARRAY] && is_ndarray(self->st, args[0]) &&
        Py_TYPE(args[0]) == (PyTypeObject *)self->ndarray_type)
        return fresh_small_upload(self, runtime, args[0]);
    if (nargs != 2 || (kwnames && PyTuple_Size(kwnames)) || !self->rlock || !self->st->hot_types[HOT_SLOT] ||
        !is_ndarray(self->st, args[0]) || Py_TYPE(args[0]) != (PyTypeObject *)self->ndarray_type || !is_hot(self->st, args[1], HOT_ARRAY))
        return fast_entry_slow(self, self->slow_upload_any, runtime, args, nargs, kwnames);
    PyObject *source = args[0], *device = args[1];
    Py_INCREF(runtime); /* held across the submission */
    RLockObject *lock = (RLockObject *)self->rlock;
    if (rlock_take(lock, -1) != 1) {
        Py_DECREF(runtime);
        return NULL;
    }
    PyObject *copy = PyObject_GetAttr(self->entry_backend, self->st->S_htod_record); /* before the checks (it may run Python) */
    if (!copy) {
        rlock_give_result(lock, NULL);
        Py_DECREF(runtime);
        return NULL;
    }
    PyObject *result = NULL, *slot = NULL, *record = NULL, *free_list = self->small_free;
    Py_ssize_t nfree = PyList_Size(free_list), n = -1;
    unsigned long long capacity = 0;
    PyObject *nbytes_obj = ARRAY(device)->nbytes;
    int common = nfree > 0 && is_hot(self->st, self->health, HOT_HEALTH) && HEALTH(self->health)->refusal == Py_None &&
                 !PyDict_Size(self->batches) && ARRAY(device)->runtime == runtime &&
                 ARRAY(device)->state == self->owned && is_zero(ARRAY(device)->leases) &&
                 ARRAY(device)->ready == Py_None && PyList_Size(self->small_active) == 0 && nbytes_obj &&
                 PyLong_Check(nbytes_obj) && ARRAY(device)->ptr && /* a deleted field (NULL): not the common case */
                 (*array_flags(source) & NPY_C_CONTIGUOUS_FLAG) &&
                 array_matches(source, ARRAY(device)->shape, ARRAY(device)->dtype);
    if (common) {
        n = PyLong_AsSsize_t(nbytes_obj);
        slot = PyList_GetItem(free_list, nfree - 1); /* borrowed */
        if (n < 0 || !slot || !is_hot(self->st, slot, HOT_SLOT) || !SLOT(slot)->ptr || !SLOT(slot)->own ||
            !SLOT(slot)->capacity) {
            common = 0;
        } else {
            capacity = as_u64(SLOT(slot)->capacity);
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
    PyObject *slot_ptr = SLOT(slot)->ptr, *device_ptr = ARRAY(device)->ptr;
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
    if (Py_TYPE(record) == self->st->RecordType)
        set_field(&((RecordObject *)record)->extra, slot);
    else if (PyObject_SetAttrString(record, "extra", slot))
        goto done_record;
    set_field(&SLOT(slot)->record, record);
    set_field(&SLOT(slot)->nbytes, nbytes_obj);
    set_field(&SLOT(slot)->extras.cleanups, SLOT(slot)->own);
    set_field(&SLOT(slot)->host, source);
    PyObject *took = PyObject_CallFunctionObjArgs(self->small_take, source, NULL);
    if (!took) goto done_record;
    Py_DECREF(took);
    set_field(&ARRAY(device)->state, self->in_flight);
    if (ring_add(self->small_ring, self->st->S_transfers, 1) || ring_add(self->small_ring, self->st->S_host_copied, (unsigned long long)n))
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

/*
 * Runtime.upload(source) of a small array: SmallRoute.new_destination makes its destination (one lock, the
 * device pool; None: the array does not qualify, Runtime.upload's full path takes it), then the common
 * path above with it. Should that path refuse the submission, the destination made here is closed again
 * (unless it went in flight) before the error propagates.
 */
static PyObject *fresh_small_upload(FastObject *self, PyObject *runtime, PyObject *source) {
    PyObject *device = PyObject_CallFunctionObjArgs(self->small_alloc, runtime, source, NULL);
    if (!device) return NULL;
    if (device == Py_None || !is_hot(self->st, device, HOT_ARRAY)) {
        Py_DECREF(device);
        PyObject *one[1] = {source};
        return fast_entry_slow(self, self->slow_upload_any, runtime, one, 1, NULL);
    }
    PyObject *pair[2] = {source, device};
    PyObject *result = fast_small_upload(self, runtime, pair, 2, NULL);
    if (!result && ARRAY(device)->state == self->owned) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *closed = PyObject_CallMethod(device, "close", NULL);
        if (closed) Py_DECREF(closed);
        else PyErr_Clear();
        PyErr_Restore(type, value, tb);
    }
    Py_DECREF(device);
    return result;
}

/* clear_writeable(array) -> whether the array was writeable; it is not now. Layout set; ndarray only. */
PyObject *mod_clear_writeable(PyObject *mod, PyObject *array) {
    if (!is_ndarray(mod_state(mod), array)) return not_ndarray("clear_writeable", array);
    int *flags = array_flags(array);
    int was = *flags & NPY_WRITEABLE_FLAG;
    *flags &= ~NPY_WRITEABLE_FLAG;
    return PyBool_FromLong(was);
}

/* set_writeable(array): the writeable flag back (an array that owns its data). Layout set; ndarray only. */
PyObject *mod_set_writeable(PyObject *mod, PyObject *array) {
    if (!is_ndarray(mod_state(mod), array)) return not_ndarray("set_writeable", array);
    *array_flags(array) |= NPY_WRITEABLE_FLAG;
    Py_RETURN_NONE;
}

