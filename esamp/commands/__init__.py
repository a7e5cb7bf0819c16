"""The ``esamp`` subcommands that are more than a screenful: each a package over the engines."""
