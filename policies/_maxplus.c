/* The elastic allocator's max-plus programme in C (see policies/elastic_dp.py): fold each job's
 * choices into its frontier, fill the table, and walk it back.
 *
 * rows is a (jobs + 1) x width float64 table whose row 0 is filled; row r becomes the best value
 * of jobs 1..r with at most k GPUs. The same IEEE additions and comparisons as the numpy path, so
 * both produce bit-identical tables. The table is filled without the GIL.
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
static void fill_rows(double *rows, Py_ssize_t width, Py_ssize_t jobs, const int64_t *offsets,
                      const int64_t *gpus, const double *values, const uint8_t *required) {
    Py_ssize_t reach = 0;
    for (Py_ssize_t r = 1; r <= jobs; r++) {
        const double *restrict prev = rows + (r - 1) * width;
        double *restrict cur = rows + r * width;
        int64_t first = offsets[r - 1], last = offsets[r];
        reach += gpus[last - 1];
        if (reach > width - 1) reach = width - 1;
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

static PyObject *forward(PyObject *self, PyObject *args) {
    Py_buffer rows_buf, offsets_buf, gpus_buf, values_buf, required_buf;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "w*ny*y*y*y*", &rows_buf, &width, &offsets_buf, &gpus_buf,
                          &values_buf, &required_buf))
        return NULL;
    Py_ssize_t jobs = required_buf.len;
    int ok = width > 0 && rows_buf.len == (Py_ssize_t)sizeof(double) * width * (jobs + 1) &&
             offsets_buf.len == (Py_ssize_t)sizeof(int64_t) * (jobs + 1);
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        fill_rows(rows_buf.buf, width, jobs, offsets_buf.buf, gpus_buf.buf, values_buf.buf,
                  required_buf.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&rows_buf);
    PyBuffer_Release(&offsets_buf);
    PyBuffer_Release(&gpus_buf);
    PyBuffer_Release(&values_buf);
    PyBuffer_Release(&required_buf);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "forward: buffer sizes do not match jobs and width");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* Walk the filled table back from `start` GPUs; picks[r] = flat index of job r's choice or -1.
 * A job is left out where that keeps the value (later jobs yield on ties); else its first
 * choice (fewest GPUs) whose sum reproduces the table entry bit for bit. */
static PyObject *backtrack(PyObject *self, PyObject *args) {
    Py_buffer rows_buf, offsets_buf, gpus_buf, values_buf, required_buf, picks_buf;
    Py_ssize_t width, start;
    if (!PyArg_ParseTuple(args, "y*nny*y*y*y*w*", &rows_buf, &width, &start, &offsets_buf,
                          &gpus_buf, &values_buf, &required_buf, &picks_buf))
        return NULL;
    Py_ssize_t jobs = required_buf.len;
    int ok = width > 0 && start >= 0 && start < width &&
             rows_buf.len == (Py_ssize_t)sizeof(double) * width * (jobs + 1) &&
             offsets_buf.len == (Py_ssize_t)sizeof(int64_t) * (jobs + 1) &&
             picks_buf.len == (Py_ssize_t)sizeof(int64_t) * jobs;
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
    PyBuffer_Release(&rows_buf);
    PyBuffer_Release(&offsets_buf);
    PyBuffer_Release(&gpus_buf);
    PyBuffer_Release(&values_buf);
    PyBuffer_Release(&required_buf);
    PyBuffer_Release(&picks_buf);
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
} Item;

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

