"""The interrupt rule (orchestrator/run/interrupts.py) where it meets OmegaConf and Hydra: an interrupt
that lands inside them is raised once they are done, so it comes out as the interrupt it is."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

# a child that honours interrupts and sends itself SIGINT from inside OmegaConf (a resolver runs below
# OmegaConf's frames), then says where the KeyboardInterrupt came out
CHILD = textwrap.dedent(
    """
    import os, signal, time, traceback
    from omegaconf import OmegaConf
    from orchestrator.run.interrupts import honour_interrupts

    honour_interrupts()

    def interrupt_me(spin):
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + float(spin)
        while time.monotonic() < deadline:  # still inside OmegaConf
            pass
        return "resolved"

    OmegaConf.register_new_resolver("interrupt_me", interrupt_me)
    cfg = OmegaConf.create({"value": "${interrupt_me:%s}"})
    try:
        value = cfg.value
        time.sleep(5)
        print("no interrupt", flush=True)
    except KeyboardInterrupt as e:
        # where it was raised (exactly when after OmegaConf is up to the scheduler under load)
        frames = [f.filename for f in traceback.extract_tb(e.__traceback__)]
        where = "inside" if any("/omegaconf/" in f for f in frames) else "outside"
        print("interrupted:", e, where, "omegaconf", flush=True)
    """
)


def run_child(spin_s: float) -> tuple[str, float]:
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", CHILD % spin_s], capture_output=True, text=True, timeout=60
    ).stdout
    return out, time.monotonic() - started


def test_an_interrupt_inside_omegaconf_is_raised_once_omegaconf_is_done():
    # without the deferral it was raised inside the resolver, and on Hydra's composition the cut-short
    # update surfaced as an AttributeError (exit 1, not 130)
    out, _ = run_child(0.2)
    assert out.splitlines() == ["interrupted: signal 2 outside omegaconf"], out


def test_an_interrupt_deferred_past_its_limit_is_raised_where_it_lands():
    # a composition that never ends must still stop: DEFER_AT_MOST_S (5 s), not the resolver's 30 s
    out, took = run_child(30.0)
    assert out.splitlines() == ["interrupted: signal 2 inside omegaconf"], out
    assert took < 20, took
