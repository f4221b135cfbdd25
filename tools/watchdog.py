"""A watchdog for a lent card's one run: a stage that outlives its time ends the run,
with what it has measured written first.

A kernel whose warpgroups wait on each other's barriers forever (a deadlock: the
warp-specialised kernels' failure a CPU cannot rule out) hangs the jax call that runs it,
and the rest of the card's minutes with it; nothing below the hung call returns, and a
run killed from outside writes nothing. The watchdog is a thread that sees which stage
the run is in: when one has run `limit` seconds, it calls `on_hang(label, seconds)`
(which writes the results so far) and ends the process at once (`os._exit`: the hung
call holds the main thread, and the driver frees the card when the process goes).

    watch = Watchdog(limit=120, on_hang=lambda label, seconds: save(...))
    with watch.stage("grad causal flex_mgpu_ws:bwd"):
      ...  # the jax calls of one case

`rehearse`: a stage whose label starts with it hangs on purpose (it sleeps), so that a
CPU can rehearse what the card's run does when a kernel hangs.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

EXIT_HUNG = 3  # the process's exit status when a stage hung


class Watchdog:

  def __init__(self, limit: float | None, on_hang, rehearse: str | None = None,
               poll: float = 0.5):
    """limit: seconds one stage may run (None: no watchdog, as for a compile-only run);
    on_hang(label, seconds): called once, from the watchdog's thread, before the exit."""
    self.limit, self.on_hang, self.rehearse, self.poll = limit, on_hang, rehearse, poll
    self._current = None  # (label, start) of the stage running now
    if limit is not None:
      threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

  @contextlib.contextmanager
  def stage(self, label: str):
    self._current = (label, time.perf_counter())
    try:
      if self.rehearse is not None and label.startswith(self.rehearse):
        print(f"[watchdog] {label}: hanging on purpose (--rehearse-hang)", flush=True)
        while True:
          time.sleep(60)
      yield
    finally:
      self._current = None

  def _watch(self):
    while True:
      time.sleep(self.poll)
      current = self._current
      if current is None:
        continue
      label, start = current
      seconds = time.perf_counter() - start
      if seconds > self.limit:
        print(f"[watchdog] HUNG: '{label}' has run {seconds:.0f} s (limit {self.limit:g} s): "
              "a kernel that never returns (a deadlock between warpgroups?); the results so "
              f"far are written, exit status {EXIT_HUNG}", flush=True)
        try:
          self.on_hang(label, round(seconds, 1))
        finally:
          os._exit(EXIT_HUNG)
