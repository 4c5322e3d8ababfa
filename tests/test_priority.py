"""CatchUp: the prefill worker's niceness follows how long its oldest prompt has waited, on every thread.

Each case runs in a forked child, so the test process keeps its niceness.
"""

import multiprocessing
import os
import resource
import threading
import time

from pdrt.priority import CatchUp
from tests.system_client import niceness


def may_return_to(nice: int) -> bool:
    """Whether this process may lower its niceness back to `nice` (CAP_SYS_NICE as root, else RLIMIT_NICE)."""
    return os.geteuid() == 0 or 20 - resource.getrlimit(resource.RLIMIT_NICE)[0] <= nice


def walk_through_waits(results) -> None:
    start = os.getpriority(os.PRIO_PROCESS, 0)
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, args=(10,))  # a thread started before: reniced with the rest
    helper.start()
    try:
        catch_up = CatchUp(min(start + 10, 19), behind_s=0.1, name="test")
        seen, caught_up_s = [niceness(os.getpid())], []
        for wait_s in (0.05, 0.2, 0.06, 0.04):  # under; over: catch up; above half: stay; under half: yield
            catch_up.update(wait_s)
            seen.append(niceness(os.getpid()))
            time.sleep(0.02)
            caught_up_s.append(catch_up.caught_up_s)
        time.sleep(0.02)
        caught_up_s.append(catch_up.caught_up_s)  # yielding again: it stays
        results.put((start, seen, catch_up.num_catch_ups, catch_up.enabled, caught_up_s))
    finally:
        stop.set()
        helper.join()


def walk_through_ages(results) -> None:
    start = os.getpriority(os.PRIO_PROCESS, 0)
    catch_up = CatchUp(min(start + 10, 19), behind_s=0.1, name="test", late_s=0.2)
    seen = []
    for during_step, age_s in ((True, 0.15), (True, 0.25), (False, 0.15), (False, 0.05)):
        # during a step: under, over: catch up; between steps, none waiting to start: above half: stay; under
        if during_step:
            catch_up.check(age_s)
        else:
            catch_up.update(0.0, age_s)
        seen.append(niceness(os.getpid()))
    results.put((start, seen, catch_up.num_catch_ups))


def run_forked(case) -> tuple:
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    child = ctx.Process(target=case, args=(results,))
    child.start()
    got = results.get(timeout=30)
    child.join(timeout=30)
    assert child.exitcode == 0
    return got


def test_the_prefill_worker_yields_until_a_prompt_waits_too_long_then_until_the_queue_has_caught_up():
    start, seen, num_catch_ups, enabled, caught_up_s = run_forked(walk_through_waits)
    low = min(start + 10, 19)
    if may_return_to(start):
        assert seen == [{low}, {low}, {start}, {start}, {low}]
        assert (num_catch_ups, enabled) == (1, True)
        assert caught_up_s[0] == 0 and 0.02 <= caught_up_s[1] < caught_up_s[2] <= caught_up_s[3] == caught_up_s[4]
    else:  # not permitted to take the CPU back: it stays yielding and stops trying
        assert seen == [{low}] * 5
        assert (num_catch_ups, enabled, caught_up_s) == (0, False, [0.0] * 5)


def test_a_prompt_without_its_first_token_too_long_takes_the_cpu_back_during_the_step_that_computes_it():
    start, seen, num_catch_ups = run_forked(walk_through_ages)
    low = min(start + 10, 19)
    if may_return_to(start):
        assert seen == [{low}, {start}, {start}, {low}] and num_catch_ups == 1
    else:
        assert seen == [{low}] * 4 and num_catch_ups == 0


def walk_through_rooms(results) -> None:
    start = os.getpriority(os.PRIO_PROCESS, 0)
    room = [1.0]
    catch_up = CatchUp(min(start + 10, 19), behind_s=0.4, name="test", late_s=0.8, room=lambda: room[0])
    seen = []
    # Decode steps far within the TPOT SLO: a prompt takes the CPU as soon as it waits, gives it back once none is.
    for room[0], wait_s in ((1.0, 0.01), (1.0, 0.0), (0.5, 0.1), (0.5, 0.25), (0.5, 0.05), (0.0, 0.3), (0.0, 0.5)):
        # half the room: the limit is half (0.2 s); none: the whole (0.4 s)
        catch_up.update(wait_s)
        seen.append(niceness(os.getpid()))
    results.put((start, seen, catch_up.num_catch_ups))


def test_the_more_room_the_decode_steps_have_against_their_slo_the_sooner_a_waiting_prompt_takes_the_cpu():
    start, seen, num_catch_ups = run_forked(walk_through_rooms)
    low = min(start + 10, 19)
    if may_return_to(start):
        assert seen == [{start}, {low}, {low}, {start}, {low}, {low}, {start}] and num_catch_ups == 3
    else:
        assert seen == [{low}] * 7 and num_catch_ups == 0
