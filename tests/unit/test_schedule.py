from qosagent.schedule import Every


def test_due_at_once_then_once_per_period_without_catching_up() -> None:
    e = Every(1.0)
    assert [e.due(t) for t in (0.0, 0.5, 0.99, 1.0, 1.5, 5.0, 5.1, 6.0)] == [
        True, False, False, True, False, True, False, True]
    e.again()
    assert e.due(6.1) and not e.due(6.2)
