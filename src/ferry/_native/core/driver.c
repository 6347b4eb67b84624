/*
 * core/driver.c: the driver seam (one function per operation, CUDA or emulated) and the driver thread.
 *
 * The lanes never call the driver directly: d_enqueue (a chunk's copy and its slot's event record),
 * d_post_record (a hand-off event), d_sync / d_query (a slot's event) and d_slot_alloc / d_slot_free
 * are the whole seam, and each goes to the CUDA entry points Python handed over or to the emulated
 * device (emulated.c). Invariants: on CUDA every enqueue and poll of the process goes through one
 * spinlock (g_driver_lock, held a few microseconds) when serialize_driver is on; a lane's next
 * request to the driver thread waits for its last, so each stream's order is its lane's; a request
 * lives on the lane's stack and belongs to the lane again once `done` is stored (the thread reads
 * the lane before that store); the driver thread is stopped only after every lane has stopped, and
 * destroys its stream on its own thread (the context current there).
 */
#include "core.h"

const char *const DRIVER_NAMES[] = {
    "cuCtxSetCurrent",   "cuMemHostAlloc",    "cuMemFreeHost",     "cuStreamCreate",
    "cuStreamDestroy",   "cuEventCreate",     "cuEventDestroy",    "cuEventRecord",
    "cuEventSynchronize", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuEventQuery",
    "cuStreamWaitEvent", "cuGetErrorName",    "cuGetErrorString",
};

void make_err(const engine_t *eng, int code, const char *op, err_t *e) {
    e->code = code;
    if (eng->emulated) {
        e->sticky = code == ERR_LAUNCH_FAILED;
        const char *what;
        switch (code) {
        case ERR_UNKNOWN: what = "emulated copy failure (injected)"; break;
        case ERR_LAUNCH_FAILED: what = "emulated copy failure (injected, sticky: the emulated device is poisoned)"; break;
        case ERR_OUT_OF_MEMORY: what = "out of host memory"; break;
        default: what = "emulated driver error"; break;
        }
        snprintf(e->text, sizeof e->text, "%s (in %s)", what, op);
        return;
    }
    e->sticky = is_sticky_cuda(code);
    const char *name = NULL, *desc = NULL;
    if (eng->drv.cuGetErrorName && eng->drv.cuGetErrorName(code, &name) != 0) name = NULL;
    if (eng->drv.cuGetErrorString && eng->drv.cuGetErrorString(code, &desc) != 0) desc = NULL;
    if (name && desc)
        snprintf(e->text, sizeof e->text, "%s: %s (in %s)", name, desc, op);
    else
        snprintf(e->text, sizeof e->text, "CUresult %d (in %s)", code, op);
}

/* -- the driver seam: one function per operation, CUDA or emulated ---------------------------------- */

/*
 * CUDA enqueue calls from many lanes at once convoy on the driver's internal lock (measured on an
 * H200 VM: 13-20 us per chunk, serialized). With serialize_driver (the default) every enqueue and
 * poll in this process goes through one spinlock instead, so the driver's lock is never contended
 * and a hand-over costs a cache line, not a futex wake-up. Held for a few microseconds at most.
 */
static atomic_int g_driver_lock;

static inline void driver_lock(const engine_t *eng) {
    if (!eng->serialize) return;
    for (unsigned spins = 0;;) {
        if (!atomic_exchange_explicit(&g_driver_lock, 1, memory_order_acquire)) return;
        while (atomic_load_explicit(&g_driver_lock, memory_order_relaxed)) {
            if (++spins < 4096)
                cpu_relax();
            else
                sched_yield(); /* the holder is stalled in the driver (another thread's long call): back off */
        }
    }
}

static inline void driver_unlock(const engine_t *eng) {
    if (eng->serialize) atomic_store_explicit(&g_driver_lock, 0, memory_order_release);
}

