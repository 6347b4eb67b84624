/*
 * core/lanes.c: the staging engine's lanes, its cooperative jobs and its lifetime (no Python.h).
 *
 * The staging engine: what it does
 * --------------------------------
 * A pageable NumPy array cannot be the target of a DMA. The engine moves it
 * through a bounded ring of page-locked *slots*: the host copies a chunk of
 * the array into a slot, the copy engine moves the slot to the device (and
 * the reverse for downloads). Python hands the engine a job (addresses,
 * sizes, shape and strides, all plain integers) and learns the outcome from
 * the job's completion. Native threads never touch a Python object and never
 * take the GIL.
 *
 * Threads
 * -------
 * An Engine serves one direction ("upload" or "download"). It owns N lanes.
 * A lane is one pthread with its own stream, `slots_per_lane` slots of
 * `slot_bytes` and one event per slot. The lane allocates all of that itself
 * on its own thread (after cuCtxSetCurrent on the given context) and frees
 * it on its own thread when it exits, so no other thread ever needs the
 * context to be current. The lane sleeps on its condition variable until a
 * *share* (the chunks of one job dealt to it) is queued.
 *
 * With driver_thread=True (the default) the engine also runs one *driver
 * thread*: the lanes only copy, and hand it their enqueues, hand-off records
 * and event waits, because a lane's own driver call right after a chunk's
 * host copy costs several times what a thread that does nothing else pays
 * (the essay above d_enqueue's definition says how much and how it waits).
 * Chunk copies from 64 KiB use streaming stores (copy_bytes), but for an upload of many chunks per lane
 * (job_streams in engine.c).
 *
 * In emulated mode (no GPU), each lane also owns a stream worker: a second
 * pthread that runs the lane's "DMAs" (memcpy, then a sleep that models
 * nbytes / bandwidth + latency) and event records in order, so
 * a stream is asynchronous exactly as a CUDA stream is.
 *
 * Jobs, chunks, shares
 * --------------------
 * submit() cuts the array's C-order byte image into chunks (contiguous: raw
 * byte ranges; strided: sub-arrays along the axes, like plan_chunks in
 * _staging.py) and deals them round-robin to min(lanes, chunks) lanes,
 * starting at a rotating lane. A share is (job, first chunk, stride), so the
 * plan costs O(lanes) at submit time, whatever the array's size; a chunk's
 * geometry is computed by the lane when it gets to it (a job of many pieces,
 * core/pieces.c, is planned into a chunk table instead: each chunk a run of
 * pieces that follow each other on the device, at chunk.dev). On an engine with
 * helpers a contiguous job of up to cooperative_max_bytes is one share
 * instead, a lead lane's, whose chunk copies idle lanes help with piece by
 * piece (cooperative jobs: see the essay above wake_helpers).
 *
 * Upload, per chunk: reap the slot (wait for its previous DMA through its
 * event), gather the chunk into the slot, enqueue HtoD, record the slot's
 * event. A share is reported complete when the event after its last DMA is
 * reaped: either when the lane reuses that slot, or, when the lane has no
 * more queued work, by reaping all busy slots before it sleeps. So a lane
 * starts the next job's host copies while the previous job's last DMAs are
 * in flight, and a job is done only once all of its DMAs completed.
 * Download, per share: enqueue DtoH into up to `slots` slots ahead, then for
 * each chunk wait its event, scatter the slot into the array, enqueue the
 * next DtoH into the freed slot. A download share ends with all its slots
 * idle. Either way each payload byte is copied by the host exactly once and
 * staging memory is exactly lanes * slots_per_lane * slot_bytes.
 *
 * Completion
 * ----------
 * job->remaining counts the lanes that still owe their share. The lane that
 * brings it to zero sets job->done (a release store, under the job's mutex)
 * and broadcasts the job's condition variable. done() is one acquire load;
 * wait() sleeps on the condition variable with the GIL released, in slices
 * of at most 5 ms, and checks Python signals between slices
 * (PyErr_CheckSignals: a KeyboardInterrupt raised by the handler propagates
 * out of wait()). With spin_us or wait_spin_us > 0, wait() first polls done (GIL released; with
 * wait_spin_us until the job's expected end and that long more, see Job_wait) and CUDA lanes poll a
 * slot's event (cuEventQuery) spin_us before they sleep: a thread's wake-up costs tens of
 * microseconds on a VM.
 *
 * Stream-order hand-off: posted events
 * ------------------------------------
 * A job submitted with hand_off=True has each of its shares *post*, once, an
 * event its lane records right after the share's last DMA: one of the lane's
 * HANDOFF_EVENTS hand-off events, taken in turn (not the slot's own event,
 * which the lane records again for every later chunk in that slot).
 * job.hand_off() sleeps until every share posted (every lane has *enqueued*
 * its part: the host copies are done, the last DMAs may still run) and lists
 * those events; a consumer stream that waits for each (cuStreamWaitEvent) is
 * ordered after every DMA of the job, on the device. The lane records a
 * hand-off event again only HANDOFF_EVENTS posts later; a wait made after
 * that (a hand-off that late) only waits longer, on the same stream, never
 * less. Events are waited while the engine is open: its lanes free them when
 * they exit, and hand_off() refuses a closed engine. A share that never enqueues its last
 * DMA (its job failed, or never ran) posts nothing, so a hand-off never
 * waits for a failed job: the job's error says what happened. Stream memory
 * operations (cuStreamWaitValue32 on words the lanes write) did this before;
 * they are invisible to the scheduler and can deadlock a consumer stream
 * against a lane's own DMA, which an H200 did.
 *
 * Failure
 * -------
 * The first driver error of a job is kept with its code; job->failed makes
 * every lane skip the job's remaining chunks. A lane that meets an error
 * *recovers*: it waits for every busy slot's event (attributing an error to
 * that slot's job), reports the shares those events end, then abandons all
 * of its slots (never reused, never freed on CUDA; counted in
 * abandoned_bytes) and allocates fresh ones. If that allocation fails the
 * lane is *broken*: every later share on it fails at once with that error.
 * An error is sticky (the context is unusable) for codes 700, 701, 702,
 * 714-719 and 999 on CUDA; in emulated mode sticky iff it came from
 * fail_next_copy(sticky=True) (code 719), after which the emulated device is
 * poisoned: every later emulated driver call fails with 719.
 *
 * Hold (tests)
 * ------------
 * hold() makes "not ready" observable: in emulated mode the stream workers
 * run no op until release() (lanes may still fill their slots, then block
 * on a slot's event); in CUDA mode lanes pause at the next chunk boundary,
 * before its host copy and DMA (DMAs already enqueued still run).
 * fail_next_copy(after, sticky) (emulated only) arms a fault like the
 * emulated backend's: the copy enqueued after the next `after` ones fails
 * when it runs (half of it is copied), and the failure surfaces at the next
 * event recorded on that lane's stream, as an asynchronous CUDA error does:
 * code 999 (not sticky) or, with sticky=True, code 719 and the emulated
 * device is poisoned.
 *
 * What the caller owns
 * --------------------
 * The host array and the device memory of a job must stay alive (and, for a
 * download, the output must not be read) until the job is done: the engine
 * holds addresses, never references. In emulated mode the "device" side is
 * a real host address: the caller translates the emulated backend's fake
 * device pointer to the memory behind it.
 *
 * Invariants
 * ----------
 * - A slot with busy=1 may still be touched by a DMA; it is reused only
 *   after its event was synchronized, and is freed only at close after
 *   every DMA completed. Abandoned slots are never reused.
 * - The lane's slot ring, cursor and busy flags are touched by the lane
 *   thread only (the driver thread reads a slot's event and records on the
 *   lane's stream only while that lane waits for its answer). Queues (and a
 *   lane's `sleeping` flag) are protected by the lane mutex, the driver
 *   thread's queue by its spinlock, job errors by the job mutex, emulated
 *   stream state by the stream mutex; counters that
 *   Python reads (done, failed, host_bytes, held/abandoned bytes) are C11
 *   atomics.
 * - A job is freed when its last reference goes: one for the Python Job
 *   object, one per share. A Python Job keeps its Engine object alive.
 * - close() waits for every queued job (it lifts a hold first), then joins
 *   the lanes, then stops the driver thread (no lane is left to ask it). tp_dealloc of an Engine created in another process (fork)
 *   touches neither threads nor locks: it leaks on purpose.
 */
