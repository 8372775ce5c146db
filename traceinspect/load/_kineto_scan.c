/* A columnar scanner for Kineto (Chrome trace) JSON.
 *
 * The document is fed in pieces (Scanner.feed); each call scans as many whole top-level units (a
 * metadata key with its value, one event of ``traceEvents``) as the piece holds and returns the
 * number of bytes consumed; the caller keeps the rest and appends the next piece. Scanning runs with
 * the GIL released. Every needed field of an event goes straight into a column of its kind; strings
 * are decoded once per distinct text (an index into a table of distinct strings), shape arguments
 * are kept as raw JSON bytes, also once per distinct text. Values of top-level keys other than
 * ``traceEvents`` are handed back as raw JSON text for the caller to decode.
 *
 * The reader is strict JSON (RFC 8259) and checks every bound: each read is guarded by the end of
 * the buffer, nesting is limited, all sizes are checked before they grow. Type rules follow the
 * typed decoder of the Python path (traceinspect/load/parse.py), which the tests compare it with.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <errno.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define MAX_DEPTH 512 /* nesting limit of skipped values (the typed decoder stops near 1000) */

/* ------------------------------------------------------------------------------------------- */
/* growable byte buffers */

typedef struct {
    char *p;
    size_t n, cap;
} Buf;

static int buf_grow(Buf *b, size_t extra) {
    if (extra > SIZE_MAX / 2 - b->n) return -1;
    size_t need = b->n + extra;
    if (need <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < need) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) return -1;
    b->p = p;
    b->cap = cap;
    return 0;
}

/* room for extra more bytes (the test inlined: a column takes a value per event) */
static inline int buf_reserve(Buf *b, size_t extra) { return extra <= b->cap - b->n ? 0 : buf_grow(b, extra); }

static int buf_put(Buf *b, const void *src, size_t n) {
    if (!n) return 0; /* (memcpy of nothing into an unallocated buffer is still undefined) */
    if (buf_reserve(b, n) < 0) return -1;
    memcpy(b->p + b->n, src, n);
    b->n += n;
    return 0;
}

static void buf_free(Buf *b) {
    free(b->p);
    b->p = NULL;
    b->n = b->cap = 0;
}

/* ------------------------------------------------------------------------------------------- */
/* a table of distinct byte strings: text -> index */

typedef struct {
    Buf arena;       /* the texts, back to back */
    Buf offs;        /* size_t offset of each entry (n + 1 values once finished) */
    Buf lens;        /* uint32 length of each entry */
    Buf hashv;       /* uint64 hash of each entry */
    uint64_t *hashes; /* = hashv.p */
    uint32_t *slots; /* open addressing: index + 1, 0 = empty */
    size_t nslots, count;
} Intern;

static uint64_t hash_bytes(const unsigned char *s, size_t n) {
    uint64_t h = 1469598103934665603ULL ^ (uint64_t)n;
    size_t i = 0;
    if (n >= 64) {
        /* four independent chains over 32 bytes a step (kernel names run to hundreds of bytes: one
         * chain would wait on a multiply per 8 bytes), folded into h */
        uint64_t a = h, b = h ^ 0x9E3779B97F4A7C15ULL, c = h ^ 0xC2B2AE3D27D4EB4FULL, d = h ^ 0x165667B19E3779F9ULL;
        for (; i + 32 <= n; i += 32) {
            uint64_t w[4];
            memcpy(w, s + i, 32);
            a = (a ^ w[0]) * 1099511628211ULL;
            b = (b ^ w[1]) * 1099511628211ULL;
            c = (c ^ w[2]) * 1099511628211ULL;
            d = (d ^ w[3]) * 1099511628211ULL;
            a ^= a >> 29;
            b ^= b >> 29;
            c ^= c >> 29;
            d ^= d >> 29;
        }
        h = (h ^ a) * 0x9E3779B97F4A7C15ULL;
        h = (h ^ (h >> 31) ^ b) * 0x9E3779B97F4A7C15ULL;
        h = (h ^ (h >> 31) ^ c) * 0x9E3779B97F4A7C15ULL;
        h = (h ^ (h >> 31) ^ d) * 0x9E3779B97F4A7C15ULL;
        h ^= h >> 31;
    }
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, s + i, 8);
        h = (h ^ w) * 1099511628211ULL;
        h ^= h >> 29;
    }
    if (i < n) { /* the last 1 to 7 bytes in one word (reads that overlap still cover each byte) */
        uint64_t w;
        if (n >= 8) {
            memcpy(&w, s + n - 8, 8);
        } else if (n >= 4) {
            uint32_t a, b;
            memcpy(&a, s, 4);
            memcpy(&b, s + n - 4, 4);
            w = (uint64_t)a << 32 | b;
        } else {
            w = (uint64_t)s[0] << 16 | (uint64_t)s[n / 2] << 8 | s[n - 1];
        }
        h = (h ^ w) * 1099511628211ULL;
    }
    h ^= h >> 32;
    h *= 0x9E3779B97F4A7C15ULL;
    h ^= h >> 29;
    return h;
}

static int intern_grow(Intern *t) {
    size_t ns = t->nslots ? t->nslots * 2 : 1024;
    if (ns > (SIZE_MAX / sizeof(uint64_t)) || ns < t->nslots) return -1;
    uint32_t *slots = calloc(ns, sizeof(uint32_t));
    if (!slots) return -1;
    size_t m = ns - 1;
    for (size_t k = 0; k < t->count; k++) {
        size_t i = (size_t)t->hashes[k] & m;
        while (slots[i]) i = (i + 1) & m;
        slots[i] = (uint32_t)(k + 1);
    }
    free(t->slots);
    t->slots = slots;
    t->nslots = ns;
    return 0;
}

/* index of the text, added when new; -1 on memory failure or too many entries */
static int64_t intern_get(Intern *t, const char *s, size_t n) {
    if (n > UINT32_MAX) return -1;
    if ((t->count + 1) * 2 > t->nslots && intern_grow(t) < 0) return -1;
    uint64_t h = hash_bytes((const unsigned char *)s, n);
    size_t m = t->nslots - 1, i = (size_t)h & m;
    const size_t *offs = (const size_t *)t->offs.p;
    const uint32_t *lens = (const uint32_t *)t->lens.p;
    while (t->slots[i]) {
        size_t k = t->slots[i] - 1;
        if (t->hashes[k] == h && lens[k] == n && (n == 0 || memcmp(t->arena.p + offs[k], s, n) == 0))
            return (int64_t)k;
        i = (i + 1) & m;
    }
    if (t->count >= 0x7FFFFFF0u) return -1;
    size_t k = t->count;
    size_t off = t->arena.n;
    uint32_t len = (uint32_t)n;
    if (buf_put(&t->arena, s, n) < 0 || buf_put(&t->offs, &off, sizeof off) < 0 ||
        buf_put(&t->lens, &len, sizeof len) < 0)
        return -1;
    if (buf_put(&t->hashv, &h, sizeof h) < 0) return -1;
    t->hashes = (uint64_t *)t->hashv.p;
    t->slots[i] = (uint32_t)(k + 1);
    t->count++;
    return (int64_t)k;
}

static void intern_free(Intern *t) {
    buf_free(&t->arena);
    buf_free(&t->offs);
    buf_free(&t->lens);
    buf_free(&t->hashv);
    free(t->slots);
    memset(t, 0, sizeof *t);
}

/* ------------------------------------------------------------------------------------------- */
/* columns */

enum {
    C_NAME, C_TS, C_DUR, C_TID, C_EXT, C_CORR, C_DEVICE, C_STREAM, C_GRID, C_BLOCK, C_BYTES,
    C_DIMS, C_TYPES, C_CONCRETE, NCOLS
};
static const char *COL_NAMES[NCOLS] = {
    "name", "ts", "dur", "tid", "external_id", "correlation", "device", "stream", "grid", "block", "bytes",
    "input_dims", "input_types", "concrete",
};
/* storage: 'f' float64, 'i' int64, 's' int32 index into strings, 'r' int32 index into raws (-1: None) */
static const char COL_TYPE[NCOLS] = {'s', 'f', 'f', 'i', 'i', 'i', 'i', 'i', 's', 's', 'f', 'r', 'r', 'r'};

#define MAX_KINDS 16
#define FILTERED 16 /* a route of FILTERED + k: kind k, for the names name_filter accepts */

typedef struct {
    uint32_t mask; /* columns kept for this kind */
    Buf cols[NCOLS];
    Buf tid_rows; /* int64 rows whose tid was a string, */
    Buf tid_strs; /* int32 index of that string */
    size_t rows;
} Kind;

/* ------------------------------------------------------------------------------------------- */
/* the scanner object */

enum { S_START, S_KEY_FIRST, S_KEY, S_AFTER_VALUE, S_EV_FIRST, S_EV_NEXT, S_EV_VALUE, S_END };

typedef struct {
    PyObject_HEAD
    PyObject *route;   /* callable: category (str) -> kind index, -(kind index + 1) (names filtered) or None */
    PyObject *name_filter; /* callable: name (str) -> bool, for the filtered kinds */
    Buf name_ok;       /* per entry of strs: 0 not asked yet, 1 accepted, 2 refused */
    PyObject *meta;    /* dict: top-level key -> raw JSON bytes of its value */
    int nkinds;
    Kind kinds[MAX_KINDS];
    Intern strs, raws;
    Intern cats;       /* raw text of a category token -> route entry */
    Buf cat_route;     /* int8 kind per cats entry (-1: not kept) */
    Buf scratch;       /* decoded strings */
    int state;
    int started;       /* at least one byte seen (a byte-order mark is skipped only at the start) */
    int event_keys;    /* traceEvents keys read (a repeated key starts the tables again) */
    int inside;        /* begun inside traceEvents, before an entry (the rest of a document split in two) */
    int joined;        /* its tables went to another scanner (join): no result of its own */
    uint64_t n_events;
    uint64_t drop_name, drop_not_object, drop_gpu; /* events dropped, by reason */
    uint32_t gpu_kinds; /* kinds whose drops count as GPU events */
    uint64_t offset;   /* bytes consumed so far, for messages */
    int busy;
    int finished;
    Buf carry;         /* a unit cut by the end of the last piece */
    size_t retry_at;   /* scan the kept unit again once it is this long (so a huge one costs O(n)) */
    /* error of the last scan */
    int err_kind;      /* 0 none, 1 JSON, 2 type (not a trace), 3 memory, 4 Python exception set */
    char err[200];
} Scanner;

/* ------------------------------------------------------------------------------------------- */
/* scanning primitives: return the position after the token, or NULL with *st set */

enum { OK = 0, NEED = 1, EJSON = 2, ETYPE = 3, EMEM = 4, EPY = 5 };

typedef struct {
    const char *base;  /* start of the buffer (for offsets in messages) */
    const char *end;
    int final;         /* no more input follows this buffer */
    int st;
    Scanner *s;
    PyThreadState *ts; /* saved thread state while the GIL is released */
    char msg[160];
} Ctx;

static const char *fail(Ctx *c, int st, const char *p, const char *msg) {
    c->st = st;
    if (st == EJSON || st == ETYPE)
        snprintf(c->msg, sizeof c->msg, "%s (byte %llu)", msg,
                 (unsigned long long)(c->s->offset + (uint64_t)(p - c->base)));
    else if (msg)
        snprintf(c->msg, sizeof c->msg, "%s", msg);
    return NULL;
}

static const char *need(Ctx *c, const char *p) {
    if (c->final) return fail(c, EJSON, p, "truncated: the document ends inside a value");
    c->st = NEED;
    return NULL;
}

/* Whitespace from p on, past the one byte or none that skip_ws passes itself (out of line: skip_ws
 * is inlined in many places). */
static __attribute__((noinline)) const char *skip_ws_run(const char *p, const char *end) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (end - p >= 9 && *p == '\n') { /* a newline and an indent: the spaces counted in one word */
        uint64_t w;
        memcpy(&w, p + 1, 8);
        w ^= 0x2020202020202020ULL; /* the first nonzero byte: the first other than a space */
        if (w) {
            const char *q = p + 1 + __builtin_ctzll(w) / 8;
            if ((unsigned char)*q > ' ') return q;
        }
    }
#endif
    while (p < end && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t')) p++;
    return p;
}

static inline const char *skip_ws(const char *p, const char *end) {
    if (p < end && (unsigned char)*p > ' ') return p; /* most tokens follow no space or one */
    if (end - p >= 2 && *p == ' ' && (unsigned char)p[1] > ' ') return p + 1;
    return skip_ws_run(p, end);
}

static int hexv(char d);

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX2_PATH 1
/* The offset of the first '"', backslash, control or non-ASCII byte of [q, end), 32 bytes a step,
 * or end - q when none; for a CPU with AVX2 (chosen at run time: the build targets any x86-64). */
__attribute__((target("avx2"))) static size_t plain_run_avx2(const char *q, const char *end) {
    const __m256i quote = _mm256_set1_epi8('"'), bslash = _mm256_set1_epi8('\\'), space = _mm256_set1_epi8(0x20);
    const char *r = q;
    while (end - r >= 32) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)r);
        __m256i m = _mm256_or_si256(_mm256_or_si256(_mm256_cmpeq_epi8(v, quote), _mm256_cmpeq_epi8(v, bslash)),
                                    _mm256_cmpgt_epi8(space, v)); /* signed: also bytes >= 0x80 */
        unsigned mask = (unsigned)_mm256_movemask_epi8(m);
        if (mask) return (size_t)(r - q) + (size_t)__builtin_ctz(mask);
        r += 32;
    }
    while (r < end) {
        unsigned char ch = (unsigned char)*r;
        if (ch == '"' || ch == '\\' || ch < 0x20 || ch >= 0x80) break;
        r++;
    }
    return (size_t)(r - q);
}
static int use_avx2;
#endif

