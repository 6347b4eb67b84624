/*
 * core/engine.c: an engine's life: its start, a job's plan and queueing, its stop (no Python.h).
 *
 * engine_start takes an engine_t whose parameters are filled (engine.c does it from Python's
 * arguments; tests/native/core_test.c from C) and starts the driver thread and the lanes, each of which
 * sets itself up on its own thread; it returns once every lane is ready, or stops and frees everything
 * if one could not be. job_plan checks a job's description and cuts it into chunks; engine_queue deals
 * its shares to the lanes. Invariants: a job holds one reference per share and one for its owner (the
 * Python Job, or a C caller), and is freed by the last job_decref; shares are queued under the engine's
 * mutex, so none is queued once close began (ENGINE_CLOSED: nothing was queued, the job is the
 * caller's); engine_stop_lanes lifts a hold, lets every queued share run, joins the lanes, then stops
 * the driver thread (no lane is left to ask it).
 */
#include "core.h"

static job_t *plan_failed(job_t *job, int *kind, const char **why, int k, const char *text) {
    if (job) {
        free(job->trace);
        free(job);
    }
    *kind = k;
    *why = text;
    return NULL;
}

size_t auto_chunk(const engine_t *eng, size_t nbytes) {
    size_t lanes = (size_t)eng->nlanes;
    size_t per_lane = (nbytes + lanes * eng->slot_bytes - 1) / (lanes * eng->slot_bytes);
    if (per_lane < (size_t)eng->min_chunks_per_lane) per_lane = (size_t)eng->min_chunks_per_lane;
    size_t chunk = (nbytes + lanes * per_lane - 1) / (lanes * per_lane);
    chunk = (chunk + 65535) / 65536 * 65536;
    if (chunk < eng->min_chunk_bytes) chunk = eng->min_chunk_bytes;
    if (chunk > eng->slot_bytes) chunk = eng->slot_bytes;
    return chunk;
}

/* A cooperative job's chunk: a quarter of the job (so that the link starts after a quarter's copy),
 * whole 64 KiB, at least two pieces and min_chunk_bytes, at most a slot. */
size_t coop_chunk(const engine_t *eng, size_t nbytes) {
    size_t chunk = (nbytes + COOP_CHUNKS - 1) / COOP_CHUNKS;
    chunk = (chunk + 65535) / 65536 * 65536;
    if (chunk < eng->min_chunk_bytes) chunk = eng->min_chunk_bytes;
    if (chunk < 2 * eng->piece_bytes) chunk = 2 * eng->piece_bytes;
    if (chunk > eng->slot_bytes) chunk = eng->slot_bytes;
    return chunk;
}

/*
 * Whether a job's chunk copies stream past the cache (copy_bytes). The engine's `nontemporal` says yes, but
 * for an upload that gives every lane at least CACHED_CHUNKS_PER_LANE chunks (a large array, a state dict):
 * there each lane reuses its slots chunk after chunk, and plain stores that leave the slot's lines in the
 * cache for its DMA moved more (on the H200, one run of 4 interleaved rounds: a 1 GiB tree of 16 MiB
 * leaves 43.9 GB/s against 38.5, 512 x 1 MiB 41.2 against 36.8, one 256 MiB array 41.8 against 38.2),
 * while a job of one or two chunks per lane, and every cooperative job, lost (8 MiB 14 against 29 GB/s,
 * 64 MiB 31 against 36.5). Downloads stream: their stores go to the user's array, read much later.
 */
int job_streams(const engine_t *eng, size_t nchunks, int coop) {
    if (!eng->nontemporal) return 0;
    return !eng->upload || coop || nchunks < CACHED_CHUNKS_PER_LANE * (size_t)eng->nlanes;
}

int is_coop(const engine_t *eng, int contiguous, size_t nbytes) {
    return eng->helpers > 0 && contiguous && nbytes >= 2 * eng->piece_bytes && nbytes <= eng->coop_max_bytes;
}

