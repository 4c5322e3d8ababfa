"""The colocated worker: prefill and decode in one engine, chunked prefill mixed into decode batches.

Life cycle of a request in this worker: `PrefillRequest` (with no decode
address) -> `engine.add_request` -> the scheduler runs its prompt in chunks
alongside the running decodes -> every step's new tokens go to the gateway
in one message -> the request finishes or is aborted. It is the baseline the
disaggregated deployment is measured against, and the simpler deployment for
short prompts.
"""

import structlog

from pdrt.roles.engine_worker import EngineWorker
from pdrt.wire import Abort, DraftSubmitted, DraftUpdate, PrefillRequest

log = structlog.get_logger(__name__)


class ColocatedWorker(EngineWorker):
    role = "colocated"
    senders = {PrefillRequest: ("gateway",), DraftUpdate: ("gateway",), DraftSubmitted: ("gateway",),
               Abort: ("gateway",)}

    async def on_receive(self, message: object) -> None:
        if isinstance(message, PrefillRequest):
            self.add_whole_request(message)
        elif isinstance(message, DraftUpdate):
            self.draft_update(message)
        elif isinstance(message, DraftSubmitted):
            self.draft_submitted(message)
        elif isinstance(message, Abort):
            rid = message.request_id
            self.drafts.pop(rid, None)
            self.reply_to.pop(rid, None)
            self.queue_op(rid, lambda: self.engine.abort(rid))
        else:
            log.warning("colocated worker ignored a message", message=type(message).__name__)

    def add_submitted(self, request_id: str, submitted: DraftSubmitted) -> None:
        self.engine.add_request(request_id, submitted.token_ids, submitted.params)
