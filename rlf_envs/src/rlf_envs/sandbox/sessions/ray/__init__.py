"""The ray session backend: sandbox sessions placed across the nodes of a Ray cluster, with the protocol and the
guarantees they have on one machine. `open_backend("ray", address=...)`; needs the `ray` extra
(`pip install -e './rlf_envs[ray]'`). Importing this package does not import Ray (`RayBackend()` does).

    driver (RayBackend) ──create / call / close, each with a deadline──▶ host actor on node A ─▶ LocalBackend (A)
         │   placement: least loaded host under its cap                  host actor on node B ─▶ LocalBackend (B)
         └── pings every 5 s (health, the hosts' own counts, leases)     ... one per selected node

- One long-lived host actor per selected node (`host.py`), pinned there (hard node affinity, `num_cpus=0`, no Ray
  restarts), owning that node's `local` (or `docker`) backend: the sessions' processes, limits, owner labels,
  warm pool and reaper are that backend's, on its node.
- Nodes: `NodeSelector` (Ray node labels, a custom resource; default: the nodes without GPUs when there are any).
- Placement (`RayBackend._pick`): the least loaded healthy host relative to its cap, ties at random; a host refuses
  a create past its `per_node_cap` and passes creates through its own rate limit (`creates_per_node_s`); the load
  counted is the host's own (live, starting and closing sessions of every client).
- Failures stay local: a host actor or node that dies fails only its sessions, as SessionInfraError (infrastructure
  failures, dropped from the loss); the host cools down (30 s, doubling) and is started again while its node is
  alive; a node that joins later and matches the selector gets a host.
- Nothing left behind: host actors are owned by the driver (not detached), so Ray kills them with it; each host's
  node watchdog (`watch.py`) then reaps its sessions there. A client a host stops hearing from for `lease_s` has its
  sessions closed by the host.
"""

from __future__ import annotations

from rlf_envs.sandbox.sessions.ray.backend import HostInfo, NodeInfo, NodeSelector, RayBackend, RaySession

__all__ = ["HostInfo", "NodeInfo", "NodeSelector", "RayBackend", "RaySession"]
