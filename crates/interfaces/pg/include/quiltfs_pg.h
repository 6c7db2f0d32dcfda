/* Patchgroups on a quiltfs mount: the C interface of libquilt_pg.so.
 *
 * A patchgroup names a set of file-system changes; "Q depends on P" means Q's changes
 * reach the disk only after P's. A process's changes join the groups it has engaged.
 * Rules: depend only before release; release before engage; a group others depend on is
 * never engaged again; no group depends on an engaged one.
 *
 * Every call returns 0 (or a group id > 0 for the create calls) on success, and -1 with
 * errno set on failure; qfs_pg_strerror() then gives the server's explanation.
 *
 * Transport: ioctls on <mount>/.quiltfs-control with the numbers below. */
#ifndef QUILTFS_PG_H
#define QUILTFS_PG_H

#include <stddef.h>
#include <stdint.h>
#include <sys/ioctl.h>

#ifdef __cplusplus
extern "C" {
#endif

#define QFS_PG_CONTROL_NAME ".quiltfs-control"

struct qfs_pg_args {
    uint64_t a; /* the group (the group after, for DEPEND; the new one, out, for CREATE) */
    uint64_t b; /* the group before (DEPEND) */
};

#define QFS_PG_ERROR_LEN 256
#define QFS_PG_IOC_CREATE    _IOWR('Q', 1, struct qfs_pg_args)
#define QFS_PG_IOC_DEPEND    _IOWR('Q', 2, struct qfs_pg_args)
#define QFS_PG_IOC_RELEASE   _IOWR('Q', 3, struct qfs_pg_args)
#define QFS_PG_IOC_ENGAGE    _IOWR('Q', 4, struct qfs_pg_args)
#define QFS_PG_IOC_DISENGAGE _IOWR('Q', 5, struct qfs_pg_args)
#define QFS_PG_IOC_SYNC      _IOWR('Q', 6, struct qfs_pg_args)
#define QFS_PG_IOC_ABANDON   _IOWR('Q', 7, struct qfs_pg_args)
#define QFS_PG_IOC_NEXT      _IOWR('Q', 9, struct qfs_pg_args)
#define QFS_PG_IOC_LAST_ERROR _IOR('Q', 8, char[QFS_PG_ERROR_LEN])

/* Opens <mount>/.quiltfs-control: the descriptor every other call takes. */
int qfs_pg_open(const char *mount);
int qfs_pg_close(int fd);

int64_t qfs_pg_create(int fd);
/* Creates a group that depends on `before`, and releases it: ready to engage. */
int64_t qfs_pg_create_after(int fd, uint64_t before);
int qfs_pg_depend(int fd, uint64_t after, uint64_t before);
int qfs_pg_release(int fd, uint64_t pg);
int qfs_pg_engage(int fd, uint64_t pg);
int qfs_pg_disengage(int fd, uint64_t pg);
/* Waits until the group's changes, and those of every group before it, are durable. */
int qfs_pg_sync(int fd, uint64_t pg);
/* Drops the handle; the group's changes keep their order. */
int qfs_pg_abandon(int fd, uint64_t pg);
/* Ends pg (engaged by this process) and engages a new group ordered after it, in one
 * call (abandon_old: also drop pg's handle). Returns the new group, or 0 and errno. */
uint64_t qfs_pg_next(int fd, uint64_t pg, int abandon_old);
int qfs_pg_strerror(int fd, char *buf, size_t len);

/* Clones on a mount that shares storage (betrfs). FICLONE/FICLONERANGE cannot reach a
 * FUSE server; these carry the same request. */
#define QFS_NAME_MAX 255

struct qfs_clone_range_args {
    uint64_t src_ino; /* the source file's st_ino */
    uint64_t src_off;
    uint64_t len;     /* 0: to the source's end; out: the bytes cloned */
    uint64_t dst_off;
};

struct qfs_clone_tree_args {
    uint64_t src_ino;  /* in: the tree's st_ino; out: the new entry's */
    uint32_t name_len;
    uint32_t pad;
    char name[QFS_NAME_MAX + 1];
};

/* On the destination file. */
#define QFS_IOC_CLONE_RANGE _IOWR('Q', 16, struct qfs_clone_range_args)
/* On the destination's directory. */
#define QFS_IOC_CLONE_TREE  _IOWR('Q', 17, struct qfs_clone_tree_args)

/* Bytes src_off..src_off+len of src_fd (len 0: to its end) into dst_fd at dst_off:
 * offsets on 4 KiB boundaries and equal, the length too unless the range ends at the
 * source's end. Returns the bytes cloned, or -1 with errno set. */
int64_t qfs_clone_range(int dst_fd, uint64_t dst_off, int src_fd, uint64_t src_off, uint64_t len);
/* A new entry dst holding a copy of the tree at src; 0 or -1 with errno set. */
int qfs_clone_tree(const char *src, const char *dst);

#ifdef __cplusplus
}
#endif
#endif
