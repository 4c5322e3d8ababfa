"""The process supervisor behind `pdrt up`: one node's processes, started, restarted and stopped.

`Supervisor` does the work; `add_arguments` and `run_up` are the `pdrt up`
subcommand. See supervisor.py for the life of a run.
"""

from pdrt.supervisor.child import RestartPolicy
from pdrt.supervisor.supervisor import Supervisor, default_command, new_run_id
from pdrt.supervisor.up import add_arguments, config_overrides, run_up

__all__ = ["RestartPolicy", "Supervisor", "add_arguments", "config_overrides", "default_command", "new_run_id",
           "run_up"]
