"""Serving benchmark of the real HTTP server: its own load generator (async httpx, streaming) against
`/v1/completions`, reported in the shape and with the metric names of vLLM's serving benchmark, so the
numbers compare.

Requests: `--num-prompts` prompts of `--input-len` random token ids (each its own, so the prefix cache
serves none; `--range-ratio` r draws lengths in [len (1 - r), len (1 + r)]), `--output-len` tokens each
(`ignore_eos`, greedy), streamed (`stream_options.include_usage`: the server's own token counts). Arrivals:
Poisson at `--request-rate` (a comma-separated list sweeps the rates, one run each, on the same server;
`inf`: every request at once), gamma-distributed with `--burstiness` (1: Poisson), at most
`--max-concurrency` in flight. Models: `--models` (names as clients send them: the base's served name,
adapter names), taken round-robin or at random (`--model-order`, `--seed`); default every model of
`GET /v1/models`. `--models` given again is another workload, swept after the first on the same server
(e.g. `--models base --models a0,a1,a2,a3`: the base alone, then four adapters).

Per run, overall and per model: successful / failed requests, duration, input / output tokens, request
throughput, output and total token throughput, TTFT (to the first streamed token), TPOT (per output token
after the first), ITL (between streamed chunks) and E2EL (the whole request): mean, median, std and the
`--metric-percentiles` (default 99), in ms. Before the first run one request per model (the run's lengths)
is sent alone, untimed, as vLLM's benchmark probes: the first one's TTFT is printed ("first request after
ready"), to compare with the loaded median (the start-up warm-up should keep it within a few times that).
`--json FILE` writes every run.

`--structured-fraction F`: that share of the requests (drawn per request, the same ones at every rate) held by
vLLM's `structured_outputs` to the regex `[a-z ]{output_len - 1}` (then EOS: the same token count as the free
ones), what a JSON-mode client mixes into a server's load: the host's grammar masks and their batch's steps.

`--score`: the requests of an evaluation harness's loglikelihood tasks instead (lm-eval's `local-completions`:
`echo`, `logprobs: 1`, `max_tokens: 1`): each prompt is scored (its tokens' logprobs, the first streamed chunk:
TTFT) and one token generated; request throughput is prompts scored a second.

Target: a running server (`--base-url`), or one started here from a model directory (`--model DIR
[--lora-modules NAME=PATH ...]`; every argument after `--` goes to `moelora serve` as it is, e.g.
`-- --load-format dummy --max-num-seqs 256`), stopped at the end.

usage: python benchmarks/serve.py (--base-url URL | --model DIR [--lora-modules N=P ...]) [--models a,b ...]
       [--num-prompts 200] [--request-rate 1,4,16,inf] [--burstiness 1] [--max-concurrency N]
       [--input-len 256] [--output-len 128] [--range-ratio 0] [--model-order round-robin|random] [--seed 0]
       [--vocab-size V] [--structured-fraction 0] [--score] [--json FILE] [-- SERVE ARGS]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass
class RequestResult:
    model: str
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0  # seconds from sending to the first streamed token
    itl: list[float] = field(default_factory=list)  # seconds between streamed chunks
    latency: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Plan:
    """What one run sends: per request (model, prompt token ids, output length, held to a format), in order."""

    models: list[str]
    prompts: list[list[int]]
    output_lens: list[int]
    score: bool = False  # loglikelihood requests (`--score`)
    held: tuple[bool, ...] = ()  # per request: structured outputs (`--structured-fraction`); () none

    def request(self, i: int) -> tuple:
        """`send`'s arguments after (client, url) for request i."""
        return (self.models[i], self.prompts[i], self.output_lens[i], self.score, bool(self.held and self.held[i]))


