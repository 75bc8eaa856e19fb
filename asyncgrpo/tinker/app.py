"""The HTTP app (aiohttp): the tinker SDK's REST routes over a :class:`TinkerService`.

Every route reads its body as the SDK's own request type and answers the SDK's response type
(:mod:`asyncgrpo.tinker.wire`). Calls that do work answer an ``UntypedAPIFuture`` at once and
queue the work; ``retrieve_future`` long-polls its outcome. A bad request is answered 400 (the
SDK raises ``BadRequestError``) or 404 for an unknown id (``NotFoundError``), as one line of
text naming the fix; a request that fails while it runs comes back from ``retrieve_future`` as
a ``RequestFailedResponse`` (the SDK raises ``RequestFailedError``).
"""

from __future__ import annotations

from aiohttp import web

from asyncgrpo.config.tinker import TinkerConfig
from asyncgrpo.tinker import checkpoint_routes, routes, sampling_routes
from asyncgrpo.tinker.front import track
from asyncgrpo.tinker.http import CONFIG, SERVICE, guard
from asyncgrpo.tinker.service import TinkerService

__all__ = ["build_app"]


def build_app(config: TinkerConfig, service: TinkerService) -> web.Application:
    app = web.Application(middlewares=[track, guard], client_max_size=config.max_body_bytes)
    app[CONFIG], app[SERVICE] = config, service
    api = "/api/v1"
    app.router.add_get(f"{api}/healthz", routes.healthz)
    app.router.add_get(f"{api}/get_server_capabilities", routes.capabilities)
    app.router.add_get(f"{api}/samplers/{{sampler_id}}", sampling_routes.get_sampler)
    for path, handler in (
        ("client/config", routes.client_config),
        ("client/dynamic_config", routes.dynamic_config),
        ("create_session", routes.create_session),
        ("session_heartbeat", routes.heartbeat),
        ("sessions/{session_id}/finish", routes.finish_session),
        ("telemetry", routes.telemetry),
        ("create_model", routes.create_model),
        ("get_info", routes.get_info),
        ("forward_backward", routes.forward_backward),
        ("optim_step", routes.optim_step),
        ("retrieve_future", routes.retrieve_future),
        ("save_weights", routes.save_weights),
        ("load_weights", routes.load_weights),
        ("save_weights_for_sampler", sampling_routes.save_weights_for_sampler),
        ("create_sampling_session", sampling_routes.create_sampling_session),
        ("asample", sampling_routes.asample),
    ):
        app.router.add_post(f"{api}/{path}", handler)
    checkpoint_routes.add_routes(app, api)
    return app
