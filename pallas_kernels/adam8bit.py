"""The 8-bit AdamW update of a bfloat16 leaf in one pass, written in place.

What ``lowmem_jax.optim.lowbit.adamw_8bit(..., bfloat16_params=True)`` and
``optax.apply_updates`` do to one leaf, or a slice of one, in one kernel: it reads the
parameter, the gradient and both moments' codes and block scales once, and writes the new
parameter, codes and scales over the old ones, where they lie in bigger buffers (a layer of a
stack, some rows of it: ``input_output_aliases``): 10 bytes an element for a bfloat16
gradient, plus 16 a block of 256, against 14.26 for the update as XLA fuses it alone and
about 32 inside the layer-streamed step, where XLA copies slices out of the stacks and back
(``docs/benchmarks.md``). A program holds whole scale blocks, so the new moments' block
maxima are taken where they are made, not in a pass of their own. Given the stack's step
counts and keys, it writes the slice's new count and key too, from the words made for every
slice of the stack before the loop over them (``lowmem_jax.optim.fused_update.Table``): a
layer's update is then this kernel and its gradient's finiteness check, no scalar kernels.

The arithmetic is the library's, `lowmem_jax.ops._lowbit_reference`: Adam's moments and
direction, the 8-bit codes and the parameter's stochastic rounding, as the XLA update
computes them. Each element's random bits are the Threefry-2x32 words
`lowmem_jax.optim.lowbit.rounding_bits` draws (Salmon et al., SC 2011), computed here with
32-bit integer operations (`threefry2x32`), as Triton has no Threefry of its own: two
evaluations an element (the moments' codes take the two words of one, the parameter the
first of the other), 77 integer operations each, rotations as funnel shifts. The kernel
declares its lane operations with its bytes (`pallas_kernels._blocks.pallas_call`), which the
step-time estimate charges at the target's vector pipes' rates. `tests/test_pallas_adam8bit.py`
holds the kernel, in interpret mode, to the optax chain compiled as written (XLA's excess
precision off: by default XLA keeps some bfloat16 results in float32 where it fuses them, and
the two then differ by a bfloat16 unit in about 0.1% of the parameters): the parameter and
the codes bit for bit, the scales to float32 roundings. On a GPU, Triton divides float32
approximately (PTX's ``div.full.f32``, within 2 ulp) where XLA rounds correctly, so a few
directions land a bfloat16 unit from the chain's, moving their parameters by a unit of the
update (many of a parameter's own units near zero), and a few moments a code (the
``gpu``-marked test's bound). Compiled for sm_90a and sm_89; on an H100 (session 40) its calls
took 1.6 times the estimate at the published integer rate, and the step was slower than with
XLA's update (``docs/gpu.md``).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lowmem_jax.ops import _lowbit_reference as reference
from pallas_kernels import _blocks

__all__ = ["block_rows", "supports", "threefry2x32", "update"]

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA
_WORDS = 14  # a slice's words (`update`)


def threefry2x32(key0, key1, x0, x1):
  """Threefry-2x32 with 20 rounds (Salmon et al., 2011) of the uint32 counter pair
  ``(x0, x1)`` under the key ``(key0, key1)`` (uint32, broadcast together): both output
  words, uint32, as ``jax.extend.random.threefry2x32_p`` gives them."""
  rotate = lambda x, r: (x << jnp.uint32(r)) | (x >> jnp.uint32(32 - r))
  keys = (key0, key1, key0 ^ key1 ^ jnp.uint32(_PARITY))
  x0, x1 = x0 + keys[0], x1 + keys[1]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x0 = x0 + x1
      x1 = rotate(x1, r) ^ x0
    x0 = x0 + keys[(i + 1) % 3]
    x1 = x1 + keys[(i + 2) % 3] + jnp.uint32(i + 1)
  return x0, x1


def _counters(n: int, block: tuple[int, int], rows_inside: int | None):
  """uint32 ``(row, within)`` of each element of the program's block of the slice, viewed as
  rows of ``n``, before its position's row and offset are added: the tree row it lies in,
  and its flat index in that row (``rows_inside``: a tree row's elements; None: one row)."""
  m = (pl.program_id(0) * block[0]
       + jax.lax.broadcasted_iota(jnp.int32, block, 0)).astype(jnp.uint32)
  col = (pl.program_id(1) * block[1]
         + jax.lax.broadcasted_iota(jnp.int32, block, 1)).astype(jnp.uint32)
  flat = m * jnp.uint32(n) + col
  if rows_inside is None:
    return jnp.zeros_like(flat), flat
  return flat // jnp.uint32(rows_inside), flat % jnp.uint32(rows_inside)


def _window(ref, first_row, block: tuple[int, int]):
  """The program's ``block`` of ``ref`` (rows of a buffer) for a slice from row
  ``first_row`` (int32 []): a view to load from and store to."""
  top = first_row + pl.program_id(0) * block[0]
  return ref.at[pl.ds(top, block[0]), pl.ds(pl.program_id(1) * block[1], block[1])]


def _kernel(*refs, hyper, n, block_rows, rows_inside, steps):
  """A program's block of the slice: ``refs`` are `update`'s operands in its order (``count``
  and ``key`` with ``steps``), then the buffers it writes."""
  inputs, outputs = refs[:10 + 2 * steps], refs[10 + 2 * steps:]
  row_ref, ok_ref, words_ref, numbers_ref, p_ref, g_ref, mc_ref, ms_ref, vc_ref, vs_ref = (
      inputs[:10])
  p_out, mc_out, ms_out, vc_out, vs_out = outputs[:5]
  block, scale_block = (block_rows, hyper.block), (block_rows, 1)
  row = row_ref[0]
  word = lambda k: words_ref[row * _WORDS + k]
  first = lambda k: word(6 + k).astype(jnp.int32)
  p, g = _window(p_ref, first(0), block)[...], _window(g_ref, first(1), block)[...]
  old = [(_window(c, first(k), block)[...], _window(s, first(k), scale_block)[...])
         for k, c, s in ((2, mc_ref, ms_ref), (3, vc_ref, vs_ref))]
  mu, nu = (reference.decoded(c.astype(jnp.uint32), signed=signed) * s
            for (c, s), signed in zip(old, (True, False)))
  mu, nu = reference.adam_moments(mu, nu, g, b1=hyper.b1, b2=hyper.b2)

  tree_row, within = _counters(n, block, rows_inside)
  tree_row, within = word(4) + tree_row, word(5) + within
  noise = [*threefry2x32(word(0), word(1), tree_row, within),  # mu's and nu's codes
           threefry2x32(word(2), word(3), tree_row, within)[0]]  # the parameter
  ok = ok_ref[0]
  direction = reference.adam_step(mu / numbers_ref[2 * row], nu / numbers_ref[2 * row + 1],
                                  eps=hyper.eps, eps_root=0.0).astype(g.dtype)
  if hyper.weight_decay:
    direction = direction + hyper.weight_decay * p
  u = -hyper.learning_rate * direction
  p_new = (p.astype(jnp.float32) + reference.rounded_update(u, p, noise[2])).astype(p.dtype)
  _window(p_out, first(0), block)[...] = jnp.where(ok, p_new, p)
  for k, x, signed, bits, c_out, s_out, (c_old, s_old) in zip(
      (2, 3), (mu, nu), (True, False), noise, (mc_out, vc_out), (ms_out, vs_out), old):
    scale = reference.abs_max(x)
    _window(c_out, first(k), block)[...] = jnp.where(
        ok, reference.codes(x, scale, bits, signed=signed), c_old)
    _window(s_out, first(k), scale_block)[...] = jnp.where(ok, scale[:, None], s_old)

  if steps:
    count_out, key_out = outputs[5:]

    @pl.when(jnp.logical_and(ok, (pl.program_id(0) == 0) & (pl.program_id(1) == 0)))
    def _():  # the step taken: the count and the key the next step reads
      count_out[row] = word(10).astype(jnp.int32)
      key_out[2 * row] = word(11)
      key_out[2 * row + 1] = word(12)


def block_rows(rows: int, block: int) -> int:
  """Rows a program takes of a slice of ``rows`` rows: a power of two that divides ``rows``
  (no program's window overhangs the slice), at most `_blocks.BLOCK_ELEMENTS` elements."""
  return min(rows & -rows, max(1, _blocks.BLOCK_ELEMENTS // block))


def supports(shape: tuple[int, ...], block: int) -> str | None:
  """Why the kernel cannot update a slice of ``shape`` in blocks of ``block``, or None."""
  if len(shape) == 0 or shape[-1] % block or math.prod(shape) == 0:
    return f"a slice of shape {shape} is not whole blocks of {block} along a last axis"
  if math.prod(shape) >= 2 ** 32:
    return f"a slice of {math.prod(shape)} elements is past the 2^32 its counters hold"
  return None


def _bytes(buffers: list[jax.Array], shape: tuple[int, ...], steps: bool) -> int:
  """Bytes the kernel moves: each buffer's slice read once, and those of the parameter and
  the moments (not the gradient's) written once; besides its row, ``ok``, its row's words
  and numbers (69 bytes), and the count and key it writes (12, with ``steps``)."""
  rows = math.prod(shape[:-1])
  moved = [rows * x.shape[1] * x.dtype.itemsize * (1 if k == 1 else 2)
           for k, x in enumerate(buffers)]
  return sum(moved) + 4 * (1 + _WORDS + 2) + 1 + 12 * steps


@functools.partial(jax.jit, static_argnames=("hyper", "shape", "rows", "options"),
                   donate_argnames=("p", "mu", "nu", "count", "key"))
def update(p: jax.Array, g: jax.Array, mu, nu, count: jax.Array | None, key: jax.Array | None,
           words: jax.Array, numbers: jax.Array, row: jax.Array, ok: jax.Array, *, hyper,
           shape: tuple[int, ...], rows: bool = True,
           options: _blocks.Options = _blocks.Options()):
  """One AdamW step of a slice of a bfloat16 leaf with 8-bit moments, rounded stochastically,
  written in place, with its step count and key.

  Each buffer is read as rows of the slice's last axis: the slice is rows ``[r, r + M)`` of
  it, ``M = prod(shape[:-1])``, ``r`` its first row (``words``): a whole leaf, a layer of
  a stack of them, some rows of one. ``words`` and ``numbers`` hold ``R`` slices' (a
  stack's layers', made before the loop over them), of which ``row`` is this one's.

  Args:
    p: bfloat16, the parameters' buffer.
    g: the slice's gradient's buffer, bfloat16 or float32.
    mu, nu: the moments' buffers, `lowmem_jax.optim.lowbit.QuantizedArray` s: signed and
      unsigned codes (``p``'s rows) and scales (rows of ``shape[-1] / hyper.block``).
    count: int32 ``[R]``, the slices' Adam step counts; key: uint32 ``[R, 2]``, their
      rounding keys (`lowmem_jax.optim.rounding.StochasticRoundingState`): row ``row``'s
      set to the step's (``words``) where ``ok``. Both None: left to the caller (a count
      inside a bigger buffer, a host row's, would be copied whole to be aliased).
    words: uint32 ``[R, 14]``, a slice's: the Threefry keys of the moments' and the
      parameter's rounding (``jax.random.key_data`` of each key folded with the leaf's index:
      two words each); its position's row and offset (`lowmem_jax.optim.lowbit.Position`);
      its first row in ``p``, ``g``, ``mu`` and ``nu``; the new count; the next key (two
      words); 0.
    numbers: float32 ``[R, 2]``: Adam's bias corrections ``1 - b1**count`` and
      ``1 - b2**count`` of each slice's new count.
    row: int32 ``[]``, this slice's row of ``count``, ``key``, ``words`` and ``numbers``.
    ok: bool ``[]``: False keeps every value (a step whose gradient is not finite).
    hyper: the static hyperparameters (`lowmem_jax.optim.lowbit.adamw_8bit`'s ``fused``).
    shape: the slice's shape (`supports` it).
    rows: the position's ``rows``: the slice's first axis runs over the tree's rows.
    options: interpret mode and tuning.

  Returns:
    ``(p, mu, nu, count, key)``: the buffers, the slice updated (donated: in place).
  """
  if p.dtype != jnp.bfloat16:
    raise ValueError(f"`p` must be bfloat16, got {p.dtype}.")
  block = hyper.block
  if block & (block - 1):
    raise ValueError(f"hyper.block must be a power of two, got {block}.")
  why = supports(shape, block)
  if why:
    raise ValueError(f"`shape` {shape}: {why}.")
  slices = jnp.shape(words)[0] if jnp.ndim(words) == 2 else -1
  steps = [] if count is None and key is None else [count, key]
  for name, x, want in (("words", words, (slices, _WORDS)), ("numbers", numbers, (slices, 2)),
                        ("row", row, ()), ("ok", ok, ()),
                        *zip(("count", "key"), steps, ((slices,), (slices, 2)))):
    if x is None or jnp.shape(x) != want:
      raise ValueError(f"`{name}` must be of shape {want} (`words`' slices), got "
                       f"{None if x is None else jnp.shape(x)}.")
  n = shape[-1]
  as_rows = lambda x, width: x.reshape(-1, width)
  buffers = [as_rows(p, n), as_rows(g, n), *[
      as_rows(x, w) for q in (mu, nu) for x, w in ((q.codes, n), (q.scales, n // block))]]
  for name, x in zip(("p", "g", "mu.codes", "mu.scales", "nu.codes", "nu.scales"), buffers):
    if x.shape[0] < math.prod(shape[:-1]):
      raise ValueError(f"`{name}` holds {x.shape[0]} rows, fewer than the slice's.")
  rows_inside = math.prod(shape[1:]) if rows else None
  m = block_rows(math.prod(shape[:-1]), block)
  whole = pl.no_block_spec
  scalars = [jnp.reshape(row, (1,)).astype(jnp.int32), jnp.reshape(ok, (1,)).astype(jnp.bool_),
             words.reshape(-1), numbers.reshape(-1)]
  steps = [x.reshape(-1) for x in steps]
  written = [buffers[0], *buffers[2:], *steps]
  out = _blocks.pallas_call(
      functools.partial(_kernel, hyper=hyper, n=n, block_rows=m, rows_inside=rows_inside,
                        steps=bool(steps)),
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in written],
      grid=(math.prod(shape[:-1]) // m, n // block),
      in_specs=[whole] * (10 + len(steps)), out_specs=[whole] * len(written),
      input_output_aliases={4: 0, **{5 + k: k for k in range(1, len(written))}},
      interpret=options.interpret, compiler_params=options.compiler_params(),
      name="lowmem_adamw_8bit",
      metadata={"bytes_accessed": str(_bytes(buffers, shape, bool(steps)))})(
          *scalars, *buffers, *steps)
  new_p, mc, ms, vc, vs, *new_steps = out
  as_moment = lambda c, s, q: q._replace(codes=c.reshape(q.codes.shape),
                                         scales=s.reshape(q.scales.shape))
  new_steps = [x.reshape(y.shape) for x, y in zip(new_steps, (count, key))] or [None, None]
  return (new_p.reshape(p.shape), as_moment(mc, ms, mu), as_moment(vc, vs, nu), *new_steps)
