"""Wide residual network with batch norm (Zagoruyko & Komodakis, "Wide Residual
Networks", BMVC 2016, arXiv:1605.07146), the CIFAR-10 model of Sohoni et al.'s
low-memory training report.

WRN-d-k: three groups of ``(d - 4) / 6`` pre-activation basic blocks
(BN-ReLU-conv3x3-BN-ReLU-conv3x3) of widths 16k, 32k, 64k, strides 1, 2, 2,
after a 3x3 stem conv of width 16; then BN-ReLU, global average pool and a
dense head (`multiply_and_sum`: no GEMM). WRN-28-2 has 1.47M parameters.

Switches: ``activation``, ``conv`` and ``density`` (see `WideResNet`), and `Switches`'
``remat`` / ``remat_policy`` for the blocks, ``dtype``, ``param_dtype``.

Batch norm in training mode (``train=True``) normalises with the statistics
of the batch it is given. Under micro-batching (`lowmem_jax.microbatch_step`)
that batch is the micro-batch: the statistics are per micro-batch, as in
ghost batch norm (Hoffer et al. 2017, arXiv:1705.08741) with the micro-batch
as the ghost batch, so the step is not the full-batch step. A loop that keeps
the running averages updates them from micro-batch statistics
(`lowmem_jax.microbatch_step` with ``has_aux`` returns the k updated
``batch_stats`` stacked; which to keep is the loop's choice), or recomputes
them after training over the training set.
"""

import functools
import itertools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lowmem_jax.choices import Activation, Conv, checked
from lowmem_jax.flax.linen import SparseConv
from lowmem_jax.models._common import Switches
from lowmem_jax.ops import compress
from lowmem_jax.ops.activations import relu

ACTIVATIONS = (Activation.EXACT, Activation.ONE_BIT)  # its ReLU's: plain, or a 1-bit mask kept
BN_MOMENTUM = 0.9  # of every batch norm's running averages


def check_switches(activation: str, conv: str) -> tuple[Activation, Conv]:
  """The WideResNet's switches as `lowmem_jax.choices` members; a ValueError names the first
  with an unknown value (``"approx"`` is the transformers' ReGELU2/ReSiLU2: the ReLU's own
  is ``"1bit"``)."""
  return checked(Activation, activation, "activation", ACTIVATIONS), checked(Conv, conv, "conv")


CONV_FNS = {Conv.PLAIN: None, Conv.POOLED: functools.partial(compress.pooled_conv, pool=2),
            Conv.INT8: compress.int8_conv}


def multiply_and_sum(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  """The head's ``[batch, features] x [features, classes]`` product as a multiply and a
  float32 sum, a `flax.linen.Dense` ``dot_general``: XLA fuses it into one kernel, where a
  GEMM is a cuBLAS call holding a 4 MiB workspace on the H100 target (no autotuning), more
  than a third of the step's peak with every technique on."""
  del precision, preferred_element_type
  if dimension_numbers != (((lhs.ndim - 1,), (0,)), ((), ())) or rhs.ndim != 2:
    raise ValueError(f"multiply_and_sum contracts lhs's last axis with a matrix's first, got "
                     f"{dimension_numbers} for {lhs.shape} and {rhs.shape}.")
  matrix = rhs.astype(jnp.float32).reshape((1,) * (lhs.ndim - 1) + rhs.shape)
  product = lhs.astype(jnp.float32)[..., :, None] * matrix
  return product.sum(axis=-2).astype(jnp.promote_types(lhs.dtype, rhs.dtype))


class Block(nn.Module):
  """Pre-activation basic block; a 1x1 conv shortcut where the shape changes."""
  width: int
  stride: int
  activation: str = "exact"
  conv: str = "plain"
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  density: float | None = None

  @nn.compact
  def __call__(self, x, train: bool = True):
    act = relu if self.activation == "1bit" else jax.nn.relu
    if self.density is None:
      conv_class = functools.partial(nn.Conv, use_bias=False)
    else:  # the same names as the dense model's, so that the param trees match
      conv_class = functools.partial(SparseConv, density=self.density)
    names = (f"Conv_{i}" for i in itertools.count())

    def conv(*args, **kwargs):
      return conv_class(*args, **kwargs, dtype=self.dtype, param_dtype=self.param_dtype,
                        conv_general_dilated=CONV_FNS[self.conv], name=next(names))
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=BN_MOMENTUM,
                             dtype=self.dtype, param_dtype=self.param_dtype)
    h = act(norm()(x))
    shortcut = x
    if self.stride != 1 or x.shape[-1] != self.width:
      shortcut = conv(self.width, (1, 1), strides=self.stride)(h)
    h = conv(self.width, (3, 3), strides=self.stride)(h)
    h = conv(self.width, (3, 3))(act(norm()(h)))
    return shortcut + h