#include "core.h"

/* -- lanes ----------------------------------------------------------------------------------------- */

/*
 * A share's hand-off post: `ev` (the event recorded right after its last DMA, on its lane's stream),
 * or NULL for a share that will never enqueue its last DMA (its job failed, or never ran).
 */
static void post_share(share_t *s, void *ev) {
    job_t *job = s->job;
    s->posted = 1;
    pthread_mutex_lock(&job->mu);
    if (ev) job->posted[job->nposted++] = ev;
    if (atomic_fetch_sub_explicit(&job->unposted, 1, memory_order_acq_rel) == 1) pthread_cond_broadcast(&job->cv);
    pthread_mutex_unlock(&job->mu);
}

/* A share is complete: all of its DMAs and host copies are done (or it was abandoned by a failure). */
static void finish_share(lane_t *L, share_t *s) {
    job_t *job = s->job;
    (void)L;
    if (s->posts && !s->posted) post_share(s, NULL);
    atomic_fetch_add_explicit(&job->host_bytes, s->copied, memory_order_relaxed);
    if (atomic_fetch_sub_explicit(&job->remaining, 1, memory_order_acq_rel) == 1) job_complete(job);
    job_decref(job);
    free(s);
}

static int alloc_slots(lane_t *L, err_t *e) {
    engine_t *eng = L->eng;
    for (int i = 0; i < eng->slots_per_lane; i++) {
        int rc = d_slot_alloc(L, &L->slots[i]);
        if (rc) {
            make_err(eng, rc, "allocating a staging slot", e);
            for (int j = 0; j < i; j++) d_slot_free(L, L->slots[j].ptr, L->slots[j].ev);
            L->nslots = 0;
            return -1;
        }
    }
    L->nslots = eng->slots_per_lane;
    atomic_fetch_add(&eng->held_bytes, (long long)eng->slot_bytes * eng->slots_per_lane);
    return 0;
}

