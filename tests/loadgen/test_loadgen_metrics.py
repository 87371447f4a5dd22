"""loadgen: vLLM's metric arithmetic, the streaming client against a scripted server, workloads."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from loadgen import workloads
from loadgen.cli import build_parser, run_bench
from loadgen.client import _sse_messages
from loadgen.energy import Sample, run_energy
from loadgen.metrics import RequestResult, calculate_metrics, parse_goodput, peak_buckets
from shared.transport.nats_server import free_port
from tests.conftest import TEST_DATA

SLICE = TEST_DATA / "azure_conv_slice.csv"
TTFT_S, ITL_S = 0.20, 0.05


# -- a scripted OpenAI-compatible server ------------------------------------------------------------


def scripted_app() -> FastAPI:
    """Streams `max_tokens` chunks: the first after `ttft_s`, the next every `itl_s`, then usage and [DONE].

    Text prompts count one token per space-separated word plus one (BOS); a prompt containing `FAIL`
    gets HTTP 500, one containing `STREAMERR` an error event in the stream.
    """
    app = FastAPI()

    def count(prompt: Any) -> int:
        return len(prompt) if isinstance(prompt, list) else len(prompt.split(" ")) + 1

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "scripted", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        prompt = body["prompt"]
        n_out = int(body["max_tokens"])
        usage = {"prompt_tokens": count(prompt), "completion_tokens": n_out,
                 "total_tokens": count(prompt) + n_out, "energy_j": 0.5 * n_out}
        if isinstance(prompt, str) and "FAIL" in prompt:
            return JSONResponse({"error": {"message": "scripted failure"}}, status_code=500)
        if not body.get("stream"):
            return JSONResponse({"choices": [{"text": "x", "index": 0}], "usage": usage})
        assert body["ignore_eos"] is True and body["min_tokens"] == n_out
        ttft_s, itl_s = float(body.get("ttft_s", TTFT_S)), float(body.get("itl_s", ITL_S))

        async def events() -> AsyncIterator[bytes]:
            await asyncio.sleep(ttft_s)
            if isinstance(prompt, str) and "STREAMERR" in prompt:
                yield b'data: {"error": {"message": "scripted stream error"}}\n\n'
                yield b"data: [DONE]\n\n"
                return
            for i in range(n_out):
                if i:
                    await asyncio.sleep(itl_s)
                chunk = {"choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}], "usage": None}
                yield b": keep-alive comment\n\n" if i == 1 else b""
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            yield b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def scripted_url() -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(scripted_app(), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "scripted server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(timeout=5)


def bench_args(url: str, *extra: str) -> Any:
    return build_parser().parse_args(["--base-url", url, "--no-progress", "--quiet", *extra])


# -- end to end against the scripted server ----------------------------------------------------------


def test_timings_against_scripted_server(scripted_url: str, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    args = bench_args(scripted_url, "--input-len", "12", "--output-len", "5", "--num-prompts", "4",
                      "--max-concurrency", "2", "--goodput", "ttft:350", "tpot:80", "--json", str(out),
                      "--save-detailed", "--metric-percentiles", "50,99")
    result = asyncio.run(run_bench(args))
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["total_input_tokens"] == 4 * 12 and result["total_output_tokens"] == 4 * 5
    assert result["prompt_mode"] == "text" and result["prompt_len_mismatches"] == 0
    assert result["prompt_tokens"] == [12] * 4  # calibrated text prompts have exactly the asked length
    assert result["output_len_mismatches"] == 0
    # The server waits 200 ms for the first token, then 4 gaps of 50 ms: no figure is below the script's, and each
    # is what the request's own times make it (TPOT = (E2EL - TTFT) / 4, the mean ITL the same). How far above the
    # script they come is this machine's overhead (a client and a server sharing one process), not loadgen's.
    ttfts, itls, e2els = result["ttfts"], result["itls"], result["e2els"]
    assert all(t >= 0.2 for t in ttfts) and all(e >= 0.4 for e in e2els) and all(len(g) == 4 for g in itls)
    assert result["mean_ttft_ms"] == pytest.approx(1e3 * sum(ttfts) / 4)
    assert result["mean_e2el_ms"] == pytest.approx(1e3 * sum(e2els) / 4)
    for ttft, gaps, e2el in zip(ttfts, itls, e2els, strict=True):
        assert e2el >= ttft + sum(gaps) - 1e-6  # the request ends after its last chunk (then the usage, [DONE])
    tpots = [(e2el - ttft) / 4 for ttft, e2el in zip(ttfts, e2els, strict=True)]
    assert result["mean_tpot_ms"] == pytest.approx(1e3 * sum(tpots) / 4)
    assert result["mean_itl_ms"] == pytest.approx(1e3 * sum(sum(gaps) for gaps in itls) / 16)
    assert len(result["itls"][0]) == 4  # one entry per chunk after the first (the comment is skipped)
    for key in ("p50_ttft_ms", "p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms", "p99_e2el_ms", "std_ttft_ms",
                "median_itl_ms"):
        assert key in result
    # two waves of two requests, each at least 0.4 s
    assert result["duration"] >= 0.8 and result["duration"] >= max(e2els)
    assert result["request_throughput"] == pytest.approx(4 / result["duration"])
    assert result["output_throughput"] == pytest.approx(20 / result["duration"])
    assert result["total_token_throughput"] == pytest.approx(68 / result["duration"])
    assert result["request_goodput"] == pytest.approx(4 / result["duration"])
    assert result["slo_attainment"] == 1.0
    assert result["max_concurrent_requests"] == 4  # vLLM counts requests active in a 1-s bucket
    assert result["usage_energy_j"] == pytest.approx(4 * 2.5) and result["energy_source"] == "usage"
    assert result["energy_per_token_j"] == pytest.approx(0.5)
    saved = json.loads(out.read_text())
    assert saved["completed"] == 4 and saved["request_rate"] == "inf"


def test_failures_and_slos(scripted_url: str) -> None:
    from loadgen.client import ClientConfig, run_requests
    from loadgen.workloads import RequestSpec

    config = ClientConfig(scripted_url, "scripted", extra_body={"ttft_s": 0.05, "itl_s": 0.01})
    specs = [RequestSpec(i, 0.0, 4, 3) for i in range(4)]
    prompts: list[str | list[int]] = [[5, 6, 7, 8], "a b FAIL", "STREAMERR x", [1, 2, 3, 4]]
    outcome = asyncio.run(run_requests(config, specs, prompts))
    ok = [r for r in outcome.results if r.success]
    assert [r.index for r in ok] == [0, 3]
    assert "HTTP 500" in outcome.results[1].error and "scripted failure" in outcome.results[1].error
    assert "scripted stream error" in outcome.results[2].error
    assert all(r.prompt_tokens == 4 and r.output_tokens == 3 for r in ok)
    m = calculate_metrics(outcome.results, outcome.duration_s, goodput_slos_ms={"ttft": 1000.0})
    assert (m["completed"], m["failed"]) == (2, 2)
    assert m["slo_attainment"] == 0.5  # failed requests count against the SLO
    m = calculate_metrics(outcome.results, outcome.duration_s, goodput_slos_ms={"ttft": 1.0})
    assert m["slo_attainment"] == 0.0 and m["request_goodput"] == 0.0


def test_token_id_prompts_with_a_trace(scripted_url: str, tiny_chat_checkpoint: Path) -> None:
    args = bench_args(scripted_url, "--trace", str(SLICE), "--num-prompts", "3", "--time-scale", "1000",
                      "--max-input-len", "20", "--max-output-len", "3", "--tokenizer", str(tiny_chat_checkpoint),
                      "--save-detailed")
    result = asyncio.run(run_bench(args))
    assert result["prompt_mode"] == "ids" and result["completed"] == 3
    assert result["prompt_tokens"] == [20, 20, 20] and result["output_lens"] == [3, 3, 3]
    assert result["request_rate"] == "trace"


# -- pure arithmetic ----------------------------------------------------------------------------------


def _result(i: int, ttft: float, itl: list[float], tail: float, n: int, start: float = 0.0,
            ok: bool = True) -> RequestResult:
    return RequestResult(i, 10, n, success=ok, ttft=ttft, itl=itl, latency=ttft + sum(itl) + tail, output_tokens=n,
                         start_time=start, chunks=len(itl) + 1)


def test_vllm_arithmetic_exact() -> None:
    rs = [
        _result(0, 0.1, [0.02, 0.02, 0.02], 0.0, 4),  # tpot 0.02
        _result(1, 0.3, [0.05], 0.01, 2, start=0.5),  # tpot 0.06
        _result(2, 0.2, [], 0.0, 1, start=1.2),  # one token: no TPOT
        RequestResult(3, 10, 4, success=False, error="boom"),
    ]
    m = calculate_metrics(rs, 2.0, goodput_slos_ms={"ttft": 250, "tpot": 50}, percentiles=[50, 99.9])
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 7
    assert m["request_throughput"] == 1.5 and m["output_throughput"] == 3.5 and m["total_token_throughput"] == 18.5
    ttfts, tpots, itls = [0.1, 0.3, 0.2], [0.02, 0.06], [0.02, 0.02, 0.02, 0.05]
    e2els = [0.16, 0.36, 0.2]
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        assert m[f"mean_{name}_ms"] == pytest.approx(np.mean(values) * 1000)
        assert m[f"median_{name}_ms"] == pytest.approx(np.median(values) * 1000)
        assert m[f"std_{name}_ms"] == pytest.approx(np.std(values) * 1000)
        assert m[f"p50_{name}_ms"] == pytest.approx(np.percentile(values, 50) * 1000)
        assert m[f"p99.9_{name}_ms"] == pytest.approx(np.percentile(values, 99.9) * 1000)
    # good: r0 (ttft 100, tpot 20) and r2 (ttft 200, tpot 0 for one token); r1 misses ttft; r3 failed
    assert m["request_goodput"] == 1.0 and m["slo_attainment"] == 0.5
    assert calculate_metrics(rs, 2.0)["request_goodput"] is None
    # 1-s buckets from the first start: tokens at .1 .12 .14 .16 | .8 .85 | 1.4 -> bucket 0 has 6, bucket 1 has 1
    assert peak_buckets(rs) == (6.0, 2)


def test_empty_run_and_goodput_parsing() -> None:
    m = calculate_metrics([RequestResult(0, 5, 5, error="x")], 1.0)
    assert m["completed"] == 0 and m["mean_ttft_ms"] == 0.0 and m["max_output_tokens_per_s"] == 0.0
    assert parse_goodput(["ttft:200", "TPOT:50.5", "e2el:1000"]) == {"ttft": 200, "tpot": 50.5, "e2el": 1000}
    for bad in (["ttft"], ["foo:1"], ["tpot:x"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_sse_parser_splits_and_skips() -> None:
    buf = bytearray(b'data: {"a": 1}\r\n\r\n: ping\n\ndata:{"b"')
    assert _sse_messages(buf) == ['{"a": 1}']
    buf.extend(b': 2}\n\ndata: [DONE]\n\n')
    assert _sse_messages(buf) == ['{"b": 2}', "[DONE]"] and not buf


def test_telemetry_energy_over_the_run() -> None:
    def s(t: float, wid: str, e: float) -> Sample:
        return Sample(t, wid, "attention", e, 100.0, 1000, None)

    samples = [s(0.9, "a", 10), s(1.0, "a", 11), s(2.0, "a", 50), s(3.1, "a", 70), s(3.2, "a", 75),
               s(1.5, "f", 100), s(3.05, "f", 120), s(0.5, "r", 9), s(3.5, "r", 1)]
    e = run_energy(samples, 1.0, 3.0)
    assert e.per_worker_j == {"a": 59, "f": 20}  # a: 70-11; f first seen during the run; r restarted
    assert e.energy_j == 79 and any("r:" in n for n in e.notes)


# -- workloads ----------------------------------------------------------------------------------------


def test_trace_window_and_time_scale() -> None:
    rows = workloads.read_trace(SLICE)
    assert len(rows) == 40 and rows[0].offset_s == 0.0
    assert (rows[0].input_len, rows[0].output_len) == (374, 44)
    assert rows[1].offset_s == pytest.approx(4.314579)  # 18:15:50.9951690 - 18:15:46.6805900
    specs = workloads.trace_workload(rows, time_scale=10)
    assert [s.arrival_s for s in specs] == pytest.approx([r.offset_s / 10 for r in rows])
    lo, hi = workloads.parse_window("10:30")
    win = workloads.trace_workload(rows, window=(lo, hi), time_scale=2, max_input_len=100, max_output_len=8)
    inside = [r for r in rows if 10 <= r.offset_s < 30]
    assert len(win) == len(inside) > 0
    assert [s.arrival_s for s in win] == pytest.approx([(r.offset_s - 10) / 2 for r in inside])
    assert all(s.input_len == min(r.input_len, 100) and s.output_len == min(r.output_len, 8)
               for s, r in zip(win, inside, strict=True))
    assert len(workloads.trace_workload(rows, num_prompts=5)) == 5
    assert workloads.parse_window(":5") == (0.0, 5.0) and workloads.parse_window("5:") == (5.0, math.inf)
    for bad in ("5", "5:2", "a:b"):
        with pytest.raises(workloads.WorkloadError):
            workloads.parse_window(bad)
    with pytest.raises(workloads.WorkloadError):
        workloads.trace_workload(rows, window=(1e6, 2e6))


def test_named_traces_resolve(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "AzureLLMInferenceTrace_conv.csv").write_bytes(SLICE.read_bytes())
    monkeypatch.setenv("AFLEX_TRACES_DIR", str(tmp_path))
    assert workloads.resolve_trace("conv") == tmp_path / "AzureLLMInferenceTrace_conv.csv"
    with pytest.raises(workloads.WorkloadError, match="AFLEX_TRACES_DIR"):
        workloads.resolve_trace("code")
    monkeypatch.setenv("AFLEX_TRACES_DIR", str(tmp_path / "absent"))
    with pytest.raises(workloads.TracesDirNotFoundError, match="AFLEX_TRACES_DIR"):
        workloads.resolve_trace("conv")


def test_presets_and_arrivals() -> None:
    assert workloads.PRESETS == {"qa": (128, 64), "chatbot": (128, 1024), "rag": (4096, 64),
                                 "summary": (4096, 1024)}
    a = workloads.arrival_times(200, rate=4.0, seed=7)
    assert a == workloads.arrival_times(200, rate=4.0, seed=7)  # deterministic for a seed
    assert a != workloads.arrival_times(200, rate=4.0, seed=8)
    assert a[-1] == pytest.approx(200 / 4.0) and bool(np.all(np.diff(a) > 0))
    gaps = np.diff([0.0, *a])
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=0.25)  # Poisson: CV about 1
    bursty = np.diff([0.0, *workloads.arrival_times(2000, rate=4.0, burstiness=0.25, seed=1)])
    assert np.std(bursty) / np.mean(bursty) == pytest.approx(2.0, abs=0.4)  # gamma CV = 1/sqrt(shape)
    assert workloads.arrival_times(4, rate=2.0, burstiness=math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert workloads.arrival_times(3, rate=math.inf) == [0.0, 0.0, 0.0]
    specs = workloads.synthetic_workload(3, *workloads.PRESETS["rag"], rate=1.0)
    assert [(s.input_len, s.output_len) for s in specs] == [(4096, 64)] * 3
    args = build_parser().parse_args(["--preset", "chatbot", "--num-prompts", "2", "--rate", "5"])
    from loadgen.cli import build_workload

    assert [(s.input_len, s.output_len) for s in build_workload(args)] == [(128, 1024)] * 2
