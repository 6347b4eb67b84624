/*
 * module.c: the module ferry._native._engine: its functions, its types, its constants, its state.
 *
 * Its state is per module (multi-phase init, m_size = sizeof(ferry_state)): the types, DriverError, the
 * interned attribute names, sys.is_finalizing, and what Python sets after the import (the registered hot
 * classes, numpy.ndarray, the handles' waited error). A second module object (importlib run twice, a
 * re-import after the module left sys.modules) gets its own types and its own state; no object of one
 * reads the other's.
 *
 * How each reader finds it. A module function has its module (mod_state). A method of a type that cannot
 * be subclassed asks its own type (PyType_GetModuleState). A method of Handle takes its defining class
 * (METH_METHOD); Handle's finalizer, which a Python subclass (a class with no module) reaches, walks the
 * bases to the first heap type whose module is this one (state_of_type: tp_base, PyType_GetModule,
 * PyModule_GetDef), because PyType_GetModuleByDef enters the limited API only in 3.13. The field types'
 * slots need no state: each type has its own slot functions with its field count built in. A Fast holds its
 * module and a pointer to its state, and every compiled entry (fast.c, entries.c, small.c) passes that
 * pointer to its checks (is_hot, no_views, is_ndarray, record_make): the pinned round trip reads one
 * pointer more than before, and looks nothing up.
 *
 * Its lifetime. Nothing reads freed state: every type is made with PyType_FromModuleAndSpec and holds its
 * module; every object holds its type, and a Fast holds the module itself until its dealloc (its clear
 * leaves that reference). The module is freed (m_free releases the state) only once nothing refers to it,
 * so no object of its types exists then. When the cyclic collector breaks the module's cycles, m_clear
 * releases only what Python handed in (hot classes, numpy.ndarray, the waited error), whose readers all
 * take NULL as "not set"; the types and strings, read unchecked, stay until m_free. A lookup through a
 * type the collector already cleared finds no module and raises; it never follows a stale pointer.
 *
 * What stays process-wide, and why. The fork generation (lock.c) counts forks of the process: a
 * pthread_atfork handler, which has no module, bumps it, and a lock taken in an older generation was
 * taken in a parent process whichever module made it. The DLPack deleters' exit flag and their release
 * callback (dlpack.c): a deleter is a bare C function address handed to other libraries, called with the
 * tensor only, on any thread, possibly after this module is gone; it takes the GIL with PyGILState_Ensure,
 * which serves the main interpreter only, and its flag marks the exit of that interpreter, that is of the
 * process. For that reason the module declares on 3.12 and later that it does not support several
 * interpreters (Py_mod_multiple_interpreters, added at run time: the slot is unknown to 3.11, which this
 * abi3 build also serves, and which refuses unknown slots); on 3.11 the slot does not exist.
 */
#include "native.h"

/* -- module ---------------------------------------------------------------------------------------- */

static PyObject *mod_is_sticky(PyObject *Py_UNUSED(mod), PyObject *arg) {
    long code = PyLong_AsLong(arg);
    if (code == -1 && PyErr_Occurred()) return NULL;
    return PyBool_FromLong(is_sticky_cuda((int)code));
}

static PyObject *mod_entry_point_names(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(ignored)) {
    PyObject *t = PyTuple_New(N_DRIVER_NAMES);
    if (!t) return NULL;
    for (int i = 0; i < N_DRIVER_NAMES; i++) {
        PyObject *s = PyUnicode_FromString(DRIVER_NAMES[i]);
        if (!s || PyTuple_SetItem(t, i, s)) {
            Py_DECREF(t);
            return NULL;
        }
    }
    return t;
}

