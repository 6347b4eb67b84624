/*
 * records.c: Record (a transfer's record) and Handle (the compiled base of ferry's handles).
 *
 * Both are made in one C call, without a Python __init__. Invariants: their fields match the Python
 * twins in ferry/_records.py and ferry/_pending.py (tests/test_native_calls.py checks it); both are
 * GC types (a record can sit in a cycle through its signal's listeners); a Handle's port and record
 * are never rebound once made (the C wait holds them across calls that release the GIL).
 */
#include "native.h"

/* -- Record: a transfer's record, made in C ----------------------------------------------------------- */

/*
 * The completion part's Record (ferry/_records.py holds the Python twin that runs without this extension,
 * ferry/_completion.py the contract): the same fields, all plain attributes, made in one C call. A Python class
 * with __slots__ costs a Python __init__ and seventeen attribute stores per transfer; this costs an
 * allocation. The fields and their defaults must match the Python class (tests/test_native_calls.py
 * checks that they do). It is a GC type: a record can sit in a cycle (its signal's listeners hold a
 * future that holds the handle that holds the record).
 */







static PyObject *Record_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    ferry_state *st = (ferry_state *)PyType_GetModuleState(type); /* Record cannot be subclassed */
    if (!st) return NULL;
    if ((kwds && PyDict_Size(kwds)) || PyTuple_Size(args) != 7 || type != st->RecordType) {
        PyErr_SetString(PyExc_TypeError, "Record(seq, event, stream, moved, leased, result, nbytes)");
        return NULL;
    }
    PyObject *items[7];
    for (int i = 0; i < 7; i++) items[i] = PyTuple_GetItem(args, i);
    return record_make(st, items);
}

/* new_record(seq, event, stream, moved, leased, result, nbytes): Record(...) without the type call. */
PyObject *mod_new_record(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs_is(nargs, 7, "new_record")) return NULL;
    return record_make(mod_state(mod), args);
}

static int Record_traverse(PyObject *obj, visitproc visit, void *arg) {
    PyObject **f = record_fields((RecordObject *)obj);
    for (int i = 0; i < RECORD_FIELDS; i++) Py_VISIT(f[i]);
    Py_VISIT((PyObject *)Py_TYPE(obj));
    return 0;
}

static int Record_clear(PyObject *obj) {
    PyObject **f = record_fields((RecordObject *)obj);
    for (int i = 0; i < RECORD_FIELDS; i++) Py_CLEAR(f[i]);
    return 0;
}

static void Record_dealloc(PyObject *obj) {
    PyTypeObject *tp = Py_TYPE(obj);
    PyObject_GC_UnTrack(obj);
    Record_clear(obj);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(obj);
    Py_DECREF(tp);
}

static PyObject *Record_repr(PyObject *obj) {
    RecordObject *self = (RecordObject *)obj;
    int failed = self->error ? PyObject_IsTrue(self->error) : 0;
    int done = self->done ? PyObject_IsTrue(self->done) : 0;
    if (failed < 0 || done < 0) return NULL;
    const char *status = failed ? "failed" : done ? "done" : "pending";
    return PyUnicode_FromFormat("<transfer record #%R %R bytes %s>", self->seq ? self->seq : Py_None,
                                self->nbytes ? self->nbytes : Py_None, status);
}

#define RECORD_MEMBER(name) {#name, T_OBJECT_EX, offsetof(RecordObject, name), 0, NULL}

static PyMemberDef Record_members[] = {
    RECORD_MEMBER(seq),     RECORD_MEMBER(event),  RECORD_MEMBER(stream),  RECORD_MEMBER(moved),
    RECORD_MEMBER(leased),  RECORD_MEMBER(result), RECORD_MEMBER(nbytes),  RECORD_MEMBER(done),
    RECORD_MEMBER(error),   RECORD_MEMBER(extra),  RECORD_MEMBER(settled), RECORD_MEMBER(claimed),
    RECORD_MEMBER(waiters), RECORD_MEMBER(spun),   RECORD_MEMBER(signal),  RECORD_MEMBER(batch),
    RECORD_MEMBER(shared),  RECORD_MEMBER(napped), {NULL, 0, 0, 0, NULL},
};

/* A field is set, never deleted: the compiled wait and settle read every field unchecked. */
static int Record_setattro(PyObject *obj, PyObject *name, PyObject *value) {
    if (!value) {
        PyErr_Format(PyExc_AttributeError, "a transfer record's field %R cannot be deleted", name);
        return -1;
    }
    return PyObject_GenericSetAttr(obj, name, value);
}

