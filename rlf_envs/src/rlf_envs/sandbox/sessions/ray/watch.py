"""The node watchdog of a ray session host: what makes a dead host (a SIGKILLed driver takes its host actors with it)
leave nothing on its node.

Each host actor starts one at start-up: `python -m rlf_envs.sandbox.sessions.ray.watch --pid P --start T ...`. It
detaches at once (a second fork in a new session: not a child of the actor, so not killed with it) and waits for the
actor process (pid + start time, so a reused pid is not mistaken for it) to be gone. Then it runs the node's reaper
for the host's inner backend until no label the actor owned is left (bounded): the local backend's owner labels
(`owners.reap`: SIGKILL what is left of each session, remove its cgroups and label; its mounts live only in the
session's mount namespace and go with its last process), or the docker backend's labelled containers of this host
whose owner is gone. Last it removes the host's seed cache. No Ray import: it runs as a bare process of the node.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

#: how long the watchdog keeps reaping after the actor is gone before it gives up (what is left: the next reap)
REAP_FOR_S = 120.0


def _detach() -> None:
    """Fork into a new session and let the first process exit: the watchdog is then no child of the host actor."""
    if os.fork() > 0:
        os._exit(0)
    os.setsid()


def watch(pid: int, start: int | None, inner: str, seeds: str | None, docker_url: str | None,
          poll_s: float = 0.5) -> int:
    from rlf_envs.sandbox.sessions import owners

    while owners.alive(pid, start):
        time.sleep(poll_s)
    left = 0
    deadline = time.monotonic() + REAP_FOR_S
    if inner == "local":
        while True:
            owners.reap("local")
            left = sum(1 for lab in owners.labels() if lab.owner_pid == pid and lab.owner_start == start)
            if not left or time.monotonic() > deadline:
                break
            time.sleep(1.0)
    elif inner == "docker":
        try:
            from rlf_envs.sandbox.sessions.docker import DockerBackend

            DockerBackend(base_url=docker_url, pool_size=0)  # reaps this host's containers of gone owners at start
        except Exception as e:  # no engine: nothing of ours can be running in it
            print(f"rlf session watchdog: docker reap failed: {e}", file=sys.stderr)
    if seeds:
        from rlf_envs.sandbox import cleanup

        cleanup.remove_tree(seeds, 60.0)
    return 1 if left else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--start", type=int, default=None)
    ap.add_argument("--inner", choices=("local", "docker"), default="local")
    ap.add_argument("--seeds", default=None)
    ap.add_argument("--docker-url", default=None)
    ap.add_argument("--foreground", action="store_true")
    a = ap.parse_args(argv)
    if not a.foreground:
        _detach()
    return watch(a.pid, a.start, a.inner, a.seeds, a.docker_url)


if __name__ == "__main__":
    sys.exit(main())
