/* Write a file, then rename it into place, with the rename ordered after the data by
 * patchgroups instead of an fsync in between. Build:
 *   cc -I crates/pg/include ordered_rename.c -L target/release -lquilt_pg -o ordered_rename
 * Run: ./ordered_rename MOUNTPOINT   (LD_LIBRARY_PATH=target/release) */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "quiltfs_pg.h"

static int fail(int fd, const char *what) {
    char why[QFS_PG_ERROR_LEN];
    int e = errno;
    if (fd < 0 || qfs_pg_strerror(fd, why, sizeof why) != 0)
        snprintf(why, sizeof why, "%s", strerror(e));
    fprintf(stderr, "%s: %s\n", what, why);
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s MOUNTPOINT\n", argv[0]);
        return 2;
    }
    int fd = qfs_pg_open(argv[1]);
    if (fd < 0)
        return fail(-1, "opening the control file");
    int64_t data = qfs_pg_create(fd);
    if (data < 0 || qfs_pg_release(fd, data) || qfs_pg_engage(fd, data))
        return fail(fd, "starting the data group");

    char tmp[4096], dst[4096];
    snprintf(tmp, sizeof tmp, "%s/note.tmp", argv[1]);
    snprintf(dst, sizeof dst, "%s/note", argv[1]);
    FILE *f = fopen(tmp, "w");
    if (!f || fputs("written before it was named\n", f) < 0 || fclose(f))
        return fail(fd, "writing");
    if (qfs_pg_disengage(fd, data))
        return fail(fd, "disengage");

    int64_t name = qfs_pg_create_after(fd, data);
    if (name < 0 || qfs_pg_engage(fd, name))
        return fail(fd, "starting the rename group");
    if (rename(tmp, dst))
        return fail(fd, "rename");
    if (qfs_pg_disengage(fd, name) || qfs_pg_sync(fd, name))
        return fail(fd, "sync");
    /* A broken rule is a clear error: a group others depend on cannot be engaged. */
    if (qfs_pg_engage(fd, data) == 0) {
        fprintf(stderr, "engaging a group with afters should fail\n");
        return 1;
    }
    char why[QFS_PG_ERROR_LEN];
    qfs_pg_strerror(fd, why, sizeof why);
    printf("refused as expected: %s\n", why);
    qfs_pg_abandon(fd, data);
    qfs_pg_abandon(fd, name);
    qfs_pg_close(fd);
    printf("ok\n");
    return 0;
}
