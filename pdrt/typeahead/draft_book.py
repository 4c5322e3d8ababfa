"""The gateway's open drafts: their text, which worker prefills them, and what that worker holds.

Life cycle of a draft in the gateway:

1. `DraftOpen` records it (bounded: `max_drafts` in all, half of them for
   one client);
2. `DraftAppend` / `DraftReplace` change its text; once enough text changed
   (`SYNC_CHARS`, or any edit), its stable tokens are recomputed and the
   difference to what the worker holds goes out as one `DraftUpdate` (keep
   the common prefix, append the rest) — an edit that reaches into prefilled
   tokens is a rollback on the worker;
3. `take` hands it to the gateway at submit, which sends the final tokens;
   `abandon` or the idle TTL drops it and tells the worker to free it.

The worker is picked at the first update (a session's reserved worker when
it has one) and kept; when it dies the draft starts over on another.

Every sync tokenizes the whole draft on the gateway's event loop, so a
draft's text is bounded (`max_chars`, what the context could hold at most:
a longer one is refused with nothing changed), and a draft longer than
`MAX_SYNC_CHARS` is no longer synced: its submit tokenizes it off the loop
and the worker prefills what it does not hold yet.
"""

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdrt.engine.sampling_params import MAX_CACHE_SALT_CHARS
from pdrt.errors import (
    InvalidRequestError,
    OverloadedError,
    PdrtError,
    PromptTooLongError,
    UnavailableError,
    UnknownRequestError,
)
from pdrt.roles.client_share import holds_a_share, release, share_of
from pdrt.roles.messaging import Outbox
from pdrt.roles.router import Router
from pdrt.roles.tenants import worker_salt
from pdrt.typeahead.draft_tokenizer import DraftTokenizer, common_prefix_len
from pdrt.wire import Abort, DraftAppend, DraftOpen, DraftReplace, DraftUpdate, WorkerInfo

SYNC_CHARS = 16  # less new text than this rarely moves the stable prefix (see DraftTokenizer)
MAX_SYNC_CHARS = 65536  # tokenizing this much holds the loop for tens of milliseconds at most


@dataclass(slots=True, eq=False)
class GatewayDraft:
    identity: bytes
    draft_id: str
    internal_id: str
    session_id: str
    messages: list[dict[str, str]] | None
    tokens: DraftTokenizer
    last_activity: float
    worker: WorkerInfo | None = None
    cache_salt: str = ""  # the client's; its submit takes it
    sent: list[int] = field(default_factory=list)  # the tokens the worker holds
    synced_text: str = ""

    @property
    def text(self) -> str:
        return self.tokens.text


