"""The server's settings (``ServerConfig``): light to import, the CLI reads its defaults from here."""

from __future__ import annotations

from dataclasses import dataclass

from dspark.config import ConfigError

ROLES = ("both", "prefill", "decode")
# where serve and serve-proxy listen unless told otherwise, and where loadtest looks for a server
DEFAULT_HOST = "127.0.0.1"  # local only
DEFAULT_PORT = 8000  # vLLM's
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
    # prefill/decode disaggregation (serve/disagg.py): "prefill" runs prompts and ships their state to a decode
    # instance, "decode" takes shipped states in (POST /v1/kv_transfer/{id}), "both" does either (and plain requests)
    role: str = "both"
    kv_transfer_timeout_s: float = 30.0  # a prefill instance's push of a payload to its decode instance
    max_kv_transfer_bytes: int = 4 * 2**30  # a larger payload is refused (413); the request then prefills locally

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError(EMPTY_API_KEY)
        if self.max_request_bytes < 1:
            raise ConfigError(f"max_request_bytes={self.max_request_bytes}: must be at least 1")
        if self.max_prompts_per_request < 1:
            raise ConfigError(f"max_prompts_per_request={self.max_prompts_per_request}: must be at least 1")
        if self.role not in ROLES:
            raise ConfigError(f"role={self.role!r}: use one of {list(ROLES)} (--role)")
        if not self.kv_transfer_timeout_s > 0:
            raise ConfigError(f"kv_transfer_timeout_s={self.kv_transfer_timeout_s}: must be positive (seconds)")
        if self.max_kv_transfer_bytes < 1:
            raise ConfigError(f"max_kv_transfer_bytes={self.max_kv_transfer_bytes}: must be at least 1")

    def takes(self, role: str) -> bool:
        """Whether this instance plays ``role`` ("prefill" or "decode") in a disaggregated deployment."""
        return self.role in (role, "both")
