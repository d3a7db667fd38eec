"""`lowmem_jax.optim.layer_stack`: the model and state types of the layer-streamed step, and the
checks that name what does not fit them (the step's own refusals: tests/test_streamed.py)."""

import jax
import jax.numpy as jnp
import pytest

from lowmem_jax.optim import layer_stack

LAYERS = {"w": jnp.ones((3, 4, 4)), "b": jnp.ones((3, 4))}


def test_a_layer_stack_refuses_what_is_not_a_function():
  fn = lambda *args: args[1]
  with pytest.raises(TypeError, match="`LayerStack.embed` must be callable"):
    layer_stack.LayerStack("embedding", fn, fn)
  with pytest.raises(TypeError, match="`LayerStack.key` must be a str"):
    layer_stack.LayerStack(fn, fn, fn, key=0)
  assert layer_stack.LayerStack(fn, (fn, fn), fn).parts == (fn, fn)


def test_split_and_layer_count_name_what_is_missing_or_uneven():
  rest, layers = layer_stack.split({"emb": jnp.ones(2), "layers": LAYERS}, "layers")
  assert list(rest) == ["emb"] and layers is LAYERS
  with pytest.raises(ValueError, match=r"stacked layers at 'blocks' .* got dict with \['layers'\]"):
    layer_stack.split({"layers": LAYERS}, "blocks")
  assert layer_stack.layer_count(LAYERS) == 3
  with pytest.raises(ValueError, match=r"\['b'\] has \(3,\), \['w'\] has \(2,\)"):
    layer_stack.layer_count({**LAYERS, "w": jnp.ones((2, 4, 4))})


def test_check_state_names_the_first_leaf_that_differs():
  """Another shape, another structure, or a leaf in the other memory: refused by name."""
  state = layer_stack.StreamedState(LAYERS, {}, jnp.zeros((), jnp.int32))
  layer_stack.check_state(state, state, "device")
  fewer = state._replace(layers={**LAYERS, "w": jnp.ones((2, 4, 4))})
  with pytest.raises(ValueError, match=r"at .*\['w'\] it should be float32\[3, 4, 4\], got .*"
                     r"float32\[2, 4, 4\]"):
    layer_stack.check_state(state, fewer, "device")
  with_emb = state._replace(rest={"emb": jnp.ones(2)})
  with pytest.raises(ValueError, match=r"at .rest\['emb'\] it should be float32\[2\], got "
                     r".total_notfinite int32\[\]"):
    layer_stack.check_state(with_emb, state, "device")
  with pytest.raises(ValueError, match=r"at .layers\['b'\] is in device memory; this step keeps "
                     r"its state in host memory \(`state='host'`\)"):
    layer_stack.check_state(state, state, "host")
  on_host = jax.device_put(state, jax.memory.Space.Host)
  layer_stack.check_state(state, on_host, "host")
  with pytest.raises(ValueError, match=r"is in host memory; .* in device memory"):
    layer_stack.check_state(state, on_host, "device")


def test_part_input_shapes_names_a_layer_that_changes_the_hidden_state():
  """A layer's parts may hand any pytree on between them (each part's input is returned);
  the last must return the hidden state as the layer takes it."""
  h = jax.ShapeDtypeStruct((2, 5, 4), jnp.float32)
  one = jax.tree.map(lambda x: x[0], LAYERS)
  good = lambda p, h, b: h @ p["w"]
  assert layer_stack.part_input_shapes(layer_stack.LayerStack(good, good, good), one, h,
                                       None) == [h]
  split = lambda p, h, b: (h, h[..., :2])
  joined = lambda p, x, b: x[0] + jnp.sum(x[1], -1, keepdims=True)
  inputs = layer_stack.part_input_shapes(
      layer_stack.LayerStack(good, (good, split, joined), good), one, h, None)
  assert inputs == [h, h, (h, jax.ShapeDtypeStruct((2, 5, 2), jnp.float32))]
  halves = layer_stack.LayerStack(good, (good, lambda p, h, b: h[..., :2]), good)
  with pytest.raises(TypeError, match=r"`LayerStack.layer`\[-1\] must return the hidden state "
                     r".*float32\[2, 5, 4\]; got float32\[2, 5, 2\]"):
    layer_stack.part_input_shapes(halves, one, h, None)
  with pytest.raises(TypeError, match=r"`LayerStack.layer`\[2\] must take \(layer_params, x, "
                     r"batch\)"):
    layer_stack.part_input_shapes(
        layer_stack.LayerStack(good, (good, split, lambda p, x: x[0]), good), one, h, None)