job_t *job_plan(const engine_t *eng, char *host, CUdeviceptr dev, long long nbytes, int ndim, const ptrdiff_t *shape,
               const ptrdiff_t *strides, long long itemsize, long long chunk_bytes, int hand_off, int *kind,
               const char **why) {
    job_t *job = calloc(1, sizeof *job);
    if (!job) return plan_failed(NULL, kind, why, PLAN_NO_MEMORY, "out of memory");
    if (ndim < 0 || ndim > MAX_DIMS) return plan_failed(job, kind, why, PLAN_VALUE, "too many dimensions");
    memcpy(job->shape, shape, (size_t)ndim * sizeof shape[0]);
    memcpy(job->strides, strides, (size_t)ndim * sizeof strides[0]);
    if (itemsize < 1 || nbytes < 0 || chunk_bytes < 0) {
        return plan_failed(job, kind, why, PLAN_VALUE, "itemsize must be >= 1, nbytes and chunk_bytes >= 0");
    }
    if ((size_t)itemsize > eng->slot_bytes) {
        return plan_failed(job, kind, why, PLAN_VALUE, "itemsize is larger than a staging slot");
    }
    if ((!host || !dev) && nbytes) {
        return plan_failed(job, kind, why, PLAN_VALUE, "host_ptr and device_ptr must not be NULL");
    }
    job->ndim = ndim;
    job->itemsize = (size_t)itemsize;
    size_t count = 1;
    for (int a = 0; a < job->ndim; a++) {
        if (job->shape[a] < 0) {
            return plan_failed(job, kind, why, PLAN_VALUE, "shape entries must be >= 0");
        }
        if (job->shape[a] && count > SIZE_MAX / (size_t)job->shape[a]) {
            return plan_failed(job, kind, why, PLAN_OVERFLOW, "the array is too large");
        }
        count *= (size_t)job->shape[a];
    }
    if (count > SIZE_MAX / job->itemsize || count * job->itemsize != (size_t)nbytes) {
        return plan_failed(job, kind, why, PLAN_VALUE, "nbytes does not equal prod(shape) * itemsize");
    }
    job->upload = eng->upload;
    job->host = host;
    job->dev = dev;
    job->nbytes = (size_t)nbytes;
    /* contiguous in C order? (dims of length 1 do not matter) */
    size_t step = job->itemsize;
    job->contiguous = 1;
    for (int a = job->ndim - 1; a >= 0; a--) {
        job->step[a] = step;
        if (job->shape[a] != 1 && job->strides[a] != (ptrdiff_t)step) job->contiguous = 0;
        step *= (size_t)job->shape[a];
    }
    job->coop = is_coop(eng, job->contiguous, job->nbytes);
    size_t chunk = chunk_bytes ? (size_t)chunk_bytes
                   : job->coop ? coop_chunk(eng, job->nbytes)
                               : auto_chunk(eng, job->nbytes);
    if (chunk > eng->slot_bytes) chunk = eng->slot_bytes;
    if (chunk < 1) chunk = 1;
    job->chunk_bytes = chunk;
    if (job->nbytes == 0) {
        job->nchunks = 0;
    } else if (job->contiguous) {
        job->nchunks = (job->nbytes + chunk - 1) / chunk;
    } else {
        int axis = job->ndim - 1;
        for (int a = 0; a < job->ndim; a++)
            if (job->step[a] <= chunk) {
                axis = a;
                break;
            }
        size_t per = chunk / job->step[axis];
        if (per < 1) per = 1;
        job->axis = axis;
        job->per = per;
        job->nper = ((size_t)job->shape[axis] + per - 1) / per;
        size_t prefixes = 1;
        for (int a = 0; a < axis; a++) prefixes *= (size_t)job->shape[a];
        job->nchunks = prefixes * job->nper;
    }
    job->nontemporal = job_streams(eng, job->nchunks, job->coop);
    if (job->nchunks && job->nchunks <= TRACE_CHUNKS) job->trace = calloc(job->nchunks, sizeof(chunk_trace_t));
    int nl = job->nchunks < (size_t)eng->nlanes ? (int)job->nchunks : eng->nlanes;
    if (job->coop && nl > 1) nl = 1; /* the lead takes every chunk; helpers copy with it */
    if (!nl) job->coop = 0;
    job->nlanes = nl;
    atomic_init(&job->done, nl == 0);
    atomic_init(&job->failed, 0);
    atomic_init(&job->remaining, nl);
    atomic_init(&job->unposted, hand_off ? nl : 0);
    atomic_init(&job->host_bytes, 0);
    atomic_init(&job->refs, 1 + nl);
    job->t_submit = now_ns();
    atomic_init(&job->t_start_first, 0);
    atomic_init(&job->t_start_last, 0);
    atomic_init(&job->t_copy_last, 0);
    atomic_init(&job->t_enqueue_last, 0);
    atomic_init(&job->t_done, nl == 0 ? job->t_submit : 0);
    if (pthread_mutex_init(&job->mu, NULL)) return plan_failed(job, kind, why, PLAN_NO_MEMORY, "out of memory");
    if (cond_init_monotonic(&job->cv)) {
        pthread_mutex_destroy(&job->mu);
        return plan_failed(job, kind, why, PLAN_NO_MEMORY, "out of memory");
    }
    *kind = PLAN_OK;
    return job;
}

