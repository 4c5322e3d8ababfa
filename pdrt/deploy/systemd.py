"""`pdrt systemd`: write a node's systemd units from the node config `pdrt up` would run.

    pdrt systemd --config node.toml --out /etc/systemd/system --config-json /etc/pdrt/node.json \\
        --user pdrt --env-file /etc/pdrt/pdrt.env
    systemctl daemon-reload && systemctl enable --now pdrt.target

The config is read as `pdrt up` reads it (the TOML file, then PDRT_*
variables), resolved (see units.resolved_config) and written as JSON where
the units will read it. Nothing is written when the config or the options
are wrong. units.py says what the units contain and why.
"""

import argparse
import hashlib
import re
import subprocess
import sys
from pathlib import Path

from pdrt.deploy.units import HEADER, UnitOptions, render_units, resolved_config, secrets_in, unit_name
from pdrt.node_config import NodeConfig, load_node_config


def systemd_version() -> int:
    """This host's systemd version, 0 when there is none to ask."""
    try:
        out = subprocess.run(["systemctl", "--version"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    match = re.match(r"systemd (\d+)", out)
    return int(match.group(1)) if match else 0


def default_run_id(prefix: str, config: NodeConfig) -> str:
    """Stable across regenerations, so rewriting the units of a node does not rename its segments."""
    return hashlib.sha256(f"{prefix}/{config.node}/{config.host}".encode()).hexdigest()[:8]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="node config (TOML), as for `pdrt up`")
    parser.add_argument("--out", metavar="DIR", required=True, help="where the unit files go "
                                                                     "(/etc/systemd/system to install them)")
    parser.add_argument("--config-json", metavar="PATH",
                        help="where the resolved config is written and read by the units "
                             "(default: DIR/PREFIX-node.json; /etc/pdrt/node.json is a good place)")
    parser.add_argument("--user", help="run the processes as this user (default: root)")
    parser.add_argument("--prefix", default="pdrt", help="unit names: PREFIX-gateway.service, PREFIX.target, ...")
    parser.add_argument("--env-file", default="/etc/pdrt/pdrt.env", metavar="PATH",
                        help="EnvironmentFile for secrets (PDRT_CLUSTER_KEY, PDRT_WARMUP_KEY, PDRT_API_KEY, "
                             "PDRT_API_KEYS); '' for none (default /etc/pdrt/pdrt.env)")
    parser.add_argument("--run-id", help="PDRT_RUN_ID of every process (default: derived from prefix, node, host)")
    parser.add_argument("--cache-dir", metavar="DIR",
                        help="writable cache directory (default: systemd's CacheDirectory, /var/cache/PREFIX)")
    parser.add_argument("--memory-max", metavar="SIZE", help="MemoryMax of each worker: 48G, 80%%, ...")
    parser.add_argument("--tasks-max", type=int, default=4096, help="TasksMax of each process (default 4096)")
    parser.add_argument("--limit-nofile", type=int, default=65536, help="LimitNOFILE (default 65536)")
    parser.add_argument("--gpus", metavar="LIST", help="CUDA_VISIBLE_DEVICES of the workers, one each in turn: "
                                                       "0,1,2,3 (needs [engine] device = \"cuda\")")
    parser.add_argument("--pin-cpus", action="store_true",
                        help="CPUAffinity: each worker on its own consecutive CPUs, as many as its threads")
    parser.add_argument("--systemd-version", type=int, metavar="N",
                        help="the target host's systemd (default: this host's); 254 and later get RestartSteps")


def _warn(message: str) -> None:
    print(f"pdrt systemd: {message}", file=sys.stderr)


def run_systemd(args: argparse.Namespace) -> int:
    config = load_node_config(args.config)
    out = Path(args.out).absolute()
    config_json = Path(args.config_json).absolute() if args.config_json else out / f"{args.prefix}-node.json"
    opts = UnitOptions(
        config_json=str(config_json),
        run_id=args.run_id or default_run_id(args.prefix, config),
        prefix=args.prefix,
        user=args.user,
        env_file=str(Path(args.env_file).absolute()) if args.env_file else None,
        cache_dir=str(Path(args.cache_dir).absolute()) if args.cache_dir else None,
        memory_max=args.memory_max,
        tasks_max=args.tasks_max,
        limit_nofile=args.limit_nofile,
        gpus=[g.strip() for g in args.gpus.split(",") if g.strip()] if args.gpus else [],
        pin_cpus=args.pin_cpus,
        systemd_version=systemd_version() if args.systemd_version is None else args.systemd_version,
    )
    units = render_units(config, opts)  # raises before anything is written
    out.mkdir(parents=True, exist_ok=True)
    config_json.parent.mkdir(parents=True, exist_ok=True)
    config_json.write_bytes(resolved_config(config).to_json() + b"\n")
    for name, text in units.items():
        (out / name).write_text(text)
        print(out / name)
    print(config_json)
    for name in secrets_in(config):
        _warn(f"{name} was left out of {config_json}; put {name}=... in the EnvironmentFile "
              f"({opts.env_file or 'none given: pass --env-file'})")
    if not config.cluster_key:
        _warn(f"every process needs the cluster key: put PDRT_CLUSTER_KEY=... (from `pdrt key`, the same on every "
              f"node) in the EnvironmentFile ({opts.env_file or 'none given: pass --env-file'}), mode 0600")
    ours = f"pdrt.deploy.cleanup {opts.run_id} "  # in every unit generated for this node before
    stale = sorted(p.name for p in out.glob(f"{args.prefix}-*.service")
                   if p.name not in units and p.read_text().startswith(HEADER) and ours in p.read_text())
    if stale:
        _warn(f"units of processes this config no longer has are still in {out}: {', '.join(stale)}")
    target = f"{args.prefix}.target"
    _warn(f"next: systemctl daemon-reload && systemctl enable --now {target}; logs: journalctl -u "
          f"'{unit_name(args.prefix, '*')}' -o cat (JSON lines)")
    return 0
