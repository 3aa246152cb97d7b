/* The elastic allocator's max-plus programme in C (see policies/elastic_dp.py): fold each job's
 * choices into its frontier, fill the table, and walk it back.
 *
 * rows is a (jobs + 1) x width float64 table whose row 0 is filled; row r becomes the best value
 * of jobs 1..r with at most k GPUs. The same IEEE additions and comparisons as the numpy path, so
 * both produce bit-identical tables. The table is filled without the GIL. Where only the optimum
 * is wanted (`best`), two rows take turns instead of the table: at thousands of jobs the table
 * is tens of megabytes, and obtaining that memory costs more than filling it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <structmember.h>

/* Where the compiler and CPU allow, an AVX2 clone of the kernel is chosen at load time: the
 * loop is a max of sums, exact in any vector width, so both clones give identical tables. */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
#define KERNEL_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define KERNEL_CLONES
#endif

KERNEL_CLONES
/* rolling: rows holds two rows, row r at (r & 1); else the whole table, row r at r. */
static void fill_rows(double *rows, Py_ssize_t width, Py_ssize_t jobs, const int64_t *offsets,
                      const int64_t *gpus, const double *values, const uint8_t *required,
                      int rolling) {
    Py_ssize_t reach = 0;
    for (Py_ssize_t r = 1; r <= jobs; r++) {
        const double *restrict prev = rows + (rolling ? (r - 1) & 1 : r - 1) * width;
        double *restrict cur = rows + (rolling ? r & 1 : r) * width;
        int64_t first = offsets[r - 1], last = offsets[r];
        /* capped before adding: a huge GPU count cannot overflow reach */
        reach = gpus[last - 1] >= width - 1 - reach ? width - 1 : reach + gpus[last - 1];
        Py_ssize_t span = reach + 1;
        for (Py_ssize_t k = 0; k < span; k++) cur[k] = required[r - 1] ? -INFINITY : prev[k];
        for (int64_t c = first; c < last; c++) {
            Py_ssize_t g = (Py_ssize_t)gpus[c];
            double v = values[c];
            for (Py_ssize_t k = g; k < span; k++) {
                double t = prev[k - g] + v;
                double c = cur[k];
                cur[k] = t > c ? t : c; /* unconditional store: vectorises */
            }
        }
        for (Py_ssize_t k = span; k < width; k++) cur[k] = cur[reach];
    }
}

/* Buffers are requested with PyBUF_FORMAT so that a float64 array passed where int64 is expected
 * (same itemsize) is refused, not reinterpreted. kind: 'q' int64, 'd' float64, 'B' one byte. */
typedef struct {
    const char *name;
    char kind;
    int writable;
} Spec;

static int format_is(const char *fmt, Py_ssize_t itemsize, char kind) {
    if (fmt == NULL) fmt = "B"; /* the buffer protocol's default */
#if PY_LITTLE_ENDIAN
    if (*fmt == '@' || *fmt == '=' || *fmt == '<') fmt++;
#else
    if (*fmt == '@' || *fmt == '=' || *fmt == '>') fmt++;
#endif
    if (fmt[0] == '\0' || fmt[1] != '\0') return 0;
    switch (kind) {
    case 'q': return itemsize == 8 && (fmt[0] == 'q' || fmt[0] == 'l');
    case 'd': return itemsize == 8 && fmt[0] == 'd';
    default: return itemsize == 1 && (fmt[0] == 'B' || fmt[0] == 'b' || fmt[0] == '?');
    }
}

static void release_buffers(Py_buffer *views, int n) {
    for (int i = 0; i < n; i++) PyBuffer_Release(&views[i]);
}

/* Contiguous buffers of the given kinds, or -1 with every buffer already taken released. */
static int get_buffers(const char *fn, PyObject **objs, const Spec *specs, Py_buffer *views,
                       int n) {
    static const char *kinds[] = {"int64", "float64", "uint8/bool"};
    for (int i = 0; i < n; i++) {
        int flags = PyBUF_FORMAT | (specs[i].writable ? PyBUF_WRITABLE : PyBUF_SIMPLE);
        if (PyObject_GetBuffer(objs[i], &views[i], flags) < 0) {
            release_buffers(views, i);
            return -1;
        }
        if (!format_is(views[i].format, views[i].itemsize, specs[i].kind)) {
            const char *kind = kinds[specs[i].kind == 'q' ? 0 : specs[i].kind == 'd' ? 1 : 2];
            PyErr_Format(PyExc_ValueError, "%s: %s must be a contiguous %s buffer, got format '%s'",
                         fn, specs[i].name, kind, views[i].format ? views[i].format : "B");
            release_buffers(views, i + 1);
            return -1;
        }
    }
    return 0;
}