int engine_queue(engine_t *eng, job_t *job, int hand_off) {
    int nl = job->nlanes;
    share_t *shares[MAX_LANES];
    for (int i = 0; i < nl; i++) {
        shares[i] = calloc(1, sizeof(share_t));
        if (!shares[i]) {
            for (int j = 0; j < i; j++) free(shares[j]);
            return ENGINE_NO_MEMORY;
        }
    }
    pthread_mutex_lock(&eng->mu);
    if (eng->closing) { /* another thread closed it since the caller looked */
        pthread_mutex_unlock(&eng->mu);
        for (int j = 0; j < nl; j++) free(shares[j]);
        return ENGINE_CLOSED;
    }
    int start = eng->next_lane;
    eng->next_lane = (int)(((size_t)start + (job->coop ? 1 : job->nchunks)) % (size_t)eng->nlanes);
    if (job->coop) { /* before the lead can run (and count down): helpers look for it */
        atomic_fetch_add(&eng->leads, 1);
        atomic_fetch_add_explicit(&eng->coop_jobs, 1, memory_order_relaxed);
    }
    if (eng->dt) atomic_fetch_add(&eng->dt->active, nl); /* before a lane can run (and count down) one */
    for (int i = 0; i < nl; i++) {
        share_t *s = shares[i];
        s->job = job;
        s->first = (size_t)i;
        s->stride = (size_t)nl;
        s->posts = hand_off;
    }
    /* Queue every share, then wake the lanes that sleep, outside their mutexes (a lane woken while
     * its mutex is held would only block on it again: a second wake-up, costly on a VM). A lane
     * that is busy or polling finds its share without a signal. */
    lane_t *sleepers[MAX_LANES];
    int nsleep = 0;
    for (int i = 0; i < nl; i++) {
        lane_t *L = &eng->lanes[(start + i) % eng->nlanes];
        pthread_mutex_lock(&L->mu);
        if (L->tail)
            L->tail->next = shares[i];
        else
            L->head = shares[i];
        L->tail = shares[i];
        atomic_fetch_add_explicit(&L->queued, 1, memory_order_release);
        if (L->sleeping) sleepers[nsleep++] = L;
        pthread_mutex_unlock(&L->mu);
    }
    pthread_mutex_unlock(&eng->mu);
    for (int i = 0; i < nsleep; i++) pthread_cond_signal(&sleepers[i]->cv);
    if (job->coop) /* helpers wake while the lead does: a wake-up costs 50 - 200 us on the H200's VM */
        wake_helpers(&eng->lanes[start], eng->helpers);
    if (eng->dt) dt_wake(eng->dt); /* up and polling before the job's first copy ends */
    return 0;
}

