"""``dspark serve``: the OpenAI-compatible server on FastAPI + uvicorn (registered by dspark.cli)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from dspark.cli_common import (
    add_kv_offload_args,
    add_model_arg,
    add_precision_args,
    add_prefix_caching_arg,
    add_seed_arg,
    add_speculative_config_arg,
    add_threads_arg,
    apply_threads,
    kv_offload_kwargs,
)
from dspark.config import ConfigError, EngineConfig
from dspark.serve.config import DEFAULT_HOST, DEFAULT_PORT, ROLES, ServerConfig

if TYPE_CHECKING:
    from dspark.engine.engine import Engine

API_KEY_ENV = "DSPARK_API_KEY"


def add_bind_args(p: argparse.ArgumentParser) -> None:
    """--host and --port of a listening command (serve, serve-proxy)."""
    p.add_argument("--host", default=DEFAULT_HOST, help=f"bind address (default {DEFAULT_HOST}: local only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}")


def resolve_api_key(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """--api-key, else $DSPARK_API_KEY (keeps the key out of `ps`); None when neither is set. An empty key is
    refused by ``ServerConfig`` (it would silently disable authentication, e.g. ``--api-key "$UNSET_VAR"``)."""
    return flag if flag is not None else environ.get(API_KEY_ENV)


def bind_warning(host: str, api_key: str | None) -> str | None:
    """A warning when the server is reachable from other machines without an API key."""
    if api_key is not None or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass  # a host name: it may resolve to a public address
    return (
        f"warning: serving on {host} without an API key: anyone who can reach this address can use the model; "
        f"set {API_KEY_ENV} (or --api-key), or bind 127.0.0.1"
    )


def server_config(args: argparse.Namespace, environ: Mapping[str, str]) -> ServerConfig:
    return ServerConfig(
        api_key=resolve_api_key(args.api_key, environ),
        served_model_name=args.served_model_name,
        max_request_bytes=args.max_request_bytes,
        max_prompts_per_request=args.max_prompts_per_request,
        role=args.role,
        kv_transfer_timeout_s=args.kv_transfer_timeout,
        max_kv_transfer_bytes=args.max_kv_transfer_bytes,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from dspark.llm import warm_up
    from dspark.serve.app import create_app

    config = server_config(args, os.environ)  # refuse a bad key or limit before loading the model
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(name)s %(message)s")
    engine = _engine(args)
    warm_up(engine)  # the first client finds the shapes warm
    app = create_app(engine, config)
    name = app.state.dspark.model_name
    method = engine.spec.method if engine.spec is not None else "none"
    print(f"dspark serve: model {name!r} (speculation: {method}) on http://{args.host}:{args.port}/v1", flush=True)
    print(f"dspark serve: {engine.precision.describe()}", flush=True)
    if config.role != "both":
        print(f"dspark serve: role {config.role} (prefill/decode disaggregation; see dspark serve-proxy)", flush=True)
    warning = bind_warning(args.host, config.api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _engine(args: argparse.Namespace) -> Engine:
    from dspark.cli_common import default_spec, model_or_demo
    from dspark.llm import build_engine

    if args.model_positional is not None:
        if args.model is not None and args.model_positional != args.model:
            raise ConfigError(f"serve: MODEL {args.model_positional!r} and --model {args.model!r} differ; give one")
        args.model = args.model_positional
    apply_threads(args)
    model, demo = model_or_demo(args.model)
    spec = default_spec(args, model if demo else None)
    return build_engine(
        model,
        spec,
        dtype=args.dtype,
        quantization=args.quantization,
        attention_backend=args.attention_backend,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        num_pages=args.num_pages,
        seed=args.seed,
        max_waiting=args.max_waiting,
        enable_prefix_caching=args.enable_prefix_caching,
        **kv_offload_kwargs(args),
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    d, s = EngineConfig(), ServerConfig()
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (completions, chat, SSE streaming, /metrics)",
        description="Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, "
        "GET /metrics (Prometheus, vLLM names), GET /version, POST /tokenize, POST /detokenize.",
    )
    p.add_argument(
        "model_positional",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="target: a model dir, a .gguf file or a hub id org/name[@rev] in the local HF/ModelScope cache "
        "(as `vllm serve MODEL`; default: the bundled kimi-k3-mini pair; k3-mini for the DeepSeek-V3-shaped one)",
    )
    add_model_arg(p, help="the same as MODEL (kept for scripts)")
    add_speculative_config_arg(p)
    p.add_argument("--no-spec", action="store_true", help="serve without speculative decoding")
    add_bind_args(p)
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV}, which keeps "
        "the key out of the process list; an empty key is refused)",
    )
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: the model dir name)")
    p.add_argument("--max-request-bytes", type=int, default=s.max_request_bytes, help="larger request bodies get 413")
    p.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=s.max_prompts_per_request,
        help="a /v1/completions request with more prompts gets 400",
    )
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="requests batched together")
    p.add_argument("--max-waiting", type=int, default=d.max_waiting, help="queued requests before answering 503")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--num-pages", type=int, default=None, help="KV cache pages (default: sized for max-num-seqs)")
    add_seed_arg(p, d.seed)
    add_prefix_caching_arg(p)
    add_kv_offload_args(p)
    add_precision_args(p)
    add_threads_arg(p)
    p.add_argument(
        "--attention-backend",
        default=None,
        help="target attention: torch | sdpa | a vLLM backend name (runs as sdpa here); default: each model's",
    )
    _add_disagg_args(p, s)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)
    add_proxy_parser(sub)


def _add_disagg_args(p: argparse.ArgumentParser, s: ServerConfig) -> None:
    p.add_argument(
        "--role",
        default=s.role,
        choices=ROLES,
        help="prefill/decode disaggregation: 'prefill' runs prompts and ships their KV state to a decode instance, "
        "'decode' continues shipped requests; 'both' (default) serves whole requests and either part",
    )
    p.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=s.kv_transfer_timeout_s,
        help="seconds a prefill instance's push of a KV payload may take (then the decode instance prefills)",
    )
    p.add_argument(
        "--max-kv-transfer-bytes", type=int, default=s.max_kv_transfer_bytes, help="larger KV payloads get 413"
    )


def cmd_serve_proxy(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from dspark.serve.proxy import create_proxy_app

    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(name)s %(message)s")
    app = create_proxy_app(args.prefill, args.decode, args.timeout)
    print(
        f"dspark serve-proxy: prefill {args.prefill}, decode {args.decode}, on http://{args.host}:{args.port}/v1",
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def add_proxy_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve-proxy",
        help="prefill/decode disaggregation proxy: prompts on a prefill instance, decoding on a decode instance",
        description="POST /v1/completions and /v1/chat/completions go to the prefill instance (dspark serve --role "
        "prefill), which ships the request's KV state to the decode instance (--role decode), which streams or "
        "returns the completion. Failures fall back to one instance, with a warning line.",
    )
    p.add_argument("--prefill", required=True, help="the prefill instance's base URL, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", required=True, help="the decode instance's base URL, e.g. http://127.0.0.1:8200")
    add_bind_args(p)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one forwarded request may take")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve_proxy)
