/*
 * The staging core in plain C: no Python, no GPU. tests/test_native_core.py builds this with the core's
 * sources (the .c files of src/ferry/_native/core, and emulated.c) and runs it, plainly and under the sanitizers.
 * Each case drives an emulated engine the way engine.c does from Python: fill an engine_t, start it,
 * plan and queue jobs, wait for them, stop it.
 */
#include "core.h"

static int failures;

#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            failures++;                                                              \
        }                                                                            \
    } while (0)

static engine_t *make(int upload, int lanes, int helpers, int driver_thread) {
    engine_t *eng = calloc(1, sizeof *eng);
    if (!eng) return NULL;
    eng->emulated = 1;
    eng->upload = upload;
    eng->nlanes = lanes;
    eng->slots_per_lane = 2;
    eng->slot_bytes = (size_t)1 << 20;
    eng->min_chunk_bytes = (size_t)256 << 10;
    eng->bandwidth = 25e9;
    eng->latency = 5e-6;
    eng->min_chunks_per_lane = 1;
    eng->nontemporal = 1;
    eng->lane_wait_ns = 100000;
    eng->helpers = helpers;
    eng->lead_copies = 1;
    eng->piece_bytes = (size_t)128 << 10;
    eng->coop_max_bytes = SIZE_MAX;
    eng->help_spin_ns = 200000;
    eng->pid = getpid();
    err_t e;
    int rc = engine_start(eng, driver_thread, 0, &e);
    CHECK(rc == 0);
    return rc ? NULL : eng;
}

static void stop(engine_t *eng) {
    engine_stop_lanes(eng);
    engine_free(eng);
}

static void wait_done(job_t *job) {
    pthread_mutex_lock(&job->mu);
    while (!atomic_load(&job->done)) pthread_cond_wait(&job->cv, &job->mu);
    pthread_mutex_unlock(&job->mu);
}

/* Plan and queue a job over a C-order array of ndim axes; the caller's reference is the returned job's. */
static job_t *submit(engine_t *eng, char *host, char *dev, int ndim, const ptrdiff_t *shape, const ptrdiff_t *strides,
                     size_t itemsize, int hand_off) {
    long long nbytes = (long long)itemsize;
    for (int a = 0; a < ndim; a++) nbytes *= shape[a];
    int kind;
    const char *why;
    job_t *job = job_plan(eng, host, (CUdeviceptr)(uintptr_t)dev, nbytes, ndim, shape, strides, (long long)itemsize, 0,
                          hand_off, &kind, &why);
    CHECK(job != NULL);
    if (!job) return NULL;
    CHECK(engine_queue(eng, job, hand_off) == 0);
    return job;
}

static void test_contiguous_upload_and_download(int driver_thread) {
    size_t n = ((size_t)8 << 20) + 13;
    char *src = malloc(n), *dev = calloc(1, n), *back = calloc(1, n);
    for (size_t i = 0; i < n; i++) src[i] = (char)(i * 7 + 3);
    engine_t *up = make(1, 4, 0, driver_thread), *down = make(0, 3, 0, driver_thread);
    ptrdiff_t shape[1] = {(ptrdiff_t)n}, strides[1] = {1};
    job_t *job = submit(up, src, dev, 1, shape, strides, 1, 0);
    wait_done(job);
    CHECK(!atomic_load(&job->failed) && atomic_load(&job->host_bytes) == n && job->nlanes == 4);
    CHECK(memcmp(src, dev, n) == 0);
    job_decref(job);
    job = submit(down, back, dev, 1, shape, strides, 1, 0);
    wait_done(job);
    CHECK(!atomic_load(&job->failed) && memcmp(src, back, n) == 0);
    job_decref(job);
    stop(up);
    stop(down);
    free(src);
    free(dev);
    free(back);
}

