"""The ``lowmem-jax`` application, on top of the library.

`techniques` declares each technique once and measures technique sets on the
reference models or a step of the user's own; `cli` is the ``lowmem-jax``
command (``report`` and ``plan``). ``import lowmem_jax`` does not load this
package: the command does, and so does whoever imports it.
"""
