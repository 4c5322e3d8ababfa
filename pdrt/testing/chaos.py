"""Kill a process of a running node while streams run through it, and account for every stream: the chaos suite
and scripts/bench_chaos.py.

`run_streams` sends a batch of streams (greedy and seeded sampling alike;
a prompt given as text is typed as a draft, then submitted) through the
Python client, which resumes a stream on a restarted gateway by itself,
and, once every stream has produced `kill_after` tokens, kills the named
process with SIGKILL (or another signal: SIGSTOP freezes it for a while,
as a host that hangs, and records when the client noticed). Each stream's
result is its tokens, or the typed error it ended with, or "hung" when
nothing ended it within the timeout; `KillRun` also says when the kill was
sent, when each token arrived (for the time a migration takes) and the
longest gap between two frames of a stream. Any other disturbance (a role
change) can take the kill's place.
"""

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from pdrt.client import AsyncClient
from pdrt.engine.sampling_params import SamplingParams
from pdrt.errors import PdrtError
from pdrt.testing.node import Node

STREAM_TIMEOUT_S = 60.0


@dataclass(slots=True)
class KillRun:
    results: dict[str, list[int] | str] = field(default_factory=dict)  # stream -> tokens, or what ended it
    logprobs: dict[str, list[float]] = field(default_factory=dict)  # stream -> its tokens' log-probabilities
    killed_at: float | None = None
    killed_pid: int = 0
    noticed_at: float | None = None  # after a SIGSTOP of the gateway: when the client dropped the connection
    disturbance: object = None  # what `disturb` returned
    token_times: dict[str, list[float]] = field(default_factory=dict)  # stream -> when each of its tokens came
    request_ids: dict[str, str] = field(default_factory=dict)  # stream -> its client request id

    def lost(self) -> list[str]:
        return [name for name, result in self.results.items() if isinstance(result, str) and result != "hung"]

    def hung(self) -> list[str]:
        return [name for name, result in self.results.items() if result == "hung"]

    def longest_gap_s(self) -> float:
        """The longest wait between two tokens of any stream, the kill's own included."""
        return max((b - a for times in self.token_times.values() for a, b in zip(times, times[1:], strict=False)),
                   default=0.0)


Prompt = list[int] | str  # token ids, or a text typed as a draft


def batch(prompts: list[Prompt], max_tokens: int, seed: int = 7, ignore_eos: bool = False, logprobs: bool = False
          ) -> dict[str, tuple[Prompt, SamplingParams]]:
    """Streams named by index: even ones greedy, odd ones sampled with a seed of their own."""
    out = {}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, logprobs=logprobs) \
            if i % 2 == 0 else SamplingParams(temperature=0.8, top_p=0.95, seed=seed + i, max_tokens=max_tokens,
                                              ignore_eos=ignore_eos, logprobs=logprobs)
        out[f"s{i}"] = (prompt, params)
    return out


async def _stream(client: AsyncClient, name: str, prompt: Prompt, params: SamplingParams, run: KillRun,
                  progress: dict[str, int]) -> None:
    tokens: list[int] = []
    logprobs = run.logprobs[name] = []
    times = run.token_times[name] = []
    try:
        async with asyncio.timeout(STREAM_TIMEOUT_S):
            if isinstance(prompt, str):
                draft = client.draft()
                await draft.append(prompt)
                stream = await draft.submit(params)
            else:
                stream = client.stream(token_ids=prompt, params=params)
            run.request_ids[name] = stream.request_id
            async for delta in stream:
                tokens += delta.token_ids
                logprobs += delta.logprobs or ()
                times += [time.monotonic()] * len(delta.token_ids)
                progress[name] = len(tokens)
        run.results[name] = tokens
    except TimeoutError:
        run.results[name] = "hung"
    except PdrtError as exc:
        run.results[name] = exc.code


async def _run(address: str, streams: dict[str, tuple[Prompt, SamplingParams]], kill: tuple[Node, str] | None,
               kill_after: int, kill_delay_s: float, sig: signal.Signals, freeze_s: float,
               disturb: Callable[[], Awaitable[object]] | None, before: Callable[[], object] | None) -> KillRun:
    run, progress = KillRun(), {name: 0 for name in streams}
    async with AsyncClient(address, timeout_s=STREAM_TIMEOUT_S) as client:
        if before is not None:
            before()
        tasks = [asyncio.create_task(_stream(client, name, prompt, params, run, progress))
                 for name, (prompt, params) in streams.items()]
        if kill is not None or disturb is not None:
            deadline = time.monotonic() + STREAM_TIMEOUT_S
            await asyncio.sleep(kill_delay_s)
            while min(progress.values()) < kill_after and not all(t.done() for t in tasks) \
                    and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
        if disturb is not None:
            run.killed_at = time.monotonic()
            run.disturbance = await disturb()
        if kill is not None:
            node, process = kill
            run.killed_pid = node.child_pids()[process]
            os.kill(run.killed_pid, sig)
            run.killed_at = time.monotonic()
            if sig == signal.SIGSTOP:
                await _thaw(client, run, freeze_s)
        await asyncio.gather(*tasks)
    return run


async def _thaw(client: AsyncClient, run: KillRun, freeze_s: float) -> None:
    """SIGCONT the frozen process after `freeze_s`, noting meanwhile when the client gave up its connection."""
    assert run.killed_at is not None
    while time.monotonic() - run.killed_at < freeze_s:
        if run.noticed_at is None and client.ready is None:
            run.noticed_at = time.monotonic()
        await asyncio.sleep(0.01)
    os.kill(run.killed_pid, signal.SIGCONT)


def run_streams(address: str, streams: dict[str, tuple[Prompt, SamplingParams]],
                kill: tuple[Node, str] | None = None, kill_after: int = 3, kill_delay_s: float = 0.0,
                sig: signal.Signals = signal.SIGKILL, freeze_s: float = 5.0,
                disturb: Callable[[], Awaitable[object]] | None = None,
                before: Callable[[], object] | None = None) -> KillRun:
    """Run `streams` to their end; with `kill` (a node and a process name), send that process `sig` (SIGKILL
    by default; SIGSTOP is followed by SIGCONT `freeze_s` later) `kill_delay_s` after they start and once every
    stream has `kill_after` tokens. `disturb` (a role change, say) is awaited at that moment instead; `before`
    is called once the client is connected, before any stream starts (a SIGSTOP of a worker, say)."""
    return asyncio.run(_run(address, streams, kill, kill_after, kill_delay_s, sig, freeze_s, disturb, before))


def freeze(node: Node, process: str) -> Callable[[], None]:
    """A `before` that SIGSTOPs `process` of `node`: a worker that hangs with what is routed to it."""
    return lambda: os.kill(node.child_pids()[process], signal.SIGSTOP)


def uptime_s(pid: int) -> float:
    """Seconds since process `pid` started (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command's parentheses
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) - started_ticks / os.sysconf("SC_CLK_TCK")


def wait_restarted(node: Node, process: str, old_pid: int, timeout_s: float = 120.0) -> float:
    """Seconds until `process` runs again under a new pid."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        pid = node.child_pids().get(process)
        if pid is not None and pid != old_pid:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"{process} was not restarted within {timeout_s} s")
