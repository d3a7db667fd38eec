"""The ops: the functions with custom VJPs that keep less for the backward pass
(approximate activations, memory-sharing norms, attention, the loss head, compressed
residuals, the late embedding gradient), their pure-JAX references, and `dispatch`,
which chooses between a Pallas kernel and XLA. Pure JAX: nothing of the compile
machinery, no Pallas until a kernel is chosen."""
