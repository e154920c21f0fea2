"""`python -m modcli` (also what `torchrun -m modcli` runs)."""

from modcli.cli import main

main()
