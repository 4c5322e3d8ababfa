"""`pdrt bench`: arrivals, figures, goodput, trace files, and a short run against a real `pdrt up`."""

import json
import statistics

import pytest

from pdrt.bench import (
    WORKLOADS,
    LengthLimits,
    RequestRecord,
    Slo,
    arrival_times,
    goodput,
    percentile,
    read_trace,
    sample_shapes,
    summarize,
)
from pdrt.bench.arrivals import rescale_times
from pdrt.bench.cli import parse_rates
from pdrt.bench.prompts import LOWEST_TOKEN_ID, PromptBuilder
from pdrt.cli import main
from pdrt.errors import ConfigError
from pdrt.testing.node import Node, free_port


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


# -- arrivals ---------------------------------------------------------------------------------


def test_poisson_arrivals_have_the_mean_rate_and_a_cv_of_one():
    times = arrival_times(20_000, rate=4.0, seed=1)
    assert times[0] == 0.0 and times == sorted(times)
    assert (len(times) - 1) / times[-1] == pytest.approx(4.0, rel=0.03)
    assert statistics.pstdev(gaps(times)) / statistics.mean(gaps(times)) == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_arrivals_keep_the_mean_rate_at_the_cv_asked_for(cv):
    times = arrival_times(40_000, rate=2.0, seed=7, process="gamma", cv=cv)
    assert (len(times) - 1) / times[-1] == pytest.approx(2.0, rel=0.05)
    assert statistics.pstdev(gaps(times)) / statistics.mean(gaps(times)) == pytest.approx(cv, rel=0.08)


def test_arrivals_are_the_same_for_the_same_seed_and_differ_for_another():
    assert arrival_times(50, 1.0, seed=3) == arrival_times(50, 1.0, seed=3) != arrival_times(50, 1.0, seed=4)


def test_bad_rates_and_processes_are_refused():
    with pytest.raises(ConfigError):
        arrival_times(10, 0.0, seed=0)
    with pytest.raises(ConfigError):
        arrival_times(10, 1.0, seed=0, process="uniform")
    with pytest.raises(ConfigError):
        parse_rates("1,x", None)
    assert parse_rates(None, "1:4:4") == [1.0, 2.0, 3.0, 4.0]
    assert rescale_times([5.0, 6.0, 9.0], 1.0) == [0.0, 0.5, 2.0]


# -- workloads and prompts ------------------------------------------------------------------------


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("max_model_len", [512, 4096])
def test_workloads_fit_the_context_and_keep_their_shape(workload, max_model_len):
    limits = LengthLimits(max_model_len)
    shapes = sample_shapes(workload, 300, limits, seed=0)
    assert len(shapes) == 300
    assert all(s.input_tokens >= 1 and s.output_tokens >= 1 for s in shapes)
    assert all(s.input_tokens + s.output_tokens <= limits.context for s in shapes)
    inputs = statistics.median(s.input_tokens for s in shapes)
    outputs = statistics.median(s.output_tokens for s in shapes)
    if workload == "summarization":
        assert inputs > 0.5 * limits.context and outputs < inputs / 4
    if workload == "code":
        assert outputs > inputs


def test_later_chat_turns_start_with_the_earlier_turns_prompt():
    shapes = sample_shapes("chat", 200, LengthLimits(4096), seed=2)
    builder = PromptBuilder(seed=0, salt="a", vocab_size=1000)
    by_conversation: dict[int, list[tuple[int, list[int]]]] = {}
    for i, s in enumerate(shapes):
        by_conversation.setdefault(s.conversation, []).append((i, builder.token_ids(i, s)))
    multi = [turns for turns in by_conversation.values() if len(turns) > 1]
    assert multi
    for turns in multi:
        for (_, earlier), (_, later) in zip(turns, turns[1:], strict=False):
            assert len(later) > len(earlier) and later[:len(earlier)] == earlier
    ids = [t for turns in by_conversation.values() for _, p in turns for t in p]
    assert min(ids) >= LOWEST_TOKEN_ID and max(ids) < 1000
    other_salt = PromptBuilder(seed=0, salt="b", vocab_size=1000)
    assert other_salt.token_ids(0, shapes[0]) != builder.token_ids(0, shapes[0])


