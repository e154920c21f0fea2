"""`modcli eval`: loss per routing mode on held-out windows."""
