"""The broker's HTTP API (FastAPI; OpenAPI at ``/openapi.json``, docs at ``/docs``).

``build_app(store, config)`` returns the app that ``fleet up`` serves with uvicorn, with the web
dashboard under ``/ui`` (``broker.dashboard``: its pages hold no data). Every route
needs a bearer token (``broker.auth``): a team sees only its own jobs (others' are 404), an admin
sees all, an agent may only post heartbeats and rendezvous visits and read its own job's files
and secrets. Bad input is a 4xx whose body names each field.
"""

# No `from __future__ import annotations`: FastAPI resolves the local Annotated aliases.

import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

import redis
from fastapi import Depends, FastAPI, Header, Path, Query, Request, Security
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from broker import __version__, errors, metrics
from broker.auth import ApiConfig, Principal, Role, is_attempt_shaped
from broker.costs import cost_report, job_cost
from broker.dashboard import mount_ui, router
from broker.errors import (
    Conflict,
    Forbidden,
    InvalidInput,
    NotFound,
    PayloadTooLarge,
    Unauthenticated,
    Unavailable,
    UnsupportedMedia,
)
from broker.files import MAX_BLOB_BYTES, BlobStore
from broker.models import MAX_NOTE_CHARS, MAX_NOTES, JobRecord, JobState
from broker.preview import placement_preview
from broker.protocol import (
    HEARTBEAT_PATH,
    JOB_ID,
    RENDEZVOUS_PATH,
    SECRETS_PATH,
    Action,
    BrokerEnv,
    Env,
    Heartbeat,
    HeartbeatReply,
    Rendezvous,
    RendezvousReply,
    SecretsReply,
    SecretsRequest,
    agent_action,
)
from broker.sealed import Sealer, SealError
from broker.spec import (
    FORMAT_SKYPILOT,
    LAUNCH_MEDIA,
    MAX_SPEC_BYTES,
    LaunchEnv,
    ParsedSpec,
    Problem,
    SpecError,
    apply_overrides,
    load_json,
    parse_spec_text,
    preview,
)
from broker.store import Store
from broker.waiting import (
    NOT_YET_SEEN,
    WAITING_STATES,
    QueuePlace,
    never_runs,
    queue_positions,
)
from policies.models import BLOB_PREFIX, REMOTE_SCHEMES, JobSpec, Market, Pool

SPEC_MEDIA = ("application/yaml", "application/x-yaml", "text/yaml", "text/plain",
              "application/json", LAUNCH_MEDIA)
STREAM_ID_PART_MAX = 2**64 - 1  # Redis stream ids are <ms>-<seq>, each an unsigned 64-bit number


def _error_body(status: int, message: str, problems: list[Problem]) -> dict[str, Any]:
    return {"error": {"status": status, "message": message,
                      "problems": [p.model_dump() for p in problems]}}


class ErrorDetail(BaseModel):
    status: int = Field(description="the HTTP status again")
    message: str = Field(description="what went wrong and how to fix it")
    problems: list[Problem] = Field(description="for bad input: one entry per field at fault")


class ErrorBody(BaseModel):
    """Every 4xx and 5xx answer of the API (docs/api-errors.md)."""

    error: ErrorDetail


_ERROR_WHY = {
    401: "no bearer token, or one the broker does not know",
    403: "the token's role or team may not do this",
    404: "no such job, team or region visible to this token",
    409: "the job is not in a state that allows this",
    413: "the request body is over the broker's limit (api.max_body_bytes), or an upload "
         "over the team's quota of kept packs (api.blob_quota_bytes)",
    415: "the body's content type is not a job spec",
    422: "invalid input: one problem per field, with the limit or the fix",
    503: "the broker's state store (Redis) is unavailable",
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of a route's error statuses (all share ``ErrorBody``)."""
    out: dict[int | str, dict[str, Any]] = {
        s: {"model": ErrorBody, "description": _ERROR_WHY[s]} for s in statuses}
    if 401 in out:
        out[401]["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"},
                                                    "description": "Bearer"}}
    return out


# Error statuses of most routes: every one needs a token (401, 403) and Redis (503); a POST
# has a body to be too big.
_READ = _errors(401, 403, 404, 422, 503)
_POST = _errors(401, 403, 404, 413, 422, 503)


def _stream_id(since: str) -> str:
    """``since`` is "0" or an id "<ms>-<seq>" that Redis can start a range after."""
    if since != "0":
        ms, seq = (int(x) for x in since.split("-"))
        if ms > STREAM_ID_PART_MAX or seq > STREAM_ID_PART_MAX or \
                ms == seq == STREAM_ID_PART_MAX:
            raise ValueError(f"each part of a stream id is at most {STREAM_ID_PART_MAX} (and "
                             "the last possible id has nothing after it); pass the 'next' of "
                             "the previous answer")
    return since


