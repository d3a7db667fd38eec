"""The ``lowmem-jax`` console script: `lowmem_jax.app.cli` loaded and run with the notes
CUDA's stub libraries print on a machine without a GPU dropped.

A package of its own, of the standard library only, because the notes come as
``import jax`` loads JAX's CUDA plugin (three lines; a fourth when the GPU
target's compiler loads), before any code of ``lowmem_jax`` could run: they
say nothing about a compile-only GPU target.
"""

import contextlib
import os
import sys
import tempfile
import threading

_CUDA_NOTE = "Could not find cuda drivers on your machine, GPU will not be used."
_ABSL_NOTE = ("WARNING: All log messages before absl::InitializeLog() is called are written to "
              "STDERR")


@contextlib.contextmanager
def without_cuda_notes():
  """Drops the lines `_CUDA_NOTE` (each after `_ABSL_NOTE`) that CUDA's stub libraries write
  to file descriptor 2 when JAX's CUDA plugin loads on a machine without a GPU, as it does
  to compile for a GPU target: C++ logging (absl ``LOG(INFO)`` in XLA's
  ``tsl/cuda/cudart_stub.cc``, inside ``xla_cuda_plugin.so``), which neither Python's
  logging nor ``TF_CPP_MIN_LOG_LEVEL`` reaches. Every other line written meanwhile is
  written on, in order, when the block ends."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as caught:
    os.dup2(caught.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      caught.seek(0)
      lines = caught.read().decode(errors="replace").splitlines(keepends=True)
      kept = [line for i, line in enumerate(lines) if _CUDA_NOTE not in line and not (
          line.startswith(_ABSL_NOTE) and i + 1 < len(lines) and _CUDA_NOTE in lines[i + 1])]
      sys.stderr.write("".join(kept))
      sys.stderr.flush()


def main() -> int:
  """Runs ``lowmem-jax`` (`lowmem_jax.app.cli.main`) on ``sys.argv``.

  The work runs in a thread, so Ctrl-C is heard at once, in the middle of a compile too:
  the process then says so in one line on the terminal's stderr and ends with status 130
  (128 + SIGINT) at once, without a traceback and without unwinding XLA's threads (which
  crashed on the way out). A ``--step`` module runs in that thread too: it cannot install
  signal handlers."""
  terminal = os.dup(2)  # stderr as it is now: `without_cuda_notes` may hold fd 2 when stopped
  outcome = {}

  def run():
    try:
      with without_cuda_notes():
        from lowmem_jax.app import cli
      outcome["status"] = cli.main(quiet_plugin_load=without_cuda_notes)
    except BaseException as e:  # noqa: BLE001  (re-raised in the main thread below)
      outcome["error"] = e

  worker = threading.Thread(target=run, name="lowmem-jax", daemon=True)
  try:
    worker.start()
    while worker.is_alive():
      worker.join(0.1)
  except KeyboardInterrupt:
    sys.stdout.flush()
    # On a terminal: the progress bar's line cleared and the cursor it hid shown again.
    restore = b"\r\x1b[2K\x1b[?25h" if os.isatty(terminal) else b""
    os.write(terminal, restore + b"lowmem-jax: interrupted\n")
    os._exit(130)
  os.close(terminal)
  if "error" in outcome:
    raise outcome["error"]
  return outcome["status"]
