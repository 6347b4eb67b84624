/*
 * engine.c: the staging engine's Python types, Engine and Job (the work is core/'s).
 *
 * Engine(direction, ...) checks its arguments, builds an engine_t, starts its lanes (and the driver
 * thread) with the GIL released and waits until every lane set up; submit() turns a NumPy array's
 * addresses, shape and strides into a job and queues its shares. Invariants: an Engine is used only in
 * the process that made it (a forked child gets RuntimeError; its tp_dealloc leaks on purpose, since
 * the threads do not exist there); a Job holds a reference to its Engine, and the C job one reference
 * per share plus one for the Job object, so a job outlives every lane that still works on it;
 * close() returns only once every queued job ran and every thread was joined; every wait releases
 * the GIL and checks Python signals at least every JOB_SLICE_NS.
 */
#include "native.h"

/* ================================================================================================
 * Python types
 * ================================================================================================ */


typedef struct {
    PyObject_HEAD
    engine_t *eng;
    pid_t pid;
    int closed;
    int abandoned; /* left at interpreter exit with copies in flight: never closed, never freed */
} EngineObject;

typedef struct {
    PyObject_HEAD
    job_t *job;
    PyObject *engine; /* keeps the engine alive */
} JobObject;

static int check_process(EngineObject *self) {
    if (self->abandoned) {
        PyErr_SetString(PyExc_RuntimeError, "this staging engine was left at interpreter exit; it cannot be used");
        return -1;
    }
    if (self->pid != getpid()) {
        PyErr_SetString(PyExc_RuntimeError,
                        "this staging engine was created in another process (a fork); it cannot be used here");
        return -1;
    }
    return 0;
}

static int check_open(EngineObject *self) {
    if (check_process(self)) return -1;
    if (self->closed || !self->eng) {
        PyErr_SetString(PyExc_RuntimeError, "the staging engine is closed");
        return -1;
    }
    return 0;
}

static void raise_driver_error(PyTypeObject *type, const err_t *e) {
    ferry_state *st = (ferry_state *)PyType_GetModuleState(type); /* Engine's module */
    PyObject *args = st ? Py_BuildValue("(is)", e->code, e->text) : NULL;
    if (args) {
        PyErr_SetObject(st->DriverError, args);
        Py_DECREF(args);
    }
}

/* -- Engine.__init__ ------------------------------------------------------------------------------- */

static int get_entry_points(PyObject *mapping, driver_t *drv) {
    void **table = (void **)drv;
    for (int i = 0; i < N_DRIVER_NAMES; i++) {
        PyObject *v = PyMapping_GetItemString(mapping, DRIVER_NAMES[i]);
        if (!v) {
            if (i >= DRIVER_REQUIRED && PyErr_ExceptionMatches(PyExc_KeyError)) {
                PyErr_Clear();
                table[i] = NULL;
                continue;
            }
            if (PyErr_ExceptionMatches(PyExc_KeyError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_ValueError, "entry_points lacks %s", DRIVER_NAMES[i]);
            }
            return -1;
        }
        unsigned long long addr = PyLong_AsUnsignedLongLong(v);
        Py_DECREF(v);
        if (PyErr_Occurred()) return -1;
        if (!addr && i < DRIVER_REQUIRED) {
            PyErr_Format(PyExc_ValueError, "entry point %s is NULL (not supported by this driver?)", DRIVER_NAMES[i]);
            return -1;
        }
        table[i] = (void *)(uintptr_t)addr;
    }
    return 0;
}


/* An address: a Python int in [0, 2**64), checked (the "K" format would wrap negative numbers). */
static int address_converter(PyObject *obj, void *out) {
    if (!PyLong_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "an address must be an int");
        return 0;
    }
    unsigned long long v = as_u64(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return 0;
    *(unsigned long long *)out = v;
    return 1;
}

