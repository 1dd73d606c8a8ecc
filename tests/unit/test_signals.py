"""train.signals.StopSignals: the first stop signal is caught, the second acts as usual."""

import signal

from meta_dist.train.signals import StopSignals


def test_a_signal_during_the_installs_leaves_the_usual_handlers():
    """A SIGTERM arriving between the two installs (raised here right after the first, where
    Python runs its handler) must not leave SIGINT caught: a second Ctrl-C would be lost."""
    before = {n: signal.getsignal(n) for n in (signal.SIGTERM, signal.SIGINT)}
    real, installs = signal.signal, []

    def install_then_signal(number, handler):
        previous = real(number, handler)
        installs.append(number)
        if len(installs) == 1:
            signal.raise_signal(signal.SIGTERM)  # its Python handler runs before this returns
        return previous

    signal.signal = install_then_signal
    try:
        with StopSignals() as stop:
            assert stop.received == signal.SIGTERM
            assert {n: signal.getsignal(n) for n in before} == before
    finally:
        signal.signal = real
    assert {n: signal.getsignal(n) for n in before} == before


def test_the_first_signal_is_caught_and_the_handlers_come_back():
    before = {n: signal.getsignal(n) for n in (signal.SIGTERM, signal.SIGINT)}
    with StopSignals() as stop:
        assert not stop.pending()
        signal.raise_signal(signal.SIGINT)
        assert stop.pending() and stop.name == "SIGINT"
        assert {n: signal.getsignal(n) for n in before} == before  # a second acts as usual
    assert {n: signal.getsignal(n) for n in before} == before
