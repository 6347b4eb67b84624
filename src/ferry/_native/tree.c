/*
 * tree.c: a tree's leaves read in one call (leaf_pieces), for the group route's one job of many pieces.
 *
 * leaf_pieces(hosts, devices, runtime, owned, upload) walks a tree's leaves, each a pair of a host array and a
 * ferry device array, and answers (pieces, nbytes): the packed (host address, device address, bytes) uint64
 * triples that Engine.submit_pieces takes, and their total. It answers None as soon as one leaf is not the
 * common case, and the caller then takes the tree the way that checks and names every problem (the Python
 * route): so nothing here raises for a user's mistake, and nothing is changed. The common case of a leaf:
 * the host array an exact, C-contiguous numpy.ndarray (writeable for a download), the device array an exact
 * DeviceArray of this runtime, owned, with no producer to wait for (and no lease for an upload), whose shape
 * and dtype object the host array has. No two leaves may overlap where the transfer writes: the device
 * arrays of an upload, the host arrays of a download (checked on the sorted ranges, so a tree of thousands of
 * leaves costs microseconds). Runs with the GIL held and the runtime's lock held by the caller; reads fields
 * at their compiled offsets (native.h) and calls no Python.
 */
#include "native.h"

static int leaf_matches(PyObject *array, PyObject *shape, PyObject *dtype) {
    const NumpyArray *a = (const NumpyArray *)array;
    if (!shape || !dtype || a->descr != dtype || !PyTuple_Check(shape)) return 0;
    int nd = a->nd;
    if (nd != PyTuple_Size(shape)) return 0;
    for (int i = 0; i < nd; i++) {
        PyObject *item = PyTuple_GetItem(shape, i);
        Py_ssize_t d = item && PyLong_Check(item) ? PyLong_AsSsize_t(item) : -1;
        if (d == -1 && PyErr_Occurred()) PyErr_Clear();
        if (d < 0 || d != a->dimensions[i]) return 0;
    }
    return 1;
}

typedef struct {
    uint64_t at, n;
} range_t;

static int by_start(const void *a, const void *b) {
    uint64_t x = ((const range_t *)a)->at, y = ((const range_t *)b)->at;
    return x < y ? -1 : x > y;
}

PyObject *mod_leaf_pieces(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs_is(nargs, 5, "leaf_pieces")) return NULL;
    ferry_state *st = mod_state(mod);
    PyObject *hosts = args[0], *devices = args[1], *runtime = args[2], *owned = args[3];
    int upload = PyObject_IsTrue(args[4]);
    if (upload < 0) return NULL;
    if (!PyList_Check(hosts) || !PyList_Check(devices)) {
        PyErr_SetString(PyExc_TypeError, "leaf_pieces: hosts and devices must be lists");
        return NULL;
    }
    Py_ssize_t n = PyList_Size(hosts);
    if (PyList_Size(devices) != n) {
        PyErr_SetString(PyExc_ValueError, "leaf_pieces: hosts and devices differ in length");
        return NULL;
    }
    if (!st->ndarray_type || !st->hot_types[HOT_ARRAY]) Py_RETURN_NONE;
    PyObject *bytes = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)(3 * sizeof(uint64_t)));
    range_t *ranges = malloc((size_t)(n ? n : 1) * sizeof(range_t));
    if (!bytes || !ranges) {
        Py_XDECREF(bytes);
        free(ranges);
        return PyErr_NoMemory();
    }
    char *out = PyBytes_AsString(bytes);
    unsigned long long total = 0;
    int common = 1;
    for (Py_ssize_t i = 0; i < n && common; i++) {
        PyObject *host = PyList_GetItem(hosts, i), *device = PyList_GetItem(devices, i);
        if (!is_ndarray(st, host) || !is_hot(st, device, HOT_ARRAY)) {
            common = 0;
            break;
        }
        int flags = *array_flags(host);
        ArrayFields *d = ARRAY(device);
        common = (flags & NPY_C_CONTIGUOUS_FLAG) && (upload || (flags & NPY_WRITEABLE_FLAG)) && d->runtime == runtime &&
                 d->state == owned && d->ready == Py_None && (!upload || is_zero(d->leases)) && d->ptr &&
                 PyLong_Check(d->ptr) && d->nbytes && PyLong_Check(d->nbytes) &&
                 leaf_matches(host, d->shape, d->dtype);
        if (!common) break;
        unsigned long long ptr = as_u64(d->ptr), size = as_u64(d->nbytes);
        if (((ptr == (unsigned long long)-1 || size == (unsigned long long)-1) && PyErr_Occurred()) || !ptr) {
            PyErr_Clear();
            common = 0;
            break;
        }
        uint64_t t[3] = {(uint64_t)(uintptr_t)array_data(host), (uint64_t)ptr, (uint64_t)size};
        memcpy(out + (size_t)i * sizeof t, t, sizeof t);
        ranges[i].at = upload ? t[1] : t[0];
        ranges[i].n = size ? size : 1; /* an empty leaf still counts as itself: the same object twice is refused */
        total += size;
    }
    if (common && n > 1) { /* no two leaves overlap where the transfer writes */
        qsort(ranges, (size_t)n, sizeof(range_t), by_start);
        for (Py_ssize_t i = 1; i < n && common; i++)
            if (ranges[i - 1].at + ranges[i - 1].n > ranges[i].at) common = 0;
    }
    free(ranges);
    if (!common) {
        Py_DECREF(bytes);
        Py_RETURN_NONE;
    }
    PyObject *size = PyLong_FromUnsignedLongLong(total);
    if (!size) {
        Py_DECREF(bytes);
        return NULL;
    }
    PyObject *result = PyTuple_Pack(2, bytes, size);
    Py_DECREF(bytes);
    Py_DECREF(size);
    return result;
}
