"""Free TCP ports on 127.0.0.1 for tools and tests that start real servers."""
from __future__ import annotations

import contextlib
import socket


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free now. Every socket stays bound until all are chosen: a port closed and then chosen
    again would name one port for two services."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(n)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
