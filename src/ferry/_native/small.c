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
 * NumPy's array struct (PyArrayObject_fields) keeps the data pointer and the flags at fixed offsets
 * (16 and 64 on 64-bit platforms): NumPy's ABI, which every extension compiled against it reads
 * directly (PyArray_DATA, PyArray_FLAGS). Python checks both offsets against NumPy's own answers for
 * a few arrays before it enables them here (set_array_layout); until then, and for any caller that
 * does not vouch for an exact numpy.ndarray of a known size, the buffer protocol serves. Read that
 * way a small array costs tens of nanoseconds instead of a buffer export.
 */

Py_ssize_t array_data_offset = -1, array_flags_offset = -1;
PyObject *ndarray_type; /* numpy.ndarray, given with the layout: only its exact instances are read */

PyObject *mod_set_array_layout(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs_is(nargs, 3, "set_array_layout")) return NULL;
    Py_ssize_t data = PyLong_AsSsize_t(args[0]), flags = PyLong_AsSsize_t(args[1]);
    if ((data == -1 || flags == -1) && PyErr_Occurred()) return NULL;
    if (!PyType_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "set_array_layout: the third argument must be numpy.ndarray");
        return NULL;
    }
    array_data_offset = data;
    array_flags_offset = flags;
    PyObject *old = ndarray_type;
    Py_INCREF(args[2]);
    ndarray_type = args[2];
    Py_XDECREF(old);
    Py_RETURN_NONE;
}


/* NumPy's nd, dimensions and descr fields (set_array_shape_layout, verified by the caller; -1: off) */
static Py_ssize_t array_nd_offset = -1, array_dims_offset = -1, array_descr_offset = -1;

PyObject *mod_set_array_shape_layout(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
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

PyObject *S_transfers;

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
PyObject *fast_small_upload(FastObject *self, PyObject *runtime, PyObject *const *args, Py_ssize_t nargs,
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
PyObject *mod_clear_writeable(PyObject *Py_UNUSED(mod), PyObject *array) {
    if (array_flags_offset < 0) {
        PyErr_SetString(PyExc_RuntimeError, "the array layout is not set");
        return NULL;
    }
    if (!is_ndarray(array)) return not_ndarray("clear_writeable", array);
    int *flags = array_flags(array);
    int was = *flags & NPY_WRITEABLE_FLAG;
    *flags &= ~NPY_WRITEABLE_FLAG;
    return PyBool_FromLong(was);
}

/* set_writeable(array): the writeable flag back (an array that owns its data). Layout set; ndarray only. */
PyObject *mod_set_writeable(PyObject *Py_UNUSED(mod), PyObject *array) {
    if (array_flags_offset < 0) {
        PyErr_SetString(PyExc_RuntimeError, "the array layout is not set");
        return NULL;
    }
    if (!is_ndarray(array)) return not_ndarray("set_writeable", array);
    *array_flags(array) |= NPY_WRITEABLE_FLAG;
    Py_RETURN_NONE;
}