int engine_start(engine_t *eng, int driver_thread, int one_stream, err_t *e) {
    int lanes = eng->nlanes;
    if (pthread_mutex_init(&eng->mu, NULL)) {
        free(eng);
        return ENGINE_NO_MEMORY;
    }
    if (pthread_cond_init(&eng->cv, NULL)) {
        pthread_mutex_destroy(&eng->mu);
        free(eng);
        return ENGINE_NO_MEMORY;
    }
    int inited = 0;
    for (; inited < lanes; inited++) {
        lane_t *L = &eng->lanes[inited];
        L->eng = eng;
        L->index = inited;
        atomic_init(&L->queued, 0);
        atomic_init(&L->help_task, NULL);
        atomic_init(&L->help_posted, 0);
        atomic_init(&L->help_active, 0);
        if (pthread_mutex_init(&L->mu, NULL)) break;
        if (cond_init_monotonic(&L->cv)) { /* dt_call's timed wait uses monotonic deadlines */
            pthread_mutex_destroy(&L->mu);
            break;
        }
    }
    if (inited < lanes) {
        for (int i = 0; i < inited; i++) {
            pthread_mutex_destroy(&eng->lanes[i].mu);
            pthread_cond_destroy(&eng->lanes[i].cv);
        }
        pthread_mutex_destroy(&eng->mu);
        pthread_cond_destroy(&eng->cv);
        free(eng);
        return ENGINE_NO_MEMORY;
    }
    if (driver_thread) { /* one that fails to start leaves the lanes calling the driver themselves: slower, not
                          * wrong; Engine.driver_thread reports which runs */
        int dt_rc = 0;
        eng->dt = dt_start(eng, eng->idle_spin_ns > 100000 ? eng->idle_spin_ns : 100000, one_stream, &dt_rc);
    }
    int started = 0;
    for (; started < lanes; started++) {
        lane_t *L = &eng->lanes[started];
        if (start_thread(&L->thread, lane_main, L)) break;
        L->started = 1;
    }
    pthread_mutex_lock(&eng->mu);
    while (eng->ready < started) pthread_cond_wait(&eng->cv, &eng->mu);
    pthread_mutex_unlock(&eng->mu);
    if (started < lanes || eng->setup_failed) {
        int failed = eng->setup_failed;
        *e = eng->setup_err;
        engine_stop_lanes(eng);
        engine_free(eng);
        return failed ? ENGINE_SETUP_FAILED : ENGINE_NO_THREADS;
    }
    return 0;
}

/* -- the stop (blocks: called without the GIL) ----------------------------------------------------- */

void engine_stop_lanes(engine_t *eng) {
    /* lift a hold first (queued work must finish), while every lane and its stream still exist */
    pthread_mutex_lock(&eng->mu);
    eng->closing = 1;
    atomic_store(&eng->held, 0);
    pthread_cond_broadcast(&eng->cv);
    pthread_mutex_unlock(&eng->mu);
    for (int i = 0; i < eng->nlanes; i++) {
        emu_stream_t *es = eng->lanes[i].started ? eng->lanes[i].es : NULL;
        if (!es) continue;
        pthread_mutex_lock(&es->mu);
        pthread_cond_broadcast(&es->cv);
        pthread_mutex_unlock(&es->mu);
    }
    for (int i = 0; i < eng->nlanes; i++) {
        lane_t *L = &eng->lanes[i];
        if (!L->started) continue;
        pthread_mutex_lock(&L->mu);
        L->stopping = 1;
        pthread_cond_signal(&L->cv);
        pthread_mutex_unlock(&L->mu);
    }
    for (int i = 0; i < eng->nlanes; i++) {
        lane_t *L = &eng->lanes[i];
        if (!L->started) continue;
        pthread_join(L->thread, NULL);
        L->started = 0;
    }
    dt_stop(eng->dt); /* no lane is left to ask it */
    eng->dt = NULL;
}

void engine_free(engine_t *eng) {
    for (int i = 0; i < eng->nlanes; i++) {
        pthread_mutex_destroy(&eng->lanes[i].mu);
        pthread_cond_destroy(&eng->lanes[i].cv);
    }
    pthread_mutex_destroy(&eng->mu);
    pthread_cond_destroy(&eng->cv);
    free(eng);
}

