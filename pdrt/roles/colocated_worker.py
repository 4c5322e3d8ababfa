"""The colocated worker: prefill and decode in one engine, chunked prefill mixed into decode batches.

Life cycle of a request in this worker: `PrefillRequest` (with no decode
address) -> `engine.add_request` -> the scheduler runs its prompt in chunks
alongside the running decodes -> every step's new tokens go to the gateway
in one message -> the request finishes or is aborted. It is the baseline the
disaggregated deployment is measured against, and the simpler deployment for
short prompts.
"""

from pdrt.roles.engine_worker import EngineWorker
from pdrt.wire import Abort, DraftSubmitted, DraftUpdate, GatewayBack, PrefillRequest


class ColocatedWorker(EngineWorker):
    role = "colocated"
    senders = {PrefillRequest: ("gateway",), DraftUpdate: ("gateway",), DraftSubmitted: ("gateway",),
               Abort: ("gateway",), GatewayBack: ("gateway",)}

    async def on_receive(self, message: object) -> None:
        if self.is_orphan(message):
            return
        match message:
            case PrefillRequest():
                self.add_whole_request(message)
            case DraftUpdate():
                self.draft_update(message)
            case DraftSubmitted():
                self.draft_submitted(message)
            case Abort(request_id=rid):
                self.abort(rid)
            case _:
                self.on_control(message)

    def add_submitted(self, request_id: str, submitted: DraftSubmitted) -> None:
        self.engine.add_request(request_id, submitted.token_ids, submitted.params)
