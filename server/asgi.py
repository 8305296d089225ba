"""What the plain ASGI middlewares share (`server.middleware.SlicedBodies`, `server.threads.ReleaseOpenMP`)."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class HTTPOnly:
    """Plain ASGI around `app` that acts on HTTP requests (`http`) and lets every other scope through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
        else:
            await self.http(scope, receive, send)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError
