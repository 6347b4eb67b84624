/*
 * module.c: the module ferry._native._engine: its functions, its types, its constants.
 *
 * Its state. Every type is a heap type made with PyType_FromModuleAndSpec, so each type (and through
 * it each instance, which holds its type) keeps this module object alive: PyType_GetModule on a type of
 * ours answers for as long as any of its objects exists. The state itself (the types, DriverError, the
 * interned attribute names, the registered hot classes and numpy.ndarray, the DLPack exit flag, the
 * fork generation) is still process-wide: static globals, set once here and never released, with
 * single-phase init (m_size -1). That is sound: nothing of it is ever freed, so an object finalized
 * after the module left sys.modules, or during the interpreter's shutdown, reads state that is alive;
 * a re-import in the same process gets the same objects (CPython copies a single-phase module's dict),
 * and an isolated subinterpreter (3.12+) refuses a single-phase module instead of sharing it.
 *
 * Why it is not per-module state yet. Multi-phase init makes a second module object possible (a
 * re-import, a subinterpreter, which 3.12+ assumes a multi-phase module supports unless it says
 * otherwise), so it is sound only once no file reads these globals. Moving them means handing each
 * reader its module's state: module functions have the module; methods can take their defining class
 * (METH_METHOD, limited API 3.10); but the slot functions of the subclassable types (Handle, the hot
 * objects' field types, whose Python subclasses are ferry's classes) and the inline checks every
 * compiled entry makes (is_hot, no_views, is_ndarray) get no module and no defining class.
 * PyType_GetModuleByDef, which finds it from a subclass, is in the limited API only from 3.13, and this
 * build serves 3.11. The sound way in the limited API of 3.11 is to walk the type's bases by hand
 * (PyType_GetSlot(Py_tp_base), then PyType_GetModule and PyModule_GetDef on each heap type) or to keep
 * a reference to the state on the objects that need it (a Fast, an Entry), and to pass the state to
 * every check of the compiled entries; that is the next step, file by file, before m_size becomes the
 * state's size.
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

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "ferry._native._engine",
    "ferry's compiled layer: the staging engine on native threads and the small-transfer fast path "
    "(src/ferry/_native/README.md lists its sources).",
    -1,
    module_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__engine(void) {
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    if (lock_count_forks()) goto fail;
    DriverError = PyErr_NewException("ferry._native._engine.DriverError", PyExc_RuntimeError, NULL);
    if (!DriverError) goto fail;
    Py_INCREF(DriverError); /* one for the module (stolen on success), one kept here */
    if (PyModule_AddObject(m, "DriverError", DriverError)) {
        Py_DECREF(DriverError);
        goto fail;
    }
    EngineType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Engine_spec, NULL);
    if (!EngineType) goto fail;
    Py_INCREF((PyObject *)EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)EngineType)) {
        Py_DECREF((PyObject *)EngineType);
        goto fail;
    }
    JobType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Job_spec, NULL);
    if (!JobType) goto fail;
    Py_INCREF((PyObject *)JobType);
    if (PyModule_AddObject(m, "Job", (PyObject *)JobType)) {
        Py_DECREF((PyObject *)JobType);
        goto fail;
    }
    RecordType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Record_spec, NULL);
    if (!RecordType) goto fail;
    record_alloc = (allocfunc)PyType_GetSlot(RecordType, Py_tp_alloc);
    Py_INCREF((PyObject *)RecordType);
    if (PyModule_AddObject(m, "Record", (PyObject *)RecordType)) {
        Py_DECREF((PyObject *)RecordType);
        goto fail;
    }
    FastType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Fast_spec, NULL);
    if (!FastType) goto fail;
    Py_INCREF((PyObject *)FastType);
    if (PyModule_AddObject(m, "Fast", (PyObject *)FastType)) {
        Py_DECREF((PyObject *)FastType);
        goto fail;
    }
    if (!(S_transfers = PyUnicode_InternFromString("transfers"))) goto fail;
    if (!(S_give = PyUnicode_InternFromString("give")) || !(S_free = PyUnicode_InternFromString("free")) ||
        !(S_host_copied = PyUnicode_InternFromString("host_copied")))
        goto fail;
    if (!(S_htod_record = PyUnicode_InternFromString("htod_record")) ||
        !(S_dtoh_record = PyUnicode_InternFromString("dtoh_record")))
        goto fail;
    if (!(S_count = PyUnicode_InternFromString("_count")) || !(S_deferred = PyUnicode_InternFromString("deferred")) ||
        !(S_doomed = PyUnicode_InternFromString("_doomed")) || !(S_refusal = PyUnicode_InternFromString("refusal")) ||
        !(S_event_wait = PyUnicode_InternFromString("event_wait")) ||
        !(S_own_event = PyUnicode_InternFromString("own_event")) || !(S_state = PyUnicode_InternFromString("_state")) ||
        !(S_leases = PyUnicode_InternFromString("_leases")) ||
        !(S_segments = PyUnicode_InternFromString("segments")) ||
        !(S_records = PyUnicode_InternFromString("records")) || !(S_last = PyUnicode_InternFromString("last")) ||
        !(S_copy = PyUnicode_InternFromString("copy")) || !(S_seen = PyUnicode_InternFromString("seen")) ||
        !(S_dsts = PyUnicode_InternFromString("dsts")) || !(S_srcs = PyUnicode_InternFromString("srcs")) ||
        !(S_sizes = PyUnicode_InternFromString("sizes")) || !(S_done = PyUnicode_InternFromString("done")) ||
        !(S_users = PyUnicode_InternFromString("users")) || !(S_event = PyUnicode_InternFromString("event")))
        goto fail;
    HandleType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Handle_spec, NULL);
    if (!HandleType) goto fail;
    Py_INCREF((PyObject *)HandleType);
    if (PyModule_AddObject(m, "Handle", (PyObject *)HandleType)) {
        Py_DECREF((PyObject *)HandleType);
        goto fail;
    }
    {
        PyObject *sys = PyImport_ImportModule("sys");
        if (!sys) goto fail;
        sys_is_finalizing = PyObject_GetAttrString(sys, "is_finalizing");
        Py_DECREF(sys);
        if (!sys_is_finalizing) goto fail;
    }
    { /* the exit flag of the DLPack deleters (dlpack.c): atexit runs first thing in finalization */
        PyObject *atexit = PyImport_ImportModule("atexit");
        PyObject *at_exit = atexit ? PyObject_GetAttrString(m, "_dlpack_at_exit") : NULL;
        PyObject *r = at_exit ? PyObject_CallMethod(atexit, "register", "O", at_exit) : NULL;
        Py_XDECREF(atexit);
        Py_XDECREF(at_exit);
        if (!r) goto fail;
        Py_DECREF(r);
    }
    if (!(S_wait = PyUnicode_InternFromString("wait")) || !(S_detach = PyUnicode_InternFromString("detach")))
        goto fail;
    if (!(S_flags = PyUnicode_InternFromString("flags")) || !(S_writeable = PyUnicode_InternFromString("writeable")) ||
        !(S_setflags = PyUnicode_InternFromString("setflags")) || !(S_base = PyUnicode_InternFromString("base")) ||
        !(S_write = PyUnicode_InternFromString("write")))
        goto fail;
    EntryType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Entry_spec, NULL);
    if (!EntryType) goto fail;
    RLockType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &RLock_spec, NULL);
    if (!RLockType) goto fail;
    Py_INCREF((PyObject *)RLockType);
    if (PyModule_AddObject(m, "RLock", (PyObject *)RLockType)) {
        Py_DECREF((PyObject *)RLockType);
        goto fail;
    }
    { /* the hot objects' field types (objects.c): Slot's derives from the extras' */
        struct { PyTypeObject **type; PyType_Spec *spec; const char *name; PyTypeObject **base; } made[] = {
            {&BufferFieldsType, &BufferFields_spec, "BufferFields", NULL},
            {&ArrayFieldsType, &ArrayFields_spec, "ArrayFields", NULL},
            {&BlockFieldsType, &BlockFields_spec, "BlockFields", NULL},
            {&HealthFieldsType, &HealthFields_spec, "HealthFields", NULL},
            {&ExtrasFieldsType, &ExtrasFields_spec, "ExtrasFields", NULL},
            {&SlotFieldsType, &SlotFields_spec, "SlotFields", &ExtrasFieldsType},
            {&HostMemoryType, &HostMemory_spec, "HostMemory", NULL},
        };
        for (size_t i = 0; i < sizeof made / sizeof made[0]; i++) {
            PyObject *t = made[i].base ? PyType_FromModuleAndSpec(m, made[i].spec, (PyObject *)*made[i].base)
                                       : PyType_FromModuleAndSpec(m, made[i].spec, NULL);
            if (!t) goto fail;
            *made[i].type = (PyTypeObject *)t;
            if (PyModule_AddObject(m, made[i].name, Py_NewRef(t))) {
                Py_DECREF(t);
                goto fail;
            }
        }
    }
    LeasesType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Leases_spec, NULL);
    if (!LeasesType) goto fail;
    Py_INCREF((PyObject *)LeasesType);
    if (PyModule_AddObject(m, "Leases", (PyObject *)LeasesType)) {
        Py_DECREF((PyObject *)LeasesType);
        goto fail;
    }
    CopierType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Copier_spec, NULL);
    if (!CopierType) goto fail;
    Py_INCREF((PyObject *)CopierType);
    if (PyModule_AddObject(m, "Copier", (PyObject *)CopierType)) {
        Py_DECREF((PyObject *)CopierType);
        goto fail;
    }
    CallsType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Calls_spec, NULL);
    if (!CallsType) goto fail;
    Py_INCREF((PyObject *)CallsType);
    if (PyModule_AddObject(m, "Calls", (PyObject *)CallsType)) {
        Py_DECREF((PyObject *)CallsType);
        goto fail;
    }
    if (PyModule_AddIntConstant(m, "MAX_LANES", MAX_LANES) || PyModule_AddIntConstant(m, "MAX_SLOTS", MAX_SLOTS) ||
        PyModule_AddIntConstant(m, "INJECTED_FAILURE", ERR_UNKNOWN) ||
        PyModule_AddIntConstant(m, "INJECTED_STICKY_FAILURE", ERR_LAUNCH_FAILED))
        goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
