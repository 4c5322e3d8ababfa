"""The event loop every pdrt process runs: uvloop where it is installed, asyncio's otherwise."""

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:  # uvloop does not build everywhere (Windows); asyncio's loop works the same
        return asyncio.run(main)
    return uvloop.run(main)
