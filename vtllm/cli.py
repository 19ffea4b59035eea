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
from vtllm.startup import StartupError, bind_http_sockets
from vtllm.vllm_compat import VLLM_ALIASES, closest_flag, unsupported_message

# exit code of every start-up mistake (bad flag, bad path, unknown model): argparse's
EXIT_USAGE = 2

# frontend fields the engine core reads too (every other frontend field is HTTP-only)
_ENGINE_FRONTEND_FIELDS = {"default_max_tokens"}


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block: ``--help`` has it) that name the
    closest flag for an unknown one, or why vtllm refuses a vLLM flag."""

    def error(self, message: str) -> typing.NoReturn:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unknown_flags_message(self, extras))
        return parsed


def _all_flags(parser: argparse.ArgumentParser) -> list[str]:
    flags: list[str] = []
    for action in parser._actions:  # argparse keeps no public list
        flags.extend(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags.extend(_all_flags(sub))
    return flags


def unknown_flags_message(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """One line for the first unknown argument: a vLLM flag vtllm refuses (and why),
    an unknown flag and its nearest vtllm spelling, or a stray value."""
    first = extras[0]
    if not first.startswith("-"):
        return f"unexpected argument {first!r} (one MODEL at most; flags start with --)"
    refused = unsupported_message(first)
    if refused:
        return refused
    near = closest_flag(first, sorted(set(_all_flags(parser))))
    hint = f"; did you mean {near}?" if near else " (vtllm serve --help lists every flag)"
    return f"unknown flag {first.split('=', 1)[0]}{hint}"


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


def _choice_type(choices: tuple[str, ...], aliases: dict[str, str], base: type):
    """A converter accepting ``choices`` and their ``aliases`` (``half`` → float16)."""

    def convert(text: str):
        value = aliases.get(text, text)
        if value not in choices:
            shown = ", ".join([*choices, *aliases])
            raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from {shown})")
        return base(value)

    return convert


class _RefuseHttpOnly(argparse.Action):
    """An HTTP-only flag given to a command without HTTP (engine-core, bench)."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(
            f"{option_string} is an HTTP flag; `{parser.prog}` serves no HTTP (give it to "
            "`vtllm serve`)"
        )


def is_http_only(section_name: str, f: dataclasses.Field) -> bool:
    """Flags only the HTTP frontend reads: the frontend section (less the fields the
    engine core reads too) and model fields marked ``http_only``."""
    if section_name == "frontend":
        return f.name not in _ENGINE_FRONTEND_FIELDS
    return bool(f.metadata.get("http_only"))


def add_config_arguments(parser: argparse.ArgumentParser, http: bool = True) -> None:
    """One flag per config field (and its vLLM aliases). ``http=False`` (engine-core,
    bench): the HTTP-only flags are refused with a one-line error."""
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
            flag = _flag(f.name)
            if not http and is_http_only(section_name, f):
                names = [flag, *VLLM_ALIASES.get(flag, ())]
                if base is bool:
                    names += ["--no-" + flag[2:], *VLLM_ALIASES.get("--no-" + flag[2:], ())]
                group.add_argument(*names, nargs=0, action=_RefuseHttpOnly, help=argparse.SUPPRESS)
                continue
            if base is bool:
                group.add_argument(
                    flag,
                    dest=dest,
                    action=argparse.BooleanOptionalAction,
                    default=default,
                    help=f"{help_text} (default: {default})",
                )
                negative = "--no-" + flag[2:]
                for alias in VLLM_ALIASES.get(negative, ()):
                    group.add_argument(
                        alias, dest=dest, action="store_false", help=f"same as {negative}"
                    )
                continue
            kind = f.metadata.get("kind")
            shown = default
            if kind == "size" and isinstance(default, int):
                shown = _human_size(default)
            choices = f.metadata.get("choices")
            aliases = f.metadata.get("aliases", {})
            convert: Any = _size if kind == "size" else base
            if choices and aliases:
                convert, choices = _choice_type(choices, aliases, base), None
            group.add_argument(
                flag,
                *VLLM_ALIASES.get(flag, ()),
                dest=dest,
                type=convert,
                default=default,
                choices=choices,
                metavar=_metavar(f),
                help=f"{help_text} (default: {shown})",
            )