/*
 * After an error: wait for every busy slot (oldest first, an error goes to that slot's job), abandon
 * every slot, take fresh ones (or mark the lane broken), then report the shares those events end (so a
 * job seen done already has this lane's slots counted abandoned and replaced).
 */
static void lane_recover(lane_t *L) {
    engine_t *eng = L->eng;
    int n = L->nslots, nends = 0;
    share_t *ends[MAX_SLOTS]; /* ended last: a job seen done has its lane's slots counted and replaced */
    for (int j = 0; j < n; j++) {
        slot_t *slot = &L->slots[(L->cursor + (size_t)j) % (size_t)n];
        if (!slot->busy) continue;
        int rc = d_sync(L, slot);
        slot->busy = 0;
        if (rc && slot->job) {
            err_t e;
            make_err(eng, rc, "waiting for a staging DMA", &e);
            job_fail(slot->job, &e);
        }
        if (slot->ends) {
            ends[nends++] = slot->ends;
            slot->ends = NULL;
        }
    }
    for (int j = 0; j < n; j++) {
        if (eng->emulated) {
            abandoned_t *a = malloc(sizeof *a);
            if (a) {
                a->ptr = L->slots[j].ptr;
                a->ev = L->slots[j].ev;
                a->next = L->abandoned;
                L->abandoned = a;
            } /* else: leaked, which is what abandoning means on CUDA anyway */
        }
        memset(&L->slots[j], 0, sizeof L->slots[j]);
    }
    if (n) {
        atomic_fetch_sub(&eng->held_bytes, (long long)eng->slot_bytes * n);
        atomic_fetch_add(&eng->abandoned_bytes, (long long)eng->slot_bytes * n);
    }
    L->nslots = 0;
    L->cursor = 0;
    L->cur_last = NULL;
    err_t e;
    if (alloc_slots(L, &e)) {
        L->broken = 1;
        L->broken_err = e;
    }
    for (int j = 0; j < nends; j++) finish_share(L, ends[j]);
}

