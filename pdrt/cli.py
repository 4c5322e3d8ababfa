"""The `pdrt` command line: `up` serves; `generate` and `chat` are clients of a running server.

Answers go to stdout and everything else (logs, progress, errors) to stderr,
so that `pdrt generate ... > answer.txt` holds the answer alone.
"""

import argparse
import sys
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

from pdrt.errors import PdrtError

if TYPE_CHECKING:
    from pdrt.client import Client, Draft, Stream
    from pdrt.engine.sampling_params import SamplingParams


def _model_path(arg: str | None) -> str:
    from pdrt.models.fetch import default_model_dir, is_fetched

    if arg:
        return arg
    if not is_fetched():
        raise PdrtError("the default model is not in the cache yet; run `pdrt model fetch` first")
    return str(default_model_dir())


def cmd_model(args: argparse.Namespace) -> int:
    from pdrt.models.fetch import default_model_dir, fetch_default_model

    if args.action == "fetch":
        fetch_default_model(force=args.force, log=lambda m: print(m, file=sys.stderr))
    print(default_model_dir())
    return 0


def _server_address(arg: str | None) -> str:
    from pdrt.client.server_address import default_server

    return arg or default_server()


def _sampling_params(args: argparse.Namespace) -> "SamplingParams":
    from pdrt.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens)


@contextmanager
def _connected(args: argparse.Namespace) -> Iterator["Client"]:
    """A client of the server at --server; with --serve, a `pdrt up` started first when nothing listens there."""
    from pdrt.client import Client
    from pdrt.client.spawned_server import SpawnedServer, is_listening
    from pdrt.errors import ServerUnreachableError

    address = _server_address(args.server)
    with ExitStack() as stack:
        # A refused TCP connect answers at once, where a handshake with nobody would wait out the timeout.
        if address.startswith("tcp://") and not is_listening(address):
            if not args.serve:
                raise ServerUnreachableError(f"nothing listens at {address}; start a server with `pdrt up`, "
                                             "or pass --serve")
            server = SpawnedServer.at(address, args.model, ready_timeout_s=args.ready_timeout)
            print(f"pdrt: no server at {address}; starting one (log: {server.log_path})", file=sys.stderr)
            stack.enter_context(server)
        yield stack.enter_context(Client(address, timeout_s=args.timeout))


def _print_answer(client: "Client", params: "SamplingParams", **prompt: object) -> str | None:
    """Stream one answer to stdout; its text, or None when Ctrl-C cancelled it."""
    return _print_stream(client.stream(params=params, **prompt))


def _print_stream(stream: "Stream") -> str | None:
    try:
        for delta in stream:
            print(delta.text, end="", flush=True)
    except KeyboardInterrupt:  # leaving the loop has cancelled the request on the server
        print(flush=True)
        print("pdrt: answer cancelled", file=sys.stderr)
        return None
    except PdrtError:
        if stream.completion.text:
            print(flush=True)  # end the partial answer's line before the error is reported
        raise
    print(flush=True)
    return stream.completion.text


def cmd_generate(args: argparse.Namespace) -> int:
    if args.local:
        return _generate_local(args)
    params = _sampling_params(args)
    prompt = {"prompt": args.prompt} if args.raw else {"messages": [{"role": "user", "content": args.prompt}]}
    with _connected(args) as client:
        return 0 if _print_answer(client, params, **prompt) is not None else 130


def _read_line(interactive: bool, draft: "Draft") -> str | None:
    """The next line of stdin, None at its end. At a terminal it is read key by key and the draft
    follows every key, so the server prefills the question while it is being typed."""
    if interactive:
        from pdrt.client.typed_line import read_typed_line

        return read_typed_line("> ", draft.set_text)
    line = sys.stdin.readline()
    if line:
        draft.set_text(line.rstrip("\n"))
    return line if line else None


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    interactive = sys.stdin.isatty()
    session_id = uuid.uuid4().hex
    first = [{"role": "system", "content": args.system}] if args.system else []
    with _connected(args) as client:
        if interactive:
            print(f"pdrt: chatting with {client.ready.model} at {client.address}; /reset starts over, /exit or "
                  "Ctrl-D quits, Ctrl-C stops an answer", file=sys.stderr)
        messages = list(first)
        while True:
            draft = client.draft(messages=messages, session_id=session_id)
            try:
                line = _read_line(interactive, draft)
            except KeyboardInterrupt:  # at the prompt, Ctrl-C clears the line, as a Python prompt does
                draft.abandon()
                print(file=sys.stderr)
                continue
            text = line.strip() if line is not None else ""
            if line is None or text == "/exit":
                draft.abandon()
                return 0
            if text == "/reset" or not text:
                draft.abandon()
                if text:
                    messages = list(first)
                    print("pdrt: conversation cleared", file=sys.stderr)
                continue
            try:
                draft.set_text(text)
                answer = _print_stream(draft.submit(params))
            except PdrtError as exc:  # one failed answer does not end the conversation
                print(f"pdrt: {exc.code}: {exc}", file=sys.stderr)
                continue
            if answer is not None:  # a cancelled or failed exchange is left out of the conversation
                messages += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]


