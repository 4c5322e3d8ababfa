"""The `pdrt` command line."""

import argparse
import sys
import uuid

from pdrt.errors import PdrtError


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


def cmd_generate(args: argparse.Namespace) -> int:
    from pdrt.engine import EngineConfig, LLMEngine, SamplingParams
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
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens)
    engine.add_request(uuid.uuid4().hex, ids, params)
    detok = IncrementalDetokenizer(tokenizer, ids)
    while engine.has_unfinished():
        for out in engine.step():
            for token in out.new_token_ids:
                print(detok.add(token), end="", flush=True)
    print()
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

    gen = sub.add_parser("generate", help="answer one prompt, streamed")
    gen.add_argument("prompt")
    gen.add_argument("--model", help="checkpoint directory or .gguf file (default: the fetched SmolLM2)")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--threads", type=int)
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.set_defaults(func=cmd_generate)
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


if __name__ == "__main__":
    sys.exit(main())
