/* HDF5 prompt files and output files (layouts and the durability contract: see h5io.h).
 *
 * Two failure kinds, as everywhere in dsbatch: a file that is not what we expect (missing
 * dataset, inconsistent offsets, a token outside the vocabulary, an output of another job) is bad
 * input, reported with ds_err_set as one line naming the file and the dataset and returned as -1;
 * an HDF5 call that fails on a file we validated is a library failure and aborts via CHECK_H5.
 * Probing calls whose failure is an answer (does this file open? is this HDF5?) run inside
 * H5E_BEGIN_TRY so HDF5 does not print its error stack for them.
 *
 * The prompt reader runs on many ranks at once; every collective HDF5 call is made by all ranks
 * in the same order, and a validation failure found by one rank (its share holds a bad token) is
 * agreed over the communicator before anyone returns, so all ranks print the same line and none
 * is left waiting in a collective. */
#include "h5io.h"

#include <cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zstd.h>

#include "log.h"

/* ------------------------------------------------------------------------------------------------
 * Small HDF5 helpers */

#define ROW_CHUNK 1024     /* per-request output datasets */
#define VALUE_CHUNK 4096   /* output tokens / logprobs: the tail chunk is rewritten per append */

static bool mpi_up(void) {
    int up = 0, down = 0;
    MPI_Initialized(&up);
    MPI_Finalized(&down);
    return up && !down;
}

static int64_t extent_1d(hid_t d) {
    hid_t s = H5Dget_space(d);
    CHECK_H5(s);
    hsize_t dims = 0;
    int rank = H5Sget_simple_extent_ndims(s);
    CHECK_H5(rank);
    if (rank == 1) CHECK_H5(H5Sget_simple_extent_dims(s, &dims, NULL));
    CHECK_H5(H5Sclose(s));
    return rank == 1 ? (int64_t)dims : -1;
}

/* Write or read elements [start, start+n) of a 1-D dataset. */
static void io_range(hid_t d, hid_t mtype, int64_t start, int64_t n, void *buf, hid_t dxpl, bool write) {
    hid_t fs = H5Dget_space(d);
    CHECK_H5(fs);
    hsize_t st = (hsize_t)start, cnt = (hsize_t)n, mdim = (hsize_t)(n > 0 ? n : 1);
    hid_t ms = H5Screate_simple(1, &mdim, NULL);
    CHECK_H5(ms);
    if (n > 0) {
        CHECK_H5(H5Sselect_hyperslab(fs, H5S_SELECT_SET, &st, NULL, &cnt, NULL));
    } else {
        CHECK_H5(H5Sselect_none(fs));
        CHECK_H5(H5Sselect_none(ms));
    }
    if (write)
        CHECK_H5(H5Dwrite(d, mtype, ms, fs, dxpl, buf));
    else
        CHECK_H5(H5Dread(d, mtype, ms, fs, dxpl, buf));
    CHECK_H5(H5Sclose(ms));
    CHECK_H5(H5Sclose(fs));
}

/* Extend a 1-D dataset to hold [start, start+n) and write that range. */
static void append_range(hid_t d, hid_t mtype, int64_t start, int64_t n, const void *buf) {
    if (n <= 0) return;
    hsize_t len = (hsize_t)(start + n);
    CHECK_H5(H5Dset_extent(d, &len));
    io_range(d, mtype, start, n, (void *)buf, H5P_DEFAULT, true);
}

void h5io_write_range(hid_t d, hid_t mtype, int64_t start, int64_t n, const void *buf) {
    io_range(d, mtype, start, n, (void *)buf, H5P_DEFAULT, true);
}

/* Does `path` (absolute, e.g. "/prompts/tokens") exist? H5Lexists needs every parent to exist. */
static bool link_exists(hid_t file, const char *path) {
    char buf[256];
    size_t n = strlen(path);
    if (n >= sizeof buf) return false;
    memcpy(buf, path, n + 1);
    for (char *s = strchr(buf + 1, '/');; s = strchr(s + 1, '/')) {
        if (s) *s = 0;
        htri_t e = H5Lexists(file, buf, H5P_DEFAULT);
        CHECK_H5(e);
        if (!e) return false;
        if (!s) return true;
        *s = '/';
    }
}

/* 64-bit FNV-1a: journal record checksums and the job fingerprint (no security role: it only has
 * to notice a torn record or a different job spec). */
#define FNV_OFFSET 0xcbf29ce484222325ULL
#define FNV_PRIME 0x100000001b3ULL
static uint64_t fnv1a(uint64_t h, const void *data, size_t n) {
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * FNV_PRIME;
    return h;
}

void h5_job_fingerprint(const char *text, char out[H5IO_FINGERPRINT_LEN]) {
    uint64_t h = fnv1a(FNV_OFFSET, text, strlen(text));
    snprintf(out, H5IO_FINGERPRINT_LEN, "%016llx", (unsigned long long)h);
}

static double now_unix(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Check that `path` can be created, with the system's reason when not (HDF5's own message for
 * an unwritable path is a long error stack). */
int h5io_check_writable(const char *path) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) {
        ds_err_set("%s: cannot write: %s", path, ds_errno_str());
        return -1;
    }
    close(fd);
    return 0;
}

/* 1 HDF5, 0 not, -1 unreadable (ds_err_set). */
static int probe_hdf5(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        ds_err_set("%s: cannot open: %s", path, ds_errno_str());
        return -1;
    }
    fclose(f);
    htri_t is = -1;
    H5E_BEGIN_TRY { is = H5Fis_hdf5(path); }
    H5E_END_TRY;
    return is > 0;
}

/* ------------------------------------------------------------------------------------------------
 * Prompt files: reading */

/* Make one rank's failure everyone's: the lowest failing rank's message goes to all. */
static int agree(MPI_Comm comm, int rc) {
    if (!mpi_up() || comm == MPI_COMM_SELF) return rc;
    int me, size;
    CHECK_MPI(MPI_Comm_rank(comm, &me));
    CHECK_MPI(MPI_Comm_size(comm, &size));
    if (size == 1) return rc;
    int key = rc ? me : INT_MAX, first = INT_MAX;
    CHECK_MPI(MPI_Allreduce(&key, &first, 1, MPI_INT, MPI_MIN, comm));
    if (first == INT_MAX) return 0;
    char msg[1024] = "";
    if (me == first) snprintf(msg, sizeof msg, "%s", ds_err_get());
    CHECK_MPI(MPI_Bcast(msg, (int)sizeof msg, MPI_CHAR, first, comm));
    ds_err_set("%s", msg);
    return -1;
}

/* Open /prompts/NAME and check it is 1-D of the expected class and (when want >= 0) length. */
static int open_dataset(struct h5_prompts *p, const char *name, H5T_class_t cls, bool allow_int, int64_t want,
                        const char *want_why, hid_t *out, int64_t *len) {
    char full[128];
    snprintf(full, sizeof full, "/prompts/%s", name);
    *out = -1;
    if (!link_exists(p->file, full)) {
        ds_err_set("%s: %s: missing dataset", p->path, full);
        return -1;
    }
    H5O_info_t info;
    CHECK_H5(H5Oget_info_by_name2(p->file, full, &info, H5O_INFO_BASIC, H5P_DEFAULT));
    if (info.type != H5O_TYPE_DATASET) {
        ds_err_set("%s: %s: not a dataset", p->path, full);
        return -1;
    }
    hid_t d = H5Dopen2(p->file, full, H5P_DEFAULT);
    CHECK_H5(d);
    hid_t t = H5Dget_type(d);
    CHECK_H5(t);
    H5T_class_t c = H5Tget_class(t);
    CHECK_H5(H5Tclose(t));
    int64_t n = extent_1d(d);
    int rc = 0;
    if (c != cls && !(allow_int && c == H5T_INTEGER)) {
        ds_err_set("%s: %s: expected %s values", p->path, full, cls == H5T_INTEGER ? "integer" : "floating-point");
        rc = -1;
    } else if (n < 0) {
        ds_err_set("%s: %s: expected a 1-D dataset", p->path, full);
        rc = -1;
    } else if (want >= 0 && n != want) {
        ds_err_set("%s: %s: length %lld, expected %lld (%s)", p->path, full, (long long)n, (long long)want, want_why);
        rc = -1;
    }
    if (rc) {
        CHECK_H5(H5Dclose(d));
        return -1;
    }
    *out = d;
    if (len) *len = n;
    return 0;
}