/* A strided host array (every other column of a 4096 x 1024 float array) against a contiguous image. */
static void test_strided_round_trip(void) {
    ptrdiff_t rows = 4096, cols = 1024;
    float *host = malloc((size_t)(rows * cols) * sizeof(float)), *image = calloc((size_t)(rows * cols / 2), sizeof(float));
    float *out = calloc((size_t)(rows * cols), sizeof(float));
    for (ptrdiff_t i = 0; i < rows * cols; i++) host[i] = (float)i;
    ptrdiff_t shape[2] = {rows, cols / 2}, strides[2] = {cols * (ptrdiff_t)sizeof(float), 2 * (ptrdiff_t)sizeof(float)};
    engine_t *up = make(1, 3, 0, 1), *down = make(0, 3, 0, 1);
    job_t *job = submit(up, (char *)host, (char *)image, 2, shape, strides, sizeof(float), 0);
    wait_done(job);
    CHECK(!job->contiguous && job->nchunks > 3 && !atomic_load(&job->failed));
    int same = 1;
    for (ptrdiff_t r = 0; r < rows && same; r++)
        for (ptrdiff_t c = 0; c < cols / 2; c++)
            if (image[r * (cols / 2) + c] != host[r * cols + 2 * c]) same = 0;
    CHECK(same);
    job_decref(job);
    job = submit(down, (char *)out, (char *)image, 2, shape, strides, sizeof(float), 0);
    wait_done(job);
    same = !atomic_load(&job->failed);
    for (ptrdiff_t r = 0; r < rows && same; r++)
        for (ptrdiff_t c = 0; c < cols; c++)
            if (out[r * cols + c] != (c % 2 ? 0.0f : host[r * cols + c])) same = 0;
    CHECK(same); /* the columns between stay untouched */
    job_decref(job);
    stop(up);
    stop(down);
    free(host);
    free(image);
    free(out);
}

/* A cooperative upload (one lead, idle lanes help with its chunk copies) and a hand-off's posted events. */
static void test_cooperative_upload_with_a_hand_off(void) {
    size_t n = (size_t)6 << 20;
    char *src = malloc(n), *dev = calloc(1, n);
    for (size_t i = 0; i < n; i++) src[i] = (char)(i ^ (i >> 9));
    engine_t *up = make(1, 4, 3, 1);
    ptrdiff_t shape[1] = {(ptrdiff_t)n}, strides[1] = {1};
    for (int k = 0; k < 4; k++) {
        job_t *job = submit(up, src, dev, 1, shape, strides, 1, 1);
        CHECK(job->coop && job->nlanes == 1);
        wait_done(job);
        pthread_mutex_lock(&job->mu);
        while (atomic_load(&job->unposted)) pthread_cond_wait(&job->cv, &job->mu);
        int posted = job->nposted;
        pthread_mutex_unlock(&job->mu);
        CHECK(posted == 1);
        CHECK(memcmp(src, dev, n) == 0);
        memset(dev, 0, n);
        job_decref(job);
    }
    CHECK(atomic_load(&up->coop_jobs) == 4);
    stop(up);
    free(src);
    free(dev);
}

/* An injected failure fails its job with the emulated code and text; the lane recovers, the next job runs. */
static void test_a_failed_copy_fails_its_job_and_the_next_one_runs(void) {
    size_t n = (size_t)4 << 20;
    char *src = malloc(n), *dev = calloc(1, n);
    memset(src, 5, n);
    engine_t *up = make(1, 2, 0, 1);
    pthread_mutex_lock(&up->mu);
    up->fail_armed = 1;
    up->fail_after = 1;
    pthread_mutex_unlock(&up->mu);
    ptrdiff_t shape[1] = {(ptrdiff_t)n}, strides[1] = {1};
    job_t *job = submit(up, src, dev, 1, shape, strides, 1, 0);
    wait_done(job);
    CHECK(atomic_load(&job->failed) && job->err.code == 999 && !job->err.sticky);
    CHECK(strstr(job->err.text, "injected") != NULL);
    job_decref(job);
    job = submit(up, src, dev, 1, shape, strides, 1, 0);
    wait_done(job);
    CHECK(!atomic_load(&job->failed) && memcmp(src, dev, n) == 0);
    CHECK(atomic_load(&up->abandoned_bytes) > 0); /* the failing lane gave its slots up */
    job_decref(job);
    stop(up);
    free(src);
    free(dev);
}

