"""The one seccomp filter of everything untrusted the sandbox runs -- a stateless run (`_workerproc`) and every exec
of a session (`sessions/_agent.py`) -- and dropping the capabilities a forked worker keeps in a user namespace.

Stdlib only, like every module the supervisor and the session agent load: they run with a bare interpreter (see
`_supervisor`).
"""

from __future__ import annotations

import ctypes
import errno
import platform
from typing import Any

from rlf_envs.sandbox._base import _check, _libc

#: the filter (`_seccomp`), for the native arch of this interpreter: the kernel's key management calls (add_key,
#: request_key, keyctl) fail with EPERM; socket and socketpair only for SOCKET_FAMILIES (others EAFNOSUPPORT); io_uring
#: (whose IORING_OP_SOCKET opens a socket without socket(2)) fails with ENOSYS; every call of a foreign ABI (i386's
#: `int 0x80` on x86_64, x32, arm on aarch64), which a native program never makes, fails with EPERM -- the compat
#: paths are kernel surface of their own, and rules read per arch would leave, say, i386's multiplexed socketcall
#: (whose arguments a filter cannot read) open.
AUDIT_ARCH_X86_64, AUDIT_ARCH_I386, AUDIT_ARCH_AARCH64, AUDIT_ARCH_ARM = 0xC000003E, 0x40000003, 0xC00000B7, 0x40000028
#: the audit arch of an interpreter's `platform.machine()`; an arch without one here runs without a filter
NATIVE_ARCH = {"x86_64": AUDIT_ARCH_X86_64, "amd64": AUDIT_ARCH_X86_64, "aarch64": AUDIT_ARCH_AARCH64,
               "arm64": AUDIT_ARCH_AARCH64, "i386": AUDIT_ARCH_I386, "i686": AUDIT_ARCH_I386,
               "armv7l": AUDIT_ARCH_ARM, "armv6l": AUDIT_ARCH_ARM}
KEY_SYSCALLS = {AUDIT_ARCH_X86_64: (248, 249, 250), AUDIT_ARCH_I386: (286, 287, 288),
                AUDIT_ARCH_AARCH64: (217, 218, 219), AUDIT_ARCH_ARM: (309, 310, 311)}
#: (socket, socketpair) per arch
SOCKET_SYSCALLS = {AUDIT_ARCH_X86_64: (41, 53), AUDIT_ARCH_I386: (359, 360), AUDIT_ARCH_AARCH64: (198, 199),
                   AUDIT_ARCH_ARM: (281, 288)}
#: i386's multiplexed socketcall, whose arguments a filter cannot read: EPERM (glibc uses socket(2) where it exists)
SOCKETCALL_SYSCALLS = {AUDIT_ARCH_I386: (102,)}
IO_URING_SYSCALLS = (425, 426, 427)  # io_uring_setup, _enter, _register: the same on every arch
#: x32 calls are x86_64 numbers with this bit set
X32_SYSCALL_BIT = 0x40000000
#: kernel interfaces untrusted code has no use for, refused with EPERM (attack surface: the usual first steps of a
#: kernel exploit): unshare and setns (new namespaces: a nested user namespace holds every capability in it),
#: bpf, perf_event_open, userfaultfd
NAMESPACE_SYSCALLS = {AUDIT_ARCH_X86_64: (272, 308), AUDIT_ARCH_I386: (310, 346), AUDIT_ARCH_AARCH64: (97, 268),
                      AUDIT_ARCH_ARM: (337, 375)}
SURFACE_SYSCALLS = {AUDIT_ARCH_X86_64: (321, 298, 323), AUDIT_ARCH_I386: (357, 336, 374),
                    AUDIT_ARCH_AARCH64: (280, 241, 282), AUDIT_ARCH_ARM: (386, 364, 388)}
