"""What people read: console tables and progress, plots, routing maps."""
