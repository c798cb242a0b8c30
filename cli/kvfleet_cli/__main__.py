from kvfleet_cli.main import cli

cli()
