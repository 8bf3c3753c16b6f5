"""What a sandbox run's namespaces cost in the kernel: fork() + unshare(flags) + exit, timed per run.

    python benchmarks/sandbox_namespaces.py [--runs 40] [--rounds 2]      (Linux; root or user namespaces)

Wall time per run and the CPU time charged to the child. The difference is work the kernel does outside the
process (notably a network namespace's teardown), which no rlimit or CPU accounting of the run sees.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MODES = {"fork + exit": 0, "+ mount, pid, ipc, uts": CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS}
MODES["+ network"] = MODES["+ mount, pid, ipc, uts"] | CLONE_NEWNET
MODES["network only"] = CLONE_NEWNET


def per_run(libc: ctypes.CDLL, flags: int, runs: int) -> tuple[float, float]:
    """(wall ms, child CPU ms) per fork + unshare(flags) + exit."""
    t0, c0 = time.perf_counter(), os.times()
    for _ in range(runs):
        pid = os.fork()
        if pid == 0:
            os._exit(0 if libc.unshare(flags) == 0 else 1)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise SystemExit(f"unshare({flags:#x}) refused: run as root (or with unprivileged user namespaces)")
    c1 = os.times()
    cpu = (c1.children_user + c1.children_system) - (c0.children_user + c0.children_system)
    return (time.perf_counter() - t0) / runs * 1e3, cpu / runs * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    libc = ctypes.CDLL(None, use_errno=True)
    for _ in range(args.rounds):
        for name, flags in MODES.items():
            wall, cpu = per_run(libc, flags, args.runs)
            print(f"{name:24s} wall {wall:6.2f} ms/run   child CPU {cpu:5.2f} ms/run")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
