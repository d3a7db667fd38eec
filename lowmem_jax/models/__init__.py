"""Reference models and their training workloads, by name.

`workload` builds what the benchmarks and the CLI measure: a model, the
abstract shapes of its parameters and batch, and its loss.
"""

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from lowmem_jax import optim
from lowmem_jax.models import bert, llama, wrn
from lowmem_jax.models._common import Switches, TransformerSwitches, check_switches
from lowmem_jax.models.bert import Bert, BertClassifier, BertConfig
from lowmem_jax.models.llama import Llama, LlamaConfig
from lowmem_jax.models.vit import ViT
from lowmem_jax.models.wrn import WideResNet
from lowmem_jax.optim import sparse

VIT_CONFIGS = {
    "vit-tiny": dict(patch_size=16, width=192, depth=2, mlp_dim=768, num_heads=3),  # quick checks
    "vit-b16": dict(patch_size=16, width=768, depth=12, mlp_dim=3072, num_heads=12),
    "vit-l16": dict(patch_size=16, width=1024, depth=24, mlp_dim=4096, num_heads=16),
}
WRN_CONFIGS = {"wrn-28-2": dict(depth=28, widen=2)}
BERT_CONFIGS = {  # a sequence classifier (2 classes) on the post-LN encoder
    "minilm-l6": bert.BertConfig(),
    "bert-base": bert.BertConfig(dim=768, n_layers=12, n_heads=12, ffn_dim=3072),
}
NAMES = tuple(VIT_CONFIGS) + tuple(llama.CONFIGS) + tuple(BERT_CONFIGS) + tuple(WRN_CONFIGS)