static PyObject *Engine_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"direction",  "mode",    "lanes",     "slots_per_lane", "slot_bytes",
                             "min_chunk_bytes", "context", "entry_points", "bandwidth", "latency", "spin_us",
                             "idle_spin_us", "min_chunks_per_lane", "serialize_driver", "nontemporal",
                             "driver_thread", "wait_spin_us", "one_stream", "lane_wait_us", "helpers",
                             "help_spin_us", "piece_bytes", "lead_copies", "cooperative_max_bytes", NULL};
    const char *direction, *mode = "emulated";
    int lanes = 4, slots = 2;
    Py_ssize_t slot_bytes = 1 << 20, min_chunk = 256 << 10;
    unsigned long long context = 0;
    PyObject *entry_points = Py_None;
    double bandwidth = 25e9, latency = 5e-6, spin_us = 0, idle_spin_us = 0;
    int min_chunks_per_lane = 1, serialize_driver = 1, nontemporal = 1, driver_thread = 1, one_stream = 0;
    double wait_spin_us = 0, lane_wait_us = DT_LANE_SLEEP_NS / 1e3, help_spin_us = 200;
    int helpers = 0, lead_copies = 1;
    Py_ssize_t piece_bytes = 128 << 10, coop_max = PY_SSIZE_T_MAX;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "s|$siinnO&Oddddipppdpdidnpn", kwlist, &direction, &mode, &lanes,
                                     &slots, &slot_bytes, &min_chunk, address_converter, &context, &entry_points,
                                     &bandwidth, &latency, &spin_us, &idle_spin_us, &min_chunks_per_lane,
                                     &serialize_driver, &nontemporal, &driver_thread, &wait_spin_us, &one_stream,
                                     &lane_wait_us, &helpers, &help_spin_us, &piece_bytes, &lead_copies,
                                     &coop_max))
        return NULL;
    int upload;
    if (!strcmp(direction, "upload"))
        upload = 1;
    else if (!strcmp(direction, "download"))
        upload = 0;
    else {
        PyErr_Format(PyExc_ValueError, "direction must be 'upload' or 'download', got '%s'", direction);
        return NULL;
    }
    int emulated;
    if (!strcmp(mode, "emulated"))
        emulated = 1;
    else if (!strcmp(mode, "cuda"))
        emulated = 0;
    else {
        PyErr_SetString(PyExc_ValueError, "mode must be 'cuda' or 'emulated'");
        return NULL;
    }
    if (lanes < 1 || lanes > MAX_LANES || slots < 1 || slots > MAX_SLOTS || slot_bytes < 4096 || min_chunk < 4096) {
        PyErr_Format(PyExc_ValueError,
                     "the engine needs 1 <= lanes <= %d, 1 <= slots_per_lane <= %d, slot_bytes >= 4096 and "
                     "min_chunk_bytes >= 4096",
                     MAX_LANES, MAX_SLOTS);
        return NULL;
    }
    if (!(spin_us >= 0 && spin_us <= 1e6 && idle_spin_us >= 0 && idle_spin_us <= 1e6 && wait_spin_us >= 0 &&
          wait_spin_us <= 1e6 && lane_wait_us >= 0 && lane_wait_us <= 1e6)) {
        PyErr_SetString(PyExc_ValueError, "spin_us, idle_spin_us, wait_spin_us and lane_wait_us must be in [0, 1e6]");
        return NULL;
    }
    if (helpers < 0 || helpers >= lanes || !(help_spin_us >= 0 && help_spin_us <= 1e7) ||
        piece_bytes < (Py_ssize_t)COPIER_MIN_PIECE || (!lead_copies && !helpers) || coop_max < 0) {
        PyErr_Format(PyExc_ValueError,
                     "the engine needs 0 <= helpers < lanes, help_spin_us in [0, 1e7], piece_bytes >= %zu, "
                     "cooperative_max_bytes >= 0, and helpers for lead_copies=False",
                     COPIER_MIN_PIECE);
        return NULL;
    }
    if (min_chunks_per_lane < 1 || min_chunks_per_lane > 64) {
        PyErr_SetString(PyExc_ValueError, "min_chunks_per_lane must be in [1, 64]");
        return NULL;
    }
    if (emulated && !(bandwidth > 0 && bandwidth <= 1e15 && latency >= 0 && latency <= 3600)) {
        PyErr_SetString(PyExc_ValueError, "emulated bandwidth must be in (0, 1e15] and latency in [0, 3600] s");
        return NULL;
    }
    /* the staging memory, lanes * slots_per_lane * slot_bytes, counted in a long long (held_bytes) */
    if ((unsigned long long)slot_bytes > (unsigned long long)LLONG_MAX / (unsigned long long)lanes / (unsigned long long)slots) {
        PyErr_SetString(PyExc_ValueError, "lanes * slots_per_lane * slot_bytes is too large");
        return NULL;
    }
    driver_t drv;
    memset(&drv, 0, sizeof drv);
    if (!emulated) {
        if (entry_points == Py_None || !context) {
            PyErr_SetString(PyExc_ValueError, "mode='cuda' needs context and entry_points");
            return NULL;
        }
        if (get_entry_points(entry_points, &drv)) return NULL;
    }
    engine_t *eng = calloc(1, sizeof *eng);
    if (!eng) return PyErr_NoMemory();
    eng->emulated = emulated;
    eng->upload = upload;
    eng->nlanes = lanes;
    eng->slots_per_lane = slots;
    eng->slot_bytes = (size_t)slot_bytes;
    eng->min_chunk_bytes = (size_t)min_chunk;
    eng->bandwidth = bandwidth;
    eng->latency = latency;
    eng->spin_ns = (int64_t)(spin_us * 1e3);
    eng->idle_spin_ns = (int64_t)(idle_spin_us * 1e3);
    eng->min_chunks_per_lane = min_chunks_per_lane;
    eng->serialize = !emulated && serialize_driver;
    eng->nontemporal = nontemporal;
    eng->wait_spin_ns = (int64_t)(wait_spin_us * 1e3);
    eng->lane_wait_ns = (int64_t)(lane_wait_us * 1e3);
    eng->helpers = helpers;
    eng->lead_copies = lead_copies;
    eng->piece_bytes = (size_t)piece_bytes;
    eng->coop_max_bytes = (size_t)coop_max;
    eng->help_spin_ns = (int64_t)(help_spin_us * 1e3);
    atomic_init(&eng->leads, 0);
    atomic_init(&eng->idle_sleepers, 0);
    atomic_init(&eng->helping, 0);
    atomic_init(&eng->waking, 0);
    atomic_init(&eng->task_seq, 0);
    atomic_init(&eng->helped, 0);
    atomic_init(&eng->coop_jobs, 0);
    eng->ctx = (CUcontext)(uintptr_t)context;
    eng->drv = drv;
    eng->pid = getpid();
    atomic_init(&eng->held, 0);
    atomic_init(&eng->held_bytes, 0);
    atomic_init(&eng->abandoned_bytes, 0);
    atomic_init(&eng->poison, 0);
    err_t e;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = engine_start(eng, driver_thread, one_stream, &e); /* frees eng on failure */
    Py_END_ALLOW_THREADS
    if (rc == ENGINE_SETUP_FAILED) {
        raise_driver_error(type, &e);
        return NULL;
    }
    if (rc) {
        if (rc == ENGINE_NO_MEMORY) PyErr_NoMemory();
        else PyErr_SetString(PyExc_RuntimeError, "could not start the staging threads");
        return NULL;
    }
    PyObject *obj = PyType_GenericAlloc(type, 0);
    if (!obj) {
        Py_BEGIN_ALLOW_THREADS
        engine_stop_lanes(eng);
        Py_END_ALLOW_THREADS
        engine_free(eng);
        return NULL;
    }
    EngineObject *self = (EngineObject *)obj;
    self->eng = eng;
    self->pid = eng->pid;
    self->closed = 0;
    self->abandoned = 0;
    return obj;
}

/* Close once; a close that finds another one draining the lanes waits until it is done (GIL released),
 * so that every close() returns only once every job ran. */
static void engine_close(EngineObject *self) {
    engine_t *eng = self->eng;
    if (!eng) return;
    if (self->closed) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&eng->mu);
        while (!eng->closed) pthread_cond_wait(&eng->cv, &eng->mu);
        pthread_mutex_unlock(&eng->mu);
        Py_END_ALLOW_THREADS
        return;
    }
    self->closed = 1;
    Py_BEGIN_ALLOW_THREADS
    engine_stop_lanes(eng);
    pthread_mutex_lock(&eng->mu);
    eng->closed = 1;
    pthread_cond_broadcast(&eng->cv);
    pthread_mutex_unlock(&eng->mu);
    Py_END_ALLOW_THREADS
}

static void Engine_dealloc(PyObject *obj) {
    EngineObject *self = (EngineObject *)obj;
    PyTypeObject *tp = Py_TYPE(obj);
    if (self->eng) {
        if (self->pid == getpid() && !self->abandoned) {
            engine_close(self);
            engine_free(self->eng);
        } /* else: a forked child (the threads do not exist here), or an engine left at interpreter exit (its
           * lanes would free slots a held copy may still use, and the driver's free waits for the device):
           * leak on purpose, the process is ending */
        self->eng = NULL;
    }
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(obj);
    Py_DECREF(tp);
}

