/*
 * objects.c: the fields of ferry's hot objects, as compiled base types.
 *
 * The compiled entries check a submission's arguments and settle a small transfer by reading the
 * fields of ferry's own objects: a pinned buffer, a device array, a pinned pool block, a runtime's
 * health, a record's extras and a small-route slot. Each of those Python classes derives from one of
 * the types here (ferry/_native/objects.py picks them, or their Python twins where the extension does
 * not run), so its fields live in a C struct declared below and are read at their offsetof: no
 * offset is searched for, and a reader checks the layout against the struct by eye.
 *
 * Invariants: every field is an object reference; a new object's fields are None until its __init__
 * sets them. A field can be deleted (as a __slots__ field can: the members are T_OBJECT_EX, which
 * CPython's specializing interpreter reads and writes as fast as __slots__), which leaves it NULL: the
 * entries treat a NULL field as "not the common case" and hand the call to the Python method, which
 * raises AttributeError as before, so no read ever follows a NULL. The entries read an object's fields
 * only after checking that its exact type is the class registered for it (set_hot_types, which checks
 * that the class derives from the matching type here); every type takes part in garbage collection
 * (a slot refers to its record, whose extras are the slot).
 */
#include "native.h"

/* The fields as a run of object references: from `first` (just after the object header) to `end`. */
static inline PyObject **fields_begin(PyObject *obj) { return (PyObject **)((char *)obj + sizeof(PyObject)); }

/* How many fields the struct T has. Each fields type gets its own slot functions with its count built in
 * (FIELDS_SPEC): a Python subclass inherits tp_new and reaches the others through its base's, so no slot
 * looks its type up (nor the module's state). */
#define FIELDS_OF(T) ((Py_ssize_t)((sizeof(T) - sizeof(PyObject)) / sizeof(PyObject *)))

static PyObject *fields_new(PyTypeObject *type, Py_ssize_t n) {
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    PyObject *self = alloc(type, 0);
    if (!self) return NULL;
    PyObject **f = fields_begin(self);
    for (Py_ssize_t i = 0; i < n; i++) f[i] = Py_NewRef(Py_None);
    return self;
}

/* The subclasses' __init__ take their own arguments: the base accepts and ignores them. */
static int Fields_init(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kwds)) { return 0; }

static int fields_traverse(PyObject *obj, visitproc visit, void *arg, Py_ssize_t n) {
    PyObject **f = fields_begin(obj);
    for (Py_ssize_t i = 0; i < n; i++) Py_VISIT(f[i]);
    Py_VISIT((PyObject *)Py_TYPE(obj));
    return 0;
}

static int fields_clear(PyObject *obj, Py_ssize_t n) {
    PyObject **f = fields_begin(obj);
    for (Py_ssize_t i = 0; i < n; i++) Py_CLEAR(f[i]);
    return 0;
}

static void fields_dealloc(PyObject *obj, Py_ssize_t n) {
    PyTypeObject *tp = Py_TYPE(obj);
    PyObject_GC_UnTrack(obj);
    fields_clear(obj, n);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(obj);
    Py_DECREF(tp);
}

/* Members (T_OBJECT_EX: an unset or deleted field reads as AttributeError, as a __slots__ one does):
 * CPython's specializing interpreter reads and writes them as fast as __slots__ (LOAD_ATTR_SLOT). */
#define FIELD(T, name, field) {name, T_OBJECT_EX, offsetof(T, field), 0, NULL}

static PyMemberDef Buffer_members[] = {
    FIELD(BufferFields, "_base", base),       FIELD(BufferFields, "_block", block),
    FIELD(BufferFields, "_nbytes", nbytes),   FIELD(BufferFields, "_runtime", runtime),
    FIELD(BufferFields, "_state", state),     {NULL, 0, 0, 0, NULL},
};

static PyMemberDef Array_members[] = {
    FIELD(ArrayFields, "_dtype", dtype),     FIELD(ArrayFields, "_leases", leases),
    FIELD(ArrayFields, "_memory", memory),   FIELD(ArrayFields, "_nbytes", nbytes),
    FIELD(ArrayFields, "_ptr", ptr),         FIELD(ArrayFields, "_ready", ready),
    FIELD(ArrayFields, "_runtime", runtime), FIELD(ArrayFields, "_shape", shape),
    FIELD(ArrayFields, "_state", state),     {NULL, 0, 0, 0, NULL},
};

static PyMemberDef Block_members[] = {
    FIELD(BlockFields, "capacity", capacity), FIELD(BlockFields, "ptr", ptr), {NULL, 0, 0, 0, NULL},
};