def make_plan(models: list[str], n: int, input_len: int, output_len: int, vocab: int, seed: int,
              range_ratio: float = 0.0, order: str = "round-robin", score: bool = False,
              structured: float = 0.0) -> Plan:
    rng = random.Random(seed)
    held = random.Random(seed + 7919)  # apart from rng: the prompts are those of a run without formats

    def length(mean: int) -> int:
        return max(1, round(rng.uniform(mean * (1 - range_ratio), mean * (1 + range_ratio))))

    names = [models[i % len(models)] if order == "round-robin" else rng.choice(models) for i in range(n)]
    prompts = [[rng.randrange(vocab) for _ in range(length(input_len))] for _ in range(n)]
    return Plan(names, prompts, [1 if score else length(output_len) for _ in range(n)], score,
                tuple(held.random() < structured for _ in range(n)) if structured else ())


async def send(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int,
               score: bool = False, held: bool = False) -> RequestResult:
    """One streamed completion; TTFT at its first chunk with choices, ITL between the later ones. `score`: the
    prompt echoed with its logprobs (the first chunk, after the prompt is scored) before the generated tokens.
    `held`: the output held to output_len - 1 letters or spaces, then EOS."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if score:
        body.update(echo=True, logprobs=1)
    if held:
        body["structured_outputs"] = {"regex": f"[a-z ]{{{output_len - 1}}}"}
    out = RequestResult(model, len(prompt))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if "error" in chunk:
                    out.error = str(chunk["error"].get("message"))
                elif chunk.get("choices"):
                    if out.ttft == 0.0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                elif chunk.get("usage"):
                    out.output_tokens = chunk["usage"]["completion_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
    out.latency = time.perf_counter() - start
    if out.ok and not out.output_tokens and out.ttft:  # a server that sends no usage: one token a chunk
        out.output_tokens = len(out.itl) + 1
    if out.ok and out.ttft == 0.0:
        out.error = "no token streamed"
    return out


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds before each request: gamma(shape burstiness, mean 1 / rate) gaps; all 0 at rate inf."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


async def run_load(url: str, plan: Plan, rate: float, burstiness: float = 1.0, max_concurrency: int | None = None,
                   seed: int = 0) -> tuple[list[RequestResult], float]:
    """Send the plan's requests at their arrival times; (results in plan order, seconds from first send to
    last answer)."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as client:
        async def one(i: int) -> RequestResult:
            if gate is None:
                return await send(client, url, *plan.request(i))
            async with gate:
                return await send(client, url, *plan.request(i))

        tasks = []
        start = time.perf_counter()
        for i, gap in enumerate(arrival_gaps(len(plan.prompts), rate, burstiness, seed)):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(i)))
        results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def _stats(name: str, values_s: list[float], percentiles: list[float]) -> dict:
    ms = sorted(v * 1e3 for v in values_s) or [0.0]
    out = {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms),
           f"std_{name}_ms": statistics.pstdev(ms)}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = _percentile(ms, p)
    return out


