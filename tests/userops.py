"""Helpers the parity tests share: results as the kernel's errno names, and calls made
as another user (in a child process, so the test itself stays root)."""
import errno
import os


def name(e):
    return errno.errorcode.get(e, str(e))


def attempt(f, *a):
    """f(*a)'s result: "ok", "ok VALUE", or the errno's name."""
    try:
        r = f(*a)
        return "ok" if r is None else f"ok {r}"
    except OSError as e:
        return name(e.errno)


def as_user(uid, groups, f, *a):
    """attempt(f, *a) in a child running as uid with groups (the first is its gid)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgroups(groups)
            os.setresgid(groups[0], groups[0], groups[0])
            os.setresuid(uid, uid, uid)
            out = attempt(f, *a)
        except BaseException as e:  # noqa: BLE001 - reported, never raised in the child
            out = f"child failed: {e}"
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    out = b""
    while chunk := os.read(r, 4096):
        out += chunk
    os.waitpid(pid, 0)
    os.close(r)
    return out.decode()
