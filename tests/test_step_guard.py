"""The step guard against intervals fed to it by hand, over a scheduler of decoding sequences."""

from pdrt.engine.block_manager import BlockManager
from pdrt.engine.sampling_params import SamplingParams
from pdrt.engine.scheduler import Scheduler
from pdrt.engine.sequence import Sequence
from pdrt.engine.step_guard import PATIENCE, RECOVERY, SLOWEST, StepGuard

SLO = 0.1
OVER, UNDER = 1.5 * SLO, 0.5 * SLO


def guarded(*context_lengths: int, max_tokens: tuple[int, ...] = ()) -> tuple[StepGuard, list[Sequence]]:
    """A guard over running sequences that decode, with the given contexts (and max_tokens, else the default),
    named by their index."""
    scheduler = Scheduler(BlockManager(64, 16, True, 0), 16, 256, 64)
    seqs = []
    for i, n in enumerate(context_lengths):
        params = SamplingParams(max_tokens=max_tokens[i]) if max_tokens else SamplingParams()
        seq = Sequence(str(i), list(range(n)), n - 1, params, seed=0)
        seq.num_computed_tokens = n - 1
        scheduler.add_running(seq)
        seqs.append(seq)
    return StepGuard(scheduler, SLO), seqs


def feed(guard: StepGuard, interval_s: float, times: int) -> None:
    for _ in range(times):
        guard.observe(interval_s)


def test_three_intervals_in_a_row_over_the_slo_demote_the_longest_context_then_the_next_of_equal_answers():
    guard, seqs = guarded(100, 900, 300, 50)
    feed(guard, OVER, PATIENCE - 1)
    assert guard.scheduler.demoted == []
    guard.observe(OVER)
    assert guard.scheduler.demoted == [seqs[1]] and seqs[1].decode_every == 2
    feed(guard, OVER, PATIENCE)
    assert guard.scheduler.demoted == [seqs[1], seqs[2]]
    assert guard.scheduler.num_demotions == 2


def test_of_a_long_prompt_with_a_short_answer_and_a_short_prompt_with_a_long_one_the_long_answer_goes_first():
    # 1400 context tokens with 15 to come, against 300 with 999: the long answer has 14 times the work left.
    guard, seqs = guarded(1400, 300, 50, 60, max_tokens=(16, 1000, 1000, 1000))
    feed(guard, OVER, PATIENCE)
    assert guard.scheduler.demoted == [seqs[1]]
    feed(guard, OVER, PATIENCE)
    assert guard.scheduler.demoted == [seqs[1], seqs[3]]


def test_alternating_intervals_count_by_their_mean():
    guard, seqs = guarded(100, 900, 300, 50)
    for _ in range(10):
        feed(guard, 1.3 * SLO, 1)
        feed(guard, 0.6 * SLO, 1)  # a mean of 0.95 times the SLO
    assert guard.scheduler.demoted == []
    for times_slo in (1.6, 0.6, 1.6):  # every other interval is under the SLO, but their mean is over it
        guard.observe(times_slo * SLO)
    assert guard.scheduler.demoted == [seqs[1]]


def test_at_most_half_the_streams_are_demoted_and_then_decoded_less_often_still():
    guard, seqs = guarded(100, 900, 300, 50, 20)
    feed(guard, OVER, 20 * PATIENCE)
    assert guard.scheduler.demoted == [seqs[1], seqs[2]]
    assert [s.decode_every for s in seqs] == [1, SLOWEST, SLOWEST, 1, 1]


def test_a_lone_stream_is_never_demoted():
    guard, seqs = guarded(900)
    feed(guard, OVER, 10 * PATIENCE)
    assert guard.scheduler.demoted == [] and seqs[0].decode_every == 1


def test_recovery_promotes_the_most_recently_demoted_first():
    guard, seqs = guarded(100, 900, 300, 50)
    feed(guard, OVER, 2 * PATIENCE)
    assert guard.scheduler.demoted == [seqs[1], seqs[2]]
    feed(guard, 0.9 * SLO, 2 * RECOVERY)  # under the SLO but with no room for a fifth of it more: no promotion
    feed(guard, UNDER, RECOVERY - 1)
    assert guard.scheduler.demoted == [seqs[1], seqs[2]]
    guard.observe(UNDER)
    assert guard.scheduler.demoted == [seqs[1]] and seqs[2].decode_every == 1
    feed(guard, UNDER, RECOVERY)
    assert guard.scheduler.demoted == [] and guard.scheduler.num_promotions == 2


def test_a_large_batch_takes_a_stream_back_closer_to_the_slo_than_a_small_one():
    small, _ = guarded(100, 900, 300, 50)
    large, _ = guarded(*range(100, 1300, 100))
    for guard in (small, large):
        feed(guard, 1.05 * SLO, PATIENCE)  # one demoted
        feed(guard, 0.9 * SLO, SLOWEST + RECOVERY)  # a twelfth more fits under the SLO, a fifth does not
    assert len(small.scheduler.demoted) == 1 and large.scheduler.demoted == []


def test_streams_that_end_bring_the_demoted_back_to_at_most_half():
    guard, seqs = guarded(100, 900, 300, 50)
    feed(guard, OVER, 2 * PATIENCE)
    guard.scheduler.remove(seqs[0])
    guard.observe(OVER)
    assert guard.scheduler.demoted == [seqs[1]]


def test_intervals_run_between_the_ends_of_steps_that_decode():
    guard, seqs = guarded(100, 900)
    seen = []
    guard.observe = seen.append
    guard.stepped(1.0, decoded=True)
    guard.stepped(1.2, decoded=False)  # a step that only prefilled
    guard.stepped(1.5, decoded=True)
    guard.idle()
    guard.stepped(9.0, decoded=True)
    guard.stepped(9.1, decoded=True)
    assert [round(s, 6) for s in seen] == [0.5, 0.1]
