"""When requests arrive: a Poisson process, or gamma-distributed gaps with a chosen burstiness.

Both have the same mean rate. The coefficient of variation (CV, the gaps'
standard deviation over their mean) says how bursty arrivals are: 1 is
Poisson, above 1 comes in bursts, below 1 is steadier. Gamma gaps with shape
k = 1/CV² and scale 1/(rate·k) have mean 1/rate and that CV, the way
DistServe and vLLM's benchmarks model bursty load.
"""

import random

from pdrt.errors import ConfigError

ARRIVALS = ("poisson", "gamma")


def arrival_times(num_requests: int, rate: float, seed: int, process: str = "poisson", cv: float = 1.0) -> list[float]:
    """Seconds from the start of a run at which each request is sent; the first one at 0."""
    if rate <= 0:
        raise ConfigError(f"the request rate must be > 0, got {rate}")
    if process not in ARRIVALS:
        raise ConfigError(f"unknown arrival process {process!r}; choose one of {', '.join(ARRIVALS)}")
    if process == "poisson":
        cv = 1.0
    if cv <= 0:
        raise ConfigError(f"the arrivals' CV must be > 0, got {cv}")
    rng = random.Random(f"arrivals:{seed}")
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    times, now = [], 0.0
    for i in range(num_requests):
        if i:
            now += rng.gammavariate(shape, scale)
        times.append(now)
    return times


def rescale_times(times: list[float], rate: float) -> list[float]:
    """A trace's arrival times stretched or squeezed to a mean rate of `rate` (the shape of its load is kept)."""
    if rate <= 0:
        raise ConfigError(f"the request rate must be > 0, got {rate}")
    if len(times) < 2 or times[-1] == times[0]:
        return [i / rate for i in range(len(times))]
    start = times[0]
    factor = (len(times) - 1) / rate / (times[-1] - start)
    return [(t - start) * factor for t in times]