@dataclasses.dataclass(frozen=True)
class Workload:
  """A reference model with the shapes of one training batch.

  Attributes:
    name: the reference name, e.g. "vit-b16".
    model: the Flax module.
    inputs: ``ShapeDtypeStruct`` of the input batch (images or tokens).
    labels: ``ShapeDtypeStruct`` of the int32 labels.
  """
  name: str
  model: nn.Module
  inputs: jax.ShapeDtypeStruct
  labels: jax.ShapeDtypeStruct

  def init(self, rng: jax.Array) -> Any:
    """Real parameters."""
    return self.model.init(rng, jnp.zeros(self.inputs.shape, self.inputs.dtype))["params"]

  def abstract_params(self) -> Any:
    """``ShapeDtypeStruct`` pytree of the parameters; allocates nothing."""
    return jax.eval_shape(self.init, jax.random.key(0))

  def batch(self, rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A random batch of the workload's shapes."""
    k1, k2 = jax.random.split(rng)
    if jnp.issubdtype(self.inputs.dtype, jnp.integer):  # token ids
      inputs = jax.random.randint(k1, self.inputs.shape, 0, self.model.config.vocab_size,
                                  self.inputs.dtype)
    else:
      inputs = jax.random.normal(k1, self.inputs.shape, self.inputs.dtype)
    return inputs, jax.random.randint(k2, self.labels.shape, 0, self._classes(), jnp.int32)

  def _classes(self) -> int:
    """The labels' range: the vocabulary for a language model, else the head's classes."""
    return self.model.config.vocab_size if isinstance(self.model, Llama) else self.model.num_classes

  def with_policy(self, policy: Callable | None) -> "Workload":
    """The same workload with each block under `nn.remat` with ``policy``."""
    return dataclasses.replace(self, model=self.model.clone(remat=True, remat_policy=policy))

  @property
  def sparse(self) -> bool:
    """Whether the model stores kernels sparse (the WideResNet's ``density``)."""
    return getattr(self.model, "density", None) is not None

  def dense_params(self) -> Any:
    """``ShapeDtypeStruct`` pytree of the parameters the dense model has (the same
    structure; a sparse kernel at its dense shape): `lowmem_jax.optim.sparse.sparse_storage`'s
    ``dense``."""
    return dataclasses.replace(self, model=self.model.clone(density=None)).abstract_params()

  def layer_stack(self, split_layer: bool = True,
                  split_at_mlp_hidden: bool = False) -> optim.LayerStack:
    """The LLaMA model as `lowmem_jax.optim.LayerStack` (`lowmem_jax.models.llama.layer_stack`,
    each layer in two parts with ``split_layer`` or ``split_at_mlp_hidden``), for the
    layer-streamed step; its batch is ``(inputs, labels)``."""
    if not isinstance(self.model, Llama):
      raise ValueError(f"The layer-streamed step takes the LLaMA models' stacked layers; "
                       f"{self.name} is not one.")
    return llama.layer_stack(self.model, split_layer, split_at_mlp_hidden)

  def optimizer(self, tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx``, wrapped in `lowmem_jax.optim.sparse.sparse_storage` where the model is `sparse`."""
    return sparse.sparse_storage(tx, self.dense_params()) if self.sparse else tx

  def loss(self, params: Any, inputs: jax.Array, labels: jax.Array,
           positions: Any = None) -> jax.Array:
    """Mean cross-entropy, float32 scalar.

    Batch norm (the WideResNet) runs in training mode: it normalises with the
    batch's statistics, so the loss and its gradient do not depend on the
    running averages, which this loss does not keep (a training loop carries
    them: 2 floats a channel). A `sparse` model reads its kernels' ``positions``
    (`lowmem_jax.optim.sparse.SparseStorageState.positions`).
    """
    if self.sparse != (positions is not None):
      raise ValueError(f"`positions` must be given for a model with sparse kernels and only "
                       f"then; the model is {'sparse' if self.sparse else 'dense'}.")
    if isinstance(self.model, Llama):  # the model's own head: its loss switch
      return self.model.apply({"params": params}, inputs, labels)
    if isinstance(self.model, WideResNet):
      variables = {"params": params} if positions is None else {"params": params,
                                                                  "sparse": positions}
      logits, _ = self.model.apply(variables, inputs, mutable=["batch_stats"])
    else:
      logits = self.model.apply({"params": params}, inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  def train_step(self, tx: optax.GradientTransformation, k: "int | optim.MomentFold" = 1,
                 fold_in_backward: bool = False) -> Callable:
    """One optimizer step of ``tx``: ``step(params, opt_state, batch) -> (params,
    opt_state, metrics)`` with ``batch = (inputs, labels)`` and ``metrics["loss"]``.

    `lowmem_jax.optim.train_step` of `loss`: with ``k > 1``, over k micro-batches
    (give an AdamA ``tx`` for the same k, or the `lowmem_jax.MomentFold` it was built
    with, to fold each micro-batch gradient into its moments, in the backward pass with
    ``fold_in_backward``). A `sparse` model's ``tx`` is `optimizer`'s, whose state
    holds the positions the step's forward reads.
    """
    if not self.sparse:
      return optim.train_step(lambda params, batch: self.loss(params, *batch), tx, k,
                              fold_in_backward=fold_in_backward)

    def step(params, opt_state, batch):
      positions = sparse.find_state(opt_state).positions
      return optim.train_step(lambda params, batch: self.loss(params, *batch, positions), tx, k,
                              fold_in_backward=fold_in_backward)(params, opt_state, batch)
    return step


def workload(name: str, *, batch: int, seq: int = 512, image: int | None = None,
             dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32,
             activation: str = "exact", norm: str = "plain", attention: str = "plain",
             conv: str = "plain", loss: str = "plain", embedding: str = "plain",
             density: float | None = None, remat: bool = False,
             remat_policy: Callable | None = None, mlp_chunk_tokens: int | None = None) -> Workload:
  """The reference workload ``name`` (one of `NAMES`).

  Args:
    name: "vit-tiny" (two ViT-Ti/16 blocks, for quick checks), "vit-b16", "vit-l16",
      "llama-tiny" (two layers of width 64, for quick checks), "llama-100m", "llama-1b",
      "llama-7b" (LLaMA-style sizes), "llama-3.2-1b",
      "llama-3.2-3b", "llama-3.1-8b", "llama-3.1-70b" (Meta's Llama 3 family,
      `lowmem_jax.models.llama.CONFIGS`), "minilm-l6", "bert-base" (a BERT
      sequence classifier, every token real) or "wrn-28-2" (CIFAR-10 sized).
    batch: examples per batch.
    seq: tokens per example (LLaMA, BERT: at most 512).
    image: image side in pixels (ViT: default 224; WideResNet: default 32).
    dtype: compute dtype; param_dtype: parameter dtype.
    activation, norm, attention, remat, remat_policy: the models' switches
      (`TransformerSwitches`). The WideResNet has batch norm and no attention:
      norm and attention "plain"; its activation is "exact" or "1bit" (see
      `WideResNet`).
    conv: the WideResNet's convolutions, "plain", "pooled" or "int8".
    loss: the LLaMA models' head, "plain" (float32 logits), "fused"
      (`lowmem_jax.ops.losses.linear_cross_entropy`, no logits kept) or "fused-one-pass"
      (the same, its backward in one pass: `lowmem_jax.models.llama.lm_head`).
    embedding: the LLaMA models' token embedding, "plain" or "late" (its
      gradient buffer made when needed: for AdamA's micro-batch loop).
    mlp_chunk_tokens: the LLaMA models' MLP over token chunks of at most this
      many tokens (`lowmem_jax.models.llama.TransformerBlock`); None: whole.
    density: the WideResNet's blocks' convs stored sparse at this density (a
      float in (0, 1)); None: dense. Train with `Workload.optimizer`'s ``tx``.
  """
  if name not in NAMES:
    raise ValueError(f"name must be one of {NAMES}, got {name!r}.")
  if batch < 1:
    raise ValueError(f"batch must be >= 1, got {batch}.")
  if image is not None and image < 1:
    raise ValueError(f"image must be >= 1, got {image}.")
  if name in WRN_CONFIGS:
    activation, conv = wrn.check_switches(activation, conv)
  else:
    activation, norm, attention = check_switches(activation, norm, attention)
  _check_language_model_switches(name, loss, embedding, mlp_chunk_tokens)
  if name in WRN_CONFIGS:
    return _wrn_workload(name, batch, image, dtype, param_dtype, activation=activation,
                         norm=norm, attention=attention, conv=conv, density=density,
                         remat=remat, remat_policy=remat_policy)
  if density is not None:
    raise ValueError(f"density (sparse storage) applies to the WideResNet's convs only; {name} "
                     f"takes density=None, got {density!r}.")
  if conv != "plain":
    raise ValueError(f"conv applies to the WideResNet only; {name} takes conv='plain', "
                     f"got {conv!r}.")
  switches = dict(activation=activation, norm=norm, attention=attention, remat=remat,
                  remat_policy=remat_policy, dtype=dtype, param_dtype=param_dtype)
  if name in BERT_CONFIGS:
    if seq > BERT_CONFIGS[name].max_len:
      raise ValueError(f"seq must be <= {BERT_CONFIGS[name].max_len} for {name}, got {seq}.")
    model = BertClassifier(BERT_CONFIGS[name], **switches)
    inputs = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    labels = jax.ShapeDtypeStruct((batch,), jnp.int32)
  elif name in VIT_CONFIGS:
    model = ViT(**VIT_CONFIGS[name], **switches)
    image = 224 if image is None else image
    if image % model.patch_size:  # its VALID patches would drop the border, or every pixel
      raise ValueError(f"image must be a multiple of {name}'s {model.patch_size}-pixel patch, "
                       f"got {image}.")
    inputs = jax.ShapeDtypeStruct((batch, image, image, 3), dtype)
    labels = jax.ShapeDtypeStruct((batch,), jnp.int32)
  else:
    model = Llama(llama.CONFIGS[name], loss=loss, embedding=embedding,
                  mlp_chunk_tokens=mlp_chunk_tokens, **switches)
    inputs = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    labels = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  return Workload(name, model, inputs, labels)


def _check_language_model_switches(name: str, loss: str, embedding: str,
                                   mlp_chunk_tokens: int | None) -> None:
  """Raises ValueError where a LLaMA model's switch is given to another model."""
  llama.check_loss(loss)
  if loss != "plain" and name not in llama.CONFIGS:
    raise ValueError(f"loss={loss!r} applies to the LLaMA models only (a language model's "
                     f"vocabulary-sized head); {name} takes loss='plain'.")
  if embedding != "plain" and name not in llama.CONFIGS:
    raise ValueError(f"embedding={embedding!r} applies to the LLaMA models only; {name} takes "
                     "embedding='plain'.")
  if mlp_chunk_tokens is not None and name not in llama.CONFIGS:
    raise ValueError(f"mlp_chunk_tokens applies to the LLaMA models only; {name} takes None, "
                     f"got {mlp_chunk_tokens!r}.")


def _wrn_workload(name: str, batch: int, image: int | None, dtype: Any, param_dtype: Any, *,
                  activation: str, norm: str, attention: str, conv: str,
                  density: float | None, remat: bool, remat_policy: Callable | None) -> Workload:
  """`workload` of the WideResNet ``name`` (its switches checked): CIFAR-sized images (32 px
  unless ``image``)."""
  if (norm, attention) != ("plain", "plain"):
    raise ValueError(f"{name} has batch norm and no attention: norm and attention must be "
                     f"'plain', got norm={norm!r}, attention={attention!r}.")
  model = WideResNet(**WRN_CONFIGS[name], activation=activation, conv=conv, density=density,
                     remat=remat, remat_policy=remat_policy, dtype=dtype, param_dtype=param_dtype)
  image = 32 if image is None else image
  if conv == "pooled" and image % 8:
    raise ValueError(f"conv='pooled' pools the input of every conv 2x2, the last group's at "
                     f"image / 4: image must be a multiple of 8, got {image}.")
  return Workload(name, model, jax.ShapeDtypeStruct((batch, image, image, 3), dtype),
                  jax.ShapeDtypeStruct((batch,), jnp.int32))


__all__ = ["Bert", "BertClassifier", "BertConfig", "Llama", "LlamaConfig", "NAMES", "Switches",
           "TransformerSwitches", "ViT", "WideResNet", "Workload", "workload"]
