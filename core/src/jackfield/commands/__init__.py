"""One module per `jackfield` subcommand, each with add_parser(subparsers) and main(args)."""