/* abandon(): the interpreter exits with copies in flight; from now on the engine refuses every call, and its
 * dealloc neither joins its lanes nor frees anything (the operating system reclaims it). */
static PyObject *Engine_abandon(PyObject *obj, PyObject *Py_UNUSED(ignored)) {
    ((EngineObject *)obj)->abandoned = 1;
    Py_RETURN_NONE;
}

static PyObject *Engine_close(PyObject *obj, PyObject *Py_UNUSED(ignored)) {
    EngineObject *self = (EngineObject *)obj;
    if (check_process(self)) return NULL;
    engine_close(self);
    Py_RETURN_NONE;
}

static PyObject *Engine_chunk_bytes(PyObject *obj, PyObject *arg) {
    EngineObject *self = (EngineObject *)obj;
    if (check_open(self)) return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "nbytes must be >= 0");
        return NULL;
    }
    engine_t *eng = self->eng;
    return PyLong_FromSize_t(is_coop(eng, 1, (size_t)n) ? coop_chunk(eng, (size_t)n) : auto_chunk(eng, (size_t)n));
}

static int seq_to_ssize(PyObject *seq, ptrdiff_t *out, Py_ssize_t *n, const char *what) {
    Py_ssize_t len = PySequence_Size(seq);
    if (len < 0) return -1;
    if (len > MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "%s has more than %d dimensions", what, MAX_DIMS);
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        PyObject *item = PySequence_GetItem(seq, i);
        if (!item) return -1;
        out[i] = PyLong_AsSsize_t(item);
        Py_DECREF(item);
        if (out[i] == -1 && PyErr_Occurred()) return -1;
    }
    *n = len;
    return 0;
}

/* The end of every submit: the plan's refusal as an exception (nothing queued), else the job wrapped in a
 * Job object (which owns it) and queued; a queue refusal frees it and raises. */
static PyObject *queue_planned(PyObject *obj, job_t *job, int kind, const char *why, int hand_off) {
    if (!job) {
        if (kind == PLAN_NO_MEMORY) return PyErr_NoMemory();
        PyErr_SetString(kind == PLAN_OVERFLOW ? PyExc_OverflowError : PyExc_ValueError, why);
        return NULL;
    }
    ferry_state *st = (ferry_state *)PyType_GetModuleState(Py_TYPE(obj));
    JobObject *jo = st ? (JobObject *)PyType_GenericAlloc(st->JobType, 0) : NULL;
    if (!jo) {
        atomic_store(&job->refs, 1);
        job_decref(job);
        return NULL;
    }
    jo->job = job;
    Py_INCREF(obj);
    jo->engine = obj;
    int rc = engine_queue(((EngineObject *)obj)->eng, job, hand_off);
    if (rc) { /* nothing was queued */
        atomic_store(&job->refs, 1);
        Py_DECREF(jo); /* frees the job */
        if (rc == ENGINE_NO_MEMORY) return PyErr_NoMemory();
        PyErr_SetString(PyExc_RuntimeError, "the staging engine is closed");
        return NULL;
    }
    return (PyObject *)jo;
}

static PyObject *Engine_submit(PyObject *obj, PyObject *args, PyObject *kwds) {
    EngineObject *self = (EngineObject *)obj;
    static char *kwlist[] = {"host_ptr", "device_ptr", "nbytes", "shape", "strides", "itemsize", "chunk_bytes",
                             "hand_off", NULL};
    unsigned long long host_ptr, dev_ptr;
    Py_ssize_t nbytes, itemsize, chunk_bytes = 0;
    PyObject *shape_obj, *strides_obj;
    int hand_off = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&O&nOOn|n$p", kwlist, address_converter, &host_ptr,
                                     address_converter, &dev_ptr, &nbytes, &shape_obj, &strides_obj, &itemsize,
                                     &chunk_bytes, &hand_off))
        return NULL;
    if (check_open(self)) return NULL;
    engine_t *eng = self->eng;
    ptrdiff_t shape[MAX_DIMS], strides[MAX_DIMS];
    Py_ssize_t nd_shape = 0, nd_strides = 0;
    if (seq_to_ssize(shape_obj, shape, &nd_shape, "shape") || seq_to_ssize(strides_obj, strides, &nd_strides, "strides"))
        return NULL;
    if (nd_shape != nd_strides) {
        PyErr_SetString(PyExc_ValueError, "shape and strides differ in length");
        return NULL;
    }
    int kind;
    const char *why;
    job_t *job = job_plan(eng, (char *)(uintptr_t)host_ptr, (CUdeviceptr)dev_ptr, nbytes, (int)nd_shape, shape, strides,
                          itemsize, chunk_bytes, hand_off, &kind, &why);
    return queue_planned(obj, job, kind, why, hand_off);
}

/*
 * submit_file(fd, direct_fd, chunks, dmas, *, direct=False, name="", fail_chunk=-1, fail_errno=0) -> Job:
 * a file job (core/file.c). chunks: (start, length, need, ndma) per chunk, dmas: (slot offset, device
 * address, bytes), both packed as native unsigned 64-bit words (NumPy uint64 arrays' bytes). The plan is
 * copied; the descriptors stay the caller's, open until the job is done. fail_chunk/fail_errno (tests):
 * that chunk's read (or write) fails with that errno.
 */
