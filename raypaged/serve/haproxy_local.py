"""Ray Serve's HAProxy, started through this module: the config Serve wrote, with two changes.

    python -m raypaged.serve.haproxy_local REAL_HAPROXY [haproxy's arguments: -db -f CFG ...]

Ray Serve 2.60 renders HAProxy's config from a fixed template and starts the binary named by
RAY_SERVE_HAPROXY_BINARY_PATH with `-f CFG`. `raypaged serve` (HAProxy is its default ingress where it can run) points that
variable at a script of its run folder that runs this module, which writes CFG.local beside
CFG and starts the real binary on it (every start and every reload, as Serve does both by
starting the binary):

- **The stats page and the Prometheus exporter listen on the loopback.** The template binds
  them to every interface (`bind *:PORT`, `bind :PORT`, no host setting), and a default
  `raypaged serve` opens nothing beyond the loopback (docs/security.md). The API's own frontend
  keeps the host Serve gave it (--host).
- **The client's address reaches the router.** Behind HAProxy every request's peer is HAProxy,
  so per-client caps and fair admission (client_gate.py) would see one client. HAProxy drops
  any X-Forwarded-For the client sent and sets its own (`option forwardfor`); the router
  believes it only from a loopback peer under this module (client_gate.client_of).

Imports nothing but the standard library: it runs before every HAProxy start."""
from __future__ import annotations

import os
import re
import sys

# `bind *:8404` (stats), `bind :9101` (exporter): every interface
_ANY_INTERFACE = re.compile(r"^(\s*bind\s+)(?:\*)?:(\d+)(.*)$", re.MULTILINE)
_API_FRONTEND = re.compile(r"^frontend http_frontend\n", re.MULTILINE)
FORWARD = ("    http-request del-header X-Forwarded-For\n"  # never the client's own
           "    option forwardfor\n")


def local_config(text: str) -> str:
    """Serve's config with every any-interface bind on 127.0.0.1 and the client's address
    forwarded by the API frontend. ValueError if the config lacks the API frontend (a Serve
    whose template changed: starting HAProxy without the forwarded address would be wrong)."""
    text = _ANY_INTERFACE.sub(r"\g<1>127.0.0.1:\2\3", text)
    text, found = _API_FRONTEND.subn(lambda m: m.group(0) + FORWARD, text)
    if found != 1:
        raise ValueError("no 'frontend http_frontend' section in Ray Serve's HAProxy config")
    return text


def main(argv: list[str]) -> None:
    real, args = argv[0], list(argv[1:])
    if "-f" in args:
        i = args.index("-f") + 1
        source = args[i]
        with open(source) as f:
            text = local_config(f.read())
        target = source + ".local"
        with open(target + ".tmp", "w") as f:
            f.write(text)
        os.replace(target + ".tmp", target)
        args[i] = target
    os.execv(real, [real, *args])


if __name__ == "__main__":
    main(sys.argv[1:])
