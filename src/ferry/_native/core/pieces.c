/*
 * core/pieces.c: a job of many pieces (no Python.h).
 *
 * A tree of arrays (a state dict) moved in one submission is one job whose pieces are its leaves: each a
 * contiguous host range and the device range it moves to or from. The plan cuts the pieces into chunks of
 * at most chunk_bytes as a one-array job is cut, except that a chunk never spans a gap on the device: the
 * pieces that follow each other there without a gap (a tree's leaves allocated back to back, or views of
 * one allocation) fill one chunk, so one slot and one DMA carry many small leaves, and a piece larger than
 * a chunk is cut into several. A chunk is (first piece, bytes skipped into it, bytes, device address): its
 * host copy walks the pieces from there (chunk_copy). The plan is O(pieces + chunks) and runs on the
 * submitting thread; the chunks are dealt to the lanes round-robin, as a one-array job's. Invariants: the
 * pieces stay the job's (freed with it); chunks cover every byte of every piece exactly once, in order;
 * a job of many pieces is never cooperative.
 */
#include "core.h"

static job_t *pieces_failed(job_t *job, piece_t *pieces, int *kind, const char **why, int k, const char *text) {
    if (job) {
        free(job->lchunks);
        free(job->trace);
        free(job);
    }
    free(pieces);
    *kind = k;
    *why = text;
    return NULL;
}

job_t *job_plan_pieces(const engine_t *eng, piece_t *pieces, size_t npieces, long long chunk_bytes, int hand_off,
                       int *kind, const char **why) {
    if (chunk_bytes < 0) return pieces_failed(NULL, pieces, kind, why, PLAN_VALUE, "chunk_bytes must be >= 0");
    size_t total = 0;
    for (size_t i = 0; i < npieces; i++) {
        if ((!pieces[i].host || !pieces[i].dev) && pieces[i].nbytes)
            return pieces_failed(NULL, pieces, kind, why, PLAN_VALUE, "a piece's host and device addresses must not be NULL");
        if (pieces[i].nbytes > SIZE_MAX - total)
            return pieces_failed(NULL, pieces, kind, why, PLAN_OVERFLOW, "the pieces are too large");
        total += pieces[i].nbytes;
    }
    job_t *job = calloc(1, sizeof *job);
    if (!job) return pieces_failed(NULL, pieces, kind, why, PLAN_NO_MEMORY, "out of memory");
    size_t chunk = chunk_bytes ? (size_t)chunk_bytes : auto_chunk(eng, total);
    if (chunk > eng->slot_bytes) chunk = eng->slot_bytes;
    if (chunk < 1) chunk = 1;
    /* at most one chunk per piece plus one per full chunk of bytes */
    size_t most = npieces + total / chunk + 1;
    job->lchunks = malloc(most * sizeof(lchunk_t));
    if (!job->lchunks) return pieces_failed(job, pieces, kind, why, PLAN_NO_MEMORY, "out of memory");
    size_t n = 0;
    lchunk_t *cur = NULL;
    for (size_t i = 0; i < npieces; i++) {
        size_t off = 0, size = pieces[i].nbytes;
        while (off < size) {
            CUdeviceptr at = pieces[i].dev + off;
            if (!cur || cur->nbytes == chunk || cur->dev + cur->nbytes != at) { /* a new chunk */
                cur = &job->lchunks[n++];
                cur->first = i;
                cur->skip = off;
                cur->nbytes = 0;
                cur->dev = at;
            }
            size_t m = size - off < chunk - cur->nbytes ? size - off : chunk - cur->nbytes;
            cur->nbytes += m;
            off += m;
        }
    }
    job->pieces = pieces;
    job->npieces = npieces;
    job->nontemporal = job_streams(eng, n, 0);
    job->upload = eng->upload;
    job->itemsize = 1;
    job->ndim = 1;
    job->shape[0] = (ptrdiff_t)total;
    job->strides[0] = 1;
    job->step[0] = 1;
    job->nbytes = total;
    job->contiguous = 0;
    job->coop = 0;
    job->chunk_bytes = chunk;
    job->nchunks = n;
    if (n && n <= TRACE_CHUNKS) job->trace = calloc(n, sizeof(chunk_trace_t));
    int nl = n < (size_t)eng->nlanes ? (int)n : eng->nlanes;
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
    if (pthread_mutex_init(&job->mu, NULL)) {
        job->pieces = NULL;
        return pieces_failed(job, pieces, kind, why, PLAN_NO_MEMORY, "out of memory");
    }
    if (cond_init_monotonic(&job->cv)) {
        pthread_mutex_destroy(&job->mu);
        job->pieces = NULL;
        return pieces_failed(job, pieces, kind, why, PLAN_NO_MEMORY, "out of memory");
    }
    *kind = PLAN_OK;
    return job;
}
