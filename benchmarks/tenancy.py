"""Tenant isolation under a flood, on loopback: tenant A (standard class) floods the server at
several times its measured capacity while tenant B (interactive, weight 1) sends a steady trickle.
Reports B's time to first token (p50/p99) alone and under the flood, their ratio (the goal: B's
p99 under the flood <= 2x its p99 alone), A's outcomes (200 / 429 / 503), and checks that every
request ended exactly once and no KV page leaked.

    python benchmarks/tenancy.py [--model smollm2-135m-instruct] [--seconds 30] [--flood 3]

The server is the real HTTP app (jaxserve.entrypoints.http.app) with a tenants file, in this process
on its own event loop and thread; the clients are aiohttp streams on another. Baseline and flood run
in the same process, one after the other, on the same engine.

`--degrade`: the flood against a route (fleet/degrade.py) over two versions, "big" (the engine
above) and "small" (a second engine, `--small-model` with `--small-max-num-seqs` seats: by default
the same model, so moving requests there adds capacity as well as degrading them), three phases of
the same flood in one run: degradation off, A's class capped at `--degrade-max-tokens`, and capped
and moved to "small". Each prints B's TTFT p99 and the shares of all requests degraded (an
x-jaxserve-degraded answer) and shed (503).

    python benchmarks/tenancy.py --degrade [--seconds 30] [--flood 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.provenance import commit, cpu  # noqa: E402

TENANTS = """
[tenant.a]
api_keys = ["sk-a"]
priority = "standard"
max_concurrent_requests = {a_concurrency}

