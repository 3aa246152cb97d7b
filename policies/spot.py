"""Spot or on-demand per job, deadline-aware as in "Can't Be Late" (NSDI'24): keep on pace.

Spot while it is there; when it is not, fall back to on-demand only if the job is behind a uniform
pace to its deadline (else wait for spot); switch to on-demand for good once the slack left could
not absorb one more preemption: what a preemption costs (``restart_h``: the round until the broker
reacts, the work lost, the restart that follows), plus, for a job not running on spot yet, the
restart onto spot (``switch_h``), paid before the risk begins. Can't Be Late's safety net of two
restarts is this rule for a preemption that costs just a restart. A job that must not be
preempted (``spot: never``, ``must_not_preempt``) stays on on-demand. A job close to the net
should hold its pace on spot, without rescales (``holds_pace``).

An elastic job can recover faster than it runs: after a preemption, on-demand room held for it
(``recover_h``: its work left at a larger size there) finishes it sooner than its pace's size
would, so the net is judged against that recovery (``recovery_slack_h``). Can't Be Late's rule
is the case of a job that recovers at its own size; the broker holds each such size for one job
only, so jobs preempted together do not count on the same on-demand GPUs. The simulator and the live
broker both build a job's ``restart_h`` with ``preemption_h``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from policies.models import Market, SpotPolicy


def must_not_preempt(spot: SpotPolicy) -> bool:
    """The one mapping of a job's spot setting to "must not be preempted": ``spot: never``."""
    return spot is SpotPolicy.NEVER


def preemption_h(reaction_h: float, restart_h: float, loss_h: float, remaining_h: float) -> float:
    """What one preemption can cost a job, in hours (``DeadlineJob.restart_h``): the time until
    the broker reacts, the restart, and the work lost since the last checkpoint (``loss_h``),
    never more than the work the job has left to do."""
    return reaction_h + restart_h + min(loss_h, remaining_h)


class DeadlineJob(BaseModel):
    """Where a job stands against its deadline; times in hours since submission."""

    model_config = ConfigDict(frozen=True)

    total_h: float = Field(gt=0, description="compute hours the job needs in all")
    progress_h: float = Field(ge=0, description="compute hours already done (checkpointed)")
    elapsed_h: float = Field(ge=0, description="hours since submission")
    deadline_h: float | None = Field(default=None, gt=0, description="None: no deadline")
    restart_h: float = Field(default=0.0, ge=0, description="what one preemption can cost")
    switch_h: float | None = Field(default=None, ge=0,
                                   description="one (re)start elsewhere; None: restart_h")
    must_not_preempt: bool = False
    current: Market | None = Field(default=None, description="market the job runs on now")
    recover_h: float | None = Field(
        default=None, ge=0, description="hours the work left takes on the on-demand room held "
        "for the job's recovery from a preemption; None: ``remaining_h`` (its own size)")

    @property
    def remaining_h(self) -> float:
        return max(self.total_h - self.progress_h, 0.0)

    @property
    def slack_h(self) -> float:
        """Hours the job can still lose and finish on time; negative: the deadline is lost."""
        if self.deadline_h is None:
            return float("inf")
        return self.deadline_h - self.elapsed_h - self.remaining_h

    @property
    def recovery_slack_h(self) -> float:
        """The slack if the job finished on its recovery's on-demand room from now: what a
        preemption may cost before the deadline is lost."""
        if self.deadline_h is None:
            return float("inf")
        left = self.remaining_h if self.recover_h is None else min(self.recover_h,
                                                                    self.remaining_h)
        return self.deadline_h - self.elapsed_h - left

    @property
    def net_h(self) -> float:
        """The safety net: the slack that absorbs one more preemption, plus the restart onto spot
        for a job not running there yet."""
        return self.restart_h + (0.0 if self.current is Market.SPOT else self._switch_h)

    @property
    def return_h(self) -> float:
        """Slack above which a job off spot goes (back) to spot: the net of a job about to start
        there, plus one preemption's worth, so that a rescale or a round below pace does not
        send it straight back."""
        return 2 * self.restart_h + self._switch_h

    @property
    def _switch_h(self) -> float:
        return self.restart_h if self.switch_h is None else self.switch_h

    @property
    def behind_pace(self) -> bool:
        """Progress below the uniform pace ``total * elapsed / deadline``."""
        return self.progress_h < self.pace_h(self.elapsed_h)

    def pace_h(self, elapsed_h: float) -> float:
        """Work the uniform pace has done by ``elapsed_h`` (none without a deadline)."""
        if self.deadline_h is None:
            return 0.0
        return self.total_h * min(elapsed_h / self.deadline_h, 1.0)


def holds_pace(job: DeadlineJob) -> bool:
    """Too little slack to give any away: within ``return_h``, a round below pace or one more
    restart (a rescale) can put the job under the safety net, onto on-demand for good, since from
    there it would not come back to spot. Such a job should run at least at its pace and keep a
    configuration that does."""
    return job.slack_h <= job.return_h


def choose_market(job: DeadlineJob, spot_available: bool) -> Market | None:
    """The market to run on now, or ``None`` to wait (hold no capacity) for spot to come back."""
    if job.must_not_preempt:
        return Market.ON_DEMAND
    if job.recovery_slack_h <= job.net_h:
        return Market.ON_DEMAND  # past the point of no return: finish on on-demand
    if spot_available:
        if job.current is Market.ON_DEMAND and job.slack_h <= job.return_h:
            return Market.ON_DEMAND
        return Market.SPOT
    if job.current is Market.ON_DEMAND:
        # Can't Be Late's hysteresis: leave on-demand to wait for spot only once clearly ahead
        # of pace, or the job flaps between waiting and relaunching, a restart each time
        ahead = job.progress_h >= job.pace_h(job.elapsed_h + job.return_h)
        return None if ahead else Market.ON_DEMAND
    return Market.ON_DEMAND if job.behind_pace else None
