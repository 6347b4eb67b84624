/*
 * core/file.c: file jobs, bytes between a file and device memory through the lanes' slots (no Python.h).
 *
 * A file job is a job (jobs.c) whose chunks are read from a file or written to one instead of copied from
 * a host array. Python plans it (which file ranges, which DMAs from each): chunk k reads `length` bytes
 * at file offset `start` into a slot, of which `need` must arrive, and its `ndma` DMAs move slot ranges
 * to (or from) device addresses. The kernel writes the read straight into the pinned slot: one host copy
 * (page cache -> slot), or none with O_DIRECT (the disk's DMA), then the slot's DMAs.
 *
 * Lanes claim chunks from one atomic counter, so the file is read nearly sequentially whichever lanes
 * run, every lane has a read in flight, and read-ahead is bounded by the lanes' slots. An upload's lane,
 * per chunk: take its next slot (reaping its previous DMA, as run_upload does), pread into it (looping on
 * short reads and EINTR), enqueue the chunk's DMAs (each records the slot's event: the last record stands
 * for all of them, on the lane's in-order stream), claim the next chunk: the next read overlaps the
 * previous DMA. A download's lane keeps up to its slots' count of chunks in flight: DMAs into a slot,
 * then for the oldest, wait for its event and pwrite the slot out.
 *
 * O_DIRECT: with `direct` set and a descriptor for it, reads take whole 4096-byte blocks at aligned
 * offsets into aligned slots (the plan aligns chunks); a filesystem that refuses it (EINVAL) turns it off
 * for the rest of the job and the read is retried buffered; a short direct read mid-file continues
 * buffered. Writes use it for aligned chunks only.
 *
 * Failure: a read or write that fails (errno), a read that ends before `need` bytes (the file was cut
 * short), or a cancel fails the job with code FILE_ERROR_CODE, the file offset and the errno kept in the
 * file job; every lane then stops claiming. The lane that met the error recovers as after a failed DMA
 * (lane_recover: its busy slots are waited for, then abandoned and counted, fresh ones taken), so a failed
 * file job's slots are accounted exactly as a failed staged job's. A driver error is handled as in
 * lanes.c. Invariants: the descriptors belong to the caller, who keeps them open until the job is done;
 * the plan is copied at submission (the caller's buffers are not kept) and checked there (a download's DMAs
 * fill each chunk's bytes exactly: the slot's stale bytes never reach the file); `moved` counts payload bytes
 * whose read (or write) finished, for progress only.
 */
#include "core.h"

#include <limits.h>

#define FILE_ALIGN 4096u

void file_job_free(file_job_t *fj) {
    if (!fj) return;
    free(fj->chunks);
    free(fj->first);
    free(fj->dmas);
    free(fj->name);
    free(fj);
}

static job_t *file_plan_failed(job_t *job, file_job_t *fj, int *kind, const char **why, int k, const char *text) {
    file_job_free(fj);
    free(job);
    *kind = k;
    *why = text;
    return NULL;
}

