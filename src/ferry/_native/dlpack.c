/*
 * dlpack.c: DLPack export and import.
 *
 * Invariants: a capsule's destructor keeps any pending exception aside while a deleter runs; an
 * exported tensor holds a reference to its owner until its deleter runs; a deleter that runs once the
 * interpreter is finalized does nothing (the process is ending).
 */
#include "native.h"

/* ---- DLPack capsule destructor ---------------------------------------------------------------
 * A DLPack producer's capsule destructor runs when the capsule dies; if nobody consumed it (its
 * name is still "dltensor") the producer must call the tensor's deleter. A consumer may drop the
 * capsule while an exception is pending (NumPy does when it refuses a CUDA tensor), so the
 * destructor keeps that exception aside while the deleter (a Python callback in ferry) runs and
 * puts it back afterwards: the consumer's error reaches its caller and nothing is printed. */
/*
 * The interpreter's exit. A deleter on a thread Python does not know takes the GIL with
 * PyGILState_Ensure; once finalization is under way that can end the thread (3.11 - 3.13) or hang it
 * (3.14). The module registers dlpack_at_exit with atexit, which runs first thing in finalization
 * (other threads still run): from then on every deleter does nothing, which leaves only the window
 * between a deleter's check and its PyGILState_Ensure. The process is ending: what a skipped deleter
 * would have released goes with it.
 */
atomic_int dlpack_exiting;

PyObject *dlpack_at_exit(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(ignored)) {
    atomic_store(&dlpack_exiting, 1);
    Py_RETURN_NONE;
}

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

void dlpack_capsule_destructor(PyObject *capsule) {
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

PyObject *mod_dlpack_capsule_destructor(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromVoidPtr((void *)dlpack_capsule_destructor);
}

/* ---- DLPack deleter ---------------------------------------------------------------------------
 * A consumer calls an exported tensor's deleter when it frees the tensor, from its own thread and
 * at its own time: PyTorch may free a tensor while the interpreter shuts down, or only after it is
 * gone. A ctypes callback would then take a GIL that no longer exists and crash the process at exit.
 * This deleter does nothing once the interpreter is finalized (the process is ending: ferry's
 * bookkeeping goes with it) and otherwise calls ferry's release callback with the tensor's address,
 * keeping aside any exception the consumer left pending. */
PyObject *dlpack_release; /* ferry's callback: release(address) */

void dlpack_deleter(void *managed) {
    if (atomic_load(&dlpack_exiting) || !Py_IsInitialized() || dlpack_release == NULL) return;
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

PyObject *mod_dlpack_deleter(PyObject *Py_UNUSED(mod), PyObject *release) {
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

PyObject *mod_dlpack_import(PyObject *Py_UNUSED(mod), PyObject *capsule) {
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
    if (atomic_load(&dlpack_exiting) || !Py_IsInitialized()) return;
    PyGILState_STATE gil = PyGILState_Ensure();
    Py_XDECREF((PyObject *)t->managed.manager_ctx);
    PyGILState_Release(gil);
    free(t);
    atomic_fetch_sub(&exported_live, 1);
}

PyObject *mod_dlpack_exports_live(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLong(atomic_load(&exported_live));
}

PyObject *mod_dlpack_export(PyObject *Py_UNUSED(mod), PyObject *const *args, Py_ssize_t nargs) {
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
PyObject *mod_dlpack_release(PyObject *Py_UNUSED(mod), PyObject *arg) {
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

