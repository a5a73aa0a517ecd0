"""Serving an aiohttp app of the operator (health server, Alertmanager webhook) on the operator's loop."""

from __future__ import annotations

from aiohttp import web


async def listen(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Serve `app` on host:port (no access log); stop with `await runner.cleanup()`. A failure to
    bind cleans the runner up before it is raised."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