/* Stopping an engine runs every queued job first (a hold is lifted); nothing is queued after. */
static void test_stop_runs_every_queued_job(void) {
    size_t n = (size_t)2 << 20;
    char *src = malloc(n), *dev[6];
    memset(src, 9, n);
    engine_t *up = make(1, 2, 0, 1);
    atomic_store(&up->held, 1);
    ptrdiff_t shape[1] = {(ptrdiff_t)n}, strides[1] = {1};
    job_t *jobs[6];
    for (int k = 0; k < 6; k++) {
        dev[k] = calloc(1, n);
        jobs[k] = submit(up, src, dev[k], 1, shape, strides, 1, 0);
    }
    engine_stop_lanes(up);
    for (int k = 0; k < 6; k++) {
        CHECK(atomic_load(&jobs[k]->done) && memcmp(src, dev[k], n) == 0);
        job_decref(jobs[k]);
        free(dev[k]);
    }
    int kind;
    const char *why;
    job_t *late = job_plan(up, src, (CUdeviceptr)(uintptr_t)src, (long long)n, 1, shape, strides, 1, 0, 0, &kind, &why);
    CHECK(late != NULL && engine_queue(up, late, 0) == ENGINE_CLOSED); /* refused: nothing queued */
    if (late) {
        atomic_store(&late->refs, 1);
        job_decref(late);
    }
    CHECK(atomic_load(&up->held_bytes) == 0); /* every lane freed its slots */
    engine_free(up);
    free(src);
}

/* job_plan refuses a description that does not add up, and says why. */
static void test_a_plan_that_does_not_add_up_is_refused(void) {
    engine_t *up = make(1, 1, 0, 0);
    ptrdiff_t shape[2] = {4, 4}, strides[2] = {16, 4};
    int kind;
    const char *why = NULL;
    char buf[64];
    CHECK(job_plan(up, buf, (CUdeviceptr)(uintptr_t)buf, 63, 2, shape, strides, 4, 0, 0, &kind, &why) == NULL);
    CHECK(kind == PLAN_VALUE && why && strstr(why, "prod(shape)"));
    ptrdiff_t huge[2] = {PTRDIFF_MAX, PTRDIFF_MAX};
    CHECK(job_plan(up, buf, (CUdeviceptr)(uintptr_t)buf, 64, 2, huge, strides, 4, 0, 0, &kind, &why) == NULL);
    CHECK(kind == PLAN_OVERFLOW);
    stop(up);
}

/* -- file jobs (core/file.c) -------------------------------------------------------------------------- */

/* A file of n bytes (byte i = i * 13 + 1) in the temporary directory, open for reading and writing. */
static int temp_file(size_t n, char *path) {
    const char *dir = getenv("TMPDIR");
    snprintf(path, 256, "%s/ferry-core-XXXXXX", dir && *dir ? dir : "/tmp");
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    char *buf = malloc(n);
    for (size_t i = 0; i < n; i++) buf[i] = (char)(i * 13 + 1);
    CHECK(pwrite(fd, buf, n, 0) == (ssize_t)n);
    free(buf);
    return fd;
}

/* Plan [lo, hi) of the file as chunks of `step` bytes at `step`-aligned offsets (from 4096-aligned
 * starts), each one DMA to dev + (file offset - lo); the job's reference is the caller's. */
static job_t *submit_file_range(engine_t *eng, int fd, int direct_fd, size_t lo, size_t hi, size_t step, char *dev,
                                long long fail_chunk, int fail_errno) {
    size_t cap = (hi - lo) / step + 2, n = 0;
    file_chunk_t *chunks = calloc(cap, sizeof *chunks);
    file_dma_t *dmas = calloc(cap, sizeof *dmas);
    for (size_t start = lo / 4096 * 4096; start < hi; n++) {
        size_t end = start + step < hi ? start + step : hi, a = start > lo ? start : lo;
        chunks[n] = (file_chunk_t){start, (end + 4095) / 4096 * 4096 - start, end - start, 1};
        dmas[n] = (file_dma_t){a - start, (unsigned long long)(uintptr_t)(dev + (a - lo)), end - a};
        start = end;
    }
    int kind;
    const char *why;
    job_t *job = file_job_plan(eng, fd, direct_fd, direct_fd >= 0, "core-test", chunks, n, dmas, n, &kind, &why);
    CHECK(job != NULL);
    free(chunks);
    free(dmas);
    if (!job) return NULL;
    job->file->inject_chunk = fail_chunk;
    job->file->inject_errno = fail_errno;
    CHECK(engine_queue(eng, job, 0) == 0);
    return job;
}

/* Reads at an odd offset into several lanes' slots (an injected EINVAL on the "direct" descriptor falls
 * back to buffered reads), a download writes the bytes back at another offset. */
