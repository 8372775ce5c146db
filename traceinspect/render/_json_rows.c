/* JSON text for table rows, written column by column.
 *
 * ``rows(program, start, stop)`` runs a small program once per row ``i`` of ``[start, stop)`` and returns
 * the bytes it wrote. A program is a tuple of operations, each a tuple ``(op, ...)``:
 *
 *   (LIT, text)                  write ``text``
 *   (FLOAT, text, f64)           write ``text`` and the number f64[i] (``null`` when not finite)
 *   (INT, text, i64)             write ``text`` and the integer i64[i]
 *   (INT_OPT, text, i64)         as INT, only where i64[i] >= 0
 *   (FLOAT_OPT, text, f64)       as FLOAT, only where f64[i] >= 0
 *   (TEXT, i64, texts)           write texts[i64[i]] (bytes of ready JSON); nothing where the code is
 *                                negative or the text is empty
 *   (IF, u8, count)              where u8[i] is 0, skip the next ``count`` operations
 *   (GROUP, text)                open a group: ``text`` is written before the first member the group
 *                                writes (and the first member's leading comma is dropped); nothing when
 *                                it writes none
 *   (END, text)                  close the group: ``text`` where it was opened
 *
 * Column arguments are buffers of one element per row of the table (bounds are checked against
 * ``stop``); text codes are checked against the list they index. A number is written so that it reads
 * back as the same double: whole thousandths (the microsecond timestamps of a trace) as decimals, any
 * other value as Python's ``repr`` writes it.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { OP_LIT, OP_FLOAT, OP_INT, OP_INT_OPT, OP_FLOAT_OPT, OP_TEXT, OP_IF, OP_GROUP, OP_END, OP_COUNT };

typedef struct {
    int op;
    const char *lit;
    Py_ssize_t litn;
    const void *col; /* f64, i64 or u8 column */
    Py_ssize_t count; /* IF: operations to skip */
    const char **tp;  /* TEXT: the texts */
    Py_ssize_t *tn;
    Py_ssize_t ntexts;
} Op;

/* the text is written straight into a bytes object, grown as needed and cut to size at the end (no copy
   of the whole text is made) */
typedef struct {
    PyObject *b;
    char *p;
    size_t n, cap;
} Out;

static int out_reserve(Out *o, size_t extra) {
    if (o->b && extra <= o->cap - o->n)
        return 0;
    size_t cap = o->cap ? o->cap : 1 << 16;
    while (cap - o->n < extra) {
        if (cap > ((size_t)PY_SSIZE_T_MAX) / 2) {
            PyErr_NoMemory();
            return -1;
        }
        cap *= 2;
    }
    if (!o->b) {
        o->b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)cap);
        if (!o->b)
            return -1;
    } else if (_PyBytes_Resize(&o->b, (Py_ssize_t)cap) < 0) {
        return -1; /* (o->b is NULL and freed) */
    }
    o->p = PyBytes_AS_STRING(o->b);
    o->cap = cap;
    return 0;
}

static int out_put(Out *o, const char *s, size_t n) {
    if (out_reserve(o, n) < 0)
        return -1;
    memcpy(o->p + o->n, s, n);
    o->n += n;
    return 0;
}

/* an integer in decimal; at most 20 characters */
static size_t int_text(char *d, int64_t v) {
    char tmp[24];
    size_t n = 0, k = 0;
    uint64_t u = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    do {
        tmp[n++] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0)
        d[k++] = '-';
    while (n)
        d[k++] = tmp[--n];
    return k;
}

static int put_int(Out *o, int64_t v) {
    if (out_reserve(o, 24) < 0)
        return -1;
    o->n += int_text(o->p + o->n, v);
    return 0;
}