# -- figures ------------------------------------------------------------------------------------


def record(index: int, ttft: float, tpot: float, tokens: int = 11, error: str | None = None) -> RequestRecord:
    r = RequestRecord(index, due_s=float(index), input_tokens=10, max_output_tokens=tokens)
    r.sent(index)
    if error:
        r.fail(index + 1.0, error)
        return r
    r.tokens(1, index + ttft)
    r.tokens(tokens - 1, index + ttft + tpot * (tokens - 1))
    r.finish(index + ttft + tpot * (tokens - 1))
    return r


def test_percentiles_interpolate_between_ranks_like_numpy():
    values = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(7.6)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 10.0
    assert percentile([5.0], 99) == 5.0 and percentile([], 50) is None


def test_a_request_attains_when_both_slos_hold_and_failures_count_against():
    records = [record(0, 0.1, 0.01), record(1, 0.5, 0.01), record(2, 0.1, 0.05), record(3, 0, 0, error="overloaded")]
    summary = summarize(records, rate=1.0, slo=Slo(ttft_s=0.2, tpot_s=0.02))
    assert summary.attainment == 0.25  # only the first meets both; the failure is in the denominator
    assert summary.ttft_attainment == 0.5 and summary.tpot_attainment == 0.5
    assert summary.num_failed == 1 and summary.errors == {"overloaded": 1}
    assert records[0].tpot_s == pytest.approx(0.01) and records[0].ttft_s == pytest.approx(0.1)
    assert summary.ttft.p50 == pytest.approx(0.1)


def test_goodput_interpolates_between_the_rates_that_bracket_the_target():
    found = goodput([(4.0, 0.5), (1.0, 1.0), (2.0, 0.95)])  # any order
    assert found.bound == "interpolated" and found.between == (2.0, 4.0)
    assert found.rate == pytest.approx(2.0 + (0.95 - 0.9) / (0.95 - 0.5) * 2.0)
    assert "interpolated" in found.describe()
    assert goodput([(1.0, 0.99), (2.0, 0.95)]).bound == "at_least"
    below = goodput([(1.0, 0.5), (2.0, 0.2)])
    assert below.bound == "below_lowest" and below.rate == 0.0
    assert goodput([(1.0, 0.9), (2.0, 0.1)]).rate == 1.0


# -- traces -------------------------------------------------------------------------------------


def test_csv_and_jsonl_traces_read_alike(tmp_path):
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("arrival_s,input_tokens,output_tokens\n0.5,100,20\n0,50,10\n1.25,7,3\n")
    jsonl_path = tmp_path / "t.jsonl"
    jsonl_path.write_text('{"timestamp": 0.5, "prompt_tokens": 100, "completion_tokens": 20}\n\n'
                          '{"arrival_s": 0, "input_tokens": 50, "output_tokens": 10}\n'
                          '{"arrival_s": 1.25, "input_len": 7, "output_len": 3.0}\n')
    rows = read_trace(csv_path)
    assert [(r.arrival_s, r.shape.input_tokens, r.shape.output_tokens) for r in rows] == \
           [(0.0, 50, 10), (0.5, 100, 20), (1.25, 7, 3)]
    assert read_trace(jsonl_path) == rows


def test_an_azure_llm_inference_trace_reads_as_published(tmp_path):
    path = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:15:50.9951690,396,109\n"
                    "2023-11-16 18:15:46.2000000,879,45\n")
    rows = read_trace(path)
    assert [(round(r.arrival_s, 6), r.shape.input_tokens, r.shape.output_tokens) for r in rows] == \
           [(0.0, 879, 45), (0.48059, 374, 44), (4.795169, 396, 109)]


