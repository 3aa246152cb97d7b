"""``fleet demo``: the broker on a three-region local fleet running real PyTorch jobs. Jobs start,
a new job arrives and running jobs shrink to make room, a spot region is reclaimed and its jobs
checkpoint and resume in another region, and a summary compares the cost with all-on-demand.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from broker.costs import job_cost
from broker.models import JobRecord, JobState
from broker.scheduler import SchedulerConfig
from broker.server import REPO, BrokerConfig, Stack
from broker.store import Store
from policies.models import BatchMode, BatchRange, GpuRange, JobSpec, SpotPolicy

DEMO_FLEET = REPO / "examples" / "fleets" / "demo.yaml"


@dataclass
class DemoConfig:
    steps: int = 1200  # training steps per job (at the base batch of 64)
    fleet: Path = DEMO_FLEET
    state_dir: Path | None = None  # default: a fresh temp dir
    reclaim_region: str = "us-east-1"  # else a spot region whose jobs have work left
    live: bool = True
    timeout_s: float = 280.0
    port: int = 0
    # A job keeps its GPUs at least this long after a (re)start before it may be resized.
    min_rescale_interval_s: float = 5.0


@dataclass
class DemoSummary:
    finished: int
    jobs: int
    rescales: int
    migrations: int
    preemptions: int
    gpu_hours: float
    cost: float
    on_demand_cost: float
    elapsed_s: float
    phases: list[str] = field(default_factory=list)
    made_room: list[str] = field(default_factory=list)  # jobs resized/moved for the newcomer

    @property
    def savings(self) -> float:
        return 1 - self.cost / self.on_demand_cost if self.on_demand_cost else 0.0


def demo_spec(name: str, steps: int, gmax: int, mode: BatchMode) -> JobSpec:
    return JobSpec(
        name=name, team="demo",
        run=f"python examples/train_digits.py --steps {steps} --checkpoint-every-steps 50",
        gpus=GpuRange(min=1, max=gmax), batch_mode=mode, spot=SpotPolicy.ALLOWED,
        batch_size=BatchRange(min=32, max=256, default=64), work_samples=steps * 64,
    )


def _where(job: JobRecord) -> str:
    if not job.pool:
        return "-"
    _, region, market, _ = job.pool.split(":")
    return f"{region} {'spot' if market == 'spot' else 'od'}"


def _cost(store: Store, job_id: str) -> float:
    return job_cost(store.placements(job_id)).cost_usd


def render(store: Store, title: str, events: list[str]) -> Group:
    table = Table(title=title, title_justify="left", expand=False, box=box.SIMPLE_HEAD,
                  pad_edge=False, collapse_padding=True, caption_justify="left",
                  caption="r/m/p: rescales / migrations / preemptions")
    for col in ("job", "state", "region", "GPUs", "batch", "done", "r/m/p", "cost $"):
        table.add_column(col, no_wrap=True,
                         justify="left" if col in ("job", "state", "region") else "right")
    for job in store.list_jobs():
        holds = job.state.holds_gpus
        table.add_row(
            job.id, job.state.value, _where(job) if holds else "-",
            str(job.gpus) if holds else "-", str(job.batch_size or "-") if holds else "-",
            f"{job.progress:.0%}", f"{job.rescales}/{job.migrations}/{job.preemptions}",
            f"{_cost(store, job.id):.4f}")
    lines = Table.grid()
    for e in events[-6:]:
        lines.add_row(e)
    return Group(table, lines)


def summarize(store: Store, started: float, phases: list[str],
              made_room: list[str]) -> DemoSummary:
    jobs = store.list_jobs()
    total = job_cost([p for ps in store.placements_of([j.id for j in jobs]).values()
                      for p in ps])
    return DemoSummary(
        finished=sum(j.state is JobState.COMPLETED for j in jobs), jobs=len(jobs),
        rescales=sum(j.rescales for j in jobs), migrations=sum(j.migrations for j in jobs),
        preemptions=sum(j.preemptions for j in jobs), gpu_hours=total.gpu_hours,
        cost=total.cost_usd, on_demand_cost=total.ondemand_cost_usd,
        elapsed_s=time.time() - started, phases=phases, made_room=made_room)


def run_demo(config: DemoConfig, console: Console | None = None,
             on_done: Callable[[Store], None] | None = None) -> DemoSummary:
    """Run the scripted scenario on a fresh broker stack; returns the summary. ``on_done``
    sees the store before the stack stops."""
    console = console or Console()
    tmp = None
    state = config.state_dir
    if state is None:
        tmp = tempfile.TemporaryDirectory(prefix="fleet-demo-")
        state = Path(tmp.name)
    sched = SchedulerConfig(min_rescale_interval_s=config.min_rescale_interval_s)
    stack = Stack(BrokerConfig(state_dir=state, fleet=config.fleet, tick_s=0.5, lease_ttl_s=5,
                               heartbeat_interval_s=1.0, scheduler=sched),
                  port=config.port).start()
    assert stack.broker is not None
    store = stack.broker.store
    started = time.time()
    phases: list[str] = []
    events: list[str] = []
    seen = "0"
    title = "starting"

    def note(msg: str) -> None:
        phases.append(msg)
        events.append(f"[bold]{time.time() - started:5.1f}s[/] {msg}")
        if not config.live:
            console.print(f"{time.time() - started:5.1f}s {msg}", highlight=False)

    def wait(cond: Callable[[], bool], live: Live | None, timeout: float) -> bool:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in store.events(since=seen, limit=1000):
                seen = e.id
                if e.type in ("running", "resize", "migrate", "suspend", "preempted",
                              "completed", "region-reclaimed", "failed"):
                    where = e.data.get("pool") or e.data.get("region") or e.data.get("reason")
                    events.append(f"{e.ts - started:5.1f}s {e.type:<16} {e.job_id or ''} "
                                  f"{where or ''}")
            if live is not None:
                live.update(render(store, title, events))
            if cond():
                return True
            time.sleep(0.5)
        return False

    def jobs_of(names: list[str]) -> list[JobRecord]:
        return [j for j in store.list_jobs() if j.name in names]

    def under_way(names: list[str]) -> bool:
        """Each job has trained (a short job may have finished between two looks)."""
        js = jobs_of(names)
        return len(js) == len(names) and all(
            j.state.terminal or (j.state is JobState.RUNNING and j.samples_done > 0) for j in js)

    try:
        ctx = (Live(render(store, title, events), console=console, refresh_per_second=4)
               if config.live else contextlib.nullcontext())
        with ctx as live:
            first = [("digits-a", 4, BatchMode.ELASTIC), ("digits-b", 2, BatchMode.ELASTIC),
                     ("digits-c", 2, BatchMode.FIXED)]
            for name, gmax, mode in first:
                store.submit(demo_spec(name, config.steps, gmax, mode), team="demo")
            title = "1. three jobs fill the fleet (cheapest regions first)"
            note("submitted digits-a (1-4 GPUs), digits-b and digits-c (1-2 GPUs)")
            budget = config.timeout_s
            wait(lambda: under_way([n for n, _, _ in first]), live, budget / 3)
            before = {j.name: j.gpus for j in jobs_of([n for n, _, _ in first])}
            mark_id = store.last_event_id()
            store.submit(demo_spec("digits-d", config.steps, 2, BatchMode.ELASTIC), team="demo")
            # Each job's model is fitted from what its agent measures: where more worker
            # processes do not train faster (a CPU-bound machine), jobs have shrunk already and
            # the newcomer takes the GPUs they gave back.
            title = "2. a new job arrives: it takes free GPUs, or running jobs shrink for it"
            note(f"digits-d arrives; GPUs before: {before}")
            wait(lambda: under_way(["digits-d"]), live, budget / 3)
            after = {j.name: j.gpus for j in store.list_jobs() if j.state is JobState.RUNNING}
            made_room = sorted({e.job_id for e in store.events(since=mark_id, limit=10_000)
                                if e.type in ("resize", "migrate", "suspend") and e.job_id})
            note(f"GPUs after: {after}; made room: {made_room}")
            title = "3. a spot region is reclaimed: jobs move"

            def with_work_left() -> dict[str, list[str]]:
                """Spot regions -> their running jobs that have a quarter of their work left:
                a job about to finish would just finish under the notice."""
                out: dict[str, list[str]] = {}
                for j in store.list_jobs():
                    if j.state is JobState.RUNNING and j.pool and ":spot:" in j.pool and \
                            j.progress < 0.75:
                        out.setdefault(j.pool.split(":")[1], []).append(j.name)
                return out

            # Jobs resized for the newcomer may still be relaunching: reclaim once one runs
            # there, else in another spot region that has a job with work left.
            wait(lambda: bool(with_work_left()), live, budget / 6)
            there = with_work_left()
            region = config.reclaim_region if config.reclaim_region in there else \
                max(there, key=lambda r: len(there[r]), default=config.reclaim_region)
            store.request_preempt(region, duration_s=3600)
            title = f"3. spot region {region} is reclaimed: jobs move"
            note(f"reclaiming {region}; running there: {there.get(region, [])}")
            title = "4. jobs checkpoint, resume elsewhere and finish"
            wait(lambda: all(j.state.terminal for j in store.list_jobs()), live,
                 max(10.0, config.timeout_s - (time.time() - started)))
            title = "done"
            if live is not None:
                live.update(render(store, title, events))
        if config.live and not console.is_terminal:  # its last frame ends a line only there
            console.print()
        if on_done is not None:
            on_done(store)
        return summarize(store, started, phases, made_room)
    finally:
        stack.stop()
        if tmp is not None:
            tmp.cleanup()


def print_summary(s: DemoSummary, console: Console) -> None:
    table = Table(title="FleetBroker demo summary", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in (("jobs finished", f"{s.finished} of {s.jobs}"), ("rescales", s.rescales),
                 ("migrations", s.migrations), ("preemptions", s.preemptions),
                 ("GPU-hours", f"{s.gpu_hours:.4f}"), ("cost", f"${s.cost:.4f}"),
                 ("cost if all on-demand", f"${s.on_demand_cost:.4f}"),
                 ("saved", f"{s.savings:.0%}"), ("wall time", f"{s.elapsed_s:.0f} s")):
        table.add_row(k, str(v))
    console.print(table)
