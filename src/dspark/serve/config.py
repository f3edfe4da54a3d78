"""The server's settings (``ServerConfig``): light to import, the CLI reads its defaults from here."""

from __future__ import annotations

from dataclasses import dataclass

from dspark.config import ConfigError

EMPTY_API_KEY = (
    "the API key is empty (--api-key '' or DSPARK_API_KEY=''), which would leave the server open to anyone; "
    "set a non-empty key, or give neither to serve without authentication"
)


@dataclass(frozen=True)
class ServerConfig:
    api_key: str | None = None  # require 'Authorization: Bearer KEY' on every route but /health
    served_model_name: str | None = None  # model id in the API (default: the model directory's name)
    max_request_bytes: int = 8 * 2**20  # request bodies above this get 413 (JSON of a ~1M-token prompt fits)
    max_prompts_per_request: int = 64  # /v1/completions with more prompts in one request gets 400

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError(EMPTY_API_KEY)
        if self.max_request_bytes < 1:
            raise ConfigError(f"max_request_bytes={self.max_request_bytes}: must be at least 1")
        if self.max_prompts_per_request < 1:
            raise ConfigError(f"max_prompts_per_request={self.max_prompts_per_request}: must be at least 1")
