"""Which waiting prompt an engine starts next: a policy, chosen once per engine and asked by its scheduler.

A policy ranks a waiting prompt by two numbers, both counted in tokens the
scheduler has put into steps (its clock): how long the prompt has waited,
and how much work it still needs (its tokens past any cached prefix). The
scheduler starts the prompt of the lowest key, and foretells each prompt's
first token by asking again as its clock advances
(`Scheduler.first_token_work`). Drafts (prompts still being typed) always
come after submitted prompts, whatever the policy.

* `ArrivalOrder`: first come, first served. Where prompts are batched side
  by side (a GPU, whose step time grows little with its tokens), their
  order within a step changes nothing.
* `ResponseRatioOrder`: prompts one by one, the highest response ratio
  (wait + work) / work first (Brinch Hansen's HRRN): among prompts that
  waited alike the shortest goes first, and a long one's ratio keeps
  growing until it does. Where a step's time grows with its tokens (a CPU),
  every token of a later prompt in a step delays the first one's first
  token, so prompts run one after another, and this order keeps short ones
  from waiting behind long ones without starving the long ones.
"""

from typing import Protocol


class PromptOrder(Protocol):
    ranks_by_work: bool  # False: the key reads neither number, and the scheduler need not count the work

    def key(self, waited: int, work: int) -> tuple[float, ...]:
        """The rank of a prompt that waited `waited` tokens of the clock and needs `work` (>= 1): lowest first."""
        ...


class ArrivalOrder:
    ranks_by_work = False

    def key(self, waited: int, work: int) -> tuple[float, ...]:
        return ()  # all equal: the stable sort keeps arrival order


class ResponseRatioOrder:
    ranks_by_work = True

    def key(self, waited: int, work: int) -> tuple[float, ...]:
        return -(waited + work) / work, work


def default_order(prompt_batch_tokens: int | None) -> PromptOrder:
    """Arrival order where prompts batch side by side (None), the highest response ratio where they go one by one."""
    return ArrivalOrder() if prompt_batch_tokens is None else ResponseRatioOrder()