def _percentile(sorted_ms: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    k = (len(sorted_ms) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(sorted_ms) - 1)
    return sorted_ms[lo] + (sorted_ms[hi] - sorted_ms[lo]) * (k - lo)


def summarize(results: list[RequestResult], duration: float, percentiles: list[float]) -> dict:
    """vLLM's serving-benchmark metrics (its JSON names) of `results` over `duration` seconds."""
    ok = [r for r in results if r.ok]
    tokens_in, tokens_out = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {"duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
            "total_input_tokens": tokens_in, "total_output_tokens": tokens_out,
            "request_throughput": len(ok) / duration, "output_throughput": tokens_out / duration,
            "total_token_throughput": (tokens_in + tokens_out) / duration,
            **_stats("ttft", [r.ttft for r in ok], percentiles), **_stats("tpot", tpot, percentiles),
            **_stats("itl", [g for r in ok for g in r.itl], percentiles),
            **_stats("e2el", [r.latency for r in ok], percentiles),
            "errors": sorted({r.error for r in results if not r.ok})[:5]}


def report(run: dict, percentiles: list[float]) -> str:
    """One run in vLLM's printed shape, then a per-model table."""
    row = "{:<40} {:<10}".format
    num = "{:<40} {:<10.2f}".format
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             row("Successful requests:", run["completed"]), row("Failed requests:", run["failed"]),
             row("Request rate configured (RPS):", run["request_rate"])]
    if run.get("max_concurrency"):
        lines.append(row("Maximum request concurrency:", run["max_concurrency"]))
    lines += [num("Benchmark duration (s):", run["duration"]), row("Total input tokens:", run["total_input_tokens"]),
              row("Total generated tokens:", run["total_output_tokens"]),
              num("Request throughput (req/s):", run["request_throughput"]),
              num("Output token throughput (tok/s):", run["output_throughput"]),
              num("Total Token throughput (tok/s):", run["total_token_throughput"])]
    for key, title, label in (("ttft", "Time to First Token", "TTFT"),
                              ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl", "Inter-token Latency", "ITL"), ("e2el", "End-to-end Latency", "E2EL")):
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        lines += [num(f"Mean {label} (ms):", run[f"mean_{key}_ms"]),
                  num(f"Median {label} (ms):", run[f"median_{key}_ms"])]
        lines += [num(f"P{p:g} {label} (ms):", run[f"p{p:g}_{key}_ms"]) for p in percentiles]
    lines.append("=" * 50)
    if len(run["per_model"]) > 1:
        p, w = f"p{percentiles[-1]:g}", max(5, *map(len, run["per_model"]))
        lines.append(f"{'model':<{w}} {'ok':>5} {'req/s':>7} {'out tok/s':>10} {'TTFT med':>9} {'TTFT ' + p:>9} "
                     f"{'TPOT med':>9} {'ITL med':>8} {'ITL ' + p:>8}")
        for name, m in run["per_model"].items():
            lines.append(f"{name:<{w}} {m['completed']:>5} {m['request_throughput']:>7.2f} "
                         f"{m['output_throughput']:>10.1f} {m['median_ttft_ms']:>9.1f} {m[f'{p}_ttft_ms']:>9.1f} "
                         f"{m['median_tpot_ms']:>9.2f} {m['median_itl_ms']:>8.2f} {m[f'{p}_itl_ms']:>8.2f}")
    return "\n".join(lines)


def benchmark(url: str, models: list[str], rates: list[float], num_prompts: int, input_len: int, output_len: int,
              vocab: int, *, burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
              range_ratio: float = 0.0, order: str = "round-robin", percentiles: tuple[float, ...] = (99,),
              first: bool = True, score: bool = False, structured: float = 0.0, print_fn=print) -> dict:
    """The probe requests (`first`: the first since the server became ready), then one run per rate;
    returns {"models", "probe_ttft_ms", "runs": [...]}."""
    pct = list(percentiles)
    probe = make_plan(models, len(models), input_len, output_len, vocab, seed - 1, range_ratio, score=score,
                      structured=1.0 if structured else 0.0)  # a format compiled before the timed runs
    firsts, _ = asyncio.run(run_load(url, probe, float("inf"), max_concurrency=1))
    bad = [r.error for r in firsts if not r.ok]
    if bad:
        raise SystemExit(f"probe request failed: {bad[0]}")
    print_fn(f"workload {','.join(models)}: " + ("first request after ready" if first else "probe request")
             + f": TTFT {firsts[0].ttft * 1e3:.1f} ms ({firsts[0].model})")
    runs = []
    for k, rate in enumerate(rates):
        plan = make_plan(models, num_prompts, input_len, output_len, vocab, seed + k, range_ratio, order, score,
                         structured)
        results, duration = asyncio.run(run_load(url, plan, rate, burstiness, max_concurrency, seed + k))
        run = {"request_rate": "inf" if rate == float("inf") else rate, "burstiness": burstiness,
               "max_concurrency": max_concurrency, "structured_requests": sum(plan.held),
               **summarize(results, duration, pct)}
        run["per_model"] = {m: summarize([r for r in results if r.model == m], duration, pct) for m in models}
        print_fn(report(run, pct))
        runs.append(run)
    return {"models": models, "probe_ttft_ms": firsts[0].ttft * 1e3, "runs": runs}


# the server ---------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launched_server(model: str, lora_modules: list[str], serve_args: list[str], timeout: float) -> Iterator[str]:
    """`moelora serve MODEL` in a subprocess on a free loopback port (extra `serve_args` as they are); yields
    its URL once /health answers 200 (after its warm-up); stopped on the way out."""
    port = _free_port()
    cmd = [sys.executable, "-m", "moelora.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
           *(["--lora-modules", *lora_modules] if lora_modules else []), *serve_args]
    print("starting:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"the server was not ready after {timeout:.0f} s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def served_models(url: str) -> list[str]:
    return [m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]]


def _rates(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates (numbers or inf), got {text!r}") from None


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """(benchmark arguments, `moelora serve` arguments: everything after `--`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = ap.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--model", help="a model directory to serve here (moelora serve MODEL ...)")
    ap.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH", help="with --model")
    ap.add_argument("--models", action="append", default=None,
                    help="comma-separated model names to send (default: /v1/models); again: another workload")
    ap.add_argument("--model-order", choices=["round-robin", "random"], default="round-robin")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--request-rate", type=_rates, default=[float("inf")], help="req/s, comma-separated: a sweep")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1: Poisson)")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.0)
    ap.add_argument("--vocab-size", type=int, default=None, help="prompt ids are drawn below it (default: "
                    "--model's config.json vocab_size; needed with --base-url)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--metric-percentiles", default="99")
    ap.add_argument("--server-timeout", type=float, default=1800.0, help="seconds to wait for --model's server")
    ap.add_argument("--score", action="store_true", help="loglikelihood requests as evaluation harnesses send "
                    "them: echo, logprobs 1, max_tokens 1 (--output-len ignored)")
    ap.add_argument("--structured-fraction", type=float, default=0.0,
                    help="share of requests held to a regex by structured_outputs (0..1)")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args(argv)
    if args.vocab_size is None:
        if args.model is None:
            ap.error("--vocab-size is needed with --base-url")
        args.vocab_size = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1 or not 0 <= args.range_ratio < 1:
        ap.error("--num-prompts, --input-len and --output-len must be >= 1 and --range-ratio in [0, 1)")
    if not 0 <= args.structured_fraction <= 1 or (args.structured_fraction and args.score):
        ap.error("--structured-fraction must be in [0, 1], and not with --score")
    if not args.request_rate or min(args.request_rate) <= 0:
        ap.error("every --request-rate must be > 0 (inf: all at once)")
    return args, serve_args


def main(argv: list[str] | None = None) -> dict:
    args, serve_args = parse_args(argv)
    percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    with contextlib.ExitStack() as stack:
        url = args.base_url or stack.enter_context(
            launched_server(args.model, args.lora_modules, serve_args, args.server_timeout))
        groups = [g.split(",") for g in args.models] if args.models else [served_models(url)]
        workloads = [benchmark(url, models, args.request_rate, args.num_prompts, args.input_len, args.output_len,
                               args.vocab_size, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                               seed=args.seed, range_ratio=args.range_ratio, order=args.model_order,
                               percentiles=percentiles, first=i == 0, score=args.score,
                               structured=args.structured_fraction)
                     for i, models in enumerate(groups)]
    result = {"target": args.base_url or args.model, "serve_args": serve_args,
              "first_request_ttft_ms": workloads[0]["probe_ttft_ms"], "workloads": workloads,
              "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
              "range_ratio": args.range_ratio, "seed": args.seed, "score": args.score,
              "structured_fraction": args.structured_fraction}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