/* A string token starting at p ('"'): the general case of scan_string. */
static const char *scan_string_slow(Ctx *c, const char *p, const char **s0, const char **s1, int *esc, int *hi) {
    const char *end = c->end;
    const char *q = p + 1;
    int e = 0, h = 0;
    for (;;) {
#ifdef HAVE_AVX2_PATH
        if (use_avx2) q += plain_run_avx2(q, end);
#endif
#if defined(__SSE2__)
        /* 16 bytes at a time to the next '"', backslash, control or non-ASCII byte */
        {
            const __m128i quote = _mm_set1_epi8('"'), bslash = _mm_set1_epi8('\\'), space = _mm_set1_epi8(0x20);
            while (end - q >= 16) {
                __m128i v = _mm_loadu_si128((const __m128i *)(const void *)q);
                __m128i m = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, bslash)),
                                         _mm_cmplt_epi8(v, space)); /* signed: also bytes >= 0x80 */
                int mask = _mm_movemask_epi8(m);
                if (mask) {
                    q += __builtin_ctz((unsigned)mask);
                    break;
                }
                q += 16;
            }
        }
#endif
        while (q < end) {
            unsigned char ch = (unsigned char)*q;
            if (ch == '"' || ch == '\\' || ch < 0x20 || ch >= 0x80) break;
            q++;
        }
        if (q >= end) return need(c, q);
        unsigned char ch = (unsigned char)*q;
        if (ch == '"') break;
        if (ch >= 0x80) {
            h = 1;
            q++;
            continue;
        }
        if (ch < 0x20) return fail(c, EJSON, q, "invalid character in a string");
        /* backslash */
        e = 1;
        if (q + 1 >= end) return need(c, q);
        char x = q[1];
        if (x == 'u') {
            if (q + 6 > end) return need(c, q);
            for (int k = 2; k < 6; k++) {
                char d = q[k];
                if (!((d >= '0' && d <= '9') || (d >= 'a' && d <= 'f') || (d >= 'A' && d <= 'F')))
                    return fail(c, EJSON, q, "invalid escape in a string");
            }
            /* a UTF-16 surrogate must come as a high-low pair, in every string (a skipped one too), as
             * the typed decoder requires */
            uint32_t cp = (uint32_t)(hexv(q[2]) << 12 | hexv(q[3]) << 8 | hexv(q[4]) << 4 | hexv(q[5]));
            if (cp >= 0xDC00 && cp <= 0xDFFF) return fail(c, EJSON, q, "invalid surrogate in a string");
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                if (q + 12 > end) return need(c, q);
                if (q[6] != '\\' || q[7] != 'u') return fail(c, EJSON, q, "invalid surrogate in a string");
                for (int k = 8; k < 12; k++) {
                    char d = q[k];
                    if (!((d >= '0' && d <= '9') || (d >= 'a' && d <= 'f') || (d >= 'A' && d <= 'F')))
                        return fail(c, EJSON, q, "invalid escape in a string");
                }
                uint32_t lo = (uint32_t)(hexv(q[8]) << 12 | hexv(q[9]) << 8 | hexv(q[10]) << 4 | hexv(q[11]));
                if (lo < 0xDC00 || lo > 0xDFFF) return fail(c, EJSON, q, "invalid surrogate in a string");
                q += 6;
            }
            q += 6;
        } else if (x == '"' || x == '\\' || x == '/' || x == 'b' || x == 'f' || x == 'n' || x == 'r' ||
                   x == 't') {
            q += 2;
        } else {
            return fail(c, EJSON, q, "invalid escape in a string");
        }
    }
    *s0 = p + 1;
    *s1 = q;
    if (esc) *esc = e;
    if (hi) *hi = h;
    return q + 1;
}

/* A string token starting at p ('"'). Sets [*s0, *s1) to its contents (escapes not decoded),
 * *esc when it has a backslash, *hi when it has a byte >= 0x80. Most strings of a trace (keys,
 * short values) end within 16 bytes with nothing to decode: those take no call. */
static inline const char *scan_string(Ctx *c, const char *p, const char **s0, const char **s1, int *esc, int *hi) {
#if defined(__SSE2__)
    if (c->end - p >= 17) {
        __m128i v = _mm_loadu_si128((const __m128i *)(const void *)(p + 1));
        __m128i m = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, _mm_set1_epi8('"')),
                                              _mm_cmpeq_epi8(v, _mm_set1_epi8('\\'))),
                                 _mm_cmplt_epi8(v, _mm_set1_epi8(0x20)));
        int mask = _mm_movemask_epi8(m);
        if (mask) {
            const char *q = p + 1 + __builtin_ctz((unsigned)mask);
            if (*q == '"') {
                *s0 = p + 1;
                *s1 = q;
                if (esc) *esc = 0;
                if (hi) *hi = 0;
                return q + 1;
            }
        }
    }
#endif
    return scan_string_slow(c, p, s0, s1, esc, hi);
}

static int utf8_valid(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned char c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t k;
        uint32_t cp;
        if (c >= 0xC2 && c <= 0xDF) {
            k = 1;
            cp = c & 0x1F;
        } else if (c >= 0xE0 && c <= 0xEF) {
            k = 2;
            cp = c & 0x0F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            k = 3;
            cp = c & 0x07;
        } else {
            return 0;
        }
        if (n - i <= k) return 0; /* the sequence runs past the end */
        for (size_t j = 1; j <= k; j++) {
            unsigned char d = s[i + j];
            if ((d & 0xC0) != 0x80) return 0;
            cp = (cp << 6) | (d & 0x3F);
        }
        if ((k == 2 && cp < 0x800) || (k == 3 && (cp < 0x10000 || cp > 0x10FFFF)) ||
            (cp >= 0xD800 && cp <= 0xDFFF))
            return 0;
        i += k + 1;
    }
    return 1;
}

static int hexv(char d) {
    if (d >= '0' && d <= '9') return d - '0';
    if (d >= 'a' && d <= 'f') return d - 'a' + 10;
    return d - 'A' + 10;
}

static void put_utf8(char *o, size_t *n, uint32_t cp) {
    if (cp < 0x80) {
        o[(*n)++] = (char)cp;
    } else if (cp < 0x800) {
        o[(*n)++] = (char)(0xC0 | (cp >> 6));
        o[(*n)++] = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        o[(*n)++] = (char)(0xE0 | (cp >> 12));
        o[(*n)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[(*n)++] = (char)(0x80 | (cp & 0x3F));
    } else {
        o[(*n)++] = (char)(0xF0 | (cp >> 18));
        o[(*n)++] = (char)(0x80 | ((cp >> 12) & 0x3F));
        o[(*n)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[(*n)++] = (char)(0x80 | (cp & 0x3F));
    }
}

/* Decode the contents of a string token into UTF-8 (c->s->scratch), checking UTF-8 and
 * surrogate pairs as a decoder that builds a str does. Returns 0, or -1 with c->st set. */
static int decode_string(Ctx *c, const char *s0, const char *s1, int esc, int hi, const char **out, size_t *outn) {
    if (!esc) {
        if (hi && !utf8_valid((const unsigned char *)s0, (size_t)(s1 - s0))) {
            fail(c, EJSON, s0, "invalid UTF-8 in a string");
            return -1;
        }
        *out = s0;
        *outn = (size_t)(s1 - s0);
        return 0;
    }
    Buf *b = &c->s->scratch;
    b->n = 0;
    if (buf_reserve(b, (size_t)(s1 - s0) + 4) < 0) {
        fail(c, EMEM, s0, NULL);
        return -1;
    }
    char *o = b->p;
    size_t n = 0;
    const char *q = s0;
    while (q < s1) {
        if (*q != '\\') {
            o[n++] = *q++;
            continue;
        }
        char x = q[1]; /* scan_string checked the escape and its length */
        if (x != 'u') {
            char v = x == 'b' ? '\b' : x == 'f' ? '\f' : x == 'n' ? '\n' : x == 'r' ? '\r' : x == 't' ? '\t' : x;
            o[n++] = v;
            q += 2;
            continue;
        }
        uint32_t cp = (uint32_t)(hexv(q[2]) << 12 | hexv(q[3]) << 8 | hexv(q[4]) << 4 | hexv(q[5]));
        q += 6;
        if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (q + 6 <= s1 && q[0] == '\\' && q[1] == 'u') {
                uint32_t lo = (uint32_t)(hexv(q[2]) << 12 | hexv(q[3]) << 8 | hexv(q[4]) << 4 | hexv(q[5]));
                if (lo >= 0xDC00 && lo <= 0xDFFF) {
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    q += 6;
                    put_utf8(o, &n, cp);
                    continue;
                }
            }
            fail(c, EJSON, q, "invalid surrogate in a string");
            return -1;
        }
        if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail(c, EJSON, q, "invalid surrogate in a string");
            return -1;
        }
        put_utf8(o, &n, cp);
    }
    if (hi && !utf8_valid((const unsigned char *)o, n)) {
        fail(c, EJSON, s0, "invalid UTF-8 in a string");
        return -1;
    }
    *out = o;
    *outn = n;
    return 0;
}

static inline int is_digit(char ch) { return ch >= '0' && ch <= '9'; }

static const char *scan_lit(Ctx *c, const char *p, const char *word, size_t n) {
    size_t have = (size_t)(c->end - p);
    size_t k = have < n ? have : n;
    if (memcmp(p, word, k) != 0) return fail(c, EJSON, p, "invalid character");
    if (have < n) return need(c, p);
    return p + n;
}

/* The digits of a number token as digits_value needs them, gathered while scanning it (so a number
 * whose value is needed is read once). m is exact while there are at most 19 significant digits
 * (those from the first nonzero one on): the only case digits_value reads it. */
typedef struct {
    uint64_t m;
    size_t sig, frac; /* significant digits; digits after the point */
    int neg, exp;     /* exp: the token has an exponent */
} Digits;

/* A number token at p: strict JSON grammar. *is_int when it has no fraction and no exponent; its
 * digits in *dg unless dg is NULL (inlined both ways, so a skipped number costs no more). */
static inline __attribute__((always_inline)) const char *scan_number_at(Ctx *c, const char *p, int *is_int,
                                                                       Digits *dg) {
    const char *q = p, *end = c->end;
    int isint = 1, neg = 0, has_exp = 0;
    uint64_t m = 0; /* (kept in registers: the digit loops write no memory) */
    size_t sig = 0, frac = 0;
    if (q < end && *q == '-') {
        q++;
        neg = 1;
    }
    if (q >= end) return need(c, p);
    if (*q == '0') {
        q++;
    } else if (*q >= '1' && *q <= '9') {
        const char *q0 = q;
        for (; q < end && is_digit(*q); q++)
            if (dg) m = m * 10 + (uint64_t)(*q - '0');
        sig = (size_t)(q - q0);
    } else {
        return fail(c, EJSON, q, "invalid number");
    }
    if (q < end && *q == '.') {
        isint = 0;
        q++;
        if (q >= end) return need(c, p);
        if (!is_digit(*q)) return fail(c, EJSON, q, "invalid number");
        const char *q0 = q;
        for (; q < end && is_digit(*q); q++) {
            if (dg) {
                m = m * 10 + (uint64_t)(*q - '0');
                sig += m != 0;
            }
        }
        frac = (size_t)(q - q0);
    }
    if (q < end && (*q == 'e' || *q == 'E')) {
        isint = 0;
        has_exp = 1;
        q++;
        if (q < end && (*q == '+' || *q == '-')) q++;
        if (q >= end) return need(c, p);
        if (!is_digit(*q)) return fail(c, EJSON, q, "invalid number");
        while (q < end && is_digit(*q)) q++;
    }
    if (q >= end && !c->final) return need(c, p); /* more digits may follow */
    if (q < end && is_digit(*q)) return fail(c, EJSON, q, "invalid number");
    *is_int = isint;
    if (dg) {
        dg->m = m;
        dg->sig = sig;
        dg->frac = frac;
        dg->neg = neg;
        dg->exp = has_exp;
    }
    return q;
}

static const char *scan_number(Ctx *c, const char *p, int *is_int) { return scan_number_at(c, p, is_int, NULL); }

static const double POW10[23] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,  1e8,  1e9,  1e10, 1e11,
                                 1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* The double nearest a number token [p, q) with digits *d (correctly rounded: exact fast path, else
 * strtod). */
static int digits_value(const Digits *d, const char *p, const char *q, double *out) {
    if (!d->exp && d->sig <= 19 && d->m < (1ULL << 53) && d->frac <= 22) {
        double v = (double)d->m;
        v = d->frac ? v / POW10[d->frac] : v;
        *out = d->neg ? -v : v;
        return 0;
    }
    /* the general case (an exponent, many digits) */
    char tmp[128];
    size_t n = (size_t)(q - p);
    char *s = n < sizeof tmp ? tmp : malloc(n + 1);
    if (!s) return -1;
    memcpy(s, p, n);
    s[n] = 0;
    errno = 0;
    *out = strtod(s, NULL);
    if (s != tmp) free(s);
    return 0;
}

/* the digits of a number text [p, q) (its grammar already checked: the scan cannot fail) */
static void text_digits(Ctx *c, const char *p, const char *q, Digits *d) {
    Ctx t = *c;
    t.end = q;
    t.final = 1;
    int isint;
    scan_number_at(&t, p, &isint, d);
}

/* int64 value of an integer token; 0 or -1 when out of range */
static int int_value(const char *p, const char *q, int64_t *out) {
    int neg = 0;
    if (*p == '-') {
        neg = 1;
        p++;
    }
    uint64_t v = 0;
    for (; p < q; p++) {
        uint64_t d = (uint64_t)(*p - '0');
        if (v > (UINT64_MAX - d) / 10) return -1;
        v = v * 10 + d;
    }
    if (neg) {
        if (v > (uint64_t)INT64_MAX + 1) return -1;
        *out = v == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)v;
    } else {
        if (v > (uint64_t)INT64_MAX) return -1;
        *out = (int64_t)v;
    }
    return 0;
}

