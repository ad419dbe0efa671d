/* safetensors checkpoints: a single file or a folder sharded by model.safetensors.index.json.
 * Shards are mmap'd read-only; each header is validated once (JSON well formed, dtype known,
 * shape x dtype size == byte length, offsets inside the data area and non-overlapping), so later
 * code can trust every st_tensor. A writer emits files the reader (and the safetensors library)
 * accepts: declare every tensor first (the header is then fixed), then stream the data in order. */
#ifndef DS_SAFETENSORS_H
#define DS_SAFETENSORS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define ST_MAX_DIMS 8

enum st_dtype {
    ST_BF16 = 0,
    ST_F16,
    ST_F32,
    ST_F64,
    ST_F8_E4M3,
    ST_F8_E8M0,
    ST_I8,
    ST_U8,
    ST_I16,
    ST_I32,
    ST_I64,
    ST_BOOL,
    ST_NDTYPES
};

const char *st_dtype_name(enum st_dtype d); /* "BF16", "F8_E4M3", ... as in the header */
size_t st_dtype_size(enum st_dtype d);
int st_dtype_parse(const char *name, enum st_dtype *out); /* 0 or -1 */

struct st_tensor {
    char *name;
    enum st_dtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    size_t nbytes;
    const void *data; /* points into the shard's mmap */
    int shard;        /* index into st_model.shard_paths */
    bool bound;       /* set by weight binding, to find extra tensors */
};

struct st_model {
    char *dir;            /* folder (or the file's folder) */
    int n_shards;
    char **shard_paths;
    void **maps;
    size_t *map_sizes;
    int n_tensors;
    struct st_tensor *tensors; /* sorted by name */
    char *metadata_json;       /* first shard's __metadata__ object as JSON text, or NULL */
};

/* path: a folder holding model.safetensors.index.json (or exactly one *.safetensors), or a file.
 * Returns 0, or -1 with ds_err_set naming the file and tensor/field. */
int st_open(const char *path, struct st_model *m);
void st_close(struct st_model *m);
struct st_tensor *st_find(const struct st_model *m, const char *name);
/* A checkpoint held in memory (no file; synthetic data for benchmarks): takes ownership of
 * `tensors` (malloc'd array of n, each name malloc'd, data pointing at memory the caller keeps
 * alive while m is used), sorts them by name and checks what st_open checks of a header: known
 * dtype, shape x dtype size == nbytes, data present, no name twice. `label` stands for the file
 * in error messages. st_close frees the tables, never the data. Returns 0, or -1 (ds_err_set;
 * tensors freed). */
int st_model_from_tensors(struct st_model *m, const char *label, struct st_tensor *tensors, int n);
/* Metadata string value of the first shard's __metadata__ (NULL if absent). Caller must not free. */
const char *st_metadata(const struct st_model *m, const char *key);

/* Writer. */
struct st_writer;
struct st_writer *st_writer_new(void);
/* Declare a tensor; names must be unique. Returns its index. */
int st_writer_declare(struct st_writer *w, const char *name, enum st_dtype dtype, int ndim,
                      const int64_t *shape);
void st_writer_set_metadata(struct st_writer *w, const char *key, const char *value);
/* Fix the header and open the file (written to path.tmp, renamed on close). */
int st_writer_begin(struct st_writer *w, const char *path);
/* Data of tensor `idx` (must be called in declaration order, each exactly once, nbytes exact). */
int st_writer_write(struct st_writer *w, int idx, const void *data, size_t nbytes);
int st_writer_finish(struct st_writer *w); /* close, fsync, rename; frees w */
void st_writer_abort(struct st_writer *w); /* remove the temp file; frees w */
/* Convenience for small files: one call per tensor, data copied and kept until st_writer_save. */
int st_writer_add(struct st_writer *w, const char *name, enum st_dtype dtype, int ndim,
                  const int64_t *shape, const void *data);
int st_writer_save(struct st_writer *w, const char *path); /* writes everything added; frees w */

#endif /* DS_SAFETENSORS_H */