/*
 * The driver thread. A lane's enqueue right after its chunk's host copy is slow: measured on the H200
 * VM (the job timeline's enqueue_us), a copy and event record cost 12 - 24
 * us from a lane against 2.8 us from a thread that calls the driver all the time, 4.5 - 9 us right
 * after a 1 MiB host copy: the lane's caches and TLB hold the chunk, not the driver's state. Eight
 * lanes' enqueues, serialized, then take 100 - 290 us of an 8 MiB upload. With a driver thread the
 * lanes only copy: each hands its enqueue (and its hand-off record) to this one thread, which makes
 * every enqueue of the engine with its caches warm, and waits for the answer (spinning: the thread
 * answers within microseconds). Requests run in arrival order; a lane's next request waits for its
 * last, so each stream's order is the lane's. While any share runs (and `idle_ns` after the last one)
 * the thread polls its queue; then it sleeps, and a submission or a request wakes it (a submission
 * first: the thread is up before the job's first copy ends). Emulated engines run it too, so the
 * CPU-only tests cover it.
 */

static inline void spin_lock(atomic_int *l) {
    while (atomic_exchange_explicit(l, 1, memory_order_acquire))
        while (atomic_load_explicit(l, memory_order_relaxed)) cpu_relax();
}

static inline void spin_unlock(atomic_int *l) { atomic_store_explicit(l, 0, memory_order_release); }

void dt_wake(driver_thread_t *dt) {
    if (!atomic_load(&dt->sleeping)) return; /* seq_cst: pairs with the thread's store before it sleeps */
    pthread_mutex_lock(&dt->mu);
    pthread_cond_signal(&dt->cv);
    pthread_mutex_unlock(&dt->mu);
}

static int d_enqueue_now(lane_t *L, slot_t *slot, char *host_side, CUdeviceptr dev, size_t n, const char **op);
static int d_post_record_now(lane_t *L, void **ev);
static int d_query(lane_t *L, void *ev);

static void dt_answer(dreq_t *r, int rc) {
    lane_t *L = r->L; /* read before done: r lives on the lane's stack */
    r->rc = rc;
    atomic_store(&r->done, 1); /* seq_cst: r belongs to the lane again; then read answer_sleeping */
    if (atomic_load(&L->answer_sleeping)) {
        pthread_mutex_lock(&L->mu);
        pthread_cond_broadcast(&L->cv);
        pthread_mutex_unlock(&L->mu);
    }
}

/* Poll every event the lanes wait for: answer the complete ones, and the ones polled too long. */
static void dt_poll(driver_thread_t *dt) {
    dreq_t **at = &dt->polled;
    while (*at) {
        dreq_t *r = *at;
        int rc = d_query(r->L, r->ev);
        if (rc == ERR_NOT_READY && now_ns() - r->since < DT_SYNC_NS) {
            at = &r->next;
            continue;
        }
        *at = r->next;
        dt_answer(r, rc); /* NOT_READY after DT_SYNC_NS: the lane sleeps on the event itself */
    }
}

static void *dt_main(void *arg) {
    driver_thread_t *dt = arg;
    engine_t *eng = dt->eng;
    int rc = eng->emulated ? 0 : eng->drv.cuCtxSetCurrent(eng->ctx);
    if (!rc && dt->one_stream && !eng->emulated) rc = eng->drv.cuStreamCreate(&dt->stream, CU_STREAM_NON_BLOCKING);
    pthread_mutex_lock(&dt->mu);
    dt->setup_rc = rc;
    dt->ready = rc ? -1 : 1;
    pthread_cond_broadcast(&dt->cv);
    pthread_mutex_unlock(&dt->mu);
    if (rc) return NULL;
    int64_t idle_since = now_ns(), last_work = idle_since, last_poll = 0;
    for (;;) {
        dreq_t *r = NULL;
        if (atomic_load_explicit(&dt->queued, memory_order_acquire)) {
            spin_lock(&dt->lock);
            r = dt->head;
            if (r) {
                dt->head = r->next;
                if (!dt->head) dt->tail = NULL;
                atomic_fetch_sub_explicit(&dt->queued, 1, memory_order_relaxed);
            }
            spin_unlock(&dt->lock);
        }
        if (r) {
            if (r->kind == DREQ_ENQUEUE) {
                dt_answer(r, d_enqueue_now(r->L, r->slot, r->host_side, r->dev, r->n, &r->op));
            } else if (r->kind == DREQ_POST) {
                dt_answer(r, d_post_record_now(r->L, &r->ev));
            } else {
                r->since = now_ns();
                r->next = dt->polled;
                dt->polled = r;
            }
            idle_since = last_work = now_ns();
            continue;
        }
        if (dt->polled) { /* a lane waits for a DMA: poll it every ~2 us (and the queue in between) */
            int64_t t = now_ns();
            if (t - last_poll >= DT_POLL_NS) {
                dt_poll(dt);
                last_poll = now_ns();
            } else {
                cpu_relax();
            }
            idle_since = last_work = t;
            continue;
        }
        if (atomic_load(&dt->stop)) break; /* every lane has stopped: nothing can be queued */
        int64_t t = now_ns();
        int active = atomic_load_explicit(&dt->active, memory_order_acquire);
        /* Poll while shares run (a lane's copy ends any time now) or for idle_ns after the last one;
         * but not past DT_ACTIVE_IDLE_NS without a request: the lanes are held, or asleep on events. */
        if ((active || t - idle_since < dt->idle_ns) && t - last_work < DT_ACTIVE_IDLE_NS) {
            if (active) idle_since = t;
            if (t - last_work < DT_SPIN_NS)
                cpu_relax();
            else
                sched_yield(); /* leave CPUs to the lanes */
            continue;
        }
        pthread_mutex_lock(&dt->mu);
        atomic_store(&dt->sleeping, 1);
        int woken = 0;
        if (!atomic_load(&dt->queued) && !atomic_load(&dt->stop)) {
            struct timespec ts = ts_of(now_ns() + DT_NET_NS); /* a safety net: wakes are signalled */
            woken = pthread_cond_timedwait(&dt->cv, &dt->mu, &ts) == 0;
        }
        atomic_store(&dt->sleeping, 0);
        pthread_mutex_unlock(&dt->mu);
        if (woken) idle_since = last_work = now_ns(); /* a submission or a request: poll again */
    }
    if (dt->stream) eng->drv.cuStreamDestroy(dt->stream); /* on the thread that made it (context current) */
    dt->stream = NULL;
    return NULL;
}