/* Skip one JSON value of any type, checking its syntax, without recursion. */
static const char *skip_value(Ctx *c, const char *p) {
    const char *end = c->end;
    char stack[MAX_DEPTH];
    int depth = 0;
    const char *s0, *s1;
    for (;;) {
        /* a value */
        p = skip_ws(p, end);
        if (p >= end) return need(c, p);
        switch (*p) {
        case '{':
            if (depth >= MAX_DEPTH) return fail(c, EJSON, p, "nested too deeply");
            stack[depth++] = '{';
            p = skip_ws(p + 1, end);
            if (p >= end) return need(c, p);
            if (*p == '}') {
                depth--;
                p++;
                goto after;
            }
            goto key;
        case '[':
            if (depth >= MAX_DEPTH) return fail(c, EJSON, p, "nested too deeply");
            stack[depth++] = '[';
            p = skip_ws(p + 1, end);
            if (p >= end) return need(c, p);
            if (*p == ']') {
                depth--;
                p++;
                goto after;
            }
            continue;
        case '"':
            p = scan_string(c, p, &s0, &s1, NULL, NULL);
            if (!p) return NULL;
            goto after;
        case 't':
            p = scan_lit(c, p, "true", 4);
            if (!p) return NULL;
            goto after;
        case 'f':
            p = scan_lit(c, p, "false", 5);
            if (!p) return NULL;
            goto after;
        case 'n':
            p = scan_lit(c, p, "null", 4);
            if (!p) return NULL;
            goto after;
        default: {
            int isint;
            p = scan_number(c, p, &isint);
            if (!p) return NULL;
            goto after;
        }
        }
    key:
        /* p at the first byte of a key */
        if (*p != '"') return fail(c, EJSON, p, "expected a key");
        p = scan_string(c, p, &s0, &s1, NULL, NULL);
        if (!p) return NULL;
        p = skip_ws(p, end);
        if (p >= end) return need(c, p);
        if (*p != ':') return fail(c, EJSON, p, "expected ':'");
        p++;
        continue;
    after:
        if (depth == 0) return p;
        p = skip_ws(p, end);
        if (p >= end) return need(c, p);
        if (*p == ',') {
            p = skip_ws(p + 1, end);
            if (p >= end) return need(c, p);
            if (stack[depth - 1] == '{') goto key;
            continue;
        }
        if ((*p == '}' && stack[depth - 1] == '{') || (*p == ']' && stack[depth - 1] == '[')) {
            depth--;
            p++;
            goto after;
        }
        return fail(c, EJSON, p, "expected ',' or the end of a container");
    }
}

/* ------------------------------------------------------------------------------------------- */
/* events
 *
 * The rules are those of the Python path's docstring ("Tolerance rules"): a value of the expected
 * type is read as the typed decoder reads it; a number written as a string is read as that number;
 * anything else is absent, or drops the event (counted by reason) where the field is needed. The
 * typed decoder reads the integer token -0 as +0.0 in a float field while the tolerant reading of
 * an event the typed decoder refused gives -0.0; the typed flags keep that one difference. */

typedef struct {
    const char *s0, *s1;
    int esc, hi;
    int set;
} Str;

typedef struct {
    const char *p, *q;
} Span;

enum { V_NUM, V_NUMSTR, V_NULL, V_STR, V_OTHER };

typedef struct {
    Str ph, cat, name, tid_s;
    int ph_ok, cat_ok, name_bad; /* ph/cat a string (or absent); name present and not a string */
    double ts, dur;
    int ts_mz, dur_mz; /* the value came from the integer token -0 */
    int64_t tid;
    int typed; /* the typed decoder would read this event as it is */
    int64_t ints[4]; /* correlation, external id, device, stream */
    int ints_set[4];
    double bytes;
    int bytes_set, bytes_mz, args_typed;
    Span raw[5]; /* grid, block, dims, types, concrete */
} Event;

/* past the ':' after a key token ending before p, and the space after it */
static inline const char *after_key(Ctx *c, const char *p) {
    if (c->end - p >= 3 && p[0] == ':' && p[1] == ' ' && (unsigned char)p[2] > ' ') return p + 2; /* ": " */
    p = skip_ws(p, c->end);
    if (p >= c->end) return need(c, p);
    if (*p != ':') return fail(c, EJSON, p, "expected ':'");
    return skip_ws(p + 1, c->end);
}

/* key of an object member: decoded text of the key token */
static const char *read_key(Ctx *c, const char *p, const char **k, size_t *kn) {
    const char *s0, *s1;
    int esc, hi;
    if (p >= c->end) return need(c, p);
    if (*p != '"') return fail(c, EJSON, p, "expected a key");
    p = scan_string(c, p, &s0, &s1, &esc, &hi);
    if (!p) return NULL;
    if (esc) {
        /* decoded into scratch; the caller compares it before anything else uses scratch. As for the
         * typed decoder, escapes count (\u0070h is ph) but the UTF-8 of a key is not checked: such a
         * key never names a field that is read. */
        if (decode_string(c, s0, s1, esc, 0, k, kn) < 0) return NULL;
    } else {
        *k = s0;
        *kn = (size_t)(s1 - s0);
    }
    return after_key(c, p);
}

#define KEY_IS(k, kn, lit) ((kn) == sizeof(lit) - 1 && memcmp((k), (lit), sizeof(lit) - 1) == 0)

/* Whether the key token at p is exactly the literal (its text and closing quote all in the buffer).
 * Matching the usual keys in the raw text first turns the end of each key into a predicted branch
 * (the position after it is known before its bytes are read); any other key, or one cut by the end
 * of the buffer, goes to read_key, which finds the same key. */
#define KEY_AT(p, end, lit) ((end) - (p) > (ptrdiff_t)sizeof(lit) && memcmp((p) + 1, lit "\"", sizeof(lit)) == 0)

/* Whether [p, q) is exactly a JSON number; *is_int when it has no fraction and no exponent. */
static int number_text(const char *p, const char *q, int *is_int) {
    const char *r = p;
    int isint = 1;
    if (r < q && *r == '-') r++;
    if (r >= q) return 0;
    if (*r == '0') {
        r++;
    } else if (*r >= '1' && *r <= '9') {
        while (r < q && is_digit(*r)) r++;
    } else {
        return 0;
    }
    if (r < q && *r == '.') {
        isint = 0;
        r++;
        if (r >= q || !is_digit(*r)) return 0;
        while (r < q && is_digit(*r)) r++;
    }
    if (r < q && (*r == 'e' || *r == 'E')) {
        isint = 0;
        r++;
        if (r < q && (*r == '+' || *r == '-')) r++;
        if (r >= q || !is_digit(*r)) return 0;
        while (r < q && is_digit(*r)) r++;
    }
    *is_int = isint;
    return r == q;
}

/* One value, classified: V_NUM (a number token: [*t0, *t1)), V_NUMSTR (a string whose whole text
 * is a number, no escapes: its contents), V_NULL, V_STR (another string: its token in *str),
 * V_OTHER. The digits of a number (V_NUM, V_NUMSTR) in *dg. */
static const char *read_value(Ctx *c, const char *p, int *cls, const char **t0, const char **t1, int *is_int,
                              Digits *dg, Str *str) {
    if (p >= c->end) return need(c, p);
    if (*p == '-' || is_digit(*p)) {
        const char *q = scan_number_at(c, p, is_int, dg);
        if (!q) return NULL;
        *cls = V_NUM;
        *t0 = p;
        *t1 = q;
        return q;
    }
    if (*p == '"') {
        Str s;
        const char *q = scan_string(c, p, &s.s0, &s.s1, &s.esc, &s.hi);
        if (!q) return NULL;
        s.set = 1;
        if (!s.esc && !s.hi && number_text(s.s0, s.s1, is_int)) {
            *cls = V_NUMSTR;
            *t0 = s.s0;
            *t1 = s.s1;
            text_digits(c, s.s0, s.s1, dg);
        } else {
            *cls = V_STR;
        }
        if (str) *str = s;
        return q;
    }
    if (*p == 'n') {
        const char *q = scan_lit(c, p, "null", 4);
        if (!q) return NULL;
        *cls = V_NULL;
        return q;
    }
    const char *q = skip_value(c, p);
    if (!q) return NULL;
    *cls = V_OTHER;
    return q;
}

/* the text -0 (the only integer token whose typed and tolerant float readings differ) */
static int minus_zero(const char *t0, const char *t1) { return t1 - t0 == 2 && t0[0] == '-' && t0[1] == '0'; }

/* a float field: *out NaN when unusable; *typed cleared when the typed decoder would refuse it */
static const char *read_float(Ctx *c, const char *p, double *out, int *mz, int *typed) {
    int cls, isint;
    const char *t0 = NULL, *t1 = NULL;
    Digits dg;
    p = read_value(c, p, &cls, &t0, &t1, &isint, &dg, NULL);
    if (!p) return NULL;
    *mz = 0;
    if (cls == V_NUM || cls == V_NUMSTR) {
        if (digits_value(&dg, t0, t1, out) < 0) return fail(c, EMEM, p, NULL);
        if (!isfinite(*out)) {
            *out = NAN;
            *typed = 0;
        }
        if (cls == V_NUMSTR) *typed = 0;
        else if (isint && minus_zero(t0, t1)) *mz = 1;
    } else {
        *out = NAN;
        *typed = 0;
    }
    return p;
}

/* an integer within int64 (a number whose value is one: 5.0 is 5); *set 0 when absent */
static int int_of(const char *t0, const char *t1, int isint, const Digits *dg, int64_t *out) {
    if (isint && dg->sig <= 18) { /* m is the whole value */
        *out = dg->neg ? -(int64_t)dg->m : (int64_t)dg->m;
        return 1;
    }
    if (isint) return int_value(t0, t1, out) == 0;
    double v;
    if (digits_value(dg, t0, t1, &v) < 0) return -1;
    if (!isfinite(v) || v != floor(v) || v < -9223372036854775808.0 || v >= 9223372036854775808.0) return 0;
    *out = (int64_t)v;
    return 1;
}

static const char *read_int(Ctx *c, const char *p, int64_t *out, int *set, int *typed) {
    int cls, isint;
    const char *t0 = NULL, *t1 = NULL;
    Digits dg;
    p = read_value(c, p, &cls, &t0, &t1, &isint, &dg, NULL);
    if (!p) return NULL;
    *set = 0;
    if (cls == V_NUM || cls == V_NUMSTR) {
        int r = int_of(t0, t1, isint, &dg, out);
        if (r < 0) return fail(c, EMEM, p, NULL);
        *set = r;
        if (!(cls == V_NUM && isint && r)) *typed = 0;
    } else if (cls != V_NULL) {
        *typed = 0;
    }
    return p;
}

/* a string field (ph, cat, name): *ok 0 when the value is not a string */
static const char *read_str(Ctx *c, const char *p, Str *out, int *ok) {
    if (p >= c->end) return need(c, p);
    if (*p != '"') {
        *ok = 0;
        out->set = 0;
        return skip_value(c, p);
    }
    p = scan_string(c, p, &out->s0, &out->s1, &out->esc, &out->hi);
    if (!p) return NULL;
    const char *d;
    size_t dn;
    if ((out->esc || out->hi) && decode_string(c, out->s0, out->s1, out->esc, out->hi, &d, &dn) < 0) return NULL;
    out->set = 1;
    *ok = 1;
    return p;
}

/* The members of an event read, and (F_OTHER on) other usual ones, matched first by their raw
 * text (KEY_AT). */
enum { F_PH, F_CAT, F_NAME, F_TS, F_DUR, F_TID, F_ARGS, F_OTHER, F_PID = F_OTHER, F_ID, F_BP, F_S };

/* their names, in that order */
static const char *const EVENT_KEYS[F_OTHER] = {"ph", "cat", "name", "ts", "dur", "tid", "args"};

/* a key matched by event_key_at or args_key_at: its field, and its length in *kn */
#define MATCH(lit, f)                                                                                 \
    if (KEY_AT(p, end, lit)) return *kn = sizeof(lit) - 1, (f)

/* the field of the key token at p when it is a usual key written plainly, else -1 */
static inline int event_key_at(const char *p, const char *end, size_t *kn) {
    if (end - p < 2 || *p != '"') return -1;
    switch (p[1]) {
    case 'p': MATCH("ph", F_PH); MATCH("pid", F_PID); break;
    case 'c': MATCH("cat", F_CAT); break;
    case 'n': MATCH("name", F_NAME); break;
    case 't': MATCH("ts", F_TS); MATCH("tid", F_TID); break;
    case 'd': MATCH("dur", F_DUR); break;
    case 'a': MATCH("args", F_ARGS); break;
    case 'i': MATCH("id", F_ID); break;
    case 'b': MATCH("bp", F_BP); break;
    case 's': MATCH("s", F_S); break;
    }
    return -1;
}

/* The same for the members of args: first the integer fields, in the order of Event.ints, then
 * the raw ones, in the order of Event.raw. */
enum {
    A_CORR, A_EXT, A_DEVICE, A_STREAM, A_BYTES, A_GRID, A_BLOCK, A_DIMS, A_TYPES, A_CONCRETE, A_OTHER,
    A_RFID = A_OTHER, A_STRIDES, A_EVIDX, A_CBID, A_QUEUED, A_CONTEXT, A_REGS, A_SHMEM, A_BPSM, A_WPSM, A_OCC,
    A_SEQ, A_FWD,
};

static const char *const ARGS_KEYS[A_OTHER] = {"correlation", "External id", "device", "stream", "bytes",
                                               "grid", "block", "Input Dims", "Input type", "Concrete Inputs"};

/* Past the key token at p and its ':', with the key's field in *f: ``at`` and ``kn`` where the key was
 * matched as written plainly (event_key_at, args_key_at), else (at -1) the key decoded and looked up
 * among the n names (n: none of them). */