/* Wait for one busy slot; report the share it ends. Returns 0, or -1 after a recovery. */
static int reap(lane_t *L, slot_t *slot) {
    int rc = d_sync(L, slot);
    slot->busy = 0;
    if (rc) {
        err_t e;
        make_err(L->eng, rc, "waiting for a staging DMA", &e);
        if (slot->job) job_fail(slot->job, &e);
        share_t *s = slot->ends;
        slot->ends = NULL;
        lane_recover(L); /* before the share ends: its job, once done, has the slots counted */
        if (s) finish_share(L, s);
        return -1;
    }
    if (slot->ends) {
        share_t *s = slot->ends;
        slot->ends = NULL;
        finish_share(L, s);
    }
    return 0;
}

static void reap_all(lane_t *L) {
    for (;;) {
        int n = L->nslots, again = 0;
        for (int j = 0; j < n; j++) {
            slot_t *slot = &L->slots[(L->cursor + (size_t)j) % (size_t)n];
            if (slot->busy && reap(L, slot)) {
                again = 1; /* recovered: the ring changed */
                break;
            }
        }
        if (!again) return;
    }
}

static int any_busy(const lane_t *L) {
    for (int j = 0; j < L->nslots; j++)
        if (L->slots[j].busy) return 1;
    return 0;
}

/* CUDA mode: a hold pauses lanes at chunk boundaries (emulated mode holds the stream workers). */
static void hold_wait(engine_t *eng) {
    if (eng->emulated || !atomic_load(&eng->held)) return;
    pthread_mutex_lock(&eng->mu);
    while (atomic_load(&eng->held)) pthread_cond_wait(&eng->cv, &eng->mu);
    pthread_mutex_unlock(&eng->mu);
}

/*
 * Cooperative jobs. A staged job's chunks dealt one per lane are copied side by side and reach the
 * link together: an 8 MiB upload's eight 1 MiB chunks were all copied at ~130 us and the link moved
 * most of the bytes after that (chunk traces), and a lane that wakes late or is
 * preempted holds its chunk up. A cooperative job (a contiguous one, on an engine with helpers) is
 * one share instead: its *lead* lane takes the chunks in order, and each chunk's host copy is cut
 * into pieces of piece_bytes that the lead and idle lanes claim from one counter, as the copier's
 * helpers do (the copier's essay below says why the task on the lead's stack outlives every
 * reader). Chunk k is on the link while chunk k+1 is copied, the lead never waits for a helper to
 * wake (it copies every piece nobody else claimed), and a late helper costs one piece at most.
 *
 * Jobs above cooperative_max_bytes are dealt as before: one lead's slots_per_lane slots cannot keep
 * the link busy through a long job (its wait for a slot to drain, then a sleeping lead's wake-up,
 * leaves the link idle), where every lane's slots can. On the H200 (probe_native.py --helpers,
 * 2026-12-01) cooperative uploads moved 8 MiB at 29 - 33 GB/s against 21 - 24 dealt, tied at
 * 32 MiB, and lost at 256 MiB (25 - 35 against 39 - 40).
 *
 * submit() counts the job in `leads` and wakes up to `helpers` sleeping lanes; an idle lane helps
 * while a lead runs, and goes back to sleep after help_spin_ns without a posted copy (a lead waiting
 * for its slots to drain, or held) or as soon as a share is queued for it: a helper never waits for a
 * lead, so helping cannot deadlock lanes whose queues hold each other's shares. A lead that posts a
 * copy while lanes sleep wakes one per piece it copies, as long as fewer than `helpers` lanes help
 * or are on their way (`helping` + `waking`, counted engine-wide: every lead counts the same ones).
 */
/* lead_copies=False (a knob for one-job tests: with every lane a lead nobody helps) copies alone after this */
#define LEAD_ALONE_NS ((int64_t)2000000000)

/* Wake up to `k` sleeping lanes to help L's lead, scanning the other lanes once; how many were woken.
 * Each wake-up first checks the engine-wide cap (`helping` + `waking` below `helpers`). */
