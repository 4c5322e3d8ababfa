"""Goodput from a rate sweep: the highest request rate at which enough requests meet their SLOs.

As in DistServe, attainment is measured at a few rates and goodput is read
off the curve where it crosses the target (90%): between the highest
measured rate that reaches the target and the next rate up, attainment is
taken to fall linearly, and goodput is where that line meets the target.
When even the highest rate reaches the target, goodput is at least that
rate (`bound` says "at_least"); when even the lowest misses it, goodput is
below the lowest rate and reported as 0 ("below_lowest").
"""

from dataclasses import asdict, dataclass

from pdrt.errors import ConfigError

DEFAULT_TARGET = 0.9


@dataclass(slots=True, frozen=True)
class Goodput:
    rate: float  # requests/s
    target: float
    bound: str  # "interpolated", "measured" (a rate hit the target exactly), "at_least" or "below_lowest"
    between: tuple[float, float] | None  # the two measured rates it was interpolated between

    def describe(self) -> str:
        if self.bound == "at_least":
            return f"goodput >= {self.rate:.3g} req/s (every rate measured reached {self.target:.0%} attainment)"
        if self.bound == "below_lowest":
            return f"goodput < {self.between[0]:.3g} req/s (the lowest rate measured missed " \
                   f"{self.target:.0%} attainment)" if self.between else "goodput: no rate measured"
        if self.bound == "measured":
            return f"goodput = {self.rate:.3g} req/s ({self.target:.0%} attainment reached exactly there)"
        low, high = self.between or (0.0, 0.0)
        return f"goodput = {self.rate:.3g} req/s ({self.target:.0%} attainment, interpolated linearly between " \
               f"{low:g} and {high:g} req/s)"

    def to_json(self) -> dict:
        return asdict(self)


def goodput(points: list[tuple[float, float]], target: float = DEFAULT_TARGET) -> Goodput:
    """Goodput from (rate, attainment) points, in any order."""
    if not 0 < target <= 1:
        raise ConfigError(f"the attainment target must be in (0, 1], got {target}")
    ordered = sorted(points)
    if not ordered:
        return Goodput(0.0, target, "below_lowest", None)
    passing = [i for i, (_, attained) in enumerate(ordered) if attained >= target]
    if not passing:
        return Goodput(0.0, target, "below_lowest", (ordered[0][0], ordered[0][0]))
    i = passing[-1]
    rate, attained = ordered[i]
    if i == len(ordered) - 1:
        return Goodput(rate, target, "at_least", None)
    if attained == target:
        return Goodput(rate, target, "measured", None)
    next_rate, next_attained = ordered[i + 1]
    crossing = rate + (attained - target) / (attained - next_attained) * (next_rate - rate)
    return Goodput(crossing, target, "interpolated", (rate, next_rate))