def _metavar(f: dataclasses.Field) -> str | None:
    """NAME for free values, ``{a,b,c}`` for choices (aliases included), as argparse shows."""
    choices = f.metadata.get("choices")
    if not choices:
        return f.name.upper()
    return "{" + ",".join([*choices, *f.metadata.get("aliases", {})]) + "}"


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
    parser = Parser(prog="vtllm", description="vtllm LLM serving engine")
    parser.add_argument("--version", action="version", version=f"vtllm {__version__}")

    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Start the frontend, the engine core and one worker per "
        "tensor-parallel rank. MODEL (or --model): a Hugging Face repo id, a model "
        "directory or a .gguf file; none: the embedded SmolLM2-135M-Instruct.",
    )
    _add_model_positional(serve)
    add_config_arguments(serve)

    headless = sub.add_parser(
        "engine-core",
        help="run the engine core and its workers without HTTP, for other frontends",
        description="Run the engine core and its workers headless. Frontends connect with "
        "`vtllm serve --engine-address ADDRESS` or vtllm.protocol.client (docs/PROTOCOL.md).",
    )
    _add_model_positional(headless)
    add_config_arguments(headless, http=False)

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
        ("prefill", "one --input-len prompt: seconds to the first token, TFLOP/s vs a matmul"),
        ("all", "latency, then throughput, on one engine start"),
    ):
        kind_parser = bench_sub.add_parser(kind, help=text, description=text)
        add_bench_arguments(kind_parser)
        add_config_arguments(kind_parser, http=False)
    from vtllm.bench_serve import add_serve_arguments

    text = "drive a running server over HTTP: output tok/s, TTFT, ITL, TPOT (JSON)"
    add_serve_arguments(bench_sub.add_parser("serve", help=text, description=text))
    return parser


def _add_model_positional(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model to serve: same as --model (vLLM's `vllm serve MODEL`)",
    )


def _validated_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> VtllmConfig:
    """The config the flags describe; a value no engine can run with is a usage error."""
    config = config_from_args(args)
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if config.model.model is not None and config.model.model != tag:
            parser.error(f"MODEL {tag!r} and --model {config.model.model!r} differ; give one")
        config.model.model = tag
    try:
        config.validate()
        if config.frontend.chat_template is not None:  # a bad template: a usage error
            from vtllm.frontend.chat_template import load_chat_template

            load_chat_template(config.frontend.chat_template)
    except ValueError as e:
        parser.error(str(e))
    return config


def _subparser(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The parser of the command given (for its prog in error lines)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices[args.command]
            kind = getattr(args, "bench_kind", None)
            return _subparser(sub, argparse.Namespace(command=kind)) if kind else sub
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "log_format", None):
        envs.export("VT_LOG_FORMAT", args.log_format)  # inherited by every child process
    command = _subparser(parser, args) if args.command in ("serve", "engine-core") else parser
    try:
        if args.command == "serve":
            config = _validated_config(command, args)
            # bound before the heavy imports: a taken port is reported within a second
            sock, *more_sockets = bind_http_sockets(
                config.frontend.host, config.frontend.port, config.frontend.api_server_count
            )
            from vtllm.launch import serve

            return serve(config, sock, more_sockets)
        if args.command == "engine-core":
            from vtllm.launch import engine_core

            return engine_core(_validated_config(command, args))
        if args.command == "keygen":
            return _keygen(parser, args)
        if args.command == "bench" and args.bench_kind == "serve":
            from vtllm.bench_serve import run_bench_serve

            return run_bench_serve(args)
        if args.command == "bench":
            from vtllm.bench import run_bench

            return run_bench(args.bench_kind, args, _validated_config(parser, args))
    except StartupError as e:
        print(f"vtllm {args.command}: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
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
