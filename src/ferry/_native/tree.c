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
 * at their compiled offsets (native.h) and calls no Python. device_pieces answers the same for a download into
 * host memory laid out for it (a fresh pinned block, whose leaves are made while the copies run). merge_runs merges such pieces into the runs that
 * follow each other on both sides (one DMA each, for leaves in pinned memory); host_sizes counts a tree's host
 * arrays' bytes and the span they take back to back (a fresh device slab's size).
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

/* Whether a ferry device array (an exact DeviceArray) is a leaf's common case: this runtime's, owned, with no
 * producer to wait for (and no lease for an upload); its address and bytes into *ptr and *size. No error set. */
static int device_leaf(PyObject *device, PyObject *runtime, PyObject *owned, int upload, unsigned long long *ptr,
                       unsigned long long *size) {
    ArrayFields *d = ARRAY(device);
    if (!(d->runtime == runtime && d->state == owned && d->ready == Py_None && (!upload || is_zero(d->leases)) &&
          d->ptr && PyLong_Check(d->ptr) && d->nbytes && PyLong_Check(d->nbytes)))
        return 0;
    *ptr = as_u64(d->ptr);
    *size = as_u64(d->nbytes);
    if (((*ptr == (unsigned long long)-1 || *size == (unsigned long long)-1) && PyErr_Occurred()) || !*ptr) {
        PyErr_Clear();
        return 0;
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

/* (pieces, nbytes): what leaf_pieces and device_pieces answer; takes the reference to bytes */
static PyObject *pieces_answer(PyObject *bytes, unsigned long long total) {
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
        unsigned long long ptr = 0, size = 0;
        common = (flags & NPY_C_CONTIGUOUS_FLAG) && (upload || (flags & NPY_WRITEABLE_FLAG)) &&
                 leaf_matches(host, ARRAY(device)->shape, ARRAY(device)->dtype) &&
                 device_leaf(device, runtime, owned, upload, &ptr, &size);
        if (!common) break;
        uint64_t t[3] = {(uint64_t)(uintptr_t)array_data(host), (uint64_t)ptr, (uint64_t)size};
        memcpy(out + (size_t)i * sizeof t, t, sizeof t);
        ranges[i].at = upload ? t[1] : t[0];
        ranges[i].n = size ? size : 1; /* an empty leaf still counts as itself: the same object twice is refused */
        total += size;
    }
    if (common && n > 1) { /* no two leaves overlap where the transfer writes */
        Py_ssize_t sorted = 1; /* a tree's leaves usually lie in order (views of one slab or one block): no sort */
        while (sorted < n && ranges[sorted - 1].at <= ranges[sorted].at) sorted++;
        if (sorted < n) qsort(ranges, (size_t)n, sizeof(range_t), by_start);
        for (Py_ssize_t i = 1; i < n && common; i++)
            if (ranges[i - 1].at + ranges[i - 1].n > ranges[i].at) common = 0;
    }
    free(ranges);
    if (!common) {
        Py_DECREF(bytes);
        Py_RETURN_NONE;
    }
    return pieces_answer(bytes, total);
}

/*
 * device_pieces(devices, runtime, owned, base, offsets): a download's pieces into host memory laid out for it
 * (leaf i at base + offsets[i], as a fresh pinned block's leaves are), answered as leaf_pieces answers them for
 * a download: (pieces, nbytes), or None as soon as one device array is not the common case (nothing changed).
 * Only the device arrays are checked: the host side is the caller's own, laid out with no two leaves
 * overlapping, and no host array exists yet (the caller makes the leaves while the copies run).
 */
PyObject *mod_device_pieces(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs_is(nargs, 5, "device_pieces")) return NULL;
    ferry_state *st = mod_state(mod);
    PyObject *devices = args[0], *runtime = args[1], *owned = args[2], *offsets = args[4];
    if (!PyList_Check(devices) || !PyList_Check(offsets) || PyList_Size(devices) != PyList_Size(offsets)) {
        PyErr_SetString(PyExc_TypeError, "device_pieces: devices and offsets must be lists of one length");
        return NULL;
    }
    unsigned long long base = PyLong_AsUnsignedLongLong(args[3]);
    if (base == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (!st->hot_types[HOT_ARRAY]) Py_RETURN_NONE;
    Py_ssize_t n = PyList_Size(devices);
    PyObject *bytes = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)(3 * sizeof(uint64_t)));
    if (!bytes) return NULL;
    char *out = PyBytes_AsString(bytes);
    unsigned long long total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *device = PyList_GetItem(devices, i), *offset = PyList_GetItem(offsets, i);
        unsigned long long ptr = 0, size = 0, at = offset && PyLong_Check(offset) ? PyLong_AsUnsignedLongLong(offset) : 0;
        if ((at == (unsigned long long)-1 && PyErr_Occurred()) || !offset || !PyLong_Check(offset) ||
            base + at < base || !is_hot(st, device, HOT_ARRAY) || !device_leaf(device, runtime, owned, 0, &ptr, &size)) {
            PyErr_Clear();
            Py_DECREF(bytes);
            Py_RETURN_NONE;
        }
        uint64_t t[3] = {(uint64_t)(base + at), (uint64_t)ptr, (uint64_t)size};
        memcpy(out + (size_t)i * sizeof t, t, sizeof t);
        total += size;
    }
    return pieces_answer(bytes, total);
}

