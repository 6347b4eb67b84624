/*
 * core/copy.c: the host copies (a lane's chunk copies, the copier's pieces).
 *
 * Every payload byte is copied by the host exactly once: gathered into a slot for an upload,
 * scattered out of one for a download (chunk_copy, which normalizes a strided chunk into runs of
 * contiguous bytes). A shared copy (copy_task_t) is cut into pieces that several threads claim from
 * one atomic counter; the task lives on the poster's stack, so task_retire waits until every piece is
 * copied *and* no helper can still read the task (helpers count themselves in `active` before they
 * load the task pointer, sequentially consistent). Nothing here blocks or allocates.
 */
#include "core.h"

/*
 * A lane's host copy. From NT_MIN_BYTES up, with `nt`, the stores are non-temporal (x86-64: SSE2
 * streaming stores, then a fence): the bytes go to memory without first reading their cache lines and
 * without evicting the lane's working set. A staged chunk is written once and read next by a DMA (or,
 * downloading, by the user much later), so caching it buys nothing; what the cache held instead is the
 * driver's own state, which the chunk's enqueue right after the copy needs (measured on the H200 VM: an
 * enqueue costs 1.7 - 3.5 us from a thread with warm caches, 12 - 24 us right after a 1 MiB memcpy).
 * Elsewhere, and below the threshold, memcpy.
 */

