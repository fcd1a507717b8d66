"""Load test of `vramshard serve`: many concurrent streaming clients over loopback.

    python benchmarks/server_load.py --model PATH [--clients 64] [--disconnect 0.3] [--max-seqs 16]
    python benchmarks/server_load.py --url http://127.0.0.1:8000 --model-name NAME [--api-key KEY]
    python benchmarks/server_load.py --shape nemo-8b --server-args "--vram 8GiB"   # random weights, token-id prompts

Each client streams one completion (prompts and answer lengths differ) and checks that its
stream is whole: events in order, a finish reason, ``[DONE]``. With ``--disconnect P`` each
client hangs up mid-stream with probability P. Reports throughput (completion tokens/s) and
p50/p99 of end-to-end latency and time to first token; with ``--json`` as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

WORDS = ("the plan runs each sub layer on the processor or the graphics card and streams weights over "
         "the link while the other side computes so the step time is the larger of the two").split()


@dataclass
class ClientResult:
    index: int
    text: str = ""
    events: int = 0
    finish_reason: str | None = None
    done: bool = False  # saw [DONE]
    disconnected: bool = False
    status: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    ttft_s: float | None = None
    ids: set = field(default_factory=set)  # response ids seen in its events (must be exactly one)
    token_ids: list = field(default_factory=list)  # streamed token ids (servers of models without a tokenizer)
    error: str | None = None


@dataclass
class LoadReport:
    clients: int
    completed: int
    disconnected: int
    failed: int
    wall_s: float
    completion_tokens: int
    tokens_per_s: float
    latency_p50_s: float
    latency_p99_s: float
    ttft_p50_s: float
    ttft_p99_s: float


def make_specs(clients: int, seed: int = 0, min_words: int = 2, max_words: int = 60,
               min_tokens: int = 4, max_tokens: int = 24) -> list[tuple[str, int]]:
    """(prompt, max_tokens) per client: different lengths, each prompt unique."""
    rng = random.Random(seed)
    specs = []
    for index in range(clients):
        words = [rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))]
        specs.append((f"{index} " + " ".join(words), rng.randint(min_tokens, max_tokens)))
    return specs


def token_specs(specs: list[tuple[str, int]], vocab: int = 200, seed: int = 0) -> list[tuple[list[int], int]]:
    """The same clients with token-id prompts (one id per word, the client's index first) for a
    model without a tokenizer (``vramshard serve --shape``)."""
    rng = random.Random(seed)
    return [([1 + index % (vocab - 1)] + [rng.randrange(1, vocab) for _ in prompt.split()[1:]], max_tokens)
            for index, (prompt, max_tokens) in enumerate(specs)]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


async def one_client(client: httpx.AsyncClient, url: str, model: str, index: int, prompt: str | list[int], max_tokens: int,
                     headers: dict, hang_up_after: int | None) -> ClientResult:
    result = ClientResult(index)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    result.done = True
                    break
                event = json.loads(data)
                result.ids.add(event["id"])
                if event.get("usage"):
                    result.completion_tokens = event["usage"]["completion_tokens"]
                for choice in event["choices"]:
                    if result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - start
                    result.text += choice["text"]
                    result.token_ids += choice.get("token_ids") or []
                    result.finish_reason = choice["finish_reason"] or result.finish_reason
                    result.events += 1
                if hang_up_after is not None and result.events >= hang_up_after:
                    result.disconnected = True
                    break
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency_s = time.perf_counter() - start
    return result


async def run_load(url: str, specs: list[tuple[str | list[int], int]], model: str, api_key: str | None = None,
                   disconnect: float = 0.0, seed: int = 0) -> tuple[LoadReport, list[ClientResult]]:
    """All clients at once; returns the report and each client's result (in spec order)."""
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(specs) + 8, max_keepalive_connections=len(specs) + 8)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(120.0)) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(
            one_client(client, url, model, i, prompt, max_tokens, headers,
                       rng.randint(1, 3) if rng.random() < disconnect else None)
            for i, (prompt, max_tokens) in enumerate(specs)))
        wall = time.perf_counter() - start
    complete = [r for r in results if r.done and not r.disconnected]
    tokens = sum(r.completion_tokens for r in complete)
    latencies = [r.latency_s for r in complete]
    ttfts = [r.ttft_s for r in complete if r.ttft_s is not None]
    report = LoadReport(
        clients=len(specs), completed=len(complete), disconnected=sum(r.disconnected for r in results),
        failed=sum(1 for r in results if r.error or (not r.done and not r.disconnected)), wall_s=wall,
        completion_tokens=tokens, tokens_per_s=tokens / wall if wall else 0.0,
        latency_p50_s=percentile(latencies, 0.5), latency_p99_s=percentile(latencies, 0.99),
        ttft_p50_s=percentile(ttfts, 0.5), ttft_p99_s=percentile(ttfts, 0.99))
    return report, list(results)


