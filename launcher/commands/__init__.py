"""pdecomp's own subcommands besides a run (`pdecomp analyze`, `convert`, `export`, `label`,
`prompt`, `tokenize`, `view`): each parses its arguments, refuses bad ones in one line, and
calls the library's functions. The library itself parses no command line."""