#: clone per arch: refused (EPERM) when its flags (the first argument) ask for a new namespace; clone3, whose flags a
#: filter cannot read (they are in memory), fails with ENOSYS, and glibc falls back to clone (as under Docker's profile)
CLONE_SYSCALLS = {AUDIT_ARCH_X86_64: 56, AUDIT_ARCH_I386: 120, AUDIT_ARCH_AARCH64: 220, AUDIT_ARCH_ARM: 120}
CLONE3 = 435
CLONE_NEW_FLAGS = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
#: the only socket families untrusted code may open: local sockets and IP (which its network namespace isolates). Not
#: AF_VSOCK (not namespaced: a channel between runs and sessions, and to the hypervisor), AF_NETLINK (glibc's
#: getaddrinfo falls back without it), AF_PACKET, AF_BLUETOOTH, AF_ALG, ... (kernel attack surface a program run
#: in a sandbox -- Python, a shell, git, pytest, pip -- does not need)
SOCKET_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10}
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _seccomp_filter(machine: str | None = None) -> list[tuple[int, int, int, int]]:
    """The classic BPF program of `_seccomp` for `machine` (default: this interpreter's; see the tables above): on
    the native arch the refused calls return their errno and socket/socketpair are allowed for SOCKET_FAMILIES only
    (their first argument, an int: the low word); every other arch (and x32) gets EPERM; all else is allowed. On an
    arch without tables, the program allows everything. Assembled with symbolic labels (jumps are forward only)."""
    ld_w_abs, jeq_k, jge_k, jset_k, ret_k = 0x20, 0x15, 0x35, 0x45, 0x06
    arch = NATIVE_ARCH.get(machine if machine is not None else platform.machine())
    if arch is None:
        return [(ret_k, 0, 0, SECCOMP_RET_ALLOW)]
    prog: list[tuple[int, Any, Any, int]] = []  # (code, jt label, jf label, k); labels resolved below
    labels: dict[str, int] = {}

    def label(name: str) -> None:
        labels[name] = len(prog)

    def jeq(k: int, jt: str | int = 0, jf: str | int = 0) -> None:
        prog.append((jeq_k, jt, jf, k))

    prog.append((ld_w_abs, 0, 0, 4))  # seccomp_data.arch
    jeq(arch, 0, "eperm")  # a foreign ABI
    prog.append((ld_w_abs, 0, 0, 0))  # seccomp_data.nr
    if arch == AUDIT_ARCH_X86_64:
        prog.append((jge_k, "eperm", 0, X32_SYSCALL_BIT))  # x32 (and anything above)
    refused = KEY_SYSCALLS[arch] + SOCKETCALL_SYSCALLS.get(arch, ()) + NAMESPACE_SYSCALLS[arch] + SURFACE_SYSCALLS[arch]
    for nr in refused:
        jeq(nr, "eperm")
    for nr in (*IO_URING_SYSCALLS, CLONE3):
        jeq(nr, "enosys")
    for nr in SOCKET_SYSCALLS[arch]:
        jeq(nr, "family")
    jeq(CLONE_SYSCALLS[arch], "clone")
    prog.append((ret_k, 0, 0, SECCOMP_RET_ALLOW))
    label("clone")
    prog.append((ld_w_abs, 0, 0, 16))  # seccomp_data.args[0], low 32 bits: the flags
    prog.append((jset_k, "eperm", 0, CLONE_NEW_FLAGS))
    prog.append((ret_k, 0, 0, SECCOMP_RET_ALLOW))
    label("family")
    prog.append((ld_w_abs, 0, 0, 16))  # seccomp_data.args[0], low 32 bits (little-endian)
    for fam in SOCKET_FAMILIES.values():
        jeq(fam, "allow")
    prog.append((ret_k, 0, 0, SECCOMP_RET_ERRNO | errno.EAFNOSUPPORT))
    label("allow")
    prog.append((ret_k, 0, 0, SECCOMP_RET_ALLOW))
    label("eperm")
    prog.append((ret_k, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM))
    label("enosys")
    prog.append((ret_k, 0, 0, SECCOMP_RET_ERRNO | errno.ENOSYS))
    out: list[tuple[int, int, int, int]] = []
    for i, (code, jt, jf, k) in enumerate(prog):
        def off(target: str | int, i: int = i) -> int:
            if isinstance(target, int):
                return target
            d = labels[target] - i - 1
            assert 0 <= d < 256, "seccomp jump out of range"
            return d

        out.append((code, off(jt), off(jf), k) if code in (jeq_k, jge_k, jset_k) else (code, 0, 0, k))
    return out


def _seccomp() -> None:
    """The run's seccomp filter (after PR_SET_NO_NEW_PRIVS; inherited by every process the code starts, kept across
    exec; after the uid drop, as the last step before the untrusted code: `_workerproc` for a run, the session agent
    for an exec): no kernel keyrings -- keys outlive processes, a key added to a user keyring stays until reboot, its
    serial is listed in /proc/keys and, opened to all, any uid can read it: a channel from one run to the next, and
    per-uid kernel memory that one uid per run never gives back; sockets of SOCKET_FAMILIES only (AF_VSOCK is not
    isolated by the network namespace); no io_uring; no new namespaces (unshare, setns, clone with a CLONE_NEW* flag,
    clone3), no bpf, perf_event_open or userfaultfd, no foreign ABI. Neither Python code nor a shell session (bash,
    git, pytest, pip, threads, subprocesses) has a use for any of them."""
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(_seccomp_prog()), 0, 0), "seccomp")


_PROG: tuple[Any, Any] | None = None


def _seccomp_prog() -> Any:
    """The filter of `_seccomp` as the kernel takes it; made once per process (the zygote's forks inherit it)."""
    global _PROG
    if _PROG is None:
        ins = _seccomp_filter()
        arr = (_SockFilter * len(ins))(*[_SockFilter(*i) for i in ins])
        _PROG = (arr, _SockFprog(len(ins), ctypes.cast(arr, ctypes.POINTER(_SockFilter))))
    return _PROG[1]


def _drop_capabilities() -> None:
    """Empty effective, permitted and inheritable sets (capset): a worker forked inside a user namespace holds every
    capability there until it execs, enough to undo its mounts."""
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(_libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset")