int wake_helpers(lane_t *L, int k) {
    engine_t *eng = L->eng;
    int woken = 0;
    for (int j = 1; j < eng->nlanes && woken < k; j++) {
        if (atomic_load(&eng->idle_sleepers) <= 0 ||
            atomic_load(&eng->helping) + atomic_load(&eng->waking) >= eng->helpers)
            break;
        lane_t *M = &eng->lanes[(L->index + j) % eng->nlanes];
        pthread_mutex_lock(&M->mu);
        int go = M->sleeping && !M->help_woken && !M->head;
        if (go) {
            M->help_woken = 1;
            atomic_fetch_sub(&eng->idle_sleepers, 1);
            atomic_fetch_add(&eng->waking, 1);
        }
        pthread_mutex_unlock(&M->mu);
        if (go) {
            pthread_cond_signal(&M->cv);
            woken++;
        }
    }
    return woken;
}

/* Wake one more helper if the lead may: while lanes sleep, and fewer than `helpers` help or are on
 * their way (every lead counts the same ones: the engine never wakes more than `helpers` to help). */
static void maybe_wake(lane_t *L, int *woken) {
    engine_t *eng = L->eng;
    if (*woken >= eng->helpers || atomic_load(&eng->idle_sleepers) <= 0 ||
        atomic_load(&eng->helping) + atomic_load(&eng->waking) >= eng->helpers)
        return; /* two loads per piece: a helper that drops out later frees room for the next piece */
    if (wake_helpers(L, 1))
        (*woken)++;
}

/* The lead's chunk copy, shared with the lanes that help (see above). */
static void coop_copy(lane_t *L, char *dst, const char *src, size_t n, int nt, int *woken) {
    engine_t *eng = L->eng;
    if (n <= eng->piece_bytes && eng->lead_copies) {
        copy_bytes(dst, src, n, nt);
        return;
    }
    if (*woken >= eng->helpers) *woken = 0; /* helpers that slept through a slot wait may be woken again */
    copy_task_t t;
    task_init(&t, dst, src, n, eng->piece_bytes, nt, atomic_fetch_add(&eng->task_seq, 1) + 1);
    atomic_store(&L->help_task, &t);
    atomic_store(&L->help_posted, t.seq);
    if (eng->lead_copies) {
        size_t k;
        for (;;) {
            maybe_wake(L, woken);
            if ((k = atomic_fetch_add(&t.next, 1)) >= t.pieces) break;
            copier_piece(&t, k);
            atomic_fetch_add_explicit(&t.done, 1, memory_order_release);
        }
    } else { /* tests only: the helpers copy; a lead left alone for LEAD_ALONE_NS copies what is left */
        int64_t alone_at = now_ns() + LEAD_ALONE_NS;
        for (unsigned i = 0; atomic_load_explicit(&t.done, memory_order_acquire) < t.pieces; i++) {
            if ((i & 255) == 0) {
                *woken = 0;
                maybe_wake(L, woken);
                if (now_ns() > alone_at) {
                    copier_drain(&t);
                    break;
                }
            }
            backoff(i);
        }
    }
    task_retire(&t, &L->help_task, &L->help_active);
}

/*
 * An idle lane helps the leads of cooperative jobs: it returns when a share is queued for it, when no
 * lead is left, or (1) after help_spin_ns without a posted copy it has not taken part in yet.
 */