# ---------------------------------------------------------------------- a server to test
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: str | None, *extra: str, timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """`vramshard serve MODEL EXTRA...` on a free loopback port (MODEL None: EXTRA names a --shape);
    returns (process, base url) once healthy."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "vramshard.cli.main", "serve", *([str(model)] if model else []),
                                "--port", str(port), *map(str, extra)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode}: {process.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model to serve (starts a server on a free loopback port)")
    parser.add_argument("--url", help="an already running server instead")
    parser.add_argument("--shape", help="serve random weights of a named shape (prompts as token ids)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds the server may take to start")
    parser.add_argument("--model-name", default=None, help="model name to send (default: as served)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--clients", default="64",
                        help="concurrent clients; several (e.g. 16,64) load one server in turn")
    parser.add_argument("--disconnect", type=float, default=0.0, help="probability a client hangs up mid-stream")
    parser.add_argument("--max-tokens", type=int, default=24, help="longest answer (answers vary from 4 to this)")
    parser.add_argument("--max-seqs", type=int, default=16, help="server --max-seqs (with --model)")
    parser.add_argument("--server-args", default="", help="more arguments for `vramshard serve` (with --model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if sum(map(bool, (args.model, args.url, args.shape))) != 1:
        parser.error("give exactly one of --model, --shape and --url")
    try:
        counts = [int(c) for c in str(args.clients).split(",")]
    except ValueError:
        parser.error(f"--clients takes client counts separated by commas, got {args.clients!r}")
    if not counts or min(counts) < 1:
        parser.error(f"--clients must be 1 or more, got {args.clients!r}")
    process = None
    url = args.url
    if args.model or args.shape:
        shape = ("--shape", args.shape) if args.shape else ()
        process, url = start_server(args.model, *shape, "--max-seqs", str(args.max_seqs), *args.server_args.split(),
                                    timeout=args.timeout)
    try:
        name = args.model_name or httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {args.api_key}"}
                                            if args.api_key else {}).json()["data"][0]["id"]
        reports = []
        for count in counts:
            specs = make_specs(count, args.seed, max_tokens=args.max_tokens)
            if args.shape:
                specs = token_specs(specs, seed=args.seed)
            reports.append(asyncio.run(run_load(url, specs, name, args.api_key, args.disconnect, args.seed))[0])
    finally:
        if process is not None:
            stop_server(process)
    if args.json:  # one report, or a list of them for several client counts
        print(json.dumps(asdict(reports[0]) if len(reports) == 1 else [asdict(r) for r in reports], indent=2))
    else:
        for report in reports:
            print(f"{report.clients} clients: {report.completed} complete, {report.disconnected} hung up, "
                  f"{report.failed} failed in {report.wall_s:.2f} s; {report.tokens_per_s:.1f} completion tok/s; "
                  f"latency p50 {report.latency_p50_s:.3f} s p99 {report.latency_p99_s:.3f} s; "
                  f"TTFT p50 {report.ttft_p50_s:.3f} s p99 {report.ttft_p99_s:.3f} s")
    return 0 if all(r.failed == 0 for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