job_t *file_job_plan(const engine_t *eng, int fd, int direct_fd, int direct, const char *name,
                     const file_chunk_t *chunks, size_t nchunks, const file_dma_t *dmas, size_t ndmas, int *kind,
                     const char **why) {
    job_t *job = calloc(1, sizeof *job);
    file_job_t *fj = calloc(1, sizeof *fj);
    if (!job || !fj) return file_plan_failed(job, fj, kind, why, PLAN_NO_MEMORY, "out of memory");
    if (fd < 0) return file_plan_failed(job, fj, kind, why, PLAN_VALUE, "fd must be an open descriptor");
    fj->fd = fd;
    fj->direct_fd = direct_fd;
    atomic_init(&fj->direct, direct && direct_fd >= 0);
    fj->name = strdup(name ? name : "");
    fj->chunks = malloc((nchunks ? nchunks : 1) * sizeof *chunks);
    fj->first = malloc((nchunks ? nchunks : 1) * sizeof(size_t));
    fj->dmas = malloc((ndmas ? ndmas : 1) * sizeof *dmas);
    if (!fj->name || !fj->chunks || !fj->first || !fj->dmas)
        return file_plan_failed(job, fj, kind, why, PLAN_NO_MEMORY, "out of memory");
    if (nchunks) memcpy(fj->chunks, chunks, nchunks * sizeof *chunks);
    if (ndmas) memcpy(fj->dmas, dmas, ndmas * sizeof *dmas);
    fj->nchunks = nchunks;
    fj->ndmas = ndmas;
    size_t next = 0, total = 0;
    for (size_t k = 0; k < nchunks; k++) {
        const file_chunk_t *c = &fj->chunks[k];
        if (!c->length || c->length > eng->slot_bytes || c->need > c->length || !c->ndma ||
            c->start > (unsigned long long)LLONG_MAX - c->length)
            return file_plan_failed(job, fj, kind, why, PLAN_VALUE,
                                    "a chunk needs 0 < need <= length <= slot_bytes and at least one DMA");
        if (c->ndma > ndmas - next)
            return file_plan_failed(job, fj, kind, why, PLAN_VALUE, "the chunks name more DMAs than were given");
        fj->first[k] = next;
        unsigned long long filled = 0; /* a download: the chunk's bytes its DMAs filled so far, in order */
        for (size_t j = next; j < next + c->ndma; j++) {
            const file_dma_t *d = &fj->dmas[j];
            if (!d->n || !d->dev || d->slot_off > c->length || d->n > c->length - d->slot_off ||
                (eng->upload ? d->slot_off + d->n > c->need : 0))
                return file_plan_failed(job, fj, kind, why, PLAN_VALUE,
                                        "a DMA must be a non-empty range of its chunk's bytes, to a device address");
            if (!eng->upload) {
                if (d->slot_off != filled)
                    return file_plan_failed(job, fj, kind, why, PLAN_VALUE,
                                            "a download's DMAs must fill its chunk, in order");
                filled += d->n;
            }
            total += (size_t)d->n;
        }
        if (!eng->upload && filled != c->length) /* else the slot's stale bytes would be written to the file */
            return file_plan_failed(job, fj, kind, why, PLAN_VALUE, "a download's DMAs must fill its chunk, in order");
        next += c->ndma;
    }
    if (next != ndmas) return file_plan_failed(job, fj, kind, why, PLAN_VALUE, "DMAs left over after the chunks");
    atomic_init(&fj->next, 0);
    atomic_init(&fj->moved, 0);
    fj->inject_chunk = -1;
    job->file = fj;
    job->nontemporal = 0;
    job->upload = eng->upload;
    job->ndim = 1;
    job->itemsize = 1;
    job->shape[0] = (ptrdiff_t)total;
    job->strides[0] = 1;
    job->step[0] = 1;
    job->contiguous = 1;
    job->nbytes = total;
    job->chunk_bytes = eng->slot_bytes;
    job->nchunks = nchunks;
    int nl = nchunks < (size_t)eng->nlanes ? (int)nchunks : eng->nlanes;
    job->nlanes = nl;
    atomic_init(&job->done, nl == 0);
    atomic_init(&job->failed, 0);
    atomic_init(&job->remaining, nl);
    atomic_init(&job->unposted, 0);
    atomic_init(&job->host_bytes, 0);
    atomic_init(&job->refs, 1 + nl);
    job->t_submit = now_ns();
    atomic_init(&job->t_start_first, 0);
    atomic_init(&job->t_start_last, 0);
    atomic_init(&job->t_copy_last, 0);
    atomic_init(&job->t_enqueue_last, 0);
    atomic_init(&job->t_done, nl == 0 ? job->t_submit : 0);
    if (pthread_mutex_init(&job->mu, NULL))
        return file_plan_failed(job, fj, kind, why, PLAN_NO_MEMORY, "out of memory");
    if (cond_init_monotonic(&job->cv)) {
        pthread_mutex_destroy(&job->mu);
        return file_plan_failed(job, fj, kind, why, PLAN_NO_MEMORY, "out of memory");
    }
    *kind = PLAN_OK;
    return job;
}

static const char *file_what(int kind) {
    switch (kind) {
    case FILE_ERR_READ: return "the read failed";
    case FILE_ERR_SHORT: return "the file ended there (was it truncated?)";
    case FILE_ERR_WRITE: return "the write failed";
    case FILE_ERR_NO_PROGRESS: return "the write made no progress";
    case FILE_ERR_CANCELLED: return "the transfer was cancelled";
    default: return "failed";
    }
}