static int help(lane_t *L) {
    engine_t *eng = L->eng;
    unsigned long long seen[MAX_LANES]; /* per lane, the last posted copy joined (a copy posted before this
                                         * lane came may still have pieces: every posted copy is new once) */
    memset(seen, 0, sizeof seen);
    atomic_fetch_add(&eng->helping, 1);
    int64_t idle_since = now_ns();
    unsigned polls = 0;
    int timed_out = 0;
    while (atomic_load(&eng->leads) > 0 && !atomic_load_explicit(&L->queued, memory_order_acquire)) {
        int joined = 0;
        for (int j = 1; j < eng->nlanes; j++) {
            int m = (L->index + j) % eng->nlanes;
            lane_t *M = &eng->lanes[m];
            unsigned long long p = atomic_load_explicit(&M->help_posted, memory_order_relaxed);
            if (p == seen[m]) continue;
            atomic_fetch_add(&M->help_active, 1); /* before reading the task: see the copier's essay */
            copy_task_t *t = atomic_load(&M->help_task);
            if (t) {
                size_t g = copier_drain(t);
                /* counted while still counted in help_active: the lead waits for that, so the job
                 * completes (and Engine.helped_pieces is read) after this count */
                if (g) atomic_fetch_add_explicit(&eng->helped, g, memory_order_relaxed);
                if (t->seq > p) p = t->seq;
            }
            atomic_fetch_sub(&M->help_active, 1);
            seen[m] = p;
            joined = 1;
        }
        if (joined) {
            idle_since = now_ns();
            continue;
        }
        if ((++polls & 63) == 0) {
            if (now_ns() - idle_since >= eng->help_spin_ns) {
                timed_out = 1;
                break;
            }
            sched_yield(); /* a machine without CPUs to spare: the lead and the caller come first */
        }
        cpu_relax();
    }
    atomic_fetch_sub(&eng->helping, 1);
    return timed_out;
}

static void fail_with(lane_t *L, job_t *job, int rc, const char *op) {
    err_t e;
    make_err(L->eng, rc, op, &e);
    job_fail(job, &e);
}

static void run_upload(lane_t *L, share_t *s) {
    job_t *job = s->job;
    chunk_t c;
    int woken = 0; /* helpers this lead woke (cooperative jobs) */
    L->cur_last = NULL;
    for (size_t k = s->first; k < job->nchunks;) {
        if (atomic_load_explicit(&job->failed, memory_order_acquire)) break;
        if (L->broken) {
            job_fail(job, &L->broken_err);
            break;
        }
        trace_at(job, k, L->index, 0);
        hold_wait(L->eng);
        slot_t *slot = &L->slots[L->cursor % (size_t)L->nslots];
        if (slot->busy && reap(L, slot)) continue; /* recovered: re-check this chunk's job, fresh slots */
        job_chunk(job, k, &c);
        trace_at(job, k, L->index, 1);
        if (job->coop)
            coop_copy(L, slot->ptr, c.host, c.nbytes, job->nontemporal, &woken);
        else
            chunk_copy(job, &c, slot->ptr, 1);
        trace_at(job, k, L->index, 2);
        s->copied += c.nbytes;
        at_max(&job->t_copy_last, now_ns());
        slot->job = job;
        slot->ends = NULL;
        slot->busy = 1; /* from here on a DMA may touch it */
        const char *op = "";
        int rc = d_enqueue(L, slot, slot->ptr, c.dev, c.nbytes, &op);
        trace_at(job, k, L->index, 3);
        if (rc) {
            fail_with(L, job, rc, op);
            lane_recover(L);
            break;
        }
        L->cursor++;
        L->cur_last = slot;
        if (s->posts && k + s->stride >= job->nchunks) { /* its last DMA: hand off */
            void *ev;
            rc = d_post_record(L, &ev);
            if (rc) {
                fail_with(L, job, rc, "cuEventRecord (hand-off)");
                lane_recover(L);
                break;
            }
            post_share(s, ev);
        }
        at_max(&job->t_enqueue_last, now_ns());
        k += s->stride;
    }
    if (L->cur_last) {
        L->cur_last->ends = s; /* reported when that event is reaped */
        L->cur_last = NULL;
        return;
    }
    finish_share(L, s); /* nothing of this share is in flight */
}