static int put_float(Out *o, double v) {
    if (!isfinite(v))
        return out_put(o, "null", 4);
    /* whole thousandths below 2**53 / 1000: the decimal text k/1000 reads back as v, since v is the
       double nearest k/1000 */
    if (fabs(v) < 9.0e12) {
        double r = nearbyint(v * 1000.0);
        if (r / 1000.0 == v) {
            int64_t k = (int64_t)r;
            if (out_reserve(o, 32) < 0)
                return -1;
            char *d = o->p + o->n;
            size_t n = 0;
            uint64_t u = k < 0 ? (uint64_t)0 - (uint64_t)k : (uint64_t)k;
            if (k < 0 || (k == 0 && signbit(v)))
                d[n++] = '-';
            n += int_text(d + n, (int64_t)(u / 1000));
            unsigned frac = (unsigned)(u % 1000);
            d[n++] = '.';
            if (!frac) {
                d[n++] = '0';
            } else {
                char f[3] = {(char)('0' + frac / 100), (char)('0' + frac / 10 % 10), (char)('0' + frac % 10)};
                int len = f[2] != '0' ? 3 : f[1] != '0' ? 2 : 1;
                memcpy(d + n, f, (size_t)len);
                n += (size_t)len;
            }
            o->n += n;
            return 0;
        }
    }
    char *s = PyOS_double_to_string(v, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (!s)
        return -1;
    int rc = out_put(o, s, strlen(s));
    PyMem_Free(s);
    return rc;
}

static void ops_free(Op *ops, Py_ssize_t n, Py_buffer *views) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyMem_Free(ops[i].tp);
        PyMem_Free(ops[i].tn);
        if (views[i].obj)
            PyBuffer_Release(&views[i]);
    }
    PyMem_Free(ops);
    PyMem_Free(views);
}

static int column(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, Py_ssize_t stop, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->len % itemsize || view->len / itemsize < stop) {
        PyErr_Format(PyExc_ValueError, "%s column: %zd bytes for %zd rows of %zd bytes", what, view->len, stop,
                     itemsize);
        return -1;
    }
    return 0;
}

static int texts(PyObject *list, Op *op) {
    if (!PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "TEXT: a list of bytes expected");
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(list);
    op->tp = PyMem_Calloc((size_t)n + 1, sizeof(char *));
    op->tn = PyMem_Calloc((size_t)n + 1, sizeof(Py_ssize_t));
    if (!op->tp || !op->tn) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *b = PyList_GET_ITEM(list, j);
        if (!PyBytes_Check(b)) {
            PyErr_SetString(PyExc_TypeError, "TEXT: a list of bytes expected");
            return -1;
        }
        op->tp[j] = PyBytes_AS_STRING(b);
        op->tn[j] = PyBytes_GET_SIZE(b);
    }
    op->ntexts = n;
    return 0;
}

