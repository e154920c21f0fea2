"""One module per subcommand; modcli/cli.py registers them; their flags are generated from the config fields they set
(config_flags.py), the few that no field holds declared in options.py.

A command only parses: it builds its config from the flags and calls its library function. It imports PyTorch-free
modules only (config, errors, options, the console and table helpers) and reaches everything else, the library
functions and their configs included, through modcli's lazy names (`modcli.evaluate`, `modcli.EvalConfig`; see
`_EXPORTS` in modcli/__init__.py), so `import modcli.cli` and `modcli --help` import no torch."""
