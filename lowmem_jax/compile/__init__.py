"""What is measured on abstract shapes: compile targets (GPUs compiled for without one),
memory and FLOP accounting of a compiled step, remat policies over checkpoint names, and the
planner that picks a policy for a budget."""
