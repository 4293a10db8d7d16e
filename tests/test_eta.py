"""The progress line: k/N, the recent pace and the time left, computed by hand."""

import pytest

from rlpipe.eta import Eta, format_duration


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (42.4, "42s"), (59.6, "1m00s"), (185, "3m05s"),
                                           (3600, "1h00m"), (7620, "2h07m"), (-3, "0s")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_pace_and_eta_from_the_steps_seen():
    eta = Eta(total=10, now=100.0)
    assert eta.line() == "0/10 (0%)"
    assert eta.tick(now=102.0) == "1/10 (10%), 2.00 s each, ETA 18s"
    assert eta.tick(now=106.0) == "2/10 (20%), 3.00 s each, ETA 24s"  # (106 - 100) / 2 steps
    assert eta.left_s == pytest.approx(24.0)


def test_window_forgets_old_steps():
    eta = Eta(total=100, window=2, now=0.0)
    for t in (10.0, 20.0, 21.0, 22.0):  # a slow start, then 1 s per step
        eta.tick(now=t)
    assert eta.pace == pytest.approx(1.0)  # the last two steps only: (22 - 20) / 2
    assert eta.left_s == pytest.approx(96.0)


def test_resume_counts_done_steps_but_times_only_new_ones():
    eta = Eta(total=80, done=50, now=1000.0)
    assert eta.pace is None
    line = eta.tick(now=1003.0)
    assert line == "51/80 (64%), 3.00 s each, ETA 1m27s"
    assert eta.tick(done=60, now=1030.0).startswith("60/80 (75%), 3.00 s each, ETA 1m00s")


def test_finished_and_invalid():
    eta = Eta(total=2, done=1, now=0.0)
    assert eta.tick(now=5.0) == "2/2 (100%), 5.00 s each, ETA 0s"
    with pytest.raises(ValueError, match="done=3"):
        Eta(total=2, done=3)
