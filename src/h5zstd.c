/* The zstd filter for HDF5 (registered id 32015), registered in-process.
 *
 * No Debian package ships filter 32015, so dsbatch carries its own: the filter callback compresses
 * one chunk into a zstd frame (the frame records the raw size, so decompression needs no extra
 * header and files stay compatible with other 32015 implementations, which use the same framing)
 * and h5zstd_register() adds it to this process's HDF5. Built with -DH5ZSTD_PLUGIN -shared, the
 * same file is a dynamic filter plugin for tools that cannot register it themselves (h5py,
 * h5dump: point HDF5_PLUGIN_PATH at the folder); that build needs only libzstd. Also here, for the
 * library build: the storage conventions every dsbatch HDF5 file follows, shared by src/h5io.c,
 * src/h5inspect.c and src/cmd_prompts.c: chunked datasets carrying this filter at the chosen
 * level, and how attributes are typed, written and read. */
#include <stdlib.h>
#include <string.h>

#include <hdf5.h>
#include <zstd.h>

#ifndef H5ZSTD_PLUGIN
#include "h5io.h"
#include "log.h"
#endif

#define ZSTD_FILTER_ID 32015
#define ZSTD_DEFAULT_LEVEL 3

/* HDF5 hands the chunk in *buf (nbytes valid, *buf_size allocated); we return a new malloc'd
 * buffer (HDF5 frees with free()) and the valid byte count, or 0 to signal failure. */
static size_t zstd_chunk_filter(unsigned flags, size_t cd_nelmts, const unsigned cd_values[], size_t nbytes,
                                size_t *buf_size, void **buf) {
    void *dst;
    size_t len;
    if (flags & H5Z_FLAG_REVERSE) {
        unsigned long long raw = ZSTD_getFrameContentSize(*buf, nbytes);
        /* A frame without its size (written by a streaming encoder) is refused rather than
         * guessed: the chunk size is not passed to filters. */
        if (raw == ZSTD_CONTENTSIZE_ERROR || raw == ZSTD_CONTENTSIZE_UNKNOWN) return 0;
        dst = malloc(raw ? (size_t)raw : 1);
        if (!dst) return 0;
        len = ZSTD_decompress(dst, (size_t)raw, *buf, nbytes);
        if (ZSTD_isError(len) || len != raw) {
            free(dst);
            return 0;
        }
        *buf_size = raw ? (size_t)raw : 1;
    } else {
        int level = cd_nelmts > 0 ? (int)cd_values[0] : ZSTD_DEFAULT_LEVEL;
        size_t cap = ZSTD_compressBound(nbytes);
        dst = malloc(cap);
        if (!dst) return 0;
        len = ZSTD_compress(dst, cap, *buf, nbytes, level);
        if (ZSTD_isError(len)) {
            free(dst);
            return 0;
        }
        *buf_size = cap;
    }
    free(*buf);
    *buf = dst;
    return len;
}

static const H5Z_class2_t zstd_filter_class = {
    .version = H5Z_CLASS_T_VERS,
    .id = ZSTD_FILTER_ID,
    .encoder_present = 1,
    .decoder_present = 1,
    .name = "zstd",
    .can_apply = NULL,
    .set_local = NULL,
    .filter = zstd_chunk_filter,
};

#ifdef H5ZSTD_PLUGIN
/* The two entry points HDF5's plugin loader looks up. */
H5PL_type_t H5PLget_plugin_type(void);
const void *H5PLget_plugin_info(void);
H5PL_type_t H5PLget_plugin_type(void) { return H5PL_TYPE_FILTER; }
const void *H5PLget_plugin_info(void) { return &zstd_filter_class; }
#else

static bool g_registered;
static int g_level = ZSTD_DEFAULT_LEVEL;
static char g_name[40];

void h5zstd_register(void) {
    if (g_registered) return;
    CHECK_H5(H5Zregister(&zstd_filter_class));
    g_registered = true;
}

void h5io_set_zstd_level(int level) {
    if (level < 0) level = 0;
    if (level > ZSTD_maxCLevel()) level = ZSTD_maxCLevel();
    g_level = level;
}

int h5io_zstd_level(void) { return g_level; }

/* Dataset creation properties: chunked (needed for extendible datasets and for filters), zstd at
 * the current level, and no fill-value writes for chunks we are about to fill anyway. */
static hid_t make_dcpl(int64_t chunk) {
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    CHECK_H5(dcpl);
    hsize_t c = (hsize_t)(chunk > 0 ? chunk : 1);
    CHECK_H5(H5Pset_chunk(dcpl, 1, &c));
    CHECK_H5(H5Pset_fill_time(dcpl, H5D_FILL_TIME_IFSET));
    int level = h5io_zstd_level();
    if (level > 0) {
        h5zstd_register();
        unsigned cd = (unsigned)level;
        CHECK_H5(H5Pset_filter(dcpl, H5Z_FILTER_ZSTD_ID, H5Z_FLAG_MANDATORY, 1, &cd));
    }
    return dcpl;
}

/* A 1-D dataset of `len` elements; extendible ones have an unlimited maximum. A fixed empty
 * dataset cannot be chunked (chunks may not exceed a fixed extent), so it is contiguous. */