static void run_download(lane_t *L, share_t *s) {
    job_t *job = s->job;
    size_t n = job->nchunks > s->first ? (job->nchunks - s->first + s->stride - 1) / s->stride : 0;
    chunk_t c;
    if (L->broken) {
        job_fail(job, &L->broken_err);
        finish_share(L, s);
        return;
    }
    size_t depth = (size_t)L->nslots, issued = 0;
    int broke = 0, woken = 0;
    /* every slot is idle here: download shares end with their slots reaped */
    for (size_t i = 0; i < n && !broke; i++) {
        while (issued < n && issued < i + depth && !atomic_load(&job->failed)) {
            hold_wait(L->eng);
            slot_t *slot = &L->slots[issued % depth];
            job_chunk(job, s->first + issued * s->stride, &c);
            slot->job = job;
            slot->ends = NULL;
            slot->busy = 1;
            const char *op = "";
            trace_at(job, s->first + issued * s->stride, L->index, 0);
            int rc = d_enqueue(L, slot, slot->ptr, c.dev, c.nbytes, &op);
            trace_at(job, s->first + issued * s->stride, L->index, 1);
            if (rc) {
                fail_with(L, job, rc, op);
                lane_recover(L);
                broke = 1;
                break;
            }
            issued++;
            if (s->posts && issued == n) { /* its last DMA: hand off */
                void *ev;
                rc = d_post_record(L, &ev);
                if (rc) {
                    fail_with(L, job, rc, "cuEventRecord (hand-off)");
                    lane_recover(L);
                    broke = 1;
                    break;
                }
                post_share(s, ev);
            }
            at_max(&job->t_enqueue_last, now_ns());
        }
        if (broke || i >= issued) break; /* failed elsewhere: nothing more was issued */
        slot_t *slot = &L->slots[i % depth];
        int rc = d_sync(L, slot);
        slot->busy = 0;
        if (rc) {
            fail_with(L, job, rc, "waiting for a staging DMA");
            lane_recover(L);
            broke = 1;
            break;
        }
        if (!atomic_load(&job->failed)) {
            job_chunk(job, s->first + i * s->stride, &c);
            trace_at(job, s->first + i * s->stride, L->index, 2);
            if (job->coop)
                coop_copy(L, c.host, slot->ptr, c.nbytes, job->nontemporal, &woken);
            else
                chunk_copy(job, &c, slot->ptr, 0);
            trace_at(job, s->first + i * s->stride, L->index, 3);
            s->copied += c.nbytes;
            at_max(&job->t_copy_last, now_ns());
        }
    }
    if (!broke) reap_all(L); /* a failure elsewhere may leave issued-but-unreaped slots */
    finish_share(L, s);
}

static int lane_setup(lane_t *L, err_t *e) {
    engine_t *eng = L->eng;
    int rc;
    if (eng->emulated) {
        L->es = emu_stream_start(eng, &rc);
        if (!L->es) {
            make_err(eng, rc, "starting an emulated stream", e);
            return -1;
        }
    } else {
        rc = eng->drv.cuCtxSetCurrent(eng->ctx);
        if (rc) {
            make_err(eng, rc, "cuCtxSetCurrent", e);
            return -1;
        }
        rc = eng->drv.cuStreamCreate(&L->stream, CU_STREAM_NON_BLOCKING);
        if (rc) {
            make_err(eng, rc, "cuStreamCreate", e);
            return -1;
        }
    }
    if (alloc_slots(L, e)) return -1;
    for (; L->nhandoff < HANDOFF_EVENTS; L->nhandoff++) {
        void **ev = &L->handoff[L->nhandoff];
        if (eng->emulated) {
            *ev = calloc(1, sizeof(emu_event_t));
            rc = *ev ? 0 : ERR_OUT_OF_MEMORY;
        } else {
            rc = eng->drv.cuEventCreate((CUevent *)ev, CU_EVENT_DISABLE_TIMING);
        }
        if (rc) {
            make_err(eng, rc, "creating a hand-off event", e);
            return -1;
        }
    }
    return 0;
}

static void lane_teardown(lane_t *L) {
    engine_t *eng = L->eng;
    if (eng->emulated && L->es) {
        emu_stream_stop(L->es); /* every queued op ran: nothing touches a slot any more */
        L->es = NULL;
        while (L->abandoned) {
            abandoned_t *a = L->abandoned;
            L->abandoned = a->next;
            d_slot_free(L, a->ptr, a->ev);
            free(a);
        }
    }
    for (int j = 0; j < L->nslots; j++) d_slot_free(L, L->slots[j].ptr, L->slots[j].ev);
    if (L->nslots) atomic_fetch_sub(&eng->held_bytes, (long long)eng->slot_bytes * L->nslots);
    L->nslots = 0;
    for (int j = 0; j < L->nhandoff; j++) { /* waits made on them keep what they captured */
        if (eng->emulated)
            free(L->handoff[j]);
        else
            eng->drv.cuEventDestroy((CUevent)L->handoff[j]);
    }
    L->nhandoff = 0;
    if (!eng->emulated && L->stream) {
        eng->drv.cuStreamDestroy(L->stream);
        L->stream = NULL;
    }
}

