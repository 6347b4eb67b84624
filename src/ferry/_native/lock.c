/*
 * lock.c: RLock, threading.RLock's semantics with a compare-and-swap fast path (the runtime's lock).
 *
 * The hot take and give (rlock_take / rlock_give) are inline in native.h so that the compiled entries
 * take the lock without a call; this file holds the type itself. Invariants: the owner and the count
 * are read and written with the GIL held; `held` is the only field threads contend for; a blocked
 * acquire sleeps with the GIL released, in slices, running signal handlers between them.
 */
#include "native.h"

/* -- RLock: the runtime's lock, takeable from C without a call ------------------------------------- */

/*
 * threading.RLock's semantics (reentrant, owned by a thread, acquire(blocking=True, timeout=-1),
 * release(), the context manager), with what matters on the small-transfer path made cheap: a free
 * lock is taken with one compare-and-swap (threading.RLock's acquire parses its arguments, and
 * PyThread_acquire_lock_timed reads the clock even when it does not wait: about 30 and 20 ns), and
 * the compiled submit and wait take and give it with a C call (rlock_take / rlock_give). A thread that
 * must wait releases the GIL and sleeps on a condition variable in slices of RLOCK_SLICE_NS, running
 * signal handlers between them, so Ctrl-C reaches a blocked acquire within that. The owner and count
 * are read and written with the GIL held; `held` is what threads contend for.
 */


atomic_uint fork_generation;

static void count_fork(void) { atomic_fetch_add(&fork_generation, 1); }

/* Count forks from now on (module.c calls it once per process, at import). 0, or -1 with an error. */
int lock_count_forks(void) {
    static int done;
    if (done) return 0;
    if (pthread_atfork(NULL, NULL, count_fork)) {
        PyErr_SetString(PyExc_RuntimeError, "pthread_atfork failed");
        return -1;
    }
    done = 1;
    return 0;
}

static PyObject *RLock_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if ((args && PyTuple_Size(args)) || (kwds && PyDict_Size(kwds))) {
        PyErr_SetString(PyExc_TypeError, "RLock() takes no arguments");
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    RLockObject *self = (RLockObject *)alloc(type, 0);
    if (!self) return NULL;
    atomic_init(&self->held, 0);
    atomic_init(&self->sleepers, 0);
    if (pthread_mutex_init(&self->mu, NULL)) {
        Py_DECREF(self);
        PyErr_SetString(PyExc_MemoryError, "cannot initialize a lock");
        return NULL;
    }
    if (cond_init_monotonic(&self->cv)) {
        pthread_mutex_destroy(&self->mu);
        Py_DECREF(self);
        PyErr_SetString(PyExc_MemoryError, "cannot initialize a lock");
        return NULL;
    }
    self->ready = 1;
    self->pid = getpid();
    return (PyObject *)self;
}

/* The mutex, condition and sleeper count, made again in a forked child (GIL held): the parent's threads do
 * not exist there, and their state (a sleeper count, a mutex one of them held) would block the child. Only
 * the contended paths call it: getpid() is a system call. 0, or -1 with MemoryError. */
int rlock_sleep_ready(RLockObject *self) {
    pid_t now = getpid();
    if (self->pid == now) return 0;
    if (pthread_mutex_init(&self->mu, NULL) || cond_init_monotonic(&self->cv)) {
        PyErr_SetString(PyExc_MemoryError, "cannot initialize a lock in a forked child");
        return -1;
    }
    atomic_store(&self->sleepers, 0);
    self->pid = now;
    return 0;
}

static void RLock_dealloc(PyObject *obj) {
    RLockObject *self = (RLockObject *)obj;
    PyTypeObject *tp = Py_TYPE(obj);
    if (self->weakreflist) PyObject_ClearWeakRefs(obj);
    if (self->ready) { /* no thread can wait on an object being deallocated */
        pthread_cond_destroy(&self->cv);
        pthread_mutex_destroy(&self->mu);
    }
    freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    f(obj);
    Py_DECREF((PyObject *)tp);
}





/* acquire(blocking=True, timeout=-1) -> bool, as threading.RLock's */
static PyObject *RLock_acquire(PyObject *obj, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *blocking_obj = NULL, *timeout_obj = NULL;
    Py_ssize_t nkw = kwnames ? PyTuple_Size(kwnames) : 0;
    if (nargs > 2) {
        PyErr_Format(PyExc_TypeError, "acquire() takes at most 2 arguments (%zd given)", nargs);
        return NULL;
    }
    if (nargs > 0) blocking_obj = args[0];
    if (nargs > 1) timeout_obj = args[1];
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *name = PyTuple_GetItem(kwnames, i);
        PyObject **slot = PyUnicode_CompareWithASCIIString(name, "blocking") == 0  ? &blocking_obj
                          : PyUnicode_CompareWithASCIIString(name, "timeout") == 0 ? &timeout_obj
                                                                                     : NULL;
        if (!slot) {
            PyErr_Format(PyExc_TypeError, "acquire() got an unexpected keyword argument '%U'", name);
            return NULL;
        }
        if (*slot) {
            PyErr_Format(PyExc_TypeError, "acquire() got multiple values for argument '%U'", name);
            return NULL;
        }
        *slot = args[nargs + i];
    }
    int blocking = 1;
    if (blocking_obj && (blocking = PyObject_IsTrue(blocking_obj)) < 0) return NULL;
    double timeout = -1.0;
    if (timeout_obj && timeout_obj != Py_None) {
        timeout = PyFloat_AsDouble(timeout_obj);
        if (timeout == -1.0 && PyErr_Occurred()) return NULL;
        if (timeout != timeout) {
            PyErr_SetString(PyExc_ValueError, "Invalid value NaN (not a number)");
            return NULL;
        }
    }
    if (!blocking && timeout != -1.0) {
        PyErr_SetString(PyExc_ValueError, "can't specify a timeout for a non-blocking call");
        return NULL;
    }
    if (timeout < 0 && timeout != -1.0) {
        PyErr_SetString(PyExc_ValueError, "timeout value must be a non-negative number");
        return NULL;
    }
    if (timeout > (double)(LLONG_MAX / 1000) / 1e6) { /* PY_TIMEOUT_MAX on Linux (not in the limited API) */
        PyErr_SetString(PyExc_OverflowError, "timeout value is too large");
        return NULL;
    }
    /* rounded up, as threading's: a timeout under a microsecond still waits */
    long long us = !blocking ? 0 : timeout < 0 ? -1 : (long long)(timeout * 1e6);
    if (us > 0 && (double)us < timeout * 1e6) us++;
    else if (us == 0 && blocking && timeout > 0) us = 1;
    int got = rlock_take((RLockObject *)obj, us);
    if (got < 0) return NULL;
    return PyBool_FromLong(got);
}