static void test_a_file_round_trip(void) {
    char path[256];
    size_t n = ((size_t)5 << 20) + 777, lo = 4097, hi = n - 5;
    int fd = temp_file(n, path);
    char *dev = calloc(1, hi - lo), *want = malloc(n);
    CHECK(pread(fd, want, n, 0) == (ssize_t)n);
    engine_t *up = make(1, 3, 0, 1), *down = make(0, 2, 0, 0);
    job_t *job = submit_file_range(up, fd, fd, lo, hi, (size_t)1 << 20, dev, 2, EINVAL);
    wait_done(job);
    CHECK(!atomic_load(&job->failed) && memcmp(dev, want + lo, hi - lo) == 0);
    CHECK(atomic_load(&job->file->moved) == hi - lo && !atomic_load(&job->file->direct));
    job_decref(job);
    file_chunk_t chunks[8];
    file_dma_t dmas[8];
    size_t out = 3, part = (hi - lo + 7) / 8;
    for (int k = 0; k < 8; k++) {
        size_t at = (size_t)k * part, len = at + part < hi - lo ? part : hi - lo - at;
        chunks[k] = (file_chunk_t){out + at, len, len, 1};
        dmas[k] = (file_dma_t){0, (unsigned long long)(uintptr_t)(dev + at), len};
    }
    int kind;
    const char *why;
    job = file_job_plan(down, fd, -1, 0, "core-test", chunks, 8, dmas, 8, &kind, &why);
    CHECK(job && engine_queue(down, job, 0) == 0);
    if (job) {
        wait_done(job);
        CHECK(!atomic_load(&job->failed));
        job_decref(job);
    }
    char *back = malloc(hi - lo);
    CHECK(pread(fd, back, hi - lo, (off_t)out) == (ssize_t)(hi - lo) && memcmp(back, want + lo, hi - lo) == 0);
    stop(up);
    stop(down);
    close(fd);
    unlink(path);
    free(dev);
    free(want);
    free(back);
}

/* A file cut short, and a read that fails: the job fails naming the offset and the errno; the failing
 * lane's slots are abandoned; the next job runs. */
static void test_a_failed_read_fails_its_file_job(void) {
    char path[256];
    size_t n = (size_t)4 << 20;
    int fd = temp_file(n, path);
    char *dev = calloc(1, n);
    engine_t *up = make(1, 2, 0, 1);
    CHECK(ftruncate(fd, (off_t)(n / 2)) == 0);
    job_t *job = submit_file_range(up, fd, -1, 0, n, (size_t)512 << 10, dev, -1, 0);
    wait_done(job);
    CHECK(atomic_load(&job->failed) && job->err.code == FILE_ERROR_CODE && job->file->err_kind == FILE_ERR_SHORT);
    /* a lane that read past the end first may be the one that reports it: a chunk's start from the cut on */
    CHECK(job->file->err_offset >= n / 2 && job->file->err_offset % (512 << 10) == 0);
    CHECK(strstr(job->err.text, "truncated") != NULL && strstr(job->err.text, "core-test") != NULL);
    job_decref(job);
    CHECK(atomic_load(&up->abandoned_bytes) >= (long long)up->slot_bytes * up->slots_per_lane);
    job = submit_file_range(up, fd, -1, 0, n / 2, (size_t)256 << 10, dev, 1, EIO);
    wait_done(job);
    CHECK(atomic_load(&job->failed) && job->file->err_kind == FILE_ERR_READ && job->file->err_errno == EIO);
    CHECK(job->file->err_offset == (size_t)256 << 10 && strstr(job->err.text, "errno 5") != NULL);
    job_decref(job);
    job = submit_file_range(up, fd, -1, 0, n / 2, (size_t)256 << 10, dev, -1, 0);
    wait_done(job);
    CHECK(!atomic_load(&job->failed) && atomic_load(&job->file->moved) == n / 2);
    job_decref(job);
    int kind;
    const char *why;
    file_chunk_t bad = {0, up->slot_bytes + 4096, 10, 1};
    file_dma_t dma = {0, (unsigned long long)(uintptr_t)dev, 10};
    CHECK(file_job_plan(up, fd, -1, 0, "x", &bad, 1, &dma, 1, &kind, &why) == NULL && kind == PLAN_VALUE);
    stop(up);
    close(fd);
    unlink(path);
    free(dev);
}