/* A lane's request, answered by the driver thread: returns its rc. */
static int dt_call(driver_thread_t *dt, dreq_t *r) {
    r->next = NULL;
    r->rc = 0;
    r->op = "";
    atomic_store_explicit(&r->done, 0, memory_order_relaxed);
    spin_lock(&dt->lock);
    if (dt->tail)
        dt->tail->next = r;
    else
        dt->head = r;
    dt->tail = r;
    spin_unlock(&dt->lock);
    atomic_fetch_add(&dt->queued, 1); /* seq_cst: then read sleeping */
    dt_wake(dt);
    int64_t t0 = now_ns();
    while (!atomic_load_explicit(&r->done, memory_order_acquire)) {
        int64_t t = now_ns() - t0;
        if (t < DT_SPIN_NS) {
            cpu_relax();
        } else if (t < r->L->eng->lane_wait_ns) {
            sched_yield(); /* more runnable threads than CPUs: let the driver thread run */
        } else { /* a long DMA: sleep until the thread answers (it signals a sleeping lane) */
            lane_t *L = r->L;
            pthread_mutex_lock(&L->mu);
            atomic_store(&L->answer_sleeping, 1); /* seq_cst: pairs with dt_answer's store of done */
            if (!atomic_load(&r->done)) {
                struct timespec ts = ts_of(now_ns() + SLICE_NS); /* a safety net: answers are signalled */
                pthread_cond_timedwait(&L->cv, &L->mu, &ts);
            }
            atomic_store(&L->answer_sleeping, 0);
            pthread_mutex_unlock(&L->mu);
        }
    }
    return r->rc;
}

driver_thread_t *dt_start(engine_t *eng, int64_t idle_ns, int one_stream, int *rc) {
    *rc = 0;
    driver_thread_t *dt = calloc(1, sizeof *dt);
    if (!dt) return NULL;
    dt->eng = eng;
    dt->idle_ns = idle_ns;
    dt->one_stream = one_stream && !eng->emulated;
    if (pthread_mutex_init(&dt->mu, NULL)) {
        free(dt);
        return NULL;
    }
    if (cond_init_monotonic(&dt->cv)) {
        pthread_mutex_destroy(&dt->mu);
        free(dt);
        return NULL;
    }
    if (start_thread(&dt->thread, dt_main, dt)) {
        pthread_cond_destroy(&dt->cv);
        pthread_mutex_destroy(&dt->mu);
        free(dt);
        return NULL;
    }
    pthread_mutex_lock(&dt->mu);
    while (!dt->ready) pthread_cond_wait(&dt->cv, &dt->mu);
    pthread_mutex_unlock(&dt->mu);
    if (dt->ready < 0) {
        *rc = dt->setup_rc;
        pthread_join(dt->thread, NULL);
        pthread_cond_destroy(&dt->cv);
        pthread_mutex_destroy(&dt->mu);
        free(dt);
        return NULL;
    }
    return dt;
}