static PyType_Slot Record_slots[] = {
    {Py_tp_new, Record_new},
    {Py_tp_setattro, Record_setattro},
    {Py_tp_dealloc, Record_dealloc},
    {Py_tp_traverse, Record_traverse},
    {Py_tp_clear, Record_clear},
    {Py_tp_repr, Record_repr},
    {Py_tp_members, Record_members},
    {Py_tp_doc, "Record(seq, event, stream, moved, leased, result, nbytes): a transfer's record "
                "(see ferry/_records.py)."},
    {0, NULL},
};

PyType_Spec Record_spec = {
    "ferry._native._engine.Record",
    sizeof(RecordObject),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    Record_slots,
};

/* -- Handle: the base of the transfer handles (ferry/_pending.py) ------------------------------------- */

/*
 * ferry.Pending derives from this where the extension runs (from its Python twin, _pending._PyHandle,
 * elsewhere): the same five fields (_port, _record, _waited, _claimed, _future), made without a Python
 * __init__, and the two calls every transfer makes: wait() (the port's wait, through Fast.wait in C
 * when it is that) and the finalizer (a handle dropped unwaited detaches its record: port.detach(record),
 * never raising, never during interpreter shutdown; a waited one does nothing). Handle itself is not
 * instantiated: only its Python subclasses are.
 */



#define HANDLE_FIELDS 5

static PyObject **handle_fields(HandleObject *self) { return &self->port; }

static void Handle_dealloc(PyObject *obj);

static PyObject *Handle_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *port, *record;
    /* Handle itself (of any module) is the only type whose own dealloc is Handle_dealloc: a Python
     * subclass's is CPython's subtype_dealloc, which reaches it through the base */
    if ((destructor)PyType_GetSlot(type, Py_tp_dealloc) == Handle_dealloc) {
        PyErr_SetString(PyExc_TypeError, "Handle is a base class: handles come from the runtime's submissions");
        return NULL;
    }
    if ((kwds && PyDict_Size(kwds)) || !PyArg_UnpackTuple(args, "Handle", 2, 2, &port, &record)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "Handle(port, record)");
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    HandleObject *self = (HandleObject *)alloc(type, 0);
    if (!self) return NULL;
    Py_INCREF(port);
    self->port = port;
    Py_INCREF(record);
    self->record = record;
    Py_INCREF(Py_False);
    self->waited = Py_False;
    Py_INCREF(Py_False);
    self->claimed = Py_False;
    Py_INCREF(Py_None);
    self->future = Py_None;
    return (PyObject *)self;
}

static int Handle_traverse(PyObject *obj, visitproc visit, void *arg) {
    PyObject **f = handle_fields((HandleObject *)obj);
    for (int i = 0; i < HANDLE_FIELDS; i++) Py_VISIT(f[i]);
    Py_VISIT((PyObject *)Py_TYPE(obj));
    return 0;
}

static int Handle_clear(PyObject *obj) {
    PyObject **f = handle_fields((HandleObject *)obj);
    for (int i = 0; i < HANDLE_FIELDS; i++) Py_CLEAR(f[i]);
    return 0;
}

static void Handle_dealloc(PyObject *obj) {
    PyTypeObject *tp = Py_TYPE(obj);
    PyObject_GC_UnTrack(obj);
    Handle_clear(obj);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(obj);
    Py_DECREF(tp);
}

/* A handle dropped unwaited: its record to the retirement queue (port.detach). Never raises. */
static void Handle_finalize(PyObject *obj) {
    HandleObject *self = (HandleObject *)obj;
    if (!self->waited || self->waited == Py_True || !self->port || !self->record) return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    int waited = PyObject_IsTrue(self->waited);
    ferry_state *st = waited == 0 ? state_of_type(Py_TYPE(obj)) : NULL; /* NULL: its module is torn down */
    PyObject *finalizing = st && st->sys_is_finalizing ? PyObject_CallNoArgs(st->sys_is_finalizing) : NULL;
    if (finalizing && finalizing == Py_False) {
        PyObject *r = PyObject_CallMethodObjArgs(self->port, st->S_detach, self->record, NULL);
        Py_XDECREF(r);
    }
    Py_XDECREF(finalizing);
    PyErr_Clear(); /* a finalizer never raises */
    PyErr_Restore(type, value, tb);
}