static PyMethodDef module_methods[] = {
    {"_dlpack_at_exit", dlpack_at_exit, METH_NOARGS,
     "_dlpack_at_exit(): the interpreter's exit began; DLPack deleters do nothing from now on (atexit calls it)"},
    {"dlpack_capsule_destructor", mod_dlpack_capsule_destructor, METH_NOARGS,
     "dlpack_capsule_destructor() -> the address of a DLPack capsule destructor that keeps a pending exception"},
    {"dlpack_deleter", mod_dlpack_deleter, METH_O,
     "dlpack_deleter(release) -> the address of a DLManagedTensor deleter that calls release(address) while the "
     "interpreter runs, and does nothing after"},
    {"dlpack_import", mod_dlpack_import, METH_O,
     "dlpack_import(capsule) -> (managed, ptr, device_type, device_id, shape, strides or None, code, bits, lanes) "
     "of an unused 'dltensor' capsule, renamed 'used_dltensor'"},
    {"dlpack_release", mod_dlpack_release, METH_O, "dlpack_release(managed): call an imported tensor's deleter"},
    {"dlpack_export", (PyCFunction)(void (*)(void))mod_dlpack_export, METH_FASTCALL,
     "dlpack_export(owner, ptr, shape, code, bits, device_type, device_id) -> a 'dltensor' capsule (C order) "
     "whose tensor keeps owner alive until its deleter runs"},
    {"dlpack_exports_live", mod_dlpack_exports_live, METH_NOARGS,
     "dlpack_exports_live() -> tensors dlpack_export made whose deleter has not run"},
    {"is_sticky", mod_is_sticky, METH_O, "is_sticky(code) -> whether a CUDA error code poisons the context"},
    {"entry_point_names", mod_entry_point_names, METH_NOARGS,
     "entry_point_names() -> the driver entry points mode='cuda' needs (the last two are optional)"},
    {"copy_in", (PyCFunction)(void (*)(void))mod_copy_in, METH_FASTCALL,
     "copy_in(dst, capacity, array[, nbytes]) -> bytes copied from a C-contiguous array, or -1 (not taken)"},
    {"address_of", (PyCFunction)(void (*)(void))mod_address_of, METH_FASTCALL,
     "address_of(array, capacity[, nbytes]) -> address of a writable C-contiguous array of at most capacity "
     "bytes, or 0"},
    {"leaf_pieces", (PyCFunction)(void (*)(void))mod_leaf_pieces, METH_FASTCALL,
     "leaf_pieces(hosts, devices, runtime, owned, upload) -> (pieces, nbytes) or None: a tree's leaves as "
     "Engine.submit_pieces takes them, or None where a leaf is not the common case (tree.c)"},
    {"device_pieces", (PyCFunction)(void (*)(void))mod_device_pieces, METH_FASTCALL,
     "device_pieces(devices, runtime, owned, base, offsets) -> (pieces, nbytes) or None: a download's pieces into "
     "host memory laid out for it (leaf i at base + offsets[i]), only the device arrays checked (tree.c)"},
    {"slab_views", (PyCFunction)(void (*)(void))mod_slab_views, METH_FASTCALL,
     "slab_views(hosts, sizes, runtime, slab, base, owned, zero) -> a fresh DeviceArray view of the slab for "
     "each host array, back to back at 256-byte aligned offsets, or None (tree.c)"},
    {"host_sizes", (PyCFunction)(void (*)(void))mod_host_sizes, METH_FASTCALL,
     "host_sizes(hosts, align) -> (sizes, total) or None: each exact ndarray's bytes, and the bytes they span back "
     "to back at that alignment (tree.c)"},
    {"merge_runs", (PyCFunction)(void (*)(void))mod_merge_runs, METH_FASTCALL,
     "merge_runs(pieces, align) -> (hosts, devices, sizes): a tree's pieces merged into runs, empty ones dropped; "
     "align > 0: a host side laid out at that alignment, whose padding runs may span (tree.c)"},
    {"mark_leaves", (PyCFunction)(void (*)(void))mod_mark_leaves, METH_FASTCALL,
     "mark_leaves(devices, state, leases): set each DeviceArray's state (unless None), add leases to its count "
     "(tree.c)"},
    {"flat_leaves", (PyCFunction)(void (*)(void))mod_flat_leaves, METH_FASTCALL,
     "flat_leaves(tree, kind) -> (keys, values, dtypes) or None: a plain dict of leaves of exactly that type, "
     "taken apart in one pass (tree.c)"},
    {"device_specs", mod_device_specs, METH_O,
     "device_specs(devices) -> (specs, sizes, total) or None: each DeviceArray's (shape, dtype) and size (tree.c)"},
    {"set_hot_types", (PyCFunction)(void (*)(void))mod_set_hot_types, METH_FASTCALL,
     "set_hot_types(PinnedHostBuffer, DeviceArray, Block, Health, Slot): the classes whose fields the entries read"},
    {"array_fields", mod_array_fields, METH_NOARGS,
     "array_fields() -> {field: offset} of the NumPy array fields the helpers read (NumPy's PyArrayObject_fields)"},
    {"set_array_type", mod_set_array_type, METH_O,
     "set_array_type(numpy.ndarray or None): enable the reads of NumPy's array fields for exact ndarrays"},
    {"clear_writeable", mod_clear_writeable, METH_O,
     "clear_writeable(ndarray) -> whether it was writeable (it is not now); needs set_array_type"},
    {"set_writeable", mod_set_writeable, METH_O, "set_writeable(ndarray): the writeable flag back; needs set_array_type"},
    {"memcopy", (PyCFunction)(void (*)(void))mod_memcopy, METH_FASTCALL,
     "memcopy(dst, src, nbytes, nontemporal=False): memcpy, the GIL held; nontemporal: the engine's streaming "
     "stores from 64 KiB on x86-64, the GIL released"},
    {"data_of", mod_data_of, METH_O,
     "data_of(ndarray) -> its data pointer (an exact numpy.ndarray; needs set_array_type)"},
    {"set_handle_errors", mod_set_handle_errors, METH_O,
     "set_handle_errors(waited_error): the exception class a handle's second wait() raises"},
    {"new_record", (PyCFunction)(void (*)(void))mod_new_record, METH_FASTCALL,
     "new_record(seq, event, stream, moved, leased, result, nbytes) -> Record, without the type call"},
    {NULL, NULL, 0, NULL},
};