/* A job of many pieces: 300 host arrays of odd sizes to back-to-back device ranges (a gap before every 50th),
 * up and back down, with a hand-off; pieces that follow each other share chunks, no byte of a gap is written. */
static void test_a_job_of_many_pieces(void) {
    size_t count = 300, total = 0, span = 0;
    piece_t *up_pieces = malloc(count * sizeof(piece_t)), *down_pieces = malloc(count * sizeof(piece_t));
    char **hosts = malloc(count * sizeof(char *)), **backs = malloc(count * sizeof(char *));
    size_t *sizes = malloc(count * sizeof(size_t)), *offsets = malloc(count * sizeof(size_t));
    for (size_t i = 0; i < count; i++) {
        sizes[i] = i % 7 == 3 ? 0 : 1000 + (i * 7919) % 70000;
        span += i % 50 == 49 ? 64 : 0;
        offsets[i] = span;
        span += sizes[i];
        total += sizes[i];
    }
    char *dev = calloc(1, span + 1);
    for (size_t i = 0; i < count; i++) {
        hosts[i] = malloc(sizes[i] + 1);
        backs[i] = calloc(1, sizes[i] + 1);
        for (size_t j = 0; j < sizes[i]; j++) hosts[i][j] = (char)(i * 31 + j * 7 + 1);
        up_pieces[i] = (piece_t){hosts[i], (CUdeviceptr)(uintptr_t)(dev + offsets[i]), sizes[i]};
        down_pieces[i] = (piece_t){backs[i], (CUdeviceptr)(uintptr_t)(dev + offsets[i]), sizes[i]};
    }
    engine_t *up = make(1, 4, 0, 1), *down = make(0, 3, 0, 0);
    int kind;
    const char *why;
    job_t *job = job_plan_pieces(up, up_pieces, count, 0, 1, &kind, &why); /* takes the pieces */
    CHECK(job != NULL && job->nbytes == total && job->nchunks < count);
    CHECK(engine_queue(up, job, 1) == 0);
    wait_done(job);
    CHECK(!atomic_load(&job->failed) && atomic_load(&job->host_bytes) == total && job->nposted == job->nlanes);
    job_decref(job);
    for (size_t i = 0; i < count; i++) CHECK(memcmp(hosts[i], dev + offsets[i], sizes[i]) == 0);
    for (size_t i = 49; i < count; i += 50) /* the 64 bytes before piece i: a gap, never written */
        for (size_t j = offsets[i] - 64; j < offsets[i]; j++) CHECK(dev[j] == 0);
    job = job_plan_pieces(down, down_pieces, count, 4096, 0, &kind, &why); /* small chunks: pieces cut */
    CHECK(job != NULL && job->nchunks > count);
    CHECK(engine_queue(down, job, 0) == 0);
    wait_done(job);
    CHECK(!atomic_load(&job->failed));
    job_decref(job);
    for (size_t i = 0; i < count; i++) CHECK(memcmp(hosts[i], backs[i], sizes[i]) == 0);
    piece_t *bad = malloc(sizeof(piece_t));
    *bad = (piece_t){NULL, (CUdeviceptr)(uintptr_t)dev, 8};
    CHECK(job_plan_pieces(up, bad, 1, 0, 0, &kind, &why) == NULL && kind == PLAN_VALUE); /* takes it too */
    stop(up);
    stop(down);
    for (size_t i = 0; i < count; i++) {
        free(hosts[i]);
        free(backs[i]);
    }
    free(hosts);
    free(backs);
    free(sizes);
    free(offsets);
    free(dev);
}

/* One lane: chunk 0's DMA fails on the device, then chunk 1's read fails. The read's error is met first, but
 * the device's replaces it: the job says the device failed (what its DMA touched is abandoned). */
static void test_a_device_error_outranks_a_file_error_met_first(void) {
    char path[256];
    size_t n = (size_t)3 << 20;
    int fd = temp_file(n, path);
    char *dev = calloc(1, n);
    engine_t *up = make(1, 1, 0, 1);
    pthread_mutex_lock(&up->mu);
    up->fail_armed = 1;
    up->fail_after = 0;
    pthread_mutex_unlock(&up->mu);
    job_t *job = submit_file_range(up, fd, -1, 0, n, (size_t)1 << 20, dev, 1, EIO);
    wait_done(job);
    CHECK(atomic_load(&job->failed) && job->err.code == 999 && strstr(job->err.text, "injected") != NULL);
    job_decref(job);
    job = submit_file_range(up, fd, -1, 0, n, (size_t)1 << 20, dev, -1, 0); /* the lane recovered */
    wait_done(job);
    CHECK(!atomic_load(&job->failed) && atomic_load(&job->file->moved) == n);
    job_decref(job);
    stop(up);
    close(fd);
    unlink(path);
    free(dev);
}