int file_fail(job_t *job, int kind, int errnum, unsigned long long offset, size_t chunk) {
    file_job_t *fj = job->file;
    int first = 0;
    pthread_mutex_lock(&job->mu);
    /* a cancel comes too late for a job done (done is set under the mutex): it stays a success */
    int late = kind == FILE_ERR_CANCELLED && atomic_load_explicit(&job->done, memory_order_relaxed);
    if (!late && !atomic_load_explicit(&job->failed, memory_order_relaxed)) {
        first = 1;
        job->err.code = FILE_ERROR_CODE;
        job->err.sticky = 0;
        if (errnum)
            snprintf(job->err.text, sizeof job->err.text, "'%s' at byte %llu: %s: %s (errno %d)", fj->name, offset,
                     file_what(kind), strerror(errnum), errnum);
        else
            snprintf(job->err.text, sizeof job->err.text, "'%s' at byte %llu: %s", fj->name, offset,
                     file_what(kind));
        fj->err_kind = kind;
        fj->err_errno = errnum;
        fj->err_offset = offset;
        fj->err_chunk = chunk;
        atomic_store_explicit(&job->failed, 1, memory_order_release);
    }
    pthread_mutex_unlock(&job->mu);
    return first;
}

static int is_aligned(const void *p, unsigned long long v) {
    return (uintptr_t)p % FILE_ALIGN == 0 && v % FILE_ALIGN == 0;
}

/* Read chunk k into dst: 0, or -1 with the job failed (kind, errno, offset). */
static int read_chunk(job_t *job, size_t k, char *dst) {
    file_job_t *fj = job->file;
    const file_chunk_t *c = &fj->chunks[k];
    int inject = fj->inject_chunk >= 0 && (size_t)fj->inject_chunk == k; /* its first read fails (tests) */
    size_t got = 0;
    while (got < c->need) {
        int use_direct = atomic_load_explicit(&fj->direct, memory_order_relaxed) && fj->direct_fd >= 0 &&
                         is_aligned(dst + got, c->start + got);
        int fd = use_direct ? fj->direct_fd : fj->fd;
        size_t want = (size_t)(use_direct ? c->length - got : c->need - got);
        ssize_t n;
        if (inject) {
            inject = 0;
            errno = fj->inject_errno;
            n = -1;
        } else {
            n = pread(fd, dst + got, want, (off_t)(c->start + got));
        }
        if (n < 0) {
            int err = errno;
            if (err == EINTR) continue;
            if (use_direct && err == EINVAL) { /* the filesystem refuses O_DIRECT here: read buffered */
                atomic_store_explicit(&fj->direct, 0, memory_order_relaxed);
                continue;
            }
            file_fail(job, FILE_ERR_READ, err, c->start + got, k);
            return -1;
        }
        if (n == 0) {
            file_fail(job, FILE_ERR_SHORT, 0, c->start + got, k);
            return -1;
        }
        got += (size_t)n;
        if (use_direct && (size_t)n % FILE_ALIGN && got < c->need) /* a short direct read mid-file */
            atomic_store_explicit(&fj->direct, 0, memory_order_relaxed);
    }
    return 0;
}

/* Write chunk k out of src: 0, or -1 with the job failed. */
static int write_chunk(job_t *job, size_t k, const char *src) {
    file_job_t *fj = job->file;
    const file_chunk_t *c = &fj->chunks[k];
    int inject = fj->inject_chunk >= 0 && (size_t)fj->inject_chunk == k;
    int aligned = is_aligned(src, c->start) && c->length % FILE_ALIGN == 0;
    size_t done = 0;
    while (done < c->length) {
        int use_direct = aligned && done % FILE_ALIGN == 0 && fj->direct_fd >= 0 &&
                         atomic_load_explicit(&fj->direct, memory_order_relaxed);
        int fd = use_direct ? fj->direct_fd : fj->fd;
        ssize_t n;
        if (inject) {
            inject = 0;
            errno = fj->inject_errno;
            n = -1;
        } else {
            n = pwrite(fd, src + done, (size_t)(c->length - done), (off_t)(c->start + done));
        }
        if (n < 0) {
            int err = errno;
            if (err == EINTR) continue;
            if (use_direct && err == EINVAL) {
                atomic_store_explicit(&fj->direct, 0, memory_order_relaxed);
                continue;
            }
            file_fail(job, FILE_ERR_WRITE, err, c->start + done, k);
            return -1;
        }
        if (n == 0) {
            file_fail(job, FILE_ERR_NO_PROGRESS, 0, c->start + done, k);
            return -1;
        }
        done += (size_t)n;
    }
    return 0;
}

static void dma_failed(lane_t *L, job_t *job, int rc, const char *op) {
    err_t e;
    make_err(L->eng, rc, op, &e);
    job_fail(job, &e);
    lane_recover_slots(L);
}

static int job_failed(job_t *job) { return atomic_load_explicit(&job->failed, memory_order_acquire); }

static size_t payload_of(const file_job_t *fj, size_t k) {
    size_t n = 0;
    for (size_t j = fj->first[k]; j < fj->first[k] + fj->chunks[k].ndma; j++) n += (size_t)fj->dmas[j].n;
    return n;
}

