"""The run's seccomp filter (no keyrings, sockets of the families a run needs only, no io_uring) and dropping the
capabilities a forked worker keeps in a user namespace.

Stdlib only, like every module the supervisor loads: it runs with a bare interpreter (see `_supervisor`).
"""

from __future__ import annotations

import ctypes
import errno
from typing import Any

from rlf_envs.sandbox._base import _check, _libc

#: the seccomp filter every run gets (`_seccomp`), per audit arch: the kernel's key management calls (add_key,
#: request_key, keyctl) fail with EPERM; socket and socketpair only for SOCKET_FAMILIES (others EAFNOSUPPORT); io_uring
#: (whose IORING_OP_SOCKET opens a socket without socket(2)) fails with ENOSYS; on i386 the multiplexed socketcall,
#: whose arguments a filter cannot read, fails with EPERM (our interpreter is 64-bit: only an `int 0x80` gets there).
#: x32 calls are x86_64 numbers with bit 30 set (masked off below).
AUDIT_ARCH_X86_64, AUDIT_ARCH_I386, AUDIT_ARCH_AARCH64, AUDIT_ARCH_ARM = 0xC000003E, 0x40000003, 0xC00000B7, 0x40000028
KEY_SYSCALLS = {AUDIT_ARCH_X86_64: (248, 249, 250), AUDIT_ARCH_I386: (286, 287, 288),
                AUDIT_ARCH_AARCH64: (217, 218, 219), AUDIT_ARCH_ARM: (309, 310, 311)}
#: (socket, socketpair) per arch
SOCKET_SYSCALLS = {AUDIT_ARCH_X86_64: (41, 53), AUDIT_ARCH_I386: (359, 360), AUDIT_ARCH_AARCH64: (198, 199),
                   AUDIT_ARCH_ARM: (281, 288)}
SOCKETCALL_SYSCALLS = {AUDIT_ARCH_I386: (102,)}
IO_URING_SYSCALLS = (425, 426, 427)  # io_uring_setup, _enter, _register: the same on every arch
#: kernel interfaces a run has no use for, refused with EPERM (attack surface: the usual first steps of a kernel
#: exploit): unshare and setns (new namespaces inside a run: a nested user namespace holds every capability in it),
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
#: the only socket families a run may open: local sockets and IP (which its network namespace isolates). Not AF_VSOCK
#: (not namespaced: a channel between runs and to the hypervisor), AF_NETLINK (glibc's getaddrinfo falls back without
#: it), AF_PACKET, AF_BLUETOOTH, AF_ALG, ... (kernel attack surface a Python program does not need)
SOCKET_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10}
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _seccomp_filter() -> list[tuple[int, int, int, int]]:
    """The classic BPF program of `_seccomp` (see KEY_SYSCALLS): per known arch, the refused calls return their
    errno and socket/socketpair are allowed for SOCKET_FAMILIES only (their first argument, an int: the low word);
    all else, and every other arch, is allowed. Assembled with symbolic labels (jumps are forward only)."""
    ld_w_abs, jeq_k, jset_k, alu_and_k, ret_k = 0x20, 0x15, 0x45, 0x54, 0x06
    prog: list[tuple[int, int, Any, Any]] = []  # (code, jt label, jf label, k); labels resolved below
    labels: dict[str, int] = {}

    def label(name: str) -> None:
        labels[name] = len(prog)

    def jeq(k: int, jt: str | int = 0, jf: str | int = 0) -> None:
        prog.append((jeq_k, jt, jf, k))  # type: ignore[arg-type]

    for arch in KEY_SYSCALLS:
        a = f"a{arch}"
        prog.append((ld_w_abs, 0, 0, 4))  # seccomp_data.arch
        jeq(arch, 0, f"{a}_end")
        prog.append((ld_w_abs, 0, 0, 0))  # seccomp_data.nr
        if arch == AUDIT_ARCH_X86_64:
            prog.append((alu_and_k, 0, 0, 0xBFFFFFFF))  # x32 numbers are x86_64's + 0x40000000
        for nr in (KEY_SYSCALLS[arch] + SOCKETCALL_SYSCALLS.get(arch, ()) + NAMESPACE_SYSCALLS[arch]
                   + SURFACE_SYSCALLS[arch]):
            jeq(nr, "eperm")
        for nr in (*IO_URING_SYSCALLS, CLONE3):
            jeq(nr, "enosys")
        for nr in SOCKET_SYSCALLS[arch]:
            jeq(nr, "family")
        jeq(CLONE_SYSCALLS[arch], "clone")
        prog.append((ret_k, 0, 0, SECCOMP_RET_ALLOW))
        label(f"{a}_end")
    prog.append((ret_k, 0, 0, SECCOMP_RET_ALLOW))  # an arch we do not know
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

        out.append((code, off(jt), off(jf), k) if code in (jeq_k, jset_k) else (code, 0, 0, k))
    return out


def _seccomp() -> None:
    """The run's seccomp filter (after PR_SET_NO_NEW_PRIVS; inherited by every process the code starts, kept across
    exec): no kernel keyrings -- keys outlive processes, a key added to a user keyring stays until reboot, its
    serial is listed in /proc/keys and, opened to all, any uid can read it: a channel from one run to the next, and
    per-uid kernel memory that one uid per run never gives back; sockets of SOCKET_FAMILIES only (AF_VSOCK is not
    isolated by the network namespace); no io_uring; no new namespaces (unshare, setns, clone with a CLONE_NEW* flag,
    clone3) and no bpf, perf_event_open or userfaultfd. Python code has no use for any of them."""
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