/*
 * slab_views(hosts, sizes, runtime, slab, base, owned, zero): the fresh device arrays of a tree's upload, views of
 * one device allocation (ferry._memory._slab) at base, one for each host array, each at the next offset aligned to
 * 256 bytes, with the host array's shape and dtype object and sizes[i] bytes (an empty one takes 256 bytes: no two views
 * share an address, which leaf_pieces would refuse). Each is made as
 * ferry._device_array.new_device_array makes one (the exact DeviceArray class, owned, no leases, nothing to wait
 * for), without a Python call per leaf. Each view is adopted by the slab as DeviceSlab.adopt does (a weak
 * reference appended to slab._views). None where a host is not an exact numpy.ndarray, the slab has no _views
 * list (or the classes are not known yet): the caller then makes them in Python. Nothing else is registered:
 * the caller does that. The views, their shape tuples and the weak references (no callback) are not tracked
 * by the collector (see below: none can be part of a cycle only it could break), so a tree of thousands of
 * leaves costs no collection.
 */
PyObject *mod_slab_views(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs_is(nargs, 7, "slab_views")) return NULL;
    ferry_state *st = mod_state(mod);
    PyObject *hosts = args[0], *sizes = args[1], *runtime = args[2], *slab = args[3], *owned = args[5],
             *zero = args[6];
    if (!PyList_Check(hosts) || !PyList_Check(sizes) || PyList_Size(hosts) != PyList_Size(sizes)) {
        PyErr_SetString(PyExc_TypeError, "slab_views: hosts and sizes must be lists of one length");
        return NULL;
    }
    unsigned long long base = PyLong_AsUnsignedLongLong(args[4]);
    if (base == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    PyTypeObject *cls = (PyTypeObject *)st->hot_types[HOT_ARRAY];
    if (!cls || !st->ndarray_type) Py_RETURN_NONE;
    Py_ssize_t n = PyList_Size(hosts);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!is_ndarray(st, PyList_GetItem(hosts, i))) Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < n; i++) { /* every size an int >= 0 (TypeError), before anything is made */
        PyObject *size = PyList_GetItem(sizes, i);
        if (!PyLong_Check(size) || (PyLong_AsUnsignedLongLong(size) == (unsigned long long)-1 && PyErr_Occurred())) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "slab_views: a size is not an int >= 0");
            return NULL;
        }
    }
    PyObject *adopted = PyObject_GetAttrString(slab, "_views");
    if (!adopted || !PyList_Check(adopted)) {
        Py_XDECREF(adopted);
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t had = PyList_Size(adopted);
    allocfunc alloc = (allocfunc)PyType_GetSlot(cls, Py_tp_alloc);
    PyObject *out = PyList_New(n);
    if (!out) goto failed;
    unsigned long long at = 0;
    const NumpyArray *prev = NULL; /* the host array before: leaves of its shape share its view's shape tuple */
    for (Py_ssize_t i = 0; i < n; i++) {
        const NumpyArray *a = (const NumpyArray *)PyList_GetItem(hosts, i);
        PyObject *size = PyList_GetItem(sizes, i);
        unsigned long long nbytes = PyLong_Check(size) ? PyLong_AsUnsignedLongLong(size) : (unsigned long long)-1;
        if (nbytes == (unsigned long long)-1) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "slab_views: a size is not an int >= 0");
            goto failed;
        }
        PyObject *shape = NULL;
        if (prev && prev->nd == a->nd &&
            (a->nd == 0 || !memcmp(prev->dimensions, a->dimensions, (size_t)a->nd * sizeof(Py_ssize_t)))) {
            shape = ARRAY(PyList_GetItem(out, i - 1))->shape; /* the leaf before's: tuples are immutable */
            Py_INCREF(shape);
        } else {
            if (!(shape = PyTuple_New(a->nd))) goto failed;
            for (int k = 0; k < a->nd; k++) {
                PyObject *d = PyLong_FromSsize_t(a->dimensions[k]);
                if (!d) {
                    Py_DECREF(shape);
                    goto failed;
                }
                PyTuple_SetItem(shape, k, d);
            }
            PyObject_GC_UnTrack(shape); /* ints only */
        }
        PyObject *ptr = PyLong_FromUnsignedLongLong(base + at);
        PyObject *obj = ptr ? alloc(cls, 0) : NULL;
        if (!obj) {
            Py_XDECREF(ptr);
            Py_DECREF(shape);
            goto failed;
        }
        ArrayFields *f = ARRAY(obj);
        Py_INCREF(a->descr);
        f->dtype = a->descr;
        Py_INCREF(zero);
        f->leases = zero;
        Py_INCREF(slab);
        f->memory = slab;
        Py_INCREF(size);
        f->nbytes = size;
        f->ptr = ptr;
        Py_INCREF(Py_None);
        f->ready = Py_None;
        Py_INCREF(runtime);
        f->runtime = runtime;
        f->shape = shape;
        Py_INCREF(owned);
        f->state = owned;
        PyList_SetItem(out, i, obj);
        /* Not tracked by the collector either: a view's fields are its runtime, its slab (which refers to
         * its views weakly), ints, its shape and dtype, and a record while a hand-off of it is pending, which
         * the record's cleanup clears; so no cycle that only the collector could break runs through it. A
         * fresh tree of 16,384 leaves otherwise costs ~4 ms of collections. */
        PyObject_GC_UnTrack(obj);
        PyObject *ref = PyWeakref_NewRef(obj, NULL);
        if (!ref) goto failed;
        PyObject_GC_UnTrack(ref); /* no callback: it refers to nothing */
        int rc = PyList_Append(adopted, ref);
        Py_DECREF(ref);
        if (rc) goto failed;
        at += ((nbytes ? nbytes : 1) + 255) / 256 * 256; /* an empty leaf too: no two views start together */
        prev = a;
    }
    Py_DECREF(adopted);
    return out;
