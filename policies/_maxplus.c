/* Forward pass of the elastic allocator's max-plus programme (see policies/elastic_dp.py).
 *
 * rows is a (jobs + 1) x width float64 table whose row 0 is filled; row r becomes the best value
 * of jobs 1..r with at most k GPUs. The same IEEE additions and comparisons as the numpy path, so
 * both produce bit-identical tables. Runs without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

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
        double *rows = rows_buf.buf;
        const int64_t *offsets = offsets_buf.buf, *gpus = gpus_buf.buf;
        const double *values = values_buf.buf;
        const uint8_t *required = required_buf.buf;
        Py_BEGIN_ALLOW_THREADS
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

static PyMethodDef methods[] = {
    {"forward", forward, METH_VARARGS, "Fill rows 1..jobs of the max-plus table in place."},
    {"backtrack", backtrack, METH_VARARGS, "Recover each job's choice from a filled table."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_maxplus", NULL, -1, methods};

PyMODINIT_FUNC PyInit__maxplus(void) { return PyModule_Create(&module); }
