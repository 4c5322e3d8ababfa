"""The actor runtime: ordering, ask/tell errors, timeouts, failure policy, stopping."""

import asyncio
import time

import pytest

from pdrt.actors import Actor, FailurePolicy, run
from pdrt.errors import ActorStoppedError, AskTimeoutError, MailboxFullError


class Recorder(Actor):
    """Records what it receives; some messages make it sleep or fail."""

    def __init__(self, policy: FailurePolicy = FailurePolicy.RESUME, mailbox_size: int = 64) -> None:
        self.seen: list = []
        self.failures: list = []
        self.started = self.stopped = False
        self.policy = policy
        self.mailbox_size = mailbox_size

    async def on_start(self) -> None:
        self.started = True

    async def on_receive(self, message):
        if message == "boom":
            raise ValueError("boom")
        if isinstance(message, float):
            await asyncio.sleep(message)
        self.seen.append(message)
        return ("ok", message)

    async def on_stop(self) -> None:
        self.stopped = True

    async def on_failure(self, exc, message) -> FailurePolicy:
        self.failures.append((type(exc), message))
        return self.policy


def test_tells_are_handled_in_order_and_ask_returns_the_reply():
    async def main():
        actor = Recorder(mailbox_size=128)
        ref = actor.start()
        for i in range(100):
            ref.tell(i)
        assert await ref.ask("last", timeout=1) == ("ok", "last")
        await ref.stop()
        return actor

    actor = run(main())
    assert actor.seen == list(range(100)) + ["last"]
    assert actor.started and actor.stopped


def test_an_error_in_ask_goes_back_to_the_caller_and_the_actor_carries_on():
    async def main():
        ref = Recorder().start()
        with pytest.raises(ValueError, match="boom"):
            await ref.ask("boom", timeout=1)
        assert await ref.ask(1, timeout=1) == ("ok", 1)
        await ref.stop()

    run(main())


def test_an_error_in_tell_goes_to_the_failure_policy():
    async def main():
        resuming = Recorder(FailurePolicy.RESUME)
        ref = resuming.start()
        ref.tell("boom")
        assert await ref.ask(2, timeout=1) == ("ok", 2)
        assert resuming.failures == [(ValueError, "boom")]
        await ref.stop()

        stopping = Recorder(FailurePolicy.STOP)
        ref = stopping.start()
        ref.tell("boom")
        pending = asyncio.ensure_future(ref.ask(3, timeout=1))
        with pytest.raises(ActorStoppedError):
            await pending
        assert not ref.is_alive and stopping.stopped
        with pytest.raises(ActorStoppedError):
            ref.tell(4)

    run(main())


def test_ask_times_out_instead_of_waiting_forever():
    async def main():
        ref = Recorder().start()
        start = time.monotonic()
        with pytest.raises(AskTimeoutError):
            await ref.ask(5.0, timeout=0.1)
        assert time.monotonic() - start < 1.0
        await ref.stop(timeout=10)

    run(main())


def test_stop_fails_the_asks_still_queued():
    async def main():
        ref = Recorder().start()
        ref.tell(0.2)
        queued = [asyncio.ensure_future(ref.ask(i, timeout=5)) for i in range(3)]
        await asyncio.sleep(0.05)
        await ref.stop()
        results = await asyncio.gather(*queued, return_exceptions=True)
        assert all(isinstance(r, ActorStoppedError) for r in results)

    run(main())


def test_a_full_mailbox_refuses_new_messages():
    async def main():
        ref = Recorder(mailbox_size=2).start()
        ref.tell(0.2)
        await asyncio.sleep(0.01)  # the sleeper is being handled; the mailbox is empty again
        ref.tell(1)
        ref.tell(2)
        with pytest.raises(MailboxFullError):
            ref.tell(3)
        await ref.stop()

    run(main())
