"""The broker's HTTP API (FastAPI; OpenAPI at ``/openapi.json``, docs at ``/docs``).

``build_app(store, config)`` returns the app that ``fleet up`` serves with uvicorn. Every route
needs a bearer token (``broker.auth``): a team sees only its own jobs (others' are 404), an admin
sees all, an agent may only post heartbeats and rendezvous visits. Bad input is a 4xx whose body
names each field.
"""

# No `from __future__ import annotations`: FastAPI resolves the local Annotated aliases.

import ipaddress
import math
import re
from typing import Annotated, Any, Literal

import redis
from fastapi import Depends, FastAPI, Header, HTTPException, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from broker import __version__, metrics
from broker.auth import ApiConfig, Principal, Role, is_attempt_shaped
from broker.costs import cost_report, job_cost
from broker.models import JobRecord, JobState
from broker.spec import (
    ParsedSpec,
    Problem,
    SpecError,
    apply_overrides,
    load_json,
    parse_spec_text,
    preview,
)
from broker.store import CHECKPOINT_EXIT, JobNotFound, NotDurable, Store
from policies.models import Accelerator, JobSpec, Market

JOB_ID = r"^[a-z0-9][a-z0-9_.-]{0,80}$"
# A node's idempotency key (FLEET_LAUNCH_KEY): "<job>:<fence>:<attempt>", a stand-in's with
# "~r<rank>.<round>" after it (providers.base.replacement_key).
LAUNCH_KEY = r"^[A-Za-z0-9:~._-]{1,160}$"
LAUNCH_KEY_FIELD = Field(
    default=None, max_length=160, pattern=LAUNCH_KEY,
    description="the node's FLEET_LAUNCH_KEY (letters, digits, ':', '~', '.', '-', '_'; at most "
                "160): a node the broker replaced no longer holds its rank's key and is told "
                "to stop; none (an agent from before keys) only while no rank was replaced")
DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
SPEC_MEDIA = ("application/yaml", "application/x-yaml", "text/yaml", "text/plain",
              "application/json")
STREAM_ID_PART_MAX = 2**64 - 1  # Redis stream ids are <ms>-<seq>, each an unsigned 64-bit number


