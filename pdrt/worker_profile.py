"""How a worker shares the machine, derived from the device and the model: its profile, logged at start-up.

Every process of a node shares the host's cores: on a CPU node the workers'
arithmetic, on a GPU node its few cores for Python. The profile decides:

* `nice`: a prefill worker yields at PREFILL_NICE, the others run at 0. A
  prompt's seconds of arithmetic must not delay a decode step or a token on
  its way out, and the kernel gives a runnable process of niceness 0 about
  ten times the CPU of one at 10.
* `catch_up_wait`: but at nice 10 throughout the prefill worker gets only
  what the rest leaves and TTFT breaks first, and at 0 throughout long
  prompts stretch the decode steps. So a prefill worker yields the CPU only
  while every prompt starts within this fraction of the TTFT SLO and has
  its first token within CATCH_UP_LATE of it, limits that shrink as the
  decode steps have room against the TPOT SLO (pdrt/priority.py, CatchUp):
  the SLOs decide, for every model.
* `borrow_threads`: on the CPU a decode worker runs each step with the
  threads of the run's idle prefill workers too (pdrt/roles/thread_ledger.py),
  for a model of SMALL_MODEL_PARAMS or more: a smaller model's step is
  bound by Python, and a second thread only adds OpenMP's wake-ups on the
  core that prefill, the gateway and clients need.
* `prompt_batch_tokens`: on the CPU, where a step's time grows with its
  tokens, a prefill worker takes prompts one by one, batching only short
  whole ones within CPU_PROMPT_BATCH tokens (pdrt/engine/scheduler.py); on
  a GPU, where it grows little, prompts batch side by side (None).
* `threads`: the host's cores split evenly across the node's workers.

`[experimental]` in the node config overrides each of these.
"""

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    from pdrt.node_config import NodeConfig

log = structlog.get_logger(__name__)

SMALL_MODEL_PARAMS = 10_000_000  # below: a step is bound by Python, not arithmetic
PREFILL_NICE = 10
CATCH_UP_WAIT = 0.25  # of [gateway] ttft_slo_s
CATCH_UP_LATE = 0.5  # of [gateway] ttft_slo_s
# A short whole prompt joining a step saves that step's fixed cost and delays its first prompt a little.
CPU_PROMPT_BATCH = 64


@dataclass(frozen=True, slots=True)
class WorkerProfile:
    role: str
    threads: int
    nice: int
    catch_up_wait: float | None  # None: the worker stays at `nice`
    borrow_threads: bool
    prompt_batch_tokens: int | None  # None: prompts side by side


def prompt_batch_tokens(config: "NodeConfig", role: str) -> int | None:
    """How a worker of `role` batches prompts; known before its model loads (it sizes nothing)."""
    if role != "prefill":
        return None
    if config.experimental.prompt_batch_tokens is not None:
        return config.experimental.prompt_batch_tokens
    return CPU_PROMPT_BATCH if config.engine.device == "cpu" else None


def prefill_nice(config: "NodeConfig") -> int:
    """The niceness this node's prefill workers run at."""
    nice = config.experimental.prefill_nice
    return PREFILL_NICE if nice is None else nice


def catches_up(nice: int) -> bool:
    """Whether a prefill worker at niceness `nice` yields the CPU only while its prompts are on time (CatchUp)."""
    return nice > 0


def worker_profile(config: "NodeConfig", role: str, num_params: int) -> WorkerProfile:
    """The profile of a worker of `role` whose model has `num_params` parameters, on this node's device."""
    exp = config.experimental
    small = num_params < SMALL_MODEL_PARAMS
    nice = prefill_nice(config)
    borrow = exp.borrow_threads if exp.borrow_threads is not None else not small
    return WorkerProfile(
        role=role,
        threads=config.threads_for(role),
        nice=nice if role == "prefill" else 0,
        catch_up_wait=CATCH_UP_WAIT if role == "prefill" and catches_up(nice) else None,
        borrow_threads=role == "decode" and config.engine.device == "cpu" and borrow,
        prompt_batch_tokens=prompt_batch_tokens(config, role),
    )


def log_profile(profile: WorkerProfile, process: str, num_params: int) -> None:
    log.info("worker profile", process=process, params=num_params, **asdict(profile))