static PyObject *Engine_submit_file(PyObject *obj, PyObject *args, PyObject *kwds) {
    EngineObject *self = (EngineObject *)obj;
    static char *kwlist[] = {"fd", "direct_fd", "chunks", "dmas", "direct", "name", "fail_chunk", "fail_errno", NULL};
    int fd, direct_fd, direct = 0, fail_errno = 0;
    long long fail_chunk = -1;
    const char *name = "";
    Py_buffer chunks, dmas;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iiy*y*|$psLi", kwlist, &fd, &direct_fd, &chunks, &dmas, &direct,
                                     &name, &fail_chunk, &fail_errno))
        return NULL;
    job_t *job = NULL;
    int kind = PLAN_OK;
    const char *why = "";
    if (check_open(self)) goto refused;
    if (chunks.len % (Py_ssize_t)sizeof(file_chunk_t) || dmas.len % (Py_ssize_t)sizeof(file_dma_t)) {
        PyErr_SetString(PyExc_ValueError, "chunks and dmas must be packed 4 and 3 unsigned 64-bit words each");
        goto refused;
    }
    size_t nchunks = (size_t)chunks.len / sizeof(file_chunk_t), ndmas = (size_t)dmas.len / sizeof(file_dma_t);
    file_chunk_t *cbuf = nchunks ? malloc(nchunks * sizeof *cbuf) : NULL;
    file_dma_t *dbuf = ndmas ? malloc(ndmas * sizeof *dbuf) : NULL;
    if ((nchunks && !cbuf) || (ndmas && !dbuf)) {
        free(cbuf);
        free(dbuf);
        PyErr_NoMemory();
        goto refused;
    }
    if (nchunks) memcpy(cbuf, chunks.buf, nchunks * sizeof *cbuf); /* the buffers may be unaligned */
    if (ndmas) memcpy(dbuf, dmas.buf, ndmas * sizeof *dbuf);
    job = file_job_plan(self->eng, fd, direct_fd, direct, name, cbuf, nchunks, dbuf, ndmas, &kind, &why);
    free(cbuf);
    free(dbuf);
    PyBuffer_Release(&chunks);
    PyBuffer_Release(&dmas);
    if (job) {
        job->file->inject_chunk = fail_chunk;
        job->file->inject_errno = fail_errno;
    }
    return queue_planned(obj, job, kind, why, 0);
refused:
    PyBuffer_Release(&chunks);
    PyBuffer_Release(&dmas);
    return NULL;
}

/* submit_pieces(pieces, *, chunk_bytes=0, hand_off=False) -> Job: one job of many pieces (core/pieces.c);
 * `pieces` is a buffer of native-endian uint64 triples (host address, device address, bytes). */
static PyObject *Engine_submit_pieces(PyObject *obj, PyObject *args, PyObject *kwds) {
    EngineObject *self = (EngineObject *)obj;
    static char *kwlist[] = {"pieces", "chunk_bytes", "hand_off", NULL};
    PyObject *buf_obj;
    Py_ssize_t chunk_bytes = 0;
    int hand_off = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|$np", kwlist, &buf_obj, &chunk_bytes, &hand_off)) return NULL;
    if (check_open(self)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(buf_obj, &view, PyBUF_SIMPLE)) return NULL;
    if (view.len % (Py_ssize_t)(3 * sizeof(uint64_t))) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "pieces must be (host, device, nbytes) uint64 triples");
        return NULL;
    }
    size_t n = (size_t)view.len / (3 * sizeof(uint64_t));
    piece_t *pieces = malloc((n ? n : 1) * sizeof(piece_t));
    if (!pieces) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    const char *raw = view.buf;
    for (size_t i = 0; i < n; i++) {
        uint64_t t[3];
        memcpy(t, raw + i * sizeof t, sizeof t);
        pieces[i].host = (char *)(uintptr_t)t[0];
        pieces[i].dev = (CUdeviceptr)t[1];
        pieces[i].nbytes = (size_t)t[2];
    }
    PyBuffer_Release(&view);
    int kind;
    const char *why;
    job_t *job = job_plan_pieces(self->eng, pieces, n, chunk_bytes, hand_off, &kind, &why); /* takes pieces */
    return queue_planned(obj, job, kind, why, hand_off);
}

static PyObject *Engine_streams(PyObject *obj, PyObject *Py_UNUSED(ignored)) {
    EngineObject *self = (EngineObject *)obj;
    if (check_open(self)) return NULL;
    engine_t *eng = self->eng;
    PyObject *list = PyList_New(0);
    if (!list) return NULL;
    if (eng->dt && eng->dt->stream) { /* one_stream: every DMA is on it */
        PyObject *v = PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)eng->dt->stream);
        if (!v || PyList_Append(list, v)) {
            Py_XDECREF(v);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(v);
        return list;
    }
    for (int i = 0; i < eng->nlanes; i++) {
        uintptr_t h = eng->emulated ? (uintptr_t)eng->lanes[i].es : (uintptr_t)eng->lanes[i].stream;
        PyObject *v = PyLong_FromUnsignedLongLong((unsigned long long)h);
        if (!v || PyList_Append(list, v)) {
            Py_XDECREF(v);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(v);
    }
    return list;
}

static PyObject *Engine_hold(PyObject *obj, PyObject *Py_UNUSED(ignored)) {
    EngineObject *self = (EngineObject *)obj;
    if (check_open(self)) return NULL;
    atomic_store(&self->eng->held, 1);
    Py_RETURN_NONE;
}

static PyObject *Engine_release(PyObject *obj, PyObject *Py_UNUSED(ignored)) {
    EngineObject *self = (EngineObject *)obj;
    if (check_open(self)) return NULL;
    engine_t *eng = self->eng;
    atomic_store(&eng->held, 0);
    pthread_mutex_lock(&eng->mu);
    pthread_cond_broadcast(&eng->cv);
    pthread_mutex_unlock(&eng->mu);
    if (eng->emulated) {
        for (int i = 0; i < eng->nlanes; i++) {
            emu_stream_t *es = eng->lanes[i].es;
            if (!es) continue;
            pthread_mutex_lock(&es->mu);
            pthread_cond_broadcast(&es->cv);
            pthread_mutex_unlock(&es->mu);
        }
    }
    Py_RETURN_NONE;
}

static PyObject *Engine_fail_next_copy(PyObject *obj, PyObject *args, PyObject *kwds) {
    EngineObject *self = (EngineObject *)obj;
    static char *kwlist[] = {"after", "sticky", NULL};
    int after = 0, sticky = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|i$p", kwlist, &after, &sticky)) return NULL;
    if (check_open(self)) return NULL;
    if (!self->eng->emulated) {
        PyErr_SetString(PyExc_RuntimeError, "fail_next_copy is for emulated engines only");
        return NULL;
    }
    if (after < 0) {
        PyErr_SetString(PyExc_ValueError, "after must be >= 0");
        return NULL;
    }
    engine_t *eng = self->eng;
    pthread_mutex_lock(&eng->mu);
    eng->fail_armed = 1;
    eng->fail_after = after;
    eng->fail_sticky = sticky;
    pthread_mutex_unlock(&eng->mu);
    Py_RETURN_NONE;
}

static PyObject *Engine_get_held_bytes(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyLong_FromLongLong(self->eng ? atomic_load(&self->eng->held_bytes) : 0);
}

static PyObject *Engine_get_abandoned_bytes(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyLong_FromLongLong(self->eng ? atomic_load(&self->eng->abandoned_bytes) : 0);
}

