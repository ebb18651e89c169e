"""`pagedserve up` restarts a service that dies instead of stopping the stack: the backoff
rule alone (compose/restarts.py). The launcher's stack with its scheduler and a worker
killed: tests/e2e/test_e2e_launcher_restarts.py."""

from __future__ import annotations

from compose.restarts import RestartBackoff


def test_backoff_doubles_and_resets_after_a_stable_run():
    backoff = RestartBackoff(initial_s=1.0, max_s=4.0, stable_s=60.0)
    assert backoff.due("w", 100.0) == 0.0  # the first crash: at once
    backoff.restarted("w", 100.0)
    assert backoff.due("w", 101.0) == 1.0  # crashed again 1 s later: wait 1 s
    assert backoff.due("w", 101.5) == 0.5
    backoff.restarted("w", 102.0)
    assert backoff.due("w", 103.0) == 2.0
    backoff.restarted("w", 105.0)
    assert backoff.due("w", 105.0) == 4.0
    backoff.restarted("w", 109.0)
    assert backoff.due("w", 110.0) == 4.0  # capped
    backoff.restarted("w", 114.0)
    assert backoff.due("w", 200.0) == 0.0  # it ran 86 s: at once again
    assert backoff.due("other", 200.0) == 0.0  # each service has its own