static Py_ssize_t count(const Py_buffer *view) { return view->len / view->itemsize; }

/* What fill_rows and backtrack index by: each job's range offsets[r-1]..offsets[r] is non-empty
 * and inside the gpus/values arrays (of equal length), and every GPU count is >= 1. */
static int frontier_ok(const int64_t *offsets, Py_ssize_t jobs, const int64_t *gpus,
                       Py_ssize_t n) {
    if (offsets[0] < 0 || offsets[jobs] > n) return 0;
    for (Py_ssize_t r = 1; r <= jobs; r++)
        if (offsets[r] <= offsets[r - 1]) return 0;
    for (Py_ssize_t c = offsets[0]; c < offsets[jobs]; c++)
        if (gpus[c] < 1) return 0;
    return 1;
}

static PyObject *forward(PyObject *self, PyObject *args) {
    PyObject *objs[5];
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "OnOOOO", &objs[0], &width, &objs[1], &objs[2], &objs[3],
                          &objs[4]))
        return NULL;
    static const Spec specs[] = {{"rows", 'd', 1}, {"offsets", 'q', 0}, {"gpus", 'q', 0},
                                 {"values", 'd', 0}, {"required", 'B', 0}};
    Py_buffer v[5];
    if (get_buffers("forward", objs, specs, v, 5) < 0) return NULL;
    Py_ssize_t jobs = count(&v[4]), n = count(&v[2]);
    int ok = width > 0 && jobs < PY_SSIZE_T_MAX / width - 1 && count(&v[0]) == width * (jobs + 1) &&
             count(&v[1]) == jobs + 1 && count(&v[3]) == n && frontier_ok(v[1].buf, jobs, v[2].buf, n);
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        fill_rows(v[0].buf, width, jobs, v[1].buf, v[2].buf, v[3].buf, v[4].buf, 0);
        Py_END_ALLOW_THREADS
    }
    release_buffers(v, 5);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "forward: buffer sizes do not match jobs and width");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* The last row's value at width - 1 GPUs (the optimum), from a forward pass over two rows. */
static PyObject *best(PyObject *self, PyObject *args) {
    PyObject *objs[4];
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "nOOOO", &width, &objs[0], &objs[1], &objs[2], &objs[3]))
        return NULL;
    static const Spec specs[] = {{"offsets", 'q', 0}, {"gpus", 'q', 0}, {"values", 'd', 0},
                                 {"required", 'B', 0}};
    Py_buffer v[4];
    if (get_buffers("best", objs, specs, v, 4) < 0) return NULL;
    Py_ssize_t jobs = count(&v[3]), n = count(&v[1]);
    int ok = width > 0 && width < PY_SSIZE_T_MAX / 2 / (Py_ssize_t)sizeof(double) &&
             count(&v[0]) == jobs + 1 && count(&v[2]) == n &&
             frontier_ok(v[0].buf, jobs, v[1].buf, n);
    double *rows = ok ? PyMem_RawMalloc(2 * width * sizeof(double)) : NULL;
    double out = 0.0;
    if (rows != NULL) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t k = 0; k < width; k++) rows[k] = 0.0;
        fill_rows(rows, width, jobs, v[0].buf, v[1].buf, v[2].buf, v[3].buf, 1);
        out = rows[(jobs & 1) * width + width - 1];
        Py_END_ALLOW_THREADS
        PyMem_RawFree(rows);
    }
    release_buffers(v, 4);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "best: buffer sizes do not match jobs and width");
        return NULL;
    }
    if (rows == NULL) return PyErr_NoMemory();
    return PyFloat_FromDouble(out);
}

/* Walk the filled table back from `start` GPUs; picks[r] = flat index of job r's choice or -1.
 * A job is left out where that keeps the value (later jobs yield on ties); else its first
 * choice (fewest GPUs) whose sum reproduces the table entry bit for bit. */
