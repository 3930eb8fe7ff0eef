"""A canary rollout under load: the automatic gate against an injected slow or failing version.

    python benchmarks/rollout.py [--fault latency|errors] [--delay 0.5] [--concurrency 8]

One server (in this process: the real HTTP app, fleet and engines) serves two versions of SmolLM2
behind one route, the incumbent at weight 80 and the canary at 20, with a canary gate. Clients
send completions at a fixed concurrency. After a healthy phase, a hook (this script's, wrapped
around the canary's engine: nothing in jaxserve) makes every canary request wait `--delay` seconds
before its first token (`latency`) or fail (`errors`). Reported: the time from that breach to the
canary's weight 0, the canary requests answered meanwhile, and the requests lost (any answer but
200). With `latency` the goal is 0 lost; with `errors` every request the canary took before the
gate tripped is lost by construction, so the count is the breach's blast radius.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.provenance import commit, cpu  # noqa: E402
from jaxserve.errors import RequestFailed  # noqa: E402
from jaxserve.fleet.fleet import Fleet  # noqa: E402
from jaxserve.fleet.loader import EngineLoader  # noqa: E402
from jaxserve.config import ServerConfig  # noqa: E402
from jaxserve.entrypoints.http.app import attach_engine, build_app, start_server  # noqa: E402

SMOLLM2 = "smollm2-135m-instruct"
ENGINE = "max_model_len = 256\nmax_num_seqs = 8\nmax_num_batched_tokens = 64\nnum_pages = 128\n"


def deployment(window_s: float, min_requests: int) -> str:
    return f"""
[version.incumbent]
model = "{SMOLLM2}"
{ENGINE}
[version.canary]
model = "{SMOLLM2}"
{ENGINE}
[route.smollm2]
weights = {{ incumbent = 80, canary = 20 }}
[route.smollm2.canary]
incumbent = "incumbent"
window_seconds = {window_s}
min_requests = {min_requests}
max_ttft_p99_ratio = 2.0
max_error_rate_ratio = 2.0
"""


class Faulty:
    """The test hook: the canary's engine, with a fault switched on at the breach."""

    def __init__(self, engine):
        self._engine = engine
        self.delay = 0.0
        self.fail = False

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, *args, **kwargs):
        if self.fail:
            raise RequestFailed("injected fault (benchmarks/rollout.py)")
        if self.delay:
            await asyncio.sleep(self.delay)
        async for out in self._engine.generate(*args, **kwargs):
            yield out


class HookedLoader(EngineLoader):
    def __init__(self, hooked: str, **kwargs):
        super().__init__(**kwargs)
        self.hooked, self.hook = hooked, None

    def load(self, spec, prepared):
        loaded = super().load(spec, prepared)
        if spec.name != self.hooked:
            return loaded
        self.hook = Faulty(loaded.engine)
        return dataclasses.replace(loaded, engine=self.hook)


async def run(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "deployment.toml"
        path.write_text(deployment(args.window, args.min_requests))
        loader = HookedLoader("canary", progress=False)
        loop = asyncio.get_running_loop()
        fleet = await loop.run_in_executor(None, Fleet.from_deployment, path, loader)
    app = build_app(ServerConfig(port=0), "rollout")
    runner, port = await start_server(app, "127.0.0.1", 0)
    attach_engine(app, None, fleet=fleet)
    url = f"http://127.0.0.1:{port}/v1/completions"
    stats = {"sent": 0, "lost": 0, "by_version": {}, "canary_after_breach": 0}
    breach_at = trip_at = None
    stop = asyncio.Event()

    async def client(session: aiohttp.ClientSession, i: int) -> None:
        rng = random.Random(i)
        while not stop.is_set():
            body = {"model": "smollm2", "prompt": f"Count from {rng.randint(1, 50)}:",
                    "max_tokens": 8, "temperature": 0}
            async with session.post(url, json=body) as resp:
                answer = await resp.json()
            stats["sent"] += 1
            if resp.status != 200:
                stats["lost"] += 1
                continue
            version = answer["model"]
            stats["by_version"][version] = stats["by_version"].get(version, 0) + 1
            if breach_at is not None and version == "canary":
                stats["canary_after_breach"] += 1

    async with aiohttp.ClientSession() as session:
        clients = [asyncio.ensure_future(client(session, i)) for i in range(args.concurrency)]
        await asyncio.sleep(args.healthy)  # both versions build a window of healthy samples
        healthy = dict(stats["by_version"])
        breach_at = time.monotonic()
        if args.fault == "latency":
            loader.hook.delay = args.delay
        else:
            loader.hook.fail = True
        while time.monotonic() - breach_at < args.timeout:
            if fleet.route("smollm2").weight("canary") == 0:
                trip_at = time.monotonic()
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(2.0)  # traffic goes on after the trip: nothing more may be lost
        stop.set()
        await asyncio.gather(*clients)
    await runner.cleanup()
    trips = fleet.route_info("smollm2")["canary_trips"]
    await loop.run_in_executor(None, fleet.shutdown)
    return {"fault": args.fault, "delay_s": args.delay if args.fault == "latency" else None,
            "concurrency": args.concurrency, "healthy_phase_s": args.healthy,
            "healthy_answers": healthy, "breach_to_weight_0_s":
                None if trip_at is None else round(trip_at - breach_at, 3),
            "requests": stats["sent"], "lost": stats["lost"],
            "canary_answers_after_breach": stats["canary_after_breach"],
            "trip": trips[-1] if trips else None, "commit": commit(), "cpu": cpu(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fault", choices=("latency", "errors"), default="latency")
    p.add_argument("--delay", type=float, default=0.5, help="seconds added before the canary's "
                   "first token (--fault latency)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--healthy", type=float, default=20.0, help="seconds of healthy traffic first")
    p.add_argument("--window", type=float, default=60.0, help="the gate's window_seconds")
    p.add_argument("--min-requests", type=int, default=10, help="the gate's min_requests")
    p.add_argument("--timeout", type=float, default=120.0, help="give up waiting for the trip")
    print(json.dumps(asyncio.run(run(p.parse_args())), indent=2))


if __name__ == "__main__":
    main()
