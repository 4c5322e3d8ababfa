"""Running a node without `pdrt up`: systemd units generated from the same node config.

`pdrt systemd` (systemd.py) writes one unit per process plus a target that
groups them (units.py renders them); `python -m pdrt.deploy.cleanup` is the
units' ExecStopPost, which removes what a stopped process left in /dev/shm.
docs/deploy.md walks through a deployment.
"""

from pdrt.deploy.systemd import add_arguments, run_systemd
from pdrt.deploy.units import UnitOptions, render_units, resolved_config

__all__ = ["UnitOptions", "add_arguments", "render_units", "resolved_config", "run_systemd"]