typedef struct {
    job_t *job;
    int took; /* file_fail's answer */
} cancel_arg_t;

static void *cancel_soon(void *arg) {
    cancel_arg_t *c = arg;
    for (int i = 0; i < (int)(c->job->t_submit % 64); i++) cpu_relax(); /* land anywhere in the job */
    c->took = file_fail(c->job, FILE_ERR_CANCELLED, 0, 0, 0);
    return NULL;
}

/* A cancel from another thread races the lanes and the job's completion: it either fails the job as
 * cancelled (and the job still ends only after its DMAs), or it came after the end and the job succeeded;
 * a cancel abandons no slot. */
static void test_a_cancel_races_the_lanes_and_the_end(void) {
    char path[256];
    size_t n = (size_t)2 << 20;
    int fd = temp_file(n, path);
    char *dev = calloc(1, n), *want = malloc(n);
    CHECK(pread(fd, want, n, 0) == (ssize_t)n);
    engine_t *up = make(1, 3, 0, 1);
    int cancelled = 0, finished = 0;
    for (int round = 0; round < 60; round++) {
        memset(dev, 0, n);
        job_t *job = submit_file_range(up, fd, -1, 0, n, (size_t)64 << 10, dev, -1, 0);
        cancel_arg_t c = {job, 0};
        pthread_t t;
        CHECK(pthread_create(&t, NULL, cancel_soon, &c) == 0);
        wait_done(job);
        pthread_join(t, NULL);
        if (c.took) {
            cancelled++;
            CHECK(atomic_load(&job->failed) && job->file->err_kind == FILE_ERR_CANCELLED);
        } else {
            finished++;
            CHECK(!atomic_load(&job->failed) && memcmp(dev, want, n) == 0);
        }
        CHECK(atomic_load(&job->file->moved) <= n);
        CHECK(file_fail(job, FILE_ERR_CANCELLED, 0, 0, 0) == 0); /* after the end: changes nothing */
        job_decref(job);
    }
    CHECK(cancelled + finished == 60);
    CHECK(atomic_load(&up->abandoned_bytes) == 0);
    stop(up);
    close(fd);
    unlink(path);
    free(dev);
    free(want);
}

/* A download whose write fails, and one whose DMA fails: each fails its job (the file's error, the device's);
 * the failing lane's slots are abandoned; the next download writes every byte. */
static void test_a_failed_write_or_dma_fails_a_download(void) {
    char path[256];
    size_t n = (size_t)3 << 20;
    int fd = temp_file(n, path);
    char *dev = malloc(n);
    for (size_t i = 0; i < n; i++) dev[i] = (char)(i * 5 + 2);
    engine_t *down = make(0, 2, 0, 1);
    file_chunk_t chunks[12];
    file_dma_t dmas[12];
    size_t part = n / 12;
    for (int k = 0; k < 12; k++) {
        chunks[k] = (file_chunk_t){(size_t)k * part, part, part, 1};
        dmas[k] = (file_dma_t){0, (unsigned long long)(uintptr_t)(dev + (size_t)k * part), part};
    }
    int kind;
    const char *why;
    job_t *job = file_job_plan(down, fd, -1, 0, "core-test", chunks, 12, dmas, 12, &kind, &why);
    CHECK(job != NULL);
    job->file->inject_chunk = 4;
    job->file->inject_errno = ENOSPC;
    CHECK(engine_queue(down, job, 0) == 0);
    wait_done(job);
    CHECK(atomic_load(&job->failed) && job->file->err_kind == FILE_ERR_WRITE && job->file->err_errno == ENOSPC);
    CHECK(job->file->err_offset == 4 * part && job->file->err_chunk == 4);
    job_decref(job);
    long long lost = atomic_load(&down->abandoned_bytes);
    CHECK(lost == (long long)down->slot_bytes * down->slots_per_lane);
    pthread_mutex_lock(&down->mu);
    down->fail_armed = 1;
    down->fail_after = 3;
    pthread_mutex_unlock(&down->mu);
    job = file_job_plan(down, fd, -1, 0, "core-test", chunks, 12, dmas, 12, &kind, &why);
    CHECK(job && engine_queue(down, job, 0) == 0);
    wait_done(job);
    CHECK(atomic_load(&job->failed) && job->err.code == 999);
    job_decref(job);
    CHECK(atomic_load(&down->abandoned_bytes) > lost);
    CHECK(ftruncate(fd, 0) == 0);
    job = file_job_plan(down, fd, -1, 0, "core-test", chunks, 12, dmas, 12, &kind, &why);
    CHECK(job && engine_queue(down, job, 0) == 0);
    wait_done(job);
    CHECK(!atomic_load(&job->failed) && atomic_load(&job->file->moved) == 12 * part);
    job_decref(job);
    char *back = malloc(n);
    CHECK(pread(fd, back, n, 0) == (ssize_t)(12 * part) && memcmp(back, dev, 12 * part) == 0);
    CHECK(atomic_load(&down->held_bytes) == (long long)down->slot_bytes * down->slots_per_lane * down->nlanes);
    stop(down);
    close(fd);
    unlink(path);
    free(dev);
    free(back);
}

