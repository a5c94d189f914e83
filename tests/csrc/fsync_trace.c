// A record of a process's durability-relevant system calls, seen from outside Python: LD_PRELOADed into the save
// processes of tests/test_durability_trace.py, which rebuilds from it what a crash at any moment may leave on disk.
//
// Environment:
//   ZB_TRACE_ROOT  only calls on paths under this folder (absolute, no trailing slash) are recorded
//   ZB_TRACE_LOG   records go to "$ZB_TRACE_LOG.<pid>", one line each, appended with O_APPEND
//
// Each successful call is one tab-separated line, written after the call returned:
//   pid  tid  seq  t_ns  op  path  path2  value
// seq counts this process's records (atomically, across threads); t_ns is CLOCK_MONOTONIC, the same clock in every
// process of the machine (Python's time.monotonic_ns), so records of several ranks and threads can be merged. op is
//   open    a file opened to write (O_WRONLY, O_RDWR, O_CREAT or O_TRUNC; or fopen's "w", "a", "+"); value: the
//           open flags (hex)
//   write   bytes written to such a file (write, pwrite, writev, pwritev, sendfile, copy_file_range); value: bytes
//   trunc   truncate, ftruncate, and fclose of a file fopen opened to write; value: the (new) length
//   fsync   fsync, fdatasync, syncfs of a file or folder (its path from /proc/self/fd); value: the call's name
//   sync    sync(); path empty
//   mkdir   mkdir, mkdirat
//   rename  rename, renameat, renameat2: path -> path2; value: renameat2's flags
//   link    link, linkat, symlink, symlinkat: path2 is the new name
//   unlink  unlink, unlinkat, rmdir (value: 1 for a folder)
// Paths are absolute (a relative one is joined to the working folder or to its dirfd's path), not normalised.
// The logging itself goes straight to the kernel (syscall()), never through the functions it replaces.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define MAX_FDS 65536

static char trace_root[PATH_MAX];
static size_t trace_root_len;
static char trace_log[PATH_MAX];
static unsigned long sequence;
// 1 for a descriptor opened to write a file under the root (its writes are recorded); cleared when it is closed.
static unsigned char writing[MAX_FDS];

__attribute__((constructor)) static void setup(void) {
    const char *root = getenv("ZB_TRACE_ROOT"), *log = getenv("ZB_TRACE_LOG");
    if (root && log && strlen(root) < sizeof trace_root && strlen(log) + 16 < sizeof trace_log) {
        strcpy(trace_root, root);
        trace_root_len = strlen(root);
        while (trace_root_len > 1 && trace_root[trace_root_len - 1] == '/') trace_root[--trace_root_len] = 0;
        strcpy(trace_log, log);
    }
}

static int under_root(const char *path) {
    return trace_root_len && path && strncmp(path, trace_root, trace_root_len) == 0 &&
           (path[trace_root_len] == '/' || path[trace_root_len] == 0);
}

// The absolute path of `path` relative to `dirfd` (AT_FDCWD: the working folder), into `out`.
static void absolute(int dirfd, const char *path, char *out, size_t size) {
    out[0] = 0;
    if (!path) return;
    if (path[0] == '/') {
        snprintf(out, size, "%s", path);
        return;
    }
    char base[PATH_MAX];
    if (dirfd == AT_FDCWD) {
        if (!getcwd(base, sizeof base)) return;
    } else {
        char link[64];
        snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
        ssize_t n = readlink(link, base, sizeof base - 1);
        if (n < 0) return;
        base[n] = 0;
    }
    snprintf(out, size, "%s/%s", base, path);
}

static void fd_path(int fd, char *out, size_t size) {
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, out, size - 1);
    out[n < 0 ? 0 : n] = 0;
}