[tenant.b]
api_keys = ["sk-b"]
priority = "interactive"
weight = 1
"""


class Server:
    """The app on its own loop thread, bound to 127.0.0.1 on a free port."""

    def __init__(self, model: str, tenants_file: Path, max_queued: int, engine_kwargs: dict,
                 small: tuple[str, dict] | None = None):
        """`small`: (model, engine kwargs) of a second version; then the app serves a fleet of
        "big" and "small" (routes set by the caller) instead of the one engine."""
        from jaxserve.core.async_engine import AsyncEngine
        from jaxserve.config import ServerConfig
        from jaxserve.core.engine_factory import build_engine
        from jaxserve.entrypoints.http.app import attach_engine, build_app, start_server

        self.llm = build_engine(model, strict_compile=True, progress=False,
                                **engine_kwargs)
        self.engine = AsyncEngine(self.llm)
        self.fleet = self.small_llm = None
        if small is not None:
            from jaxserve.fleet.deployment import VersionSpec
            from jaxserve.fleet.fleet import Fleet

            self.small_llm = build_engine(small[0], strict_compile=True, progress=False,
                                          **small[1])
            self.fleet = Fleet.of_engine("big", self.engine, max_queued_requests=max_queued)
            self.fleet.adopt(VersionSpec("small", small[0]), AsyncEngine(self.small_llm))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.app = build_app(ServerConfig(port=0, tenants_file=str(tenants_file),
                                          max_queued_requests=max_queued), model)
        self.runner, port = self._call(start_server(self.app, "127.0.0.1", 0))
        self.loop.call_soon_threadsafe(
            lambda: attach_engine(self.app, self.engine if self.fleet is None else None,
                                  fleet=self.fleet))
        self._call(asyncio.sleep(0))  # runs after the attach: the server is ready
        self.url = f"http://127.0.0.1:{port}"

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    def stop(self) -> None:
        self._call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if self.fleet is not None:
            self.fleet.shutdown()
        else:
            self.engine.shutdown()


async def one(session: aiohttp.ClientSession, url: str, key: str, body: dict) -> dict:
    """One streaming completion: its status, TTFT (first text), how it ended and whether its
    route degraded it (x-jaxserve-degraded)."""
    start = time.perf_counter()
    ttft, ends = None, []
    async with session.post(f"{url}/v1/completions", json={**body, "stream": True},
                            headers={"Authorization": f"Bearer {key}"}) as resp:
        if resp.status != 200:
            await resp.read()
            return {"status": resp.status, "ttft": None, "ends": 1}
        degraded = resp.headers.get("x-jaxserve-degraded")
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                ends.append("done")
                continue
            event = json.loads(data)
            if "error" in event:
                ends.append("error")
            elif ttft is None and event["choices"] and event["choices"][0]["text"]:
                ttft = time.perf_counter() - start
    # exactly one [DONE] per stream: "ended once"
    return {"status": 200, "ttft": ttft, "ends": ends.count("done"),
            "stream_error": "error" in ends, "degraded": degraded}


async def trickle(session, url, key, body, interval: float, seconds: float) -> list[dict]:
    tasks = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        tasks.append(asyncio.ensure_future(one(session, url, key, body)))
        await asyncio.sleep(interval)
    return list(await asyncio.gather(*tasks))


async def flood(session, url, key, body, rate: float, seconds: float, rng) -> list[dict]:
    """Open-loop Poisson arrivals at `rate` per second."""
    tasks = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        tasks.append(asyncio.ensure_future(one(session, url, key, body)))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


async def capacity(session, url, key, body, concurrency: int, seconds: float) -> float:
    """Completed requests per second at a closed-loop concurrency that keeps the engine full."""
    done = 0
    end = time.perf_counter() + seconds

    async def worker():
        nonlocal done
        while time.perf_counter() < end:
            r = await one(session, url, key, body)
            done += r["status"] == 200
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - start)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def statuses(results: list[dict]) -> dict[str, int]:
    """HTTP statuses, a 200 stream that ended with an error event counted as "200+error"."""
    counts: dict[str, int] = {}
    for r in results:
        key = f"{r['status']}+error" if r.get("stream_error") else str(r["status"])
        counts[key] = counts.get(key, 0) + 1
    return counts


def summary(results: list[dict]) -> dict:
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    return {"requests": len(results), "statuses": statuses(results),
            "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1) if ttfts else None,
            "ttft_p99_ms": round(1000 * pct(ttfts, 0.99), 1) if ttfts else None}


async def run(args, url: str) -> dict:
    rng = random.Random(0)
    a_body = {"model": args.model, "prompt": "Once upon a time " * 16, "max_tokens": 32,
              "ignore_eos": True}
    b_body = {"model": args.model, "prompt": "Hello, how are", "max_tokens": 8,
              "ignore_eos": True}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        cap = await capacity(session, url, "sk-a", a_body, args.max_num_seqs + args.max_queued,
                             args.capacity_seconds)
        alone = await trickle(session, url, "sk-b", b_body, args.b_interval, args.seconds)
        rate = args.flood * cap
        a_task = asyncio.ensure_future(flood(session, url, "sk-a", a_body, rate, args.seconds,
                                             rng))
        under = await trickle(session, url, "sk-b", b_body, args.b_interval, args.seconds)
        a = await a_task
    b_alone, b_flood = summary(alone), summary(under)
    return {
        "capacity_req_s": round(cap, 2), "flood_rate_req_s": round(rate, 2),
        "b_alone": b_alone, "b_under_flood": b_flood,
        "b_p99_ratio": (round(b_flood["ttft_p99_ms"] / b_alone["ttft_p99_ms"], 2)
                        if b_alone["ttft_p99_ms"] and b_flood["ttft_p99_ms"] else None),
        "a_statuses": statuses(a),
        "every_request_ended_once": all(r["ends"] == 1 for r in alone + under + a),
    }


def route(degrade: dict | None):
    from jaxserve.fleet.deployment import parse_route

    return parse_route("chat", {"weights": {"big": 1}, "degrade": degrade or False})


def shares(results: list[dict]) -> dict:
    n = len(results)
    return {"requests": n,
            "degraded_share": round(sum(bool(r.get("degraded")) for r in results) / n, 3),
            "shed_share": round(sum(r["status"] == 503 for r in results) / n, 3)}


async def run_degrade(args, server: Server) -> dict:
    """The same flood three times on one server: degradation off, A's class capped, capped and
    moved to "small"."""
    rng = random.Random(0)
    a_body = {"model": "chat", "prompt": "Once upon a time " * 16, "max_tokens": 32,
              "ignore_eos": True}
    b_body = {"model": "chat", "prompt": "Hello, how are", "max_tokens": 8, "ignore_eos": True}
    cap = {"classes": ["standard"], "max_tokens": args.degrade_max_tokens}
    phases = {"off": None, "max_tokens": cap, "max_tokens+version": {**cap, "degrade_to": "small"}}
    timeout = aiohttp.ClientTimeout(total=600)
    result: dict = {}
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        server.fleet.set_route(route(None))
        capacity_req_s = await capacity(session, server.url, "sk-a", a_body,
                                        args.max_num_seqs + args.max_queued,
                                        args.capacity_seconds)
        rate = args.flood * capacity_req_s
        result.update(capacity_req_s=round(capacity_req_s, 2), flood_rate_req_s=round(rate, 2))
        ended = True
        for name, degrade in phases.items():
            server.fleet.set_route(route(degrade))
            a_task = asyncio.ensure_future(flood(session, server.url, "sk-a", a_body, rate,
                                                 args.seconds, rng))
            b = await trickle(session, server.url, "sk-b", b_body, args.b_interval, args.seconds)
            a = await a_task
            ended = ended and all(r["ends"] == 1 for r in a + b)
            result[name] = {"b": summary(b), "a_statuses": statuses(a), "all": shares(a + b),
                            "b_degraded": sum(bool(r.get("degraded")) for r in b)}
            await asyncio.sleep(2)  # the phase's last requests leave the queue
    result["every_request_ended_once"] = ended
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--seconds", type=float, default=30.0, help="each phase (alone, flood)")
    p.add_argument("--capacity-seconds", type=float, default=15.0)
    p.add_argument("--flood", type=float, default=3.0, help="A's rate, times the capacity")
    p.add_argument("--b-interval", type=float, default=1.0, help="seconds between B's requests")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-queued", type=int, default=4, help="--max-queued-requests")
    p.add_argument("--output", type=Path, default=None, help="also write the JSON result here")
    p.add_argument("--degrade", action="store_true",
                   help="flood a route with degradation off, capped, capped and moved (above)")
    p.add_argument("--degrade-max-tokens", type=int, default=8,
                   help="--degrade: the cap on A's completions (A asks for 32)")
    p.add_argument("--small-model", default=None, help="--degrade: the smaller version's model "
                                                         "(default: --model)")
    p.add_argument("--small-max-num-seqs", type=int, default=4)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tenants = Path(tmp) / "tenants.toml"
        # A may hold every seat and the whole queue: beyond that it gets 429s (its limit), and
        # each of B's arrivals at a full queue sheds one of A's queued requests (a 503 for A).
        tenants.write_text(TENANTS.format(
            a_concurrency=args.max_num_seqs + args.max_queued))
        engine_kwargs = dict(num_pages=512, max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=256, max_model_len=512)
        small = ((args.small_model or args.model,
                  {**engine_kwargs, "max_num_seqs": args.small_max_num_seqs})
                 if args.degrade else None)
        server = Server(args.model, tenants, args.max_queued, engine_kwargs, small)
        try:
            result = asyncio.run(run_degrade(args, server) if args.degrade
                                 else run(args, server.url))
            time.sleep(0.5)  # aborts land on the engine thread a moment after a stream ends
            llms = [server.llm] + ([server.small_llm] if server.small_llm is not None else [])
            for llm in llms:
                llm.scheduler.cache.check_invariants()
            result["pages_leaked"] = sum(llm.stats().pages_in_use for llm in llms)
            result["engine_unfinished"] = any(llm.has_unfinished() for llm in llms)
        finally:
            server.stop()
    result.update(model=args.model, degrade=args.degrade, seconds=args.seconds, flood=args.flood,
                  b_interval=args.b_interval, max_num_seqs=args.max_num_seqs,
                  max_queued=args.max_queued, commit=commit(), cpu=cpu(),
                  date=time.strftime("%Y-%m-%d", time.gmtime()))
    text = json.dumps(result, indent=2)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
