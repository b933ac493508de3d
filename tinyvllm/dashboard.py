"""`python -m tinyvllm.dashboard --url http://host:8000`: the engine dashboard of a tinyvllm server elsewhere.

    browser --> http://127.0.0.1:8001/dashboard              the page's files, from this package
            --> http://127.0.0.1:8001/v1/engine/state/stream  --httpx, streamed--> URL/v1/engine/state/stream
"""

from __future__ import annotations

import argparse
import os
import threading
import webbrowser
from urllib.parse import urlsplit

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from tinyvllm.api.dashboard import page_file

PROXIED = ("/v1/engine/state", "/v1/engine/state/stream")


def check_url(url: str) -> str:
    """'http://host:8000/' -> 'http://host:8000'; ValueError for anything but an http(s) URL with a host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--url must be the server's http(s) address, e.g. http://127.0.0.1:8000, got {url!r}")
    return url.rstrip("/")


def build_app(url: str, api_key: str | None = None) -> FastAPI:
    """The page, and its data calls passed on to the tinyvllm server at `url`."""
    url = check_url(url)
    app = FastAPI(title="tinyvllm dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    client = httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None))

    @app.get("/")
    async def root():
        return RedirectResponse("/dashboard")

    @app.get("/dashboard")
    async def page():
        return page_file("dashboard.html")

    @app.get("/dashboard/{name}")
    async def files(name: str):
        return page_file(name)

    async def forward(request: Request) -> Response:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if not headers and "authorization" in request.headers:
            headers["Authorization"] = request.headers["authorization"]
        upstream = client.build_request("GET", url + request.url.path, params=request.query_params, headers=headers)
        try:
            response = await client.send(upstream, stream=True)
        except httpx.HTTPError as e:
            return Response(f'{{"error": {{"message": "the server at {url} cannot be reached: {type(e).__name__}", '
                            f'"type": "server_error", "param": null, "code": null}}}}', status_code=502,
                            media_type="application/json")
        kept = {k: v for k, v in response.headers.items() if k.lower() in ("content-type", "retry-after",
                                                                            "www-authenticate", "cache-control")}
        return StreamingResponse(response.aiter_raw(), status_code=response.status_code, headers=kept,
                                 background=BackgroundTask(response.aclose))

    for path in PROXIED:
        app.add_api_route(path, forward, methods=["GET"])
    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="tinyvllm: the engine dashboard of a server elsewhere")
    p.add_argument("--url", required=True, help="the tinyvllm server, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=os.environ.get("TINYVLLM_API_KEY"),
                   help="the server's API key, if it has one (default: $TINYVLLM_API_KEY; else the page asks)")
    p.add_argument("--host", default="127.0.0.1", help="where to serve the page (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8001, help="where to serve the page (default 8001)")
    p.add_argument("--open", action="store_true", help="open the page in a web browser")
    p.add_argument("--direct", action="store_true",
                   help="serve nothing: open the server's own URL/dashboard in a web browser")
    args = p.parse_args(argv)
    try:
        url = check_url(args.url)
    except ValueError as e:
        p.error(str(e))
    if args.direct:
        webbrowser.open(f"{url}/dashboard" + (f"#key={args.api_key}" if args.api_key else ""))  # a fragment: never sent
        return
    local = f"http://{args.host}:{args.port}/dashboard"
    print(f"the dashboard of {url}: {local}")
    if args.open:
        threading.Timer(1.0, webbrowser.open, [local]).start()
    uvicorn.run(build_app(url, args.api_key), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
