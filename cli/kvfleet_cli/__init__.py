"""kvfleet_cli: the `kvfleet` command. Glue only: parse flags, build typed configs, call in."""
