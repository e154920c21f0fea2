"""The command line. It only parses flags and prints results; each subcommand lives in modcli/commands/, its flags
generated from the config fields they set (modcli/commands/config_flags.py) or, for the few no field holds, declared in
modcli/commands/options.py. Importing it imports no torch: `modcli --help` is instant."""

from __future__ import annotations

import typer

from modcli.commands import evaluate, generate, import_command, plot, profile, routes, sensitivity, sweep, tokenizer, train
from modcli.commands import export as export_command
from modcli.commands.common import OneLineErrors

app = typer.Typer(
    help="Mixture-of-Depths decoders: train, evaluate, generate, profile, export, import, sweep, plot, routes, "
         "sensitivity.",
    no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
    cls=OneLineErrors,  # a flag that does not parse is one red line and exit code 2
)
app.command("train")(train.train)
app.command("eval")(evaluate.eval_command)
app.command("generate")(generate.generate)
app.command("export")(export_command.export)
app.command("profile")(profile.profile)
app.command("import")(import_command.import_command)
app.command("sweep")(sweep.sweep)
app.command("plot")(plot.plot)
app.command("routes")(routes.routes)
app.command("sensitivity")(sensitivity.sensitivity)
app.add_typer(tokenizer.app, name="tokenizer")


def main() -> None:
    app()  # each command tunes the CPU allocator first (modcli.commands.common.subcommand), not --help


if __name__ == "__main__":
    main()
