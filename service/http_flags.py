"""`serve` flags of the front door's optional features, with vLLM's names and value syntax:
CORS (--allowed-origins, --allowed-methods, --allowed-headers as JSON lists, --allow-credentials)
and OpenTelemetry tracing (--otlp-traces-endpoint). Both are off by default."""
from __future__ import annotations

import argparse
import importlib.util
import json
from urllib.parse import urlsplit

OTLP_SCHEMES = ("http", "https", "grpc", "grpcs")
CORS_LISTS = ("allowed_methods", "allowed_headers")


def json_string_list(text: str) -> tuple[str, ...]:
    """vLLM's syntax: a JSON list of strings, e.g. '["http://localhost:3000"]'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, e.g. '[\"*\"]', got {text!r}")
    return tuple(value)


def otlp_endpoint(text: str) -> str:
    url = urlsplit(text)
    if url.scheme not in OTLP_SCHEMES or not url.netloc:
        raise argparse.ArgumentTypeError(f"expected http(s)://host:port[/v1/traces] (OTLP over HTTP) or "
                                         f"grpc(s)://host:port (OTLP over gRPC), got {text!r}")
    if importlib.util.find_spec("opentelemetry.sdk") is None:
        raise argparse.ArgumentTypeError("the OpenTelemetry SDK is not installed: pip install opentelemetry-sdk "
                                         "opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-grpc")
    return text


def add_http_feature_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--allowed-origins", type=json_string_list, default=None,
                       help='CORS: origins a browser page may call the API from, a JSON list (e.g. '
                            '\'["http://localhost:3000"]\', or \'["*"]\' for any); without it CORS is off '
                            "and no response carries CORS headers")
    group.add_argument("--allowed-methods", type=json_string_list, default=None,
                       help='CORS: allowed methods, a JSON list (default with --allowed-origins: ["*"])')
    group.add_argument("--allowed-headers", type=json_string_list, default=None,
                       help='CORS: allowed request headers, a JSON list (default with --allowed-origins: ["*"])')
    group.add_argument("--allow-credentials", action="store_true",
                       help="CORS: let pages send cookies and HTTP auth (Access-Control-Allow-Credentials)")
    group.add_argument("--otlp-traces-endpoint", type=otlp_endpoint, default=None,
                       help="export an OpenTelemetry span per request to this OTLP endpoint: "
                            "http(s)://host:4318 (OTLP/HTTP protobuf, path /v1/traces unless given) or "
                            "grpc://host:4317 (OTLP/gRPC; grpcs:// for TLS); off without it")


def check_http_feature_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.allowed_origins is None:
        given = [f"--{name.replace('_', '-')}" for name in CORS_LISTS if getattr(args, name) is not None]
        if args.allow_credentials:
            given.append("--allow-credentials")
        if given:
            parser.error(f"{', '.join(given)} need --allowed-origins (CORS is off without it)")


def http_feature_settings(args: argparse.Namespace) -> dict:
    """The ServeSettings keywords of these flags (the unset CORS lists keep the settings' defaults)."""
    settings = {"allowed_origins": args.allowed_origins, "allow_credentials": args.allow_credentials,
                "otlp_traces_endpoint": args.otlp_traces_endpoint}
    settings.update({name: getattr(args, name) for name in CORS_LISTS if getattr(args, name) is not None})
    return settings
