"""The `dflashkit` subcommands, one module per group, on top of every other package: each module's
`register(subparsers)` adds its parsers (`cli.build_parser` calls them in order). Parsing needs nothing
heavy, so each handler imports torch, transformers and the code it drives when it runs: `dflashkit
--help` and `dflashkit doctor` start fast."""
