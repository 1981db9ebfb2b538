"""`train.interrupt.StopRequests`: a signal is deferred, and nested guards share it."""
import os
import signal

import pytest

from rstar_jax.train import interrupt


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR2])
def test_signal_is_deferred_and_handlers_restored(signum):
  # SIGUSR2: what the SLURM script sends through srun (which turns SIGTERM into SIGKILL).
  before = signal.getsignal(signum)
  with interrupt.StopRequests() as stop:
    assert not stop.requested
    os.kill(os.getpid(), signum)
    assert stop.requested and stop.signum == signum
  assert signal.getsignal(signum) is before


def test_a_signal_in_an_inner_guard_reaches_the_outer_one():
  # A trainer's loop (inner) that ends normally after its last step must not swallow
  # the request: the recipe's stage loop (outer) still sees it.
  before = signal.getsignal(signal.SIGINT)  # SIG_IGN where the suite runs as a background job
  with interrupt.StopRequests() as outer:
    with interrupt.StopRequests() as inner:
      os.kill(os.getpid(), signal.SIGINT)
      assert inner.requested
    assert outer.requested and outer.signum == signal.SIGINT
    with pytest.raises(KeyboardInterrupt):   # a second Ctrl-C aborts at once
      os.kill(os.getpid(), signal.SIGINT)
  assert signal.getsignal(signal.SIGINT) is before


def test_interrupted_names_where_it_stopped():
  assert "after step 3 " in str(interrupt.Interrupted(signal.SIGTERM, 3))
  assert "after stage sft " in str(interrupt.Interrupted(signal.SIGINT, after="stage sft"))
