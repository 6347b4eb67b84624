/*
 * emulated.c: the emulated device's native stand-in (no Python.h).
 *
 * In emulated mode (no GPU) each lane owns a stream worker: a pthread that runs the lane's "DMAs"
 * (memcpy, then a sleep that models nbytes / bandwidth + latency) and event records in order, so a
 * stream is asynchronous exactly as a CUDA stream is, and the CPU-only tests run the same engine
 * as a GPU. Invariants: a stream's queue, its pending error and every event's recorded/done
 * generations are touched under the stream's mutex only; an event is complete when its newest record
 * ran (done == recorded), and carries the failure of that record; a failed copy is torn (half of it
 * copied) and surfaces at the next record on its stream, as an asynchronous CUDA error does; a
 * sticky failure (code 719) poisons the emulated device, after which every call fails with it. A hold
 * (Engine.hold) stops the workers before their next op; stopping a stream runs every queued op first.
 * The worker blocks every signal (start_thread).
 */
#include "core/core.h"

static int emu_push(emu_stream_t *es, emu_op_t *op) {
    op->next = NULL;
    pthread_mutex_lock(&es->mu);
    if (es->tail)
        es->tail->next = op;
    else
        es->head = op;
    es->tail = op;
    pthread_cond_signal(&es->cv);
    pthread_mutex_unlock(&es->mu);
    return 0;
}

static void sleep_until(int64_t deadline) {
    struct timespec ts = ts_of(deadline);
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

static void *emu_stream_main(void *arg) {
    emu_stream_t *es = arg;
    engine_t *eng = es->eng;
    for (;;) {
        pthread_mutex_lock(&es->mu);
        while (!es->head || (atomic_load(&eng->held) && es->head->kind != OP_STOP))
            pthread_cond_wait(&es->cv, &es->mu);
        emu_op_t *op = es->head;
        es->head = op->next;
        if (!es->head) es->tail = NULL;
        pthread_mutex_unlock(&es->mu);
        switch (op->kind) {
        case OP_STOP:
            free(op);
            return NULL;
        case OP_COPY: {
            int64_t start = now_ns();
            if (!op->fail) {
                memcpy(op->dst, op->src, op->n);
            } else {
                memcpy(op->dst, op->src, op->n / 2); /* a torn copy */
                if (op->fail == ERR_LAUNCH_FAILED) atomic_store(&eng->poison, ERR_LAUNCH_FAILED);
                pthread_mutex_lock(&es->mu);
                if (!es->pending_error) es->pending_error = op->fail;
                pthread_mutex_unlock(&es->mu);
            }
            double ns = (eng->latency + (double)op->n / eng->bandwidth) * 1e9; /* finite: Engine checks both */
            int64_t deadline = start + (ns < 1e17 ? (int64_t)ns : (int64_t)1e17);
            if (deadline - now_ns() > 20000) sleep_until(deadline);
            break;
        }
        case OP_RECORD:
            pthread_mutex_lock(&es->mu);
            op->ev->done = op->gen;
            op->ev->error = es->pending_error;
            es->pending_error = 0;
            pthread_cond_broadcast(&es->done_cv);
            pthread_mutex_unlock(&es->mu);
            break;
        default:
            break;
        }
        free(op);
    }
}

int emu_enqueue_copy(lane_t *L, char *dst, const char *src, size_t n) {
    engine_t *eng = L->eng;
    int poison = atomic_load(&eng->poison);
    if (poison) return poison;
    emu_op_t *op = calloc(1, sizeof *op);
    if (!op) return ERR_OUT_OF_MEMORY;
    op->kind = OP_COPY;
    op->dst = dst;
    op->src = src;
    op->n = n;
    pthread_mutex_lock(&eng->mu);
    if (eng->fail_armed) {
        if (eng->fail_after > 0) {
            eng->fail_after--;
        } else {
            op->fail = eng->fail_sticky ? ERR_LAUNCH_FAILED : ERR_UNKNOWN;
            eng->fail_armed = 0;
        }
    }
    pthread_mutex_unlock(&eng->mu);
    return emu_push(L->es, op);
}

int emu_record(lane_t *L, emu_event_t *ev) {
    int poison = atomic_load(&L->eng->poison);
    if (poison) return poison;
    emu_op_t *op = calloc(1, sizeof *op);
    if (!op) return ERR_OUT_OF_MEMORY;
    op->kind = OP_RECORD;
    op->ev = ev;
    pthread_mutex_lock(&L->es->mu);
    op->gen = ++ev->recorded;
    pthread_mutex_unlock(&L->es->mu);
    return emu_push(L->es, op);
}

int emu_sync(lane_t *L, emu_event_t *ev) {
    emu_stream_t *es = L->es;
    pthread_mutex_lock(&es->mu);
    uint64_t want = ev->recorded;
    while (ev->done < want) pthread_cond_wait(&es->done_cv, &es->mu);
    int err = ev->done == want ? ev->error : 0;
    pthread_mutex_unlock(&es->mu);
    if (err) return err;
    return atomic_load(&L->eng->poison);
}

emu_stream_t *emu_stream_start(engine_t *eng, int *code) {
    emu_stream_t *es = calloc(1, sizeof *es);
    if (!es) {
        *code = ERR_OUT_OF_MEMORY;
        return NULL;
    }
    es->eng = eng;
    es->stop_op = calloc(1, sizeof *es->stop_op);
    if (!es->stop_op) goto fail_mu;
    es->stop_op->kind = OP_STOP;
    if (pthread_mutex_init(&es->mu, NULL)) goto fail_mu;
    if (pthread_cond_init(&es->cv, NULL)) goto fail_cv;
    if (pthread_cond_init(&es->done_cv, NULL)) goto fail_done;
    if (start_thread(&es->thread, emu_stream_main, es)) goto fail_thread;
    es->started = 1;
    return es;
fail_thread:
    pthread_cond_destroy(&es->done_cv);
fail_done:
    pthread_cond_destroy(&es->cv);
fail_cv:
    pthread_mutex_destroy(&es->mu);
fail_mu:
    free(es->stop_op);
    free(es);
    *code = ERR_OUT_OF_MEMORY;
    return NULL;
}

/* Runs every queued op first (close lifts a hold before it stops the lanes). */
void emu_stream_stop(emu_stream_t *es) {
    emu_push(es, es->stop_op); /* the worker frees it */
    pthread_join(es->thread, NULL);
    pthread_cond_destroy(&es->done_cv);
    pthread_cond_destroy(&es->cv);
    pthread_mutex_destroy(&es->mu);
    free(es);
}

