"""`pdrt up`: its flags, and the glue from flags to a running `Supervisor`."""

import argparse
import sys

from pdrt.node_config import TRANSFERS, load_node_config
from pdrt.supervisor.supervisor import Supervisor, new_run_id


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `up` flags. Each one that is given overrides the config file and the PDRT_* environment."""
    parser.add_argument("--config", metavar="FILE", help="node config (TOML); see pdrt/node_config.py")
    parser.add_argument("--model", help="checkpoint directory (default: the fetched SmolLM2)")
    split = parser.add_mutually_exclusive_group()
    split.add_argument("--colocated", action="store_true", help="colocated workers (default: as the host suits)")
    split.add_argument("--disaggregated", action="store_true", help="prefill + decode workers (default: as the "
                                                                    "host suits)")
    parser.add_argument("--host", help="address every socket binds to")
    parser.add_argument("--port", type=int, help="gateway port")
    parser.add_argument("--controller-port", type=int)
    parser.add_argument("--controller-host", help="where the controller is reached, when another node runs it")
    parser.add_argument("--node", help="this node's name, carried by its workers' names (several nodes)")
    parser.add_argument("--kv-cache-bytes", type=int, help="KV pool size of each worker")
    parser.add_argument("--prefill-chunk", type=int, help="largest prefill chunk, in tokens")
    parser.add_argument("--transfer", choices=TRANSFERS, help="KV handoff backend")
    parser.add_argument("--device", help="auto (default: CUDA where torch sees a GPU), cpu, cuda or cuda:N")
    parser.add_argument("--ready-timeout", type=float, default=300.0, metavar="S",
                        help="give up when the node is not ready after S seconds (default 300)")


def config_overrides(args: argparse.Namespace) -> dict[tuple[str, ...], object]:
    """Flag values as load_node_config overrides; flags not given are None and leave the setting alone."""
    return {
        ("model",): args.model,
        ("mode",): "colocated" if args.colocated else "disaggregated" if args.disaggregated else None,
        ("host",): args.host,
        ("gateway", "port"): args.port,
        ("controller", "port"): args.controller_port,
        ("controller", "host"): args.controller_host,
        ("node",): args.node,
        ("engine", "kv_cache_bytes"): args.kv_cache_bytes,
        ("engine", "max_prefill_chunk_size"): args.prefill_chunk,
        ("transfer",): args.transfer,
        ("engine", "device"): args.device,
    }


def run_up(args: argparse.Namespace) -> int:
    """Run the node until SIGINT/SIGTERM (exit 0), or until it cannot be kept running (exit 1)."""
    config = load_node_config(args.config, config_overrides(args))
    supervisor = Supervisor(config, new_run_id(), ready_timeout_s=args.ready_timeout)
    code = supervisor.run()
    if supervisor.failure:
        print(f"pdrt: {supervisor.failure}", file=sys.stderr)
    return code