static PyObject *rows(PyObject *Py_UNUSED(m), PyObject *args) {
    PyObject *program;
    Py_ssize_t start, stop;
    if (!PyArg_ParseTuple(args, "O!nn", &PyTuple_Type, &program, &start, &stop))
        return NULL;
    if (start < 0 || stop < start) {
        PyErr_SetString(PyExc_ValueError, "rows: 0 <= start <= stop expected");
        return NULL;
    }
    Py_ssize_t nops = PyTuple_GET_SIZE(program);
    Op *ops = PyMem_Calloc((size_t)nops + 1, sizeof(Op));
    Py_buffer *views = PyMem_Calloc((size_t)nops + 1, sizeof(Py_buffer));
    if (!ops || !views) {
        PyMem_Free(ops);
        PyMem_Free(views);
        return PyErr_NoMemory();
    }
    Out o = {NULL, NULL, 0, 0};
    /* about 300 bytes a row (a kernel event with its flows): most blocks need no growing */
    size_t guess = (size_t)(stop - start) < ((size_t)PY_SSIZE_T_MAX >> 10) ? (size_t)(stop - start) * 320 : 0;
    for (Py_ssize_t i = 0; i < nops; i++) {
        PyObject *t = PyTuple_GET_ITEM(program, i);
        Op *op = &ops[i];
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 2) {
            PyErr_SetString(PyExc_TypeError, "rows: each operation is a tuple (op, ...)");
            goto fail;
        }
        op->op = (int)PyLong_AsLong(PyTuple_GET_ITEM(t, 0));
        if (PyErr_Occurred())
            goto fail;
        Py_ssize_t want = op->op == OP_LIT || op->op == OP_GROUP || op->op == OP_END ? 2 : 3;
        if (op->op < 0 || op->op >= OP_COUNT || PyTuple_GET_SIZE(t) != want) {
            PyErr_Format(PyExc_ValueError, "rows: operation %zd is malformed", i);
            goto fail;
        }
        PyObject *a1 = PyTuple_GET_ITEM(t, 1);
        switch (op->op) {
        case OP_LIT:
        case OP_GROUP:
        case OP_END:
        case OP_FLOAT:
        case OP_INT:
        case OP_INT_OPT:
        case OP_FLOAT_OPT:
            if (!PyBytes_Check(a1)) {
                PyErr_Format(PyExc_TypeError, "rows: operation %zd: text must be bytes", i);
                goto fail;
            }
            op->lit = PyBytes_AS_STRING(a1);
            op->litn = PyBytes_GET_SIZE(a1);
            break;
        default:
            break;
        }
        switch (op->op) {
        case OP_FLOAT:
        case OP_FLOAT_OPT:
        case OP_INT:
        case OP_INT_OPT:
            if (column(PyTuple_GET_ITEM(t, 2), &views[i], 8, stop,
                       op->op == OP_FLOAT || op->op == OP_FLOAT_OPT ? "float" : "int") < 0)
                goto fail;
            break;
        case OP_TEXT:
            if (column(a1, &views[i], 8, stop, "code") < 0 || texts(PyTuple_GET_ITEM(t, 2), op) < 0)
                goto fail;
            break;
        case OP_IF:
            if (column(a1, &views[i], 1, stop, "mask") < 0)
                goto fail;
            op->count = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 2));
            if (op->count < 0 || op->count > nops - 1 - i) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_ValueError, "rows: operation %zd skips past the end", i);
                goto fail;
            }
            break;
        default:
            break;
        }
        op->col = views[i].buf; /* (NULL for an operation without a column) */
    }
    if (guess && out_reserve(&o, guess) < 0)
        goto fail;
    for (Py_ssize_t r = start; r < stop; r++) {
        const char *pending = NULL; /* an open group not yet written */
        Py_ssize_t pendn = 0;
        int opened = 0, first = 0;
        for (Py_ssize_t i = 0; i < nops; i++) {
            const Op *op = &ops[i];
            const char *lit = op->lit;
            Py_ssize_t litn = op->litn;
            int emit = 1;
            switch (op->op) {
            case OP_IF:
                if (!((const uint8_t *)op->col)[r])
                    i += op->count;
                continue;
            case OP_GROUP:
                pending = lit;
                pendn = litn;
                opened = 0;
                continue;
            case OP_END:
                if (opened && out_put(&o, lit, (size_t)litn) < 0)
                    goto fail;
                pending = NULL;
                opened = 0;
                continue;
            case OP_INT_OPT:
                emit = ((const int64_t *)op->col)[r] >= 0;
                break;
            case OP_FLOAT_OPT:
                emit = ((const double *)op->col)[r] >= 0;
                break;
            case OP_TEXT: {
                int64_t c = ((const int64_t *)op->col)[r];
                if (c >= op->ntexts) {
                    PyErr_Format(PyExc_ValueError, "rows: text code %lld of %zd texts", (long long)c, op->ntexts);
                    goto fail;
                }
                emit = c >= 0 && op->tn[c] > 0;
                if (emit) {
                    lit = op->tp[c];
                    litn = op->tn[c];
                }
                break;
            }
            default:
                break;
            }
            if (!emit)
                continue;
            if (pending) { /* the group's first member */
                if (out_put(&o, pending, (size_t)pendn) < 0)
                    goto fail;
                pending = NULL;
                opened = first = 1;
            }
            if (first && litn && lit[0] == ',') {
                lit++;
                litn--;
            }
            first = 0;
            if (litn && out_put(&o, lit, (size_t)litn) < 0)
                goto fail;
            int rc = 0;
            switch (op->op) {
            case OP_FLOAT:
            case OP_FLOAT_OPT:
                rc = put_float(&o, ((const double *)op->col)[r]);
                break;
            case OP_INT:
            case OP_INT_OPT:
                rc = put_int(&o, ((const int64_t *)op->col)[r]);
                break;
            default:
                break;
            }
            if (rc < 0)
                goto fail;
        }
    }
    ops_free(ops, nops, views);
    if (!o.b)
        return PyBytes_FromStringAndSize("", 0);
    if (_PyBytes_Resize(&o.b, (Py_ssize_t)o.n) < 0)
        return NULL;
    return o.b;
fail:
    Py_XDECREF(o.b);
    ops_free(ops, nops, views);
    return NULL;
}

static PyMethodDef methods[] = {
    {"rows", rows, METH_VARARGS, "rows(program, start, stop) -> bytes: JSON text of table rows"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_json_rows", NULL, -1, methods};

PyMODINIT_FUNC PyInit__json_rows(void) {
    PyObject *m = PyModule_Create(&moduledef);
    if (!m)
        return NULL;
    const char *names[OP_COUNT] = {"LIT", "FLOAT", "INT", "INT_OPT", "FLOAT_OPT", "TEXT", "IF", "GROUP", "END"};
    for (int i = 0; i < OP_COUNT; i++)
        if (PyModule_AddIntConstant(m, names[i], i) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    return m;
}