def _generate_local(args: argparse.Namespace) -> int:
    """The engine in this process, without a server: the engine as a library, for a quick look at a checkpoint."""
    from pdrt.engine import EngineConfig, LLMEngine
    from pdrt.engine.detokenizer import IncrementalDetokenizer

    engine = LLMEngine(EngineConfig(model=_model_path(args.model), num_threads=args.threads))
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise PdrtError("this model has no tokenizer; text prompts need one")
    if args.raw or not tokenizer.chat_template:
        ids = tokenizer(args.prompt)["input_ids"]
    else:
        messages = [{"role": "user", "content": args.prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    engine.add_request(uuid.uuid4().hex, ids, _sampling_params(args))
    detok = IncrementalDetokenizer(tokenizer, ids)
    while engine.has_unfinished():
        for out in engine.step():
            for token in out.new_token_ids:
                print(detok.add(token), end="", flush=True)
    print()
    return 0


def _add_client_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", metavar="ADDRESS",
                        help="the gateway (default: $PDRT_SERVER, else tcp://$PDRT_HOST:$PDRT_PORT, those "
                             "defaulting to 127.0.0.1 and 7100 as for `pdrt up`)")
    parser.add_argument("--serve", action="store_true",
                        help="when no server listens at the address, run `pdrt up` there for this command")
    parser.add_argument("--model", help="with --serve (or --local): checkpoint directory (default: the fetched "
                                        "SmolLM2)")
    parser.add_argument("--ready-timeout", type=float, default=300.0, metavar="S",
                        help="with --serve: how long the server may take to start (default 300)")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S",
                        help="give up when the server sends nothing for S seconds (default 60)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int)


def cmd_key(args: argparse.Namespace) -> int:
    from pdrt.actors.cluster_key import ClusterKey

    print(ClusterKey.generate().text)
    return 0


def _cluster_key_text(key_file: str | None) -> str:
    """The key from PDRT_CLUSTER_KEY, else `key_file`, else the one `pdrt up` node running on this host."""
    import glob
    import os
    import tempfile
    from pathlib import Path

    if os.environ.get("PDRT_CLUSTER_KEY"):
        return os.environ["PDRT_CLUSTER_KEY"]
    if key_file:
        return Path(key_file).read_text().strip()
    found = glob.glob(os.path.join(tempfile.gettempdir(), "pdrt-*", "cluster.key"))
    if len(found) != 1:
        raise PdrtError(f"{len(found)} local runs have a cluster key; give PDRT_CLUSTER_KEY or --key-file")
    return Path(found[0]).read_text().strip()


def cmd_role(args: argparse.Namespace) -> int:
    import asyncio

    from pdrt.actors.cluster_key import ClusterKey
    from pdrt.control_plane.set_role import set_role

    key = ClusterKey.parse(_cluster_key_text(args.key_file))
    changed = asyncio.run(set_role(args.controller, key, args.worker, args.role, args.timeout))
    print(f"{changed.process_id} serves as a {changed.role} worker ({changed.moved} streams moved on)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdrt", description="prefill/decode-disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="the default model (SmolLM2-135M-Instruct)")
    model.add_argument("action", choices=["fetch", "path"])
    model.add_argument("--force", action="store_true", help="fetch and convert again")
    model.set_defaults(func=cmd_model)

    from pdrt.supervisor import add_arguments, run_up

    up = sub.add_parser("up", help="serve: start this node's processes and keep them running")
    add_arguments(up)
    up.set_defaults(func=run_up)

    key = sub.add_parser("key", help="print a new cluster key (PDRT_CLUSTER_KEY: the same on every node of a "
                                     "cluster)")
    key.set_defaults(func=cmd_key)

    role = sub.add_parser("role", help="make a worker of a disaggregated node a prefill or a decode worker, in place")
    role.add_argument("worker", help="its process id, as `pdrt status` shows it (decode-0)")
    role.add_argument("role", choices=["prefill", "decode"])
    role.add_argument("--controller", default="tcp://127.0.0.1:7101", help="the controller (default: this host's)")
    role.add_argument("--key-file", help="the cluster key (default: $PDRT_CLUSTER_KEY, else the local run's)")
    role.add_argument("--timeout", type=float, default=15.0, metavar="S")
    role.set_defaults(func=cmd_role)

    from pdrt.deploy import systemd as deploy_systemd

    units = sub.add_parser("systemd", help="write systemd units that run this node's processes (docs/deploy.md)")
    deploy_systemd.add_arguments(units)
    units.set_defaults(func=deploy_systemd.run_systemd)

    gen = sub.add_parser("generate", help="answer one prompt, streamed from a running server")
    gen.add_argument("prompt")
    _add_client_arguments(gen)
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--local", action="store_true", help="run the engine in this process instead of asking a "
                                                          "server (needs the checkpoint)")
    gen.add_argument("--threads", type=int, help="with --local: torch threads")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat with a running server, answers streamed")
    _add_client_arguments(chat)
    chat.add_argument("--system", help="a system message that opens the conversation")
    chat.set_defaults(func=cmd_chat)

    from pdrt.bench.cli import add_arguments as add_bench_arguments
    from pdrt.bench.cli import run_bench

    bench = sub.add_parser("bench", help="open-loop load against a running server: latencies, SLO attainment, "
                                         "goodput over a rate sweep")
    add_bench_arguments(bench)
    bench.set_defaults(func=run_bench)

    from pdrt.planner.cli import add_parsers as add_planner_parsers

    add_planner_parsers(sub)

    from pdrt.metrics.status_table import add_status_parser

    add_status_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pdrt.logs import configure_logging

    # stdout carries answers; logs and progress go to stderr.
    configure_logging()
    try:
        return args.func(args)
    except PdrtError as exc:
        print(f"pdrt: {exc.code}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pdrt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