/* Check CSR offsets [n+1] against their values' length. */
static int check_offsets(const char *path, const char *name, const int64_t *off, int64_t n, int64_t values,
                         const char *values_name, bool nonempty) {
    if (off[0] != 0) {
        ds_err_set("%s: /prompts/%s: offsets[0] = %lld, must be 0", path, name, (long long)off[0]);
        return -1;
    }
    for (int64_t i = 0; i < n; i++) {
        if (off[i + 1] < off[i]) {
            ds_err_set("%s: /prompts/%s: not monotonic: entry %lld = %lld is below entry %lld = %lld", path, name,
                       (long long)(i + 1), (long long)off[i + 1], (long long)i, (long long)off[i]);
            return -1;
        }
        if (nonempty && off[i + 1] == off[i]) {
            ds_err_set("%s: /prompts/%s: prompt %lld is empty (entries %lld and %lld are both %lld)", path, name,
                       (long long)i, (long long)i, (long long)(i + 1), (long long)off[i]);
            return -1;
        }
    }
    if (off[n] != values) {
        ds_err_set("%s: /prompts/%s: last entry %lld does not match /prompts/%s length %lld", path, name,
                   (long long)off[n], values_name, (long long)values);
        return -1;
    }
    return 0;
}

/* Read a whole CSR pair NAME_chars / NAME_offsets (offsets kept; chars read on demand). */
static int open_csr(struct h5_prompts *p, const char *name, int64_t **off_out) {
    char cn[64], on[64];
    snprintf(cn, sizeof cn, "%s_chars", name);
    snprintf(on, sizeof on, "%s_offsets", name);
    hid_t dc, doff;
    int64_t nchars;
    if (open_dataset(p, cn, H5T_INTEGER, false, -1, "", &dc, &nchars)) return -1;
    CHECK_H5(H5Dclose(dc));
    if (open_dataset(p, on, H5T_INTEGER, false, p->n_prompts + 1, "one more than the number of prompts", &doff, NULL))
        return -1;
    int64_t *off = ds_malloc(sizeof *off * (size_t)(p->n_prompts + 1));
    io_range(doff, H5T_NATIVE_INT64, 0, p->n_prompts + 1, off, p->dxpl, false);
    CHECK_H5(H5Dclose(doff));
    if (check_offsets(p->path, on, off, p->n_prompts, nchars, cn, false)) {
        free(off);
        return -1;
    }
    *off_out = off;
    return 0;
}

static int validate_prompts(struct h5_prompts *p) {
    if (!link_exists(p->file, "/prompts")) {
        ds_err_set("%s: /prompts: missing group (not a dsbatch prompt file)", p->path);
        return -1;
    }
    hid_t g = H5Gopen2(p->file, "/prompts", H5P_DEFAULT);
    CHECK_H5(g);
    int64_t ver = 0;
    int rc = h5io_attr_get_i64(g, "format_version", &ver);
    CHECK_H5(H5Gclose(g));
    if (rc) {
        ds_err_set("%s: /prompts: missing integer attribute format_version", p->path);
        return -1;
    }
    if (ver != H5IO_FORMAT_VERSION) {
        ds_err_set("%s: /prompts: format_version %lld is not supported (this dsbatch reads %d)", p->path,
                   (long long)ver, H5IO_FORMAT_VERSION);
        return -1;
    }
    hid_t dt, doff;
    int64_t n_off;
    if (open_dataset(p, "tokens", H5T_INTEGER, false, -1, "", &dt, &p->n_tokens)) return -1;
    CHECK_H5(H5Dclose(dt));
    if (open_dataset(p, "offsets", H5T_INTEGER, false, -1, "", &doff, &n_off)) return -1;
    if (n_off < 1) {
        CHECK_H5(H5Dclose(doff));
        ds_err_set("%s: /prompts/offsets: empty (needs one entry more than the number of prompts)", p->path);
        return -1;
    }
    p->n_prompts = n_off - 1;
    p->offsets = ds_malloc(sizeof *p->offsets * (size_t)n_off);
    io_range(doff, H5T_NATIVE_INT64, 0, n_off, p->offsets, p->dxpl, false);
    CHECK_H5(H5Dclose(doff));
    if (check_offsets(p->path, "offsets", p->offsets, p->n_prompts, p->n_tokens, "tokens", true)) return -1;

    /* Optional per-prompt values. */
    static const struct {
        const char *name;
        H5T_class_t cls;
        size_t flag;
    } opt[] = {
        {"max_new_tokens", H5T_INTEGER, offsetof(struct h5_prompts, has_max_new)},
        {"temperature", H5T_FLOAT, offsetof(struct h5_prompts, has_temperature)},
        {"top_p", H5T_FLOAT, offsetof(struct h5_prompts, has_top_p)},
        {"top_k", H5T_INTEGER, offsetof(struct h5_prompts, has_top_k)},
        {"seed", H5T_INTEGER, offsetof(struct h5_prompts, has_seed)},
    };
    for (size_t i = 0; i < sizeof opt / sizeof *opt; i++) {
        char full[64];
        snprintf(full, sizeof full, "/prompts/%s", opt[i].name);
        if (!link_exists(p->file, full)) continue;
        hid_t d;
        if (open_dataset(p, opt[i].name, opt[i].cls, true, p->n_prompts, "one per prompt", &d, NULL)) return -1;
        if (!strcmp(opt[i].name, "seed")) {
            hid_t t = H5Dget_type(d);
            CHECK_H5(t);
            p->seed_signed = H5Tget_sign(t) == H5T_SGN_2;
            CHECK_H5(H5Tclose(t));
        }
        CHECK_H5(H5Dclose(d));
        *(bool *)((char *)p + opt[i].flag) = true;
    }
    if (link_exists(p->file, "/prompts/id")) {
        hid_t d;
        if (open_dataset(p, "id", H5T_INTEGER, false, p->n_prompts, "one per prompt", &d, NULL)) {
            ds_err_set("%s: /prompts/id: expected integer ids, one per prompt (string ids go in id_chars + id_offsets)",
                       p->path);
            return -1;
        }
        CHECK_H5(H5Dclose(d));
        p->id_kind = 1;
    } else if (link_exists(p->file, "/prompts/id_chars") || link_exists(p->file, "/prompts/id_offsets")) {
        if (open_csr(p, "id", &p->id_offsets)) return -1;
        p->id_kind = 2;
    }
    if (link_exists(p->file, "/prompts/text_chars") || link_exists(p->file, "/prompts/text_offsets")) {
        if (open_csr(p, "text", &p->text_offsets)) return -1;
        p->has_text = true;
    }
    return 0;
}

int h5_prompts_open(struct h5_prompts *p, const char *path, MPI_Comm comm) {
    memset(p, 0, sizeof *p);
    p->path = ds_strdup(path);
    p->comm = comm;
    p->file = p->dxpl = -1;
    h5zstd_register();
    bool mpio = mpi_up();
    if (!mpio && comm != MPI_COMM_SELF) {
        ds_err_set("%s: MPI is not initialised: only MPI_COMM_SELF can open prompt files", path);
        free(p->path);
        p->path = NULL;
        return -1;
    }
    int is = probe_hdf5(path);
    if (is == 0) ds_err_set("%s: not an HDF5 file", path);
    if (agree(comm, is == 1 ? 0 : -1)) {
        free(p->path);
        p->path = NULL;
        return -1;
    }
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
    CHECK_H5(fapl);
    p->dxpl = H5Pcreate(H5P_DATASET_XFER);
    CHECK_H5(p->dxpl);
    if (mpio) {
        CHECK_H5(H5Pset_fapl_mpio(fapl, comm, MPI_INFO_NULL));
        /* One rank reads each metadata block and broadcasts it, instead of every rank asking the
         * file system for the same object headers. */
        CHECK_H5(H5Pset_all_coll_metadata_ops(fapl, 1));
        CHECK_H5(H5Pset_dxpl_mpio(p->dxpl, H5FD_MPIO_COLLECTIVE));
    }
    H5E_BEGIN_TRY { p->file = H5Fopen(path, H5F_ACC_RDONLY, fapl); }
    H5E_END_TRY;
    CHECK_H5(H5Pclose(fapl));
    int rc = 0;
    if (p->file < 0) {
        ds_err_set("%s: cannot be opened as HDF5 (damaged or truncated)", path);
        rc = -1;
    }
    if (!rc) rc = validate_prompts(p);
    if (agree(comm, rc)) {
        h5_prompts_close(p);
        return -1;
    }
    return 0;
}

void h5_prompts_close(struct h5_prompts *p) {
    if (p->file >= 0) CHECK_H5(H5Fclose(p->file));
    if (p->dxpl >= 0) CHECK_H5(H5Pclose(p->dxpl));
    free(p->offsets);
    free(p->id_offsets);
    free(p->text_offsets);
    free(p->path);
    memset(p, 0, sizeof *p);
    p->file = p->dxpl = -1;
}

/* /prompts/NAME (already validated) opened for a read of `mlen` values: the dataset, its file space
 * and a memory space of mlen (at least 1, so an empty read is still a valid call). */
static hid_t open_for_read(struct h5_prompts *p, const char *name, int64_t mlen, hid_t *fs, hid_t *ms) {
    char full[64];
    snprintf(full, sizeof full, "/prompts/%s", name);
    hid_t d = H5Dopen2(p->file, full, H5P_DEFAULT);
    CHECK_H5(d);
    *fs = H5Dget_space(d);
    CHECK_H5(*fs);
    hsize_t mdim = (hsize_t)(mlen > 0 ? mlen : 1);
    *ms = H5Screate_simple(1, &mdim, NULL);
    CHECK_H5(*ms);
    return d;
}