class _BoundedJsonRequest(Request):
    """A request whose JSON body is read within the spec's shape limits (depth, values): a
    body nested a thousand levels deep is a 422 naming it, not a RecursionError."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = load_json(await self.body(), "body")
            except SpecError as exc:
                # FastAPI's body parsing lets only HTTPExceptions through as they are (anything
                # else becomes a bare 400): the error travels inside one to the one handler
                raise _Carried(InvalidInput("invalid request body", exc.problems)) from None
        return self._json


class _Carried(StarletteHTTPException):
    """A FleetError raised where only an HTTPException reaches the handler unchanged."""

    def __init__(self, error: errors.FleetError) -> None:
        super().__init__(error.status, error.message)
        self.error = error


class _BoundedJsonRoute(APIRoute):
    def get_route_handler(self) -> Any:
        handler = super().get_route_handler()

        async def bounded(request: Request) -> Response:
            return await handler(_BoundedJsonRequest(request.scope, request.receive))

        return bounded


class PreemptRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    region: str = Field(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9:_.-]*$",
                        description="a spot pool's region, or cloud:region")
    duration_s: float = Field(default=60.0, gt=0, le=86_400,
                              description="how long the region stays reclaimed")


class NodeChaosRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job_id: str = Field(min_length=1, max_length=128)
    rank: int = Field(default=0, ge=0, le=4096, description="the node's rank in the job")
    how: Literal["reclaim", "kill"] = Field(
        default="reclaim", description="reclaim: a spot notice, then the grace period; kill: "
        "the machine dies at once")


def job_view(job: JobRecord, place: QueuePlace | None = None) -> dict[str, Any]:
    """A job as the API shows it: the record (its secrets' names, never their sealed values)
    plus its name, progress and, while it waits, why and its place in the queue of its
    accelerators."""
    view = {**job.model_dump(mode="json", exclude={"sealed_secrets"}), "name": job.name,
            "progress": job.progress,
            "queue_position": None if place is None else {"position": place.position,
                                                          "of": place.of}}
    if job.state is JobState.QUEUED and not job.reason:
        view["reason"] = NOT_YET_SEEN
    return view


class LaunchBody(BaseModel):
    """A submission with values given at launch (``fleet launch --env K=V --secret K``): the
    secrets are sealed into the job, never stored or shown in clear."""

    model_config = ConfigDict(extra="forbid")

    spec: str = Field(max_length=MAX_SPEC_BYTES, description="the job spec: YAML or JSON text")
    envs: dict[str, str] = Field(default_factory=dict, max_length=256)
    secrets: dict[str, SecretStr] = Field(default_factory=dict, max_length=256)


# Every token goes in the Authorization header. Each auth dependency below names the roles it
# lets through as this scheme's "scopes", so the OpenAPI document says who may call each
# operation (OpenAPI 3.1: role names for a non-OAuth scheme); an operation without it is public.
BEARER = HTTPBearer(auto_error=False, scheme_name="bearer",
                    description="a team's, the admin's, an agent's (or a job attempt's) or a "
                                "metrics token (docs/security.md)")


def Documented(*roles: Role) -> Any:
    """A dependency parameter that documents ``roles`` as the operation's security; the
    dependency it is on still checks them (auto_error off: it never answers by itself)."""
    return Annotated[HTTPAuthorizationCredentials | None,
                     Security(BEARER, scopes=[r.value for r in roles])]


def resize_owed(job: JobRecord | None, attempt: int, world_size: int) -> int | None:
    """The workers a running attempt's node owes since the broker resized it in place
    (``transitions.resized_in_place``), while rank 0 still reports another world size."""
    if job is None or job.state is not JobState.RUNNING or job.attempt != attempt:
        return None
    return job.resized_to if job.resized_to not in (None, world_size) else None


def build_app(store: Store, config: ApiConfig, *,
              ceiling: Callable[[], Sequence[Pool]] | None = None, sealer: Sealer | None = None,
              blobs: BlobStore | None = None) -> FastAPI:
    """The API over ``store`` with ``config``'s tokens and limits. ``ceiling``: the fleet's
    pools at their most (``FleetProvider.ceiling``); a submission that can never run on them
    is refused (none: nothing is refused for that reason). ``sealer`` seals the jobs' secrets
    (none: a job with secrets is refused); ``blobs`` keeps the packed workdirs and local file
    mounts (none: a job with them is refused)."""
    scrape, warm_metrics = metrics.registry(store)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await run_in_threadpool(warm_metrics)  # before it serves: the first scrape is cheap
        yield

    app = FastAPI(title="FleetBroker", version=__version__, lifespan=lifespan,
                  description="Submit and follow elastic training jobs across clouds. Errors: "
                              "docs/api-errors.md.")
    app.router.route_class = _BoundedJsonRoute
    _install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes,
                       wider={"/v1/blobs": MAX_BLOB_BYTES})

    # The auth dependencies are async: pure CPU, so no worker-thread hop per request.
    def bearer(authorization: str | None) -> str | None:
        scheme, _, token = (authorization or "").partition(" ")
        return token.strip() if scheme.lower() == "bearer" else None

    def unauthenticated(authorization: str | None) -> Unauthenticated:
        why = "missing bearer token" if not authorization else "invalid token"
        return Unauthenticated(f"{why}: send 'Authorization: Bearer TOKEN' (fleet uses "
                        f"{BrokerEnv.TOKEN} or ~/.config/fleet/config.yaml)",
                        headers={"WWW-Authenticate": "Bearer"})

    async def principal(authorization: Annotated[str | None, Header()] = None) -> Principal:
        who = config.authenticate(bearer(authorization))
        if who is None:
            raise unauthenticated(authorization)
        return who

    async def user(who: Annotated[Principal, Depends(principal)],
                   _: Documented(Role.ADMIN, Role.TEAM)) -> Principal:
        if who.role is Role.AGENT:
            raise Forbidden("an agent token may only post heartbeats and rendezvous visits")
        if who.role is Role.METRICS:
            raise Forbidden("a metrics token may only read /metrics")
        return who

    async def scraper(who: Annotated[Principal, Depends(principal)],
                      _: Documented(Role.ADMIN, Role.METRICS)) -> Principal:
        if who.role not in (Role.ADMIN, Role.METRICS):
            raise Forbidden("/metrics needs the admin token or a metrics token "
                            f"({BrokerEnv.METRICS_TOKEN}, or api.tokens: {{metrics: true, ...}})")
        return who

    async def admin(who: Annotated[Principal, Depends(principal)],
                    _: Documented(Role.ADMIN)) -> Principal:
        if who.role is not Role.ADMIN:
            raise Forbidden("this needs an admin token")
        return who

    def agent_caller(*roles: Role, refused: str = "agent endpoints need the job attempt's "
                     "agent token") -> Callable[..., Any]:
        """The dependency of an agent endpoint that also takes the tokens of ``roles``."""

        async def reporter(_: Documented(*roles),
                           authorization: Annotated[str | None, Header()] = None,
                           ) -> tuple[str, Principal | None]:
            """An agent endpoint's caller: a token of ``roles`` (the fleet's agent or admin
            token: operators), or what may be an attempt token (checked against the body's job
            and attempt by ``for_attempt``), which is all a launched agent holds: a job's code
            cannot report for, stop or complete another job."""
            token = bearer(authorization)
            who = config.authenticate(token)
            if who is not None and who.role not in roles:
                raise Forbidden(refused)
            if token is None or (who is None and not is_attempt_shaped(token)):
                raise unauthenticated(authorization)
            return token, who

        return reporter

    def for_attempt(caller: tuple[str, Principal | None], job_id: str, attempt: int) -> None:
        token, who = caller
        if who is None and not config.is_attempt(token, job_id, attempt):
            raise Forbidden("agent endpoints need the job attempt's agent token; this one "
                           "is for another job or attempt")

    Reporter = Annotated[tuple[str, Principal | None],
                         Depends(agent_caller(Role.AGENT, Role.ADMIN))]
    # A job's secrets go to its attempt's agent (or the agent key, which derives every attempt
    # token), never to an admin token: no API answer holds them for a person.
    SecretsReader = Annotated[tuple[str, Principal | None], Depends(agent_caller(
        Role.AGENT, refused="a job's secrets go only to the job attempt's agent token"))]
    checkpoints = metrics.CheckpointReports()

    User = Annotated[Principal, Depends(user)]
    JobId = Annotated[str, Path(pattern=JOB_ID, max_length=81)]

    def visible_job(job_id: str, who: Principal) -> JobRecord:
        job = store.get_job(job_id)
        if job is None or not who.can_see(job.team):
            raise NotFound(f"no job {job_id!r} (fleet jobs lists yours)")
        return job

    def visible_team(who: Principal, team: str | None) -> str | None:
        """A team token sees its own team's jobs; an admin any team's, or all (None)."""
        if who.role is not Role.ADMIN:
            if team is not None and team != who.team:
                raise NotFound(f"no team {team!r} visible to this token")
            return who.team
        return team

    def visible_jobs(who: Principal, team: str | None,
                     states: list[JobState] | None) -> list[JobRecord]:
        return store.list_jobs(team=visible_team(who, team), states=states)

    def queue() -> dict[str, QueuePlace]:
        return queue_positions(store.list_jobs(states=list(WAITING_STATES)))

    def used_gpus() -> dict[str, int]:
        used: dict[str, int] = {}
        for job in store.list_jobs(states=[s for s in JobState if s.holds_gpus]):
            if job.pool:
                used[job.pool] = used.get(job.pool, 0) + job.gpus
        return used

    def admit(parsed: ParsedSpec, spec: JobSpec) -> list[Problem]:
        if ceiling is None:
            return []
        return never_runs(spec, ceiling(), skypilot=parsed.format == FORMAT_SKYPILOT)

    @app.get("/healthz", tags=["meta"], summary="Liveness (no token needed)")
    def healthz() -> dict[str, str]:
        return {"status": "ok", "version": __version__}

    @app.get("/readyz", tags=["meta"], summary="Readiness: Redis answers and a leader holds "
             "the lease (no token needed)",
             responses={503: {"model": ErrorBody, "description": "not ready, and why"}})
    def readyz() -> JSONResponse:
        ready, reason, leader = readiness(store)
        if not ready:
            return JSONResponse(_error_body(503, f"not ready: {reason}", []), status_code=503)
        return JSONResponse({"status": "ready", "version": __version__, "leader_fence": leader})

    @app.get("/metrics", tags=["meta"], response_class=Response,
             summary="Prometheus metrics (admin or metrics token)",
             responses={200: {"description": "the Prometheus text format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}},
                        **_errors(401, 403, 422, 503)})
    def prometheus(who: Annotated[Principal, Depends(scraper)]) -> Response:
        return Response(generate_latest(scrape), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/jobs", status_code=201, tags=["jobs"], summary="Submit a job",
              responses=_errors(401, 403, 413, 415, 422, 503),
              openapi_extra={"requestBody": {"required": True, "content": {
                  m: {"schema": {"type": "string"} if m not in ("application/json", LAUNCH_MEDIA)
                      else LaunchBody.model_json_schema() if m == LAUNCH_MEDIA
                      else {"type": "object"}}
                  for m in SPEC_MEDIA}}})
    async def submit(
        request: Request, who: User,
        gpus: Annotated[str | None, Query(max_length=16, description="N or MIN:MAX")] = None,
        spot: Annotated[str | None, Query(max_length=16,
                                          description="never|allowed|preferred")] = None,
        idempotency_key: Annotated[str | None, Header(max_length=128,
                                                      pattern=r"^[\x21-\x7e]+$")] = None,
        note: Annotated[list[Annotated[str, Field(max_length=MAX_NOTE_CHARS)]] | None, Query(
            max_length=MAX_NOTES, description="notes of a translation the client made (fleet "
            "launch sends a SkyPilot task's), kept on the job with the body's own")] = None,
    ) -> dict[str, Any]:
        """Body: the job spec as YAML (own format or SkyPilot task) or JSON. A retry with the
        same ``Idempotency-Key`` returns the first job instead of a second one."""
        body = await _read_spec_body(request)
        # in a worker thread: a big spec never holds up the event loop
        parsed, spec = await run_in_threadpool(_parse_submission, body, gpus, spot,
                                               _is_launch(request))
        if never := admit(parsed, spec):
            raise InvalidInput("the job can never run on this fleet", never)
        team = _submit_team(spec, who)
        if spec.team != team:
            spec = spec.model_copy(update={"team": team})
        _check_files(spec, team, blobs)
        sealed = None
        if parsed.secrets:
            if sealer is None:
                raise InvalidInput("this broker keeps no secrets key, so it takes no secrets; "
                                   "start it with a state dir (fleet up) or "
                                   f"{BrokerEnv.SECRETS_KEY}")
            sealed = sealer.seal({k: v.get_secret_value() for k, v in parsed.secrets.items()})
        job = await run_in_threadpool(store.submit, spec, team=team,
                                      request_key=idempotency_key,
                                      notes=[*(note or []), *parsed.warnings],
                                      sealed_secrets=sealed)
        return {"job": job_view(job), "format": parsed.format, "warnings": parsed.warnings}

    @app.post("/v1/blobs", status_code=201, tags=["jobs"], responses=_POST,
              summary="Keep a packed workdir or local file mount (tar.gz) for a launch",
              openapi_extra={"requestBody": {"required": True, "content": {
                  # a gzip stream is at least its 18-byte header and trailer
                  "application/octet-stream": {"schema": {"type": "string", "format": "binary",
                                                          "minLength": 18}}}}})
    async def put_blob(request: Request, who: User) -> dict[str, Any]:
        """Body: the tar.gz ``fleet launch`` packs; returns its ``ref`` for the spec. It counts
        towards the team's quota of kept packs (``api.blob_quota_bytes``)."""
        if blobs is None:
            raise InvalidInput("this broker keeps no files; launch without workdir and local "
                           "file_mounts, or start it with a state dir (fleet up)")
        upload = await run_in_threadpool(blobs.upload, who.team)
        try:
            # chunk by chunk to disk: a 100 MB pack never sits in memory (BodyLimit still
            # stops the stream at the per-request limit)
            async for chunk in request.stream():
                if chunk:
                    await run_in_threadpool(upload.write, chunk)
            ref = await run_in_threadpool(upload.commit)
        finally:
            await run_in_threadpool(upload.abort)
        return {"ref": ref, "bytes": upload.size}

    @app.get("/v1/agent/blobs/{digest}", tags=["agent"], responses=_READ,
             response_class=FileResponse,
             summary="A pack of the job's files, for the job's own agent")
    def get_blob(digest: Annotated[str, Path(pattern=r"^[0-9a-f]{64}$")],
                 job_id: Annotated[str, Query(pattern=JOB_ID)],
                 attempt: Annotated[int, Query(ge=0, le=10**9)],
                 caller: Reporter) -> FileResponse:
        for_attempt(caller, job_id, attempt)
        job = store.get_job(job_id)
        ref = BLOB_PREFIX + digest
        if job is None or ref not in {job.spec.workdir, *(m.source for m in
                                                          job.spec.file_mounts)}:
            raise NotFound(f"job {job_id!r} has no file {ref}")
        path = blobs.path(digest, job.team) if blobs is not None else None
        if path is None:
            raise NotFound(f"{ref} is not kept here; launch the job again")
        return FileResponse(path, media_type="application/gzip")

    @app.get("/v1/jobs", tags=["jobs"], summary="List jobs (yours; an admin sees all)",
             responses=_READ)
    def list_jobs(
        who: User,
        state: Annotated[list[JobState] | None, Query()] = None,
        team: Annotated[str | None, Query(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$")] = None,
        limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
    ) -> dict[str, Any]:
        jobs = visible_jobs(who, team, state)
        shown = jobs[-min(limit, config.max_list):]
        places = queue()
        return {"jobs": [job_view(j, places.get(j.id)) for j in shown], "total": len(jobs)}

    @app.post("/v1/jobs/preview", tags=["jobs"], responses=_errors(401, 403, 413, 415, 422, 503),
              summary="What a job would get (nothing is submitted): its translation, whether "
              "it can ever run, and the pools it may use with price and cost per hour",
              openapi_extra={"requestBody": {"required": True, "content": {
                  m: {"schema": {"type": "string" if m != "application/json" else "object"}}
                  for m in SPEC_MEDIA}}})
    async def preview_job(
        request: Request, who: User,
        gpus: Annotated[str | None, Query(max_length=16, description="N or MIN:MAX")] = None,
        spot: Annotated[str | None, Query(max_length=16,
                                          description="never|allowed|preferred")] = None,
    ) -> dict[str, Any]:
        """Body: a job spec, as for submitting one."""
        body = await _read_spec_body(request)
        parsed, spec = await run_in_threadpool(_parse_submission, body, gpus, spot)
        never = admit(parsed, spec)
        return {"spec": spec.model_dump(mode="json"), "format": parsed.format,
                "warnings": parsed.warnings,
                "never_runs": [p.model_dump() for p in never],
                "pools": [] if never else placement_preview(spec, store.pools(), used_gpus())}

    @app.get("/v1/jobs/{job_id}", tags=["jobs"], summary="One job with its placements and cost",
             responses=_READ)
    def get_job(job_id: JobId, who: User) -> dict[str, Any]:
        job = visible_job(job_id, who)
        placements = store.placements(job_id)
        total = job_cost(placements)
        return {"job": job_view(job, queue().get(job.id)),
                "placements": [{**p.model_dump(mode="json"), "gpu_hours": p.gpu_hours,
                                "cost": p.cost} for p in placements],
                "gpu_hours": total.gpu_hours, "cost": total.cost_usd,
                "ondemand_cost": total.ondemand_cost_usd}

    @app.post("/v1/jobs/{job_id}/cancel", tags=["jobs"], summary="Cancel a job",
              responses=_POST)
    def cancel(job_id: JobId, who: User) -> dict[str, Any]:
        """``finished``: the job had already ended (completed, failed, cancelled, dropped)
        before this call, which then changed nothing."""
        before = visible_job(job_id, who)
        job = store.request_cancel(job_id)
        return {"job": job_view(job), "finished": before.state.terminal}

    @app.get("/v1/jobs/{job_id}/logs", tags=["jobs"], summary="Log lines from an offset",
             responses=_READ)
    def logs(job_id: JobId, who: User,
             offset: Annotated[int, Query(ge=0, le=10**12)] = 0,
             limit: Annotated[int, Query(ge=1, le=10_000)] = 1000) -> dict[str, Any]:
        job = visible_job(job_id, who)
        lines, next_offset = store.read_logs(job_id, offset, limit)
        return {"lines": lines, "next_offset": next_offset, "state": job.state.value,
                "terminal": job.state.terminal}

    @app.get("/v1/capacity", tags=["fleet"], summary="Pools: capacity, GPUs in use, prices",
             responses=_errors(401, 403, 422, 503))
    def capacity(who: User) -> dict[str, Any]:
        used = used_gpus()
        pools = []
        for pool in sorted(store.pools(), key=lambda p: p.id):
            busy = used.get(pool.id, 0)
            pools.append({**pool.model_dump(mode="json"), "id": pool.id,
                          "capacity": pool.capacity, "used": busy,
                          "free": max(0, pool.capacity - busy)})
        return {"pools": pools,
                "total": {"capacity": sum(p["capacity"] for p in pools),
                          "used": sum(p["used"] for p in pools)}}

    @app.get("/v1/costs", tags=["fleet"],
             summary="Cost per job and per team across recoveries, and the saving vs on-demand",
             responses=_READ)
    def costs(
        who: User,
        team: Annotated[str | None, Query(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$")] = None,
        state: Annotated[list[JobState] | None, Query()] = None,
        limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
    ) -> dict[str, Any]:
        jobs = visible_jobs(who, team, state)
        # rows: the newest, as GET /v1/jobs; the team sums and the total: every visible job
        report = cost_report(jobs, store.placements_of([j.id for j in jobs]),
                             rows=min(limit, config.max_list))
        return {**report, "jobs_total": len(jobs)}

    @app.get("/v1/events", tags=["fleet"], summary="Events after a stream id, oldest first",
             responses=_READ)
    def events(who: User,
               since: Annotated[str, Query(pattern=r"^(0|[0-9]{1,20}-[0-9]{1,20})$",
                                           description="a stream id '<ms>-<seq>' (each part "
                                           "at most 2^64-1), or 0 for the oldest"),
                                AfterValidator(_stream_id)] = "0",
               job_id: Annotated[str | None, Query(pattern=JOB_ID)] = None,
               limit: Annotated[int, Query(ge=1, le=10_000)] = 100) -> dict[str, Any]:
        if job_id is not None:
            visible_job(job_id, who)
            found = store.events(since=since, job_id=job_id, limit=limit)
            last = found[-1].id if found else since
        else:
            found, last = _team_events(store, who, since, limit)
        return {"events": [e.model_dump(mode="json") for e in found], "next": last}

    @app.post(HEARTBEAT_PATH, tags=["agent"], response_model=HeartbeatReply,
              responses=_POST,
              summary="An agent's progress report; the reply tells it to go on or stop")
    def heartbeat(beat: Heartbeat, caller: Reporter) -> HeartbeatReply:
        for_attempt(caller, beat.job_id, beat.attempt)
        report = beat.model_dump(exclude={"checkpoint_seconds"})
        if not report["samples_per_sec"]:
            report["samples_per_sec"] = None  # 0 = not measured yet, not a real throughput
        said = store.record_heartbeat(**report)
        if beat.node_rank == 0:  # rank 0 reports the job's checkpoint (store.record_heartbeat)
            checkpoints.observe(beat.job_id, beat.attempt, beat.checkpoint_step,
                                beat.checkpoint_bytes, beat.checkpoint_seconds)
        action, nproc = agent_action(said.action), None
        if action is None and beat.node_rank == 0 and beat.world_size is not None:
            nproc = resize_owed(store.get_job(beat.job_id), beat.attempt, beat.world_size)
            action = None if nproc is None else Action.RESIZE
        return HeartbeatReply(action=action, round=said.round, brokers=store.broker_urls(),
                              nproc=nproc)

    @app.post(RENDEZVOUS_PATH, tags=["agent"], response_model=RendezvousReply,
              responses=_POST,
              summary="A multi-node job's rendezvous: every node checks in (rank 0 with the "
                      "master's address) and polls until its whole round has")
    def rendezvous(visit: Rendezvous, caller: Reporter) -> RendezvousReply:
        for_attempt(caller, visit.job_id, visit.attempt)
        got = store.rendezvous(visit.job_id, visit.attempt, visit.round, visit.node_rank,
                               visit.addr, visit.launch_key)
        return RendezvousReply(**{**got, "action": agent_action(got["action"])})

    @app.post(SECRETS_PATH, tags=["agent"], response_model=SecretsReply,
              responses=_errors(401, 403, 404, 409, 413, 422, 503),
              summary="The job's secrets, for its current attempt's agent on a node whose start "
                      f"script names them only ({Env.SECRET_ENVS})")
    def agent_secrets(ask: SecretsRequest, caller: SecretsReader) -> SecretsReply:
        for_attempt(caller, ask.job_id, ask.attempt)
        job = store.get_job(ask.job_id)
        if job is None:
            raise NotFound(f"no job {ask.job_id!r}")
        if job.attempt != ask.attempt:
            raise Conflict(f"attempt {ask.attempt} is not job {job.id}'s current attempt "
                           f"({job.attempt}); its secrets go to that attempt's agent only")
        if job.state not in (JobState.LAUNCHING, JobState.RUNNING):
            raise Conflict(f"job {job.id} is {job.state.value}, not launching or running: its "
                           "secrets go only to an attempt that launches or runs")
        if not job.sealed_secrets:
            return SecretsReply(secrets={})
        if sealer is None:  # another replica may hold the key: the agent tries the next
            raise Unavailable("this broker keeps no secrets key, so it cannot open the job's "
                              f"secrets; give every replica the same {BrokerEnv.SECRETS_KEY}")
        try:
            return SecretsReply(secrets=sealer.open(job.sealed_secrets))  # registered: scrubbed
        except SealError as exc:
            raise Unavailable(str(exc)) from None

    @app.post("/v1/chaos/preempt", status_code=202, tags=["chaos"], responses=_POST,
              summary="Reclaim every spot node in a region (admin)")
    def chaos_preempt(req: PreemptRequest,
                      who: Annotated[Principal, Depends(admin)]) -> dict[str, Any]:
        spot = [p for p in store.pools() if p.market is Market.SPOT]
        hits = [p for p in spot if req.region in (p.region, f"{p.cloud}:{p.region}")]
        if not hits:
            known = sorted({f"{p.cloud}:{p.region}" for p in spot}) or ["none"]
            raise NotFound(f"no spot pool in region {req.region!r}; spot regions: "
                           + ", ".join(known))
        store.request_preempt(hits[0].region, duration_s=req.duration_s)
        return {"accepted": True, "region": hits[0].region,
                "pools": sorted(p.id for p in hits), "duration_s": req.duration_s}

    @app.post("/v1/chaos/node", status_code=202, tags=["chaos"],
              responses=_errors(401, 403, 404, 409, 413, 422, 503),
              summary="Reclaim or kill one node of a running job (admin)")
    def chaos_node(req: NodeChaosRequest,
                   who: Annotated[Principal, Depends(admin)]) -> dict[str, Any]:
        job = store.get_job(req.job_id)
        if job is None:
            raise NotFound(f"no job {req.job_id!r}")
        if job.state is not JobState.RUNNING or req.rank >= job.nodes:
            raise Conflict(f"job {job.id} is {job.state.value} on {job.nodes} node(s): "
                           f"rank {req.rank} is not a running node of it")
        store.request_command("node", job_id=job.id, rank=req.rank, how=req.how)
        return {"accepted": True, "job_id": job.id, "rank": req.rank, "how": req.how}

    app.include_router(router(store, user, visible_team, visible_jobs, _READ))
    mount_ui(app)
    return app


def readiness(store: Store) -> tuple[bool, str, int | None]:
    """Whether this replica can serve: Redis answers and the leader lease is known (some
    replica holds it). Returns (ready, why not, the leader's fence)."""
    try:
        leader = store.leader()
    except redis.RedisError as exc:
        return False, f"redis does not answer ({type(exc).__name__})", None
    if leader is None:
        return False, "no broker replica holds the leader lease yet", None
    return True, "", leader[0]


def _check_files(spec: JobSpec, team: str, blobs: BlobStore | None) -> None:
    """A submitted spec's workdir and file mounts: packed and kept here, or remote."""
    problems = []
    for field, source in [("workdir", spec.workdir),
                          *((f"file_mounts.{m.path}", m.source) for m in spec.file_mounts)]:
        if source is None:
            continue
        if not source.startswith(BLOB_PREFIX) and (field == "workdir" or not source.startswith(
                REMOTE_SCHEMES)):
            problems.append(Problem(field=field, value=preview(source), message=(
                "a local path the broker cannot read: submit with `fleet launch`, which packs "
                "it and uploads it (POST /v1/blobs), and give the ref it returns")))
        elif source.startswith(BLOB_PREFIX) and (
                blobs is None or blobs.path(source.removeprefix(BLOB_PREFIX), team) is None):
            problems.append(Problem(field=field, value=source, message=(
                "not kept by this broker; upload it first (POST /v1/blobs)")))
    if problems:
        raise SpecError(problems)


def _is_launch(request: Request) -> bool:
    return request.headers.get("content-type", "").split(";")[0].strip().lower() == LAUNCH_MEDIA


def _parse_submission(body: bytes, gpus: str | None, spot: str | None,
                      launch: bool = False) -> tuple[ParsedSpec, JobSpec]:
    """A submitted body's parsed spec (with the values given at launch, for a ``LaunchBody``)
    and the spec with the query's overrides applied."""
    if launch:
        try:
            got = LaunchBody.model_validate(load_json(body, "(body)"))
        except json.JSONDecodeError as exc:
            raise SpecError([Problem(field="(body)", message=(
                f"not JSON ({exc.msg}); a launch is a JSON object {{spec, envs, secrets}}"))]
                            ) from None
        except ValidationError as exc:  # never the input: it may hold a secret
            raise SpecError([Problem(field=".".join(map(str, e["loc"])) or "(body)",
                                     message=e["msg"]) for e in exc.errors()]) from None
        parsed = parse_spec_text(got.spec, launch=LaunchEnv(envs=got.envs, secrets=got.secrets))
    else:
        parsed = parse_spec_text(body)
    spec = parsed.spec
    if gpus is not None or spot is not None:
        spec = apply_overrides(spec, gpus=gpus, spot=spot)
    return parsed, spec


def _submit_team(spec: JobSpec, who: Principal) -> str:
    """A team token submits for its own team; ``team:`` in the spec must then agree."""
    if who.role is Role.ADMIN:
        return spec.team
    assert who.team is not None  # team grants always carry a team
    if spec.team not in ("default", who.team):
        raise Forbidden(f"this token belongs to team {who.team!r}, the spec says team "
                       f"{spec.team!r}; remove team: or use that team's token",
                       [Problem(field="team", value=repr(spec.team),
                                message=f"must be {who.team!r} for this token")])
    return who.team


def _team_events(store: Store, who: Principal, since: str,
                 limit: int) -> tuple[list[Any], str]:
    """The global stream, filtered to events of jobs the caller may see (and fleet events)."""
    if who.role is Role.ADMIN:
        found = store.events(since=since, limit=limit)
        return found, found[-1].id if found else since
    own = {j.id for j in store.list_jobs(team=who.team)}
    out: list[Any] = []
    cursor = since
    for _ in range(20):  # bounded scan: at most 20 pages per request
        page = store.events(since=cursor, limit=max(limit, 200))
        if not page:
            break
        for event in page:
            cursor = event.id
            if event.job_id is None or event.job_id in own:
                out.append(event)
                if len(out) == limit:
                    return out, cursor
    return out, cursor


async def _read_spec_body(request: Request) -> bytes:
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media and media not in SPEC_MEDIA:
        raise UnsupportedMedia(f"content type {media!r} is not a job spec; send "
                       + ", ".join(SPEC_MEDIA))
    return await request.body()


class BodyLimit:
    """ASGI middleware: refuse request bodies over ``limit`` bytes (declared or streamed) with
    413 on every route, before anything parses them (auth runs after FastAPI reads a body)."""

    def __init__(self, app: ASGIApp, limit: int, wider: dict[str, int] | None = None) -> None:
        self.app = app
        self.limit = limit
        self.wider = wider or {}  # a path's own, larger limit (uploads of packed files)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.wider.get(scope.get("path", ""), self.limit)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            response = JSONResponse(self._error(limit), status_code=PayloadTooLarge.status)
            await response(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # a chunked upload: stop reading at the limit
                    # an HTTPException: FastAPI passes those through its body parsing as
                    # they are (anything else there becomes a 400)
                    raise StarletteHTTPException(PayloadTooLarge.status,
                                                 self._error(limit)["error"]["message"])
            return message

        await self.app(scope, limited, send)

    @staticmethod
    def _error(limit: int) -> dict[str, Any]:
        return _error_body(PayloadTooLarge.status,
                           f"request body is over the {limit}-byte limit", [])


def _install_error_handlers(app: FastAPI) -> None:
    """One handler answers every error: a FleetError (``broker.errors`` gives its status), or
    what FastAPI, Starlette or Redis raise, first made into one."""

    async def fleet_error(request: Request, exc: Exception) -> JSONResponse:
        err = errors.as_fleet_error(exc)
        return JSONResponse(_error_body(err.status, err.message, err.problems),
                            status_code=err.status, headers=err.headers)

    for cls in errors.handled():
        app.add_exception_handler(cls, fleet_error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc, _Carried):
            return await fleet_error(request, exc.error)
        # routing's own (an unknown path: 404, a wrong method: 405)
        return JSONResponse(_error_body(exc.status_code, str(exc.detail), []),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(redis.RedisError)
    async def store_down(request: Request, exc: redis.RedisError) -> JSONResponse:
        return await fleet_error(request, Unavailable(
            "the broker's state store (redis) is unavailable; check `fleet up`"))

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            loc = [str(x) for x in err["loc"]]
            where = ".".join(loc[1:] if loc and loc[0] in ("body", "query", "path", "header")
                             else loc) or "body"
            value = err.get("input") if err["type"] != "missing" else None
            problems.append(Problem(field=where, message=err["msg"].removeprefix(
                "Value error, "), value=None if value is None else preview(value)))
        return await fleet_error(request, InvalidInput("invalid request", problems))