/* After every lane stopped (no request can come). */
void dt_stop(driver_thread_t *dt) {
    if (!dt) return;
    pthread_mutex_lock(&dt->mu);
    atomic_store(&dt->stop, 1);
    pthread_cond_signal(&dt->cv);
    pthread_mutex_unlock(&dt->mu);
    pthread_join(dt->thread, NULL); /* it destroyed its stream (queued DMAs still complete) */
    pthread_cond_destroy(&dt->cv);
    pthread_mutex_destroy(&dt->mu);
    free(dt);
}

/*
 * The stream a lane's DMAs and records go on: its own, or with Engine(one_stream=True) and the driver
 * thread in CUDA mode one stream for the whole engine, in request order (DMAs on several streams run at
 * once and end together, so a download's lanes all wait for the last of them before copying out; on
 * one stream they end one after the other and the copies out start as each lands). A producer is then
 * ordered before that one stream (Engine.streams()). Off by default: on the H200 VM (2026-11-30) it
 * measured within the run-to-run spread of the lanes' streams (8 MiB download 18.7 against 16.7 GB/s,
 * 64 MiB 34.3 against 37.7), so the tested path stays.
 */
static inline CUstream dma_stream(const lane_t *L) {
    const driver_thread_t *dt = L->eng->dt;
    return dt && dt->stream ? dt->stream : L->stream;
}

/*
 * One chunk's stream work, in order: the copy, the slot's event record. Returns 0, or the failing
 * call's code with *op naming it.
 */
static int d_enqueue_now(lane_t *L, slot_t *slot, char *host_side, CUdeviceptr dev, size_t n, const char **op) {
    engine_t *eng = L->eng;
    int rc;
    int64_t t0 = now_ns(), t1 = t0;
    if (eng->emulated) {
        *op = eng->upload ? "cuMemcpyHtoDAsync" : "cuMemcpyDtoHAsync";
        rc = eng->upload ? emu_enqueue_copy(L, (char *)(uintptr_t)dev, host_side, n)
                         : emu_enqueue_copy(L, host_side, (const char *)(uintptr_t)dev, n);
        if (!rc) {
            *op = "cuEventRecord";
            rc = emu_record(L, slot->ev);
        }
        goto account;
    }
    CUstream stream = dma_stream(L);
    driver_lock(eng);
    t1 = now_ns();
    *op = eng->upload ? "cuMemcpyHtoDAsync" : "cuMemcpyDtoHAsync";
    rc = eng->upload ? eng->drv.cuMemcpyHtoDAsync(dev, host_side, n, stream)
                     : eng->drv.cuMemcpyDtoHAsync(host_side, dev, n, stream);
    if (!rc) {
        *op = "cuEventRecord";
        rc = eng->drv.cuEventRecord(slot->ev, stream);
    }
    driver_unlock(eng);
account:
    if (slot->job) { /* where a chunk's enqueue goes: waiting for the lock, or in the driver */
        atomic_fetch_add_explicit(&slot->job->n_enqueues, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&slot->job->lock_wait_ns, t1 - t0, memory_order_relaxed);
        atomic_fetch_add_explicit(&slot->job->enqueue_ns, now_ns() - t1, memory_order_relaxed);
    }
    return rc;
}

/* A posting share's hand-off event: recorded right after its last DMA, on the lane's stream. */
static int d_post_record_now(lane_t *L, void **ev) {
    engine_t *eng = L->eng;
    *ev = L->handoff[L->handoff_next++ % HANDOFF_EVENTS];
    if (eng->emulated) return emu_record(L, *ev);
    driver_lock(eng);
    int rc = eng->drv.cuEventRecord(*ev, dma_stream(L));
    driver_unlock(eng);
    return rc;
}

