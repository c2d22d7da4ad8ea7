"""The solver: plan a run, drive the loop (LBFGS/Adam, stages, Fisher preconditioning), keep its history and checkpoints, and finalise the result."""