void *lane_main(void *arg) {
    lane_t *L = arg;
    engine_t *eng = L->eng;
    err_t e;
    memset(&e, 0, sizeof e);
    int failed = lane_setup(L, &e);
    if (failed) lane_teardown(L); /* before reporting: the constructor then stops the other lanes */
    pthread_mutex_lock(&eng->mu);
    if (failed && !eng->setup_failed) {
        eng->setup_failed = 1;
        eng->setup_err = e;
    }
    eng->ready++;
    pthread_cond_broadcast(&eng->cv);
    pthread_mutex_unlock(&eng->mu);
    if (failed) return NULL;
    for (;;) {
        int spun = 0, helped_out = 0;
        pthread_mutex_lock(&L->mu);
        while (!L->head && !L->stopping) {
            if (any_busy(L)) { /* idle: finish what is in flight before sleeping */
                pthread_mutex_unlock(&L->mu);
                reap_all(L);
                pthread_mutex_lock(&L->mu);
                continue;
            }
            if (eng->helpers && !helped_out && atomic_load(&eng->leads) > 0) { /* a lead may post a copy */
                pthread_mutex_unlock(&L->mu);
                helped_out = help(L);
                pthread_mutex_lock(&L->mu);
                continue;
            }
            if (eng->idle_spin_ns > 0 && !spun) { /* back-to-back jobs: poll before paying a wake-up */
                pthread_mutex_unlock(&L->mu);
                int64_t until = now_ns() + eng->idle_spin_ns;
                while (!atomic_load_explicit(&L->queued, memory_order_acquire) && now_ns() < until) cpu_relax();
                spun = 1;
                pthread_mutex_lock(&L->mu);
                continue;
            }
            L->sleeping = 1; /* under mu: a submitter that queues after this signals */
            atomic_fetch_add(&eng->idle_sleepers, 1);
            pthread_cond_wait(&L->cv, &L->mu);
            L->sleeping = 0;
            if (L->help_woken) { /* the waker took this lane off idle_sleepers */
                L->help_woken = 0;
                atomic_fetch_sub(&eng->waking, 1);
            } else
                atomic_fetch_sub(&eng->idle_sleepers, 1);
            helped_out = 0;
        }
        share_t *s = L->head;
        if (!s) {
            pthread_mutex_unlock(&L->mu);
            break;
        }
        L->head = s->next;
        if (!L->head) L->tail = NULL;
        atomic_fetch_sub_explicit(&L->queued, 1, memory_order_relaxed);
        pthread_mutex_unlock(&L->mu);
        long long t = now_ns();
        at_min(&s->job->t_start_first, t);
        at_max(&s->job->t_start_last, t);
        int coop = s->job->coop; /* the share (and maybe the job) is gone once it ran */
        if (s->job->file)
            run_file(L, s);
        else if (eng->upload)
            run_upload(L, s);
        else
            run_download(L, s);
        if (coop) atomic_fetch_sub(&eng->leads, 1); /* copied all it will: helpers may sleep */
        if (eng->dt) atomic_fetch_sub_explicit(&eng->dt->active, 1, memory_order_release); /* enqueued all */
    }
    reap_all(L);
    lane_teardown(L);
    return NULL;
}

/* -- the slot ring's operations, for file jobs (file.c) ------------------------------------------- */

int lane_reap(lane_t *L, slot_t *slot) { return reap(L, slot); }
void lane_reap_all(lane_t *L) { reap_all(L); }
void lane_recover_slots(lane_t *L) { lane_recover(L); }
void lane_finish_share(lane_t *L, share_t *s) { finish_share(L, s); }
void lane_hold_wait(engine_t *eng) { hold_wait(eng); }