static PyObject *RLock_release(PyObject *obj, PyObject *Py_UNUSED(arg)) {
    if (rlock_give((RLockObject *)obj)) return NULL;
    Py_RETURN_NONE;
}

static PyObject *RLock_enter(PyObject *obj, PyObject *Py_UNUSED(arg)) {
    if (rlock_take((RLockObject *)obj, -1) < 0) return NULL;
    Py_RETURN_TRUE;
}

static PyObject *RLock_exit(PyObject *obj, PyObject *const *Py_UNUSED(args), Py_ssize_t Py_UNUSED(nargs)) {
    if (rlock_give((RLockObject *)obj)) return NULL;
    Py_RETURN_NONE;
}

/* _is_owned(): whether the calling thread holds it (threading.Condition's protocol) */
static PyObject *RLock_is_owned(PyObject *obj, PyObject *Py_UNUSED(arg)) {
    RLockObject *self = (RLockObject *)obj;
    return PyBool_FromLong(self->count && self->owner == PyThread_get_thread_ident());
}

/* _release_save() -> (count, owner): give it back entirely (threading.Condition's protocol) */
static PyObject *RLock_release_save(PyObject *obj, PyObject *Py_UNUSED(arg)) {
    RLockObject *self = (RLockObject *)obj;
    if (!self->count || self->owner != PyThread_get_thread_ident()) {
        PyErr_SetString(PyExc_RuntimeError, "cannot release un-acquired lock");
        return NULL;
    }
    PyObject *state = Py_BuildValue("(kk)", self->count, self->owner);
    if (!state) return NULL;
    self->count = 1;
    rlock_give(self);
    return state;
}

/* _acquire_restore((count, owner)): take it again as it was (threading.Condition's protocol) */
static PyObject *RLock_acquire_restore(PyObject *obj, PyObject *state) {
    RLockObject *self = (RLockObject *)obj;
    unsigned long count, owner;
    if (!PyArg_ParseTuple(state, "kk:_acquire_restore", &count, &owner)) return NULL;
    if (count == 0) {
        PyErr_SetString(PyExc_ValueError, "_acquire_restore: a count of 0");
        return NULL;
    }
    int got = rlock_take(self, -1);
    if (got != 1) return NULL;
    self->count = count;
    self->owner = owner;
    Py_RETURN_NONE;
}

static PyObject *RLock_repr(PyObject *obj) {
    RLockObject *self = (RLockObject *)obj;
    return PyUnicode_FromFormat("<ferry RLock %s owner=%lu count=%lu>", self->count ? "locked" : "unlocked",
                                self->count ? self->owner : 0UL, self->count);
}

static PyMethodDef RLock_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))RLock_acquire, METH_FASTCALL | METH_KEYWORDS,
     "acquire(blocking=True, timeout=-1) -> bool: take the lock (again, if this thread holds it)"},
    {"release", RLock_release, METH_NOARGS, "release(): give it back once; RuntimeError if not held"},
    {"__enter__", RLock_enter, METH_NOARGS, "acquire()"},
    {"__exit__", (PyCFunction)(void (*)(void))RLock_exit, METH_FASTCALL, "release()"},
    {"_is_owned", RLock_is_owned, METH_NOARGS, "whether the calling thread holds it"},
    {"_release_save", RLock_release_save, METH_NOARGS, "give it back entirely: (count, owner) (Condition's)"},
    {"_acquire_restore", RLock_acquire_restore, METH_O, "take it again as _release_save left it (Condition's)"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef RLock_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(RLockObject, weakreflist), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot RLock_slots[] = {
    {Py_tp_new, RLock_new},
    {Py_tp_dealloc, RLock_dealloc},
    {Py_tp_methods, RLock_methods},
    {Py_tp_members, RLock_members},
    {Py_tp_repr, RLock_repr},
    {Py_tp_doc, "RLock(): threading.RLock's semantics, takeable from C (the runtime's lock)"},
    {0, NULL},
};

PyType_Spec RLock_spec = {
    "ferry._native._engine.RLock",
    sizeof(RLockObject),
    0,
    Py_TPFLAGS_DEFAULT,
    RLock_slots,
};

