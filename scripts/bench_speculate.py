"""Speculative decoding with the gate against speculation off, in one run of one node, per stream.

A `pdrt up` node of SmolLM2 (the default deployment: a prefill and a decode worker) serves two workloads
through the native protocol, greedy, with speculation on (the gate decides) and off (the request's
`speculate: false`), the two interleaved so that both see the same machine:

* grounded: rewrite, correct or copy a given piece of code or text (the answer quotes its input);
* chat: open-ended questions.

At batch 1 each prompt runs alone, once each way a repeat; at batch 8 eight streams run together, all on
or all off. A stream's decode rate is its tokens after the first over the time from its first token to its
last, as the client sees them. The figure per cell is the ratio of the medians (on over off), over every
stream of every repeat. Greedy outputs must be equal on and off. The node's counters give the proposed and
kept tokens.

Then, in process, what an entropy threshold of 2.1 (nats) would have done: for every output token of the
off runs, the entropy of the model's distribution there and whether prompt lookup's first proposed token
was the model's token.

Last line: `speculate grounded_b1=X grounded_b8=Y chat_b1=Z chat_b8=W accept=A equal=E/T`.
"""

import argparse
import asyncio
import difflib
import inspect
import json
import shlex
import statistics
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

import torch

from pdrt.client import AsyncClient
from pdrt.client.spawned_server import free_port
from pdrt.engine import SamplingParams
from pdrt.engine.proposers import PromptLookup
from pdrt.engine.sequence import Sequence
from pdrt.metrics.exposition import parse, total
from pdrt.models.fetch import default_model_dir, is_fetched
from pdrt.testing.node import Node

ENTROPY_THRESHOLD = 2.1
MIN_TOKENS = 16  # a stream shorter than this says little about a decode rate

CHAT = ["Write a short story about a lighthouse keeper.", "Explain how a refrigerator works.",
        "What are some tips for learning a new language?", "Describe a day in the life of a honeybee.",
        "Write a poem about the ocean.", "Why is the sky blue?", "Give me a recipe for pancakes.",
        "What is the history of the bicycle?"]


def grounded_prompts() -> list[str]:
    code = [inspect.getsource(f) for f in (textwrap.dedent, textwrap.indent, shlex.join, shlex.quote,
                                           difflib.get_close_matches)]
    texts = [textwrap.dedent(difflib.SequenceMatcher.__doc__ or "")[:1200],
             textwrap.dedent(textwrap.TextWrapper.__doc__ or "")[:1200],
             textwrap.dedent(shlex.shlex.__doc__ or "") + textwrap.dedent(json.dumps.__doc__ or "")[:1200]]
    asks = [f"Rewrite this Python function with type hints. Answer with the code only.\n\n```python\n{c}```"
            for c in code[:3]]
    asks += [f"Add a comment to each line of this function.\n\n```python\n{c}```" for c in code[3:]]
    asks += [f"Repeat this text, fixing any typos:\n\n{t}" for t in texts]
    return asks


