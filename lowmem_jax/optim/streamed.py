"""The layer-streamed train step: the optimizer runs inside the backward, one layer at a time.

For a model ``head(scan(layer, embed(batch), stacked_params), batch)`` (a
`LayerStack`).
"""

import dataclasses
from typing import Any, Callable

import jax


@dataclasses.dataclass(frozen=True)
class LayerStack:
  """A model of identical stacked layers between an embedding and a head.

  ``params`` is a dict whose entry ``key`` holds the layers, each leaf
  ``[layers, ...]``; the other entries (``rest``: embedding, final norm, head,
  tied or not) are read by ``embed`` and ``head``. The loss is
  ``head(rest, scan(layer, embed(rest, batch)), batch)``.

  Attributes:
    embed: ``(rest, batch) -> h``, ``h: [batch, length, dim]`` in the compute dtype.
    layer: ``(layer_params, h, batch) -> h`` for one layer (its params: one slice
      of ``params[key]``); ``h`` keeps its shape and dtype. ``batch`` is read, not
      differentiated (positions, masks).
    head: ``(rest, h, batch) -> loss``, a float32 scalar (the mean over the batch).
    key: the entry of ``params`` that holds the stacked layers.
  """
  embed: Callable[[Any, Any], jax.Array]
  layer: Callable[[Any, jax.Array, Any], jax.Array]
  head: Callable[[Any, jax.Array, Any], jax.Array]
  key: str = "layers"