/* Collective read of the rows idx[0..n) of a per-prompt dataset (a strided hyperslab). */
static void read_strided(struct h5_prompts *p, const char *name, hid_t mtype, int64_t i0, int64_t stride, int64_t n,
                         void *buf) {
    hid_t fs, ms, d = open_for_read(p, name, n, &fs, &ms);
    if (n > 0) {
        hsize_t st = (hsize_t)i0, sd = (hsize_t)stride, cnt = (hsize_t)n;
        CHECK_H5(H5Sselect_hyperslab(fs, H5S_SELECT_SET, &st, &sd, &cnt, NULL));
    } else {
        /* A rank with nothing to read still takes part in the collective read. */
        CHECK_H5(H5Sselect_none(fs));
        CHECK_H5(H5Sselect_none(ms));
    }
    CHECK_H5(H5Dread(d, mtype, ms, fs, p->dxpl, buf));
    CHECK_H5(H5Sclose(ms));
    CHECK_H5(H5Sclose(fs));
    CHECK_H5(H5Dclose(d));
}

/* The union of blocks [lo, hi) as a selection of `base`. Adding blocks one by one with
 * H5S_SELECT_OR costs O(blocks) each in HDF5 1.10 (6,250 blocks: 3 s per rank); merging halves
 * with H5Scombine_select keeps the whole union near-linear (20,000 blocks: 0.08 s). */
static hid_t select_blocks(hid_t base, const hsize_t *start, const hsize_t *count, int64_t lo, int64_t hi) {
    if (hi - lo <= 16) {
        hid_t s = H5Scopy(base);
        CHECK_H5(s);
        for (int64_t i = lo; i < hi; i++)
            CHECK_H5(H5Sselect_hyperslab(s, i == lo ? H5S_SELECT_SET : H5S_SELECT_OR, &start[i], NULL, &count[i], NULL));
        return s;
    }
    int64_t mid = lo + (hi - lo) / 2;
    hid_t a = select_blocks(base, start, count, lo, mid), b = select_blocks(base, start, count, mid, hi);
    hid_t u = H5Scombine_select(a, H5S_SELECT_OR, b);
    CHECK_H5(u);
    CHECK_H5(H5Sclose(a));
    CHECK_H5(H5Sclose(b));
    return u;
}

/* Collective read of the CSR rows idx[0..n) of a values dataset: the union of their ranges, in
 * increasing order, lands packed in buf. Adjacent ranges are merged (dp 1 reads one block). */
static void read_rows(struct h5_prompts *p, const char *name, hid_t mtype, const int64_t *off, const int64_t *idx,
                      int64_t n, void *buf, int64_t total) {
    hid_t fs, ms, d = open_for_read(p, name, total, &fs, &ms);
    hsize_t *start = ds_malloc(sizeof *start * (size_t)(n + 1)), *count = ds_malloc(sizeof *count * (size_t)(n + 1));
    int64_t nb = 0;
    for (int64_t j = 0; j < n;) {
        int64_t a = off[idx[j]], b = off[idx[j] + 1];
        for (j++; j < n && off[idx[j]] == b; j++) b = off[idx[j] + 1];
        if (b > a) start[nb] = (hsize_t)a, count[nb++] = (hsize_t)(b - a);
    }
    if (nb > 0) {
        hid_t sel = select_blocks(fs, start, count, 0, nb);
        CHECK_H5(H5Sclose(fs));
        fs = sel;
    } else {
        CHECK_H5(H5Sselect_none(fs));
        CHECK_H5(H5Sselect_none(ms));
    }
    free(start);
    free(count);
    CHECK_H5(H5Dread(d, mtype, ms, fs, p->dxpl, buf));
    CHECK_H5(H5Sclose(ms));
    CHECK_H5(H5Sclose(fs));
    CHECK_H5(H5Dclose(d));
}

/* Read the CSR strings of the share; NUL-terminated copies. */
static char **read_strings(struct h5_prompts *p, const char *name, const int64_t *off, const int64_t *idx, int64_t n) {
    int64_t total = 0;
    for (int64_t j = 0; j < n; j++) total += off[idx[j] + 1] - off[idx[j]];
    char *chars = ds_malloc((size_t)total + 1);
    char cn[64];
    snprintf(cn, sizeof cn, "%s_chars", name);
    read_rows(p, cn, H5T_NATIVE_UINT8, off, idx, n, chars, total);
    char **s = ds_calloc((size_t)n + 1, sizeof *s);
    int64_t at = 0;
    for (int64_t j = 0; j < n; j++) {
        int64_t len = off[idx[j] + 1] - off[idx[j]];
        s[j] = ds_malloc((size_t)len + 1);
        memcpy(s[j], chars + at, (size_t)len);
        s[j][len] = 0;
        at += len;
    }
    free(chars);
    return s;
}

/* Resolve and check one prompt's fields; -1 with ds_err_set on a bad value. */
static int resolve_prompt(struct h5_prompts *p, const struct h5_prompt_limits *lim, struct h5_prompt_batch *b,
                          int64_t j, const int64_t *mn, const float *temp, const float *topp, const int32_t *topk,
                          const int64_t *seed) {
    int64_t i = b->index[j];
    b->max_new[j] = mn && mn[j] >= 0 ? mn[j] : lim->default_max_new;
    struct sample_params *sp = &b->sp[j];
    *sp = lim->default_sp;
    if (temp && !isnan(temp[j])) {
        if (!isfinite(temp[j]) || temp[j] < 0) {
            ds_err_set("%s: /prompts/temperature: prompt %lld: %g is not a temperature >= 0", p->path, (long long)i,
                       (double)temp[j]);
            return -1;
        }
        sp->temperature = temp[j];
    }
    if (topp && !isnan(topp[j])) {
        if (!(topp[j] > 0 && topp[j] <= 1)) {
            ds_err_set("%s: /prompts/top_p: prompt %lld: %g is outside (0, 1]", p->path, (long long)i, (double)topp[j]);
            return -1;
        }
        sp->top_p = topp[j];
    }
    if (topk && topk[j] >= 0) sp->top_k = topk[j];
    if (seed && (!p->seed_signed || seed[j] >= 0)) sp->seed = (uint64_t)seed[j];
    int64_t len = b->offsets[j + 1] - b->offsets[j];
    if (lim->max_len > 0 && len + b->max_new[j] > lim->max_len) {
        ds_err_set("%s: /prompts/offsets: prompt %lld has %lld tokens + max_new_tokens %lld, above the maximum "
                   "sequence length %lld",
                   p->path, (long long)i, (long long)len, (long long)b->max_new[j], (long long)lim->max_len);
        return -1;
    }
    for (int64_t k = b->offsets[j]; k < b->offsets[j + 1]; k++) {
        int32_t t = b->tokens[k];
        if (t < 0 || (lim->vocab > 0 && t >= lim->vocab)) {
            char range[48] = "negative";
            if (lim->vocab > 0) snprintf(range, sizeof range, "outside the vocabulary [0, %lld)", (long long)lim->vocab);
            ds_err_set("%s: /prompts/tokens[%lld]: prompt %lld token %lld is %d, %s", p->path,
                       (long long)(p->offsets[i] + k - b->offsets[j]), (long long)i, (long long)(k - b->offsets[j]), t,
                       range);
            return -1;
        }
    }
    return 0;
}