failed: /* nothing adopted stays: the views made so far die with the list */
    if (PyList_Size(adopted) > had) PyList_SetSlice(adopted, had, PyList_Size(adopted), NULL);
    Py_DECREF(adopted);
    Py_XDECREF(out);
    return NULL;
}

/*
 * mark_leaves(devices, state, leases): the device arrays of a tree's job, queued now, take their new state in one
 * call: state (unless None) becomes each one's _state, and leases (an int, 0 for none) is added to each one's
 * _leases. Every item must be an exact DeviceArray (leaf_pieces checked them): TypeError, nothing changed,
 * otherwise.
 */
PyObject *mod_mark_leaves(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs_is(nargs, 3, "mark_leaves")) return NULL;
    ferry_state *st = mod_state(mod);
    PyObject *devices = args[0], *state = args[1], *delta = args[2];
    int tuple = PyTuple_Check(devices);
    if (!tuple && !PyList_Check(devices)) {
        PyErr_SetString(PyExc_TypeError, "mark_leaves: devices must be a list or a tuple");
        return NULL;
    }
    Py_ssize_t n = tuple ? PyTuple_Size(devices) : PyList_Size(devices);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = tuple ? PyTuple_GetItem(devices, i) : PyList_GetItem(devices, i);
        if (!is_hot(st, d, HOT_ARRAY) || !ARRAY(d)->leases) {
            PyErr_SetString(PyExc_TypeError, "mark_leaves: every item must be a DeviceArray");
            return NULL;
        }
    }
    PyObject **sums = NULL;
    if (!is_zero(delta)) { /* every new count first: nothing changes if one cannot be made */
        sums = calloc((size_t)(n ? n : 1), sizeof(PyObject *));
        if (!sums) return PyErr_NoMemory();
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *d = tuple ? PyTuple_GetItem(devices, i) : PyList_GetItem(devices, i);
            if (!(sums[i] = PyNumber_Add(ARRAY(d)->leases, delta))) {
                for (Py_ssize_t k = 0; k < i; k++) Py_DECREF(sums[k]);
                free(sums);
                return NULL;
            }
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        ArrayFields *f = ARRAY(tuple ? PyTuple_GetItem(devices, i) : PyList_GetItem(devices, i));
        PyObject *old;
        if (sums) {
            old = f->leases;
            f->leases = sums[i];
            Py_DECREF(old);
        }
        if (state != Py_None) {
            Py_INCREF(state);
            old = f->state;
            f->state = state;
            Py_XDECREF(old);
        }
    }
    free(sums);
    Py_RETURN_NONE;
}