static void record(const char *op, const char *path, const char *path2, long long value) {
    if (!trace_root_len) return;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    unsigned long seq = __atomic_fetch_add(&sequence, 1, __ATOMIC_SEQ_CST);
    char line[3 * PATH_MAX];
    int n = snprintf(line, sizeof line, "%d\t%ld\t%lu\t%lld\t%s\t%s\t%s\t%llx\n", (int)getpid(),
                     (long)syscall(SYS_gettid), seq, (long long)now.tv_sec * 1000000000LL + now.tv_nsec, op,
                     path ? path : "", path2 ? path2 : "", value);
    if (n <= 0) return;
    if (n >= (int)sizeof line) n = sizeof line - 1;
    char name[PATH_MAX + 32];
    snprintf(name, sizeof name, "%s.%d", trace_log, (int)getpid());
    int saved = errno;
    int log = (int)syscall(SYS_openat, AT_FDCWD, name, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (log >= 0) {
        syscall(SYS_write, log, line, (size_t)n);
        syscall(SYS_close, log);
    }
    errno = saved;
}

// The next definition of `name` (libc's), looked up once; its type is the one this file defines.
#define REAL(name) \
    static __typeof__(&name) real_##name; \
    if (!real_##name) real_##name = (__typeof__(&name))dlsym(RTLD_NEXT, #name)

static void opened(int fd, int dirfd, const char *path, int flags) {
    if (fd < 0) return;
    int writes = (flags & (O_WRONLY | O_RDWR | O_CREAT | O_TRUNC)) != 0;
    char full[PATH_MAX];
    absolute(dirfd, path, full, sizeof full);
    int traced = writes && under_root(full);
    if (fd < MAX_FDS) writing[fd] = (unsigned char)traced;
    if (traced) record("open", full, "", flags);
}

static void wrote(int fd, long long bytes) {
    if (bytes < 0 || fd < 0 || fd >= MAX_FDS || !writing[fd]) return;
    char path[PATH_MAX];
    fd_path(fd, path, sizeof path);
    record("write", path, "", bytes);
}

static void synced(int fd, int result, long long which) {
    if (result != 0) return;
    char path[PATH_MAX];
    fd_path(fd, path, sizeof path);
    if (under_root(path)) record("fsync", path, "", which);
}

static void named(const char *op, int dirfd, const char *path, int dirfd2, const char *path2, long long value) {
    char full[PATH_MAX], full2[PATH_MAX];
    absolute(dirfd, path, full, sizeof full);
    absolute(dirfd2, path2, full2, sizeof full2);
    if (under_root(full) || under_root(full2)) record(op, full, full2, value);
}

static mode_t mode_of(int flags, va_list args) {
    return (flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE ? (mode_t)va_arg(args, int) : 0;
}

#define OPEN(name)                                                  \
    int name(const char *path, int flags, ...) {                    \
        va_list args;                                               \
        va_start(args, flags);                                      \
        mode_t mode = mode_of(flags, args);                         \
        va_end(args);                                               \
        REAL(name);                \
        int fd = real_##name(path, flags, mode);                    \
        opened(fd, AT_FDCWD, path, flags);                          \
        return fd;                                                  \
    }
OPEN(open)
OPEN(open64)

#define OPENAT(name)                                                \
    int name(int dirfd, const char *path, int flags, ...) {         \
        va_list args;                                               \
        va_start(args, flags);                                      \
        mode_t mode = mode_of(flags, args);                         \
        va_end(args);                                               \
        REAL(name);           \
        int fd = real_##name(dirfd, path, flags, mode);             \
        opened(fd, dirfd, path, flags);                             \
        return fd;                                                  \
    }
OPENAT(openat)
OPENAT(openat64)

// glibc's _FORTIFY_SOURCE entry points (open with a flags value unknown at compile time)
int __open_2(const char *path, int flags) {
    REAL(__open_2);
    int fd = real___open_2(path, flags);
    opened(fd, AT_FDCWD, path, flags);
    return fd;
}
int __open64_2(const char *path, int flags) {
    REAL(__open64_2);
    int fd = real___open64_2(path, flags);
    opened(fd, AT_FDCWD, path, flags);
    return fd;
}
int __openat_2(int dirfd, const char *path, int flags) {
    REAL(__openat_2);
    int fd = real___openat_2(dirfd, path, flags);
    opened(fd, dirfd, path, flags);
    return fd;
}
int __openat64_2(int dirfd, const char *path, int flags) {
    REAL(__openat64_2);
    int fd = real___openat64_2(dirfd, path, flags);
    opened(fd, dirfd, path, flags);
    return fd;
}

int creat(const char *path, mode_t mode) {
    REAL(creat);
    int fd = real_creat(path, mode);
    opened(fd, AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC);
    return fd;
}
int creat64(const char *path, mode_t mode) {
    REAL(creat64);
    int fd = real_creat64(path, mode);
    opened(fd, AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC);
    return fd;
}

// stdio: glibc's fopen opens with its own internal open, not the ones above, and libstdc++'s std::ofstream (torch.save
// to a path: Trainer's training_args.bin) opens through fopen and then writes with write(2) itself, so fopen's
// descriptor is registered here; fclose's internal close is not close() above, so it is cleared here, after the
// file's length is recorded (a trunc record: what stdio's own buffered writes added, which write() above misses).
static int fopen_flags(const char *mode) {
    int flags = 0;
    if (strchr(mode, 'w')) flags |= O_WRONLY | O_CREAT | O_TRUNC;
    if (strchr(mode, 'a')) flags |= O_WRONLY | O_CREAT | O_APPEND;
    if (strchr(mode, '+')) flags = (flags & ~O_WRONLY) | O_RDWR;
    return flags;
}

#define FOPEN(name)                                                         \
    FILE *name(const char *path, const char *mode) {                        \
        REAL(name);                                                         \
        FILE *file = real_##name(path, mode);                               \
        if (file && mode) opened(fileno(file), AT_FDCWD, path, fopen_flags(mode)); \
        return file;                                                        \
    }
FOPEN(fopen)
FOPEN(fopen64)

int fclose(FILE *file) {
    REAL(fclose);
    int fd = file ? fileno(file) : -1;
    if (fd >= 0 && fd < MAX_FDS && writing[fd]) {
        struct stat status;
        fflush(file);
        if (fstat(fd, &status) == 0) {
            char path[PATH_MAX];
            fd_path(fd, path, sizeof path);
            record("trunc", path, "", (long long)status.st_size);
        }
        writing[fd] = 0;
    }
    return real_fclose(file);
}

int close(int fd) {
    REAL(close);
    if (fd >= 0 && fd < MAX_FDS) writing[fd] = 0;
    return real_close(fd);
}

int dup2(int old, int fd) {
    REAL(dup2);
    int result = real_dup2(old, fd);
    if (result >= 0 && result < MAX_FDS) writing[result] = old >= 0 && old < MAX_FDS ? writing[old] : 0;
    return result;
}
int dup3(int old, int fd, int flags) {
    REAL(dup3);
    int result = real_dup3(old, fd, flags);
    if (result >= 0 && result < MAX_FDS) writing[result] = old >= 0 && old < MAX_FDS ? writing[old] : 0;
    return result;
}

ssize_t write(int fd, const void *data, size_t size) {
    REAL(write);
    ssize_t n = real_write(fd, data, size);
    wrote(fd, n);
    return n;
}
ssize_t pwrite(int fd, const void *data, size_t size, off_t offset) {
    REAL(pwrite);
    ssize_t n = real_pwrite(fd, data, size, offset);
    wrote(fd, n);
    return n;
}
ssize_t pwrite64(int fd, const void *data, size_t size, off_t offset) {
    REAL(pwrite64);
    ssize_t n = real_pwrite64(fd, data, size, offset);
    wrote(fd, n);
    return n;
}
ssize_t writev(int fd, const struct iovec *iov, int count) {
    REAL(writev);
    ssize_t n = real_writev(fd, iov, count);
    wrote(fd, n);
    return n;
}
ssize_t pwritev(int fd, const struct iovec *iov, int count, off_t offset) {
    REAL(pwritev);
    ssize_t n = real_pwritev(fd, iov, count, offset);
    wrote(fd, n);
    return n;
}
ssize_t sendfile(int out, int in, off_t *offset, size_t count) {
    REAL(sendfile);
    ssize_t n = real_sendfile(out, in, offset, count);
    wrote(out, n);
    return n;
}
ssize_t copy_file_range(int in, off_t *in_offset, int out, off_t *out_offset, size_t count, unsigned flags) {
    REAL(copy_file_range);
    ssize_t n = real_copy_file_range(in, in_offset, out, out_offset, count, flags);
    wrote(out, n);
    return n;
}

int ftruncate(int fd, off_t length) {
    REAL(ftruncate);
    int result = real_ftruncate(fd, length);
    if (result == 0 && fd >= 0 && fd < MAX_FDS && writing[fd]) {
        char path[PATH_MAX];
        fd_path(fd, path, sizeof path);
        record("trunc", path, "", length);
    }
    return result;
}
int truncate(const char *path, off_t length) {
    REAL(truncate);
    int result = real_truncate(path, length);
    if (result == 0) named("trunc", AT_FDCWD, path, AT_FDCWD, NULL, length);
    return result;
}

int fsync(int fd) {
    REAL(fsync);
    int result = real_fsync(fd);
    synced(fd, result, 0);
    return result;
}
int fdatasync(int fd) {
    REAL(fdatasync);
    int result = real_fdatasync(fd);
    synced(fd, result, 1);
    return result;
}
int syncfs(int fd) {
    REAL(syncfs);
    int result = real_syncfs(fd);
    synced(fd, result, 2);
    return result;
}
void sync(void) {
    REAL(sync);
    real_sync();
    record("sync", "", "", 0);
}

int mkdir(const char *path, mode_t mode) {
    REAL(mkdir);
    int result = real_mkdir(path, mode);
    if (result == 0) named("mkdir", AT_FDCWD, path, AT_FDCWD, NULL, 0);
    return result;
}
int mkdirat(int dirfd, const char *path, mode_t mode) {
    REAL(mkdirat);
    int result = real_mkdirat(dirfd, path, mode);
    if (result == 0) named("mkdir", dirfd, path, AT_FDCWD, NULL, 0);
    return result;
}

int rename(const char *old, const char *new) {
    REAL(rename);
    int result = real_rename(old, new);
    if (result == 0) named("rename", AT_FDCWD, old, AT_FDCWD, new, 0);
    return result;
}
int renameat(int olddirfd, const char *old, int newdirfd, const char *new) {
    REAL(renameat);
    int result = real_renameat(olddirfd, old, newdirfd, new);
    if (result == 0) named("rename", olddirfd, old, newdirfd, new, 0);
    return result;
}
int renameat2(int olddirfd, const char *old, int newdirfd, const char *new, unsigned flags) {
    REAL(renameat2);
    int result = real_renameat2(olddirfd, old, newdirfd, new, flags);
    if (result == 0) named("rename", olddirfd, old, newdirfd, new, flags);
    return result;
}

int link(const char *old, const char *new) {
    REAL(link);
    int result = real_link(old, new);
    if (result == 0) named("link", AT_FDCWD, old, AT_FDCWD, new, 0);
    return result;
}
int linkat(int olddirfd, const char *old, int newdirfd, const char *new, int flags) {
    REAL(linkat);
    int result = real_linkat(olddirfd, old, newdirfd, new, flags);
    if (result == 0) named("link", olddirfd, old, newdirfd, new, flags);
    return result;
}
int symlink(const char *target, const char *new) {
    REAL(symlink);
    int result = real_symlink(target, new);
    if (result == 0) named("link", AT_FDCWD, target, AT_FDCWD, new, 1);
    return result;
}
int symlinkat(const char *target, int newdirfd, const char *new) {
    REAL(symlinkat);
    int result = real_symlinkat(target, newdirfd, new);
    if (result == 0) named("link", AT_FDCWD, target, newdirfd, new, 1);
    return result;
}

int unlink(const char *path) {
    REAL(unlink);
    int result = real_unlink(path);
    if (result == 0) named("unlink", AT_FDCWD, path, AT_FDCWD, NULL, 0);
    return result;
}
int unlinkat(int dirfd, const char *path, int flags) {
    REAL(unlinkat);
    int result = real_unlinkat(dirfd, path, flags);
    if (result == 0) named("unlink", dirfd, path, AT_FDCWD, NULL, (flags & AT_REMOVEDIR) ? 1 : 0);
    return result;
}
int rmdir(const char *path) {
    REAL(rmdir);
    int result = real_rmdir(path);
    if (result == 0) named("unlink", AT_FDCWD, path, AT_FDCWD, NULL, 1);
    return result;
}

// syscall(): Rust's tempfile crate (safetensors' save_file: Trainer's model.safetensors) publishes its temporary file
// with a raw renameat2 (RENAME_NOREPLACE), which no function above sees. The calls the records above stand for are
// recorded here too when made through syscall(); the others pass straight through. (This file's own logging calls
// syscall() too: openat, write, close, gettid, none of them recorded.)
long syscall(long number, ...) {
    va_list args;
    va_start(args, number);
    long a[6];
    for (int i = 0; i < 6; i++) a[i] = va_arg(args, long);
    va_end(args);
    REAL(syscall);
    long result = real_syscall(number, a[0], a[1], a[2], a[3], a[4], a[5]);
    if (result < 0) return result;
    switch (number) {
    case SYS_renameat2:
        named("rename", (int)a[0], (const char *)a[1], (int)a[2], (const char *)a[3], a[4]);
        break;
    case SYS_renameat:
        named("rename", (int)a[0], (const char *)a[1], (int)a[2], (const char *)a[3], 0);
        break;
    case SYS_rename:
        named("rename", AT_FDCWD, (const char *)a[0], AT_FDCWD, (const char *)a[1], 0);
        break;
    case SYS_linkat:
        named("link", (int)a[0], (const char *)a[1], (int)a[2], (const char *)a[3], a[4]);
        break;
    case SYS_unlinkat:
        named("unlink", (int)a[0], (const char *)a[1], AT_FDCWD, NULL, (a[2] & AT_REMOVEDIR) ? 1 : 0);
        break;
    case SYS_unlink:
        named("unlink", AT_FDCWD, (const char *)a[0], AT_FDCWD, NULL, 0);
        break;
    case SYS_mkdirat:
        named("mkdir", (int)a[0], (const char *)a[1], AT_FDCWD, NULL, 0);
        break;
    case SYS_fsync:
    case SYS_fdatasync:
        synced((int)a[0], 0, 0);
        break;
    }
    return result;
}