/* wait(timeout=None): the port's wait, at most once (Pending.wait's contract). */
static PyObject *Handle_wait(PyObject *obj, PyTypeObject *defining, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames) {
    HandleObject *self = (HandleObject *)obj;
    ferry_state *st = (ferry_state *)PyType_GetModuleState(defining); /* Handle's module */
    if (!st) return NULL;
    PyObject *timeout = Py_None;
    Py_ssize_t nkw = kwnames ? PyTuple_Size(kwnames) : 0;
    if (nargs + nkw > 1) {
        PyErr_SetString(PyExc_TypeError, "wait() takes at most 1 argument (timeout)");
        return NULL;
    }
    if (nargs == 1) {
        timeout = args[0];
    } else if (nkw == 1) {
        PyObject *name = PyTuple_GetItem(kwnames, 0);
        if (PyUnicode_CompareWithASCIIString(name, "timeout") != 0) {
            PyErr_Format(PyExc_TypeError, "wait() got an unexpected keyword argument '%U'", name);
            return NULL;
        }
        timeout = args[0];
    }
    if (!self->port || !self->record || !self->claimed) {
        PyErr_SetString(PyExc_AttributeError, "this handle's fields were deleted");
        return NULL;
    }
    int claimed = PyObject_IsTrue(self->claimed);
    if (claimed) {
        if (claimed > 0)
            PyErr_SetString(st->handle_waited_error ? st->handle_waited_error : PyExc_RuntimeError,
                            "this transfer was already waited; a handle is waited at most once");
        return NULL;
    }
    PyObject *fn = PyObject_GetAttr(self->port, st->S_wait);
    if (!fn) return NULL;
    PyObject *record = self->record;
    Py_INCREF(record); /* the handle's field may be rebound while the wait releases the GIL */
    PyObject *a[2] = {record, timeout};
    PyObject *result;
    if (PyCFunction_Check(fn) && PyCFunction_GetFunction(fn) == (PyCFunction)(void (*)(void))Fast_wait)
        result = Fast_wait(PyCFunction_GetSelf(fn), a, timeout == Py_None ? 1 : 2);
    else
        result = call_args(fn, a, 2);
    Py_DECREF(fn);
    Py_DECREF(record);
    if (!result) return NULL;
    set_field(&self->waited, Py_True);
    set_field(&self->claimed, Py_True);
    return result;
}

/* set_handle_errors(waited_error): the exception a second wait() raises (ferry.FerryError). */
PyObject *mod_set_handle_errors(PyObject *mod, PyObject *arg) {
    ferry_state *st = mod_state(mod);
    PyObject *old = st->handle_waited_error;
    Py_INCREF(arg);
    st->handle_waited_error = arg;
    Py_XDECREF(old);
    Py_RETURN_NONE;
}

/* T_OBJECT_EX: a deleted field reads as AttributeError, as a __slots__ one does; the port and the
 * record are never rebound (the C code holds them across calls that release the GIL) */
#define HANDLE_MEMBER(name, field, flags) {name, T_OBJECT_EX, offsetof(HandleObject, field), flags, NULL}

static PyMemberDef Handle_members[] = {
    HANDLE_MEMBER("_port", port, READONLY),      HANDLE_MEMBER("_record", record, READONLY),
    HANDLE_MEMBER("_waited", waited, 0),         HANDLE_MEMBER("_claimed", claimed, 0),
    HANDLE_MEMBER("_future", future, 0),         {NULL, 0, 0, 0, NULL},
};

/* Python subclasses may chain __init__ (super().__init__(port, record)): the fields are set in tp_new */
static int Handle_init(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kwds)) {
    return 0;
}

static PyMethodDef Handle_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))Handle_wait, METH_METHOD | METH_FASTCALL | METH_KEYWORDS,
     "wait($self, /, timeout=None)\n--\n\n"
     "Block until the copy completed, then hand back what was handed in.\n\n"
     "At most once per handle (a second call raises FerryError). timeout=None waits without bound; "
     "TimeoutError after timeout seconds, and Ctrl-C, leave the handle pending. TransferFailedError: the "
     "device reported a failure, nothing is published, the objects stay abandoned. See ferry.Pending.wait "
     "in ferry/_pending.py for the whole contract."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Handle_slots[] = {
    {Py_tp_new, Handle_new},
    {Py_tp_init, Handle_init},
    {Py_tp_dealloc, Handle_dealloc},
    {Py_tp_traverse, Handle_traverse},
    {Py_tp_clear, Handle_clear},
    {Py_tp_finalize, Handle_finalize},
    {Py_tp_members, Handle_members},
    {Py_tp_methods, Handle_methods},
    {Py_tp_doc, "Handle(port, record): the compiled base of ferry's transfer handles (see ferry/_pending.py)."},
    {0, NULL},
};

PyType_Spec Handle_spec = {
    "ferry._native._engine.Handle",
    sizeof(HandleObject),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    Handle_slots,
};

