"""The prompt-order policies, constructed directly: which waiting prompt goes next."""

from pdrt.engine.prompt_order import ArrivalOrder, ResponseRatioOrder


def ranked(order, prompts: dict[str, tuple[int, int]]) -> list[str]:
    """Names of prompts (name -> (waited, work)) in the order the policy starts them, at one moment."""
    return sorted(prompts, key=lambda name: order.key(*prompts[name]))


def test_arrival_order_keeps_the_queue_as_it_came_and_needs_no_work_counted():
    prompts = {"first": (0, 900), "second": (500, 10), "third": (50, 1)}
    assert ranked(ArrivalOrder(), prompts) == ["first", "second", "third"]
    assert not ArrivalOrder.ranks_by_work and ResponseRatioOrder.ranks_by_work


def test_response_ratio_puts_the_least_work_first_among_prompts_that_waited_alike():
    assert ranked(ResponseRatioOrder(), {"long": (100, 1000), "short": (100, 50), "middle": (100, 400)}) == [
        "short", "middle", "long"]


def test_response_ratio_lets_a_long_prompt_that_waited_go_before_a_short_newcomer():
    order = ResponseRatioOrder()
    # (1000 + 1000) / 1000 = 2 beats (100 + 150) / 150 = 1.67; a newer short one waiting 200 ties at 2.33 and wins.
    assert ranked(order, {"long": (1000, 1000), "newcomer": (100, 150)}) == ["long", "newcomer"]
    assert ranked(order, {"long": (1000, 1000), "newcomer": (200, 150)}) == ["newcomer", "long"]
    assert ranked(order, {"a": (0, 100), "b": (0, 100)}) == ["a", "b"]  # equal keys: arrival order