class ApiError(HTTPException):
    """A 4xx with a message and, for bad input, one problem per field."""

    def __init__(self, status: int, message: str, problems: list[Problem] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(status_code=status, detail=message, headers=headers)
        self.problems = problems or []


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
    413: "the request body is over the broker's limit (api.max_body_bytes)",
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
                raise ApiError(422, "invalid request body", exc.problems) from None
        return self._json


class _BoundedJsonRoute(APIRoute):
    def get_route_handler(self) -> Any:
        handler = super().get_route_handler()

        async def bounded(request: Request) -> Response:
            return await handler(_BoundedJsonRequest(request.scope, request.receive))

        return bounded


class Heartbeat(BaseModel):
    """What a job's agent reports (rank 0 reports progress; every rank may report liveness)."""

    model_config = ConfigDict(extra="ignore")

    job_id: str = Field(pattern=JOB_ID)
    attempt: int = Field(ge=0, le=10**9)
    node_rank: int = Field(default=0, ge=0, le=4096)
    round: int = Field(default=0, ge=0, le=10**9, description="the agent's rendezvous round")
    launch_key: str | None = LAUNCH_KEY_FIELD
    state: str = Field(default="running", max_length=32)
    step: int | None = Field(default=None, ge=0, le=10**15)
    samples_done: int | None = Field(default=None, ge=0, le=10**18)
    samples_per_sec: float | None = Field(default=None, ge=0, le=1e12)
    world_size: int | None = Field(default=None, ge=1, le=4096)
    global_batch_size: int | None = Field(default=None, ge=1, le=10**7)
    checkpoint_step: int | None = Field(default=None, ge=0, le=10**15)
    # strict: a size sent as a string or a fraction is a broken agent, not something to coerce
    checkpoint_bytes: int | None = Field(
        default=None, ge=0, le=10**16, strict=True,
        description="size in bytes of the checkpoint of checkpoint_step: every rank's files and "
                    "the manifest (placement prices its egress on a move)")
    checkpoint_seconds: float | None = Field(
        default=None, ge=0, le=10**7, description="how long writing and committing the "
        "checkpoint of checkpoint_step took (fleet_checkpoint_duration_seconds)")
    grad_noise_scale: float | None = Field(
        default=None, ge=0, le=1e15, description="the gradient noise scale in samples, as the "
        "runtime measures it (per-replica and all-reduced gradients): the batch beyond which a "
        "larger one buys little progress per sample")
    accelerator: Accelerator | None = Field(
        default=None, description="the node's accelerator type (FLEET_ACCELERATOR): the "
        "throughput measured is kept per type")
    exit_code: int | None = Field(default=None, ge=-255, le=255,
                                  description="the command's exit code, in the last report")
    notice: str | None = Field(default=None, max_length=500,
                               description="the node's preemption notice, once it came")
    error: str | None = Field(default=None, max_length=500,
                              description="why the command failed, as the runtime named it "
                              "(e.g. 'checkpoint write failed: no space left on device'), in "
                              "a failed last report")

    @field_validator("samples_per_sec", "grad_noise_scale", "checkpoint_seconds")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v


class HeartbeatReply(BaseModel):
    action: str | None = Field(description="null: keep going; 'checkpoint-exit': checkpoint, "
                                           "then exit 75")
    round: int = Field(description="the job's rendezvous round; above the agent's: stop the "
                                   "workers and re-form the group in that round")


class Rendezvous(BaseModel):
    """A node's visit to its job's rendezvous: it checks in for its round (rank 0 with the
    master's address)."""

    model_config = ConfigDict(extra="ignore")

    job_id: str = Field(pattern=JOB_ID)
    attempt: int = Field(ge=0, le=10**9)
    round: int = Field(ge=0, le=10**9)
    node_rank: int = Field(ge=0, le=4096)
    addr: str | None = Field(default=None, max_length=270,
                             description="this node's 'host:port' (host: an IP address, IPv6 in "
                                         "brackets, or a DNS name; port 1-65535); rank 0's is "
                                         "the round's master and required for its check-in")
    launch_key: str | None = LAUNCH_KEY_FIELD

    @field_validator("addr")
    @classmethod
    def _host_port(cls, v: str | None) -> str | None:
        if v is not None and not _is_host_port(v):
            raise ValueError("must be host:port, e.g. 10.0.0.5:29500 or [fd00::5]:29500 (host: "
                             "an IP address or DNS name, port 1-65535)")
        return v


class RendezvousReply(BaseModel):
    round: int = Field(description="the job's current round (above the node's: move to it)")
    nnodes: int = Field(description="nodes in the job")
    master: str | None = Field(description="'host:port' rank 0 registered for that round, "
                                           "once every node checked in for it; null until then")
    action: str | None = Field(description="null: keep going; 'checkpoint-exit': exit 75")


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


def job_view(job: JobRecord) -> dict[str, Any]:
    """A job as the API shows it: the record plus its name and progress."""
    return {**job.model_dump(mode="json"), "name": job.name, "progress": job.progress}


def build_app(store: Store, config: ApiConfig) -> FastAPI:
    """The API over ``store`` with ``config``'s tokens and limits."""
    app = FastAPI(title="FleetBroker", version=__version__,
                  description="Submit and follow elastic training jobs across clouds. Errors: "
                              "docs/api-errors.md.")
    app.router.route_class = _BoundedJsonRoute
    _install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)

    # The auth dependencies are async: pure CPU, so no worker-thread hop per request.
    def bearer(authorization: str | None) -> str | None:
        scheme, _, token = (authorization or "").partition(" ")
        return token.strip() if scheme.lower() == "bearer" else None

    def unauthenticated(authorization: str | None) -> ApiError:
        why = "missing bearer token" if not authorization else "invalid token"
        return ApiError(401, f"{why}: send 'Authorization: Bearer TOKEN' (fleet uses "
                        "FLEET_TOKEN or ~/.config/fleet/config.yaml)",
                        headers={"WWW-Authenticate": "Bearer"})

    async def principal(authorization: Annotated[str | None, Header()] = None) -> Principal:
        who = config.authenticate(bearer(authorization))
        if who is None:
            raise unauthenticated(authorization)
        return who

    async def user(who: Annotated[Principal, Depends(principal)]) -> Principal:
        if who.role is Role.AGENT:
            raise ApiError(403, "an agent token may only post heartbeats and rendezvous visits")
        if who.role is Role.METRICS:
            raise ApiError(403, "a metrics token may only read /metrics")
        return who

    async def scraper(who: Annotated[Principal, Depends(principal)]) -> Principal:
        if who.role not in (Role.ADMIN, Role.METRICS):
            raise ApiError(403, "/metrics needs the admin token or a metrics token "
                           "(FLEET_METRICS_TOKEN, or api.tokens: {metrics: true, ...})")
        return who

    async def admin(who: Annotated[Principal, Depends(principal)]) -> Principal:
        if who.role is not Role.ADMIN:
            raise ApiError(403, "this needs an admin token")
        return who

    async def reporter(authorization: Annotated[str | None, Header()] = None,
                       ) -> tuple[str, Principal | None]:
        """An agent endpoint's caller: the fleet's agent or admin token (operators), or what may
        be an attempt token (checked against the body's job and attempt by ``for_attempt``),
        which is all a launched agent holds: a job's code cannot report for, stop or complete
        another job."""
        token = bearer(authorization)
        who = config.authenticate(token)
        if who is not None and who.role not in (Role.AGENT, Role.ADMIN):
            raise ApiError(403, "agent endpoints need the job attempt's agent token")
        if token is None or (who is None and not is_attempt_shaped(token)):
            raise unauthenticated(authorization)
        return token, who

    def for_attempt(caller: tuple[str, Principal | None], job_id: str, attempt: int) -> None:
        token, who = caller
        if who is None and not config.is_attempt(token, job_id, attempt):
            raise ApiError(403, "agent endpoints need the job attempt's agent token; this one "
                           "is for another job or attempt")

    Reporter = Annotated[tuple[str, Principal | None], Depends(reporter)]
    checkpoints = metrics.CheckpointReports()

    User = Annotated[Principal, Depends(user)]
    JobId = Annotated[str, Path(pattern=JOB_ID, max_length=81)]

    def visible_job(job_id: str, who: Principal) -> JobRecord:
        job = store.get_job(job_id)
        if job is None or not who.can_see(job.team):
            raise ApiError(404, f"no job {job_id!r} (fleet jobs lists yours)")
        return job

    def visible_jobs(who: Principal, team: str | None,
                     states: list[JobState] | None) -> list[JobRecord]:
        """A team token sees its own team's jobs; an admin any team's, or all."""
        if who.role is not Role.ADMIN:
            if team is not None and team != who.team:
                raise ApiError(404, f"no team {team!r} visible to this token")
            team = who.team
        return store.list_jobs(team=team, states=states)

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

    scrape = metrics.registry(store)

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
                  m: {"schema": {"type": "string" if m != "application/json" else "object"}}
                  for m in SPEC_MEDIA}}})
    async def submit(
        request: Request, who: User,
        gpus: Annotated[str | None, Query(max_length=16, description="N or MIN:MAX")] = None,
        spot: Annotated[str | None, Query(max_length=16,
                                          description="never|allowed|preferred")] = None,
        idempotency_key: Annotated[str | None, Header(max_length=128,
                                                      pattern=r"^[\x21-\x7e]+$")] = None,
    ) -> dict[str, Any]:
        """Body: the job spec as YAML (own format or SkyPilot task) or JSON. A retry with the
        same ``Idempotency-Key`` returns the first job instead of a second one."""
        body = await _read_spec_body(request)
        try:  # in a worker thread: a big spec never holds up the event loop
            parsed, spec = await run_in_threadpool(_parse_submission, body, gpus, spot)
        except SpecError as exc:
            raise ApiError(422, "invalid job spec", exc.problems) from None
        team = _submit_team(spec, who)
        if spec.team != team:
            spec = spec.model_copy(update={"team": team})
        job = await run_in_threadpool(store.submit, spec, team=team,
                                      request_key=idempotency_key)
        return {"job": job_view(job), "format": parsed.format, "warnings": parsed.warnings}

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
        return {"jobs": [job_view(j) for j in shown], "total": len(jobs)}

    @app.get("/v1/jobs/{job_id}", tags=["jobs"], summary="One job with its placements and cost",
             responses=_READ)
    def get_job(job_id: JobId, who: User) -> dict[str, Any]:
        job = visible_job(job_id, who)
        placements = store.placements(job_id)
        total = job_cost(placements)
        return {"job": job_view(job),
                "placements": [{**p.model_dump(mode="json"), "gpu_hours": p.gpu_hours,
                                "cost": p.cost} for p in placements],
                "gpu_hours": total.gpu_hours, "cost": total.cost_usd,
                "ondemand_cost": total.ondemand_cost_usd}

    @app.post("/v1/jobs/{job_id}/cancel", tags=["jobs"], summary="Cancel a job",
              responses=_POST)
    def cancel(job_id: JobId, who: User) -> dict[str, Any]:
        visible_job(job_id, who)
        try:
            job = store.request_cancel(job_id)
        except JobNotFound:
            raise ApiError(404, f"no job {job_id!r}") from None
        return {"job": job_view(job)}

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
        used: dict[str, int] = {}
        holding = [s for s in JobState if s.holds_gpus]
        for job in store.list_jobs(states=holding):
            if job.pool:
                used[job.pool] = used.get(job.pool, 0) + job.gpus
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

    @app.post("/v1/agent/heartbeat", tags=["agent"], response_model=HeartbeatReply,
              responses=_POST,
              summary="An agent's progress report; the reply tells it to go on or stop")
    def heartbeat(beat: Heartbeat, caller: Reporter) -> HeartbeatReply:
        for_attempt(caller, beat.job_id, beat.attempt)
        report = beat.model_dump(exclude={"checkpoint_seconds"})
        if not report["samples_per_sec"]:
            report["samples_per_sec"] = None  # 0 = not measured yet, not a real throughput
        try:
            said = store.record_heartbeat(**report)
        except JobNotFound:
            raise ApiError(404, f"no job {beat.job_id!r}") from None
        if beat.node_rank == 0:  # rank 0 reports the job's checkpoint (store.record_heartbeat)
            checkpoints.observe(beat.job_id, beat.attempt, beat.checkpoint_step,
                                beat.checkpoint_bytes, beat.checkpoint_seconds)
        return HeartbeatReply(action=_agent_action(said.action), round=said.round)

    @app.post("/v1/agent/rendezvous", tags=["agent"], response_model=RendezvousReply,
              responses=_POST,
              summary="A multi-node job's rendezvous: every node checks in (rank 0 with the "
                      "master's address) and polls until its whole round has")
    def rendezvous(visit: Rendezvous, caller: Reporter) -> RendezvousReply:
        for_attempt(caller, visit.job_id, visit.attempt)
        try:
            got = store.rendezvous(visit.job_id, visit.attempt, visit.round, visit.node_rank,
                                   visit.addr, visit.launch_key)
        except JobNotFound:
            raise ApiError(404, f"no job {visit.job_id!r}") from None
        return RendezvousReply(**{**got, "action": _agent_action(got["action"])})

    @app.post("/v1/chaos/preempt", status_code=202, tags=["chaos"], responses=_POST,
              summary="Reclaim every spot node in a region (admin)")
    def chaos_preempt(req: PreemptRequest,
                      who: Annotated[Principal, Depends(admin)]) -> dict[str, Any]:
        spot = [p for p in store.pools() if p.market is Market.SPOT]
        hits = [p for p in spot if req.region in (p.region, f"{p.cloud}:{p.region}")]
        if not hits:
            known = sorted({f"{p.cloud}:{p.region}" for p in spot}) or ["none"]
            raise ApiError(404, f"no spot pool in region {req.region!r}; spot regions: "
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
            raise ApiError(404, f"no job {req.job_id!r}")
        if job.state is not JobState.RUNNING or req.rank >= job.nodes:
            raise ApiError(409, f"job {job.id} is {job.state.value} on {job.nodes} node(s): "
                           f"rank {req.rank} is not a running node of it")
        store.request_command("node", job_id=job.id, rank=req.rank, how=req.how)
        return {"accepted": True, "job_id": job.id, "rank": req.rank, "how": req.how}

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


def _parse_submission(body: bytes, gpus: str | None,
                      spot: str | None) -> tuple[ParsedSpec, JobSpec]:
    """A submitted body's parsed spec and the spec with the query's overrides applied."""
    parsed = parse_spec_text(body)
    spec = parsed.spec
    if gpus is not None or spot is not None:
        spec = apply_overrides(spec, gpus=gpus, spot=spot)
    return parsed, spec


def _agent_action(action: str) -> str | None:
    """An agent endpoint's ``action``: null to keep going, or ``checkpoint-exit``."""
    return CHECKPOINT_EXIT if action == CHECKPOINT_EXIT else None


def _is_host_port(addr: str) -> bool:
    """Is ``addr`` "host:port" with an IP address ("[...]" around IPv6) or DNS name as host
    and a port in 1-65535?"""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        return False
    if host.startswith("[") and host.endswith("]"):
        try:
            return ipaddress.ip_address(host[1:-1]).version == 6
        except ValueError:
            return False
    try:
        ipaddress.IPv4Address(host)
        return True
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    return len(host) <= 253 and all(DNS_LABEL.fullmatch(x) for x in labels) and \
        not labels[-1].isdigit()


def _submit_team(spec: JobSpec, who: Principal) -> str:
    """A team token submits for its own team; ``team:`` in the spec must then agree."""
    if who.role is Role.ADMIN:
        return spec.team
    assert who.team is not None  # team grants always carry a team
    if spec.team not in ("default", who.team):
        raise ApiError(403, f"this token belongs to team {who.team!r}, the spec says team "
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
        raise ApiError(415, f"content type {media!r} is not a job spec; send "
                       + ", ".join(SPEC_MEDIA))
    return await request.body()


class BodyLimit:
    """ASGI middleware: refuse request bodies over ``limit`` bytes (declared or streamed) with
    413 on every route, before anything parses them (auth runs after FastAPI reads a body)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            response = JSONResponse(self._error(), status_code=413)
            await response(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # a chunked upload: stop reading at the limit
                    raise ApiError(413, self._error()["error"]["message"])
            return message

        await self.app(scope, limited, send)

    def _error(self) -> dict[str, Any]:
        return _error_body(413, f"request body is over the {self.limit}-byte limit", [])


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        problems = exc.problems if isinstance(exc, ApiError) else []
        return JSONResponse(_error_body(exc.status_code, str(exc.detail), problems),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(NotDurable)
    async def not_durable(request: Request, exc: NotDurable) -> JSONResponse:
        # not acknowledged: the same Idempotency-Key on a retry never makes a second job
        message = (f"not accepted: the submission could not be made durable ({exc}); retry "
                   "later with the same Idempotency-Key")
        return JSONResponse(_error_body(503, message, []), status_code=503,
                            headers={"Retry-After": "5"})

    @app.exception_handler(redis.RedisError)
    async def store_down(request: Request, exc: redis.RedisError) -> JSONResponse:
        message = "the broker's state store (redis) is unavailable; check `fleet up`"
        return JSONResponse(_error_body(503, message, []), status_code=503)

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
        return JSONResponse(_error_body(422, "invalid request", problems), status_code=422)