/* The ferry module state of tp or of its nearest base made by this module's def (see the essay). */
ferry_state *state_of_type(PyTypeObject *tp) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    ferry_state *st = NULL;
    for (PyTypeObject *t = tp; t && !st && (PyType_GetFlags(t) & Py_TPFLAGS_HEAPTYPE);
         t = (PyTypeObject *)PyType_GetSlot(t, Py_tp_base)) {
        PyObject *m = PyType_GetModule(t); /* borrowed; NULL (TypeError) for a Python class */
        if (m && PyModule_GetDef(m) == &ferry_module_def) st = mod_state(m);
        PyErr_Clear();
    }
    PyErr_Restore(type, value, tb);
    if (!st && !PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "ferry._native._engine: this type's module is gone");
    return st;
}

static int module_traverse(PyObject *m, visitproc visit, void *arg) {
    ferry_state *st = mod_state(m);
    if (!st) return 0;
    PyObject **refs = state_refs(st);
    for (size_t i = 0; i < FERRY_STATE_REFS; i++) Py_VISIT(refs[i]);
    return 0;
}

/* What the collector may break: what Python handed in (its readers take NULL as "not set"). */
static int module_clear(PyObject *m) {
    ferry_state *st = mod_state(m);
    if (!st) return 0;
    PyObject **refs = state_refs(st);
    for (size_t i = FERRY_STATE_KEPT; i < FERRY_STATE_REFS; i++) Py_CLEAR(refs[i]);
    return 0;
}

/* The module is freed: no object of its types is left, the whole state goes. */
static void module_free(void *m) {
    ferry_state *st = mod_state((PyObject *)m);
    if (!st) return;
    PyObject **refs = state_refs(st);
    for (size_t i = 0; i < FERRY_STATE_REFS; i++) Py_CLEAR(refs[i]);
    st->record_alloc = NULL;
}

/* A type of spec (on base, or none) added to the module as name: 0, or -1 with the error set. */
static int add_type(PyObject *m, PyTypeObject **slot, PyType_Spec *spec, const char *name, PyTypeObject *base) {
    PyObject *t = PyType_FromModuleAndSpec(m, spec, (PyObject *)base);
    if (!t) return -1;
    *slot = (PyTypeObject *)t; /* the state's reference */
    return name ? PyModule_AddObject(m, name, Py_NewRef(t)) ? (Py_DECREF(t), -1) : 0 : 0;
}

static int intern(PyObject **slot, const char *text) { return (*slot = PyUnicode_InternFromString(text)) ? 0 : -1; }

static PyMethodDef at_exit_def = {"_dlpack_at_exit", dlpack_at_exit, METH_NOARGS,
                                  "the interpreter's exit began: DLPack deleters do nothing from now on"};
static int at_exit_registered; /* touched with the GIL held, by the one interpreter that imports ferry */