static inline const char *member_key(Ctx *c, const char *p, int at, size_t kn, const char *const *names, int n,
                                     int *f) {
    if (at >= 0) {
        *f = at;
        return after_key(c, p + kn + 2);
    }
    const char *k;
    p = read_key(c, p, &k, &kn);
    if (!p) return NULL;
    *f = n;
    for (int i = 0; i < n; i++) {
        if (strlen(names[i]) == kn && memcmp(k, names[i], kn) == 0) {
            *f = i;
            break;
        }
    }
    return p;
}

static inline int args_key_at(const char *p, const char *end, size_t *kn) {
    if (end - p < 2 || *p != '"') return -1;
    switch (p[1]) {
    case 'c': MATCH("correlation", A_CORR); MATCH("cbid", A_CBID); MATCH("context", A_CONTEXT); break;
    case 'E': MATCH("External id", A_EXT); MATCH("Ev Idx", A_EVIDX); break;
    case 'd': MATCH("device", A_DEVICE); break;
    case 's': MATCH("stream", A_STREAM); MATCH("shared memory", A_SHMEM); break;
    case 'b': MATCH("bytes", A_BYTES); MATCH("block", A_BLOCK); MATCH("blocks per SM", A_BPSM); break;
    case 'g': MATCH("grid", A_GRID); break;
    case 'I': MATCH("Input Dims", A_DIMS); MATCH("Input type", A_TYPES); MATCH("Input Strides", A_STRIDES); break;
    case 'C': MATCH("Concrete Inputs", A_CONCRETE); break;
    case 'R': MATCH("Record function id", A_RFID); break;
    case 'q': MATCH("queued", A_QUEUED); break;
    case 'r': MATCH("registers per thread", A_REGS); break;
    case 'w': MATCH("warps per SM", A_WPSM); break;
    case 'e': MATCH("est. achieved occupancy %", A_OCC); break;
    case 'S': MATCH("Sequence number", A_SEQ); break;
    case 'F': MATCH("Fwd thread id", A_FWD); break;
    }
    return -1;
}

static const char *read_args(Ctx *c, const char *p, Event *e) {
    for (int k = 0; k < 4; k++) e->ints_set[k] = 0;
    e->bytes_set = e->bytes_mz = 0;
    e->args_typed = 1;
    for (int k = 0; k < 5; k++) e->raw[k].p = e->raw[k].q = NULL;
    if (p >= c->end) return need(c, p);
    if (*p == 'n') return scan_lit(c, p, "null", 4);
    if (*p != '{') { /* not an object: every field absent */
        e->args_typed = 0;
        return skip_value(c, p);
    }
    p = skip_ws(p + 1, c->end);
    if (p >= c->end) return need(c, p);
    if (*p == '}') return p + 1;
    for (;;) {
        size_t kn = 0;
        int f = args_key_at(p, c->end, &kn);
        p = member_key(c, p, f, kn, ARGS_KEYS, A_OTHER, &f);
        if (!p) return NULL;
        if (f <= A_STREAM) {
            p = read_int(c, p, &e->ints[f], &e->ints_set[f], &e->args_typed);
        } else if (f == A_BYTES) {
            int cls, isint;
            const char *t0 = NULL, *t1 = NULL;
            Digits dg;
            p = read_value(c, p, &cls, &t0, &t1, &isint, &dg, NULL);
            e->bytes_set = e->bytes_mz = 0;
            if (p && (cls == V_NUM || cls == V_NUMSTR)) {
                if (digits_value(&dg, t0, t1, &e->bytes) < 0) return fail(c, EMEM, p, NULL);
                if (isfinite(e->bytes)) {
                    e->bytes_set = 1;
                    if (cls == V_NUM && isint && minus_zero(t0, t1)) e->bytes_mz = 1;
                } else {
                    e->args_typed = 0;
                }
                if (cls == V_NUMSTR) e->args_typed = 0;
            } else if (p && cls != V_NULL) {
                e->args_typed = 0;
            }
        } else {
            int r = f <= A_CONCRETE ? f - A_GRID : -1;
            const char *q = skip_value(c, p);
            if (q && r >= 0) {
                e->raw[r].p = p;
                e->raw[r].q = q;
            }
            p = q;
        }
        if (!p) return NULL;
        p = skip_ws(p, c->end);
        if (p >= c->end) return need(c, p);
        if (*p == '}') return p + 1;
        if (*p != ',') return fail(c, EJSON, p, "expected ',' or '}'");
        p = skip_ws(p + 1, c->end);
    }
}

/* one entry of traceEvents; *is_obj 0 when it is not an object */
static const char *read_event(Ctx *c, const char *p, Event *e, int *is_obj) {
    /* the fields an event may leave unset (a memset of the whole struct costs more than the rest) */
    e->ph.set = e->cat.set = e->name.set = e->tid_s.set = 0;
    e->name_bad = e->ts_mz = e->dur_mz = 0;
    e->dur = 0.0;
    e->tid = 0;
    for (int k = 0; k < 4; k++) e->ints_set[k] = 0;
    e->bytes_set = e->bytes_mz = 0;
    for (int k = 0; k < 5; k++) e->raw[k].p = e->raw[k].q = NULL;
    e->ph_ok = e->cat_ok = 1;
    e->typed = 1;
    e->args_typed = 1;
    e->ts = NAN; /* absent: dropped */
    if (p >= c->end) return need(c, p);
    if (*p != '{') {
        *is_obj = 0;
        return skip_value(c, p);
    }
    *is_obj = 1;
    p = skip_ws(p + 1, c->end);
    if (p >= c->end) return need(c, p);
    if (*p == '}') return p + 1;
    for (;;) {
        int ok;
        size_t kn = 0;
        int f = event_key_at(p, c->end, &kn);
        p = member_key(c, p, f, kn, EVENT_KEYS, F_OTHER, &f);
        if (!p) return NULL;
        if (f == F_PH) {
            p = read_str(c, p, &e->ph, &e->ph_ok);
            if (p && !e->ph_ok) e->typed = 0;
        } else if (f == F_CAT) {
            p = read_str(c, p, &e->cat, &e->cat_ok);
            if (p && !e->cat_ok) e->typed = 0;
        } else if (f == F_NAME) {
            p = read_str(c, p, &e->name, &ok);
            if (p) {
                e->name_bad = !ok;
                if (!ok) e->typed = 0;
            }
        } else if (f == F_TS) {
            p = read_float(c, p, &e->ts, &e->ts_mz, &e->typed);
        } else if (f == F_DUR) {
            p = read_float(c, p, &e->dur, &e->dur_mz, &e->typed);
        } else if (f == F_TID) {
            int cls, isint;
            const char *t0 = NULL, *t1 = NULL;
            Str s;
            Digits dg;
            s.set = 0;
            p = read_value(c, p, &cls, &t0, &t1, &isint, &dg, &s);
            if (p) {
                e->tid_s.set = 0;
                e->tid = 0;
                if (cls == V_STR || cls == V_NUMSTR) {
                    const char *d;
                    size_t dn;
                    if ((s.esc || s.hi) && decode_string(c, s.s0, s.s1, s.esc, s.hi, &d, &dn) < 0) return NULL;
                    e->tid_s = s;
                } else if (cls == V_NUM) {
                    int r = int_of(t0, t1, isint, &dg, &e->tid);
                    if (r < 0) return fail(c, EMEM, p, NULL);
                    if (!r) e->tid = 0;
                    if (!(isint && r)) e->typed = 0;
                } else {
                    e->typed = 0;
                }
            }
        } else if (f == F_ARGS) {
            p = read_args(c, p, e);
            if (p && !e->args_typed) e->typed = 0;
        } else {
            p = skip_value(c, p);
        }
        if (!p) return NULL;
        p = skip_ws(p, c->end);
        if (p >= c->end) return need(c, p);
        if (*p == '}') return p + 1;
        if (*p != ',') return fail(c, EJSON, p, "expected ',' or '}'");
        p = skip_ws(p + 1, c->end);
    }
}

/* index of a decoded string in the strings table */
static int64_t str_index(Ctx *c, const Str *s) {
    const char *d;
    size_t dn;
    if (!s->set) return intern_get(&c->s->strs, "", 0);
    if (s->esc || s->hi) {
        if (decode_string(c, s->s0, s->s1, s->esc, s->hi, &d, &dn) < 0) return -2;
    } else {
        d = s->s0;
        dn = (size_t)(s->s1 - s->s0);
    }
    return intern_get(&c->s->strs, d, dn);
}

/* kind index of an event's category (the route callable decides each distinct category once) */
static int route_of(Ctx *c, const Str *cat) {
    Scanner *s = c->s;
    const char *key = cat->set ? cat->s0 : "";
    size_t kn = cat->set ? (size_t)(cat->s1 - cat->s0) : 0;
    size_t before = s->cats.count;
    int64_t k = intern_get(&s->cats, key, kn);
    if (k < 0) return -3;
    if ((size_t)k < before) return (int)(signed char)s->cat_route.p[k];
    /* a new category: ask Python */
    const char *d = "";
    size_t dn = 0;
    if (cat->set) {
        if (cat->esc || cat->hi) {
            if (decode_string(c, cat->s0, cat->s1, cat->esc, cat->hi, &d, &dn) < 0) return -2;
        } else {
            d = cat->s0;
            dn = kn;
        }
    }
    PyEval_RestoreThread(c->ts);
    int kind = -1;
    PyObject *str = PyUnicode_DecodeUTF8(d, (Py_ssize_t)dn, "strict");
    PyObject *r = str ? PyObject_CallOneArg(s->route, str) : NULL;
    Py_XDECREF(str);
    if (!r) {
        kind = -4;
    } else if (r != Py_None) {
        long v = PyLong_AsLong(r);
        if (v == -1 && PyErr_Occurred()) kind = -4;
        else if (v < -s->nkinds || v >= s->nkinds || (v < 0 && !s->name_filter)) {
            PyErr_SetString(PyExc_ValueError, "route returned an unknown kind");
            kind = -4;
        } else {
            kind = v >= 0 ? (int)v : FILTERED + (int)(-v - 1); /* -(k + 1): kind k, names filtered */
        }
    }
    Py_XDECREF(r);
    c->ts = PyEval_SaveThread();
    if (kind == -4) {
        /* forget the entry: cat_route must stay one entry per category */
        return -4;
    }
    signed char v = (signed char)kind;
    if (buf_put(&s->cat_route, &v, 1) < 0) return -3;
    return kind;
}

static int is_x(Ctx *c, const Str *ph) {
    if (!ph->set) return 0;
    if (!ph->esc) return ph->s1 - ph->s0 == 1 && ph->s0[0] == 'X';
    const char *d;
    size_t dn;
    if (decode_string(c, ph->s0, ph->s1, ph->esc, ph->hi, &d, &dn) < 0) return -1;
    return dn == 1 && d[0] == 'X';
}

#define PUT(col, val)                                                                                 \
    do {                                                                                              \
        if (buf_put(&kd->cols[col], &(val), sizeof(val)) < 0) return fail(c, EMEM, p, NULL), -1;      \
    } while (0)