/*
 * flat_leaves(tree, kind) -> (keys, values, dtypes) or None: a plain dict (exactly dict, not empty) whose values
 * are all exactly of type kind, taken apart in one pass: its keys and its values as lists, in order, and, when
 * kind is numpy.ndarray (and its fields' layout was verified), the distinct dtype objects of the values in the
 * order met (consecutive repeats dropped: few items, the caller makes a set), else None for dtypes. None for any
 * other tree. Calls no Python code once its lists are made (the dict cannot change under it).
 */
PyObject *mod_flat_leaves(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs_is(nargs, 2, "flat_leaves")) return NULL;
    ferry_state *st = mod_state(mod);
    PyObject *tree = args[0], *kind = args[1];
    if (!PyDict_CheckExact(tree) || PyDict_Size(tree) == 0) Py_RETURN_NONE;
    Py_ssize_t n = PyDict_Size(tree), pos = 0, i = 0;
    PyObject *key, *value;
    int arrays = st->ndarray_type && kind == st->ndarray_type;
    /* the lists first: making them may collect garbage, whose finalizers may change the dict; from here on
     * nothing allocates an object until the lists are filled (appends only grow a buffer) */
    PyObject *keys = PyList_New(n), *values = PyList_New(n), *dtypes = arrays ? PyList_New(0) : Py_None;
    if (!arrays) Py_INCREF(Py_None);
    if (!keys || !values || !dtypes) goto failed;
    if (PyDict_Size(tree) != n) goto not_flat;
    while (PyDict_Next(tree, &pos, &key, &value)) /* every value of the kind first */
        if ((PyObject *)Py_TYPE(value) != kind) goto not_flat;
    PyObject *last = NULL;
    pos = 0;
    while (PyDict_Next(tree, &pos, &key, &value) && i < n) {
        Py_INCREF(key);
        PyList_SetItem(keys, i, key);
        Py_INCREF(value);
        PyList_SetItem(values, i, value);
        i++;
        if (arrays) {
            PyObject *descr = ((const NumpyArray *)value)->descr;
            if (descr != last) {
                if (PyList_Append(dtypes, descr)) goto failed;
                last = descr;
            }
        }
    }
    PyObject *out = PyTuple_Pack(3, keys, values, dtypes);
    Py_DECREF(keys);
    Py_DECREF(values);
    Py_DECREF(dtypes);
    return out;
not_flat:
    Py_DECREF(keys);
    Py_DECREF(values);
    Py_DECREF(dtypes);
    Py_RETURN_NONE;
failed:
    Py_XDECREF(keys);
    Py_XDECREF(values);
    Py_XDECREF(dtypes);
    return NULL;
}

/*
 * device_specs(devices) -> (specs, sizes, total) or None: for a list of exact DeviceArrays, each one's (shape,
 * dtype) pair and its size in bytes (its own objects), and the sizes' sum; the fresh host leaves of a download
 * are made from these. Consecutive leaves with the very same shape and dtype objects (a slab's views of one
 * shape share them) share one pair. None where an item is not an exact DeviceArray or a size not an int >= 0.
 */