int h5_prompts_read(struct h5_prompts *p, int64_t first, int64_t count, int dp_rank, int dp_size,
                    const struct h5_prompt_limits *lim, struct h5_prompt_batch *out) {
    memset(out, 0, sizeof *out);
    int rc = 0;
    if (first < 0 || count < 0 || first > p->n_prompts || count > p->n_prompts - first) {
        ds_err_set("%s: prompts %lld..%lld requested, the file has %lld", p->path, (long long)first,
                   (long long)(first + count - 1), (long long)p->n_prompts);
        rc = -1;
    } else if (dp_size < 1 || dp_rank < 0 || dp_rank >= dp_size) {
        ds_err_set("%s: data-parallel rank %d of %d is not valid", p->path, dp_rank, dp_size);
        rc = -1;
    }
    if (agree(p->comm, rc)) return -1;
    /* This replica's prompts: i in [first, first+count) with i % dp_size == dp_rank. */
    int64_t dp = dp_size, i0 = first + ((dp_rank - first % dp) % dp + dp) % dp;
    int64_t n = i0 < first + count ? (first + count - 1 - i0) / dp + 1 : 0;
    struct h5_prompt_batch *b = out;
    b->n = n;
    b->index = ds_malloc(sizeof *b->index * (size_t)(n + 1));
    b->offsets = ds_malloc(sizeof *b->offsets * (size_t)(n + 1));
    b->offsets[0] = 0;
    for (int64_t j = 0; j < n; j++) {
        b->index[j] = i0 + j * dp;
        b->offsets[j + 1] = b->offsets[j] + p->offsets[b->index[j] + 1] - p->offsets[b->index[j]];
    }
    b->tokens = ds_malloc(sizeof *b->tokens * (size_t)(b->offsets[n] + 1));
    read_rows(p, "tokens", H5T_NATIVE_INT32, p->offsets, b->index, n, b->tokens, b->offsets[n]);

    size_t rows = (size_t)(n + 1);
    int64_t *mn = p->has_max_new ? ds_malloc(sizeof *mn * rows) : NULL, *seed = p->has_seed ? ds_malloc(8 * rows) : NULL;
    float *temp = p->has_temperature ? ds_malloc(sizeof *temp * rows) : NULL;
    float *topp = p->has_top_p ? ds_malloc(sizeof *topp * rows) : NULL;
    int32_t *topk = p->has_top_k ? ds_malloc(sizeof *topk * rows) : NULL;
    if (mn) read_strided(p, "max_new_tokens", H5T_NATIVE_INT64, i0, dp, n, mn);
    if (temp) read_strided(p, "temperature", H5T_NATIVE_FLOAT, i0, dp, n, temp);
    if (topp) read_strided(p, "top_p", H5T_NATIVE_FLOAT, i0, dp, n, topp);
    if (topk) read_strided(p, "top_k", H5T_NATIVE_INT32, i0, dp, n, topk);
    /* Unsigned seeds above 2^63 keep their bits: read as the file's signedness. */
    if (seed) read_strided(p, "seed", p->seed_signed ? H5T_NATIVE_INT64 : H5T_NATIVE_UINT64, i0, dp, n, seed);
    b->id_kind = p->id_kind;
    if (p->id_kind == 1) {
        b->int_id = ds_malloc(sizeof *b->int_id * rows);
        read_strided(p, "id", H5T_NATIVE_INT64, i0, dp, n, b->int_id);
    }
    if (p->id_kind == 2) {
        b->id = read_strings(p, "id", p->id_offsets, b->index, n);
    } else {
        b->id = ds_calloc(rows, sizeof *b->id);
        for (int64_t j = 0; j < n; j++) {
            char s[32];
            snprintf(s, sizeof s, "%lld", (long long)(p->id_kind == 1 ? b->int_id[j] : b->index[j]));
            b->id[j] = ds_strdup(s);
        }
    }
    if (lim->want_text && p->has_text) b->text = read_strings(p, "text", p->text_offsets, b->index, n);

    b->max_new = ds_malloc(sizeof *b->max_new * rows);
    b->sp = ds_malloc(sizeof *b->sp * rows);
    for (int64_t j = 0; j < n && !rc; j++) rc = resolve_prompt(p, lim, b, j, mn, temp, topp, topk, seed);
    free(mn);
    free(seed);
    free(temp);
    free(topp);
    free(topk);
    if (agree(p->comm, rc)) {
        h5_prompt_batch_free(b);
        return -1;
    }
    return 0;
}

void h5_prompt_batch_free(struct h5_prompt_batch *b) {
    for (int64_t j = 0; j < b->n; j++) {
        if (b->id) free(b->id[j]);
        if (b->text) free(b->text[j]);
    }
    free(b->id);
    free(b->text);
    free(b->index);
    free(b->offsets);
    free(b->tokens);
    free(b->max_new);
    free(b->sp);
    free(b->int_id);
    memset(b, 0, sizeof *b);
}


/* ------------------------------------------------------------------------------------------------
 * Output files
 *
 * Durability. HDF5 1.10 is not crash-consistent: a flush rewrites the tail chunk of each
 * compressed dataset at a new address and frees the old one, which the same flush may reuse
 * before the chunk index pointing at it is written, so a kill in the middle of a flush can leave
 * an earlier request unreadable (the unit test that kills the writer at random moments sees it).
 * So the HDF5 file is not the record of what finished: OUT.h5.journal is. Each append first adds
 * one self-checking record to the journal with a single write() (a kill leaves at most a torn last
 * record, which is recognised and ignored), then updates the HDF5 file and flushes it so readers
 * see it. Resume reads the journal and rebuilds the HDF5 file from it (OUT.h5.rebuild, renamed
 * over OUT.h5), so every request whose append returned survives a SIGKILL at any moment. finish
 * marks the file complete, fsyncs it and deletes the journal; resuming a complete output (no
 * journal) finds every prompt done. */

/* Rows of the two trace tables (packed in the file; h5py/pandas read them as record arrays). */
struct req_row {
    int64_t prompt_index;
    int32_t run;
    double admit_s, first_token_s, last_token_s;
    int64_t prompt_tokens, generated_tokens;
};

struct step_row {
    int32_t run, rank, stage, tp, step, seqs, rows;
    double start_s, end_s, compute_s, comm_s, wait_s, tp_comm_s;
};

static hid_t req_type(void) {
    hid_t t = H5Tcreate(H5T_COMPOUND, sizeof(struct req_row));
    CHECK_H5(t);
#define F(name, ty) CHECK_H5(H5Tinsert(t, #name, HOFFSET(struct req_row, name), ty))
    F(prompt_index, H5T_NATIVE_INT64);
    F(run, H5T_NATIVE_INT32);
    F(admit_s, H5T_NATIVE_DOUBLE);
    F(first_token_s, H5T_NATIVE_DOUBLE);
    F(last_token_s, H5T_NATIVE_DOUBLE);
    F(prompt_tokens, H5T_NATIVE_INT64);
    F(generated_tokens, H5T_NATIVE_INT64);
#undef F
    return t;
}

static hid_t step_type(void) {
    hid_t t = H5Tcreate(H5T_COMPOUND, sizeof(struct step_row));
    CHECK_H5(t);
#define F(name, ty) CHECK_H5(H5Tinsert(t, #name, HOFFSET(struct step_row, name), ty))
    F(run, H5T_NATIVE_INT32);
    F(rank, H5T_NATIVE_INT32);
    F(stage, H5T_NATIVE_INT32);
    F(tp, H5T_NATIVE_INT32);
    F(step, H5T_NATIVE_INT32);
    F(seqs, H5T_NATIVE_INT32);
    F(rows, H5T_NATIVE_INT32);
    F(start_s, H5T_NATIVE_DOUBLE);
    F(end_s, H5T_NATIVE_DOUBLE);
    F(compute_s, H5T_NATIVE_DOUBLE);
    F(comm_s, H5T_NATIVE_DOUBLE);
    F(wait_s, H5T_NATIVE_DOUBLE);
    F(tp_comm_s, H5T_NATIVE_DOUBLE);
#undef F
    return t;
}

static hid_t create_table(hid_t loc, const char *name, hid_t mtype) {
    hid_t ft = H5Tcopy(mtype);
    CHECK_H5(ft);
    CHECK_H5(H5Tpack(ft)); /* no padding bytes in the file */
    hid_t d = h5io_create_1d(loc, name, ft, 0, true, ROW_CHUNK);
    CHECK_H5(H5Tclose(ft));
    return d;
}

static const char *group_of(enum h5_out_kind k) { return k == H5_OUT_SCORE ? "/scores" : "/outputs"; }
static const char *kind_name(enum h5_out_kind k) { return k == H5_OUT_SCORE ? "score" : "generate"; }

static void version_strings(char *mpi, size_t nm, char *hdf5, size_t nh) {
    int len = 0;
    /* MPI_Get_library_version is allowed before MPI_Init (MPI-3). */
    if (MPI_Get_library_version(mpi, &len) != MPI_SUCCESS) snprintf(mpi, nm, "unknown");
    mpi[strcspn(mpi, "\n")] = 0;
    unsigned maj, min, rel;
    CHECK_H5(H5get_libversion(&maj, &min, &rel));
    snprintf(hdf5, nh, "%u.%u.%u", maj, min, rel);
}

char *h5_meta_json(const struct h5_meta *m) {
    cJSON *j = cJSON_CreateObject();
    const char *keys[2] = {"job_spec", "model_config"}, *texts[2] = {m->job_spec_json, m->model_config_json};
    for (int i = 0; i < 2; i++) {
        if (!texts[i]) continue;
        cJSON *v = cJSON_Parse(texts[i]);
        cJSON_AddItemToObject(j, keys[i], v ? v : cJSON_CreateString(texts[i]));
    }
    if (m->rank_table) cJSON_AddStringToObject(j, "rank_table", m->rank_table);
    if (m->git_commit) cJSON_AddStringToObject(j, "git_commit", m->git_commit);
    if (m->hosts) cJSON_AddStringToObject(j, "hosts", m->hosts);
    char host[256] = "?";
    gethostname(host, sizeof host - 1);
    cJSON_AddStringToObject(j, "writer_host", host);
    char mpi[MPI_MAX_LIBRARY_VERSION_STRING], hdf5[32], buf[64];
    version_strings(mpi, sizeof mpi, hdf5, sizeof hdf5);
    cJSON *v = cJSON_AddObjectToObject(j, "versions");
    cJSON_AddStringToObject(v, "mpi", mpi);
    cJSON_AddStringToObject(v, "hdf5", hdf5);
    cJSON_AddStringToObject(v, "zstd", ZSTD_versionString());
    if (m->cuda_version) cJSON_AddStringToObject(v, "cuda", m->cuda_version);
    if (m->nccl_version) cJSON_AddStringToObject(v, "nccl", m->nccl_version);
    cJSON_AddNumberToObject(v, "dsbatch_format", H5IO_FORMAT_VERSION);
    cJSON_AddStringToObject(j, "compression", h5io_compression_name());
    double t = now_unix();
    time_t secs = (time_t)t;
    struct tm tm;
    gmtime_r(&secs, &tm);
    strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
    cJSON_AddStringToObject(j, "start_time", buf);
    cJSON_AddNumberToObject(j, "start_unix", t);
    char *s = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    char *r = ds_strdup(s);
    free(s);
    return r;
}