/* append one event to its kind's columns (or nothing, when its kind is not kept) */
static int add_event(Ctx *c, Event *e, const char *p) {
    if (!e->ph_ok || !e->cat_ok) return 0; /* ph or cat not a string: never used */
    int x = is_x(c, &e->ph);
    if (x < 0) return -1;
    if (!x) return 0;
    int kind = route_of(c, &e->cat);
    if (kind == -4) return fail(c, EPY, p, NULL), -1;
    if (kind == -3) return fail(c, EMEM, p, NULL), -1;
    if (kind == -2) return -1;
    if (kind < 0) return 0;
    Scanner *s = c->s;
    int filtered = kind >= FILTERED;
    if (filtered) kind -= FILTERED;
    if (e->name_bad) {
        s->drop_name++;
        if (s->gpu_kinds & (1u << kind)) s->drop_gpu++;
        return 0;
    }
    if (filtered) { /* kept only when name_filter accepts the name (asked once per distinct name) */
        int64_t v = str_index(c, &e->name);
        if (v == -2) return -1;
        if (v < 0) return fail(c, EMEM, p, NULL), -1;
        if (s->name_ok.n < s->strs.count) {
            size_t grow = s->strs.count - s->name_ok.n;
            if (buf_reserve(&s->name_ok, grow) < 0) return fail(c, EMEM, p, NULL), -1;
            memset(s->name_ok.p + s->name_ok.n, 0, grow);
            s->name_ok.n += grow;
        }
        char *ok = &s->name_ok.p[v];
        if (!*ok) {
            const size_t *offs = (const size_t *)s->strs.offs.p;
            const uint32_t *lens = (const uint32_t *)s->strs.lens.p;
            PyEval_RestoreThread(c->ts);
            PyObject *str = PyUnicode_DecodeUTF8(s->strs.arena.p ? s->strs.arena.p + offs[v] : "",
                                                 (Py_ssize_t)lens[v], "strict");
            PyObject *r = str ? PyObject_CallOneArg(s->name_filter, str) : NULL;
            Py_XDECREF(str);
            int t = r ? PyObject_IsTrue(r) : -1;
            Py_XDECREF(r);
            c->ts = PyEval_SaveThread();
            if (t < 0) return fail(c, EPY, p, NULL), -1;
            ok = &s->name_ok.p[v]; /* (the buffer did not move: nothing was interned meanwhile) */
            *ok = t ? 1 : 2;
        }
        if (*ok != 1) return 0;
    }
    if (e->typed) { /* the typed decoder's reading of the integer token -0 */
        if (e->ts_mz) e->ts = 0.0;
        if (e->dur_mz) e->dur = 0.0;
    }
    if (e->args_typed && e->bytes_mz) e->bytes = 0.0;
    Kind *kd = &s->kinds[kind];
    uint32_t m = kd->mask;
    for (int col = 0; col < NCOLS; col++) {
        if (!(m & (1u << col))) continue;
        switch (col) {
        case C_NAME: {
            int64_t v = str_index(c, &e->name);
            if (v == -2) return -1;
            if (v < 0) return fail(c, EMEM, p, NULL), -1;
            int32_t i = (int32_t)v;
            PUT(col, i);
            break;
        }
        case C_TS: PUT(col, e->ts); break;
        case C_DUR: PUT(col, e->dur); break;
        case C_TID: {
            if (e->tid_s.set) {
                int64_t v = str_index(c, &e->tid_s);
                if (v == -2) return -1;
                if (v < 0) return fail(c, EMEM, p, NULL), -1;
                int32_t i = (int32_t)v;
                int64_t row = (int64_t)kd->rows;
                if (buf_put(&kd->tid_rows, &row, sizeof row) < 0 || buf_put(&kd->tid_strs, &i, sizeof i) < 0)
                    return fail(c, EMEM, p, NULL), -1;
                int64_t zero = 0;
                PUT(col, zero);
            } else {
                PUT(col, e->tid);
            }
            break;
        }
        case C_EXT: case C_CORR: case C_DEVICE: case C_STREAM: {
            int j = col == C_CORR ? 0 : col == C_EXT ? 1 : col == C_DEVICE ? 2 : 3;
            int64_t v = e->ints_set[j] ? e->ints[j] : -1;
            PUT(col, v);
            break;
        }
        case C_BYTES: {
            double v = e->bytes_set ? e->bytes : -1.0;
            PUT(col, v);
            break;
        }
        case C_GRID: case C_BLOCK: {
            Span *r = &e->raw[col == C_GRID ? 0 : 1];
            size_t n = r->p ? (size_t)(r->q - r->p) : 0;
            if (n && !utf8_valid((const unsigned char *)r->p, n)) {
                fail(c, EJSON, r->p, "invalid UTF-8 in a string");
                return -1;
            }
            int64_t v = intern_get(&s->strs, n ? r->p : "", n);
            if (v < 0) return fail(c, EMEM, p, NULL), -1;
            int32_t i = (int32_t)v;
            PUT(col, i);
            break;
        }
        case C_DIMS: case C_TYPES: case C_CONCRETE: {
            Span *r = &e->raw[col - C_DIMS + 2];
            int32_t i = -1;
            if (r->p && r->q > r->p) {
                int64_t v = intern_get(&s->raws, r->p, (size_t)(r->q - r->p));
                if (v < 0) return fail(c, EMEM, p, NULL), -1;
                i = (int32_t)v;
            }
            PUT(col, i);
            break;
        }
        }
    }
    kd->rows++;
    return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* the document */

static int store_meta(Ctx *c, const char *k, size_t kn, const char *v0, const char *v1) {
    PyEval_RestoreThread(c->ts);
    int rc = 0;
    PyObject *key = PyUnicode_DecodeUTF8(k, (Py_ssize_t)kn, "strict");
    PyObject *val = key ? PyBytes_FromStringAndSize(v0, v1 - v0) : NULL;
    if (!val || PyDict_SetItem(c->s->meta, key, val) < 0) rc = -1;
    Py_XDECREF(key);
    Py_XDECREF(val);
    c->ts = PyEval_SaveThread();
    return rc;
}

static void reset_tables(Scanner *s) {
    for (int k = 0; k < s->nkinds; k++) {
        Kind *kd = &s->kinds[k];
        for (int col = 0; col < NCOLS; col++) kd->cols[col].n = 0;
        kd->tid_rows.n = kd->tid_strs.n = 0;
        kd->rows = 0;
    }
    s->n_events = 0;
    s->drop_name = s->drop_not_object = s->drop_gpu = 0;
}

/* Scan [base, end); returns bytes consumed (whole units only), or -1 with c->st set. */
static Py_ssize_t scan(Ctx *c) {
    Scanner *s = c->s;
    const char *p = c->base, *end = c->end;
    const char *done = p;
    Event ev;
    if (!s->started && p < end) {
        if (end - p < 3 && !c->final && memcmp(p, "\xEF\xBB\xBF", (size_t)(end - p)) == 0) return 0;
        if (end - p >= 3 && memcmp(p, "\xEF\xBB\xBF", 3) == 0) p += 3; /* a UTF-8 byte-order mark */
        s->started = 1;
        done = p;
    }
    for (;;) {
        p = skip_ws(p, end);
        done = p; /* state and position are committed together */
        if (p >= end) {
            if (c->final && s->state != S_END) {
                fail(c, EJSON, p, s->state == S_START ? "empty document" : "truncated: the document ends early");
                return -1;
            }
            return done - c->base;
        }
        switch (s->state) {
        case S_START:
            if (*p != '{') {
                if (*p == '[' || *p == '"' || *p == '-' || is_digit(*p) || *p == 't' || *p == 'f' || *p == 'n') {
                    const char *q = skip_value(c, p);
                    if (!q) return -1;
                    fail(c, ETYPE, p, "the top level is not a JSON object");
                } else {
                    fail(c, EJSON, p, "invalid character");
                }
                return -1;
            }
            p++;
            s->state = S_KEY_FIRST;
            break;
        case S_KEY_FIRST:
        case S_KEY: {
            if (*p == '}' && s->state == S_KEY_FIRST) {
                p++;
                s->state = S_END;
                break;
            }
            const char *k;
            size_t kn;
            const char *q = read_key(c, p, &k, &kn);
            if (!q) return c->st == NEED ? done - c->base : -1;
            if (KEY_IS(k, kn, "traceEvents")) {
                if (q >= end) {
                    if (need(c, q), c->st == NEED) return done - c->base;
                    return -1;
                }
                if (*q != '[') {
                    const char *r = skip_value(c, q);
                    if (!r) return c->st == NEED ? done - c->base : -1;
                    fail(c, ETYPE, q, "no traceEvents array");
                    return -1;
                }
                if (s->event_keys) reset_tables(s); /* a repeated key: the last one counts */
                s->event_keys++;
                p = q + 1;
                s->state = S_EV_FIRST;
                break;
            }
            int ascii = 1; /* only ASCII keys can name a field of the trace: others are skipped */
            for (size_t i = 0; i < kn; i++)
                if ((unsigned char)k[i] >= 0x80) ascii = 0;
            /* keep k: copy it, since skipping may not touch scratch but decoding others would */
            char kbuf[64];
            char *kcopy = kn <= sizeof kbuf ? kbuf : malloc(kn ? kn : 1);
            if (!kcopy) {
                fail(c, EMEM, p, NULL);
                return -1;
            }
            memcpy(kcopy, k, kn);
            const char *r = skip_value(c, q);
            if (!r) {
                if (kcopy != kbuf) free(kcopy);
                return c->st == NEED ? done - c->base : -1;
            }
            int rc = ascii ? store_meta(c, kcopy, kn, q, r) : 0;
            if (kcopy != kbuf) free(kcopy);
            if (rc < 0) {
                c->st = EPY;
                return -1;
            }
            p = r;
            s->state = S_AFTER_VALUE;
            break;
        }
        case S_AFTER_VALUE:
            if (*p == ',') {
                p++;
                s->state = S_KEY;
            } else if (*p == '}') {
                p++;
                s->state = S_END;
            } else {
                fail(c, EJSON, p, "expected ',' or '}'");
                return -1;
            }
            break;
        case S_EV_FIRST:
            if (*p == ']') {
                p++;
                s->state = S_AFTER_VALUE;
                break;
            }
            s->state = S_EV_VALUE;
            break;
        case S_EV_NEXT:
            if (*p == ']') {
                p++;
                s->state = S_AFTER_VALUE;
            } else if (*p == ',') {
                p++;
                s->state = S_EV_VALUE;
            } else {
                fail(c, EJSON, p, "expected ',' or ']'");
                return -1;
            }
            break;
        case S_EV_VALUE: {
            int is_obj;
            const char *q = read_event(c, p, &ev, &is_obj);
            if (!q) return c->st == NEED ? done - c->base : -1;
            if (!is_obj) s->drop_not_object++;
            else if (add_event(c, &ev, p) < 0) return -1;
            s->n_events++;
            p = q;
            s->state = S_EV_NEXT;
            break;
        }
        case S_END:
            fail(c, EJSON, p, "trailing characters after the document");
            return -1;
        }
    }
}

/* ------------------------------------------------------------------------------------------- */
/* Python interface */

static PyObject *ScanError; /* (kind, message): kind 'json' or 'type' */

static int Scanner_init(Scanner *self, PyObject *args, PyObject *kw) {
    PyObject *route, *kinds, *gpu = NULL, *name_filter = NULL;
    int inside = 0;
    unsigned long long offset = 0;
    static char *kwlist[] = {"kinds", "route", "gpu_kinds", "name_filter", "inside_events", "offset", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|OOpK", kwlist, &kinds, &route, &gpu, &name_filter, &inside,
                                     &offset))
        return -1;
    if (inside) { /* as if '{"traceEvents": [' and entries up to this one had been read */
        self->started = 1;
        self->state = S_EV_VALUE;
        self->event_keys = 1;
        self->inside = 1;
        self->offset = offset;
    }
    if (name_filter == Py_None) name_filter = NULL;
    if (name_filter && !PyCallable_Check(name_filter)) {
        PyErr_SetString(PyExc_TypeError, "name_filter must be callable");
        return -1;
    }
    Py_XINCREF(name_filter);
    Py_XSETREF(self->name_filter, name_filter);
    self->gpu_kinds = 0;
    if (gpu) {
        PyObject *g = PySequence_Fast(gpu, "gpu_kinds must be a sequence");
        if (!g) return -1;
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(g); i++) {
            long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(g, i));
            if (v < 0 || v >= MAX_KINDS) {
                Py_DECREF(g);
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "gpu_kinds: a kind index");
                return -1;
            }
            self->gpu_kinds |= 1u << v;
        }
        Py_DECREF(g);
    }
    if (!PyCallable_Check(route)) {
        PyErr_SetString(PyExc_TypeError, "route must be callable");
        return -1;
    }
    /* kinds: a sequence of sequences of column names, one per kind */
    PyObject *seq = PySequence_Fast(kinds, "kinds must be a sequence");
    if (!seq) return -1;
    Py_ssize_t nk = PySequence_Fast_GET_SIZE(seq);
    if (nk > MAX_KINDS) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "too many kinds");
        return -1;
    }
    for (Py_ssize_t i = 0; i < nk; i++) {
        PyObject *cols = PySequence_Fast(PySequence_Fast_GET_ITEM(seq, i), "columns must be a sequence");
        if (!cols) {
            Py_DECREF(seq);
            return -1;
        }
        uint32_t mask = 0;
        for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(cols); j++) {
            const char *name = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(cols, j));
            if (!name) {
                Py_DECREF(cols);
                Py_DECREF(seq);
                return -1;
            }
            int found = -1;
            for (int k = 0; k < NCOLS; k++)
                if (strcmp(name, COL_NAMES[k]) == 0) found = k;
            if (found < 0) {
                PyErr_Format(PyExc_ValueError, "unknown column %s", name);
                Py_DECREF(cols);
                Py_DECREF(seq);
                return -1;
            }
            mask |= 1u << found;
        }
        Py_DECREF(cols);
        self->kinds[i].mask = mask;
    }
    Py_DECREF(seq);
    self->nkinds = (int)nk;
    Py_INCREF(route);
    Py_XSETREF(self->route, route);
    Py_XSETREF(self->meta, PyDict_New());
    if (!self->meta) return -1;
    return 0;
}

static void Scanner_clear(Scanner *self) {
    for (int k = 0; k < MAX_KINDS; k++) {
        Kind *kd = &self->kinds[k];
        for (int col = 0; col < NCOLS; col++) buf_free(&kd->cols[col]);
        buf_free(&kd->tid_rows);
        buf_free(&kd->tid_strs);
        kd->rows = 0;
    }
    intern_free(&self->strs);
    intern_free(&self->raws);
    intern_free(&self->cats);
    buf_free(&self->cat_route);
    buf_free(&self->scratch);
    buf_free(&self->carry);
    buf_free(&self->name_ok);
}