static PyObject *backtrack(PyObject *self, PyObject *args) {
    PyObject *objs[6];
    Py_ssize_t width, start;
    if (!PyArg_ParseTuple(args, "OnnOOOOO", &objs[0], &width, &start, &objs[1], &objs[2],
                          &objs[3], &objs[4], &objs[5]))
        return NULL;
    static const Spec specs[] = {{"rows", 'd', 0}, {"offsets", 'q', 0}, {"gpus", 'q', 0},
                                 {"values", 'd', 0}, {"required", 'B', 0}, {"picks", 'q', 1}};
    Py_buffer v[6];
    if (get_buffers("backtrack", objs, specs, v, 6) < 0) return NULL;
    Py_buffer rows_buf = v[0], offsets_buf = v[1], gpus_buf = v[2], values_buf = v[3],
              required_buf = v[4], picks_buf = v[5];
    Py_ssize_t jobs = count(&required_buf), n = count(&gpus_buf);
    int ok = width > 0 && start >= 0 && start < width && jobs < PY_SSIZE_T_MAX / width - 1 &&
             count(&rows_buf) == width * (jobs + 1) && count(&offsets_buf) == jobs + 1 &&
             count(&picks_buf) == jobs && count(&values_buf) == n &&
             frontier_ok(offsets_buf.buf, jobs, gpus_buf.buf, n);
    int found = 1;
    if (ok) {
        const double *rows = rows_buf.buf, *values = values_buf.buf;
        const int64_t *offsets = offsets_buf.buf, *gpus = gpus_buf.buf;
        const uint8_t *required = required_buf.buf;
        int64_t *picks = picks_buf.buf;
        Py_ssize_t k = start;
        for (Py_ssize_t r = jobs; r >= 1 && found; r--) {
            const double *prev = rows + (r - 1) * width;
            double target = rows[r * width + k];
            picks[r - 1] = -1;
            if (!required[r - 1] && prev[k] == target) continue;
            found = 0;
            for (int64_t c = offsets[r - 1]; c < offsets[r]; c++) {
                if (gpus[c] <= k && prev[k - gpus[c]] + values[c] == target) {
                    picks[r - 1] = c;
                    k -= gpus[c];
                    found = 1;
                    break;
                }
            }
        }
    }
    release_buffers(v, 6);
    if (!ok || !found) {
        PyErr_SetString(PyExc_ValueError, ok ? "backtrack: table has no witness"
                                             : "backtrack: buffer sizes do not match");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* One job's choices, read from the Python objects, before folding. */
typedef struct {
    int64_t gpus, batch, src;
    double value;
    PyObject *big_batch; /* owned: a batch size beyond int64, compared as a Python int */
} Item;

/* x's batch < y's batch: 1, 0, or -1 with an exception set. */
static int batch_less(const Item *x, const Item *y) {
    if (x->big_batch == NULL && y->big_batch == NULL) return x->batch < y->batch;
    PyObject *a = x->big_batch ? Py_NewRef(x->big_batch) : PyLong_FromLongLong(x->batch);
    PyObject *b = y->big_batch ? Py_NewRef(y->big_batch) : PyLong_FromLongLong(y->batch);
    int less = a && b ? PyObject_RichCompareBool(a, b, Py_LT) : -1;
    Py_XDECREF(a);
    Py_XDECREF(b);
    return less;
}

static void clear_items(Item *items, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) Py_CLEAR(items[i].big_batch);
}

static int by_gpus_then_src(const void *a, const void *b) {
    const Item *x = a, *y = b;
    if (x->gpus != y->gpus) return x->gpus < y->gpus ? -1 : 1;
    return x->src < y->src ? -1 : (x->src > y->src);
}

/* Where the choices are instances of one slots class (policies.elastic_dp.Choice), read the
 * three fields straight from their slots: attribute lookups would cost as much as the whole
 * programme. Anything else goes through getattr. */
typedef struct {
    PyTypeObject *type;
    Py_ssize_t gpus, batch, value; /* slot offsets, or -1 */
} Layout;

static Py_ssize_t slot_offset(PyTypeObject *type, PyObject *name) {
    PyObject *descr = type->tp_dict ? PyDict_GetItemWithError(type->tp_dict, name) : NULL;
    if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) return -1;
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    return member->type == T_OBJECT_EX ? member->offset : -1;
}

static PyObject *field(PyObject *obj, Py_ssize_t offset, PyObject *name) {
    if (offset < 0) return PyObject_GetAttr(obj, name);
    PyObject *v = *(PyObject **)((char *)obj + offset);
    if (v == NULL) return PyObject_GetAttr(obj, name); /* unset slot: let getattr raise */
    Py_INCREF(v);
    return v;
}

/* An integer field as int64; where it does not fit, *overflow is its sign (+1 or -1) and, when
 * `big` is given, *big holds the Python int (a new reference). -1 on error. */