/* /meta: the JSON text whole, and its short scalars as attributes (one h5py call each). */
static void write_meta(hid_t f, const char *meta_json, const double *starts, int32_t runs) {
    hid_t g = H5Gcreate2(f, "meta", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    CHECK_H5(g);
    hid_t st = h5io_vlen_str_type(), sp = H5Screate(H5S_SCALAR);
    CHECK_H5(sp);
    hid_t d = H5Dcreate2(g, "json", st, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    CHECK_H5(d);
    CHECK_H5(H5Dwrite(d, st, H5S_ALL, H5S_ALL, H5P_DEFAULT, &meta_json));
    CHECK_H5(H5Dclose(d));
    CHECK_H5(H5Sclose(sp));
    CHECK_H5(H5Tclose(st));
    cJSON *meta = cJSON_Parse(meta_json);
    const cJSON *it;
    cJSON_ArrayForEach(it, meta) {
        if (!it->string || !strcmp(it->string, "json")) continue;
        if (cJSON_IsString(it) && strlen(it->valuestring) < 4096) h5io_attr_str(g, it->string, it->valuestring);
        else if (cJSON_IsNumber(it)) h5io_attr_f64(g, it->string, it->valuedouble);
        else if (cJSON_IsBool(it)) h5io_attr_i32(g, it->string, cJSON_IsTrue(it));
    }
    cJSON_Delete(meta);
    char mpi[MPI_MAX_LIBRARY_VERSION_STRING], hdf5[32];
    version_strings(mpi, sizeof mpi, hdf5, sizeof hdf5);
    h5io_attr_str(g, "mpi_version", mpi);
    h5io_attr_str(g, "hdf5_version", hdf5);
    h5io_attr_str(g, "zstd_version", ZSTD_versionString());
    h5io_attr_str(g, "compression", h5io_compression_name());
    h5io_attr_write(g, "run_start_unix", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, runs, starts);
    h5io_attr_f64(g, "end_unix", 0);
    CHECK_H5(H5Gclose(g));
}

/* Open the datasets of an output file for appending. */
static void bind_out(struct h5_out *o) {
    hid_t f = o->file;
    const char *g = group_of(o->kind);
    char p[64];
    hid_t *ds[] = {&o->d_index, &o->d_offsets, &o->d_tokens, &o->d_logprobs, &o->d_finish, &o->d_nll, &o->d_ntok};
    const char *names[] = {"prompt_index", "offsets", "tokens", "logprobs", "finish_reason", "nll", "n_tokens"};
    for (size_t i = 0; i < sizeof ds / sizeof *ds; i++) {
        snprintf(p, sizeof p, "%s/%s", g, names[i]);
        *ds[i] = -1;
        if (link_exists(f, p)) {
            *ds[i] = H5Dopen2(f, p, H5P_DEFAULT);
            CHECK_H5(*ds[i]);
        }
    }
    o->d_req = H5Dopen2(f, "/trace/requests", H5P_DEFAULT);
    CHECK_H5(o->d_req);
    o->d_steps = H5Dopen2(f, "/trace/steps", H5P_DEFAULT);
    CHECK_H5(o->d_steps);
    o->t_req = req_type();
    o->t_step = step_type();
    o->logprobs = o->d_logprobs >= 0;
}

static hid_t open_rw(const char *path) {
    hid_t f = -1;
    H5E_BEGIN_TRY { f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT); }
    H5E_END_TRY;
    return f;
}

/* Is a writer holding the file? HDF5 takes an exclusive flock on files it writes. */
static bool in_use(const char *path) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return false;
    bool busy = flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
    close(fd); /* also drops our lock */
    return busy;
}

/* Root attributes of a dsbatch output; -1 with ds_err_set when absent. */
struct out_attrs {
    int64_t version, complete, n_prompts, runs;
    char fp[128], kind[32];
};

static int read_out_attrs(hid_t f, const char *path, struct out_attrs *a) {
    a->runs = 1;
    h5io_attr_get_i64(f, "runs", &a->runs);
    if (h5io_attr_get_i64(f, "format_version", &a->version) || h5io_attr_get_i64(f, "complete", &a->complete) ||
        h5io_attr_get_i64(f, "n_prompts", &a->n_prompts) || h5io_attr_get_str(f, "fingerprint", a->fp, sizeof a->fp) ||
        h5io_attr_get_str(f, "kind", a->kind, sizeof a->kind)) {
        ds_err_set("%s: not a dsbatch output file", path);
        return -1;
    }
    return 0;
}

/* What is at an output path before we create there: 0 nothing or a partial dsbatch output (may
 * be replaced), -1 anything else (ds_err_set). */