static void Scanner_dealloc(Scanner *self) {
    Scanner_clear(self);
    Py_XDECREF(self->route);
    Py_XDECREF(self->name_filter);
    Py_XDECREF(self->meta);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *raise_scan(const char *kind, const char *msg) {
    PyObject *v = Py_BuildValue("(ss)", kind, msg);
    if (v) {
        PyErr_SetObject(ScanError, v);
        Py_DECREF(v);
    }
    return NULL;
}

/* scan [p, p + n); the bytes consumed, or -1 with the error in c */
static Py_ssize_t scan_at(Scanner *self, Ctx *c, const char *p, size_t n, int final) {
    c->base = p;
    c->end = p + n;
    c->final = final;
    c->st = OK;
    Py_ssize_t k = scan(c);
    if (k > 0) self->offset += (uint64_t)k;
    return k;
}

/* feed(data, final=False): scan what data completes. A unit cut by the end of data is kept (copied)
 * and completed by the next call. */
static PyObject *Scanner_feed(Scanner *self, PyObject *args, PyObject *kw) {
    Py_buffer view;
    int final = 0;
    static char *kwlist[] = {"data", "final", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*|p", kwlist, &view, &final)) return NULL;
    if (self->busy || self->err_kind || self->finished) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_RuntimeError, self->busy ? "feed is already running"
                                            : self->err_kind ? "the scanner stopped at an error"
                                                             : "the document was already finished");
        return NULL;
    }
    self->busy = 1;
    Ctx c;
    memset(&c, 0, sizeof c);
    c.s = self;
    const char *data = view.buf;
    size_t len = (size_t)view.len, pos = 0;
    Buf *carry = &self->carry;
    Py_ssize_t k = 0;
    c.ts = PyEval_SaveThread();
    /* 1. complete the unit kept from the previous call, appending data in growing steps */
    size_t step = 4096;
    while (carry->n && (pos < len || final)) {
        size_t take = len - pos < step ? len - pos : step;
        size_t old = carry->n;
        if (buf_put(carry, data + pos, take) < 0) {
            c.st = EMEM;
            k = -1;
            break;
        }
        pos += take;
        int last = final && pos == len;
        if (!last && carry->n < self->retry_at) continue; /* not enough new text to try again */
        k = scan_at(self, &c, carry->p, carry->n, last);
        if (k < 0) break;
        if (last) { /* the final scan reads to the end or fails */
            carry->n = 0;
            break;
        }
        if ((size_t)k >= old) { /* the kept unit is complete: go on in data itself */
            size_t rest = carry->n - (size_t)k; /* unconsumed bytes, all from data (rest <= take) */
            pos -= rest;
            carry->n = 0;
            self->retry_at = 0;
            break;
        }
        memmove(carry->p, carry->p + k, carry->n - (size_t)k);
        carry->n -= (size_t)k;
        self->retry_at = carry->n * 2;
        step *= 2;
    }
    /* 2. the rest of data */
    if (k >= 0 && !carry->n && (pos < len || final)) {
        k = scan_at(self, &c, data + pos, len - pos, final);
        if (k >= 0 && (size_t)k < len - pos) {
            if (buf_put(carry, data + pos + k, len - pos - (size_t)k) < 0) {
                c.st = EMEM;
                k = -1;
            } else {
                self->retry_at = carry->n * 2;
            }
        }
    }
    PyEval_RestoreThread(c.ts);
    self->busy = 0;
    PyBuffer_Release(&view);
    if (k < 0) {
        self->err_kind = c.st == EJSON ? 1 : c.st == ETYPE ? 2 : c.st == EMEM ? 3 : 4;
        if (c.st == EPY) return NULL;
        if (c.st == EMEM) return PyErr_NoMemory();
        return raise_scan(c.st == EJSON ? "json" : "type", c.msg);
    }
    if (final) self->finished = 1;
    Py_RETURN_NONE;
}

/* A column handed to Python: it owns the scanner's buffer (no copy: a 1 GB trace's columns are about
 * 100 MB, and copying them meant faulting in as much fresh memory again) and exposes it, writable,
 * through the buffer protocol (numpy.frombuffer, memoryview, os.write). */
typedef struct {
    PyObject_HEAD
    char *p;
    Py_ssize_t n;
} Column;

static char column_empty[1];

static int Column_getbuffer(PyObject *o, Py_buffer *view, int flags) {
    Column *self = (Column *)o;
    return PyBuffer_FillInfo(view, o, self->p ? self->p : column_empty, self->n, 0, flags);
}

static void Column_dealloc(PyObject *o) {
    Column *self = (Column *)o;
    free(self->p);
    Py_TYPE(o)->tp_free(o);
}

static Py_ssize_t Column_length(PyObject *o) { return ((Column *)o)->n; }

static PyBufferProcs Column_as_buffer = {Column_getbuffer, NULL};
static PySequenceMethods Column_as_sequence = {Column_length};

static PyTypeObject ColumnType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "traceinspect.load._kineto_scan.Column",
    .tp_basicsize = sizeof(Column),
    .tp_dealloc = Column_dealloc,
    .tp_as_sequence = &Column_as_sequence,
    .tp_as_buffer = &Column_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A column of the scanner's result: its bytes, through the buffer protocol.",
};

/* the buffer as a Column, which takes it over (cut to its length); the Buf is left empty */
static PyObject *bytes_of(Buf *b) {
    Column *c = PyObject_New(Column, &ColumnType);
    if (!c) return NULL;
    c->p = NULL;
    c->n = (Py_ssize_t)b->n;
    if (b->n) {
        char *q = realloc(b->p, b->n); /* (a shrink: in place) */
        c->p = q ? q : b->p;
    } else {
        free(b->p);
    }
    b->p = NULL;
    b->n = b->cap = 0;
    return (PyObject *)c;
}

static PyObject *table_list(Intern *t, int as_str) {
    PyObject *list = PyList_New((Py_ssize_t)t->count);
    if (!list) return NULL;
    const size_t *offs = (const size_t *)t->offs.p;
    const uint32_t *lens = (const uint32_t *)t->lens.p;
    for (size_t k = 0; k < t->count; k++) {
        const char *s = t->arena.p ? t->arena.p + offs[k] : ""; /* only empty texts: no arena */
        PyObject *o;
        if (as_str) {
            o = PyUnicode_DecodeUTF8(s, (Py_ssize_t)lens[k], "strict");
            if (o) PyUnicode_InternInPlace(&o);
        } else {
            o = PyBytes_FromStringAndSize(s, (Py_ssize_t)lens[k]);
        }
        if (!o) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)k, o);
    }
    return list;
}

/* result() -> dict: n_events, strings, raws, meta, kinds: [{column: Column, ...,
 * 'rows': n, 'tid_rows': Column, 'tid_strs': Column}] (the columns leave the scanner) */
static PyObject *Scanner_result(Scanner *self, PyObject *Py_UNUSED(ignored)) {
    if (self->state != S_END || self->err_kind || !self->finished || self->joined) {
        PyErr_SetString(PyExc_RuntimeError, self->joined ? "its tables were joined to another scanner"
                                                         : "the document was not scanned to its end");
        return NULL;
    }
    PyObject *out = PyDict_New(), *kinds = NULL, *o = NULL;
    if (!out) return NULL;
#define SET(d, k, v)                                                  \
    do {                                                              \
        o = (v);                                                      \
        if (!o || PyDict_SetItemString((d), (k), o) < 0) goto error; \
        Py_CLEAR(o);                                                  \
    } while (0)
    SET(out, "n_events", PyLong_FromUnsignedLongLong(self->n_events));
    SET(out, "events_seen", PyBool_FromLong(self->event_keys > 0));
    o = Py_BuildValue("{sKsK}", "name", (unsigned long long)self->drop_name, "not_object",
                      (unsigned long long)self->drop_not_object);
    if (!o || PyDict_SetItemString(out, "drops", o) < 0) goto error;
    Py_CLEAR(o);
    SET(out, "gpu_dropped", PyLong_FromUnsignedLongLong(self->drop_gpu));
    SET(out, "strings", table_list(&self->strs, 1));
    SET(out, "raws", table_list(&self->raws, 0));
    Py_INCREF(self->meta);
    SET(out, "meta", self->meta);
    kinds = PyList_New(self->nkinds);
    if (!kinds) goto error;
    for (int k = 0; k < self->nkinds; k++) {
        Kind *kd = &self->kinds[k];
        PyObject *d = PyDict_New();
        if (!d) goto error;
        PyList_SET_ITEM(kinds, k, d);
        SET(d, "rows", PyLong_FromSize_t(kd->rows));
        for (int col = 0; col < NCOLS; col++)
            if (kd->mask & (1u << col)) SET(d, COL_NAMES[col], bytes_of(&kd->cols[col]));
        SET(d, "tid_rows", bytes_of(&kd->tid_rows));
        SET(d, "tid_strs", bytes_of(&kd->tid_strs));
    }
    SET(out, "kinds", kinds);
    kinds = NULL;
    Scanner_clear(self); /* the columns now live in the result */
    return out;
error:
    Py_XDECREF(o);
    Py_XDECREF(kinds);
    Py_DECREF(out);
    return NULL;
#undef SET
}

static PyObject *col_types(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a)) {
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    for (int k = 0; k < NCOLS; k++) {
        char t[2] = {COL_TYPE[k], 0};
        PyObject *v = PyUnicode_FromString(t);
        if (!v || PyDict_SetItemString(d, COL_NAMES[k], v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(v);
    }
    return d;
}

static PyTypeObject ScannerType;

/* at_event_boundary() -> bool: the text fed so far ended between two entries of traceEvents, after the
 * ',' (and the space after it), with nothing kept of a unit cut short: a scanner begun with
 * inside_events on the rest of the document can be joined to this one */
static int at_boundary(Scanner *s) {
    return !s->busy && !s->err_kind && !s->finished && s->state == S_EV_VALUE && s->carry.n == 0 && s->started;
}

static PyObject *Scanner_at_event_boundary(Scanner *self, PyObject *Py_UNUSED(ignored)) {
    return PyBool_FromLong(at_boundary(self));
}

/* the entry of t equal to entry k of u, added when new; the indices of u's entries in t go to map */
static int intern_map(Intern *t, Intern *u, int32_t **map) {
    *map = malloc((u->count ? u->count : 1) * sizeof(int32_t));
    if (!*map) return -1;
    const size_t *offs = (const size_t *)u->offs.p;
    const uint32_t *lens = (const uint32_t *)u->lens.p;
    for (size_t k = 0; k < u->count; k++) {
        int64_t v = intern_get(t, u->arena.p ? u->arena.p + offs[k] : "", lens[k]);
        if (v < 0) return -1;
        (*map)[k] = (int32_t)v;
    }
    return 0;
}

/* dst += src with each int32 index i of src as map[i] (negative: kept, an absent value) */
static int put_mapped(Buf *dst, const Buf *src, const int32_t *map, size_t nmap) {
    size_t n = src->n / sizeof(int32_t);
    if (buf_reserve(dst, n * sizeof(int32_t)) < 0) return -1;
    int32_t *out = (int32_t *)(dst->p + dst->n);
    for (size_t j = 0; j < n; j++) {
        int32_t v;
        memcpy(&v, src->p + j * sizeof v, sizeof v);
        if (v >= 0) {
            if ((size_t)v >= nmap) return -2;
            v = map[v];
        }
        memcpy(out + j, &v, sizeof v);
    }
    dst->n += n * sizeof(int32_t);
    return 0;
}

/* join(other): the events of other, a scanner begun with inside_events where this one's text ended
 * (at_event_boundary) and fed the rest of the document to its end, appended to this one's tables as if
 * this one had read that text itself: the strings and raw texts other met first are added in its order,
 * its columns re-indexed (and freed), its counts and top-level keys added. This scanner is then
 * finished; other gives no result of its own. */
static PyObject *Scanner_join(Scanner *self, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, &ScannerType) || arg == (PyObject *)self) {
        PyErr_SetString(PyExc_TypeError, "join: another Scanner");
        return NULL;
    }
    Scanner *o = (Scanner *)arg;
    int same = o->nkinds == self->nkinds;
    for (int k = 0; same && k < self->nkinds; k++) same = self->kinds[k].mask == o->kinds[k].mask;
    if (!at_boundary(self) || !o->inside || o->joined || o->busy || o->err_kind || !o->finished || o->state != S_END ||
        o->event_keys != 1 || !same) {
        PyErr_SetString(PyExc_ValueError, "join: this scanner is not between two events, or the other did not "
                                          "scan the rest of the same kind of document to its end");
        return NULL;
    }
    int32_t *smap = NULL, *rmap = NULL;
    int rc = intern_map(&self->strs, &o->strs, &smap);
    if (rc == 0) rc = intern_map(&self->raws, &o->raws, &rmap);
    for (int k = 0; rc == 0 && k < self->nkinds; k++) {
        Kind *a = &self->kinds[k], *b = &o->kinds[k];
        for (int col = 0; rc == 0 && col < NCOLS; col++) {
            if (!(a->mask & (1u << col))) continue;
            char t = COL_TYPE[col];
            if (t == 's') rc = put_mapped(&a->cols[col], &b->cols[col], smap, o->strs.count);
            else if (t == 'r') rc = put_mapped(&a->cols[col], &b->cols[col], rmap, o->raws.count);
            else rc = buf_put(&a->cols[col], b->cols[col].p, b->cols[col].n);
            buf_free(&b->cols[col]); /* (freed as it goes: the peak is not both whole sets of columns) */
        }
        size_t nt = b->tid_rows.n / sizeof(int64_t);
        if (rc == 0 && buf_reserve(&a->tid_rows, nt * sizeof(int64_t)) < 0) rc = -1;
        for (size_t j = 0; rc == 0 && j < nt; j++) {
            int64_t r;
            memcpy(&r, b->tid_rows.p + j * sizeof r, sizeof r);
            r += (int64_t)a->rows;
            memcpy(a->tid_rows.p + a->tid_rows.n, &r, sizeof r);
            a->tid_rows.n += sizeof r;
        }
        if (rc == 0) rc = put_mapped(&a->tid_strs, &b->tid_strs, smap, o->strs.count);
        if (rc == 0) a->rows += b->rows;
    }
    free(smap);
    free(rmap);
    o->joined = 1;
    if (rc == 0 && PyDict_Update(self->meta, o->meta) < 0) rc = -3;
    if (rc != 0) {
        self->err_kind = 3; /* half joined: this scanner is of no further use */
        if (rc == -2) PyErr_SetString(PyExc_SystemError, "join: an index out of its table");
        else if (rc == -1) PyErr_NoMemory();
        return NULL;
    }
    self->n_events += o->n_events;
    self->drop_name += o->drop_name;
    self->drop_not_object += o->drop_not_object;
    self->drop_gpu += o->drop_gpu;
    self->offset = o->offset;
    self->state = S_END;
    self->finished = 1;
    Py_RETURN_NONE;
}

