"""`pdrt bench`: open-loop load against a running server, at one rate or a sweep, and its goodput.

The table goes to stdout; the progress bar (at a terminal, without
--quiet) and messages go to stderr. `--out` writes the JSON results and,
unless --no-plots, the PNG plots next to them.
"""

import argparse
import asyncio
import json
import os
import sys

from pdrt.bench.arrivals import ARRIVALS
from pdrt.bench.driver import Target
from pdrt.bench.goodput import DEFAULT_TARGET
from pdrt.bench.record import RequestRecord
from pdrt.bench.runner import BenchOptions, run_sweep
from pdrt.bench.stats import Slo
from pdrt.bench.workloads import WORKLOADS
from pdrt.client.server_address import default_server
from pdrt.errors import ConfigError


def parse_rates(rates: str | None, sweep: str | None) -> list[float]:
    """Rates from "0.5,1,2" or from "start:stop:steps" (`steps` rates evenly spaced, both ends included)."""
    if rates:
        try:
            values = [float(r) for r in rates.split(",") if r.strip()]
        except ValueError:
            raise ConfigError(f"--rates takes numbers separated by commas, got {rates!r}") from None
    elif sweep:
        try:
            start, stop, steps = sweep.split(":")
            low, high, num = float(start), float(stop), int(steps)
        except ValueError:
            raise ConfigError(f"--sweep takes start:stop:steps, such as 0.5:4:8; got {sweep!r}") from None
        if num < 1 or high < low:
            raise ConfigError(f"--sweep needs steps >= 1 and stop >= start, got {sweep!r}")
        values = [low] if num == 1 else [low + (high - low) * i / (num - 1) for i in range(num)]
    else:
        return []
    if not values or any(v <= 0 for v in values):
        raise ConfigError("request rates must be > 0")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_argument_group("server")
    where.add_argument("--server", metavar="ADDRESS",
                       help="a pdrt gateway, native protocol (default: $PDRT_SERVER, else "
                            "tcp://$PDRT_HOST:$PDRT_PORT, as for `pdrt up`)")
    where.add_argument("--base-url", metavar="URL", help="an OpenAI-compatible server instead, e.g. "
                                                         "http://127.0.0.1:7180/v1)")
    where.add_argument("--model", help="OpenAI: the model to ask for (default: the first /v1/models lists)")
    where.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="OpenAI: bearer key "
                                                                                    "(default: $OPENAI_API_KEY)")
    where.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                       help="OpenAI: /v1/completions (exact prompt, the default) or /v1/chat/completions")
    where.add_argument("--prompt-format", choices=["text", "ids"], default="text",
                       help="OpenAI: prompts as words, or as token-id lists (servers that take them: pdrt, vLLM)")
    where.add_argument("--extra-body", metavar="JSON", help='OpenAI: merged into each request, e.g. '
                                                            '\'{"ignore_eos": true}\' for vLLM')
    where.add_argument("--vocab-size", type=int, help="token-id prompts use ids below this (default 1000)")
    where.add_argument("--max-model-len", type=int, help="the server's context, when it does not say")
    where.add_argument("--timeout", type=float, default=300.0, metavar="S",
                       help="a request fails when nothing arrives for S seconds (default 300)")

    load = parser.add_argument_group("load")
    load.add_argument("--workload", choices=WORKLOADS, default="chat")
    load.add_argument("--trace", metavar="FILE", help="replay a CSV/JSONL trace (arrival_s, input_tokens, "
                                                      "output_tokens); with --rates its times are rescaled")
    load.add_argument("--rates", help="request rates to run, e.g. 0.5,1,2,4")
    load.add_argument("--sweep", metavar="START:STOP:STEPS", help="evenly spaced rates, e.g. 0.5:4:8")
    load.add_argument("--duration", type=float, default=30.0, metavar="S",
                      help="requests per rate = rate x S (default 30)")
    load.add_argument("--num-requests", type=int, metavar="N", help="requests per rate, instead of --duration")
    load.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    load.add_argument("--cv", type=float, default=1.0, help="gamma arrivals: coefficient of variation (default 1)")
    load.add_argument("--seed", type=int, default=0, help="lengths and arrival times (default 0)")
    load.add_argument("--length-scale", type=float, default=1.0, help="shrink every length by this (0..1]")
    load.add_argument("--max-input-tokens", type=int)
    load.add_argument("--max-output-tokens", type=int)
    load.add_argument("--max-context", type=int, help="treat the context as this long (summarization scales to it)")
    load.add_argument("--max-in-flight", type=int, default=256, help="safety cap on open requests (default 256)")
    load.add_argument("--temperature", type=float, default=0.0)

    judge = parser.add_argument_group("SLOs and output")
    judge.add_argument("--ttft-slo", type=float, default=1.0, metavar="S", help="seconds (default 1.0)")
    judge.add_argument("--tpot-slo", type=float, default=0.1, metavar="S", help="seconds (default 0.1)")
    judge.add_argument("--attainment-target", type=float, default=DEFAULT_TARGET,
                       help=f"goodput is the highest rate reaching this (default {DEFAULT_TARGET})")
    judge.add_argument("--out", metavar="FILE", help="write results as JSON here (and plots next to it)")
    judge.add_argument("--plots", metavar="PREFIX", help="write PREFIX-cdf.png and PREFIX-attainment.png "
                                                         "(default: --out without .json)")
    judge.add_argument("--no-plots", action="store_true")
    judge.add_argument("--quiet", action="store_true", help="no progress bar")


