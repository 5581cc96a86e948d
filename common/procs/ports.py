"""Free TCP ports, for a role or service that binds them right after."""
from __future__ import annotations

import random
import socket

# Below Linux's ephemeral range (32768-60999), with room for an offset of 10000 under it too.
STABLE_RANGE = (10000, 22000)
_TRIES = 500


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Like the servers do: a port in TIME_WAIT after a restart is free, a listener is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", *, stable: bool = False, offset: int = 0,
              taken: set[int] | None = None) -> int:
    """A TCP port that was free on ``host`` a moment ago.

    By default the kernel's pick, from the ephemeral range: right for a port bound at once and
    never again (a job's scheduler). ``stable``: a random port below that range, for a service
    restarted on the same port later (by then a client connection may hold an ephemeral one as
    its source port); ``offset``: port+offset must be free as well (SeaweedFS's gRPC ports);
    ``taken``: ports already handed out, skipped, and the new ones are added to it.
    """
    if not stable:
        if offset or taken is not None:
            raise ValueError("free_port: offset and taken need stable=True (the kernel's pick ignores them)")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    taken = taken if taken is not None else set()
    rng = random.SystemRandom()
    for _ in range(_TRIES):
        port = rng.randrange(*STABLE_RANGE)
        wanted = [port, port + offset] if offset else [port]
        if not taken.intersection(wanted) and all(port_is_free(p, host) for p in wanted):
            taken.update(wanted)
            return port
    raise RuntimeError(f"no free port found on {host} in {STABLE_RANGE[0]}-{STABLE_RANGE[1] - 1} "
                       f"after {_TRIES} tries")
