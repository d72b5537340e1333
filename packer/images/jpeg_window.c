/* packer.images._jpeg_window: decode only a window of a JPEG, at a reduced DCT scale, with the system's
 * libjpeg-turbo (jpeg_crop_scanline and jpeg_skip_scanlines, which neither Pillow nor simplejpeg exposes).
 *
 * decode(data, out, gray, denom, left, top, right, bottom) -> (rows, width, x, scaled_height, scaled_width)
 *
 * The image is decoded at scale 1/denom; of that scaled image (scaled_height x scaled_width), rows [top, bottom)
 * are decoded, and the columns of whole iMCUs that cover [left, right): the returned x is where they begin (at
 * most left) and width how many there are. Rows are written to `out` (a writable buffer of at least rows * width * channels bytes), packed.
 * Rows above `top` are skipped without their inverse DCT; rows below `bottom` are never decoded.
 *
 * ValueError for anything libjpeg-turbo calls an error or a warning (a damaged or truncated file), as
 * simplejpeg does; NotImplementedError for a JPEG this path does not take (CMYK): the caller decodes those whole.
 * The GIL is released while decoding.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

#ifndef LIBJPEG_TURBO_VERSION_NUMBER
#error "packer's window decoder needs libjpeg-turbo (jpeg_crop_scanline, jpeg_skip_scanlines)"
#endif

enum outcome { DONE = 0, FAILED = 1, UNSUPPORTED = 2, TOO_SMALL = 3 };

struct failure {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
};

static void on_error(j_common_ptr cinfo) {
    struct failure *err = (struct failure *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

/* A warning means damaged data that libjpeg-turbo would paper over (grey blocks): refused, as simplejpeg does. */
static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) {
        on_error(cinfo);
    }
}

struct job {
    const unsigned char *data;
    unsigned long size;
    unsigned char *out;
    Py_ssize_t out_size;
    int gray, denom;
    unsigned int left, top, right, bottom;
    /* results */
    unsigned int rows, width, x, scaled_height, scaled_width;
};

static enum outcome run(struct job *job, char *message) {
    struct jpeg_decompress_struct cinfo;
    struct failure err;
    JSAMPROW row;
    JDIMENSION xoffset, width;
    unsigned int channels = job->gray ? 1 : 3;
    enum outcome result = DONE;

    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    err.message[0] = '\0';
    if (setjmp(err.jump)) {
        strncpy(message, err.message, JMSG_LENGTH_MAX);
        jpeg_destroy_decompress(&cinfo);
        return FAILED;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, job->data, job->size);
    jpeg_read_header(&cinfo, TRUE);
    if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
        jpeg_destroy_decompress(&cinfo);
        return UNSUPPORTED;
    }
    cinfo.out_color_space = job->gray ? JCS_GRAYSCALE : JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)job->denom;
    jpeg_start_decompress(&cinfo);
    job->scaled_height = cinfo.output_height;
    job->scaled_width = cinfo.output_width;
    if (job->right > cinfo.output_width) job->right = cinfo.output_width;
    if (job->bottom > cinfo.output_height) job->bottom = cinfo.output_height;
    if (job->left >= job->right || job->top >= job->bottom) {
        jpeg_destroy_decompress(&cinfo);
        strncpy(message, "the window lies outside the image", JMSG_LENGTH_MAX);
        return FAILED;
    }
    xoffset = job->left;
    width = job->right - job->left;
    if (xoffset > 0 || width < cinfo.output_width) {
        jpeg_crop_scanline(&cinfo, &xoffset, &width);
    }
    job->x = xoffset;
    job->width = width;
    job->rows = job->bottom - job->top;
    if ((Py_ssize_t)job->rows * width * channels > job->out_size) {
        jpeg_destroy_decompress(&cinfo);
        return TOO_SMALL;
    }
    if (job->top > 0) {
        jpeg_skip_scanlines(&cinfo, job->top);
    }
    while (cinfo.output_scanline < job->bottom) {
        row = job->out + (size_t)(cinfo.output_scanline - job->top) * width * channels;
        jpeg_read_scanlines(&cinfo, &row, 1);
    }
    /* the rows below the window are never decoded */
    jpeg_abort_decompress(&cinfo);
    jpeg_destroy_decompress(&cinfo);
    return result;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer data, out;
    struct job job;
    char message[JMSG_LENGTH_MAX];
    enum outcome result;

    (void)self;
    memset(&job, 0, sizeof job);
    if (!PyArg_ParseTuple(args, "y*w*piIIII", &data, &out, &job.gray, &job.denom, &job.left, &job.top, &job.right,
                          &job.bottom)) {
        return NULL;
    }
    if (job.denom != 1 && job.denom != 2 && job.denom != 4 && job.denom != 8) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "denom must be 1, 2, 4 or 8");
        return NULL;
    }
    job.data = data.buf;
    job.size = (unsigned long)data.len;
    job.out = out.buf;
    job.out_size = out.len;
    message[0] = '\0';
    Py_BEGIN_ALLOW_THREADS
    result = run(&job, message);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    switch (result) {
    case FAILED:
        PyErr_SetString(PyExc_ValueError, message);
        return NULL;
    case UNSUPPORTED:
        PyErr_SetString(PyExc_NotImplementedError, "CMYK JPEG");
        return NULL;
    case TOO_SMALL:
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes, the window needs %u rows of %u pixels", out.len,
                     job.rows, job.width);
        return NULL;
    default:
        return Py_BuildValue("(IIIII)", job.rows, job.width, job.x, job.scaled_height, job.scaled_width);
    }
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(data, out, gray, denom, left, top, right, bottom) -> (rows, width, x, scaled_height, scaled_width): "
     "rows [top, bottom) and the iMCU columns covering [left, right) of the JPEG decoded at scale 1/denom, written "
     "into out."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpeg_window", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jpeg_window(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "LIBJPEG_TURBO", "" Py_STRINGIFY(LIBJPEG_TURBO_VERSION)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
