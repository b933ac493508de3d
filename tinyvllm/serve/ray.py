"""N engine replicas behind one OpenAI-compatible endpoint, on Ray Serve: an ingress passes each request to the
replica the router picks (`serve/router.py`), each replica a `python -m tinyvllm.api.server` process (the arguments
after `--`) that its Ray Serve replica starts and watches.

    python -m tinyvllm.serve.ray --num-replicas 2 --port 8000 -- --model path/or/default --max-num-seqs 32

Taught in docs/phases/08-multi-device.md, section 8.
"""

import argparse  # no `from __future__ import annotations`: FastAPI reads the handlers' annotations as types
import asyncio
import json
import re
import socket
import subprocess
import sys
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve

from tinyvllm.serve.router import POLICIES, PrefixAffinityRouter

STARTUP_TIMEOUT_S = 600  # a replica's server loads the model and compiles before /health answers


def prompt_text(body: dict) -> str:
    """The text a request's prefix is judged by: a completion's prompt, or a chat's messages in order."""
    if "messages" in body:
        return "".join(f"{m.get('role', '')}:{m.get('content', '')}\n" for m in body.get("messages") or []
                       if isinstance(m, dict))
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def label_metrics(text: str, replica: int) -> list[str]:
    """Prometheus text with replica="i" added to every sample's labels (comment lines kept as they are)."""
    lines = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            lines.append(line)
        elif (m := re.match(r"^([a-zA-Z_:][\w:]*)\{(.*)\}(.*)$", line)):
            lines.append(f'{m.group(1)}{{replica="{replica}",{m.group(2)}}}{m.group(3)}')
        else:
            name, _, rest = line.partition(" ")
            lines.append(f'{name}{{replica="{replica}"}} {rest}')
    return lines


@serve.deployment(ray_actor_options={"num_cpus": 0})
class EngineReplica:
    """One engine: starts `python -m tinyvllm.api.server` on a free port of its node and waits for /health."""

    def __init__(self, server_args: list[str]):
        from ray.util import get_node_ip_address

        host = get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self.process = subprocess.Popen([sys.executable, "-m", "tinyvllm.api.server", *server_args,
                                         "--host", host, "--port", str(port)])
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the replica's server exited with {self.process.returncode} before it was up")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replica's server did not answer /health within {STARTUP_TIMEOUT_S} s")
            time.sleep(0.5)

    def info(self) -> dict:
        return {"url": self.url, "pid": self.process.pid}

    def __del__(self):
        if getattr(self, "process", None) is not None and self.process.poll() is None:
            self.process.terminate()


