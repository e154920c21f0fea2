"""One module per subcommand; modcli/cli.py registers them."""
