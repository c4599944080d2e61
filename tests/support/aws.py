"""An AWS configuration for tests: fake credentials, and nothing from the machine's own profile, config files,
endpoints or instance metadata, so boto3's standard chain resolves the same way everywhere."""

from __future__ import annotations

from pathlib import Path

import pytest

MACHINE_SETTINGS = ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_MAX_ATTEMPTS",
                    "AWS_RETRY_MODE", "AWS_SESSION_TOKEN")


def isolate_aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in MACHINE_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