/* Enqueue chunk k's DMAs from (or into) the slot; 0, or the failing call's code with *op naming it. */
static int enqueue_chunk(lane_t *L, job_t *job, size_t k, slot_t *slot, const char **op) {
    file_job_t *fj = job->file;
    for (size_t j = fj->first[k]; j < fj->first[k] + fj->chunks[k].ndma; j++) {
        const file_dma_t *d = &fj->dmas[j];
        int rc = d_enqueue(L, slot, slot->ptr + d->slot_off, (CUdeviceptr)d->dev, (size_t)d->n, op);
        if (rc) return rc;
    }
    return 0;
}

static void file_upload(lane_t *L, share_t *s) {
    job_t *job = s->job;
    file_job_t *fj = job->file;
    L->cur_last = NULL;
    for (;;) {
        if (job_failed(job)) break;
        if (L->broken) {
            job_fail(job, &L->broken_err);
            break;
        }
        size_t k = atomic_fetch_add_explicit(&fj->next, 1, memory_order_relaxed);
        if (k >= fj->nchunks) break;
        lane_hold_wait(L->eng);
        slot_t *slot;
        for (;;) { /* the next slot, its previous DMA reaped (a failed reap recovers: fresh slots) */
            slot = &L->slots[L->cursor % (size_t)L->nslots];
            if (!slot->busy || !lane_reap(L, slot) || L->broken) break;
        }
        if (L->broken) {
            job_fail(job, &L->broken_err);
            break;
        }
        if (job_failed(job)) break; /* the reap failed this job */
        if (read_chunk(job, k, slot->ptr)) {
            lane_recover_slots(L);
            break;
        }
        at_max(&job->t_copy_last, now_ns());
        slot->job = job;
        slot->ends = NULL;
        slot->busy = 1; /* from here on a DMA may touch it */
        const char *op = "";
        int rc = enqueue_chunk(L, job, k, slot, &op);
        if (rc) {
            dma_failed(L, job, rc, op);
            break;
        }
        L->cursor++;
        L->cur_last = slot;
        atomic_fetch_add_explicit(&fj->moved, payload_of(fj, k), memory_order_relaxed);
        at_max(&job->t_enqueue_last, now_ns());
    }
    if (L->cur_last) {
        L->cur_last->ends = s; /* reported when that event is reaped */
        L->cur_last = NULL;
        return;
    }
    lane_finish_share(L, s);
}

static void file_download(lane_t *L, share_t *s) {
    job_t *job = s->job;
    file_job_t *fj = job->file;
    if (L->broken) {
        job_fail(job, &L->broken_err);
        lane_finish_share(L, s);
        return;
    }
    size_t depth = (size_t)L->nslots, head = 0, count = 0;
    size_t ring[MAX_SLOTS];
    int broke = 0;
    /* every slot is idle here: download shares end with their slots reaped */
    for (;;) {
        while (count < depth && !job_failed(job)) {
            lane_hold_wait(L->eng);
            size_t k = atomic_fetch_add_explicit(&fj->next, 1, memory_order_relaxed);
            if (k >= fj->nchunks) break;
            size_t at = (head + count) % depth;
            slot_t *slot = &L->slots[at];
            slot->job = job;
            slot->ends = NULL;
            slot->busy = 1;
            const char *op = "";
            int rc = enqueue_chunk(L, job, k, slot, &op);
            if (rc) {
                dma_failed(L, job, rc, op);
                broke = 1;
                break;
            }
            ring[at] = k;
            count++;
            at_max(&job->t_enqueue_last, now_ns());
        }
        if (broke || !count) break;
        slot_t *slot = &L->slots[head];
        int rc = d_sync(L, slot);
        slot->busy = 0;
        if (rc) {
            dma_failed(L, job, rc, "waiting for a staging DMA");
            broke = 1;
            break;
        }
        if (!job_failed(job)) {
            size_t k = ring[head];
            if (write_chunk(job, k, slot->ptr)) {
                lane_recover_slots(L);
                broke = 1;
                break;
            }
            at_max(&job->t_copy_last, now_ns());
            atomic_fetch_add_explicit(&fj->moved, payload_of(fj, k), memory_order_relaxed);
        }
        head = (head + 1) % depth;
        count--;
    }
    if (!broke) lane_reap_all(L); /* a failure elsewhere may leave issued-but-unreaped slots */
    lane_finish_share(L, s);
}

void run_file(lane_t *L, share_t *s) {
    if (L->eng->upload)
        file_upload(L, s);
    else
        file_download(L, s);
}
