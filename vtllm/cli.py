"""``vtllm`` command line. Flags are generated from the config dataclasses (config.py):
one flag per field, its help and default from the field."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from typing import Any

from vtllm import __version__, envs
from vtllm.config import VtllmConfig, config_sections, parse_size


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(annotation: Any) -> type:
    """``int | None`` → int; ``str`` → str."""
    if isinstance(annotation, str):
        annotation = eval(annotation, {}, {})  # annotations are postponed (strings)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0]
    return annotation


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=None,
        help="log lines as text (default) or one JSON object per line, in every process "
        "(same as VT_LOG_FORMAT)",
    )
    config = VtllmConfig()
    for section_name, section in config_sections(config):
        group = parser.add_argument_group(section_name)
        for f in dataclasses.fields(section):
            default = getattr(section, f.name)
            help_text = f.metadata.get("help", "")
            dest = f"{section_name}.{f.name}"
            base = _base_type(f.type)
            if base is bool:
                group.add_argument(
                    _flag(f.name),
                    dest=dest,
                    action=argparse.BooleanOptionalAction,
                    default=default,
                    help=f"{help_text} (default: {default})",
                )
                continue
            kind = f.metadata.get("kind")
            shown = default
            if kind == "size" and isinstance(default, int):
                shown = _human_size(default)
            group.add_argument(
                _flag(f.name),
                dest=dest,
                type=_size if kind == "size" else base,
                default=default,
                choices=f.metadata.get("choices"),
                metavar=f.name.upper() if "choices" not in f.metadata else None,
                help=f"{help_text} (default: {shown})",
            )


def _human_size(num_bytes: int) -> str:
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if num_bytes >= factor and num_bytes % factor == 0:
            return f"{num_bytes // factor}{unit}"
    return str(num_bytes)


def config_from_args(args: argparse.Namespace) -> VtllmConfig:
    config = VtllmConfig()
    for key, value in vars(args).items():
        if "." not in key:
            continue
        section_name, field_name = key.split(".", 1)
        setattr(getattr(config, section_name), field_name, value)
    return config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vtllm", description="vtllm LLM serving engine")
    parser.add_argument("--version", action="version", version=f"vtllm {__version__}")

    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Start the frontend, the engine core and one worker per "
        "tensor-parallel rank. Without --model: the embedded SmolLM2-135M-Instruct.",
    )
    add_config_arguments(serve)

    headless = sub.add_parser(
        "engine-core",
        help="run the engine core and its workers without HTTP, for other frontends",
        description="Run the engine core and its workers headless. Frontends connect with "
        "`vtllm serve --engine-address ADDRESS` or vtllm.protocol.client (docs/PROTOCOL.md).",
    )
    add_config_arguments(headless)

    keygen = sub.add_parser(
        "keygen",
        help="make CurveZMQ key files for a tcp:// engine address",
        description="`keygen server --out engine.key` makes the engine core's file (its key "
        "pair and the list of client public keys it admits). `keygen client --server "
        "engine.key --name NAME --out client.key` makes a client's file (its key pair and "
        "the engine's public key, never the engine's secret) and admits it in engine.key. "
        "Files are created with mode 0600.",
    )
    keygen_sub = keygen.add_subparsers(dest="key_kind", required=True)
    key_server = keygen_sub.add_parser("server", help="the engine core's key file")
    key_server.add_argument("--out", required=True, help="file to create (mode 0600)")
    key_client = keygen_sub.add_parser(
        "client", help="a client's key file, admitted by the engine's key file"
    )
    key_client.add_argument("--out", required=True, help="file to create (mode 0600)")
    key_client.add_argument(
        "--server",
        required=True,
        help="the engine's key file: its public key is copied, "
        "and the client's public key is added to its allow-list",
    )
    key_client.add_argument("--name", required=True, help="the client's name in the allow-list")

    from vtllm.bench import add_bench_arguments

    bench = sub.add_parser("bench", help="benchmark the engine (no HTTP)")
    bench_sub = bench.add_subparsers(dest="bench_kind", required=True)
    for kind, text in (
        ("latency", "batch-1 decode: time to first token and decode tok/s"),
        ("throughput", "offline: N random prompts at once; output and total tok/s"),
        ("all", "latency, then throughput, on one engine start"),
    ):
        kind_parser = bench_sub.add_parser(kind, help=text, description=text)
        add_bench_arguments(kind_parser)
        add_config_arguments(kind_parser)
    return parser


def _validated_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> VtllmConfig:
    """The config the flags describe; a value no engine can run with is a usage error."""
    config = config_from_args(args)
    try:
        config.validate()
    except ValueError as e:
        parser.error(str(e))
    return config


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "log_format", None):
        envs.export("VT_LOG_FORMAT", args.log_format)  # inherited by every child process
    if args.command == "serve":
        from vtllm.launch import serve

        return serve(_validated_config(parser, args))
    if args.command == "engine-core":
        from vtllm.launch import engine_core

        return engine_core(_validated_config(parser, args))
    if args.command == "keygen":
        return _keygen(parser, args)
    if args.command == "bench":
        from vtllm.bench import run_bench

        return run_bench(args.bench_kind, args, _validated_config(parser, args))
    parser.error(f"unknown command {args.command}")
    return 2


def _keygen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from pathlib import Path

    from vtllm.protocol.transport import ClientKeys, ServerKeys

    out = Path(args.out)
    if out.exists():
        parser.error(f"{out} exists; refusing to overwrite a key file")
    if args.key_kind == "server":
        ServerKeys.generate().save(out)
        print(
            f"wrote {out} (mode 0600): the engine core's key file (--engine-curve-key-file "
            f"of vtllm engine-core). Admit clients with `vtllm keygen client --server {out}`"
        )
        return 0
    try:
        server = ServerKeys.load(args.server)
        client = ClientKeys.generate(server.public, args.name)
        server.allow(args.name, client.public)
    except (OSError, ValueError, KeyError) as e:
        parser.error(str(e))
    client.save(out)
    server.save(Path(args.server), replace=True)
    print(
        f"wrote {out} (mode 0600): the key file of client {args.name!r} "
        f"(--engine-curve-key-file of vtllm serve --engine-address, or "
        f"transport.ClientKeys.load); {args.server} now admits it (a running engine core "
        "reads the change at the client's next connection)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
