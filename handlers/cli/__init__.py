"""The `warmstart` command line: one module per command (serve, the snapshot commands, demo, template,
prepare-model)."""
