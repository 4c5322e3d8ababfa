"""`python -m pdrt.deploy.cleanup RUN_ID NAME`: remove what process NAME of run RUN_ID left in /dev/shm.

Under `pdrt up` the supervisor removes a dead process's segments before it
restarts it. Under systemd each unit does it for its own process as its
ExecStopPost, which systemd runs after every stop, clean or not, and before
a restart: a prefill worker killed mid-way cannot unlink its KV pool, and the
next incarnation creates a new one under a new name.
"""

import json
import sys

from pdrt.supervisor.leftovers import process_prefix, remove_segments


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or not all(argv):
        print("usage: python -m pdrt.deploy.cleanup RUN_ID NAME", file=sys.stderr)
        return 2
    run_id, name = argv
    removed = remove_segments(process_prefix(run_id, name))
    if removed:  # a JSON line, like every pdrt log line in the journal
        print(json.dumps({"event": "removed leftover shared memory", "process": name, "segments": removed}),
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