static PyMemberDef Health_members[] = {
    FIELD(HealthFields, "closed", closed),     FIELD(HealthFields, "exited", exited),
    FIELD(HealthFields, "forked", forked),     FIELD(HealthFields, "poisoned", poisoned),
    FIELD(HealthFields, "refusal", refusal),   {NULL, 0, 0, 0, NULL},
};

static PyMemberDef Extras_members[] = {
    FIELD(ExtrasFields, "cleanups", cleanups),   FIELD(ExtrasFields, "export_stream", export_stream),
    FIELD(ExtrasFields, "finish", finish),       FIELD(ExtrasFields, "handed", handed),
    FIELD(ExtrasFields, "job", job),             FIELD(ExtrasFields, "order_after", order_after),
    FIELD(ExtrasFields, "progress", progress),   FIELD(ExtrasFields, "ready_to_order", ready_to_order),
    {NULL, 0, 0, 0, NULL},
};

static PyMemberDef Slot_members[] = {
    FIELD(SlotFields, "address", address),   FIELD(SlotFields, "block", block),
    FIELD(SlotFields, "capacity", capacity), FIELD(SlotFields, "host", host),
    FIELD(SlotFields, "nbytes", nbytes),     FIELD(SlotFields, "own", own),
    FIELD(SlotFields, "ptr", ptr),           FIELD(SlotFields, "record", record),
    FIELD(SlotFields, "ring", ring),         {NULL, 0, 0, 0, NULL},
};