class DraftBook:
    def __init__(self, tokenizer: Any, max_chars: int, max_model_len: int, router: Router, outbox: Outbox, role: str,
                 max_drafts: int, ttl_s: float, new_id: Callable[[], str], counters: Counter[str]) -> None:
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        self.max_model_len = max_model_len
        self.router = router
        self.outbox = outbox
        self.role = role  # the role that prefills drafts: "prefill" or "colocated"
        self.max_drafts = max_drafts
        self.ttl_s = ttl_s
        self.new_id = new_id
        self.counters = counters
        self.drafts: dict[tuple[bytes, str], GatewayDraft] = {}
        self.max_per_client = share_of(max_drafts)
        self.num_open_by: Counter[bytes] = Counter()  # open drafts per client identity

    def open(self, identity: bytes, message: DraftOpen, worker: WorkerInfo | None) -> None:
        key = (identity, message.draft_id)
        if key in self.drafts:
            raise InvalidRequestError(f"draft {message.draft_id!r} is already open")
        if len(self.drafts) >= self.max_drafts:
            raise UnavailableError(f"the server has {len(self.drafts)} open drafts, its limit; retry later")
        if self.num_open_by[identity] >= self.max_per_client and holds_a_share(identity):
            raise OverloadedError(f"this client has {self.num_open_by[identity]} open drafts, its share of the "
                                  f"server's {self.max_drafts}")
        if len(message.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidRequestError(f"cache_salt has at most {MAX_CACHE_SALT_CHARS} characters")
        messages = None if message.messages is None else [{"role": m.role, "content": m.content}
                                                          for m in message.messages]
        self._check_chars(sum(len(m["role"]) + len(m["content"]) + 1 for m in messages or []))  # as text_chars
        if messages is not None and not self.tokenizer.chat_template:
            raise InvalidRequestError("this model has no chat template; open the draft without messages")
        try:
            tokens = DraftTokenizer(self.tokenizer, messages)
        except Exception as exc:  # the template refused the conversation, or places the typed text oddly
            raise InvalidRequestError(f"the chat template cannot render this draft: {exc}") from None
        self.drafts[key] = GatewayDraft(identity, message.draft_id, self.new_id(), message.session_id, messages,
                                        tokens, time.monotonic(), worker, cache_salt=message.cache_salt)
        self.num_open_by[identity] += 1
        self.counters["drafts_opened"] += 1
        self._sync(self.drafts[key], force=True)  # a conversation so far can start prefilling at once

    def _get(self, identity: bytes, draft_id: str) -> GatewayDraft:
        draft = self.drafts.get((identity, draft_id))
        if draft is None:
            raise UnknownRequestError(f"no open draft {draft_id!r}")
        draft.last_activity = time.monotonic()
        return draft

    def _check_chars(self, num_chars: int) -> None:
        if num_chars > self.max_chars:
            raise PromptTooLongError(f"the draft would have {num_chars} characters; this model's context holds "
                                     f"at most {self.max_chars}")

    def append(self, identity: bytes, message: DraftAppend) -> None:
        draft = self._get(identity, message.draft_id)
        self._check_chars(draft.tokens.num_chars + len(message.text))
        draft.tokens.text += message.text
        self._sync(draft)

    def replace(self, identity: bytes, message: DraftReplace) -> None:
        draft = self._get(identity, message.draft_id)
        if not (0 <= message.num_kept_chars <= len(draft.text)):
            raise InvalidRequestError(f"the draft has {len(draft.text)} characters; cannot keep "
                                      f"{message.num_kept_chars}")
        self._check_chars(draft.tokens.num_chars - len(draft.text) + message.num_kept_chars + len(message.text))
        draft.tokens.text = draft.text[: message.num_kept_chars] + message.text
        self._sync(draft, force=message.num_kept_chars < len(draft.synced_text))

    def set_text(self, identity: bytes, draft_id: str, text: str) -> None:
        """The input box now reads `text` (HTTP clients send the whole box): keep the common prefix, edit the rest."""
        draft = self._get(identity, draft_id)
        kept = common_prefix_len(list(draft.text), list(text))
        self.replace(identity, DraftReplace(draft_id, kept, text[kept:]))

    def _sync(self, draft: GatewayDraft, force: bool = False) -> None:
        """Send the worker the change in the draft's stable tokens, if there is one."""
        if not force and len(draft.text) - len(draft.synced_text) < SYNC_CHARS:
            return
        if draft.tokens.num_chars > MAX_SYNC_CHARS:
            return
        draft.synced_text = draft.text
        stable = draft.tokens.stable_ids()
        if len(stable) >= self.max_model_len:
            raise PromptTooLongError(f"the draft has {len(stable)} tokens; this model's context is "
                                     f"{self.max_model_len}")
        if draft.worker is None or not self.router.is_live(draft.worker):
            draft.worker, draft.sent = self.router.pick(self.role), []
            if draft.worker is None:
                return  # no worker now: the submit routes it like any request
        kept = common_prefix_len(draft.sent, stable)
        if kept == len(draft.sent) == len(stable) or (not draft.sent and not stable):
            return
        if kept < len(draft.sent):
            self.counters["draft_rollbacks"] += 1
        self.outbox.send(draft.worker.address, DraftUpdate(draft.internal_id, kept, stable[kept:],
                                                           colocated=self.role == "colocated",
                                                           cache_salt=worker_salt(draft.identity, draft.cache_salt)))
        self.counters["draft_updates"] += 1
        draft.sent = stable

    def sync_paused(self, pause_s: float) -> None:
        """Sync drafts whose typist paused with text not yet synced, so that their tail gets prefilled too: the
        longest paused first, and no more than MAX_SYNC_CHARS of text tokenized in one call (one tick of the
        gateway's loop); the rest wait for the next."""
        cutoff = time.monotonic() - pause_s
        paused = [d for d in self.drafts.values() if d.last_activity < cutoff and d.text != d.synced_text
                  and d.tokens.num_chars <= MAX_SYNC_CHARS]
        budget = MAX_SYNC_CHARS
        for draft in sorted(paused, key=lambda d: d.last_activity):
            if draft.tokens.num_chars > budget:
                break
            budget -= draft.tokens.num_chars
            try:
                self._sync(draft, force=True)
            except PdrtError:
                pass  # too long: the submit reports it

    def take(self, identity: bytes, draft_id: str) -> GatewayDraft:
        """Remove the draft for its submit; the caller sends its final tokens."""
        draft = self._get(identity, draft_id)
        self._remove(draft)
        self.counters["drafts_submitted"] += 1
        return draft

    def _remove(self, draft: GatewayDraft) -> bool:
        if self.drafts.pop((draft.identity, draft.draft_id), None) is None:
            return False
        release(self.num_open_by, draft.identity)
        return True

    def drop(self, draft: GatewayDraft, counter: str) -> None:
        self._remove(draft)
        self.counters[counter] += 1
        if draft.worker is not None and draft.sent and self.router.is_live(draft.worker):
            self.outbox.send(draft.worker.address, Abort(draft.internal_id))

    def abandon(self, identity: bytes, draft_id: str) -> None:
        self.drop(self._get(identity, draft_id), "drafts_abandoned")

    def expire(self) -> list[GatewayDraft]:
        cutoff = time.monotonic() - self.ttl_s
        expired = [d for d in self.drafts.values() if d.last_activity < cutoff]
        for draft in expired:
            self.drop(draft, "drafts_expired")
        return expired

    def forget_client(self, identity: bytes) -> None:
        for draft in [d for d in self.drafts.values() if d.identity == identity]:
            self.drop(draft, "drafts_abandoned")

    def worker_lost(self, worker: WorkerInfo) -> None:
        for draft in self.drafts.values():
            if draft.worker is not None and draft.worker.process_id == worker.process_id:
                draft.worker, draft.sent = None, []