/* A chunk's enqueue, through the driver thread where the engine has one. */
int d_enqueue(lane_t *L, slot_t *slot, char *host_side, CUdeviceptr dev, size_t n, const char **op) {
    driver_thread_t *dt = L->eng->dt;
    if (!dt) return d_enqueue_now(L, slot, host_side, dev, n, op);
    dreq_t r;
    memset(&r, 0, sizeof r);
    r.kind = DREQ_ENQUEUE;
    r.L = L;
    r.slot = slot;
    r.host_side = host_side;
    r.dev = dev;
    r.n = n;
    int rc = dt_call(dt, &r);
    *op = r.op;
    return rc;
}

int d_post_record(lane_t *L, void **ev) {
    driver_thread_t *dt = L->eng->dt;
    if (!dt) return d_post_record_now(L, ev);
    dreq_t r;
    memset(&r, 0, sizeof r);
    r.kind = DREQ_POST;
    r.L = L;
    int rc = dt_call(dt, &r);
    *ev = r.ev;
    return rc;
}

/* cuEventQuery (emulated: the same on the lane's stream): 0, ERR_NOT_READY, or the failure. */
static int d_query(lane_t *L, void *ev) {
    engine_t *eng = L->eng;
    if (eng->emulated) {
        emu_stream_t *es = L->es;
        emu_event_t *e = ev;
        pthread_mutex_lock(&es->mu);
        int rc = e->done < e->recorded ? ERR_NOT_READY : e->error;
        pthread_mutex_unlock(&es->mu);
        return rc ? rc : atomic_load(&eng->poison);
    }
    driver_lock(eng);
    int rc = eng->drv.cuEventQuery((CUevent)ev);
    driver_unlock(eng);
    return rc;
}

/* Wait for a slot's DMA: the driver thread polls it where there is one (a lane's wake-up from a
 * blocking event costs tens of microseconds on a VM); past DT_SYNC_NS the lane sleeps on it. */
int d_sync(lane_t *L, slot_t *slot) {
    engine_t *eng = L->eng;
    driver_thread_t *dt = eng->dt;
    if (dt) {
        dreq_t r;
        memset(&r, 0, sizeof r);
        r.kind = DREQ_SYNC;
        r.L = L;
        r.ev = slot->ev;
        int rc = dt_call(dt, &r);
        if (rc != ERR_NOT_READY) return rc;
    }
    if (eng->emulated) return emu_sync(L, slot->ev);
    if (eng->spin_ns > 0) { /* a DMA about to end: polling beats a sleeping thread's wake-up */
        int64_t until = now_ns() + eng->spin_ns;
        for (;;) {
            driver_lock(eng);
            int rc = eng->drv.cuEventQuery(slot->ev);
            driver_unlock(eng);
            if (rc != ERR_NOT_READY) return rc;
            int64_t t = now_ns();
            if (t >= until) break;
            while (now_ns() < t + 2000) cpu_relax(); /* poll every ~2 us, leave the lock to enqueuers */
        }
    }
    return eng->drv.cuEventSynchronize(slot->ev);
}

int d_slot_alloc(lane_t *L, slot_t *slot) {
    engine_t *eng = L->eng;
    memset(slot, 0, sizeof *slot);
    if (eng->emulated) {
        int poison = atomic_load(&eng->poison);
        if (poison) return poison;
        void *p = NULL;
        if (posix_memalign(&p, 4096, eng->slot_bytes)) return ERR_OUT_OF_MEMORY;
        for (size_t off = 0; off < eng->slot_bytes; off += 4096) ((volatile char *)p)[off] = 0; /* pre-touch */
        emu_event_t *ev = calloc(1, sizeof *ev);
        if (!ev) {
            free(p);
            return ERR_OUT_OF_MEMORY;
        }
        slot->ptr = p;
        slot->ev = ev;
        return 0;
    }
    void *p = NULL;
    CUevent ev = NULL;
    int rc = eng->drv.cuMemHostAlloc(&p, eng->slot_bytes, CU_MEMHOSTALLOC_PORTABLE);
    if (rc) return rc;
    rc = eng->drv.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC);
    if (rc) {
        eng->drv.cuMemFreeHost(p);
        return rc;
    }
    slot->ptr = p;
    slot->ev = ev;
    return 0;
}

void d_slot_free(lane_t *L, char *ptr, void *ev) {
    engine_t *eng = L->eng;
    if (eng->emulated) {
        free(ptr);
        free(ev);
        return;
    }
    eng->drv.cuEventDestroy(ev);
    eng->drv.cuMemFreeHost(ptr);
}

