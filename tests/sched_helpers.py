"""Driving the batched scheduler from tests: submit requests, wait until every one has sent its last event."""

from __future__ import annotations

import threading


def submit_and_wait(sched, reqs, timeout: float = 120) -> dict[int, str]:
    """Submit `reqs` (their `emit` is replaced), wait for each one's final event; finish reason per request index."""
    done, lock, out = threading.Event(), threading.Lock(), {}

    def sink(i):
        def emit(ev):
            if ev.finish_reason:
                with lock:
                    out[i] = ev.finish_reason
                    if len(out) == len(reqs):
                        done.set()

        return emit

    for i, r in enumerate(reqs):
        r.emit = sink(i)
        sched.submit(r)
    assert done.wait(timeout), f"requests never finished: {sorted(set(range(len(reqs))) - set(out))}"
    return out