static int module_exec(PyObject *m) {
    ferry_state *st = mod_state(m);
    if (lock_count_forks()) return -1;
    st->DriverError = PyErr_NewException("ferry._native._engine.DriverError", PyExc_RuntimeError, NULL);
    if (!st->DriverError || PyModule_AddObject(m, "DriverError", Py_NewRef(st->DriverError))) return -1;
    if (add_type(m, &st->EngineType, &Engine_spec, "Engine", NULL) || add_type(m, &st->JobType, &Job_spec, "Job", NULL) ||
        add_type(m, &st->RecordType, &Record_spec, "Record", NULL) || add_type(m, &st->FastType, &Fast_spec, "Fast", NULL) ||
        add_type(m, &st->HandleType, &Handle_spec, "Handle", NULL) || add_type(m, &st->EntryType, &Entry_spec, NULL, NULL) ||
        add_type(m, &st->RLockType, &RLock_spec, "RLock", NULL) ||
        add_type(m, &st->BufferFieldsType, &BufferFields_spec, "BufferFields", NULL) ||
        add_type(m, &st->ArrayFieldsType, &ArrayFields_spec, "ArrayFields", NULL) ||
        add_type(m, &st->BlockFieldsType, &BlockFields_spec, "BlockFields", NULL) ||
        add_type(m, &st->HealthFieldsType, &HealthFields_spec, "HealthFields", NULL) ||
        add_type(m, &st->ExtrasFieldsType, &ExtrasFields_spec, "ExtrasFields", NULL) ||
        add_type(m, &st->SlotFieldsType, &SlotFields_spec, "SlotFields", st->ExtrasFieldsType) ||
        add_type(m, &st->HostMemoryType, &HostMemory_spec, "HostMemory", NULL) ||
        add_type(m, &st->LeasesType, &Leases_spec, "Leases", NULL) ||
        add_type(m, &st->CopierType, &Copier_spec, "Copier", NULL) || add_type(m, &st->CallsType, &Calls_spec, "Calls", NULL))
        return -1;
    st->record_alloc = (allocfunc)PyType_GetSlot(st->RecordType, Py_tp_alloc);
    if (intern(&st->S_transfers, "transfers") || intern(&st->S_give, "give") || intern(&st->S_free, "free") ||
        intern(&st->S_host_copied, "host_copied") || intern(&st->S_htod_record, "htod_record") ||
        intern(&st->S_dtoh_record, "dtoh_record") || intern(&st->S_count, "_count") ||
        intern(&st->S_deferred, "deferred") || intern(&st->S_doomed, "_doomed") || intern(&st->S_refusal, "refusal") ||
        intern(&st->S_event_wait, "event_wait") || intern(&st->S_own_event, "own_event") ||
        intern(&st->S_state, "_state") || intern(&st->S_leases, "_leases") || intern(&st->S_segments, "segments") ||
        intern(&st->S_records, "records") || intern(&st->S_last, "last") || intern(&st->S_copy, "copy") ||
        intern(&st->S_seen, "seen") || intern(&st->S_dsts, "dsts") || intern(&st->S_srcs, "srcs") ||
        intern(&st->S_sizes, "sizes") || intern(&st->S_done, "done") || intern(&st->S_users, "users") ||
        intern(&st->S_event, "event") || intern(&st->S_wait, "wait") || intern(&st->S_detach, "detach") ||
        intern(&st->S_flags, "flags") || intern(&st->S_writeable, "writeable") || intern(&st->S_setflags, "setflags") ||
        intern(&st->S_base, "base") || intern(&st->S_write, "write"))
        return -1;
    {
        PyObject *sys = PyImport_ImportModule("sys");
        if (!sys) return -1;
        st->sys_is_finalizing = PyObject_GetAttrString(sys, "is_finalizing");
        Py_DECREF(sys);
        if (!st->sys_is_finalizing) return -1;
    }
    if (!at_exit_registered) { /* the exit flag of the DLPack deleters (dlpack.c): atexit runs first thing in
                                * finalization. The flag is the process's: registered once, as a function
                                * bound to no module (a bound one would keep its module alive to the exit). */
        PyObject *atexit = PyImport_ImportModule("atexit");
        PyObject *at_exit = atexit ? PyCFunction_New(&at_exit_def, NULL) : NULL;
        PyObject *r = at_exit ? PyObject_CallMethod(atexit, "register", "O", at_exit) : NULL;
        Py_XDECREF(atexit);
        Py_XDECREF(at_exit);
        if (!r) return -1;
        Py_DECREF(r);
        at_exit_registered = 1;
    }
    if (PyModule_AddIntConstant(m, "MAX_LANES", MAX_LANES) || PyModule_AddIntConstant(m, "MAX_SLOTS", MAX_SLOTS) ||
        PyModule_AddIntConstant(m, "INJECTED_FAILURE", ERR_UNKNOWN) ||
        PyModule_AddIntConstant(m, "INJECTED_STICKY_FAILURE", ERR_LAUNCH_FAILED))
        return -1;
    return 0;
}

/* Py_mod_multiple_interpreters (3.12+), Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED: see the essay */
#define MOD_MULTIPLE_INTERPRETERS 3

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, (void *)module_exec},
    {0, NULL}, /* PyInit__engine sets Py_mod_multiple_interpreters here on 3.12 and later */
    {0, NULL},
};

struct PyModuleDef ferry_module_def = {
    PyModuleDef_HEAD_INIT,
    "ferry._native._engine",
    "ferry's compiled layer: the staging engine on native threads and the small-transfer fast path "
    "(src/ferry/_native/README.md lists its sources).",
    sizeof(ferry_state),
    module_methods,
    module_slots,
    module_traverse,
    module_clear,
    module_free,
};

PyMODINIT_FUNC PyInit__engine(void) {
    if (Py_Version >= 0x030C0000) {
        module_slots[1].slot = MOD_MULTIPLE_INTERPRETERS;
        module_slots[1].value = NULL; /* Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED */
    }
    return PyModuleDef_Init(&ferry_module_def);
}