static int read_int(PyObject *obj, Py_ssize_t offset, PyObject *name, int64_t *out,
                    int *overflow, PyObject **big) {
    PyObject *v = field(obj, offset, name);
    if (v == NULL) return -1;
    *out = PyLong_AsLongLongAndOverflow(v, overflow);
    if (*out == -1 && PyErr_Occurred()) {
        Py_DECREF(v);
        return -1;
    }
    if (*overflow && big != NULL) *big = Py_NewRef(v);
    Py_DECREF(v);
    return 0;
}

static int read_double(PyObject *obj, Py_ssize_t offset, PyObject *name, double *out) {
    PyObject *v = field(obj, offset, name);
    if (v == NULL) return -1;
    *out = PyFloat_CheckExact(v) ? PyFloat_AS_DOUBLE(v) : PyFloat_AsDouble(v);
    Py_DECREF(v);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* Attribute names, interned once at module init (the module is single-phase, so static). */
static PyObject *s_choices, *s_required, *s_gpus, *s_batch, *s_value;

/* Read one choice into *it: 1 if it fits, 0 if skipped (more GPUs than capacity, as in
 * _frontier: a count beyond int64 is just larger), -1 on error. A batch size beyond int64 is
 * kept as a Python int, since _frontier compares batch sizes exactly. */
static int read_choice(PyObject *choice, Layout *layout, Py_ssize_t capacity, Py_ssize_t c,
                       Item *it) {
    if (Py_TYPE(choice) != layout->type) {
        layout->type = Py_TYPE(choice);
        layout->gpus = slot_offset(layout->type, s_gpus);
        layout->batch = slot_offset(layout->type, s_batch);
        layout->value = slot_offset(layout->type, s_value);
        if (PyErr_Occurred()) return -1;
    }
    int overflow;
    *it = (Item){.src = c};
    if (read_int(choice, layout->gpus, s_gpus, &it->gpus, &overflow, NULL) < 0) return -1;
    if (overflow > 0 || it->gpus > capacity) return 0;
    if (overflow < 0) {  /* fits under capacity but not in the int64 output, as numpy refuses */
        PyErr_SetString(PyExc_OverflowError, "Python int too large to convert to C long");
        return -1;
    }
    if (read_int(choice, layout->batch, s_batch, &it->batch, &overflow, &it->big_batch) < 0)
        return -1;
    if (read_double(choice, layout->value, s_value, &it->value) < 0) {
        Py_CLEAR(it->big_batch);
        return -1;
    }
    return 1;
}

/* The same fold as policies/elastic_dp.py:_frontier, for every job at once: the undominated
 * choices that fit, by increasing GPUs and strictly increasing value (best batch per GPU count,
 * ties to the smaller batch, then the earlier choice; optional jobs drop values <= 0). Writes the
 * flat gpus/values/src (index in the job's choices) arrays, offsets, required and concave flags
 * (GPU counts 1..m with non-increasing marginal value). */
static PyObject *fold(PyObject *self, PyObject *args) {
    PyObject *jobs, *objs[6];
    Py_ssize_t capacity;
    if (!PyArg_ParseTuple(args, "OnOOOOOO", &jobs, &capacity, &objs[0], &objs[1], &objs[2],
                          &objs[3], &objs[4], &objs[5]))
        return NULL;
    static const Spec specs[] = {{"gpus", 'q', 1},    {"values", 'd', 1},   {"src", 'q', 1},
                                 {"offsets", 'q', 1}, {"required", 'B', 1}, {"concave", 'B', 1}};
    Py_buffer v[6];
    if (get_buffers("fold", objs, specs, v, 6) < 0) return NULL;
    Py_buffer gpus_buf = v[0], values_buf = v[1], src_buf = v[2], offsets_buf = v[3],
              required_buf = v[4], concave_buf = v[5];
    Py_ssize_t room = count(&gpus_buf);
    PyObject *seq = PySequence_Fast(jobs, "fold: jobs must be a sequence");
    Item *items = NULL;
    Layout layout = {NULL, -1, -1, -1};
    Py_ssize_t cap_items = 0, out = 0;
    int ok = seq != NULL;
    Py_ssize_t n_jobs = ok ? PySequence_Fast_GET_SIZE(seq) : 0;
    if (ok && (count(&offsets_buf) != n_jobs + 1 || count(&required_buf) != n_jobs ||
               count(&concave_buf) != n_jobs || count(&values_buf) != room ||
               count(&src_buf) != room)) {
        PyErr_SetString(PyExc_ValueError, "fold: buffer sizes do not match the jobs");
        ok = 0;
    }
    int64_t *gpus = gpus_buf.buf, *src = src_buf.buf, *offsets = offsets_buf.buf;
    double *values = values_buf.buf;
    uint8_t *required = required_buf.buf, *concave = concave_buf.buf;
    for (Py_ssize_t j = 0; ok && j < n_jobs; j++) {
        /* a getattr or __bool__ may run Python code that mutates a list being read: each item
         * is held while read and each length checked again (the buffers are sized for n_jobs) */
        if (PySequence_Fast_GET_SIZE(seq) != n_jobs) {
            PyErr_SetString(PyExc_RuntimeError, "fold: the jobs list changed while being read");
            ok = 0;
            break;
        }
        PyObject *job = Py_NewRef(PySequence_Fast_GET_ITEM(seq, j));
        offsets[j] = out;
        PyObject *req = PyObject_GetAttr(job, s_required);
        int is_req = req ? PyObject_IsTrue(req) : -1;
        Py_XDECREF(req);
        PyObject *raw = is_req < 0 ? NULL : PyObject_GetAttr(job, s_choices);
        Py_DECREF(job);
        PyObject *choices = raw ? PySequence_Fast(raw, "fold: choices must be a sequence") : NULL;
        Py_XDECREF(raw);
        if (is_req < 0 || choices == NULL) { Py_XDECREF(choices); ok = 0; break; }
        required[j] = (uint8_t)is_req;
        Py_ssize_t m = PySequence_Fast_GET_SIZE(choices), fit = 0;
        if (m > cap_items) {
            Item *grown = PyMem_Realloc(items, sizeof(Item) * (size_t)m);
            if (grown == NULL) { Py_DECREF(choices); PyErr_NoMemory(); ok = 0; break; }
            items = grown;
            cap_items = m;
        }
        for (Py_ssize_t c = 0; c < m && c < PySequence_Fast_GET_SIZE(choices); c++) {
            PyObject *choice = Py_NewRef(PySequence_Fast_GET_ITEM(choices, c));
            int rc = read_choice(choice, &layout, capacity, c, &items[fit]);
            Py_DECREF(choice);
            if (rc < 0) { ok = 0; break; }
            fit += rc;
        }
        Py_DECREF(choices);
        if (!ok) { clear_items(items, fit); break; }
        qsort(items, (size_t)fit, sizeof(Item), by_gpus_then_src);
        double floor = is_req ? -INFINITY : 0.0, last = 0.0, previous_gain = INFINITY;
        int is_concave = 1;
        for (Py_ssize_t a = 0; a < fit;) {
            Item best = items[a];
            Py_ssize_t b = a + 1;
            for (; b < fit && items[b].gpus == best.gpus; b++) {
                const Item *it = &items[b];
                int less = it->value == best.value ? batch_less(it, &best) : 0;
                if (less < 0) { ok = 0; break; }
                if (it->value > best.value || less) best = *it;
            }
            if (!ok) break;
            a = b;
            if (!(best.value > floor)) continue;
            floor = best.value;
            if (out >= room) {
                PyErr_SetString(PyExc_ValueError, "fold: output arrays are too small");
                ok = 0;
                break;
            }
            double gain = best.value - last;
            if (best.gpus != out - offsets[j] + 1 || gain > previous_gain) is_concave = 0;
            previous_gain = gain;
            last = best.value;
            gpus[out] = best.gpus;
            values[out] = best.value;
            src[out] = best.src;
            out++;
        }
        clear_items(items, fit);
        if (!ok) break;
        concave[j] = (uint8_t)is_concave;
    }
    if (ok) offsets[n_jobs] = out;
    PyMem_Free(items);
    Py_XDECREF(seq);
    release_buffers(v, 6);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"forward", forward, METH_VARARGS, "Fill rows 1..jobs of the max-plus table in place."},
    {"best", best, METH_VARARGS, "The optimum of the max-plus programme, without its table."},
    {"backtrack", backtrack, METH_VARARGS, "Recover each job's choice from a filled table."},
    {"fold", fold, METH_VARARGS, "Each job's undominated choices as flat arrays."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_maxplus", NULL, -1, methods};

PyMODINIT_FUNC PyInit__maxplus(void) {
    PyObject **names[] = {&s_choices, &s_required, &s_gpus, &s_batch, &s_value};
    const char *texts[] = {"choices", "required", "gpus", "batch_size", "value"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (*names[i] == NULL && (*names[i] = PyUnicode_InternFromString(texts[i])) == NULL)
            return NULL;
    return PyModule_Create(&module);
}
