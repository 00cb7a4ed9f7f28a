"""The command line: one module per command group; app.py is the entry point."""