app = FastAPI(title="tinyvllm on Ray Serve")


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
@serve.ingress(app)
class Ingress:
    """The one endpoint: routes each request to a replica and passes its response through."""

    def __init__(self, replicas: list, policy: str = "prefix_affinity"):
        self.replicas = replicas  # DeploymentHandles, one per engine
        self.router = PrefixAffinityRouter(len(replicas), policy)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10))
        self.urls: list[str] | None = None

    async def _urls(self) -> list[str]:
        if self.urls is None:
            infos = await asyncio.gather(*[r.info.remote() for r in self.replicas])
            self.urls = [info["url"] for info in infos]
        return self.urls

    async def _proxy(self, request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}  # the replica answers with the OpenAI-shaped 400
        prompt = prompt_text(body) if isinstance(body, dict) else ""
        urls = await self._urls()
        try:
            replica = self.router.choose(prompt)
        except RuntimeError as e:
            return JSONResponse({"error": {"message": str(e), "type": "server_error", "code": 503}}, status_code=503)
        self.router.started(replica, prompt)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        try:
            response = await self.client.send(self.client.build_request("POST", urls[replica] + path, content=raw,
                                                                        headers=headers), stream=True)
        except httpx.TransportError as e:
            self.router.finished(replica)
            self.router.mark_down(replica)
            return JSONResponse({"error": {"message": f"engine replica {replica} failed: {type(e).__name__}",
                                           "type": "server_error", "code": 502}}, status_code=502,
                                headers={"x-tinyvllm-replica": str(replica)})

        async def passthrough():
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            except httpx.TransportError as e:  # the replica died mid-stream: this request ends, with the reason
                self.router.mark_down(replica)
                error = {"error": {"message": f"engine replica {replica} failed: {type(e).__name__}",
                                   "type": "server_error", "code": 502}}
                yield f"data: {json.dumps(error)}\n\n".encode()
            finally:
                await response.aclose()
                self.router.finished(replica)

        return StreamingResponse(passthrough(), status_code=response.status_code,
                                 media_type=response.headers.get("content-type"),
                                 headers={"x-tinyvllm-replica": str(replica)})

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._proxy(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(self) -> Response:
        urls = await self._urls()
        for i, url in enumerate(urls):
            if i not in self.router.down:
                r = await self.client.get(url + "/v1/models")
                return Response(r.content, status_code=r.status_code, media_type="application/json")
        return JSONResponse({"error": {"message": "no engine replica is up", "code": 503}}, status_code=503)

    @app.get("/health")
    async def health(self) -> Response:
        up = self.router.num_replicas - len(self.router.down)
        return JSONResponse({"replicas_up": up}, status_code=200 if up else 503)

    @app.get("/router")
    async def router_state(self) -> dict:
        r = self.router
        return {"policy": r.policy, "routed": r.routed, "in_flight": r.in_flight, "down": sorted(r.down)}

    @app.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        """Every replica's /metrics, each sample labelled with its replica, and the router's counts."""
        lines, seen_comments = [], set()
        for i, url in enumerate(await self._urls()):
            if i in self.router.down:
                continue
            try:
                text = (await self.client.get(url + "/metrics")).text
            except httpx.TransportError:
                continue
            for line in label_metrics(text, i):
                if line.startswith("#"):
                    if line in seen_comments:
                        continue
                    seen_comments.add(line)
                lines.append(line)
        lines += ["# HELP tinyvllm:router_requests_total Requests the ingress sent to each replica.",
                  "# TYPE tinyvllm:router_requests_total counter"]
        lines += [f'tinyvllm:router_requests_total{{replica="{i}"}} {n}' for i, n in enumerate(self.router.routed)]
        lines += [f'tinyvllm:router_replica_up{{replica="{i}"}} {int(i not in self.router.down)}'
                  for i in range(self.router.num_replicas)]
        return PlainTextResponse("\n".join(lines) + "\n")


def build_app(num_replicas: int, server_args: list[str], policy: str = "prefix_affinity"):
    """The Serve application: `num_replicas` EngineReplica deployments (one engine each) and the Ingress."""
    replicas = [EngineReplica.options(name=f"engine-{i}").bind(server_args) for i in range(num_replicas)]
    return Ingress.bind(replicas, policy)


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """`--num-replicas 2 -- --max-num-seqs 32` -> (the deployment's flags, the server's)."""
    return (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tinyvllm.serve.ray", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-replicas", type=int, default=2, help="engine replicas (default 2)")
    p.add_argument("--routing", default="prefix_affinity", choices=POLICIES, help="(default prefix_affinity)")
    p.add_argument("--address", default=None, help="Ray cluster address ('auto': the one `ray start` made; default: "
                                                   "a local cluster for this process)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, server_args = split_argv(argv)
    p = build_parser()
    args = p.parse_args(ours)
    if args.num_replicas < 1:
        p.error(f"--num-replicas must be >= 1, got {args.num_replicas}")
    import ray

    ray.init(address=args.address)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app(args.num_replicas, server_args, args.routing), name="tinyvllm", route_prefix="/")
    print(f"tinyvllm on Ray Serve: {args.num_replicas} replicas behind http://{args.host}:{args.port}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