PyObject *mod_device_specs(PyObject *mod, PyObject *arg) {
    ferry_state *st = mod_state(mod);
    if (!PyList_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "device_specs: devices must be a list");
        return NULL;
    }
    Py_ssize_t n = PyList_Size(arg);
    unsigned long long total = 0;
    for (Py_ssize_t i = 0; i < n; i++) { /* every item checked first: nothing made otherwise */
        PyObject *d = PyList_GetItem(arg, i);
        if (!is_hot(st, d, HOT_ARRAY)) Py_RETURN_NONE;
        ArrayFields *f = ARRAY(d);
        if (!f->shape || !f->dtype || !f->nbytes || !PyLong_Check(f->nbytes)) Py_RETURN_NONE;
        unsigned long long size = PyLong_AsUnsignedLongLong(f->nbytes);
        if (size == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        total += size;
    }
    PyObject *specs = PyList_New(n), *sizes = PyList_New(n);
    if (!specs || !sizes) goto failed;
    PyObject *spec = NULL; /* the pair before (borrowed from specs) */
    for (Py_ssize_t i = 0; i < n; i++) {
        ArrayFields *f = ARRAY(PyList_GetItem(arg, i));
        if (spec && PyTuple_GetItem(spec, 0) == f->shape && PyTuple_GetItem(spec, 1) == f->dtype) {
            Py_INCREF(spec);
        } else if (!(spec = PyTuple_Pack(2, f->shape, f->dtype))) {
            goto failed;
        }
        PyList_SetItem(specs, i, spec);
        Py_INCREF(f->nbytes);
        PyList_SetItem(sizes, i, f->nbytes);
    }
    PyObject *sum = PyLong_FromUnsignedLongLong(total);
    PyObject *out = sum ? PyTuple_Pack(3, specs, sizes, sum) : NULL;
    Py_XDECREF(sum);
    Py_DECREF(specs);
    Py_DECREF(sizes);
    return out;
failed:
    Py_XDECREF(specs);
    Py_XDECREF(sizes);
    return NULL;
}

/*
 * merge_runs(pieces, align): the pieces (packed native uint64 triples: host, device, bytes, as leaf_pieces makes
 * them) merged into runs where they follow each other on both sides, empty ones dropped: (hosts, devices, sizes),
 * three lists of ints. With align > 0 the host side was laid out by the transfer itself (each leaf at a multiple
 * of align bytes), so two pieces also merge where the same gap of less than align bytes separates them on both
 * sides, and a run spans from its first piece's start to its last one's end (padding included). The arithmetic
 * is unsigned 64-bit, as the Python twin's (ferry._routes._groups._runs): a piece that starts before the last
 * one ended makes a huge gap, never merged.
 */
PyObject *mod_merge_runs(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    (void)mod;
    if (nargs_is(nargs, 2, "merge_runs")) return NULL;
    unsigned long long align = PyLong_AsUnsignedLongLong(args[1]);
    if (align == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE)) return NULL;
    if (view.len % (Py_ssize_t)(3 * sizeof(uint64_t))) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "merge_runs: pieces must be (host, device, nbytes) uint64 triples");
        return NULL;
    }
    size_t n = (size_t)view.len / (3 * sizeof(uint64_t));
    PyObject *lists[3] = {PyList_New(0), PyList_New(0), PyList_New(0)};
    if (!lists[0] || !lists[1] || !lists[2]) goto failed;
    const char *raw = view.buf;
    uint64_t run[3] = {0, 0, 0}, end_h = 0, end_d = 0; /* the open run: its start, its bytes; both ends */
    int open = 0;
    for (size_t i = 0; i <= n; i++) {
        uint64_t t[3] = {0, 0, 0};
        if (i < n) {
            memcpy(t, raw + i * sizeof t, sizeof t);
            if (!t[2]) continue;
            if (open) {
                uint64_t gap = t[0] - end_h;
                int joins = align ? gap == t[1] - end_d && gap < align : t[0] == end_h && t[1] == end_d;
                if (joins) {
                    run[2] = align ? t[0] + t[2] - run[0] : run[2] + t[2];
                    end_h = t[0] + t[2];
                    end_d = t[1] + t[2];
                    continue;
                }
            }
        }
        if (open) { /* the open run ends here: appended */
            for (int k = 0; k < 3; k++) {
                PyObject *v = PyLong_FromUnsignedLongLong(run[k]);
                if (!v || PyList_Append(lists[k], v)) {
                    Py_XDECREF(v);
                    goto failed;
                }
                Py_DECREF(v);
            }
        }
        if (i < n) {
            run[0] = t[0];
            run[1] = t[1];
            run[2] = t[2];
            end_h = t[0] + t[2];
            end_d = t[1] + t[2];
            open = 1;
        }
    }
    PyBuffer_Release(&view);
    PyObject *out = PyTuple_Pack(3, lists[0], lists[1], lists[2]);
    for (int k = 0; k < 3; k++) Py_DECREF(lists[k]);
    return out;