static PyObject *Engine_get_closed(PyObject *obj, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(((EngineObject *)obj)->closed);
}

static PyObject *Engine_get_lanes(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyLong_FromLong(self->eng ? self->eng->nlanes : 0);
}

static PyObject *Engine_get_slots_per_lane(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyLong_FromLong(self->eng ? self->eng->slots_per_lane : 0);
}

static PyObject *Engine_get_slot_bytes(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyLong_FromSize_t(self->eng ? self->eng->slot_bytes : 0);
}

static PyObject *Engine_get_direction(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyUnicode_FromString(self->eng && self->eng->upload ? "upload" : "download");
}

static PyObject *Engine_get_driver_thread(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyBool_FromLong(self->eng && self->eng->dt);
}

static PyObject *Engine_get_wait_spin_us(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyFloat_FromDouble(self->eng ? (double)self->eng->wait_spin_ns / 1e3 : 0.0);
}

static PyObject *Engine_get_lane_wait_us(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyFloat_FromDouble(self->eng ? (double)self->eng->lane_wait_ns / 1e3 : 0.0);
}

static PyObject *Engine_get_spin_us(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyFloat_FromDouble(self->eng ? (double)self->eng->spin_ns / 1e3 : 0.0);
}

static PyObject *Engine_get_helpers(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyLong_FromLong(self->eng ? self->eng->helpers : 0);
}

static PyObject *Engine_get_piece_bytes(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyLong_FromSize_t(self->eng ? self->eng->piece_bytes : 0);
}

static PyObject *Engine_get_cooperative_max_bytes(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyLong_FromSize_t(self->eng ? self->eng->coop_max_bytes : 0);
}

static PyObject *Engine_get_helped_pieces(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyLong_FromUnsignedLongLong(self->eng ? atomic_load(&self->eng->helped) : 0);
}

static PyObject *Engine_get_cooperative_jobs(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyLong_FromUnsignedLongLong(self->eng ? atomic_load(&self->eng->coop_jobs) : 0);
}

static PyObject *Engine_get_mode(PyObject *obj, void *Py_UNUSED(closure)) {
    EngineObject *self = (EngineObject *)obj;
    return PyUnicode_FromString(self->eng && self->eng->emulated ? "emulated" : "cuda");
}

