"""Where a client finds the server when it is not told: the environment that `pdrt up` reads.

`$PDRT_SERVER` names the gateway outright; otherwise `$PDRT_HOST` and
`$PDRT_PORT` do, as they do for `pdrt up`, so a shell that sets them for the
server reaches it with every other command too. Unset, they are the node
config's defaults.
"""

import os

from pdrt.node_config import GatewayConfig, NodeConfig


def default_server(environ: dict[str, str] | None = None) -> str:
    """The native-protocol address of the gateway: tcp://HOST:PORT."""
    env = os.environ if environ is None else environ
    if env.get("PDRT_SERVER"):
        return env["PDRT_SERVER"]
    return f"tcp://{_host(env)}:{env.get('PDRT_PORT') or GatewayConfig().port}"


def _host(env: dict[str, str] | os._Environ) -> str:
    host = env.get("PDRT_HOST") or NodeConfig().host
    return f"[{host}]" if ":" in host else host