#define FIELDS_SPEC(Name, T, members, doc)                                                                    \
    static PyObject *Name##_new(PyTypeObject *type, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kwds)) {    \
        return fields_new(type, FIELDS_OF(T));                                                                \
    }                                                                                                         \
    static int Name##_traverse(PyObject *obj, visitproc visit, void *arg) {                                   \
        return fields_traverse(obj, visit, arg, FIELDS_OF(T));                                                \
    }                                                                                                         \
    static int Name##_clear(PyObject *obj) { return fields_clear(obj, FIELDS_OF(T)); }                         \
    static void Name##_dealloc(PyObject *obj) { fields_dealloc(obj, FIELDS_OF(T)); }                           \
    static PyType_Slot Name##_slots[] = {                                                                     \
        {Py_tp_new, Name##_new},           {Py_tp_init, Fields_init},   {Py_tp_dealloc, Name##_dealloc},     \
        {Py_tp_traverse, Name##_traverse}, {Py_tp_clear, Name##_clear}, {Py_tp_members, members},            \
        {Py_tp_doc, doc},                  {0, NULL},                                                         \
    };                                                                                                        \
    PyType_Spec Name##_spec = {"ferry._native._engine." #Name, sizeof(T), 0,                                  \
                               Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, Name##_slots}

FIELDS_SPEC(BufferFields, BufferFields, Buffer_members, "The fields of ferry.PinnedHostBuffer (its base type).");
FIELDS_SPEC(ArrayFields, ArrayFields, Array_members, "The fields of ferry.DeviceArray (its base type).");
FIELDS_SPEC(BlockFields, BlockFields, Block_members, "The fields of a pinned pool block (its base type).");
FIELDS_SPEC(HealthFields, HealthFields, Health_members, "The fields of a runtime's health (its base type).");
FIELDS_SPEC(ExtrasFields, ExtrasFields, Extras_members, "The fields of a record's extras (their base type).");
FIELDS_SPEC(SlotFields, SlotFields, Slot_members, "The fields of a small-route slot (its base type, after the extras').");

/* -- HostMemory: the pinned memory a buffer's views are made from ---------------------------------------
 *
 * A pinned buffer's `_base`. It exports [ptr, ptr + nbytes) as a writable buffer of bytes and counts the
 * exports it made and has not had back. Views are counted by those exports, not by reference counts (which
 * free-threaded CPython does not keep exact): NumPy's frombuffer wraps an exporter that releases buffers
 * in a memoryview, which holds one export for as long as the array it makes, or any array, slice or
 * memoryview derived from that array, is alive. `exports` is 0 exactly when no such object is alive.
 *
 * Invariants: the count only changes in bf_getbuffer (+1, after the view is filled) and bf_releasebuffer
 * (-1), both atomic, so it is exact under any interleaving; every export holds a reference to the
 * HostMemory (view->obj), so the memory outlives its last export, and the pinned block goes back to its
 * pool only when the HostMemory dies (a weakref.finalize on it: ferry/_buffer.py). The type cannot be
 * subclassed, so its exact type is the check no_views makes. ptr and nbytes never change. */

static PyObject *HostMemory_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *address;
    unsigned long long ptr;
    Py_ssize_t nbytes;
    if (kwds && PyDict_Size(kwds)) {
        PyErr_SetString(PyExc_TypeError, "HostMemory takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "On:HostMemory", &address, &nbytes) || int_arg(address, &ptr, 0)) return NULL;
    if (nbytes < 0 || (!ptr && nbytes)) {
        PyErr_SetString(PyExc_ValueError, "HostMemory needs an address and a size of at least 0 bytes");
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    HostMemoryObject *self = (HostMemoryObject *)alloc(type, 0);
    if (!self) return NULL;
    self->ptr = (char *)(uintptr_t)ptr;
    self->nbytes = nbytes;
    atomic_init(&self->exports, 0);
    self->weakreflist = NULL;
    return (PyObject *)self;
}

static int HostMemory_getbuffer(PyObject *obj, Py_buffer *view, int flags) {
    HostMemoryObject *self = (HostMemoryObject *)obj;
    if (PyBuffer_FillInfo(view, obj, self->ptr, self->nbytes, 0, flags) < 0) return -1;
    atomic_fetch_add_explicit(&self->exports, 1, memory_order_acq_rel);
    return 0;
}

static void HostMemory_releasebuffer(PyObject *obj, Py_buffer *Py_UNUSED(view)) {
    atomic_fetch_sub_explicit(&((HostMemoryObject *)obj)->exports, 1, memory_order_acq_rel);
}

static PyObject *HostMemory_get_exports(PyObject *obj, void *Py_UNUSED(closure)) {
    return PyLong_FromLong(atomic_load_explicit(&((HostMemoryObject *)obj)->exports, memory_order_acquire));
}

/* export() -> the object a view is made from: the HostMemory itself (its Python twin makes one each time) */
static PyObject *HostMemory_export(PyObject *obj, PyObject *Py_UNUSED(ignored)) { return Py_NewRef(obj); }

static void HostMemory_dealloc(PyObject *obj) {
    PyTypeObject *tp = Py_TYPE(obj);
    if (((HostMemoryObject *)obj)->weakreflist) PyObject_ClearWeakRefs(obj);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(obj);
    Py_DECREF(tp);
}

static PyGetSetDef HostMemory_getset[] = {
    {"exports", HostMemory_get_exports, NULL, "how many buffers it exported that are not released yet", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef HostMemory_methods[] = {
    {"export", HostMemory_export, METH_NOARGS, "export() -> the object to make a view from (this one)"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef HostMemory_members[] = {
    {"nbytes", T_PYSSIZET, offsetof(HostMemoryObject, nbytes), READONLY, "the size in bytes"},
    {"__weaklistoffset__", T_PYSSIZET, offsetof(HostMemoryObject, weakreflist), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot HostMemory_slots[] = {
    {Py_tp_new, HostMemory_new},
    {Py_tp_dealloc, HostMemory_dealloc},
    {Py_tp_getset, HostMemory_getset},
    {Py_tp_methods, HostMemory_methods},
    {Py_tp_members, HostMemory_members},
    {Py_bf_getbuffer, HostMemory_getbuffer},
    {Py_bf_releasebuffer, HostMemory_releasebuffer},
    {Py_tp_doc, "HostMemory(ptr, nbytes): pinned memory exported as writable bytes, counting its live exports"},
    {0, NULL},
};

PyType_Spec HostMemory_spec = {"ferry._native._engine.HostMemory", sizeof(HostMemoryObject), 0, Py_TPFLAGS_DEFAULT,
                               HostMemory_slots};

/* -- the classes the entries read ------------------------------------------------------------------ */

/* set_hot_types(PinnedHostBuffer, DeviceArray, Block, Health, Slot): the exact classes whose instances the
 * compiled entries read, each checked to derive from its fields type above. */
PyObject *mod_set_hot_types(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs_is(nargs, HOT_TYPES, "set_hot_types")) return NULL;
    ferry_state *st = mod_state(mod);
    PyTypeObject *bases[HOT_TYPES] = {st->BufferFieldsType, st->ArrayFieldsType, st->BlockFieldsType,
                                      st->HealthFieldsType, st->SlotFieldsType};
    for (int i = 0; i < HOT_TYPES; i++) {
        if (!PyType_Check(args[i]) || !PyType_IsSubtype((PyTypeObject *)args[i], bases[i])) {
            PyErr_Format(PyExc_TypeError, "set_hot_types: argument %d must derive from %R", i + 1,
                         (PyObject *)bases[i]);
            return NULL;
        }
    }
    for (int i = 0; i < HOT_TYPES; i++) {
        PyObject *old = st->hot_types[i];
        st->hot_types[i] = Py_NewRef(args[i]);
        Py_XDECREF(old);
    }
    Py_RETURN_NONE;
}
