"""The hostile requests of issue 13 (anchor bombs, alias floods, oversized fields, deep
nesting, catastrophic-backtracking input, out-of-range ids) and a client that sends them. Light
on imports: the attack runs in processes of its own."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import httpx

SPEC = "name: a\nrun: echo hi\nbatch_size: 1\nwork: {samples: 1}\n"


def anchor_bomb(levels: int = 8) -> str:
    """The issue's 473-byte request: 8 levels of 9 aliases, ``run: *l7``."""
    lines = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nname: a\nrun: *l{levels - 1}\nbatch_size: 1\n" \
        "work: {samples: 1}\n"


def alias_flood() -> str:
    """About 208 KB that expands to a ~100 MB ``setup`` (a 1.5 KB value aliased 69,000 times)."""
    return (SPEC + "envs: {X: &x '" + "x" * 1500 + "'}\n"
            + "setup: [" + ",".join(["*x"] * 69_000) + "]\n")


@dataclass
class Case:
    name: str
    who: str
    method: str
    path: str
    body: str | None = None
    params: dict[str, str] = field(default_factory=dict)
    content_type: str = "application/yaml"
    status: int = 422
    field: str | None = None  # a problem's field starts with this (None: the 413 names none)


CASES = [
    Case("anchor bomb", "ml", "POST", "/v1/jobs", anchor_bomb(), field="l"),
    Case("alias flood", "ml", "POST", "/v1/jobs", alias_flood(), field="setup"),
    Case("long setup", "ml", "POST", "/v1/jobs", SPEC + "setup: '" + "s" * 70_000 + "'\n",
         field="setup"),
    Case("long run", "ml", "POST", "/v1/jobs",
         SPEC.replace("echo hi", "'" + "r" * 70_000 + "'"), field="run"),
    Case("many envs", "ml", "POST", "/v1/jobs",
         SPEC + "envs:\n" + "".join(f"  V{i}: v\n" for i in range(5000)), field="envs"),
    Case("huge env value", "ml", "POST", "/v1/jobs",
         SPEC + "envs: {BIG: '" + "e" * 100_000 + "'}\n", field="envs.BIG"),
    Case("flat list", "ml", "POST", "/v1/jobs",
         SPEC.replace("run: echo hi", "run: [" + "1," * 120_000 + "1]"), field="run"),
    Case("deep yaml", "ml", "POST", "/v1/jobs",
         SPEC.replace("run: echo hi", "run: " + "[" * 500 + "]" * 500), field="run[0]"),
    # libyaml looks 1,000 levels ahead before the composer sees the 33rd: it names the position
    Case("deeper yaml", "ml", "POST", "/v1/jobs",
         SPEC.replace("run: echo hi", "run: " + "[" * 5000 + "]" * 5000), field="line 2"),
    Case("deep json object", "ml", "POST", "/v1/jobs", '{"a":' * 1000 + "1" + "}" * 1000,
         content_type="application/json", field="(file)"),
    Case("deep json in a field", "ml", "POST", "/v1/jobs",
         '{"run": ' + "[" * 5000 + "]" * 5000 + "}", content_type="application/json",
         field="(file)"),
    Case("deep json", "ml", "POST", "/v1/jobs", '{"run": ' + "[" * 100 + "]" * 100 + "}",
         content_type="application/json", field="run[0]"),
    Case("spaces in a duration", "ml", "POST", "/v1/jobs",
         SPEC + 'deadline: "' + " " * 200 + 'x"\n', field="deadline"),
    Case("long region", "ml", "POST", "/v1/jobs",
         SPEC + 'checkpoint: {uri: /x, region: "azure:' + "east" * 16_000 + '!"}\n',
         field="checkpoint.region"),
    Case("long accelerator", "ml", "POST", "/v1/jobs",
         'run: x\nresources: {accelerators: "A' + " " * 60_000 + ':x"}\n',
         field="resources.accelerators"),
    Case("a digit int() refuses", "ml", "POST", "/v1/jobs", SPEC + 'gpus: "1:\u00b2"\n',
         field="gpus"),
    Case("5000 digits", "ml", "POST", "/v1/jobs", SPEC + 'priority: "' + "9" * 5000 + '"\n',
         field="priority"),
    Case("deep json heartbeat", "agent", "POST", "/v1/agent/heartbeat",
         "[" * 1000 + "]" * 1000, content_type="application/json", field="body"),
    Case("flat json heartbeat", "agent", "POST", "/v1/agent/heartbeat",
         '{"job_id": "a-1", "attempt": 1, "notice": [' + "1," * 100_000 + "1]}",
         content_type="application/json", field="notice"),
    Case("deep json preempt", "admin", "POST", "/v1/chaos/preempt",
         '{"region": ' + "[" * 1000 + "]" * 1000 + "}", content_type="application/json",
         field="body"),
    Case("stream id out of range", "ml", "GET", "/v1/events",
         params={"since": "99999999999999999999999-0"}, field="since"),
    Case("stream id seq out of range", "admin", "GET", "/v1/events",
         params={"since": "0-18446744073709551616"}, field="since"),
    Case("body over the limit", "ml", "POST", "/v1/jobs", SPEC + "#" * 300_000, status=413),
]


def send(c: httpx.Client, case: Case, tokens: Mapping[str, str]) -> httpx.Response:
    """Send ``case`` with the token of its role from ``tokens``."""
    headers = {"Authorization": f"Bearer {tokens[case.who]}", "Content-Type": case.content_type}
    return c.request(case.method, case.path, content=case.body, params=case.params,
                     headers=headers)


def timed(call: Callable[[], httpx.Response]) -> tuple[float, httpx.Response]:
    t0 = time.perf_counter()
    r = call()
    return time.perf_counter() - t0, r


def attack(url: str, tokens: Mapping[str, str], first: int, stride: int,
           seconds: float) -> list[tuple[str, int, float]]:
    """Send every ``stride``-th case from ``first`` on, round and round, for ``seconds``:
    (case, status, seconds taken) of each."""
    out = []
    with httpx.Client(base_url=url, timeout=60) as c:
        n, end = first, time.monotonic() + seconds
        while time.monotonic() < end:
            case = CASES[n % len(CASES)]
            took, r = timed(lambda case=case: send(c, case, tokens))  # type: ignore[misc]
            out.append((case.name, r.status_code, took))
            n += stride
    return out
