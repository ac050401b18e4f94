"""The one command, ``mooncake-operator``: a subcommand per part of the project."""