hid_t h5io_create_1d(hid_t loc, const char *name, hid_t ftype, int64_t len, bool extendible, int64_t chunk) {
    hsize_t dims = (hsize_t)len, maxd = extendible ? H5S_UNLIMITED : (hsize_t)len;
    hid_t space = H5Screate_simple(1, &dims, &maxd);
    CHECK_H5(space);
    hid_t dcpl = H5P_DEFAULT;
    if (extendible || len > 0) dcpl = make_dcpl(extendible ? chunk : (chunk < len ? chunk : len));
    hid_t d = H5Dcreate2(loc, name, ftype, space, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    CHECK_H5(d);
    if (dcpl != H5P_DEFAULT) CHECK_H5(H5Pclose(dcpl));
    CHECK_H5(H5Sclose(space));
    return d;
}

/* Attributes: little-endian numbers, variable-length UTF-8 strings (h5py returns them as str). */
void h5io_attr_write(hid_t obj, const char *name, hid_t ftype, hid_t mtype, int64_t n, const void *v) {
    hsize_t dims = (hsize_t)n;
    hid_t s = n < 0 ? H5Screate(H5S_SCALAR) : H5Screate_simple(1, &dims, NULL);
    CHECK_H5(s);
    htri_t e = H5Aexists(obj, name);
    CHECK_H5(e);
    if (e) CHECK_H5(H5Adelete(obj, name)); /* rewriting may change the shape (run_start_unix) */
    hid_t a = H5Acreate2(obj, name, ftype, s, H5P_DEFAULT, H5P_DEFAULT);
    CHECK_H5(a);
    CHECK_H5(H5Awrite(a, mtype, v));
    CHECK_H5(H5Aclose(a));
    CHECK_H5(H5Sclose(s));
}

void h5io_attr_i32(hid_t obj, const char *name, int32_t v) { h5io_attr_write(obj, name, H5T_STD_I32LE, H5T_NATIVE_INT32, -1, &v); }
void h5io_attr_i64(hid_t obj, const char *name, int64_t v) { h5io_attr_write(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, -1, &v); }
void h5io_attr_f64(hid_t obj, const char *name, double v) { h5io_attr_write(obj, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, -1, &v); }

/* Variable-length UTF-8 strings: h5py returns them as str. */
hid_t h5io_vlen_str_type(void) {
    hid_t t = H5Tcopy(H5T_C_S1);
    CHECK_H5(t);
    CHECK_H5(H5Tset_size(t, H5T_VARIABLE));
    CHECK_H5(H5Tset_cset(t, H5T_CSET_UTF8));
    return t;
}

void h5io_attr_str(hid_t obj, const char *name, const char *v) {
    hid_t t = h5io_vlen_str_type();
    h5io_attr_write(obj, name, t, t, -1, &v);
    CHECK_H5(H5Tclose(t));
}

/* Read an integer attribute (any integer type). Returns 0, or -1 when absent or not an integer. */
int h5io_attr_get_i64(hid_t obj, const char *name, int64_t *v) {
    htri_t e = H5Aexists(obj, name);
    CHECK_H5(e);
    if (!e) return -1;
    hid_t a = H5Aopen(obj, name, H5P_DEFAULT);
    CHECK_H5(a);
    hid_t t = H5Aget_type(a), s = H5Aget_space(a);
    CHECK_H5(t);
    CHECK_H5(s);
    hssize_t npts = H5Sget_simple_extent_npoints(s);
    CHECK_H5(npts);
    int rc = -1;
    if (H5Tget_class(t) == H5T_INTEGER && npts == 1) {
        CHECK_H5(H5Aread(a, H5T_NATIVE_INT64, v));
        rc = 0;
    }
    CHECK_H5(H5Sclose(s));
    CHECK_H5(H5Tclose(t));
    CHECK_H5(H5Aclose(a));
    return rc;
}

/* Read a string attribute (variable or fixed length) into buf. Returns 0, or -1 when absent. */
int h5io_attr_get_str(hid_t obj, const char *name, char *buf, size_t cap) {
    htri_t e = H5Aexists(obj, name);
    CHECK_H5(e);
    buf[0] = 0;
    if (!e) return -1;
    hid_t a = H5Aopen(obj, name, H5P_DEFAULT);
    CHECK_H5(a);
    hid_t t = H5Aget_type(a);
    CHECK_H5(t);
    int rc = -1;
    if (H5Tget_class(t) == H5T_STRING) {
        htri_t var = H5Tis_variable_str(t);
        CHECK_H5(var);
        hid_t m = H5Tcopy(H5T_C_S1);
        CHECK_H5(m);
        /* HDF5 does not convert between ASCII and UTF-8 strings: read in the file's set. */
        CHECK_H5(H5Tset_cset(m, H5Tget_cset(t)));
        if (var) {
            char *s = NULL;
            CHECK_H5(H5Tset_size(m, H5T_VARIABLE));
            CHECK_H5(H5Aread(a, m, &s));
            snprintf(buf, cap, "%s", s ? s : "");
            if (s) CHECK_H5(H5free_memory(s));
        } else {
            size_t sz = H5Tget_size(t);
            char *tmp = ds_calloc(sz + 1, 1);
            CHECK_H5(H5Tset_size(m, sz + 1));
            CHECK_H5(H5Aread(a, m, tmp));
            snprintf(buf, cap, "%s", tmp);
            free(tmp);
        }
        CHECK_H5(H5Tclose(m));
        rc = 0;
    }
    CHECK_H5(H5Tclose(t));
    CHECK_H5(H5Aclose(a));
    return rc;
}

const char *h5io_compression_name(void) {
    if (g_level == 0) return "none";
    snprintf(g_name, sizeof g_name, "zstd-%d level %d", ZSTD_FILTER_ID, g_level);
    return g_name;
}
#endif