class WideResNet(Switches):
  """WRN-depth-widen classifier; defaults are WRN-28-2 on CIFAR-10.

  Input ``float[batch, image, image, channels]`` (image a multiple of 8 for
  ``conv="pooled"``); output ``float32[batch, num_classes]``. Call with
  ``train=True`` (batch statistics; make ``"batch_stats"`` mutable) or
  ``train=False`` (running averages).

  Attributes:
    depth: 6n + 4 layers; widen: the width multiplier k.
    num_classes: classes of the head.
    activation: "exact", `jax.nn.relu`, which saves a float array, or "1bit",
      `lowmem_jax.relu`, which saves a 1-bit mask and is exact too: ReLU's
      derivative is a step. ("approx" is the transformers' ReGELU2/ReSiLU2: refused here.)
    conv: "plain", "pooled" (`lowmem_jax.ops.compress.pooled_conv` with pool 2) or
      "int8" (the conv input saved as int8 rows, see `lowmem_jax.ops.compress`);
      where a block's shortcut is a 1x1 conv, it and the first 3x3 conv each
      save their own compressed copy of the same input.
    density: None (dense kernels) or a float in (0, 1): each block's convs
      stored sparse at that density (`lowmem_jax.flax.linen.SparseConv`; the stem
      and the head stay dense), trained with `lowmem_jax.optim.sparse.sparse_storage`.
    remat, remat_policy, dtype, param_dtype: `Switches`' (keywords).
  """
  depth: int = 28
  widen: int = 2
  num_classes: int = 10
  activation: str = "exact"
  conv: str = "plain"
  density: float | None = None

  @nn.compact
  def __call__(self, images, train: bool = True):
    activation, _ = check_switches(self.activation, self.conv)
    if self.depth < 10 or (self.depth - 4) % 6:
      raise ValueError(f"depth must be 6n + 4 with n >= 1, got {self.depth}.")
    if self.widen < 1:
      raise ValueError(f"widen must be >= 1, got {self.widen}.")
    if not (self.density is None or isinstance(self.density, float) and 0 < self.density < 1):
      raise ValueError(f"density must be None or a float in (0, 1), got {self.density!r}.")
    block = self.remat_block(Block, static_argnums=(2,))
    x = nn.Conv(16, (3, 3), use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
                name="stem")(images.astype(self.dtype))
    for group, (width, stride) in enumerate(zip((16, 32, 64), (1, 2, 2))):
      for i in range((self.depth - 4) // 6):
        x = block(width * self.widen, stride if i == 0 else 1, activation, self.conv,
                  self.dtype, self.param_dtype, self.density,
                  name=f"group{group}_block{i}")(x, train)
    x = jax.nn.relu(nn.BatchNorm(use_running_average=not train, momentum=BN_MOMENTUM,
                                 dtype=self.dtype, param_dtype=self.param_dtype,
                                 name="final_norm")(x))
    x = x.mean(axis=(1, 2))
    head = nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype,
                    dot_general=multiply_and_sum, name="head")
    return head(x).astype(jnp.float32)
