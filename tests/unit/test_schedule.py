from qosagent.schedule import Every, Pace


def test_due_at_once_then_once_per_period_without_catching_up() -> None:
    e = Every(1.0)
    assert [e.due(t) for t in (0.0, 0.5, 0.99, 1.0, 1.5, 5.0, 5.1, 6.0)] == [
        True, False, False, True, False, True, False, True]
    e.again()
    assert e.due(6.1) and not e.due(6.2)


def test_pace_rests_after_rest_seconds_of_quiet_ticks_and_wakes_at_the_first_busy_one() -> None:
    p = Pace(0.1, 0.5)
    # Quiet from 0.0 on: still at interval until the quiet has lasted rest_interval.
    assert [p.after(t / 10, quiet=True) for t in range(6)] == [0.1, 0.1, 0.1, 0.1, 0.1, 0.5]
    assert p.resting and p.after(1.0, quiet=True) == 0.5
    # One tick that found something: back to interval at once, and the quiet counted afresh.
    assert p.after(1.5, quiet=False) == 0.1 and not p.resting
    assert p.after(1.6, quiet=True) == 0.1 and p.after(2.0, quiet=True) == 0.1 and p.after(2.1, quiet=True) == 0.5


def test_pace_with_rest_no_longer_than_interval_never_rests_and_a_reload_wakes_it() -> None:
    never = Pace(0.1, 0.1)
    assert {never.after(t, quiet=True) for t in range(20)} == {0.1} and not never.resting
    p = Pace(0.1, 0.2)
    for t in (0.0, 0.1, 0.2):
        p.after(t, quiet=True)
    assert p.resting
    p.again(0.05, 1.0)
    assert not p.resting and p.after(0.3, quiet=True) == 0.05