static PyMethodDef Scanner_methods[] = {
    {"at_event_boundary", (PyCFunction)Scanner_at_event_boundary, METH_NOARGS,
     "whether the text fed so far ended between two entries of traceEvents, nothing kept"},
    {"join", (PyCFunction)Scanner_join, METH_O,
     "join(other): append the events of a scanner begun inside_events where this one ended"},
    {"feed", (PyCFunction)(void (*)(void))Scanner_feed, METH_VARARGS | METH_KEYWORDS,
     "feed(data, final=False) -> number of bytes consumed (whole units only)"},
    {"result", (PyCFunction)Scanner_result, METH_NOARGS, "the columns, once the document is complete"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ScannerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "traceinspect.load._kineto_scan.Scanner",
    .tp_basicsize = sizeof(Scanner),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Scanner(kinds, route): columns of the events of one Kineto JSON document",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Scanner_init,
    .tp_dealloc = (destructor)Scanner_dealloc,
    .tp_methods = Scanner_methods,
};

/* factorize(list) -> (codes: bytearray of int64, uniques: list): codes in order of first appearance,
 * equal values (hash and ==, as a dict has them) sharing one code.
 *
 * A column's values are mostly a few objects repeated (the tables' strings are made once per distinct
 * text), so each object seen is remembered by its address first: the same object is the same dict key,
 * and the dict (hash, then ==) is asked only for objects not met before. The list holds every item for
 * the whole call, so no address is reused meanwhile. The address table stops growing at ID_MAX objects,
 * and is no longer asked once it is full while most values so far were new objects (a column of mostly
 * distinct objects gains nothing from it). */
typedef struct {
    PyObject *key;
    int64_t code;
} IdSlot;

#define ID_MAX (1 << 16)

static inline size_t id_slot(const PyObject *v, size_t mask) {
    uint64_t h = (uint64_t)(uintptr_t)v;
    h ^= h >> 29;
    h *= 0x9E3779B97F4A7C15ULL;
    return (size_t)(h >> 32) & mask;
}

static int id_grow(IdSlot **tab, size_t *cap) {
    size_t ncap = *cap * 2, nmask = ncap - 1;
    IdSlot *nt = (IdSlot *)calloc(ncap, sizeof(IdSlot));
    if (!nt) return -1;
    for (size_t i = 0; i < *cap; i++) {
        PyObject *k = (*tab)[i].key;
        if (!k) continue;
        size_t j = id_slot(k, nmask);
        while (nt[j].key) j = (j + 1) & nmask;
        nt[j] = (*tab)[i];
    }
    free(*tab);
    *tab = nt;
    *cap = ncap;
    return 0;
}

static PyObject *factorize(PyObject *Py_UNUSED(m), PyObject *arg) {
    if (!PyList_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "factorize takes a list");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(arg);
    if (n > PY_SSIZE_T_MAX / 8) return PyErr_NoMemory();
    size_t cap = 256, used = 0;
    IdSlot *tab = (IdSlot *)calloc(cap, sizeof(IdSlot));
    PyObject *codes = PyByteArray_FromStringAndSize(NULL, n * 8);
    PyObject *seen = PyDict_New();
    PyObject *uniq = PyList_New(0);
    if (!tab) PyErr_NoMemory();
    if (!tab || !codes || !seen || !uniq) goto error;
    int64_t *out = (int64_t *)(void *)PyByteArray_AS_STRING(codes);
    PyObject *last = NULL;
    int64_t last_code = -1;
    int probe = 1;
    uint64_t hits = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyList_GET_ITEM(arg, i);
        if (v == last) { /* runs of one object: the same key */
            out[i] = last_code;
            continue;
        }
        size_t j = 0;
        if (probe) {
            j = id_slot(v, cap - 1);
            while (tab[j].key && tab[j].key != v) j = (j + 1) & (cap - 1);
        }
        int64_t code;
        if (probe && tab[j].key) {
            code = tab[j].code;
            hits++;
        } else {
            PyObject *c = PyDict_GetItemWithError(seen, v);
            if (c) {
                code = PyLong_AsLongLong(c);
            } else {
                if (PyErr_Occurred()) goto error;
                code = (int64_t)PyList_GET_SIZE(uniq);
                PyObject *k = PyLong_FromLongLong(code);
                if (!k) goto error;
                int rc = PyDict_SetItem(seen, v, k);
                Py_DECREF(k);
                if (rc < 0 || PyList_Append(uniq, v) < 0) goto error;
            }
            if (probe && used < ID_MAX) { /* remembered by address (j: the free slot the probe ended on) */
                tab[j].key = v;
                tab[j].code = code;
                if (++used * 2 > cap && id_grow(&tab, &cap) < 0) {
                    PyErr_NoMemory();
                    goto error;
                }
            } else if (probe && hits < (uint64_t)i / 2) {
                probe = 0; /* full, and most values were new objects: the dict alone from here */
            }
        }
        out[i] = code;
        last = v;
        last_code = code;
    }
    free(tab);
    Py_DECREF(seen);
    PyObject *res = PyTuple_Pack(2, codes, uniq);
    Py_DECREF(codes);
    Py_DECREF(uniq);
    return res;
error:
    free(tab);
    Py_XDECREF(codes);
    Py_XDECREF(seen);
    Py_XDECREF(uniq);
    return NULL;
}

/* nest_parents(key, ts, end) -> bytearray of int64: for ops sorted per thread by (ts, -dur) (key: the
 * thread, int64; ts, end: float64), the position of each op's innermost enclosing op, or -1: the nearest
 * earlier op of the same thread, walking up from the previous op through its enclosing ops, that has not
 * ended before this op starts. A NaN time encloses nothing. */
static PyObject *nest_parents(PyObject *Py_UNUSED(m), PyObject *args) {
    PyObject *ko, *to, *eo;
    if (!PyArg_ParseTuple(args, "OOO", &ko, &to, &eo)) return NULL;
    Py_buffer kb, tb, eb;
    if (PyObject_GetBuffer(ko, &kb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    if (PyObject_GetBuffer(to, &tb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&kb);
        return NULL;
    }
    if (PyObject_GetBuffer(eo, &eb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&kb);
        PyBuffer_Release(&tb);
        return NULL;
    }
    PyObject *res = NULL;
    Py_ssize_t n = kb.len / 8;
    if (kb.itemsize != 8 || tb.itemsize != 8 || eb.itemsize != 8 || !kb.format || !tb.format || !eb.format ||
        (kb.format[0] != 'l' && kb.format[0] != 'q') || tb.format[0] != 'd' || eb.format[0] != 'd' ||
        tb.len != kb.len || eb.len != kb.len) {
        PyErr_SetString(PyExc_TypeError, "nest_parents takes int64 keys and float64 ts and end of one length");
        goto done;
    }
    res = PyByteArray_FromStringAndSize(NULL, n * 8);
    if (!res) goto done;
    {
        const int64_t *key = (const int64_t *)kb.buf;
        const double *ts = (const double *)tb.buf, *end = (const double *)eb.buf;
        int64_t *par = (int64_t *)(void *)PyByteArray_AS_STRING(res);
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t c = -1;
            if (i > 0 && key[i] == key[i - 1]) {
                c = (int64_t)(i - 1);
                while (c >= 0 && !(end[c] >= ts[i])) c = par[c];
            }
            par[i] = c;
        }
        Py_END_ALLOW_THREADS
    }
done:
    PyBuffer_Release(&kb);
    PyBuffer_Release(&tb);
    PyBuffer_Release(&eb);
    return res;
}

/* the int64 or float64 contents of a C-contiguous buffer of 8-byte items; 0, or -1 with TypeError set */
static int buf8(PyObject *o, Py_buffer *b, char kind, const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *f = b->format ? b->format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@') f++;
    int ok = b->itemsize == 8 && b->ndim <= 1 && f[1] == '\0' &&
             (kind == 'd' ? f[0] == 'd' : (f[0] == 'l' || f[0] == 'q'));
    if (!ok) {
        PyBuffer_Release(b);
        PyErr_Format(PyExc_TypeError, "%s must be a buffer of %s", what,
                     kind == 'd' ? "float64" : "int64");
        return -1;
    }
    return 0;
}

/* critical_walk(order, bounds, g_inst, g_key, g_prev, g_xprev, g_launch, bind, last_op, g_start, g_end,
 *               h_wait, h_prev, h_waited, h_start, dur, r, (n_keys, comm, gap, launch, host),
 *               (by_stream, by_xstream, by_launch)) -> (sums, first, steps)
 * The walk back along a replay's critical path of Replayer._path (traceinspect/whatif/__init__.py),
 * step by step: ``order`` holds the ops grouped by step position (ascending within a group), ``bounds``
 * the groups' limits; each walk starts at the op of its group that ends last (the first one, a NaN end
 * counting as the latest, as numpy's argmax has it). Integer arrays are int64 (bind, h_waited: 0/1 as
 * int64), times float64; an index reads as Python reads it (-1: the last item). ``sums`` (float64 per
 * key) adds each key's values in the walk's order, ``first`` (int64 per key) numbers the keys in the
 * order the walk first touched them (-1: never), ``steps`` counts the walks. */
typedef struct {
    Py_buffer b;
    int held;
} CwBuf;

static int cw_index(int64_t i, Py_ssize_t n, int64_t *out) {
    if (i < 0) i += (int64_t)n;
    if (i < 0 || i >= (int64_t)n) {
        PyErr_SetString(PyExc_IndexError, "critical_walk: index out of range");
        return -1;
    }
    *out = i;
    return 0;
}

static PyObject *critical_walk(PyObject *Py_UNUSED(m), PyObject *args) {
    enum { ORDER, BOUNDS, G_INST, G_KEY, G_PREV, G_XPREV, G_LAUNCH, BIND, LAST_OP, G_START, G_END, H_WAIT,
           H_PREV, H_WAITED, H_START, DUR, R, NBUF };
    static const char kinds[NBUF] = {'q', 'q', 'q', 'q', 'q', 'q', 'q', 'q', 'q', 'd', 'd',
                                     'q', 'q', 'q', 'd', 'd', 'd'};
    static const char *names[NBUF] = {"order", "bounds", "g_inst", "g_key", "g_prev", "g_xprev", "g_launch",
                                      "bind", "last_op", "g_start", "g_end", "h_wait", "h_prev", "h_waited",
                                      "h_start", "dur", "r"};
    PyObject *o[NBUF];
    Py_ssize_t n_keys, k_comm, k_gap, k_launch, k_host, by_stream, by_xstream, by_launch;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOOOOOO(nnnnn)(nnn)", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5],
                          &o[6], &o[7], &o[8], &o[9], &o[10], &o[11], &o[12], &o[13], &o[14], &o[15], &o[16],
                          &n_keys, &k_comm, &k_gap, &k_launch, &k_host, &by_stream, &by_xstream, &by_launch))
        return NULL;
    CwBuf bufs[NBUF];
    for (int i = 0; i < NBUF; i++) bufs[i].held = 0;
    PyObject *res = NULL, *sums_o = NULL, *first_o = NULL;
    int64_t *mark = NULL;
    for (int i = 0; i < NBUF; i++) {
        if (buf8(o[i], &bufs[i].b, kinds[i], names[i]) < 0) goto done;
        bufs[i].held = 1;
    }
    if (n_keys <= 0 || n_keys > (PY_SSIZE_T_MAX / 8) || k_comm < 0 || k_comm >= n_keys || k_gap < 0 ||
        k_gap >= n_keys || k_launch < 0 || k_launch >= n_keys || k_host < 0 || k_host >= n_keys) {
        PyErr_SetString(PyExc_ValueError, "critical_walk: the fixed keys must lie in [0, n_keys)");
        goto done;
    }