failed:
    PyBuffer_Release(&view);
    for (int k = 0; k < 3; k++) Py_XDECREF(lists[k]);
    return NULL;
}

/*
 * host_sizes(hosts, align) -> (sizes, total) or None: each host array's bytes (its dtype's itemsize times its
 * element count, as ndarray.nbytes) and the bytes they span back to back, each at a multiple of align (an empty
 * one takes align bytes too), as ferry._memory._slab.slab_layout counts them. None where a host is not an exact
 * numpy.ndarray (the caller then asks each array). The itemsize is asked of each distinct dtype object once, in a
 * row: a tree's leaves share a few. OverflowError where the span passes 2**64 bytes.
 */
PyObject *mod_host_sizes(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs_is(nargs, 2, "host_sizes")) return NULL;
    ferry_state *st = mod_state(mod);
    PyObject *hosts = args[0];
    unsigned long long align = PyLong_AsUnsignedLongLong(args[1]);
    if (align == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (!PyList_Check(hosts)) {
        PyErr_SetString(PyExc_TypeError, "host_sizes: hosts must be a list");
        return NULL;
    }
    if (align == 0) {
        PyErr_SetString(PyExc_ValueError, "host_sizes: align must be > 0");
        return NULL;
    }
    if (!st->ndarray_type) Py_RETURN_NONE;
    Py_ssize_t n = PyList_Size(hosts);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!is_ndarray(st, PyList_GetItem(hosts, i))) Py_RETURN_NONE;
    PyObject *sizes = PyList_New(n);
    if (!sizes) return NULL;
    PyObject *descr = NULL; /* the dtype object whose itemsize was asked last */
    unsigned long long itemsize = 0, total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const NumpyArray *a = (const NumpyArray *)PyList_GetItem(hosts, i);
        if (a->descr != descr) {
            PyObject *size = PyObject_GetAttrString(a->descr, "itemsize");
            itemsize = size && PyLong_Check(size) ? PyLong_AsUnsignedLongLong(size) : (unsigned long long)-1;
            Py_XDECREF(size);
            if (itemsize == (unsigned long long)-1) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "host_sizes: a dtype's itemsize is not an int");
                Py_DECREF(sizes);
                return NULL;
            }
            descr = a->descr;
        }
        unsigned long long nbytes = itemsize;
        for (int k = 0; k < a->nd; k++) nbytes *= (unsigned long long)a->dimensions[k]; /* NumPy keeps it < 2**63 */
        PyObject *v = PyLong_FromUnsignedLongLong(nbytes);
        if (!v) {
            Py_DECREF(sizes);
            return NULL;
        }
        PyList_SetItem(sizes, i, v);
        unsigned long long span = ((nbytes ? nbytes : 1) + align - 1) / align * align;
        if (span < nbytes || span > ULLONG_MAX - total) { /* no slab spans that much */
            Py_DECREF(sizes);
            PyErr_SetString(PyExc_OverflowError, "host_sizes: the arrays span more than 2**64 bytes");
            return NULL;
        }
        total += span;
    }
    PyObject *t = PyLong_FromUnsignedLongLong(total);
    PyObject *out = t ? PyTuple_Pack(2, sizes, t) : NULL;
    Py_XDECREF(t);
    Py_DECREF(sizes);
    return out;
}