async def stream_rate(client: AsyncClient, prompt: str, max_tokens: int, speculate: bool
                      ) -> tuple[list[int], float | None]:
    """The stream's tokens and its decode rate (tokens/s after the first token; None when too short)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, speculate=speculate)
    tokens, times = [], []
    async for delta in client.stream(messages=[{"role": "user", "content": prompt}], params=params):
        tokens += delta.token_ids
        times += [time.perf_counter()] * len(delta.token_ids)
    if len(tokens) < MIN_TOKENS or times[-1] == times[0]:
        return tokens, None
    return tokens, (len(tokens) - 1) / (times[-1] - times[0])


async def measure(address: str, prompts: list[str], batch: int, repeats: int, max_tokens: int
                  ) -> tuple[dict[bool, list[float]], int, int, dict[str, list[int]]]:
    """Rates on and off, greedy outputs equal / compared, and the off outputs by prompt."""
    rates: dict[bool, list[float]] = {True: [], False: []}
    equal = compared = 0
    off_outputs: dict[str, list[int]] = {}
    async with AsyncClient(address, timeout_s=600) as client:
        for r in range(repeats):
            groups = [[p] for p in prompts] if batch == 1 else [prompts[:batch]]
            for group in groups:
                outputs = {}
                for speculate in ((True, False) if r % 2 == 0 else (False, True)):
                    results = await asyncio.gather(*(stream_rate(client, p, max_tokens, speculate) for p in group))
                    outputs[speculate] = [tokens for tokens, _ in results]
                    rates[speculate] += [rate for _, rate in results if rate is not None]
                for p, on, off in zip(group, outputs[True], outputs[False], strict=True):
                    equal += on == off
                    compared += 1
                    off_outputs[p] = off
    return rates, equal, compared, off_outputs


def spec_counters(metrics_url: str) -> tuple[float, float]:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        families = parse(response.read())
    return (total(families, "pdrt_worker_spec_proposed_tokens_total"),
            total(families, "pdrt_worker_spec_accepted_tokens_total"))


def entropy_analysis(model_dir: str, prompts: list[str], outputs: dict[str, list[int]]) -> dict[str, float]:
    """Per output token of `outputs`: the model's entropy there (nats), and whether prompt lookup's first
    proposal was the model's token; summed over tokens below and above the threshold."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    counts = {"low": 0, "high": 0, "low_right": 0, "high_right": 0, "low_proposed": 0, "high_proposed": 0}
    for prompt in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        out = outputs.get(prompt, [])
        if not out:
            continue
        tokens = list(ids) + out
        with torch.inference_mode():
            logits = model(torch.tensor([tokens])).logits[0, len(ids) - 1 : -1].float()
        entropy = torch.distributions.Categorical(logits=logits).entropy().tolist()
        lookup = PromptLookup()
        for i, h in enumerate(entropy):
            seq = Sequence("x", tokens[: len(ids) + i], len(ids), SamplingParams(), 0)
            side = "low" if h < ENTROPY_THRESHOLD else "high"
            counts[side] += 1
            if lookup.available(seq):
                counts[f"{side}_proposed"] += 1
                counts[f"{side}_right"] += lookup.propose(seq, 1) == [out[i]]
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args()
    if not is_fetched():
        raise SystemExit("run `pdrt model fetch` first")
    model = str(default_model_dir())
    workdir = Path(tempfile.mkdtemp(prefix="bench-speculate-"))
    metrics_port = free_port()
    node = Node(workdir, model, extra={"controller": {"metrics_port": metrics_port},
                                       "engine": {"kv_cache_bytes": 256 << 20}}, ready_timeout_s=300)
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    workloads = {"grounded": grounded_prompts(), "chat": CHAT}
    figures, accepts, off_outputs = {}, [], {}
    equal = compared = 0
    with node:
        for name, prompts in workloads.items():
            before = spec_counters(metrics_url)
            for batch in (1, 8):
                rates, e, c, offs = asyncio.run(measure(node.address, prompts, batch, args.repeats,
                                                        args.max_tokens))
                equal, compared = equal + e, compared + c
                off_outputs.update(offs)
                on, off = statistics.median(rates[True]), statistics.median(rates[False])
                figures[f"{name}_b{batch}"] = on / off
                print(f"{name} batch {batch}: on {on:.1f} tok/s, off {off:.1f} tok/s per stream (medians of "
                      f"{len(rates[True])} and {len(rates[False])} streams): {on / off:.2f}x", flush=True)
            time.sleep(1.5)  # the workers' next metrics reports
            after = spec_counters(metrics_url)
            proposed, accepted = after[0] - before[0], after[1] - before[1]
            accepts.append(accepted / proposed if proposed else 0.0)
            print(f"{name}: {proposed:.0f} tokens proposed, {accepted:.0f} kept ({accepts[-1]:.0%})", flush=True)
    counts = entropy_analysis(model, [p for ps in workloads.values() for p in ps], off_outputs)
    low, high = counts["low"], counts["high"]
    print(f"entropy < {ENTROPY_THRESHOLD} nats at {low} of {low + high} output tokens; prompt lookup proposed "
          f"at {counts['low_proposed']} of them and was right at {counts['low_right']}; at the other "
          f"{high}: proposed at {counts['high_proposed']}, right at {counts['high_right']}")
    accept = sum(accepts) / len(accepts)
    print("speculate " + " ".join(f"{k}={v:.2f}" for k, v in figures.items())
          + f" accept={accept:.2f} equal={equal}/{compared}")


if __name__ == "__main__":
    main()
