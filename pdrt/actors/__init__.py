"""Lightweight asyncio actors: one mailbox each, `tell` / `ask`, lifecycle hooks, a failure policy."""

from pdrt.actors.actor import Actor, ActorRef, FailurePolicy
from pdrt.actors.loop import run

__all__ = ["Actor", "ActorRef", "FailurePolicy", "run"]