static int check_replaceable(const char *path) {
    struct stat sb;
    if (stat(path, &sb) != 0) return 0;
    int is = probe_hdf5(path);
    if (is < 0) return -1;
    if (is == 0) {
        ds_err_set("%s: exists and is not an HDF5 file; refusing to overwrite it", path);
        return -1;
    }
    hid_t f = -1;
    if (!in_use(path)) {
        H5E_BEGIN_TRY { f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT); }
        H5E_END_TRY;
    }
    if (f < 0) {
        ds_err_set("%s: exists and cannot be opened (in use by a running job, or damaged); refusing to overwrite it",
                   path);
        return -1;
    }
    struct out_attrs a;
    int rc = read_out_attrs(f, path, &a);
    CHECK_H5(H5Fclose(f));
    if (rc) {
        ds_err_set("%s: exists and is not a dsbatch output file; refusing to overwrite it", path);
        return -1;
    }
    if (a.complete == 1) {
        ds_err_set("%s: holds the complete output of a finished job (fingerprint %s); refusing to overwrite it "
                   "(remove it, choose another output, or resume)",
                   path, a.fp);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------
 * The journal: records [type u32, 0 u32, payload length u64, payload, FNV-1a of all before u64] */

/* J_STEPS_V1: step rows without tp_comm_s, as journals written before it hold them (read only, so
 * a job killed under an older dsbatch still resumes with every record); J_STEPS: struct step_row. */
enum { J_HEADER = 1, J_RUN = 2, J_REQUEST = 3, J_STEPS_V1 = 4, J_STEPS = 5 };

struct step_row_v1 {
    int32_t run, rank, stage, tp, step, seqs, rows;
    double start_s, end_s, compute_s, comm_s, wait_s;
};

struct j_header {
    int32_t kind, logprobs;
    int64_t n_prompts;
    char fingerprint[64];
}; /* + meta JSON text */

struct j_request {
    int64_t idx, n;
    int32_t finish, run;
    double nll;
    struct h5_request_trace tr;
}; /* + int32 tokens [n] (generate) + double logprobs [n] (when the file keeps them) */

static char *journal_name(const char *path) {
    char *j = ds_malloc(strlen(path) + 9);
    sprintf(j, "%s.journal", path);
    return j;
}

/* One record, one write(): a kill leaves whole records and at most one torn last record. */
static void journal_put(struct h5_out *o, uint32_t type, const void *a, size_t na, const void *b, size_t nb,
                        const void *c, size_t nc) {
    if (o->jfd < 0) return;
    uint64_t len = na + nb + nc, total = 16 + len + 8;
    char *buf = ds_malloc(total);
    uint32_t head[2] = {type, 0};
    memcpy(buf, head, 8);
    memcpy(buf + 8, &len, 8);
    if (na) memcpy(buf + 16, a, na);
    if (nb) memcpy(buf + 16 + na, b, nb);
    if (nc) memcpy(buf + 16 + na + nb, c, nc);
    uint64_t sum = fnv1a(FNV_OFFSET, buf, 16 + len);
    memcpy(buf + 16 + len, &sum, 8);
    for (size_t done = 0; done < total;) {
        ssize_t w = write(o->jfd, buf + done, total - done);
        if (w < 0 && errno == EINTR) continue;
        CHECK_LIBC(w);
        done += (size_t)w;
    }
    if (o->sync) CHECK_LIBC(fsync(o->jfd));
    free(buf);
}

/* Everything an output file holds, whatever it was read from; rebuild() writes it back. */
struct out_records {
    struct j_header h;
    char *meta;
    int32_t runs;
    double *run_start;
    int64_t n, cap, nv, vcap, n_steps, scap;
    struct j_request *req;
    int64_t *voff; /* [n+1] into tok / lp */
    int32_t *tok;
    double *lp;
    struct step_row *steps;
};

static void rec_add_request(struct out_records *r, const struct j_request *q, const int32_t *tok, const double *lp) {
    if (r->n + 1 >= r->cap) {
        r->cap = r->cap ? 2 * r->cap : 256;
        r->req = ds_realloc(r->req, sizeof *r->req * (size_t)r->cap);
        r->voff = ds_realloc(r->voff, sizeof *r->voff * (size_t)(r->cap + 1));
    }
    if (r->nv + q->n > r->vcap) {
        r->vcap = 2 * (r->nv + q->n) + 1024;
        r->tok = ds_realloc(r->tok, sizeof *r->tok * (size_t)r->vcap);
        r->lp = ds_realloc(r->lp, sizeof *r->lp * (size_t)r->vcap);
    }
    r->voff[0] = 0;
    r->req[r->n] = *q;
    if (tok) memcpy(r->tok + r->nv, tok, sizeof *r->tok * (size_t)q->n);
    if (lp) memcpy(r->lp + r->nv, lp, sizeof *r->lp * (size_t)q->n);
    r->nv += q->n;
    r->voff[++r->n] = r->nv;
}

static void rec_add_steps(struct out_records *r, const struct step_row *s, int64_t n) {
    if (r->n_steps + n > r->scap) {
        r->scap = 2 * (r->n_steps + n) + 256;
        r->steps = ds_realloc(r->steps, sizeof *r->steps * (size_t)r->scap);
    }
    memcpy(r->steps + r->n_steps, s, sizeof *s * (size_t)n);
    r->n_steps += n;
}

static void rec_free(struct out_records *r) {
    free(r->meta);
    free(r->run_start);
    free(r->req);
    free(r->voff);
    free(r->tok);
    free(r->lp);
    free(r->steps);
    memset(r, 0, sizeof *r);
}

/* Parse a journal. 1: none, 0: parsed, -1: unusable (ds_err_set). A torn or damaged tail ends it. */
static int journal_load(const char *jpath, struct out_records *r) {
    FILE *f = fopen(jpath, "rb");
    if (!f) return 1;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = ds_malloc((size_t)size + 1);
    size_t got = fread(buf, 1, (size_t)size, f);
    fclose(f);
    int rc = -1;
    bool header = false;
    for (size_t pos = 0; pos + 16 <= got;) {
        uint32_t type;
        uint64_t len, sum;
        memcpy(&type, buf + pos, 4);
        memcpy(&len, buf + pos + 8, 8);
        if (len > got || pos + 24 + len > got) break;
        memcpy(&sum, buf + pos + 16 + len, 8);
        if (fnv1a(FNV_OFFSET, buf + pos, 16 + len) != sum) break;
        const char *p = buf + pos + 16;
        pos += 24 + len;
        if (type == J_HEADER && !header && len >= sizeof r->h) {
            memcpy(&r->h, p, sizeof r->h);
            r->h.fingerprint[sizeof r->h.fingerprint - 1] = 0;
            r->meta = ds_malloc(len - sizeof r->h + 1);
            memcpy(r->meta, p + sizeof r->h, len - sizeof r->h);
            r->meta[len - sizeof r->h] = 0;
            header = true;
        } else if (!header) {
            break;
        } else if (type == J_RUN && len == sizeof(double)) {
            r->run_start = ds_realloc(r->run_start, sizeof(double) * (size_t)(r->runs + 1));
            memcpy(&r->run_start[r->runs++], p, sizeof(double));
        } else if (type == J_REQUEST && len >= sizeof(struct j_request)) {
            struct j_request q;
            memcpy(&q, p, sizeof q);
            bool tok = r->h.kind == H5_OUT_GENERATE, lp = r->h.kind == H5_OUT_SCORE || r->h.logprobs;
            if (q.n < 0 || len != sizeof q + (size_t)q.n * ((tok ? 4 : 0) + (lp ? 8 : 0))) break;
            int32_t *tv = tok ? ds_malloc(4 * (size_t)(q.n + 1)) : NULL;
            double *lv = lp ? ds_malloc(8 * (size_t)(q.n + 1)) : NULL;
            if (tv) memcpy(tv, p + sizeof q, 4 * (size_t)q.n);
            if (lv) memcpy(lv, p + sizeof q + (tok ? 4 * (size_t)q.n : 0), 8 * (size_t)q.n);
            rec_add_request(r, &q, tv, lv);
            free(tv);
            free(lv);
        } else if (type == J_STEPS && len % sizeof(struct step_row) == 0) {
            struct step_row *s = ds_malloc(len + 1);
            memcpy(s, p, len);
            rec_add_steps(r, s, (int64_t)(len / sizeof *s));
            free(s);
        } else if (type == J_STEPS_V1 && len % sizeof(struct step_row_v1) == 0) {
            int64_t n = (int64_t)(len / sizeof(struct step_row_v1));
            struct step_row *s = ds_calloc((size_t)n + 1, sizeof *s);
            for (int64_t i = 0; i < n; i++) {
                struct step_row_v1 v;
                memcpy(&v, p + (size_t)i * sizeof v, sizeof v);
                struct step_row *w = &s[i]; /* field by field: the padding stays calloc's zeros */
                w->run = v.run, w->rank = v.rank, w->stage = v.stage, w->tp = v.tp, w->step = v.step;
                w->seqs = v.seqs, w->rows = v.rows, w->start_s = v.start_s, w->end_s = v.end_s;
                w->compute_s = v.compute_s, w->comm_s = v.comm_s, w->wait_s = v.wait_s;
            }
            rec_add_steps(r, s, n);
            free(s);
        } else {
            break;
        }
    }
    free(buf);
    if (header) rc = 0;
    else ds_err_set("%s: no valid header record", jpath);
    return rc;
}

/* ------------------------------------------------------------------------------------------------
 * Creating, appending, rebuilding */

/* Create the skeleton at path (via path.tmp) and its journal; o is then open for appends. When
 * replace_check, an existing file must be replaceable (see h5_out_create). */
static int create_out(struct h5_out *o, const char *path, const char *meta_json, const char *fp, int64_t n_prompts,
                      enum h5_out_kind kind, bool logprobs, bool replace_check, const double *starts, int32_t runs) {
    memset(o, 0, sizeof *o);
    o->file = -1;
    o->jfd = -1;
    cJSON *meta = meta_json ? cJSON_Parse(meta_json) : NULL;
    bool bad_meta = !cJSON_IsObject(meta);
    cJSON_Delete(meta);
    if (bad_meta) {
        ds_err_set("%s: the job's meta data is not a JSON object", path);
        return -1;
    }
    if (n_prompts < 0 || !fp || !fp[0] || strlen(fp) >= sizeof((struct j_header *)0)->fingerprint) {
        ds_err_set("%s: no job fingerprint (or one over 63 characters), or a negative prompt count", path);
        return -1;
    }
    if (replace_check && check_replaceable(path)) return -1;
    char *tmp = ds_malloc(strlen(path) + 5), *jpath = journal_name(path);
    sprintf(tmp, "%s.tmp", path);
    if (h5io_check_writable(tmp)) {
        ds_err_set("%s: cannot write: %s", path, ds_errno_str());
        free(tmp);
        free(jpath);
        return -1;
    }
    h5zstd_register();
    hid_t f = H5Fcreate(tmp, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    CHECK_H5(f);
    h5io_attr_i32(f, "format_version", H5IO_FORMAT_VERSION);
    h5io_attr_str(f, "kind", kind_name(kind));
    h5io_attr_i32(f, "complete", 0);
    h5io_attr_str(f, "fingerprint", fp);
    h5io_attr_i64(f, "n_prompts", n_prompts);
    h5io_attr_i32(f, "runs", runs);
    h5io_attr_str(f, "compression", h5io_compression_name());
    hid_t g = H5Gcreate2(f, group_of(kind), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    CHECK_H5(g);
    CHECK_H5(H5Dclose(h5io_create_1d(g, "prompt_index", H5T_STD_I64LE, 0, true, ROW_CHUNK)));
    hid_t d = h5io_create_1d(g, "offsets", H5T_STD_I64LE, 0, true, ROW_CHUNK);
    int64_t zero = 0;
    append_range(d, H5T_NATIVE_INT64, 0, 1, &zero);
    CHECK_H5(H5Dclose(d));
    if (kind == H5_OUT_GENERATE) {
        CHECK_H5(H5Dclose(h5io_create_1d(g, "tokens", H5T_STD_I32LE, 0, true, VALUE_CHUNK)));
        d = h5io_create_1d(g, "finish_reason", H5T_STD_I8LE, 0, true, ROW_CHUNK);
        h5io_attr_str(d, "meaning", "0 length, 1 stop (EOS), 2 stop id");
        CHECK_H5(H5Dclose(d));
    } else {
        CHECK_H5(H5Dclose(h5io_create_1d(g, "nll", H5T_IEEE_F64LE, 0, true, ROW_CHUNK)));
        CHECK_H5(H5Dclose(h5io_create_1d(g, "n_tokens", H5T_STD_I64LE, 0, true, ROW_CHUNK)));
    }
    if (kind == H5_OUT_SCORE || logprobs)
        CHECK_H5(H5Dclose(h5io_create_1d(g, "logprobs", H5T_IEEE_F64LE, 0, true, VALUE_CHUNK)));
    CHECK_H5(H5Gclose(g));
    g = H5Gcreate2(f, "trace", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    CHECK_H5(g);
    hid_t t = req_type();
    CHECK_H5(H5Dclose(create_table(g, "requests", t)));
    CHECK_H5(H5Tclose(t));
    t = step_type();
    CHECK_H5(H5Dclose(create_table(g, "steps", t)));
    CHECK_H5(H5Tclose(t));
    CHECK_H5(H5Gclose(g));
    write_meta(f, meta_json, starts, runs);
    CHECK_H5(H5Fclose(f));
    /* The journal first (a stale one of a replaced job is truncated), then the skeleton appears
     * under its name, whole. */
    o->jfd = open(jpath, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0644);
    if (o->jfd < 0) {
        ds_err_set("%s: cannot write: %s", jpath, ds_errno_str());
        unlink(tmp);
        free(tmp);
        free(jpath);
        return -1;
    }
    struct j_header h = {.kind = kind, .logprobs = logprobs, .n_prompts = n_prompts};
    snprintf(h.fingerprint, sizeof h.fingerprint, "%s", fp);
    journal_put(o, J_HEADER, &h, sizeof h, meta_json, strlen(meta_json), NULL, 0);
    for (int32_t r = 0; r < runs; r++) journal_put(o, J_RUN, &starts[r], sizeof(double), NULL, 0, NULL, 0);
    if (rename(tmp, path) != 0) {
        ds_err_set("%s: cannot write: %s", path, ds_errno_str());
        close(o->jfd);
        unlink(tmp);
        free(tmp);
        free(jpath);
        return -1;
    }
    free(tmp);
    free(jpath);
    o->file = open_rw(path);
    CHECK_H5(o->file);
    o->path = ds_strdup(path);
    o->kind = kind;
    o->n_prompts = n_prompts;
    o->run = runs - 1;
    o->done = ds_calloc((size_t)n_prompts + 1, 1);
    bind_out(o);
    return 0;
}

int h5_out_create(struct h5_out *o, const char *path, const char *meta_json, const char *job_fingerprint,
                  int64_t n_prompts, bool save_logprobs) {
    double t = now_unix();
    return create_out(o, path, meta_json, job_fingerprint, n_prompts, H5_OUT_GENERATE, save_logprobs, true, &t, 1);
}

int h5_out_create_score(struct h5_out *o, const char *path, const char *meta_json, const char *job_fingerprint,
                        int64_t n_prompts) {
    double t = now_unix();
    return create_out(o, path, meta_json, job_fingerprint, n_prompts, H5_OUT_SCORE, true, true, &t, 1);
}

static void make_durable(struct h5_out *o) {
    if (o->defer_flush) return;
    CHECK_H5(H5Fflush(o->file, H5F_SCOPE_LOCAL));
    if (o->sync) {
        int *fd = NULL;
        CHECK_H5(H5Fget_vfd_handle(o->file, H5P_DEFAULT, (void **)&fd));
        CHECK_LIBC(fsync(*fd));
    }
}

/* Close the HDF5 handles and the journal, keeping the counters. */
static void close_handles(struct h5_out *o) {
    hid_t *ids[] = {&o->d_index, &o->d_offsets, &o->d_tokens, &o->d_logprobs, &o->d_finish,
                    &o->d_nll,   &o->d_ntok,    &o->d_req,     &o->d_steps};
    for (size_t i = 0; i < sizeof ids / sizeof *ids; i++) {
        if (*ids[i] > 0) CHECK_H5(H5Dclose(*ids[i]));
        *ids[i] = -1;
    }
    if (o->t_req > 0) CHECK_H5(H5Tclose(o->t_req));
    if (o->t_step > 0) CHECK_H5(H5Tclose(o->t_step));
    if (o->file >= 0) CHECK_H5(H5Fclose(o->file));
    if (o->jfd >= 0) close(o->jfd);
    o->t_req = o->t_step = o->file = -1;
    o->jfd = -1;
}

static void free_out(struct h5_out *o) {
    close_handles(o);
    free(o->path);
    free(o->done);
    memset(o, 0, sizeof *o);
    o->file = -1;
    o->jfd = -1;
}

static int append_common(struct h5_out *o, enum h5_out_kind kind, int64_t idx, const int32_t *tokens,
                         const double *lp, int64_t n, int finish, double nll, const struct h5_request_trace *tr) {
    if (o->file < 0 || o->kind != kind) {
        ds_err_set("%s: not open as a %s output", o->path ? o->path : "(output)", kind_name(kind));
        return -1;
    }
    if (idx < 0 || idx >= o->n_prompts || n < 0) {
        ds_err_set("%s: request for prompt %lld (of %lld) with %lld values is out of range", o->path, (long long)idx,
                   (long long)o->n_prompts, (long long)n);
        return -1;
    }
    if (o->done[idx]) {
        ds_err_set("%s: prompt %lld is already recorded", o->path, (long long)idx);
        return -1;
    }
    if (kind == H5_OUT_GENERATE && (finish < 0 || finish > H5_FINISH_STOP_ID)) {
        ds_err_set("%s: prompt %lld: finish reason %d is not 0, 1 or 2", o->path, (long long)idx, finish);
        return -1;
    }
    if (n > 0 && ((kind == H5_OUT_GENERATE && !tokens) || (kind == H5_OUT_SCORE && !lp))) {
        ds_err_set("%s: prompt %lld: no values given", o->path, (long long)idx);
        return -1;
    }
    double *nan_lp = NULL;
    if (o->d_logprobs >= 0 && !lp && n > 0) {
        nan_lp = ds_malloc(sizeof *nan_lp * (size_t)n);
        for (int64_t k = 0; k < n; k++) nan_lp[k] = NAN;
        lp = nan_lp;
    }
    if (o->d_logprobs < 0) lp = NULL;
    if (kind != H5_OUT_GENERATE) tokens = NULL, finish = 0;
    if (kind != H5_OUT_SCORE) nll = 0;
    struct j_request q = {.idx = idx, .n = n, .finish = finish, .run = o->run, .nll = nll,
                          .tr = {NAN, NAN, NAN, -1, kind == H5_OUT_GENERATE ? n : 0}};
    if (tr) q.tr = *tr;
    journal_put(o, J_REQUEST, &q, sizeof q, tokens, tokens ? 4 * (size_t)n : 0, lp, lp ? 8 * (size_t)n : 0);

    int64_t v0 = o->n_values, v1 = v0 + n, r = o->n_done;
    if (tokens) append_range(o->d_tokens, H5T_NATIVE_INT32, v0, n, tokens);
    if (lp) append_range(o->d_logprobs, H5T_NATIVE_DOUBLE, v0, n, lp);
    append_range(o->d_offsets, H5T_NATIVE_INT64, r + 1, 1, &v1);
    int8_t fin = (int8_t)finish;
    if (kind == H5_OUT_GENERATE) {
        append_range(o->d_finish, H5T_NATIVE_INT8, r, 1, &fin);
    } else {
        append_range(o->d_nll, H5T_NATIVE_DOUBLE, r, 1, &nll);
        append_range(o->d_ntok, H5T_NATIVE_INT64, r, 1, &n);
    }
    struct req_row row = {.prompt_index = idx, .run = q.run, .admit_s = q.tr.admit_s,
                          .first_token_s = q.tr.first_token_s, .last_token_s = q.tr.last_token_s,
                          .prompt_tokens = q.tr.prompt_tokens, .generated_tokens = q.tr.generated_tokens};
    append_range(o->d_req, o->t_req, r, 1, &row);
    append_range(o->d_index, H5T_NATIVE_INT64, r, 1, &idx);
    make_durable(o);
    free(nan_lp);
    o->n_done = r + 1;
    o->n_values = v1;
    o->done[idx] = 1;
    return 0;
}

int h5_out_append(struct h5_out *o, int64_t prompt_index, const int32_t *tokens, const double *logprobs, int64_t n,
                  int finish, const struct h5_request_trace *tr) {
    return append_common(o, H5_OUT_GENERATE, prompt_index, tokens, logprobs, n, finish, 0, tr);
}

int h5_out_append_score(struct h5_out *o, int64_t prompt_index, const double *logprobs, int64_t n, double nll,
                        const struct h5_request_trace *tr) {
    return append_common(o, H5_OUT_SCORE, prompt_index, NULL, logprobs, n, 0, nll, tr);
}

static void append_steps(struct h5_out *o, const struct step_row *rows, int64_t n) {
    if (n <= 0) return;
    journal_put(o, J_STEPS, rows, sizeof *rows * (size_t)n, NULL, 0, NULL, 0);
    append_range(o->d_steps, o->t_step, o->n_steps, n, rows);
    o->n_steps += n;
    make_durable(o);
}

int h5_out_write_steps(struct h5_out *o, const struct h5_step_trace *ev, int64_t n) {
    if (o->file < 0 || n < 0) {
        ds_err_set("(output): not open");
        return -1;
    }
    /* calloc and field by field: the padding bytes the journal copies are then defined */
    struct step_row *rows = ds_calloc((size_t)n + 1, sizeof *rows);
    for (int64_t i = 0; i < n; i++) {
        struct step_row *r = &rows[i];
        r->run = o->run, r->rank = ev[i].rank, r->stage = ev[i].stage, r->tp = ev[i].tp, r->step = ev[i].step;
        r->seqs = ev[i].seqs, r->rows = ev[i].rows, r->start_s = ev[i].start_s, r->end_s = ev[i].end_s;
        r->compute_s = ev[i].compute_s, r->comm_s = ev[i].comm_s, r->wait_s = ev[i].wait_s;
        r->tp_comm_s = ev[i].tp_comm_s;
    }
    append_steps(o, rows, n);
    free(rows);
    return 0;
}

/* Write rec into a fresh file next to path, plus a new run, and move both (journal first) over
 * path and its journal; o is left open on path. A kill at any point leaves either the old pair or
 * a new journal that holds everything the old one did. */
static int rebuild(struct h5_out *o, const char *path, const struct out_records *rec) {
    char *tmp = ds_malloc(strlen(path) + 9);
    sprintf(tmp, "%s.rebuild", path);
    double *starts = ds_malloc(sizeof *starts * (size_t)(rec->runs + 1));
    if (rec->runs) memcpy(starts, rec->run_start, sizeof *starts * (size_t)rec->runs);
    starts[rec->runs] = now_unix();
    int rc = create_out(o, tmp, rec->meta, rec->h.fingerprint, rec->h.n_prompts, (enum h5_out_kind)rec->h.kind,
                        rec->h.logprobs, false, starts, rec->runs + 1);
    free(starts);
    if (rc) {
        free(tmp);
        return -1;
    }
    o->defer_flush = true; /* one flush at the end: the old journal still holds everything */
    int32_t run = o->run;
    for (int64_t i = 0; i < rec->n && !rc; i++) {
        const struct j_request *q = &rec->req[i];
        o->run = q->run;
        int64_t v = rec->voff[i];
        rc = append_common(o, o->kind, q->idx, rec->tok + v, rec->lp + v, q->n, q->finish, q->nll, &q->tr);
    }
    o->run = run;
    append_steps(o, rec->steps, rec->n_steps);
    o->defer_flush = false;
    make_durable(o);
    close_handles(o);
    char *jt = journal_name(tmp), *jp = journal_name(path);
    if (!rc && (rename(jt, jp) != 0 || rename(tmp, path) != 0)) {
        ds_err_set("%s: cannot replace: %s", path, ds_errno_str());
        rc = -1;
    }
    free(jt);
    free(tmp);
    if (!rc) {
        free(o->path);
        o->path = ds_strdup(path);
        o->file = open_rw(path);
        CHECK_H5(o->file);
        bind_out(o);
        o->jfd = open(jp, O_WRONLY | O_APPEND);
        CHECK_LIBC(o->jfd);
    }
    free(jp);
    if (rc) free_out(o);
    return rc;
}

/* A complete output has no journal (finish deleted it) and nothing left to do: reopen it as is. */
static int reopen_complete(struct h5_out *o, const char *path, const struct out_attrs *a) {
    o->file = open_rw(path);
    CHECK_H5(o->file);
    o->path = ds_strdup(path);
    o->kind = !strcmp(a->kind, "score") ? H5_OUT_SCORE : H5_OUT_GENERATE;
    o->n_prompts = a->n_prompts;
    o->run = (int32_t)a->runs;
    o->done = ds_calloc((size_t)a->n_prompts + 1, 1);
    bind_out(o);
    o->n_done = extent_1d(o->d_index);
    o->n_steps = extent_1d(o->d_steps);
    int64_t *idx = ds_malloc(8 * (size_t)(o->n_done + 1));
    io_range(o->d_index, H5T_NATIVE_INT64, 0, o->n_done, idx, H5P_DEFAULT, false);
    io_range(o->d_offsets, H5T_NATIVE_INT64, o->n_done, 1, &o->n_values, H5P_DEFAULT, false);
    for (int64_t i = 0; i < o->n_done; i++)
        if (idx[i] >= 0 && idx[i] < o->n_prompts) o->done[idx[i]] = 1;
    free(idx);
    return 0;
}

int h5_out_open_resume(struct h5_out *o, const char *path, const char *job_fingerprint, int64_t n_prompts,
                       uint8_t *done) {
    memset(o, 0, sizeof *o);
    o->file = -1;
    o->jfd = -1;
    struct stat sb;
    if (stat(path, &sb) != 0) {
        if (errno == ENOENT) return 1;
        ds_err_set("%s: cannot open: %s", path, ds_errno_str());
        return -1;
    }
    int is = probe_hdf5(path);
    if (is <= 0) {
        if (is == 0) ds_err_set("%s: not an HDF5 file; refusing to resume into it", path);
        return -1;
    }
    if (in_use(path)) {
        ds_err_set("%s: in use by a running job; refusing to resume into it", path);
        return -1;
    }
    h5zstd_register();
    /* Whose file is it? The root attributes when readable, else the journal's header. */
    hid_t f = -1;
    H5E_BEGIN_TRY { f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT); }
    H5E_END_TRY;
    struct out_attrs a = {0};
    int rc = 0;
    if (f >= 0) {
        H5E_BEGIN_TRY { rc = read_out_attrs(f, path, &a); }
        H5E_END_TRY;
        if (rc) {
            CHECK_H5(H5Fclose(f));
            ds_err_set("%s: not a dsbatch output file; refusing to resume into it", path);
            return -1;
        }
    }
    struct out_records rec = {0};
    char *jpath = journal_name(path);
    int jrc = journal_load(jpath, &rec);
    if (jrc < 0) rec_free(&rec);
    if (f < 0 && jrc != 0) {
        ds_err_set("%s: cannot be opened (damaged by a kill in the middle of a write) and has no usable journal "
                   "(%s); remove it and run again without resuming",
                   path, jpath);
        rc = -1;
    }
    const char *fp = f >= 0 ? a.fp : rec.h.fingerprint, *why = NULL;
    int64_t np = f >= 0 ? a.n_prompts : rec.h.n_prompts;
    if (!rc && f >= 0 && a.version != H5IO_FORMAT_VERSION) why = "another dsbatch output format";
    else if (!rc && (strcmp(fp, job_fingerprint) || (jrc == 0 && strcmp(rec.h.fingerprint, job_fingerprint))))
        why = "a different job spec or model";
    else if (!rc && np != n_prompts) why = "a prompt set of another size";
    if (why) {
        ds_err_set("%s: output of %s (fingerprint %s, %lld prompts; this job: %s, %lld prompts); refusing to resume "
                   "into it or overwrite it",
                   path, why, fp, (long long)np, job_fingerprint, (long long)n_prompts);
        rc = -1;
    }
    bool complete = !rc && jrc != 0 && f >= 0 && a.complete == 1;
    if (!rc && jrc != 0 && !complete) {
        ds_err_set("%s: unfinished output without its journal %s (deleted?): its rows cannot be trusted after a kill; "
                   "remove it and run again without resuming",
                   path, jpath);
        rc = -1;
    }
    if (f >= 0) CHECK_H5(H5Fclose(f));
    free(jpath);
    if (!rc) rc = complete ? reopen_complete(o, path, &a) : rebuild(o, path, &rec);
    rec_free(&rec);
    if (rc) return -1;
    if (done) memcpy(done, o->done, (size_t)n_prompts);
    return 0;
}

int h5_out_finish(struct h5_out *o) {
    if (o->file < 0) {
        ds_err_set("(output): not open");
        return -1;
    }
    if (o->n_done < o->n_prompts) {
        /* complete = 1 must mean every prompt has its row; the file stays resumable. */
        ds_err_set("%s: only %lld of %lld prompts recorded; not marking the output complete", o->path,
                   (long long)o->n_done, (long long)o->n_prompts);
        h5_out_close(o);
        return -1;
    }
    hid_t g = H5Gopen2(o->file, "/meta", H5P_DEFAULT);
    CHECK_H5(g);
    h5io_attr_f64(g, "end_unix", now_unix());
    CHECK_H5(H5Gclose(g));
    h5io_attr_i32(o->file, "complete", 1);
    o->sync = true; /* the end of a job is worth one fsync, before the journal goes */
    make_durable(o);
    char *jpath = journal_name(o->path);
    free_out(o);
    unlink(jpath);
    free(jpath);
    return 0;
}

void h5_out_close(struct h5_out *o) {
    if (o->file >= 0) CHECK_H5(H5Fflush(o->file, H5F_SCOPE_LOCAL));
    free_out(o);
}
