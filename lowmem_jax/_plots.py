"""PNG plots of `lowmem_jax.compile.memory.Breakdown`s (matplotlib, an optional extra).

Imports nothing of the library: the breakdowns and the names of their
components come in as arguments.
"""


def _pyplot():
  try:
    import matplotlib
  except ImportError as e:
    raise ImportError("Plots need matplotlib: pip install 'lowmem-jax[plot]'.") from e
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def components(path: str, breakdowns, order, estimated) -> None:
  """Stacked bars of the components live at each breakdown's peak, in GiB.

  Args:
    path: the PNG to write.
    breakdowns: `lowmem_jax.compile.memory.Breakdown`s, one bar each.
    order: the components' names, bottom first (`lowmem_jax.compile.memory.COMPONENTS`).
    estimated: the names labelled estimated (`lowmem_jax.compile.memory.ESTIMATED`).
  """
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(1.6 * len(breakdowns) + 3, 4.5))
  labels = [b.label for b in breakdowns]
  bottom = [0.0] * len(breakdowns)
  for component in order:
    heights = [b.at_peak[component] / 2**30 for b in breakdowns]
    if any(heights):
      name = component + (" (est.)" if component in estimated else "")
      ax.bar(labels, heights, bottom=bottom, label=name)
      bottom = [lo + h for lo, h in zip(bottom, heights)]
  ax.set_ylabel("GiB live at the compiled peak")
  ax.set_title("Memory at the peak, by component (XLA buffer assignment)")
  ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
  ax.tick_params(axis="x", labelrotation=20)
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)


def live_bytes(path: str, breakdowns) -> None:
  """Live GiB over program order (as a fraction of it), each peak marked."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(8, 4.5))
  for b in breakdowns:
    n = len(b.live_bytes)
    x = [i / max(n - 1, 1) for i in range(n)]
    (line,) = ax.plot(x, [v / 2**30 for v in b.live_bytes], label=b.label, linewidth=1)
    ax.plot(x[b.peak_position], b.live_bytes[b.peak_position] / 2**30, "o", color=line.get_color())
  ax.set_xlabel("position in program order (fraction of the schedule)")
  ax.set_ylabel("GiB live")
  ax.set_title("Live bytes over the compiled program (summed over XLA's buffer live ranges); peaks marked")
  ax.legend(fontsize="small")
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)