#define CW_LEN(i) (bufs[i].b.len / 8)
#define CW_I(i) ((const int64_t *)bufs[i].b.buf)
#define CW_D(i) ((const double *)bufs[i].b.buf)
    {
        Py_ssize_t G = CW_LEN(G_INST), H = CW_LEN(H_WAIT), n_order = CW_LEN(ORDER), n_bounds = CW_LEN(BOUNDS);
        const int g_arrays[] = {G_KEY, G_PREV, G_XPREV, G_LAUNCH, BIND, LAST_OP, G_START, G_END, DUR};
        for (size_t i = 0; i < sizeof g_arrays / sizeof g_arrays[0]; i++) {
            if (CW_LEN(g_arrays[i]) != G) {
                PyErr_Format(PyExc_ValueError, "critical_walk: %s must have one item per op", names[g_arrays[i]]);
                goto done;
            }
        }
        if (CW_LEN(H_PREV) != H || CW_LEN(H_WAITED) != H || CW_LEN(H_START) != H || CW_LEN(R) != H) {
            PyErr_SetString(PyExc_ValueError, "critical_walk: the host arrays must have one length");
            goto done;
        }
        const int64_t *order = CW_I(ORDER), *bounds = CW_I(BOUNDS), *g_inst = CW_I(G_INST), *g_key = CW_I(G_KEY),
                      *g_prev = CW_I(G_PREV), *g_xprev = CW_I(G_XPREV), *g_launch = CW_I(G_LAUNCH),
                      *bind = CW_I(BIND), *last_op = CW_I(LAST_OP), *h_wait = CW_I(H_WAIT), *h_prev = CW_I(H_PREV),
                      *h_waited = CW_I(H_WAITED);
        const double *g_start = CW_D(G_START), *g_end = CW_D(G_END), *h_start = CW_D(H_START), *dur = CW_D(DUR),
                     *r = CW_D(R);
        for (Py_ssize_t i = 0; i < G; i++) {
            if (g_key[i] < 0 || g_key[i] >= n_keys) {
                PyErr_SetString(PyExc_ValueError, "critical_walk: an op's key lies outside [0, n_keys)");
                goto done;
            }
        }
        for (Py_ssize_t i = 0; i + 1 < n_bounds; i++) {
            if (bounds[i] < 0 || bounds[i] > bounds[i + 1] || bounds[i + 1] > n_order) {
                PyErr_SetString(PyExc_ValueError, "critical_walk: bounds must rise within the order");
                goto done;
            }
        }
        for (Py_ssize_t i = 0; i < n_order; i++) {
            if (order[i] < 0 || order[i] >= G) {
                PyErr_SetString(PyExc_ValueError, "critical_walk: order names an op outside the model");
                goto done;
            }
        }
        sums_o = PyByteArray_FromStringAndSize(NULL, n_keys * 8);
        first_o = PyByteArray_FromStringAndSize(NULL, n_keys * 8);
        mark = (int64_t *)PyMem_Malloc((size_t)(G > 0 ? G : 1) * 8);
        if (!sums_o || !first_o || !mark) {
            if (!mark) PyErr_NoMemory();
            goto done;
        }
        double *sums = (double *)(void *)PyByteArray_AS_STRING(sums_o);
        int64_t *first = (int64_t *)(void *)PyByteArray_AS_STRING(first_o);
        for (Py_ssize_t k = 0; k < n_keys; k++) {
            sums[k] = 0.0;
            first[k] = -1;
        }
        for (Py_ssize_t i = 0; i < G; i++) mark[i] = -1;
        int64_t touched = 0, steps = 0;
#define CW_ADD(key, v)                          \
    do {                                        \
        if (first[key] < 0) first[key] = touched++; \
        sums[key] += (v);                       \
    } while (0)
#define CW_AT(i, n, out) \
    if (cw_index((i), (n), &(out)) < 0) goto done
#define CW_POS(x) ((0.0 > (x)) ? 0.0 : (x)) /* max(x, 0.0) as Python has it (NaN and -0.0 pass) */
        for (Py_ssize_t g = 0; g + 1 < n_bounds; g++) {
            int64_t lo = bounds[g], hi = bounds[g + 1];
            if (lo == hi) continue;
            int64_t cur = order[lo];
            for (int64_t j = lo + 1; j < hi && g_end[cur] == g_end[cur]; j++) {
                int64_t i = order[j];
                if (g_end[i] != g_end[i] || g_end[i] > g_end[cur]) cur = i;
            }
            steps++;
            while (cur >= 0) {
                if (cur >= G) {
                    PyErr_SetString(PyExc_IndexError, "critical_walk: index out of range");
                    goto done;
                }
                if (mark[cur] == g) break; /* met again on this walk: a cycle */
                mark[cur] = g;
                if (g_inst[cur] >= 0) {
                    int64_t last;
                    CW_AT(last_op[cur], G, last);
                    CW_ADD(k_comm, g_end[cur] - g_start[last]);
                    cur = last;
                } else {
                    CW_ADD(g_key[cur], dur[cur]);
                }
                int64_t how = bind[cur];
                if (how == by_stream) {
                    int64_t pv;
                    CW_AT(g_prev[cur], G, pv);
                    CW_ADD(k_gap, CW_POS(g_start[cur] - g_end[pv]));
                    cur = g_prev[cur];
                } else if (how == by_xstream) {
                    cur = g_xprev[cur];
                } else if (how == by_launch && g_launch[cur] >= 0) {
                    int64_t h;
                    CW_AT(g_launch[cur], H, h);
                    CW_ADD(k_launch, CW_POS(g_start[cur] - h_start[h]));
                    cur = -1;
                    for (Py_ssize_t guard = 0; h >= 0; guard++) {
                        if (guard > H) {
                            PyErr_SetString(PyExc_ValueError, "critical_walk: the host calls' links form a cycle");
                            goto done;
                        }
                        if (h_waited[h] && h_wait[h] >= 0) {
                            CW_ADD(k_host, r[h]);
                            cur = h_wait[h];
                            break;
                        }
                        int64_t pv = h_prev[h];
                        if (pv < 0) break;
                        CW_AT(pv, H, pv);
                        CW_ADD(k_host, CW_POS(h_start[h] - h_start[pv]));
                        h = pv;
                    }
                } else {
                    cur = -1;
                }
            }
        }
#undef CW_ADD
#undef CW_AT
#undef CW_POS
        res = Py_BuildValue("(OOL)", sums_o, first_o, (long long)steps);
    }
#undef CW_LEN
#undef CW_I
#undef CW_D
done:
    for (int i = 0; i < NBUF; i++)
        if (bufs[i].held) PyBuffer_Release(&bufs[i].b);
    Py_XDECREF(sums_o);
    Py_XDECREF(first_o);
    PyMem_Free(mark);
    return res;
}

/* longest_path(n, weight, src, dst, source, sink) -> bytearray of int64 node ids, or None when the graph
 * has a cycle. A node-weighted DAG given by its edges (src[i], dst[i]); a path's length is the sum of the
 * weights of its nodes but the last. Exactly _longest_path of traceinspect/measure/critical_path.py: a
 * repeated edge counts once, in its first position; nodes without successors (but the sink) lead to the
 * sink, nodes without predecessors (but the source) come from the source, those links after the given
 * edges; topological order by generations; each node's first best predecessor in edge order; the first
 * farthest node in topological order. */
static PyObject *longest_path(PyObject *Py_UNUSED(m), PyObject *args) {
    Py_ssize_t n, source, sink;
    PyObject *wo, *so, *dobj;
    if (!PyArg_ParseTuple(args, "nOOOnn", &n, &wo, &so, &dobj, &source, &sink)) return NULL;
    if (n <= 0 || source < 0 || source >= n || sink < 0 || sink >= n) {
        PyErr_SetString(PyExc_ValueError, "longest_path needs n > 0 and source and sink in [0, n)");
        return NULL;
    }
    if (n > (PY_SSIZE_T_MAX / 8) / 8) return PyErr_NoMemory();
    Py_buffer wb, sb, db;
    if (buf8(wo, &wb, 'd', "weight") < 0) return NULL;
    if (buf8(so, &sb, 'q', "src") < 0) {
        PyBuffer_Release(&wb);
        return NULL;
    }
    if (buf8(dobj, &db, 'q', "dst") < 0) {
        PyBuffer_Release(&wb);
        PyBuffer_Release(&sb);
        return NULL;
    }
    PyObject *res = NULL;
    Py_ssize_t m = sb.len / 8;
    /* the working arrays, one block: everything below is bounded by n + m + 2n extra links */
    int64_t *mem = NULL;
    if (wb.len / 8 != n || db.len != sb.len) {
        PyErr_SetString(PyExc_ValueError, "longest_path: weight must have n items and src and dst one length");
        goto done;
    }
    const int64_t *src = (const int64_t *)sb.buf, *dst = (const int64_t *)db.buf;
    for (Py_ssize_t i = 0; i < m; i++) {
        if (src[i] < 0 || src[i] >= n || dst[i] < 0 || dst[i] >= n) {
            PyErr_Format(PyExc_ValueError, "longest_path: edge %zd names a node outside [0, %zd)", i, n);
            goto done;
        }
    }
    if (m > (PY_SSIZE_T_MAX / 8 - 16 * n) / 8) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t me = m + 2 * n; /* edges with the source and sink links */
    /* eu, ev: kept edges; soff/succ, poff/pred: CSR; indeg, order, back, mark: per node; dist: doubles */
    size_t words = (size_t)(2 * me + (n + 1) + me + (n + 1) + me + 4 * n + n);
    mem = PyMem_Malloc(words * 8 + 8);
    if (!mem) {
        PyErr_NoMemory();
        goto done;
    }
    int cycle = 0;
    {
        const double *w = (const double *)wb.buf;
        int64_t *eu = mem, *ev = eu + me, *soff = ev + me, *succ = soff + n + 1, *poff = succ + me,
                *pred = poff + n + 1, *indeg = pred + me, *order = indeg + n, *back = order + n, *mark = back + n;
        double *dist = (double *)(void *)(mark + n);
        Py_ssize_t k = 0;
        Py_BEGIN_ALLOW_THREADS
        /* a repeated edge counts once, in its first position: bucket edge positions by source (stable),
         * then drop a source's later edges to a head it already has */
        for (Py_ssize_t v = 0; v <= n; v++) soff[v] = 0;
        for (Py_ssize_t i = 0; i < m; i++) soff[src[i] + 1]++;
        for (Py_ssize_t v = 0; v < n; v++) soff[v + 1] += soff[v];
        for (Py_ssize_t v = 0; v < n; v++) indeg[v] = soff[v]; /* fill cursor */
        for (Py_ssize_t i = 0; i < m; i++) succ[indeg[src[i]]++] = (int64_t)i;
        for (Py_ssize_t v = 0; v < n; v++) mark[v] = -1;
        for (Py_ssize_t v = 0; v < m; v++) pred[v] = 0; /* keep flags by edge position */
        for (Py_ssize_t u = 0; u < n; u++) {
            for (int64_t q = soff[u]; q < soff[u + 1]; q++) {
                int64_t i = succ[q];
                if (mark[dst[i]] != u) {
                    mark[dst[i]] = u;
                    pred[i] = 1;
                }
            }
        }
        for (Py_ssize_t i = 0; i < m; i++) {
            if (pred[i]) {
                eu[k] = src[i];
                ev[k] = dst[i];
                k++;
            }
        }
        /* links: nodes without successors to the sink, then the source to nodes without predecessors;
         * (source, sink) can be both, and counts once */
        for (Py_ssize_t v = 0; v < n; v++) indeg[v] = 0, mark[v] = 0;
        for (Py_ssize_t i = 0; i < k; i++) mark[eu[i]] = 1, indeg[ev[i]] = 1;
        int src_sink = 0;
        for (Py_ssize_t u = 0; u < n; u++) {
            if (!mark[u] && u != sink) {
                eu[k] = u, ev[k] = sink, k++;
                if (u == source) src_sink = 1;
            }
        }
        for (Py_ssize_t v = 0; v < n; v++) {
            if (!indeg[v] && v != source && !(v == sink && src_sink)) eu[k] = source, ev[k] = v, k++;
        }
        /* CSR of successors and predecessors, each in edge order */
        for (Py_ssize_t v = 0; v <= n; v++) soff[v] = 0, poff[v] = 0;
        for (Py_ssize_t i = 0; i < k; i++) soff[eu[i] + 1]++, poff[ev[i] + 1]++;
        for (Py_ssize_t v = 0; v < n; v++) soff[v + 1] += soff[v], poff[v + 1] += poff[v];
        for (Py_ssize_t v = 0; v < n; v++) mark[v] = soff[v], back[v] = poff[v];
        for (Py_ssize_t i = 0; i < k; i++) {
            succ[mark[eu[i]]++] = ev[i];
            pred[back[ev[i]]++] = eu[i];
        }
        /* topological order by generations: a FIFO queue visits them in the same order */
        Py_ssize_t head = 0, tail = 0;
        for (Py_ssize_t v = 0; v < n; v++) {
            indeg[v] = poff[v + 1] - poff[v];
            if (!indeg[v]) order[tail++] = v;
        }
        while (head < tail) {
            int64_t u = order[head++];
            for (int64_t q = soff[u]; q < soff[u + 1]; q++) {
                if (!--indeg[succ[q]]) order[tail++] = succ[q];
            }
        }
        if (tail != n) {
            cycle = 1;
        } else {
            for (Py_ssize_t v = 0; v < n; v++) dist[v] = 0.0, back[v] = v;
            for (Py_ssize_t t = 0; t < n; t++) {
                int64_t v = order[t], arg = v;
                double best = -1.0;
                for (int64_t q = poff[v]; q < poff[v + 1]; q++) {
                    double d = dist[pred[q]] + w[pred[q]];
                    if (d > best) best = d, arg = pred[q];
                }
                if (best >= 0) dist[v] = best, back[v] = arg;
            }
            double far = dist[0];
            for (Py_ssize_t v = 1; v < n; v++) if (dist[v] > far) far = dist[v];
            int64_t v = order[0];
            for (Py_ssize_t t = 0; t < n; t++) {
                if (dist[order[t]] == far) {
                    v = order[t];
                    break;
                }
            }
            /* the path, reversed into mark */
            Py_ssize_t len = 0;
            mark[len++] = v;
            while (back[v] != v && len < n) v = back[v], mark[len++] = v;
            for (Py_ssize_t i = 0; i < len / 2; i++) {
                int64_t x = mark[i];
                mark[i] = mark[len - 1 - i], mark[len - 1 - i] = x;
            }
            k = len;
        }
        Py_END_ALLOW_THREADS
        if (cycle) {
            res = Py_None;
            Py_INCREF(res);
        } else {
            res = PyByteArray_FromStringAndSize((const char *)mark, (Py_ssize_t)(k * 8));
        }
    }
done:
    PyMem_Free(mem);
    PyBuffer_Release(&wb);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&db);
    return res;
}

static PyMethodDef module_methods[] = {
    {"column_types", col_types, METH_NOARGS, "column name -> storage ('f', 'i', 's', 'r')"},
    {"factorize", factorize, METH_O, "factorize(list) -> (int64 codes as a bytearray, uniques)"},
    {"nest_parents", nest_parents, METH_VARARGS, "nest_parents(key, ts, end) -> int64 parent positions"},
    {"critical_walk", critical_walk, METH_VARARGS,
     "critical_walk(order, bounds, ...) -> (sums, first, steps): a replay's critical path, per key"},
    {"longest_path", longest_path, METH_VARARGS,
     "longest_path(n, weight, src, dst, source, sink) -> int64 path, or None on a cycle"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_kineto_scan", "Columnar scanner for Kineto JSON", -1, module_methods,
};

PyMODINIT_FUNC PyInit__kineto_scan(void) {
#ifdef HAVE_AVX2_PATH
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2");
#endif
    if (PyType_Ready(&ScannerType) < 0 || PyType_Ready(&ColumnType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    ScanError = PyErr_NewException("traceinspect.load._kineto_scan.ScanError", PyExc_ValueError, NULL);
    if (!ScanError || PyModule_AddObject(m, "ScanError", ScanError) < 0) {
        Py_XDECREF(ScanError);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(ScanError);
    Py_INCREF(&ScannerType);
    if (PyModule_AddObject(m, "Scanner", (PyObject *)&ScannerType) < 0) {
        Py_DECREF(&ScannerType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&ColumnType);
    if (PyModule_AddObject(m, "Column", (PyObject *)&ColumnType) < 0) {
        Py_DECREF(&ColumnType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
