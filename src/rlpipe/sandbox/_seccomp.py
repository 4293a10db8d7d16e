"""The seccomp filter applied to sandboxed code, compiled to a classic-BPF program with pyseccomp.

The filter allows by default and denies, with an errno (never a kill, so the code sees a normal
failure it can report):

* sockets of any family but AF_UNIX (``socket``/``socketpair``): no network, no netlink;
* ``ptrace`` and the calls that read or write another process's memory or fds;
* every mount-family call, ``chroot``, ``pivot_root``;
* ``unshare``, ``setns``, and ``clone`` with a namespace flag; ``clone3`` answers ENOSYS (its flags
  sit in memory a filter cannot read) so libc falls back to ``clone``;
* ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring_*``, the keyring calls;
* ``kill``/``tgkill``/``rt_sigqueueinfo`` aimed at a process group or at everything (pid <= -1)
  and at pid 1 (inside the sandbox that is the namespace's init; outside it would be the host's);
* ``ioctl(TIOCSTI/TIOCLINUX)`` (pushing keystrokes into a terminal);
* a list of administrative calls that need privileges the sandbox never has (modules, reboot,
  clock setting, swap, quotas, …) as defence in depth.

System calls of another architecture (i386 ``int 0x80``, x32) kill the process.
"""

from __future__ import annotations

import errno
import io
import os
import socket

from rlpipe.sandbox._once import Once

__all__ = ["build_bpf", "seccomp_version", "DENIED_SYSCALLS"]

# Denied outright with EPERM. Names unknown to the installed libseccomp are skipped.
DENIED_SYSCALLS: tuple[str, ...] = (
    # debugging / other processes' memory and fds
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    # mounts and filesystem roots
    "mount", "umount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr",
    # namespaces
    "unshare", "setns",
    # kernel attack surface rarely needed by ordinary programs
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key", "fanotify_init", "open_by_handle_at", "name_to_handle_at",
    "lookup_dcookie", "syslog", "vhangup", "iopl", "ioperm", "modify_ldt", "uselib", "nfsservctl",
    # administrative
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
    "swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "settimeofday", "clock_settime",
    "clock_adjtime", "adjtimex", "sethostname", "setdomainname",
)

# clone(2) flags that create namespaces (CLONE_NEWTIME shares its bit with the exit-signal byte of
# clone(2), so it is only reachable through unshare/clone3, which are denied anyway).
_CLONE_NS_FLAGS = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)
_TIOCSTI = 0x5412
_TIOCLINUX = 0x541C
_LOW32 = 0xFFFFFFFF
_SIGN32 = 0x80000000


def seccomp_version() -> str:
    """'pyseccomp X / libseccomp a.b.c', or raise if either is missing."""
    import ctypes

    import pyseccomp

    lib = pyseccomp._libseccomp  # noqa: SLF001 - the loaded libseccomp, for its version
    lib.seccomp_version.restype = ctypes.c_void_p
    ver = ctypes.cast(lib.seccomp_version(), ctypes.POINTER(ctypes.c_uint * 3)).contents
    return f"pyseccomp {pyseccomp.__version__} / libseccomp {ver[0]}.{ver[1]}.{ver[2]}"


def _compile() -> bytes:
    import pyseccomp as sc

    f = sc.SyscallFilter(defaction=sc.ALLOW)
    f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    eperm = sc.ERRNO(errno.EPERM)

    def rule(action: int, name: str, *args) -> None:
        try:
            nr = sc.resolve_syscall(sc.Arch.NATIVE, name)
        except Exception:  # pragma: no cover - depends on libseccomp
            return
        if nr is None or nr < 0:  # unknown to this libseccomp / not on this arch
            return
        f.add_rule(action, nr, *args)

    for name in DENIED_SYSCALLS:
        rule(eperm, name)
    rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for flag in _CLONE_NS_FLAGS:
        rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    # Sockets: only AF_UNIX. NE compares all 64 bits, so junk in the upper half is denied too.
    for name in ("socket", "socketpair"):
        rule(eperm, name, sc.Arg(0, sc.NE, socket.AF_UNIX))
    # Signals: pid_t is 32 bits; test its sign bit and its low word so sign- or zero-extension
    # by the caller cannot slip past.
    for name in ("kill", "rt_sigqueueinfo", "tgkill"):
        rule(eperm, name, sc.Arg(0, sc.MASKED_EQ, _SIGN32, _SIGN32))
        rule(eperm, name, sc.Arg(0, sc.MASKED_EQ, _LOW32, 1))
    rule(eperm, "tkill", sc.Arg(0, sc.MASKED_EQ, _LOW32, 1))
    for req in (_TIOCSTI, _TIOCLINUX):
        rule(eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, _LOW32, req))

    fd = os.memfd_create("rlpipe-seccomp")
    try:
        with io.FileIO(fd, "r+", closefd=False) as fh:
            f.export_bpf(fh)
            fh.seek(0)
            data = fh.read()
    finally:
        os.close(fd)
    if not data or len(data) % 8:
        raise RuntimeError(f"libseccomp exported a malformed BPF program ({len(data)} bytes)")
    return data


_bpf: Once[bytes] = Once(_compile)


def build_bpf() -> bytes:
    """The compiled filter (cached for the process). Raises if pyseccomp/libseccomp is unusable."""
    return _bpf.get()