@pytest.mark.parametrize(("name", "text", "message"), [
    ("bad.csv", "arrival_s,input_tokens,output_tokens\n0,10,5\n1,ten,5\n", "bad.csv:3: input_tokens must be a number"),
    ("neg.csv", "arrival_s,input_tokens,output_tokens\n-1,10,5\n", "arrival_s must be >= 0"),
    ("frac.csv", "arrival_s,input_tokens,output_tokens\n0,10.5,5\n", "must be an integer"),
    ("missing.csv", "arrival_s,input_tokens\n0,10\n", "no output_tokens"),
    ("zero.jsonl", '{"arrival_s": 0, "input_tokens": 0, "output_tokens": 5}\n', "must be >= 1"),
    ("broken.jsonl", '{"arrival_s": 0, "input_tokens": 3, "output_tokens": 5}\n{"arrival_s": 1,\n', "broken.jsonl:2: "
                                                                                                   "not JSON"),
    ("list.jsonl", "[0, 1, 2]\n", "each line must be a JSON object"),
    ("empty.csv", "", "no header row"),
    ("when.csv", "time,input_tokens,output_tokens\nyesterday,10,5\n", "seconds or an ISO 8601 date-time"),
    ("mixed.csv", "time,input_tokens,output_tokens\n2023-11-16 18:15:46,10,5\n3.5,10,5\n", "mix date-times"),
])
def test_bad_trace_rows_stop_the_load_with_where_and_why(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        read_trace(path)


# -- against a real server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def node(model_dirs, tmp_path_factory):
    http_port = free_port()
    with Node(tmp_path_factory.mktemp("bench"), str(model_dirs["llama"]),
              extra={"gateway": {"http_port": http_port}}) as running:
        running.http = f"http://127.0.0.1:{http_port}/v1"
        yield running


SHORT_RUN = ["--workload", "chat", "--length-scale", "0.15", "--max-output-tokens", "12", "--num-requests", "5",
             "--ttft-slo", "2", "--tpot-slo", "0.5", "--quiet"]


def check_results(path, num_rates: int) -> dict:
    results = json.loads(path.read_text())
    assert len(results["runs"]) == num_rates
    for run in results["runs"]:
        summary = run["summary"]
        assert summary["num_requests"] == 5 and summary["num_ok"] == 5, summary["errors"]
        assert 0.0 <= summary["attainment"] <= 1.0
        assert summary["output_throughput"] > 0 and summary["request_throughput"] > 0
        for r in run["records"]:
            assert r["error"] is None and r["output_tokens"] >= 1
            assert 0 < r["ttft_s"] <= r["e2e_s"] and r["tpot_s"] >= 0
    assert results["goodput"]["bound"] in ("interpolated", "measured", "at_least", "below_lowest")
    assert "api_key" not in results["config"]["target"]
    return results


def test_a_short_sweep_over_the_native_protocol_writes_json_and_plots(node, tmp_path, capsys):
    out = tmp_path / "native.json"
    assert main(["bench", "--server", node.address, "--rates", "2,4", *SHORT_RUN, "--out", str(out)]) == 0
    results = check_results(out, num_rates=2)
    assert results["server"]["max_model_len"] > 0
    for run in results["runs"]:  # ignore_eos: every answer is exactly as long as asked
        assert all(r["output_tokens"] == r["max_output_tokens"] for r in run["records"])
    assert (tmp_path / "native-cdf.png").stat().st_size > 1000
    assert (tmp_path / "native-attainment.png").read_bytes()[:4] == b"\x89PNG"
    table = capsys.readouterr().out
    assert "attain" in table and "goodput" in table


def test_a_short_run_over_the_openai_http_api(node, tmp_path):
    out = tmp_path / "http.json"
    assert main(["bench", "--base-url", node.http, "--rates", "3", *SHORT_RUN, "--out", str(out),
                 "--no-plots"]) == 0
    results = check_results(out, num_rates=1)
    assert results["config"]["target"]["protocol"] == "openai"
    assert results["server"]["tokens_per_word"] > 0
    for r in results["runs"][0]["records"]:
        assert r["prompt_tokens"] > 0 and r["output_tokens"] <= r["max_output_tokens"]
    assert not (tmp_path / "http-cdf.png").exists()