void copy_bytes(char *dst, const char *src, size_t n, int nt) {
#if HAVE_NT_COPY
    if (nt && n >= NT_MIN_BYTES) {
        size_t head = (64 - ((uintptr_t)dst & 63)) & 63; /* aligned, whole cache lines (16 bytes needed) */
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        for (size_t blocks = n / 64; blocks; blocks--) {
            __m128i a = _mm_loadu_si128((const __m128i *)(const void *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(const void *)(src + 48));
            _mm_stream_si128((__m128i *)(void *)dst, a);
            _mm_stream_si128((__m128i *)(void *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(void *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(void *)(dst + 48), d);
            src += 64;
            dst += 64;
        }
        _mm_sfence(); /* the streamed bytes are globally visible before the DMA is enqueued */
        memcpy(dst, src, n % 64);
        return;
    }
#endif
    (void)nt;
    memcpy(dst, src, n);
}

void copier_piece(const copy_task_t *t, size_t k) {
    size_t off = k * t->piece;
    size_t len = t->n - off < t->piece ? t->n - off : t->piece;
    copy_bytes(t->dst + off, t->src + off, len, t->nt);
}

/* Claim and copy pieces until none is left; how many this thread copied. */
size_t copier_drain(copy_task_t *t) {
    size_t k, got = 0;
    while ((k = atomic_fetch_add(&t->next, 1)) < t->pieces) {
        copier_piece(t, k);
        atomic_fetch_add_explicit(&t->done, 1, memory_order_release);
        got++;
    }
    return got;
}

void task_init(copy_task_t *t, char *dst, const char *src, size_t n, size_t piece, int nt,
                      unsigned long long seq) {
    t->dst = dst;
    t->src = src;
    t->n = n;
    t->piece = piece;
    t->pieces = (n + piece - 1) / piece;
    t->nt = nt;
    t->seq = seq;
    atomic_init(&t->next, 0);
    atomic_init(&t->done, 0);
}

/* The poster's end of a shared copy: wait until every piece is copied, withdraw the task from
 * `posted`, then wait until no helper may still read it. A helper counts itself in `active` before it
 * loads the task pointer, so once `active` reads 0 after the withdrawal none can reach `t` (it lives on
 * the poster's stack). Both waits yield after a while: a helper may be preempted in its piece. */
void task_retire(copy_task_t *t, _Atomic(copy_task_t *) *posted, atomic_int *active) {
    for (unsigned i = 0; atomic_load_explicit(&t->done, memory_order_acquire) < t->pieces; i++) backoff(i);
    atomic_store(posted, NULL);
    for (unsigned i = 0; atomic_load(active); i++) backoff(i);
}

/* Copy one run of `e` bytes `m` times, host side stepping by `s`, image side contiguous. */
static inline void copy_row(char *img, char *host, size_t e, ptrdiff_t m, ptrdiff_t s, int gather) {
#define ROW(T)                                                                                  \
    do {                                                                                        \
        for (ptrdiff_t j = 0; j < m; j++) {                                                    \
            T v;                                                                                \
            if (gather) {                                                                       \
                memcpy(&v, host + j * s, sizeof(T));                                            \
                memcpy(img + (size_t)j * sizeof(T), &v, sizeof(T));                             \
            } else {                                                                            \
                memcpy(&v, img + (size_t)j * sizeof(T), sizeof(T));                             \
                memcpy(host + j * s, &v, sizeof(T));                                            \
            }                                                                                   \
        }                                                                                       \
    } while (0)
    switch (e) {
    case 1: ROW(uint8_t); return;
    case 2: ROW(uint16_t); return;
    case 4: ROW(uint32_t); return;
    case 8: ROW(uint64_t); return;
    default: break;
    }
#undef ROW
    for (ptrdiff_t j = 0; j < m; j++) {
        if (gather)
            memcpy(img + (size_t)j * e, host + j * s, e);
        else
            memcpy(host + j * s, img + (size_t)j * e, e);
    }
}

/* Move a chunk between the array and `img` (its C-order bytes): gather=1 array -> img. */
void chunk_copy(const job_t *job, const chunk_t *c, char *img, int gather) {
    int nt = job->nontemporal;
    if (c->lc) { /* a run of pieces: each piece's part in turn, back to back in the image */
        size_t left = c->nbytes, i = c->lc->first, skip = c->lc->skip;
        while (left) {
            const piece_t *p = &job->pieces[i++];
            size_t m = p->nbytes - skip < left ? p->nbytes - skip : left;
            if (gather)
                copy_bytes(img, p->host + skip, m, nt && m >= NT_MIN_BYTES);
            else
                copy_bytes(p->host + skip, img, m, nt && m >= NT_MIN_BYTES);
            img += m;
            left -= m;
            skip = 0;
        }
        return;
    }
    if (c->nd == 0) {
        if (gather)
            copy_bytes(img, c->host, c->nbytes, nt);
        else
            copy_bytes(c->host, img, c->nbytes, nt);
        return;
    }
    /* normalize: the innermost host-contiguous run of e bytes, then one row dim (m, s), then outer dims */
    size_t e = job->itemsize;
    int i = c->nd - 1;
    while (i >= 0 && (c->len[i] == 1 || c->str[i] == (ptrdiff_t)e)) {
        e *= (size_t)c->len[i];
        i--;
    }
    ptrdiff_t m = 1, s = 0;
    if (i >= 0) {
        m = c->len[i];
        s = c->str[i];
        i--;
    }
    int outer = 0;
    ptrdiff_t olen[MAX_DIMS], ostr[MAX_DIMS], idx[MAX_DIMS];
    for (int a = 0; a <= i; a++) {
        if (c->len[a] == 1) continue;
        olen[outer] = c->len[a];
        ostr[outer] = c->str[a];
        idx[outer] = 0;
        outer++;
    }
    size_t row_bytes = e * (size_t)m;
    char *host = c->host;
    for (;;) {
        if (m == 1 || s == (ptrdiff_t)e) { /* the row is contiguous too */
            if (gather)
                copy_bytes(img, host, row_bytes, nt);
            else
                copy_bytes(host, img, row_bytes, nt);
        } else {
            copy_row(img, host, e, m, s, gather);
        }
        img += row_bytes;
        int a = outer - 1; /* odometer over the outer dims */
        for (; a >= 0; a--) {
            host += ostr[a];
            if (++idx[a] < olen[a]) break;
            host -= ostr[a] * olen[a];
            idx[a] = 0;
        }
        if (a < 0) break;
    }
}

