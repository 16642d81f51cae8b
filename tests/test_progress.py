"""The progress line every long job prints (titanlite/log.py Progress): due by a monotonic clock, whatever else
the job prints; items done of total, time per item and time left."""

from titanlite.log import Progress, duration


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_line_comes_when_the_interval_has_passed_with_time_per_item_and_time_left(caplog):
    clock = Clock()
    progress = Progress(total=10, label="generate", every_seconds=30, unit="prompt", clock=clock)
    clock.now += 12
    assert progress.advance() is None  # 12 s: not due yet
    clock.now += 12
    assert progress.advance() is None
    clock.now += 12
    line = progress.advance()  # 36 s since the start, 3 prompts: 12 s each, 7 left
    assert line == "generate: 3/10 prompts (30%)  12.00 s/prompt  left 1m 24s"
    with caplog.at_level("INFO", logger="titanlite"):
        clock.now += 0.5
        assert progress.advance(4) is None  # the interval restarts at each line
        clock.now += 29.5
        assert progress.advance() == "generate: 8/10 prompts (80%)  8.25 s/prompt  left 16s"
    assert "generate: 8/10 prompts (80%)" in caplog.text


def test_fast_items_read_in_milliseconds_and_done_sums_up(caplog):
    clock = Clock()
    progress = Progress(total=None, label="prepare", every_seconds=5, unit="document", clock=clock)
    for _ in range(400):
        clock.now += 0.025
        progress.advance()
    with caplog.at_level("INFO", logger="titanlite"):
        assert progress.done() == "prepare: 400 documents in 10s (25 ms/document)"
    assert "prepare: 400 documents in 10s" in caplog.text


def test_a_resumed_job_counts_its_earlier_steps_towards_the_total_not_the_time_per_step():
    clock = Clock()
    progress = Progress(total=200, label="train", every_seconds=30, already=100, clock=clock)
    assert progress.status() == "100/200 steps (50%)"  # nothing measured yet: no time per step, no time left
    clock.now += 40
    assert progress.advance(10) == "train: 110/200 steps (55%)  4.00 s/step  left 6m 00s"


def test_another_line_that_reported_the_progress_delays_the_next():
    clock = Clock()
    progress = Progress(total=5, label="train", every_seconds=30, clock=clock)
    clock.now += 29
    progress.reported()  # e.g. the training step line
    clock.now += 29
    assert progress.advance() is None
    clock.now += 1
    assert progress.advance() is not None


def test_durations_read_at_a_glance():
    assert [duration(s) for s in (0.4, 59, 185, 7620)] == ["0s", "59s", "3m 05s", "2h 07m"]
