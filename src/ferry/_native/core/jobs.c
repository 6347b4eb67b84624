/*
 * core/jobs.c: a job's lifetime and its chunks' geometry.
 *
 * A job is one staged transfer: a host array (contiguous, or strided with up to MAX_DIMS axes) and a
 * device range, cut into chunks of at most a slot. Its plan is O(lanes) at submit time: a share is
 * (job, first chunk, stride), and a chunk's geometry is computed by the lane when it gets to it
 * (job_chunk: contiguous chunks are byte ranges, strided ones sub-arrays along an axis, in the C-order
 * image the device holds). Invariants: a job is freed when its last reference goes (one for the
 * Python Job object, one per share: job_decref); its first error is kept under its mutex and
 * published by a release store of `failed` (job_fail; a device error replaces a file job's host-side
 * error met first, never the reverse); `done` is set once, under the mutex, with a
 * broadcast, by the lane that brings `remaining` to zero (job_complete).
 */
#include "core.h"

void job_decref(job_t *job) {
    if (atomic_fetch_sub_explicit(&job->refs, 1, memory_order_acq_rel) == 1) {
        pthread_mutex_destroy(&job->mu);
        pthread_cond_destroy(&job->cv);
        free(job->trace);
        file_job_free(job->file);
        free(job->pieces);
        free(job->lchunks);
        free(job);
    }
}

void job_fail(job_t *job, const err_t *e) {
    pthread_mutex_lock(&job->mu);
    /* a device error outranks a file job's host-side one (file.c) met first: the device may still touch
     * what its DMA did, so the job must say the device failed */
    if (!atomic_load_explicit(&job->failed, memory_order_relaxed) ||
        (job->err.code == FILE_ERROR_CODE && e->code != FILE_ERROR_CODE)) {
        job->err = *e;
        atomic_store_explicit(&job->failed, 1, memory_order_release);
    }
    pthread_mutex_unlock(&job->mu);
}

void job_complete(job_t *job) {
    atomic_store_explicit(&job->t_done, now_ns(), memory_order_relaxed);
    pthread_mutex_lock(&job->mu);
    atomic_store_explicit(&job->done, 1, memory_order_release);
    pthread_cond_broadcast(&job->cv);
    pthread_mutex_unlock(&job->mu);
}
void job_chunk(const job_t *job, size_t k, chunk_t *c) {
    c->lc = NULL;
    if (job->lchunks) { /* a job of many pieces */
        const lchunk_t *lc = &job->lchunks[k];
        c->offset = 0;
        c->nbytes = lc->nbytes;
        c->host = job->pieces[lc->first].host + lc->skip;
        c->dev = lc->dev;
        c->lc = lc;
        c->nd = -1;
        return;
    }
    if (job->contiguous) {
        c->offset = k * job->chunk_bytes;
        c->nbytes = job->nbytes - c->offset < job->chunk_bytes ? job->nbytes - c->offset : job->chunk_bytes;
        c->host = job->host + c->offset;
        c->dev = job->dev + c->offset;
        c->nd = 0;
        return;
    }
    size_t prefix = k / job->nper;
    size_t r = k % job->nper;
    size_t start = r * job->per;
    size_t count = (size_t)job->shape[job->axis] - start;
    if (count > job->per) count = job->per;
    ptrdiff_t host_off = 0;
    size_t image_off = 0;
    for (int a = job->axis - 1; a >= 0; a--) { /* decompose prefix over shape[:axis], C order */
        size_t idx = prefix % (size_t)job->shape[a];
        prefix /= (size_t)job->shape[a];
        host_off += (ptrdiff_t)idx * job->strides[a];
        image_off += idx * job->step[a];
    }
    host_off += (ptrdiff_t)start * job->strides[job->axis];
    image_off += start * job->step[job->axis];
    c->offset = image_off;
    c->dev = job->dev + image_off;
    c->nbytes = count * job->step[job->axis];
    c->host = job->host + host_off;
    c->nd = job->ndim - job->axis;
    c->len[0] = (ptrdiff_t)count;
    c->str[0] = job->strides[job->axis];
    for (int a = job->axis + 1; a < job->ndim; a++) {
        c->len[a - job->axis] = job->shape[a];
        c->str[a - job->axis] = job->strides[a];
    }
}

