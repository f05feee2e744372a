"""Ray Serve's HAProxy, started through this module: the config Serve wrote, with three changes.

    python haproxy_local.py REAL_HAPROXY BODY_TIMEOUT_S [haproxy's arguments: -db -f CFG ...]

Ray Serve 2.60 renders HAProxy's config from a fixed template and starts the binary named by
RAY_SERVE_HAPROXY_BINARY_PATH with `-f CFG`. `raypaged serve` (whose default ingress HAProxy is,
where it can run) points that variable at a script of its run folder that runs this module,
which writes CFG.local beside CFG and starts the real binary on it (every start and every
reload, as Serve does both by starting the binary):

- **The stats page and the Prometheus exporter listen on the loopback.** The template binds
  them to every interface (`bind *:PORT`, `bind :PORT`, no host setting), and a default
  `raypaged serve` opens nothing beyond the loopback (docs/security.md). The API's own frontend
  keeps the host Serve gave it (--host).
- **The client's address reaches the router.** Behind HAProxy every request's peer is HAProxy,
  so per-client caps and fair admission (client_gate.py) would see one client. HAProxy drops
  any X-Forwarded-For the client sent and sets its own (`option forwardfor`); the router
  believes it only from a loopback peer under this module (client_gate.client_of).
- **A request's body has --body-timeout-s to arrive, at HAProxy too.** The router answers a
  body that is too slow with 408, but HAProxy would keep the client's connection open, waiting
  for the rest of the declared body (`timeout client` is an hour of silence). So HAProxy reads
  the body before it forwards the request (`option http-buffer-request`) within the same
  deadline (`timeout http-request`): 408 and the connection closed.

Imports nothing but the standard library: it runs before every HAProxy start."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

# `bind *:8404` (stats), `bind :9101` (exporter): every interface
_ANY_INTERFACE = re.compile(r"^(\s*bind\s+)(?:\*)?:(\d+)(.*)$", re.MULTILINE)
_API_FRONTEND = re.compile(r"^frontend http_frontend\n", re.MULTILINE)


def api_frontend_lines(body_timeout_s: float) -> str:
    return ("    http-request del-header X-Forwarded-For\n"  # never the client's own
            "    option forwardfor\n"
            "    option http-buffer-request\n"
            f"    timeout http-request {max(1, round(body_timeout_s * 1000))}ms\n")


def local_config(text: str, body_timeout_s: float) -> str:
    """Serve's config with every any-interface bind on 127.0.0.1, and the API frontend
    forwarding the client's address and reading each request within `body_timeout_s`.
    ValueError if the config lacks the API frontend (a Serve whose template changed: starting
    HAProxy without these would be wrong)."""
    text = _ANY_INTERFACE.sub(r"\g<1>127.0.0.1:\2\3", text)
    lines = api_frontend_lines(body_timeout_s)
    text, found = _API_FRONTEND.subn(lambda m: m.group(0) + lines, text)
    if found != 1:
        raise ValueError("no 'frontend http_frontend' section in Ray Serve's HAProxy config")
    return text


def main(argv: list[str]) -> None:
    real, body_timeout_s, args = argv[0], float(argv[1]), list(argv[2:])
    if "-f" in args:
        i = args.index("-f") + 1
        target = args[i] + ".local"
        Path(target + ".tmp").write_text(local_config(Path(args[i]).read_text(), body_timeout_s))
        os.replace(target + ".tmp", target)
        args[i] = target
    os.execv(real, [real, *args])


if __name__ == "__main__":
    main(sys.argv[1:])
