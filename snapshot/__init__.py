"""Snapshots: format, stores (local directory, S3), local cache, build pipeline and loader."""
