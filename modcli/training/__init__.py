"""Training: the loop, the objective (every loss in one place), distributed set-up."""
