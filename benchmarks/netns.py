"""Network namespaces for a chaos run's partitions (`failover-chaos --kinds primary-partition`).

The run first moves into a network namespace of its own (`enter_private_network` execs the command again under
`unshare --net`), so that nothing it builds touches the host's network. There `Network` makes two bridges, side A
and side B, gives the run itself an address on A (`HOST`), and gives each node that asks (`node`) a namespace of its
own with one end of a veth pair on A. A partition moves some nodes' veths to B: those nodes still reach each other
(their open TCP connections live on), and nobody on A reaches them, or they anybody there, until `heal` moves them
back. Every address is on a private /24 inside the run's own namespace. It needs root (`ip netns`, bridges, veths).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterable

from pipeline.local import Place

SUBNET = "10.77.0"
HOST = f"{SUBNET}.254"
"""The run's own address on side A: its Sentinels bind it, and every client outside a namespace reaches the nodes
from it."""
_INSIDE = "ROLLOUTS_PRIVATE_NETWORK"


def why_not() -> str | None:
    """Why partitions cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "partitions need root (network namespaces, bridges, veths): run as root, or leave primary-partition out"
    missing = [tool for tool in ("ip", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"partitions need {' and '.join(missing)} (iproute2, util-linux): install them, or leave it out"
    probe = "ip link add p0 type bridge && ip link add p1 type veth peer name p2"
    made = subprocess.run(["unshare", "--net", "--", "sh", "-c", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"this kernel makes no bridge or veth in a network namespace ({made.stderr.strip()}): leave it out"
    return None


def enter_private_network() -> None:
    """Run this command again in a network namespace of its own (its loopback up), unless it already is there."""
    if os.environ.get(_INSIDE) == "1":
        _ip("link", "set", "lo", "up")
        return
    env = {**os.environ, _INSIDE: "1"}
    os.execvpe("unshare", ["unshare", "--net", "--", sys.executable, *sys.orig_argv[1:]], env)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def process_tag(pid: int, tag: str = "rs") -> str:
    """What the names of every namespace, veth and bridge that process `pid` makes begin with."""
    return f"{tag}{pid % 100_000}"


class Network:
    """Two bridges and a namespace a node, inside the run's own network namespace (`enter_private_network` first)."""

    made = 0
    """Networks made by this process: each has names of its own (a namespace's deletion finishes in the background)."""

    def __init__(self, tag: str = "rs") -> None:
        Network.made += 1
        self.tag = f"{process_tag(os.getpid(), tag)}{chr(ord('a') + Network.made % 26)}"
        self.side_a, self.side_b = f"{self.tag}A", f"{self.tag}B"
        self.nodes: dict[str, int] = {}
        """Node name -> its index: its namespace is `{tag}-{index}`, its address `{SUBNET}.{index + 1}`."""
        for bridge in (self.side_a, self.side_b):
            _ip("link", "add", bridge, "type", "bridge")
            _ip("link", "set", bridge, "up")
        _ip("addr", "add", f"{HOST}/24", "dev", self.side_a)

    def node(self, name: str) -> Place:
        """A namespace of its own for `name`, on side A: where to start its processes."""
        index = self.nodes.setdefault(name, len(self.nodes))
        ns, outside = self._namespace(index), self._veth(index)
        _ip("netns", "add", ns)
        _ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", ns, "addr", "add", f"{SUBNET}.{index + 1}/24", "dev", "eth0")
        for link in ("lo", "eth0"):
            _ip("-n", ns, "link", "set", link, "up")
        _ip("link", "set", outside, "master", self.side_a, "up")
        return Place(f"{SUBNET}.{index + 1}", ("ip", "netns", "exec", ns))

    def partition(self, names: Iterable[str]) -> None:
        """Cut `names` off from everyone else: they reach each other only."""
        for name in names:
            _ip("link", "set", self._veth(self.nodes[name]), "master", self.side_b)

    def heal(self) -> None:
        for index in self.nodes.values():
            _ip("link", "set", self._veth(index), "master", self.side_a)

    def close(self) -> None:
        """Delete the namespaces (their veths go with them) and the bridges."""
        for index in self.nodes.values():
            subprocess.run(["ip", "netns", "delete", self._namespace(index)], capture_output=True)
        self.nodes.clear()
        for bridge in (self.side_a, self.side_b):
            subprocess.run(["ip", "link", "delete", bridge], capture_output=True)

    def _namespace(self, index: int) -> str:
        return f"{self.tag}-{index}"

    def _veth(self, index: int) -> str:
        return f"{self.tag}v{index}"
