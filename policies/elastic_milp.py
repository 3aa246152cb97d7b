"""The allocator's problem as a MILP solved by HiGHS (scipy): the reference that checks exactness.

Same objective and constraints as :func:`policies.elastic_dp.allocate`; used by tests and the
benchmark, not on the scheduling path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from policies.elastic_dp import Choice, InfeasibleAllocation, JobChoices


def allocate_milp(
    jobs: Sequence[JobChoices], capacity: int, *, time_limit: float | None = None
) -> tuple[float, dict[str, Choice | None]]:
    """Solve exactly with HiGHS; returns (optimal value, choice per job). The relative MIP gap
    is 0: at HiGHS's default (1e-4) it stops at a solution up to 0.01% short of the optimum,
    which the exactness tests would then hold against the DP."""
    owners: list[int] = []
    flat: list[Choice] = []
    for j, job in enumerate(jobs):
        for c in job.choices:
            owners.append(j)
            flat.append(c)
    n = len(flat)
    result: dict[str, Choice | None] = {job.job_id: None for job in jobs}
    if n == 0:
        return 0.0, result
    value = np.array([c.value for c in flat])
    gpus = np.array([c.gpus for c in flat], dtype=float)
    rows = np.array(owners)
    # One row per job: sum of its indicators <= 1 (== 1 when required); one capacity row.
    pick = coo_array((np.ones(n), (rows, np.arange(n))), shape=(len(jobs), n))
    lower = np.array([1.0 if job.required else 0.0 for job in jobs])
    constraints = [
        LinearConstraint(pick, lower, np.ones(len(jobs))),
        LinearConstraint(gpus[None, :], 0, capacity),
    ]
    options: dict[str, float] = {"mip_rel_gap": 0.0}
    if time_limit:
        options["time_limit"] = time_limit
    res = milp(-value, constraints=constraints, integrality=np.ones(n),
               bounds=Bounds(0, 1), options=options)
    if res.status == 2:
        raise InfeasibleAllocation([job.job_id for job in jobs if job.required], capacity,
                                   capacity + 1)
    if res.x is None:
        raise RuntimeError(f"HiGHS did not solve the problem: {res.message}")
    for idx in np.flatnonzero(res.x > 0.5):
        result[jobs[owners[idx]].job_id] = flat[idx]
    return float(-res.fun), result