static PyMethodDef Engine_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))Engine_submit, METH_VARARGS | METH_KEYWORDS,
     "submit(host_ptr, device_ptr, nbytes, shape, strides, itemsize, chunk_bytes=0, *, hand_off=False)"
     " -> Job"},
    {"submit_pieces", (PyCFunction)(void (*)(void))Engine_submit_pieces, METH_VARARGS | METH_KEYWORDS,
     "submit_pieces(pieces, *, chunk_bytes=0, hand_off=False) -> Job: one job of many pieces (uint64 triples: "
     "host address, device address, bytes); pieces that follow each other on the device share chunks"},
    {"chunk_bytes", Engine_chunk_bytes, METH_O, "chunk_bytes(nbytes) -> the chunk size submit picks"},
    {"submit_file", (PyCFunction)(void (*)(void))Engine_submit_file, METH_VARARGS | METH_KEYWORDS,
     "submit_file(fd, direct_fd, chunks, dmas, *, direct=False, name='', fail_chunk=-1, fail_errno=0) -> Job: "
     "a file job (chunks: uint64 (start, length, need, ndma) each; dmas: uint64 (slot offset, device address, "
     "bytes) each)"},
    {"streams", Engine_streams, METH_NOARGS, "streams() -> the lanes' stream handles"},
    {"hold", Engine_hold, METH_NOARGS, "hold(): no new DMA starts until release()"},
    {"release", Engine_release, METH_NOARGS, "release(): lift a hold"},
    {"fail_next_copy", (PyCFunction)(void (*)(void))Engine_fail_next_copy, METH_VARARGS | METH_KEYWORDS,
     "fail_next_copy(after=0, *, sticky=False): emulated only"},
    {"abandon", Engine_abandon, METH_NOARGS,
     "abandon(): left at interpreter exit with copies in flight: refuse every call, never close or free"},
    {"close", Engine_close, METH_NOARGS, "close(): wait for every queued job, stop the lanes, free the slots"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Engine_getset[] = {
    {"held_bytes", Engine_get_held_bytes, NULL, "staging memory the lanes hold", NULL},
    {"abandoned_bytes", Engine_get_abandoned_bytes, NULL, "staging memory given up after failures", NULL},
    {"closed", Engine_get_closed, NULL, "whether close() ran", NULL},
    {"lanes", Engine_get_lanes, NULL, "lanes (threads, streams)", NULL},
    {"slots_per_lane", Engine_get_slots_per_lane, NULL, "slots per lane", NULL},
    {"slot_bytes", Engine_get_slot_bytes, NULL, "bytes per slot", NULL},
    {"direction", Engine_get_direction, NULL, "'upload' or 'download'", NULL},
    {"mode", Engine_get_mode, NULL, "'cuda' or 'emulated'", NULL},
    {"spin_us", Engine_get_spin_us, NULL, "how long an event or a job is polled before sleeping on it", NULL},
    {"wait_spin_us", Engine_get_wait_spin_us, NULL, "how long Job.wait polls the job before sleeping", NULL},
    {"lane_wait_us", Engine_get_lane_wait_us, NULL,
     "how long a lane waits awake for the driver thread's answer (a DMA's end) before sleeping (at least "
     "20 us of spinning; no effect without the driver thread)",
     NULL},
    {"helpers", Engine_get_helpers, NULL,
     "the most idle lanes that help one cooperative job's lead copy (0: every job's chunks are dealt to lanes)",
     NULL},
    {"piece_bytes", Engine_get_piece_bytes, NULL, "the pieces a cooperative job's chunk copy is cut into", NULL},
    {"cooperative_max_bytes", Engine_get_cooperative_max_bytes, NULL,
     "the largest cooperative job (larger ones are dealt to the lanes)", NULL},
    {"helped_pieces", Engine_get_helped_pieces, NULL, "pieces of cooperative jobs that helpers copied", NULL},
    {"cooperative_jobs", Engine_get_cooperative_jobs, NULL,
     "jobs submitted as cooperative (contiguous, at least two pieces, on an engine with helpers)", NULL},
    {"driver_thread", Engine_get_driver_thread, NULL,
     "whether a driver thread makes the lanes' enqueues (False: each lane calls the driver, or the engine is closed)",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Engine_slots[] = {
    {Py_tp_new, Engine_new},
    {Py_tp_dealloc, Engine_dealloc},
    {Py_tp_methods, Engine_methods},
    {Py_tp_getset, Engine_getset},
    {Py_tp_doc, "Engine(direction, *, mode='emulated', lanes=4, slots_per_lane=2, slot_bytes=1 MiB, "
                "min_chunk_bytes=256 KiB, context=0, entry_points=None, bandwidth=25e9, latency=5e-6, spin_us=0, "
                "idle_spin_us=0, min_chunks_per_lane=1, serialize_driver=True, nontemporal=True, driver_thread=True, "
                "wait_spin_us=0, one_stream=False, lane_wait_us=100, helpers=0, help_spin_us=200, piece_bytes=128 KiB, "
                "lead_copies=True, cooperative_max_bytes=no limit)"},
    {0, NULL},
};

PyType_Spec Engine_spec = {
    "ferry._native._engine.Engine",
    sizeof(EngineObject),
    0,
    Py_TPFLAGS_DEFAULT,
    Engine_slots,
};

/* -- Job ------------------------------------------------------------------------------------------- */

static void Job_dealloc(PyObject *obj) {
    JobObject *self = (JobObject *)obj;
    PyTypeObject *tp = Py_TYPE(obj);
    EngineObject *eo = (EngineObject *)self->engine;
    if (self->job) {
        if (!eo || eo->pid == getpid()) job_decref(self->job); /* in a forked child: leak */
        self->job = NULL;
    }
    Py_XDECREF(self->engine);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(obj);
    Py_DECREF(tp);
}

static PyObject *Job_done(PyObject *obj, PyObject *Py_UNUSED(ignored)) {
    JobObject *self = (JobObject *)obj;
    return PyBool_FromLong(atomic_load_explicit(&self->job->done, memory_order_acquire));
}

/* timeout (None or seconds) -> an absolute deadline (0: already passed); -1 with an exception */
static int deadline_of(PyObject *timeout_obj, int64_t *deadline) {
    *deadline = INT64_MAX;
    if (timeout_obj == Py_None) return 0;
    double t = PyFloat_AsDouble(timeout_obj);
    if (t == -1.0 && PyErr_Occurred()) return -1;
    if (t != t) {
        PyErr_SetString(PyExc_ValueError, "timeout must not be NaN");
        return -1;
    }
    *deadline = t <= 0 ? 0 : t > 1e9 ? INT64_MAX : now_ns() + (int64_t)(t * 1e9);
    return 0;
}

static int job_is_done(job_t *job) { return atomic_load_explicit(&job->done, memory_order_acquire); }
static int job_is_posted(job_t *job) { return atomic_load_explicit(&job->unposted, memory_order_acquire) == 0; }

/*
 * Sleep on the job's condition variable (GIL released, in slices of JOB_SLICE_NS, Python signals
 * checked between them) until holds(job) or the deadline: 1 when it holds, 0 at the deadline, -1 with
 * the exception a signal handler raised. Every change of done or unposted broadcasts under job->mu.
 * A signal does not cut a condition variable's wait short, so the slice bounds how late Ctrl-C is seen
 * (it was 50 ms; a sleeping waiter now wakes 200 times a second).
 */
#define JOB_SLICE_NS 5000000LL

static int job_sleep(job_t *job, int (*holds)(job_t *), int64_t deadline) {
    for (;;) {
        int ok;
        int64_t slice_end = now_ns() + JOB_SLICE_NS;
        if (slice_end > deadline) slice_end = deadline;
        Py_BEGIN_ALLOW_THREADS
        struct timespec ts = ts_of(slice_end);
        pthread_mutex_lock(&job->mu);
        while (!(ok = holds(job))) {
            if (pthread_cond_timedwait(&job->cv, &job->mu, &ts) == ETIMEDOUT) {
                ok = holds(job);
                break;
            }
        }
        pthread_mutex_unlock(&job->mu);
        Py_END_ALLOW_THREADS
        if (ok) return 1;
        if (now_ns() >= deadline) return 0;
        if (PyErr_CheckSignals() < 0) return -1;
    }
}

static int job_of_this_process(JobObject *self) {
    if (((EngineObject *)self->engine)->pid == getpid()) return 0;
    PyErr_SetString(PyExc_RuntimeError, "this job belongs to another process (a fork)");
    return -1;
}

/*
 * Job.wait with wait_spin_us > 0 (a roomy machine, see engine_threads) polls the job until its
 * expected end plus the larger of wait_spin_us and spin_us (with spin_us alone: that long). The
 * expected end is its submission plus nbytes at 1 / WAIT_EXPECT_NS_PER_BYTE (16 GB/s, below every
 * staged figure the H200 measured from 8 MiB), at most WAIT_EXPECT_CAP_NS from now.
 * Without that an 8 MiB job (~330 us) outlasted the 200 us poll and paid a sleeping thread's wake-up
 * (30 - 60 us on the H200 VM). The waiting thread has nothing else to do; the GIL is released while
 * it polls. Job.wait(poll=False), the runtime watcher's, sleeps at once.
 */
#define WAIT_EXPECT_NS_PER_BYTE (1.0 / 16.0)
#define WAIT_EXPECT_CAP_NS 5000000LL

static PyObject *Job_wait(PyObject *obj, PyObject *args, PyObject *kwds) {
    JobObject *self = (JobObject *)obj;
    static char *kwlist[] = {"timeout", "poll", NULL};
    PyObject *timeout_obj = Py_None;
    int poll = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O$p", kwlist, &timeout_obj, &poll)) return NULL;
    job_t *job = self->job;
    if (job_is_done(job)) Py_RETURN_TRUE;
    int64_t deadline;
    if (deadline_of(timeout_obj, &deadline)) return NULL;
    if (deadline == 0) Py_RETURN_FALSE;
    if (job_of_this_process(self)) return NULL;
    EngineObject *eo = (EngineObject *)self->engine;
    int64_t spin_ns = 0, wait_spin_ns = 0;
    if (eo->eng && poll) {
        wait_spin_ns = eo->eng->wait_spin_ns;
        spin_ns = wait_spin_ns > eo->eng->spin_ns ? wait_spin_ns : eo->eng->spin_ns;
    }
    if (spin_ns > 0) {
        int done = 0;
        Py_BEGIN_ALLOW_THREADS
        int64_t now = now_ns(), until = now + spin_ns;
        if (wait_spin_ns > 0) { /* a job that should end soon: poll until then, not a wake-up past it */
            int64_t expected = job->t_submit + (int64_t)((double)job->nbytes * WAIT_EXPECT_NS_PER_BYTE);
            if (expected > WAIT_EXPECT_CAP_NS + now) expected = now + WAIT_EXPECT_CAP_NS;
            if (expected + spin_ns > until) until = expected + spin_ns;
        }
        if (until > deadline) until = deadline;
        while (!(done = job_is_done(job)) && now_ns() < until) cpu_relax();
        Py_END_ALLOW_THREADS
        if (done) Py_RETURN_TRUE;
    }
    int rc = job_sleep(job, job_is_done, deadline);
    if (rc < 0) return NULL;
    return PyBool_FromLong(rc);
}

/*
 * The hand-off: sleep until every share of the job posted, then list the events they posted. Each
 * was recorded on its lane's stream right after the share's last DMA, so a stream that waits for
 * all of them (cuStreamWaitEvent) runs after every DMA of the job. A share that never enqueued its
 * last DMA (the job failed) posts nothing: check the job's error.
 */
static PyObject *Job_hand_off(PyObject *obj, PyObject *args, PyObject *kwds) {
    JobObject *self = (JobObject *)obj;
    static char *kwlist[] = {"timeout", NULL};
    PyObject *timeout_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O", kwlist, &timeout_obj)) return NULL;
    job_t *job = self->job;
    int64_t deadline;
    if (deadline_of(timeout_obj, &deadline) || job_of_this_process(self)) return NULL;
    int rc = job_sleep(job, job_is_posted, deadline);
    if (rc < 0) return NULL;
    if (rc == 0) Py_RETURN_NONE;
    EngineObject *eo = (EngineObject *)self->engine;
    if (eo->closed || !eo->eng) { /* its lanes freed the events: a closed engine ran every job to the end */
        PyErr_SetString(PyExc_RuntimeError, "the staging engine is closed");
        return NULL;
    }
    void *events[MAX_LANES];
    pthread_mutex_lock(&job->mu);
    int n = job->nposted;
    memcpy(events, job->posted, (size_t)n * sizeof events[0]);
    pthread_mutex_unlock(&job->mu);
    PyObject *list = PyList_New(n);
    if (!list) return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *v = PyLong_FromVoidPtr(events[i]);
        if (!v || PyList_SetItem(list, i, v)) { /* steals v */
            Py_DECREF(list);
            return NULL;
        }
    }
    return list;
}

static PyObject *Job_get_error(PyObject *obj, void *Py_UNUSED(closure)) {
    job_t *job = ((JobObject *)obj)->job;
    if (job_of_this_process((JobObject *)obj)) return NULL; /* its mutex may be held by a lane that is not here */
    if (!atomic_load_explicit(&job->failed, memory_order_acquire)) Py_RETURN_NONE;
    err_t e;
    pthread_mutex_lock(&job->mu);
    e = job->err;
    pthread_mutex_unlock(&job->mu);
    return Py_BuildValue("(isO)", e.code, e.text, e.sticky ? Py_True : Py_False);
}

static PyObject *Job_get_host_bytes(PyObject *obj, void *Py_UNUSED(closure)) {
    job_t *job = ((JobObject *)obj)->job;
    return PyLong_FromSize_t(atomic_load_explicit(&job->host_bytes, memory_order_acquire));
}

static PyObject *Job_get_nbytes(PyObject *obj, void *Py_UNUSED(closure)) {
    return PyLong_FromSize_t(((JobObject *)obj)->job->nbytes);
}

static PyObject *Job_get_chunks(PyObject *obj, void *Py_UNUSED(closure)) {
    return PyLong_FromSize_t(((JobObject *)obj)->job->nchunks);
}

static PyObject *Job_get_chunk_bytes(PyObject *obj, void *Py_UNUSED(closure)) {
    return PyLong_FromSize_t(((JobObject *)obj)->job->chunk_bytes);
}

static PyObject *Job_get_lanes(PyObject *obj, void *Py_UNUSED(closure)) {
    return PyLong_FromLong(((JobObject *)obj)->job->nlanes);
}

static PyObject *Job_timeline(PyObject *obj, PyObject *Py_UNUSED(ignored)) {
    job_t *job = ((JobObject *)obj)->job;
    const char *names[] = {"start_first", "start_last", "copy_last", "enqueue_last", "done"};
    atomic_llong *values[] = {&job->t_start_first, &job->t_start_last, &job->t_copy_last, &job->t_enqueue_last,
                              &job->t_done};
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    for (int i = 0; i < 5; i++) {
        long long t = atomic_load_explicit(values[i], memory_order_relaxed);
        PyObject *v = t ? PyFloat_FromDouble((double)(t - job->t_submit) / 1e3) : Py_NewRef(Py_None);
        if (!v || PyDict_SetItemString(d, names[i], v)) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(v);
    }
    const char *sums[] = {"enqueues", "enqueue_us", "lock_wait_us"};
    atomic_llong *sum_values[] = {&job->n_enqueues, &job->enqueue_ns, &job->lock_wait_ns};
    for (int i = 0; i < 3; i++) {
        long long t = atomic_load_explicit(sum_values[i], memory_order_relaxed);
        PyObject *v = i ? PyFloat_FromDouble((double)t / 1e3) : PyLong_FromLongLong(t);
        if (!v || PyDict_SetItemString(d, sums[i], v)) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(v);
    }
    return d;
}

static PyObject *Job_chunk_times(PyObject *obj, PyObject *Py_UNUSED(ignored)) {
    job_t *job = ((JobObject *)obj)->job;
    if (!job_is_done(job)) {
        PyErr_SetString(PyExc_RuntimeError, "chunk_times() needs a finished job");
        return NULL;
    }
    PyObject *list = PyList_New(0);
    if (!list || !job->trace) return list;
    for (size_t k = 0; k < job->nchunks; k++) {
        const chunk_trace_t *t = &job->trace[k];
        PyObject *row = Py_BuildValue("(idddd)", t->lane, (double)(t->t[0] - job->t_submit) / 1e3,
                                      (double)(t->t[1] - job->t_submit) / 1e3, (double)(t->t[2] - job->t_submit) / 1e3,
                                      (double)(t->t[3] - job->t_submit) / 1e3);
        if (!row || PyList_Append(list, row)) {
            Py_XDECREF(row);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(row);
    }
    return list;
}

static PyObject *Job_chunk_sizes(PyObject *obj, PyObject *Py_UNUSED(ignored)) {
    job_t *job = ((JobObject *)obj)->job;
    PyObject *list = PyList_New((Py_ssize_t)job->nchunks);
    if (!list) return NULL;
    chunk_t c;
    for (size_t k = 0; k < job->nchunks; k++) {
        job_chunk(job, k, &c);
        PyObject *v = PyLong_FromSize_t(c.nbytes);
        if (!v || PyList_SetItem(list, (Py_ssize_t)k, v)) { /* steals v */
            Py_DECREF(list);
            return NULL;
        }
    }
    return list;
}

/* A file job's side: cancel, progress, and how it failed on the host. */
static int is_file_job(JobObject *self) {
    if (self->job->file) return 1;
    PyErr_SetString(PyExc_TypeError, "not a file job (Engine.submit_file)");
    return 0;
}

static PyObject *Job_cancel(PyObject *obj, PyObject *Py_UNUSED(ignored)) {
    JobObject *self = (JobObject *)obj;
    if (!is_file_job(self) || job_of_this_process(self)) return NULL;
    file_job_t *fj = self->job->file;
    size_t k = atomic_load(&fj->next);
    unsigned long long at = k < fj->nchunks ? fj->chunks[k].start : 0;
    return PyBool_FromLong(file_fail(self->job, FILE_ERR_CANCELLED, 0, at, k));
}

static PyObject *Job_get_file_moved(PyObject *obj, void *Py_UNUSED(closure)) {
    JobObject *self = (JobObject *)obj;
    if (!is_file_job(self)) return NULL;
    return PyLong_FromUnsignedLongLong(atomic_load_explicit(&self->job->file->moved, memory_order_relaxed));
}

static PyObject *Job_get_file_error(PyObject *obj, void *Py_UNUSED(closure)) {
    JobObject *self = (JobObject *)obj;
    if (!is_file_job(self) || job_of_this_process(self)) return NULL;
    job_t *job = self->job;
    if (!atomic_load_explicit(&job->failed, memory_order_acquire)) Py_RETURN_NONE;
    pthread_mutex_lock(&job->mu);
    int code = job->err.code, kind = job->file->err_kind, errnum = job->file->err_errno;
    unsigned long long offset = job->file->err_offset;
    size_t chunk = job->file->err_chunk;
    pthread_mutex_unlock(&job->mu);
    if (code != FILE_ERROR_CODE) Py_RETURN_NONE;
    static const char *const kinds[] = {"", "read", "short", "write", "no_progress", "cancelled"};
    return Py_BuildValue("(sinK)", kinds[kind], errnum, (Py_ssize_t)chunk, offset);
}

static PyObject *Job_get_file_direct(PyObject *obj, void *Py_UNUSED(closure)) {
    JobObject *self = (JobObject *)obj;
    if (!is_file_job(self)) return NULL;
    return PyBool_FromLong(atomic_load(&self->job->file->direct));
}

static PyMethodDef Job_methods[] = {
    {"done", Job_done, METH_NOARGS, "done() -> bool: one atomic load, never blocks"},
    {"cancel", Job_cancel, METH_NOARGS,
     "cancel() -> bool: a file job's lanes stop claiming chunks and the job fails (False: it had failed or "
     "finished already)"},
    {"wait", (PyCFunction)(void (*)(void))Job_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(timeout=None) -> bool: sleep (GIL released) until done; False on timeout"},
    {"hand_off", (PyCFunction)(void (*)(void))Job_hand_off, METH_VARARGS | METH_KEYWORDS,
     "hand_off(timeout=None) -> [event handle] or None on timeout: sleep (GIL released) until every lane "
     "enqueued its share's last DMA, then the events recorded after them (submit(..., hand_off=True))"},
    {"timeline", Job_timeline, METH_NOARGS,
     "timeline() -> {event: microseconds after submit or None}: start_first, start_last, copy_last, "
     "enqueue_last, done; and the chunks' enqueues: enqueues (count), enqueue_us (summed time in the driver's "
     "copy and record calls), lock_wait_us (summed time waiting for the process's driver lock)"},
    {"chunk_sizes", Job_chunk_sizes, METH_NOARGS,
     "chunk_sizes() -> [bytes of chunk k]: the job's plan (chunk k goes to share k mod lanes)"},
    {"chunk_times", Job_chunk_times, METH_NOARGS,
     "chunk_times() -> [(lane, t0, t1, t2, t3)] per chunk, microseconds after submit, of a finished job (up to "
     "1024 chunks, else []): an upload's chunk taken up, its copy begun and ended, its enqueue answered; a "
     "download's DMA handed over and answered, its copy out begun and ended. A chunk a failure skipped reads "
     "negative times"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Job_getset[] = {
    {"error", Job_get_error, NULL, "(code, text, sticky) of the first failure, or None", NULL},
    {"file_moved", Job_get_file_moved, NULL, "a file job's payload bytes read (or written) so far", NULL},
    {"file_error", Job_get_file_error, NULL,
     "a file job's host-side failure: (kind, errno, chunk, file offset), kind 'read', 'short', 'write', "
     "'no_progress' or 'cancelled'; None if it did not fail so",
     NULL},
    {"file_direct", Job_get_file_direct, NULL, "whether a file job still reads through O_DIRECT", NULL},
    {"host_bytes", Job_get_host_bytes, NULL, "bytes the host copied so far", NULL},
    {"nbytes", Job_get_nbytes, NULL, "the payload's size", NULL},
    {"chunks", Job_get_chunks, NULL, "how many chunks the payload was cut into", NULL},
    {"chunk_bytes", Job_get_chunk_bytes, NULL, "the chunk size limit used", NULL},
    {"lanes", Job_get_lanes, NULL, "how many lanes took a share", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyObject *Job_new_refused(PyTypeObject *Py_UNUSED(type), PyObject *Py_UNUSED(a), PyObject *Py_UNUSED(k)) {
    PyErr_SetString(PyExc_TypeError, "Job objects come from Engine.submit()");
    return NULL;
}

static PyType_Slot Job_slots[] = {
    {Py_tp_new, Job_new_refused},
    {Py_tp_dealloc, Job_dealloc},
    {Py_tp_methods, Job_methods},
    {Py_tp_getset, Job_getset},
    {Py_tp_doc, "One staged transfer (from Engine.submit)."},
    {0, NULL},
};

PyType_Spec Job_spec = {
    "ferry._native._engine.Job",
    sizeof(JobObject),
    0,
    Py_TPFLAGS_DEFAULT,
    Job_slots,
};

