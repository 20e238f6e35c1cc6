"""The ``tpserve`` command: ``serve``, ``loadtest``, ``soak`` and ``memory``."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import logging
import os
import re
import sys
from typing import Any, NoReturn

from tpserve import __version__
from tpserve.server.flag_types import reads_json_object

# help text that states its default itself ("default: the model's", "%(default)s")
_STATES_DEFAULT = re.compile(r"default:|%\(default\)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to an option's help at most once: not when the help states its
    default itself, and not for a None default (the help says what no value means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or _STATES_DEFAULT.search(text):
            return text
        return super()._get_help_string(action)


def unrecognized_message(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """argparse's "unrecognized arguments" error, with the closest option named for each
    mistyped flag: "unrecognized argument --max-model-length; did you mean
    --max-model-len?"."""
    options = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    hints = []
    for arg in extras:
        flag = arg.split("=", 1)[0]
        if not flag.startswith("--"):
            continue
        # 0.75: a typo (--max-model-length) still finds its flag; another flag of vLLM
        # that merely shares words (--hf-config-path, --scheduler-cls) gets no false lead
        close = difflib.get_close_matches(flag, options, n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]}?" if close else ""
        hints.append(f"unrecognized argument {flag}{hint}")
    return "\n".join(hints) or f"unrecognized arguments: {' '.join(extras)}"


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from tpserve import loadtest
    from tpserve.loadtest.memory import add_memory_arguments
    from tpserve.loadtest.soak import add_soak_arguments
    from tpserve.server.arguments import add_serve_arguments

    fmt = HelpFormatter
    parser = argparse.ArgumentParser(
        prog="tpserve", formatter_class=fmt,
        description="Tensor-parallel, OpenAI-compatible LLM inference server.",
        epilog="Each command's flags: tpserve COMMAND --help (e.g. tpserve serve --help).")
    parser.add_argument("--version", action="version", version=f"tpserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{serve,loadtest,soak,memory}")
    serve = sub.add_parser("serve", formatter_class=fmt,
                           help="serve a model over the OpenAI API",
                           description="Serve a model over the OpenAI API.")
    add_serve_arguments(serve)
    lt = sub.add_parser("loadtest", formatter_class=fmt,
                        help="load-test an OpenAI-compatible server",
                        description="Load-test an OpenAI-compatible server.")
    loadtest.add_arguments(lt)
    soak = sub.add_parser("soak", formatter_class=fmt,
                          help="soak-test a server: mixed requests, aborts, leak checks",
                          description="Soak-test a running server: thousands of mixed "
                                      "requests with client aborts; then every request must "
                                      "have ended cleanly, the KV pool be free and resident "
                                      "memory bounded.")
    add_soak_arguments(soak)
    mem = sub.add_parser("memory", formatter_class=fmt,
                         help="a running server's memory: table and PNG",
                         description="Read a running server's /memory: the memory plan per "
                                     "rank and component, the allocator's live figures and "
                                     "fragmentation, printed as a table and drawn to a PNG; "
                                     "or (--snapshot) save its allocator snapshot for "
                                     "https://pytorch.org/memory_viz.")
    add_memory_arguments(mem)
    return parser, {"serve": serve, "loadtest": lt, "soak": soak, "memory": mem}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        build_parser()[0].print_help()
        return 0
    args = parse_cli(argv)
    if args.command == "loadtest":
        from tpserve import loadtest

        return loadtest.main(args)
    if args.command == "memory":
        from tpserve.loadtest.memory import memory_main

        return memory_main(args)
    if args.command == "soak":
        from tpserve.loadtest.soak import soak_main

        return soak_main(args)
    from tpserve.server.config import config_from_args
    from tpserve.server.serve import serve

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
        code = serve(cfg)
    except (ValueError, FileNotFoundError, MemoryError) as e:
        print(f"tpserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the server's own handler is installed
        print("tpserve: interrupted during start-up", file=sys.stderr)
        return 130
    _exit_without_finalization(code)


def dashed_flags(argv: list[str]) -> list[str]:
    """``--max_model_len 64`` and ``--max_model_len=64`` as ``--max-model-len``: the
    underscores of a long flag's name (before any ``=`` or ``.``) become dashes, as vLLM's
    FlexibleArgumentParser takes them; values, a JSON flag's keys
    (``--speculative_config.num_speculative_tokens``) and everything after ``--``
    unchanged."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        if arg.startswith("--"):
            end = min((j for j in (arg.find("="), arg.find(".")) if j >= 0), default=len(arg))
            arg = arg[:end].replace("_", "-") + arg[end:]
        out.append(arg)
    return out


def dotted_json_flags(argv: list[str], json_flags: set[str]) -> list[str]:
    """vLLM's key-by-key form of a JSON flag: ``--speculative-config.method ngram
    --speculative-config.num_speculative_tokens 4`` (or ``KEY=VALUE``; ``a.b`` a nested
    key) as one ``--speculative-config '{"method": "ngram", ...}'``, laid over the flag's
    own JSON object where it is given too. A value is read as JSON where it is JSON
    (``4``, ``true``), else as text. ``json_flags``: the flags that take a JSON object;
    ``argv`` unchanged where none is given key by key."""
    if not any(a.partition("=")[0].partition(".")[0] in json_flags and "." in
               a.partition("=")[0] for a in argv if a.startswith("--")):
        return argv
    dotted: dict[str, dict[str, Any]] = {}
    whole: dict[str, str] = {}
    out: list[str] = []
    tail: list[str] = []  # from a bare "--" on, after the merged flags
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            tail = argv[i:]
            break
        name, eq, value = arg.partition("=")
        flag, dot, keys = name.partition(".")
        if not (arg.startswith("--") and flag in json_flags and (eq or i + 1 < len(argv))):
            out.append(arg)  # a flag without its value: argparse says so
            i += 1
            continue
        if not eq:
            i += 1
            value = argv[i]
        if dot:
            _set_nested(dotted.setdefault(flag, {}), keys.split("."), _json_or_text(value))
        else:
            whole[flag] = value
        i += 1
    for flag, value in whole.items():
        if flag not in dotted:
            out += [flag, value]
    for flag, keys in dotted.items():
        try:
            base = json.loads(whole[flag]) if flag in whole else {}
        except ValueError:
            base = None
        if not isinstance(base, dict):  # the flag's own check names the bad value
            out += [flag, whole[flag]]
            continue
        _merge(base, keys)
        out += [flag, json.dumps(base)]
    return out + tail


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


def _set_nested(obj: dict[str, Any], keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        if not isinstance(obj.get(key), dict):
            obj[key] = {}
        obj = obj[key]
    obj[keys[-1]] = value


def _merge(base: dict[str, Any], over: dict[str, Any]) -> None:
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def parse_cli(argv: list[str]) -> argparse.Namespace:
    """The parsed command line (``serve --config FILE``: its flags under the command
    line's); a mistyped flag exits 2 naming the closest one. Flag names may be spelled
    with underscores (``dashed_flags``), a JSON flag given key by key
    (``dotted_json_flags``)."""
    parser, subs = build_parser()
    argv = dotted_json_flags(dashed_flags(argv), {
        opt for action in subs["serve"]._actions if reads_json_object(action)
        for opt in action.option_strings})
    args, extras = parser.parse_known_args(argv)
    if args.command == "serve" and args.config is not None and not extras:
        args, extras = _with_config_file(args, argv, subs["serve"])
    if extras:
        sub = subs.get(args.command, parser)
        sub.error(unrecognized_message(sub, extras))  # exits 2
    if args.command == "serve":
        _check_keys_took_no_model(args, subs["serve"])
    return args


_REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")


def _check_keys_took_no_model(args: argparse.Namespace, serve: argparse.ArgumentParser
                              ) -> None:
    """``serve --api-key KEY MODEL``: ``--api-key`` takes several keys (vLLM's), so the
    model became a key and the embedded model would be served; exits 2 saying so where no
    model was given and the last key names a model (a path that exists, or an
    ``org/name`` repository id)."""
    keys = args.api_key
    if args.model is not None or args.model_flag is not None or not isinstance(keys, list) \
            or len(keys) < 2:
        return
    last = keys[-1]
    if os.path.exists(last) or _REPO_ID.fullmatch(last):
        serve.error(f"--api-key took {last!r} as a key and no model was given: put the model "
                    "before --api-key (it takes several keys, as vLLM's), or use --model")


def _with_config_file(args: argparse.Namespace, argv: list[str],
                      serve: argparse.ArgumentParser) -> tuple[argparse.Namespace, list[str]]:
    """``serve --config FILE``: the file's flags first, then the command line's over them
    (``server/config_file.py``); a bad file exits 2 naming it."""
    from tpserve.server.config_file import config_file_args

    try:
        file_args = config_file_args(args.config, serve,
                                     args.model is not None or args.model_flag is not None)
    except ValueError as e:
        serve.error(str(e))  # exits 2
    namespace = serve.parse_args(file_args)  # a flag's own error exits 2, naming it
    namespace.command = "serve"
    # argparse fills in defaults only where the namespace has no value yet
    return serve.parse_known_args(argv[argv.index("serve") + 1:], namespace=namespace)


def _exit_without_finalization(code: int) -> NoReturn:
    """Ends a finished server process the way multiprocessing ends its workers: flush, then
    ``os._exit``. Interpreter finalization would destroy a process group that objects still
    reference after ``destroy_process_group`` (gloo's threads then abort the process:
    "terminate called without an active exception") and would tear down around an engine
    thread still blocked in a collective after a rank died."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
