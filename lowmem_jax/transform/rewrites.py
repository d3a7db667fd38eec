"""What one pass of `lowmem` found: each `Rewrite`, the `Rewrites` of a trace, and the
`Pass` that carries the matchers, the log and the counting through the interpreter."""

import collections
import contextlib
import dataclasses
from typing import Callable

import jax.numpy as jnp

from lowmem_jax.compile import memory
from lowmem_jax.transform.graph import aval, op_at


@dataclasses.dataclass(frozen=True)
class Rewrite:
  """One pattern `lowmem` replaced (``left`` None) or recognised and left.

  Attributes:
    kind: "activation", "norm", "attention", "loss" or "layout" (a matmul over an
      array as saved rather than over its reshape; logged beside the
      attention rewrite it belongs to).
    op: what it became, e.g. "regelu2", "ms_layer_norm + fold into 3 matmuls".
    source: "file.py:line" of the original op.
    saved_bytes: bytes it removes from autodiff's residuals, counted on the
      pattern alone (its inputs to its outputs); 0 for a pattern left.
    left: the reason it was left, or None.
    exact: whether the rewritten function's gradient equals the original's to float
      tolerance; False for ReGELU2/ReSiLU2's approximate backward (LowMemoryBP).
  """
  kind: str
  op: str
  source: str
  saved_bytes: int = 0
  left: str | None = None
  exact: bool = True


@dataclasses.dataclass(frozen=True)
class Rewrites:
  """The `Rewrite`s of one trace, in program order; ``str()`` is a table.

  Iterates, indexes and has a length like the tuple it holds.

  Attributes:
    rewrites: each `Rewrite`, in program order.
  """
  rewrites: tuple[Rewrite, ...] = ()

  def __iter__(self):
    return iter(self.rewrites)

  def __len__(self) -> int:
    return len(self.rewrites)

  def __getitem__(self, index):
    return self.rewrites[index]

  @property
  def counts(self) -> dict[str, int]:
    """Patterns replaced, by kind."""
    return dict(collections.Counter(r.kind for r in self if r.left is None))

  @property
  def saved_bytes(self) -> int:
    return sum(r.saved_bytes for r in self)

  @property
  def exact(self) -> bool:
    """Whether every replacement keeps the gradient (to float tolerance)."""
    return all(r.exact for r in self if r.left is None)

  def __str__(self) -> str:
    import rich.table  # only to print: `import lowmem_jax` does not load rich

    from lowmem_jax import _text

    gradient = "exact gradient" if self.exact else "gradient approximate"
    table = rich.table.Table(title=f"lm.lowmem: {sum(self.counts.values())} rewrites, "
                             f"{self.saved_bytes / 2**20:.1f} MiB fewer residuals, {gradient}")
    for col in ("kind", "became", "gradient", "source", "MiB saved", "left because"):
      table.add_column(col)
    for r in self:
      replaced = r.left is None
      table.add_row(r.kind, r.op if replaced else "-",
                    ("exact" if r.exact else "approximate") if replaced else "-", r.source,
                    f"{r.saved_bytes / 2**20:.2f}", r.left or "")
    return _text.render(table)


class Left(Exception):
  """Raised by a matcher's step: the pattern is recognised and left, for the reason given."""

  @classmethod
  def at(cls, g, why, e, sep=": ") -> "Left":
    """`Left` for the reason ``why``, naming equation ``e`` of ``g`` (or its index) and its
    line."""
    return cls(f"{why}{sep}{op_at(g, e)}")


@dataclasses.dataclass(frozen=True)
class Pass:
  """One evaluation of a traced function with its patterns rewritten.

  Attributes:
    matchers: each ``matcher(graph, actions, pass_)``, in the order they run on a jaxpr.
    log: the `Rewrite`s found so far, appended in program order (nested jaxprs too).
    count: whether each rewrite counts the residual bytes it saves (``explain``).
  """
  matchers: tuple[Callable, ...]
  log: list = dataclasses.field(default_factory=list)
  count: bool = False

  def rewrote(self, g, kind, op, anchor, inputs=(), before=None, after=None, exact=True):
    """Logs a replacement at equation ``anchor``, its gradient ``exact`` or not; when
    counting, the residual bytes of ``before`` less those of ``after``, two functions of
    the vars ``inputs``."""
    saved = 0
    if self.count and before is not None:
      avals = [aval(v) for v in inputs]
      saved = _residual_bytes(before, avals) - _residual_bytes(after, avals)
    self.log.append(Rewrite(kind, op, g.source(anchor), saved, exact=exact))

  def left(self, g, kind, anchor, why):
    """Logs a pattern recognised at equation ``anchor`` and left, for the reason ``why``."""
    self.log.append(Rewrite(kind, "-", g.source(anchor), 0, why))

  @contextlib.contextmanager
  def leaving(self, g, kind, anchor):
    """Logs a `Left` raised inside as the pattern at equation ``anchor`` left, for its reason."""
    try:
      yield
    except Left as left:
      self.left(g, kind, anchor, str(left))

  def result(self) -> Rewrites:
    return Rewrites(tuple(self.log))


def _residual_bytes(fn, avals) -> int:
  """Bytes of autodiff's residuals of ``fn``, differentiated in its float args."""
  diff = [i for i, a in enumerate(avals) if jnp.issubdtype(a.dtype, jnp.floating)]

  def f(*d):
    full = [jnp.zeros(a.shape, a.dtype, out_sharding=a.sharding) for a in avals]  # explicit axes
    for i, x in zip(diff, d):
      full[i] = x
    return fn(*full)

  return memory.saved_residuals(f, *[avals[i] for i in diff]).total_bytes