typedef struct {
    engine_t *eng;
    int fd;
    size_t n;
    const char *want;
    int ok;
} loader_arg_t;

static void *load_many(void *arg) {
    loader_arg_t *a = arg;
    char *dev = malloc(a->n);
    a->ok = 1;
    for (int i = 0; i < 8; i++) {
        memset(dev, 0, a->n);
        size_t lo = (size_t)i * 4099 % 8192;
        job_t *job = submit_file_range(a->eng, a->fd, -1, lo, a->n, (size_t)(96 + 32 * i) << 10, dev, -1, 0);
        wait_done(job);
        if (atomic_load(&job->failed) || memcmp(dev, a->want + lo, a->n - lo) != 0) a->ok = 0;
        job_decref(job);
    }
    free(dev);
    return NULL;
}

/* File jobs submitted from several threads at once share the lanes (with staged jobs among them): every
 * load reads its bytes, whichever lanes claim its chunks. */
static void test_file_jobs_from_several_threads_share_the_lanes(void) {
    char path[256];
    size_t n = ((size_t)1 << 20) + 333;
    int fd = temp_file(n, path);
    char *want = malloc(n);
    CHECK(pread(fd, want, n, 0) == (ssize_t)n);
    engine_t *up = make(1, 3, 0, 1);
    loader_arg_t args[3];
    pthread_t threads[3];
    for (int t = 0; t < 3; t++) {
        args[t] = (loader_arg_t){up, fd, n, want, 0};
        CHECK(pthread_create(&threads[t], NULL, load_many, &args[t]) == 0);
    }
    char *dev = calloc(1, n);
    ptrdiff_t shape[1] = {(ptrdiff_t)n}, strides[1] = {1};
    for (int k = 0; k < 4; k++) { /* staged jobs among them */
        job_t *job = submit(up, want, dev, 1, shape, strides, 1, 0);
        wait_done(job);
        CHECK(!atomic_load(&job->failed) && memcmp(dev, want, n) == 0);
        job_decref(job);
    }
    for (int t = 0; t < 3; t++) {
        pthread_join(threads[t], NULL);
        CHECK(args[t].ok);
    }
    stop(up);
    close(fd);
    unlink(path);
    free(want);
    free(dev);
}

/* A read or write interrupted by a signal (EINTR, through the same handling as a real one) is retried:
 * the job succeeds with every byte in place. */
