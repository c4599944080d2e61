"""Entry points: the Starlette app, platform adapters and the `warmstart` command line."""
