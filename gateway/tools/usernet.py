"""The network of a sandbox with the network on (gateway/tools/sandbox.py): the sandbox has
a network namespace of its own, and a user-mode network stack, started by the gateway
against that namespace before the command runs, connects it to the outside.

The stack makes the connections on the host, as the gateway's user, to the addresses the
sandbox asked for, except the host's loopback: the sandbox's 127.0.0.1 and ::1 are its own,
the stack maps no port of the host's loopback into the sandbox (nor the sandbox's onto the
host), and the stack's gateway address leads to the real network, not to the host's
loopback. So the gateway's own HTTP API on 127.0.0.1 is out of reach, as is every other
loopback service of the host, abstract Unix sockets included (they belong to a network
namespace). What stays reachable is what any machine on the network reaches: the host's
other addresses, the local network, the internet.

Inside: the address 10.0.2.100/24, the gateway 10.0.2.2 and a resolver at 10.0.2.3
(the conventional slirp addresses), and with pasta the host's IPv6 address and routes.

Two programs can do it:
- pasta (passt), preferred: `--no-map-gw` (the gateway address is not the host), `-T none
  -U none` (no port of the host's loopback forwarded into the namespace), `-t none -u none`
  (nothing of the sandbox listens on the host); `--dns-forward 10.0.2.3` maps UDP port 53
  of that address, and nothing else, to the host's first resolver (on the host's loopback
  when that is where it is, e.g. systemd-resolved's 127.0.0.53).
- slirp4netns, else: `--disable-host-loopback`, and its built-in resolver off (it forwards
  every port of 10.0.2.3, not only 53, to the host's resolver, which may be on the host's
  loopback): the sandbox is given the host's resolvers that are not loopback addresses, and
  none (so no names) when the host only has a loopback resolver.

The stack is started through `setpriv --pdeathsig KILL`: it dies with the gateway, like the
sandbox (bwrap's --die-with-parent). The sandbox kills it when it ends.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

ADDRESS = "10.0.2.100"
PREFIX = 24
GATEWAY = "10.0.2.2"
RESOLVER = "10.0.2.3"
SEARCH_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"


@dataclass(frozen=True, slots=True)
class Stack:
    """One user-mode network program and how it is told what to do."""

    kind: str  # "pasta" or "slirp4netns"
    path: str
    setpriv: str

    def argv(self, netns: str, userns: str, ready_fd: int) -> list[str]:
        """The command line that connects the network namespace at `netns` (owned by the
        user namespace at `userns`) and writes to `ready_fd` once it has."""
        prefix = [self.setpriv, "--pdeathsig", "KILL", "--", self.path]
        if self.kind == "pasta":
            args = ["--quiet", "--foreground", "--config-net", "--netns", netns, "--userns", userns,
                    "--no-netns-quit", "-t", "none", "-u", "none", "-T", "none", "-U", "none", "--no-map-gw",
                    "-a", ADDRESS, "-n", str(PREFIX), "-g", GATEWAY, "--dns-forward", RESOLVER,
                    "-P", f"/proc/self/fd/{ready_fd}"]
            if os.geteuid() == 0:  # else it becomes nobody, who may not enter the sandbox's namespaces
                args[:0] = ["--runas", f"{os.geteuid()}:{os.getegid()}"]
            return prefix + args
        args = ["--configure", "--mtu=65520", "--disable-host-loopback", "--disable-dns", "--enable-seccomp",
                f"--ready-fd={ready_fd}", "--netns-type=path", f"--userns-path={userns}", netns, "eth0"]
        if os.geteuid() == 0:  # it drops its capabilities; unprivileged, it would need a uid 0 the namespace lacks
            args[:0] = ["--enable-sandbox"]
        return prefix + args

    def resolv_conf(self) -> str:
        """The sandbox's /etc/resolv.conf."""
        if self.kind == "pasta":
            return f"nameserver {RESOLVER}\n"
        servers = [s for s in host_resolvers() if not ipaddress.ip_address(s.split("%")[0]).is_loopback]
        if not servers:  # nothing of the host's loopback: no names then (the README says so)
            return "# the host's resolver is on its loopback, out of the sandbox's reach\n"
        return "".join(f"nameserver {s}\n" for s in servers[:3])


def host_resolvers(path: Path = Path("/etc/resolv.conf")) -> list[str]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            try:
                ipaddress.ip_address(parts[1].split("%")[0])
            except ValueError:
                continue
            found.append(parts[1])
    return found


def find(prefer: tuple[str, ...] = ("pasta", "slirp4netns")) -> Stack | str:
    """The stack to use here, or why there is none."""
    setpriv = shutil.which("setpriv", path=SEARCH_PATH)
    if setpriv is None:
        return "setpriv (util-linux) is not installed"
    for kind in prefer:
        path = shutil.which(kind, path=SEARCH_PATH)
        if path is not None:
            return Stack(kind, path, setpriv)
    return ("neither pasta (Debian's passt package) nor slirp4netns is installed: a sandbox with the network on "
            "needs one of them to have a network of its own")