static void test_an_interrupted_read_or_write_is_retried(void) {
    char path[256];
    size_t n = ((size_t)2 << 20) + 99;
    int fd = temp_file(n, path);
    char *dev = calloc(1, n), *want = malloc(n);
    CHECK(pread(fd, want, n, 0) == (ssize_t)n);
    engine_t *up = make(1, 2, 0, 1), *down = make(0, 2, 0, 1);
    job_t *job = submit_file_range(up, fd, -1, 0, n, (size_t)256 << 10, dev, 3, EINTR);
    wait_done(job);
    CHECK(!atomic_load(&job->failed) && atomic_load(&job->file->moved) == n && memcmp(dev, want, n) == 0);
    job_decref(job);
    file_chunk_t chunks[4];
    file_dma_t dmas[4];
    size_t part = n / 4 + 1;
    for (int k = 0; k < 4; k++) {
        size_t at = (size_t)k * part, len = at + part < n ? part : n - at;
        chunks[k] = (file_chunk_t){7 + at, len, len, 1};
        dmas[k] = (file_dma_t){0, (unsigned long long)(uintptr_t)(dev + at), len};
    }
    int kind;
    const char *why;
    job = file_job_plan(down, fd, -1, 0, "core-test", chunks, 4, dmas, 4, &kind, &why);
    CHECK(job != NULL);
    if (job) {
        job->file->inject_chunk = 2;
        job->file->inject_errno = EINTR;
        CHECK(engine_queue(down, job, 0) == 0);
        wait_done(job);
        CHECK(!atomic_load(&job->failed) && atomic_load(&job->file->moved) == n);
        job_decref(job);
    }
    char *back = malloc(n);
    CHECK(pread(fd, back, n, 7) == (ssize_t)n && memcmp(back, want, n) == 0);
    stop(up);
    stop(down);
    close(fd);
    unlink(path);
    free(dev);
    free(want);
    free(back);
}

/* An empty file job is done at once; zero-length chunks and DMAs, and a download whose DMAs leave part of
 * its chunk unfilled (stale slot bytes would reach the file), are refused with nothing queued. */
static void test_empty_and_malformed_file_plans(void) {
    char path[256];
    int fd = temp_file(8192, path);
    char buf[8192];
    engine_t *up = make(1, 2, 0, 0), *down = make(0, 2, 0, 0);
    int kind;
    const char *why;
    job_t *job = file_job_plan(up, fd, -1, 0, "e", NULL, 0, NULL, 0, &kind, &why);
    CHECK(job && atomic_load(&job->done) && engine_queue(up, job, 0) == 0);
    if (job) job_decref(job);
    unsigned long long p = (unsigned long long)(uintptr_t)buf;
    file_chunk_t zero = {0, 0, 0, 1}, one = {0, 4096, 100, 1}, whole = {0, 8192, 8192, 2};
    file_dma_t empty = {0, p, 0}, some = {0, p, 100};
    file_dma_t halves[2] = {{0, p, 4096}, {4096, p + 4096, 4096}}, gap[2] = {{0, p, 4096}, {4100, p, 4092}};
    CHECK(file_job_plan(up, fd, -1, 0, "e", &zero, 1, &some, 1, &kind, &why) == NULL && kind == PLAN_VALUE);
    CHECK(file_job_plan(up, fd, -1, 0, "e", &one, 1, &empty, 1, &kind, &why) == NULL && kind == PLAN_VALUE);
    CHECK(file_job_plan(up, -1, -1, 0, "e", &one, 1, &some, 1, &kind, &why) == NULL && kind == PLAN_VALUE);
    CHECK(file_job_plan(down, fd, -1, 0, "e", &one, 1, &some, 1, &kind, &why) == NULL && kind == PLAN_VALUE);
    CHECK(why && strstr(why, "fill"));
    CHECK(file_job_plan(down, fd, -1, 0, "e", &whole, 1, gap, 2, &kind, &why) == NULL && kind == PLAN_VALUE);
    job = file_job_plan(down, fd, -1, 0, "e", &whole, 1, halves, 2, &kind, &why);
    CHECK(job != NULL);
    if (job) {
        atomic_store(&job->refs, 1);
        job_decref(job);
    }
    stop(up);
    stop(down);
    close(fd);
    unlink(path);
}

int main(void) {
    test_contiguous_upload_and_download(1);
    test_contiguous_upload_and_download(0);
    test_strided_round_trip();
    test_cooperative_upload_with_a_hand_off();
    test_a_failed_copy_fails_its_job_and_the_next_one_runs();
    test_stop_runs_every_queued_job();
    test_a_plan_that_does_not_add_up_is_refused();
    test_a_file_round_trip();
    test_a_failed_read_fails_its_file_job();
    test_a_job_of_many_pieces();
    test_a_device_error_outranks_a_file_error_met_first();
    test_a_cancel_races_the_lanes_and_the_end();
    test_a_failed_write_or_dma_fails_a_download();
    test_file_jobs_from_several_threads_share_the_lanes();
    test_empty_and_malformed_file_plans();
    test_an_interrupted_read_or_write_is_retried();
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("ok\n");
    return 0;
}