static int read_int(PyObject *obj, Py_ssize_t offset, PyObject *name, int64_t *out) {
    PyObject *v = field(obj, offset, name);
    if (v == NULL) return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int read_double(PyObject *obj, Py_ssize_t offset, PyObject *name, double *out) {
    PyObject *v = field(obj, offset, name);
    if (v == NULL) return -1;
    *out = PyFloat_CheckExact(v) ? PyFloat_AS_DOUBLE(v) : PyFloat_AsDouble(v);
    Py_DECREF(v);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* The same fold as policies/elastic_dp.py:_frontier, for every job at once: the undominated
 * choices that fit, by increasing GPUs and strictly increasing value (best batch per GPU count,
 * ties to the smaller batch, then the earlier choice; optional jobs drop values <= 0). Writes the
 * flat gpus/values/src (index in the job's choices) arrays, offsets, required and concave flags
 * (GPU counts 1..m with non-increasing marginal value). */
static PyObject *fold(PyObject *self, PyObject *args) {
    PyObject *jobs;
    Py_ssize_t capacity;
    Py_buffer gpus_buf, values_buf, src_buf, offsets_buf, required_buf, concave_buf;
    if (!PyArg_ParseTuple(args, "Onw*w*w*w*w*w*", &jobs, &capacity, &gpus_buf, &values_buf,
                          &src_buf, &offsets_buf, &required_buf, &concave_buf))
        return NULL;
    PyObject *seq = PySequence_Fast(jobs, "fold: jobs must be a sequence");
    Item *items = NULL;
    Layout layout = {NULL, -1, -1, -1};
    Py_ssize_t cap_items = 0, out = 0;
    int ok = seq != NULL;
    Py_ssize_t n_jobs = ok ? PySequence_Fast_GET_SIZE(seq) : 0;
    if (ok && (offsets_buf.len != (Py_ssize_t)sizeof(int64_t) * (n_jobs + 1) ||
               required_buf.len != n_jobs || concave_buf.len != n_jobs)) {
        PyErr_SetString(PyExc_ValueError, "fold: buffer sizes do not match the jobs");
        ok = 0;
    }
    PyObject *s_choices = PyUnicode_InternFromString("choices");
    PyObject *s_required = PyUnicode_InternFromString("required");
    PyObject *s_gpus = PyUnicode_InternFromString("gpus");
    PyObject *s_batch = PyUnicode_InternFromString("batch_size");
    PyObject *s_value = PyUnicode_InternFromString("value");
    Py_ssize_t room = gpus_buf.len / (Py_ssize_t)sizeof(int64_t);
    int64_t *gpus = gpus_buf.buf, *src = src_buf.buf, *offsets = offsets_buf.buf;
    double *values = values_buf.buf;
    uint8_t *required = required_buf.buf, *concave = concave_buf.buf;
    for (Py_ssize_t j = 0; ok && j < n_jobs; j++) {
        PyObject *job = PySequence_Fast_GET_ITEM(seq, j);
        offsets[j] = out;
        PyObject *req = PyObject_GetAttr(job, s_required);
        int is_req = req ? PyObject_IsTrue(req) : -1;
        Py_XDECREF(req);
        PyObject *raw = PyObject_GetAttr(job, s_choices);
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
        for (Py_ssize_t c = 0; c < m; c++) {
            PyObject *choice = PySequence_Fast_GET_ITEM(choices, c);
            if (Py_TYPE(choice) != layout.type) {
                layout.type = Py_TYPE(choice);
                layout.gpus = slot_offset(layout.type, s_gpus);
                layout.batch = slot_offset(layout.type, s_batch);
                layout.value = slot_offset(layout.type, s_value);
                if (PyErr_Occurred()) { ok = 0; break; }
            }
            Item it = {.src = c};
            if (read_int(choice, layout.gpus, s_gpus, &it.gpus) < 0) { ok = 0; break; }
            if (it.gpus > capacity) continue;
            if (read_int(choice, layout.batch, s_batch, &it.batch) < 0 ||
                read_double(choice, layout.value, s_value, &it.value) < 0) { ok = 0; break; }
            items[fit++] = it;
        }
        Py_DECREF(choices);
        if (!ok) break;
        qsort(items, (size_t)fit, sizeof(Item), by_gpus_then_src);
        double floor = is_req ? -INFINITY : 0.0, last = 0.0, previous_gain = INFINITY;
        int is_concave = 1;
        for (Py_ssize_t a = 0; a < fit;) {
            Item best = items[a];
            Py_ssize_t b = a + 1;
            for (; b < fit && items[b].gpus == best.gpus; b++) {
                const Item *it = &items[b];
                if (it->value > best.value || (it->value == best.value && it->batch < best.batch))
                    best = *it;
            }
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
        concave[j] = (uint8_t)is_concave;
    }
    if (ok) offsets[n_jobs] = out;
    Py_XDECREF(s_choices);
    Py_XDECREF(s_required);
    Py_XDECREF(s_gpus);
    Py_XDECREF(s_batch);
    Py_XDECREF(s_value);
    PyMem_Free(items);
    Py_XDECREF(seq);
    PyBuffer_Release(&gpus_buf);
    PyBuffer_Release(&values_buf);
    PyBuffer_Release(&src_buf);
    PyBuffer_Release(&offsets_buf);
    PyBuffer_Release(&required_buf);
    PyBuffer_Release(&concave_buf);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"forward", forward, METH_VARARGS, "Fill rows 1..jobs of the max-plus table in place."},
    {"backtrack", backtrack, METH_VARARGS, "Recover each job's choice from a filled table."},
    {"fold", fold, METH_VARARGS, "Each job's undominated choices as flat arrays."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_maxplus", NULL, -1, methods};

PyMODINIT_FUNC PyInit__maxplus(void) { return PyModule_Create(&module); }
