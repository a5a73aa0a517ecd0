"""The `sits` subcommands, one module each (registered in sits.runtime.cli.COMMANDS)."""
