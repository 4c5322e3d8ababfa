"""Which worker gets the next request: the controller's view of the workers plus this gateway's own count.

The controller's load figures are up to one heartbeat old; between two views
a burst of requests would all go to the same worker. So each worker's score
adds the requests this gateway has sent it and that are still open.
"""

from collections import Counter

from pdrt.wire import WorkerInfo


class Router:
    def __init__(self) -> None:
        self.workers: dict[str, WorkerInfo] = {}
        self.open_requests: Counter[str] = Counter()  # process id -> requests of this gateway it holds

    def update(self, workers: list[WorkerInfo], complete: bool = True) -> list[WorkerInfo]:
        """Take a new view; returns the workers that left it (or came back as a new incarnation). A view that is
        not `complete` (a restarted controller's first) only adds and updates: a worker missing from it is not
        gone."""
        new = {w.process_id: w for w in workers}
        gone = [w for pid, w in self.workers.items()
                if (pid not in new and complete) or (pid in new and new[pid].incarnation != w.incarnation)]
        self.workers = new if complete else {**{w.process_id: w for w in self.workers.values() if w not in gone},
                                             **new}
        return gone

    def remove(self, process_id: str, incarnation: str) -> WorkerInfo | None:
        worker = self.workers.get(process_id)
        if worker is None or worker.incarnation != incarnation:
            return None
        return self.workers.pop(process_id)

    def is_live(self, worker: WorkerInfo) -> bool:
        current = self.workers.get(worker.process_id)
        return current is not None and current.incarnation == worker.incarnation

    def pick(self, role: str) -> WorkerInfo | None:
        candidates = [w for w in self.workers.values() if w.role == role]
        if not candidates:
            return None

        def score(w: WorkerInfo) -> tuple[int, int]:
            busy = self.open_requests[w.process_id] + w.load.num_waiting + (w.load.num_running if role != "decode"
                                                                            else 0)
            return busy, -w.load.num_free_blocks

        return min(candidates, key=score)

    def count_roles(self) -> Counter[str]:
        return Counter(w.role for w in self.workers.values())