def target_from(args: argparse.Namespace) -> Target:
    address = args.base_url or args.server or default_server()
    try:
        extra = json.loads(args.extra_body) if args.extra_body else {}
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--extra-body is not JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise ConfigError("--extra-body must be a JSON object")
    return Target(address, model=args.model, api_key=args.api_key, endpoint=args.endpoint,
                  prompt_format=args.prompt_format, extra_body=extra, temperature=args.temperature,
                  request_timeout_s=args.timeout, vocab_size=args.vocab_size)


def options_from(args: argparse.Namespace) -> BenchOptions:
    return BenchOptions(workload=args.workload, trace=args.trace, num_requests=args.num_requests,
                        duration_s=args.duration, arrival=args.arrival, cv=args.cv, seed=args.seed,
                        slo=Slo(args.ttft_slo, args.tpot_slo), attainment_target=args.attainment_target,
                        length_scale=args.length_scale, max_input_tokens=args.max_input_tokens,
                        max_output_tokens=args.max_output_tokens, max_context=args.max_context,
                        max_model_len=args.max_model_len, max_in_flight=args.max_in_flight)


class _Progress:
    """One tqdm bar per rate, on stderr; nothing when stderr is not a terminal or with --quiet."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar = None

    def start(self, rate: float | None, num_requests: int):
        self.close()
        if not self.enabled:
            return None
        from tqdm import tqdm

        self.bar = tqdm(total=num_requests, desc=f"{rate:g} req/s" if rate else "trace", unit="req",
                        file=sys.stderr, leave=True)
        bar = self.bar

        def done(record: RequestRecord) -> None:
            bar.update(1)
            if not record.ok:
                bar.set_postfix_str("failures", refresh=False)

        return done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def run_bench(args: argparse.Namespace) -> int:
    from pdrt.bench.report import format_table, write_json

    rates: list[float | None] = list(parse_rates(args.rates, args.sweep))
    if not rates:
        if args.trace is None:
            raise ConfigError("give the request rates: --rates 0.5,1,2 or --sweep 0.5:4:8 (or replay a --trace)")
        rates = [None]
    target, options = target_from(args), options_from(args)
    progress = _Progress(not args.quiet and sys.stderr.isatty())
    try:
        result = asyncio.run(run_sweep(target, rates, options, progress.start))
    finally:
        progress.close()
    print(format_table(result))
    if args.out:
        print(f"pdrt bench: results in {write_json(result, args.out)}", file=sys.stderr)
    prefix = args.plots or (args.out[:-5] if args.out and args.out.endswith(".json") else args.out)
    if prefix and not args.no_plots:
        from pdrt.bench.plots import write_plots

        paths = write_plots(result, prefix)
        print("pdrt bench: plots in " + ", ".join(map(str, paths)), file=sys.stderr)
    return 0 if all(s.num_ok for s in result.summaries) else 1

