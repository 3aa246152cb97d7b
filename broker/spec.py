"""Load a job spec (the project's own YAML, or a SkyPilot task YAML as it is) into ``JobSpec``.

Every problem in a spec is collected and raised together as one ``SpecError`` that names the
field, the value and the fix; nothing a user wrote is dropped without an error or a warning.
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import math
import re
import reprlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, SecretStr, ValidationError
from yaml.cyaml import CParser

from broker.errors import InvalidInput
from broker.protocol import ENV_PREFIX
from policies.models import (
    CLOUD_REGION,
    NODE_SIZE,
    REMOTE_SCHEMES,
    STORE_SCHEMES,
    Accelerator,
    FileMount,
    JobSpec,
    MountMode,
    SpecFieldError,
    SpotPolicy,
    UnknownAccelerator,
    check_image,
    check_name,
)
from providers import registry

MAX_SPEC_BYTES = 256 * 1024
# The shape a spec may have once its YAML aliases are expanded: an anchor bomb or an alias flood
# (a few hundred bytes that expand to gigabytes) is refused while it is read, before anything is
# built from it. Real specs hold a few hundred values, nested a few levels.
MAX_SPEC_VALUES = 2_000
MAX_SPEC_DEPTH = 32
# Field caps: every field is bounded, so is the stored record (its canonical JSON).
MAX_TEXT_BYTES = 64 * 1024  # run, setup
MAX_ENVS = 256
MAX_ENV_VALUE_BYTES = 16 * 1024
MAX_ENVS_BYTES = 64 * 1024  # names and values together
MAX_LIST_ITEMS = 64  # accelerators, region patterns, SkyPilot resource alternatives
# A cloud:region (pattern) or an accelerator name: longer ones are refused before any regex.
MAX_REGION_CHARS = 64
MAX_DEADLINE_S = 366 * 24 * 3600.0
MAX_WORK_SAMPLES = 10**15
# A SkyPilot task says nothing about its work: it runs until its command exits.
UNBOUNDED_WORK = MAX_WORK_SAMPLES
FORMAT_FLEET = "fleet"
FORMAT_SKYPILOT = "skypilot"


class Problem(BaseModel):
    """One thing wrong with a spec: where, what was there, and how to fix it."""

    field: str
    value: str | None = None
    message: str

    def __str__(self) -> str:
        shown = f" (got {self.value})" if self.value is not None else ""
        return f"{self.field}{shown}: {self.message}"


class SpecError(InvalidInput):
    """A spec that cannot be accepted; ``problems`` lists every reason."""

    problems: list[Problem]

    def __init__(self, problems: list[Problem]) -> None:
        lines = "\n".join(f"  - {p}" for p in problems)
        noun = "problem" if len(problems) == 1 else "problems"
        super().__init__(f"invalid job spec ({len(problems)} {noun}):\n{lines}", problems)

    @property
    def message(self) -> str:
        return "invalid job spec"  # the API's answer: its problems list each reason


class ParsedSpec(BaseModel):
    """A validated spec, the format it was written in, notes on what was translated, and the
    values of its ``secret_envs`` (never part of the spec itself)."""

    spec: JobSpec
    format: str
    warnings: list[str] = []
    secrets: dict[str, SecretStr] = {}


# The media type of a submission with values given at launch: {"spec", "envs", "secrets"}.
LAUNCH_MEDIA = "application/vnd.fleetbroker.launch+json"


class LaunchEnv(BaseModel):
    """Values given at launch (``fleet launch --env K=V --secret K``): they win over the spec's
    and fill its envs and secrets that have none."""

    model_config = ConfigDict(frozen=True)

    envs: dict[str, str] = {}
    secrets: dict[str, SecretStr] = {}


_PREVIEW = reprlib.Repr()
_PREVIEW.maxlevel, _PREVIEW.maxstring, _PREVIEW.maxother = 3, 70, 70


def preview(value: Any) -> str:
    """At most 80 characters of ``value`` for an error message, however big or deep it is."""
    text = _PREVIEW.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Problems:
    def __init__(self) -> None:
        self.items: list[Problem] = []
        self.fields: set[str] = set()

    def add(self, field: str, value: Any, message: str, *, show: bool = True) -> None:
        self.items.append(Problem(field=field, value=preview(value) if show else None,
                                  message=message))
        self.fields.add(field.split(".")[0].split("[")[0])

    def raise_if_any(self) -> None:
        if self.items:
            raise SpecError(self.items)


# --- YAML loading ---------------------------------------------------------------------------


class _Refused(yaml.YAMLError):
    """The document is over a shape limit; ``problem`` says where and which."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.message)
        self.problem = problem


class _BoundedComposer(yaml.composer.Composer):
    """Composes the node graph while counting what it expands to, every alias as often as it is
    used: past ``MAX_SPEC_VALUES`` values, ``MAX_SPEC_BYTES`` of text or ``MAX_SPEC_DEPTH``
    levels the document is refused, so an anchor bomb costs no more than the limits."""

    def compose_document(self) -> yaml.Node | None:
        self._values = self._text = 0
        self._path: list[Any] = []  # the index (key node or position) of each open level
        self._anchored: dict[int, tuple[int, int]] = {}  # id(node) -> (values, text) expanded
        try:
            return super().compose_document()
        finally:
            self._anchored.clear()

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        self._path.append(index)
        try:
            if len(self._path) > MAX_SPEC_DEPTH:
                self._refuse(f"nests deeper than {MAX_SPEC_DEPTH} levels; flatten it")
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent):
                target = self.anchors.get(event.anchor)
                if target is not None:  # an undefined alias: the composer names it
                    if id(target) not in self._anchored:
                        self._refuse("an alias inside its own anchor (a structure that "
                                     "contains itself); write the value out")
                    self._charge(*self._anchored[id(target)])
                return super().compose_node(parent, index)
            values, text = self._values, self._text
            self._charge(1, len(event.value) if isinstance(event, yaml.ScalarEvent) else 0)
            node = super().compose_node(parent, index)
            if event.anchor is not None:
                self._anchored[id(node)] = (self._values - values, self._text - text)
            return node
        finally:
            self._path.pop()

    def _charge(self, values: int, text: int) -> None:
        self._values += values
        self._text += text
        if self._values > MAX_SPEC_VALUES:
            self._refuse(f"the spec holds more than {MAX_SPEC_VALUES:,} values (an alias counts "
                         "as often as it is used); write it with fewer")
        if self._text > MAX_SPEC_BYTES:
            self._refuse(f"the spec holds more than {MAX_SPEC_BYTES:,} bytes of text (an alias "
                         "counts as often as it is used); write it without aliases")

    def _refuse(self, message: str) -> None:
        where = "".join(f"[{i}]" if isinstance(i, int) else
                        f".{i.value}" if isinstance(i, yaml.ScalarNode) else ""
                        for i in self._path).removeprefix(".")
        line = self.peek_event().start_mark.line + 1
        raise _Refused(Problem(field=where or "(file)", value=f"line {line}", message=message))


class _StrictLoader(_BoundedComposer, CParser, yaml.constructor.SafeConstructor,
                    yaml.resolver.Resolver):
    """Safe YAML (libyaml's parser) that refuses duplicate keys (PyYAML would silently keep
    the last one) and documents over the shape limits."""

    def __init__(self, stream: str) -> None:
        CParser.__init__(self, stream)
        _BoundedComposer.__init__(self)
        yaml.constructor.SafeConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)


def _mapping_no_duplicates(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"unhashable key {preview(key)}", key_node.start_mark) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {preview(key)}", key_node.start_mark)
        seen[key] = loader.construct_object(value_node, deep=True)
    return seen


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                              _mapping_no_duplicates)
# YAML 1.1 reads `1:4` as the base-60 number 64; keep such values text (gpus: 1:4, A100:8).
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, re.compile(r"(?=[^:]*$)" + rx.pattern, rx.flags)
             if tag.endswith((":int", ":float")) else rx) for tag, rx in resolvers]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def load_yaml(text: str | bytes) -> Any:
    """Parse one YAML (or JSON) document with size and shape limits; ``SpecError`` on failure."""
    if isinstance(text, bytes):
        if len(text) > MAX_SPEC_BYTES:
            raise SpecError([_too_big(len(text))])
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SpecError([Problem(field="(file)", message=f"not UTF-8 text ({exc.reason}); "
                                     "save the spec as UTF-8")]) from None
    if len(text.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise SpecError([_too_big(len(text))])
    if text.lstrip().startswith("{"):
        try:  # JSON proper first: YAML cannot read JSON's surrogate-pair escapes
            return load_json(text, "(file)")
        except json.JSONDecodeError:
            pass  # a YAML flow mapping, or broken JSON: YAML's parser names the position
    try:
        docs = list(yaml.load_all(text, Loader=_StrictLoader))
    except _Refused as exc:
        raise SpecError([exc.problem]) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        if exc.context_mark and mark and mark.index >= len(text):
            mark = exc.context_mark  # the text ended: point where the open construct began
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(file)"
        context = f" ({exc.context})" if exc.context and mark is exc.context_mark else ""
        raise SpecError([Problem(field=where, message=f"malformed YAML: {exc.problem or exc}"
                                 f"{context}; fix it at that position")]) from None
    except (yaml.YAMLError, RecursionError, ValueError) as exc:
        raise SpecError([_unreadable(exc)]) from None
    docs = [d for d in docs if d is not None]
    if len(docs) != 1:
        msg = ("the file is empty; write a job spec (see examples/jobs/)" if not docs else
               f"holds {len(docs)} YAML documents; put one job per file")
        raise SpecError([Problem(field="(file)", message=msg)])
    return docs[0]


def load_json(text: str | bytes, where: str) -> Any:
    """``json.loads`` within the spec's shape limits (depth, values), duplicate keys refused.
    Raises ``json.JSONDecodeError`` for text that is no JSON, else ``SpecError`` naming
    ``where`` (the body) or the field at fault."""
    try:
        doc = json.loads(text, object_pairs_hook=_json_object)
    except RecursionError:
        raise SpecError([Problem(field=where, message=f"nests deeper than {MAX_SPEC_DEPTH} "
                                 "levels; flatten it")]) from None
    except json.JSONDecodeError:
        raise
    except ValueError as exc:  # a duplicate key, or a number too long to convert
        raise SpecError([_unreadable(exc, where)]) from None
    _check_shape(doc, where)
    return doc


def _check_shape(doc: Any, where: str) -> None:
    """Refuse a loaded JSON document deeper or bigger than a spec may be (a walk, no recursion,
    that stops at the first limit)."""
    values, todo = 1, [(doc, "", 1)]
    while todo:
        value, path, depth = todo.pop()
        if not isinstance(value, dict | list) or not value:
            continue
        values += len(value)
        why = (f"nests deeper than {MAX_SPEC_DEPTH} levels; flatten it"
               if depth >= MAX_SPEC_DEPTH else
               f"holds more than {MAX_SPEC_VALUES:,} values; write it with fewer"
               if values > MAX_SPEC_VALUES else None)
        if why:
            raise SpecError([Problem(field=path or where, message=why)])
        if isinstance(value, dict):
            todo += [(v, f"{path}.{k}" if path else str(k), depth + 1) for k, v in value.items()]
        else:
            todo += [(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]


def _unreadable(exc: BaseException, where: str = "(file)") -> Problem:
    text = str(exc).split(";")[0] or type(exc).__name__
    what = "the spec" if where == "(file)" else f"the {where}"
    return Problem(field=where, message=f"cannot read {what}: {text}; fix that value")


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}; remove one of them")
        out[key] = value
    return out


def _too_big(size: int) -> Problem:
    return Problem(field="(file)", value=f"{size} bytes",
                   message=f"a spec may be at most {MAX_SPEC_BYTES} bytes; move data out of it")


# --- entry points ---------------------------------------------------------------------------


def parse_spec_text(text: str | bytes, *, default_name: str | None = None,
                    launch: LaunchEnv | None = None) -> ParsedSpec:
    """Parse spec text in either format (detected from its keys), with ``launch``'s values."""
    return parse_spec_data(load_yaml(text), default_name=default_name, launch=launch)


def load_spec_file(path: str | Path, *, launch: LaunchEnv | None = None) -> ParsedSpec:
    """Read and parse a spec file; a missing file is a ``SpecError`` naming the path."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        problem = Problem(field="(file)", value=str(p),
                          message=f"cannot read it ({exc.strerror}); check the path")
        raise SpecError([problem]) from None
    return parse_spec_text(raw, default_name=_name_from_stem(p.stem), launch=launch)


def _name_from_stem(stem: str) -> str | None:
    name = re.sub(r"[^a-z0-9_.-]+", "-", stem.lower()).strip("-_.")[:63]
    return name or None


_FLEET_KEYS = {
    "name", "run", "setup", "envs", "accelerators", "gpus", "batch_size", "batch_mode", "work",
    "work_samples", "spot", "regions", "checkpoint", "priority", "team", "deadline", "deadline_s",
    "model", "nodes", "run_per_node", "secret_envs", "workdir", "file_mounts", "container_image",
    "cpus", "memory",
}
# nodes, run_per_node and secret_envs are what a SkyPilot task becomes (the canonical JSON has
# them): they do not make a document the project's own format.
_FLEET_ONLY = _FLEET_KEYS - {"name", "run", "setup", "envs", "nodes", "run_per_node",
                             "secret_envs", "workdir", "file_mounts", "container_image"}
_SKY_KEYS = {
    "name", "run", "setup", "envs", "num_nodes", "resources", "workdir", "file_mounts", "secrets",
    "service", "config", "event_callback", "inputs", "outputs", "volumes",
}
# workdir and file_mounts are in the canonical JSON of a translated task too.
_SKY_ONLY = _SKY_KEYS - {"name", "run", "setup", "envs", "workdir", "file_mounts"}


def detect_format(doc: Mapping[str, Any]) -> str:
    """``fleet`` if the document uses a key only the own format has, else ``skypilot``.

    A document with only ``name/run/setup/envs`` is a minimal SkyPilot task.
    """
    keys = set(doc)
    if keys & _FLEET_ONLY:
        return FORMAT_FLEET
    return FORMAT_SKYPILOT


def parse_spec_data(doc: Any, *, default_name: str | None = None,
                    launch: LaunchEnv | None = None) -> ParsedSpec:
    """Validate an already-loaded document (dict from YAML or JSON) in either format."""
    if not isinstance(doc, Mapping):
        raise SpecError([Problem(field="(file)", value=preview(doc), message=(
            "a job spec is a YAML mapping (key: value lines); see examples/jobs/"))])
    bad_keys = [k for k in doc if not isinstance(k, str)]
    if bad_keys:
        raise SpecError([Problem(field="(top level)", value=preview(k),
                                 message="keys must be text") for k in bad_keys])
    fleet_keys, sky_keys = set(doc) & _FLEET_ONLY, set(doc) & _SKY_ONLY
    if fleet_keys and sky_keys:
        raise SpecError([Problem(
            field="(top level)", value=", ".join(sorted(sky_keys)),
            message=("mixes SkyPilot task keys with FleetBroker keys "
                     f"({', '.join(sorted(fleet_keys))}); write one format per file"))])
    launch = launch or LaunchEnv()
    if detect_format(doc) == FORMAT_FLEET:
        return _parse_fleet(doc, launch)
    return _parse_skypilot(doc, launch, default_name=default_name)


# --- the project's own format ---------------------------------------------------------------

# Whole numbers in text: ASCII digits, at most 19 of them (more is out of every range here, and
# int() of thousands of digits is slow or refused).
_WHOLE = re.compile(r"\s*(\d{1,19})\s*", re.ASCII)
# Spaces only after a unit: no two quantifiers compete for the same spaces (catastrophic
# backtracking on a long run of them).
_DURATION = re.compile(r"(?:(\d{1,19})\s*d\s*)?(?:(\d{1,19})\s*h\s*)?(?:(\d{1,19})\s*m\s*)?"
                       r"(?:(\d{1,19})\s*s\s*)?", re.ASCII)
MAX_DURATION_CHARS = 64
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_REGION_PATTERN = re.compile(r"^[a-z0-9*?\[\]!-]+:[a-z0-9*?\[\]!_-]+$")
_CLOUD_REGION = re.compile(CLOUD_REGION)
_RESERVED_ENV_PREFIX = ENV_PREFIX


def parse_duration(value: Any) -> float | None:
    """Seconds from ``90``, ``"90s"``, ``"5m"``, ``"1h30m"``, ``"2d"``; ``None`` if not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value) if math.isfinite(value) else None
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_DURATION_CHARS:
        return None
    m = _DURATION.fullmatch(value.strip())
    if not m or not any(m.groups()):
        return None
    d, h, mi, s = (int(g or 0) for g in m.groups())
    return float(((d * 24 + h) * 60 + mi) * 60 + s)


def _int(p: _Problems, field: str, value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and (m := _WHOLE.fullmatch(value)):
            return int(m.group(1))
        p.add(field, value, "must be a whole number")
        return None
    return value


def _parse_range(p: _Problems, field: str, value: Any) -> dict[str, int] | None:
    """``4``, ``"2:8"`` or ``{min: 2, max: 8, default: 4}`` (``default``: the size the job
    asks for, where its deadline's pace is judged)."""
    if isinstance(value, Mapping):
        unknown = set(value) - {"min", "max", "default"}
        if unknown:
            p.add(f"{field}.{sorted(map(str, unknown))[0]}", None,
                  f"unknown key; {field} takes min, max and default", show=False)
            return None
        lo = _int(p, f"{field}.min", value.get("min", 1))
        hi = _int(p, f"{field}.max", value.get("max", value.get("min", 1)))
        out = None if lo is None or hi is None else {"min": lo, "max": hi}
        if out is not None and value.get("default") is not None:
            default = _int(p, f"{field}.default", value["default"])
            if default is None:
                return None
            out["default"] = default
        return out
    if isinstance(value, str) and ":" in value:
        lo_s, _, hi_s = value.partition(":")
        lo_m, hi_m = _WHOLE.fullmatch(lo_s), _WHOLE.fullmatch(hi_s)
        if lo_m and hi_m:
            return {"min": int(lo_m.group(1)), "max": int(hi_m.group(1))}
        p.add(field, value, "write N, MIN:MAX (like 2:8) or {min: 2, max: 8}")
        return None
    n = _int(p, field, value)
    return None if n is None else {"min": n, "max": n}


def _parse_batch(p: _Problems, value: Any) -> dict[str, Any] | None:
    if isinstance(value, Mapping):
        unknown = set(value) - {"min", "max", "default", "per_gpu_max"}
        if unknown:
            p.add(f"batch_size.{sorted(map(str, unknown))[0]}", None,
                  "unknown key; batch_size takes min, max, default and per_gpu_max", show=False)
            return None
        out = {}
        for key in ("min", "max", "default", "per_gpu_max"):
            if key in value and value[key] is not None:
                n = _int(p, f"batch_size.{key}", value[key])
                if n is None:
                    return None
                out[key] = n
        if "min" not in out or "max" not in out:
            p.add("batch_size", dict(value), "needs min and max (global batch sizes)")
            return None
        return out
    n = _int(p, "batch_size", value)
    return None if n is None else {"min": n, "max": n, "default": n}


def _parse_work(p: _Problems, value: Any, batch: dict[str, Any] | None) -> int | None:
    if not isinstance(value, Mapping):
        p.add("work", value, "write {samples: N}, {epochs: E, dataset_size: D} or {steps: S}")
        return None
    keys = set(value)
    if keys == {"samples"}:
        total = _int(p, "work.samples", value["samples"])
    elif keys == {"epochs", "dataset_size"}:
        e = _int(p, "work.epochs", value["epochs"])
        d = _int(p, "work.dataset_size", value["dataset_size"])
        total = None if e is None or d is None else e * d
    elif keys == {"steps"}:
        s = _int(p, "work.steps", value["steps"])
        if s is None or batch is None:
            return None
        initial = batch.get("default", batch["min"])
        total = s * initial
    else:
        p.add("work", dict(value), "write exactly one of {samples: N}, "
              "{epochs: E, dataset_size: D} or {steps: S} (steps at the initial batch size)")
        return None
    if total is not None and not 1 <= total <= MAX_WORK_SAMPLES:
        p.add("work", dict(value), f"total samples {total} must lie in [1, {MAX_WORK_SAMPLES}]")
        return None
    return total


def _parse_envs(p: _Problems, value: Any, where: str = "envs") -> dict[str, str | None] | None:
    """``NAME: value`` pairs; a name without a value (null) is kept as None: it must be given
    at launch (``_resolve_envs``)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        p.add(where, value, "write a mapping NAME: value")
        return None
    if _too_many(p, where, value, MAX_ENVS):
        return None
    out: dict[str, str | None] = {}
    for k, v in value.items():
        field = f"{where}.{k}"
        if not isinstance(k, str) or not _ENV_NAME.match(k):
            p.add(where, k, "an environment variable name is letters, digits and '_', "
                  "not starting with a digit")
        elif k.startswith(_RESERVED_ENV_PREFIX):
            p.add(field, v, f"names starting with {_RESERVED_ENV_PREFIX} are set by the broker; "
                  "rename the variable")
        elif v is None:
            out[k] = None
        elif isinstance(v, Mapping | list):
            p.add(field, v, "must be text or a number")
        elif isinstance(v, str) and "\0" in v:
            p.add(field, v, "contains a NUL character; remove it")
        elif (size := _utf8_size(text := _env_text(v))) > MAX_ENV_VALUE_BYTES:
            p.add(field, f"{size:,} bytes", f"may be at most {MAX_ENV_VALUE_BYTES:,} bytes; "
                  "pass big values as a file the job fetches")
        else:
            out[k] = text
    total = sum(_utf8_size(k) + _utf8_size(v or "") for k, v in out.items())
    if total > MAX_ENVS_BYTES:
        p.add(where, f"{total:,} bytes", f"names and values may total at most "
              f"{MAX_ENVS_BYTES:,} bytes; pass big values as a file the job fetches")
    return out


_MOUNT_KEYS = {"source", "mode", "name", "store", "persistent", "path"}
_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
# SkyPilot's pattern for the envs it fills into file_mounts and workdir: $NAME and ${NAME}.
_ENV_REF = re.compile(r"\$\{?\b([a-zA-Z_][a-zA-Z0-9_]*)\b\}?")


def _fill_envs(value: Any, envs: Mapping[str, str]) -> Any:
    """``value`` with the task's envs filled in, as SkyPilot fills them into file_mounts (paths,
    bucket names, sources) and workdir; a name that is no env stays as written. Secrets are not
    filled in: a path or bucket name is kept in the job record in clear text."""
    if isinstance(value, str):
        return _ENV_REF.sub(lambda m: envs.get(m.group(1), m.group(0)), value)
    if isinstance(value, Mapping):
        return {_fill_envs(k, envs): _fill_envs(v, envs) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill_envs(v, envs) for v in value]
    return value


def _parse_files(p: _Problems, doc: Mapping[str, Any], out: dict[str, Any]) -> None:
    """``workdir`` (a local directory, packed at launch) and ``file_mounts``: SkyPilot's
    mapping ``{node path: source or {source, name, store, mode}}``, or the canonical list of
    FileMount."""
    workdir = doc.get("workdir")
    if workdir is not None:
        if not isinstance(workdir, str) or not workdir.strip() or \
                workdir.startswith(REMOTE_SCHEMES):
            p.add("workdir", workdir, "write a local directory (it is packed at launch); for a "
                  "bucket use file_mounts")
        else:
            out["workdir"] = workdir.strip()
    mounts = doc.get("file_mounts")
    if mounts is None:
        return
    if isinstance(mounts, list):
        items = [(m.get("path") if isinstance(m, Mapping) else None, m) for m in mounts]
    elif isinstance(mounts, Mapping):
        items = list(mounts.items())
    else:
        p.add("file_mounts", mounts, "write a mapping {node path: source}")
        return
    if _too_many(p, "file_mounts", items, 64):
        return
    found = []
    for path, entry in items:
        field = f"file_mounts.{path}"
        if not isinstance(path, str) or not path.strip():
            p.add("file_mounts", path, "each key is a path on the node, like /data")
            continue
        mount = _parse_mount(p, field, path.strip(), entry, canonical=isinstance(mounts, list))
        if mount is not None:
            found.append(mount)
    out["file_mounts"] = found


def _parse_mount(p: _Problems, field: str, path: str, entry: Any, *,
                 canonical: bool) -> FileMount | None:
    """One file_mounts entry, with SkyPilot's meaning: a plain source is copied; a mapping
    (SkyPilot's storage) mounts by default, and with ``name`` it is a bucket FleetBroker makes
    if absent (filled from a local ``source``). SkyPilot's refusals are kept: a bucket source
    with a name, a new bucket in COPY mode with nothing to copy into it."""
    spec = entry if isinstance(entry, Mapping) else {"source": entry}
    bad = set(spec) - _MOUNT_KEYS
    if bad:
        p.add(f"{field}.{sorted(map(str, bad))[0]}", None, "unknown key; a mount takes "
              "source, name, store and mode", show=False)
        return None
    source, name, store = spec.get("source"), spec.get("name"), spec.get("store")
    if isinstance(source, list) and len(source) == 1:
        source = source[0]
    if source is not None and (not isinstance(source, str) or not source.strip()):
        p.add(f"{field}.source", source, "write a source: a local path, s3://, gs://, az:// "
              "or https://")
        return None
    source = source.strip() if source is not None else None
    remote = source is not None and source.startswith(REMOTE_SCHEMES)
    bucket = remote and not source.startswith("https://")
    if source is None and name is None:
        p.add(f"{field}.source", None, "write a source (a local path, s3://, gs://, az:// or "
              "https://), or name: a bucket to create (like name: my-outputs)", show=False)
        return None
    if name is not None and (not isinstance(name, str) or not _BUCKET_NAME.match(name)):
        p.add(f"{field}.name", name, "a bucket name is 3-63 lowercase letters, digits, '.', "
              "'-' or '_', starting and ending with a letter or digit: write your bucket's name")
        return None
    if name is not None and remote:
        p.add(f"{field}.name", name, f"{source} names its bucket already: remove name (or "
              "remove source to create a bucket of that name)")
        return None
    if store is not None:
        store = str(store).strip().lower()
        if name is None:
            p.add(f"{field}.store", store, "store says where FleetBroker creates a bucket: "
                  "give name too, or remove store")
            return None
        if store not in STORE_SCHEMES:
            p.add(f"{field}.store", spec["store"], f"use one of {', '.join(STORE_SCHEMES)} "
                  "(the stores of FleetBroker's clouds)")
            return None
    # SkyPilot: a storage mapping mounts unless told otherwise; a plain string is copied. A
    # local path without a name has no bucket to mount, so it is copied as before.
    default = "MOUNT" if not canonical and isinstance(entry, Mapping) and (
        name is not None or bucket) else "COPY"
    mode = str(spec.get("mode") or default).upper()
    if mode not in MountMode.__members__:
        p.add(f"{field}.mode", spec.get("mode"), "use COPY, MOUNT or MOUNT_CACHED")
        return None
    if mode == "COPY" and name is not None and source is None:
        p.add(f"{field}.mode", mode, "a new bucket has nothing to copy: use mode: MOUNT to "
              "write into it, or give source (a local path uploaded into the bucket)")
        return None
    if mode != "COPY" and name is None and not bucket:
        p.add(f"{field}.mode", mode, "only a bucket (s3://, gs://, az://) can be mounted: use "
              "COPY, or give name to upload a local source into a bucket and mount that")
        return None
    return FileMount(path=path, source=source, mode=MountMode[mode], name=name, store=store)


def _resolve_envs(p: _Problems, envs: dict[str, str | None] | None,
                  secrets: dict[str, str | None] | None,
                  launch: LaunchEnv) -> tuple[dict[str, str] | None, dict[str, SecretStr]]:
    """The job's envs and secret values: the spec's, overridden by the launch's; a name the
    launch passes with ``--secret`` is a secret even where the spec lists it under envs. A name
    left without a value is a problem that names the fix."""
    for flag, names in (("--env", launch.envs), ("--secret", launch.secrets)):
        for k in names:
            if not _ENV_NAME.match(k) or k.startswith(_RESERVED_ENV_PREFIX):
                p.add(flag, k, "an environment variable name is letters, digits and '_', not "
                      f"starting with a digit or {_RESERVED_ENV_PREFIX}")
    given = {k: v.get_secret_value() for k, v in launch.secrets.items()}
    secret_names = [*(secrets or {}), *(k for k in given if k not in (secrets or {}))]
    out_envs: dict[str, str] = {}
    for k, v in {**(envs or {}), **launch.envs}.items():
        if k in given or k in (secrets or {}):
            continue  # a secret: never among the plain envs
        value = launch.envs.get(k, v)
        if value is None:
            p.add(f"envs.{k}", None, f"{k} has no value: pass --env {k}=... or --secret {k}",
                  show=False)
        else:
            out_envs[k] = value
    out_secrets: dict[str, SecretStr] = {}
    for k in [*secret_names, *(k for k in (envs or {}) if k in given)]:
        value = given.get(k, (secrets or {}).get(k))
        if value is None:
            p.add(f"secrets.{k}", None, f"{k} has no value: pass --secret {k} (its value from "
                  "your environment)", show=False)
        else:
            out_secrets[k] = SecretStr(value)
    return (None if envs is None else out_envs), out_secrets


def _parse_secret_names(p: _Problems, field: str, value: Any) -> list[str] | None:
    """A list of secret environment variable names (their values never sit in a spec)."""
    if not isinstance(value, list):
        p.add(field, value, "write a list of environment variable names")
        return None
    if _too_many(p, field, value, MAX_ENVS):
        return None
    bad = [v for v in value if not isinstance(v, str) or not _ENV_NAME.match(v)
           or v.startswith(_RESERVED_ENV_PREFIX)]
    if bad:
        p.add(field, bad[0], "an environment variable name is letters, digits and '_', not "
              f"starting with a digit or {_RESERVED_ENV_PREFIX}")
        return None
    return list(dict.fromkeys(value))


def _env_text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _parse_accelerators(p: _Problems, field: str, value: Any) -> list[Accelerator] | None:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        p.add(field, value,
              "write one accelerator or a list in order of preference, like [A100, V100]")
        return None
    if _too_many(p, field, items, MAX_LIST_ITEMS):
        return None
    before = len(p.items)
    out: list[Accelerator] = []
    for i, item in enumerate(items):
        acc = _accelerator(p, f"{field}[{i}]", item)
        if acc is not None and acc not in out:
            out.append(acc)
    return out if len(p.items) == before else None


def _accelerator(p: _Problems, field: str, name: Any) -> Accelerator | None:
    """A known accelerator, or a problem with the closest known name (never read as another)."""
    if isinstance(name, str):
        try:
            return Accelerator.parse(name)
        except UnknownAccelerator as exc:
            p.add(field, name, "unknown accelerator; " + str(exc).split("; ", 1)[1])
            return None
    p.add(field, name, "unknown accelerator; use one of: "
          + ", ".join(a.value for a in Accelerator))
    return None


def _parse_text(p: _Problems, field: str, value: Any, *, required: bool) -> str | None:
    if value is None:
        if required:
            p.add(field, None, "is required; give the shell command that runs the job",
                  show=False)
        return None
    if isinstance(value, list) and all(isinstance(x, str) for x in value):
        value = "\n".join(value)
    if not isinstance(value, str):
        p.add(field, value, "must be text (a shell command or script)")
        return None
    if "\0" in value:
        p.add(field, value, "contains a NUL character; remove it")
        return None
    size = _utf8_size(value)
    if size > MAX_TEXT_BYTES:
        p.add(field, f"{size:,} bytes", f"may be at most {MAX_TEXT_BYTES:,} bytes; put the "
              "script in a file the job fetches (in setup) and run that")
        return None
    return value


def _utf8_size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _too_many(p: _Problems, field: str, items: Any, limit: int) -> bool:
    """Is ``items`` longer than ``limit`` (then a problem is added)?"""
    if len(items) <= limit:
        return False
    p.add(field, f"{len(items):,} entries", f"may have at most {limit} entries")
    return True


def _parse_name(p: _Problems, field: str, value: Any) -> str | None:
    if not isinstance(value, str):
        p.add(field, value, "must be text: 1-63 lowercase letters, digits, '-', '_' or '.'")
        return None
    try:
        return check_name(value, field)
    except ValueError as exc:
        p.add(field, value, str(exc).split(" is invalid: ", 1)[-1])
        return None


def _parse_region_list(p: _Problems, field: str, value: Any) -> list[str] | None:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        p.add(field, value, "write a list of cloud:region patterns, like [aws:us-*, gcp:*]")
        return None
    if _too_many(p, field, items, MAX_LIST_ITEMS):
        return None
    out = []
    for i, item in enumerate(items):
        pat = item.strip().lower() if isinstance(item, str) else None
        if pat is not None and len(pat) > MAX_REGION_CHARS:
            p.add(f"{field}[{i}]", f"{len(pat):,} characters",
                  f"a region pattern has at most {MAX_REGION_CHARS} characters")
            continue
        if pat is not None and pat != "*" and ":" not in pat:
            pat = f"{pat}:*"  # a bare cloud name means all its regions
        if pat is None or (pat != "*" and not _REGION_PATTERN.match(pat)):
            p.add(f"{field}[{i}]", item, "write cloud:region with optional * wildcards, "
                  "like aws:us-east-1, aws:us-*, local:*")
            continue
        if unknown := _unknown_cloud(pat, bare=":" not in item):
            p.add(f"{field}[{i}]", item, unknown)
            continue
        out.append(pat)
    return out


def _unknown_cloud(pattern: str, *, bare: bool) -> str | None:
    """Why ``pattern``'s cloud matches no known cloud (a region written alone, a typo), or None."""
    cloud, _, region = pattern.partition(":")
    clouds = registry.names()
    if any(fnmatch.fnmatchcase(c, cloud) for c in clouds):
        return None
    if bare and (fix := _bare_region_fix(cloud)):
        return f"{cloud!r} has no cloud; {fix}"
    close = registry.meant(cloud)
    if close:
        fix = f"did you mean '{close}" + ("'?" if bare else f":{region}'?")
    else:
        fix = "write cloud:region, like aws:us-east-1"
    return f"unknown cloud {cloud!r} (the clouds are {', '.join(clouds)}); {fix}"


def _not_a_region(location: str) -> str | None:
    """Why ``cloud:region`` names no region its cloud could have (``aws:us-east1``), or None."""
    cloud, _, region = location.partition(":")
    known = registry.clouds().get(cloud)
    return None if known is None else known.region_problem(region)


def _bare_region_fix(region: str) -> str | None:
    """For a region written without its cloud: the pattern it meant (``europe-west4`` ->
    ``gcp:europe-west4``), or for a region glob the clouds to choose from; None for a word that
    looks like no region (then it reads as a mistyped cloud)."""
    if any(c in region for c in "*?["):
        return f"give its cloud, like aws:{region} or gcp:{region}" if "-" in region else None
    cloud = next((c.name for c in registry.clouds().values() if c.has_region_shape(region)),
                 None)
    return f"did you mean {cloud}:{region}?" if cloud else None


def _parse_regions(p: _Problems, value: Any) -> dict[str, list[str]] | None:
    if isinstance(value, list | str):
        allow = _parse_region_list(p, "regions", value)
        return None if allow is None else {"allow": allow, "deny": []}
    if not isinstance(value, Mapping):
        p.add("regions", value, "write {allow: [...], deny: [...]} with cloud:region patterns")
        return None
    unknown = set(value) - {"allow", "deny"}
    if unknown:
        p.add(f"regions.{sorted(map(str, unknown))[0]}", None,
              "unknown key; regions takes allow and deny", show=False)
        return None
    allow = _parse_region_list(p, "regions.allow", value.get("allow", ["*"]))
    deny = _parse_region_list(p, "regions.deny", value.get("deny", []))
    return None if allow is None or deny is None else {"allow": allow, "deny": deny}


def _parse_checkpoint(p: _Problems, value: Any) -> dict[str, Any] | None:
    if isinstance(value, str):
        value = {"uri": value}
    if not isinstance(value, Mapping):
        p.add("checkpoint", value, "write {uri: ..., interval: 100s | 500steps}")
        return None
    unknown = set(value) - {"uri", "region", "interval"}
    if unknown:
        p.add(f"checkpoint.{sorted(map(str, unknown))[0]}", None,
              "unknown key; checkpoint takes uri, region and interval", show=False)
        return None
    out: dict[str, Any] = {}
    uri = value.get("uri")
    if uri is not None:
        if not isinstance(uri, str) or not uri or len(uri) > 2048 or any(
                ord(ch) < 32 for ch in uri):
            p.add("checkpoint.uri", uri, "write a path or URL (file://, s3://, gs://, az://) "
                  "without control characters")
            return None
        out["uri"] = uri
    region = value.get("region")
    if region is not None:
        text = region.strip().lower() if isinstance(region, str) else ""
        why = None if not text or any(c in text for c in "*?[") else \
            f"has at most {MAX_REGION_CHARS} characters" if len(text) > MAX_REGION_CHARS else \
            _unknown_cloud(text, bare=":" not in text) or _not_a_region(text)
        if why or not _CLOUD_REGION.fullmatch(text):
            p.add("checkpoint.region", region, why or "write the bucket's cloud:region, like "
                  "aws:us-east-1 or gcp:europe-west4 (no patterns)")
            return None
        out["region"] = text
    interval = value.get("interval")
    if interval is not None:
        steps = re.fullmatch(r"\s*(\d{1,19})\s*steps?\s*", interval, re.ASCII) if isinstance(
            interval, str) else None
        secs = parse_duration(interval)
        if steps and int(steps.group(1)) >= 1:
            out["interval"] = f"{int(steps.group(1))}steps"
        elif secs is not None and 1 <= secs <= MAX_DEADLINE_S:
            out["interval"] = f"{int(secs)}s"
        else:
            p.add("checkpoint.interval", interval,
                  "write a time like 100s or 5m, or a step count like 500steps")
            return None
    return out


def _parse_spot(p: _Problems, field: str, value: Any) -> SpotPolicy | None:
    if isinstance(value, str):
        try:
            return SpotPolicy(value.strip().lower())
        except ValueError:
            pass
    p.add(field, value, "use one of: never, allowed, preferred")
    return None


def _choice(p: _Problems, field: str, value: Any, choices: Iterable[str]) -> str | None:
    options = list(choices)
    if isinstance(value, str) and value.strip().lower() in options:
        return value.strip().lower()
    p.add(field, value, "use one of: " + ", ".join(options))
    return None


def _unknown_keys(p: _Problems, keys: Iterable[str], known: set[str], what: str) -> None:
    for key in keys:
        if key in known:
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"remove it; {what} keys are: " + \
            ", ".join(sorted(known))
        p.add(key, None, f"unknown key; {hint}", show=False)


def _parse_fleet(doc: Mapping[str, Any], launch: LaunchEnv) -> ParsedSpec:
    p = _Problems()
    _unknown_keys(p, doc, _FLEET_KEYS, "job spec")
    out: dict[str, Any] = {}

    if "name" not in doc:
        p.add("name", None, "is required: 1-63 lowercase letters, digits, '-', '_' or '.'",
              show=False)
    else:
        out["name"] = _parse_name(p, "name", doc["name"])
    out["run"] = _parse_text(p, "run", doc.get("run"), required=True)
    if doc.get("setup") is not None:
        out["setup"] = _parse_text(p, "setup", doc["setup"], required=False)
    names = None
    if doc.get("secret_envs") is not None:
        names = _parse_secret_names(p, "secret_envs", doc["secret_envs"])
    envs, secret_values = _resolve_envs(p, _parse_envs(p, doc.get("envs")),
                                        dict.fromkeys(names or ()), launch)
    out["envs"], out["secret_envs"] = envs, list(secret_values)
    if "accelerators" in doc:
        out["accelerators"] = _parse_accelerators(p, "accelerators", doc["accelerators"])
    if "gpus" in doc:
        out["gpus"] = _parse_range(p, "gpus", doc["gpus"])
    # A node size with no accelerators asks for CPU nodes, as a SkyPilot task's does. A CPU job
    # is sized in whole nodes, not batches: like a SkyPilot task it needs no batch_size or work.
    if "accelerators" not in doc and any(doc.get(k) is not None for k in ("cpus", "memory")):
        out["accelerators"] = [Accelerator.CPU]
    cpu_job = Accelerator.CPU in (out.get("accelerators") or ())
    batch = None
    if cpu_job and "batch_size" not in doc:
        pass  # one unit per node, set below once nodes is known
    elif "batch_size" not in doc:
        p.add("batch_size", None, "is required: {min, max, default, per_gpu_max} global batch "
              "sizes (or one number for a fixed batch)", show=False)
    else:
        batch = out["batch_size"] = _parse_batch(p, doc["batch_size"])
    if "batch_mode" in doc:
        out["batch_mode"] = _choice(p, "batch_mode", doc["batch_mode"], ("elastic", "fixed"))
    if "work" in doc and "work_samples" in doc:
        p.add("work_samples", doc["work_samples"], "give work or work_samples, not both")
    elif "work" in doc:
        out["work_samples"] = _parse_work(p, doc["work"], batch)
    elif "work_samples" in doc:
        out["work_samples"] = _parse_work(p, {"samples": doc["work_samples"]}, batch)
    elif cpu_job:
        out["work_samples"] = UNBOUNDED_WORK  # it runs until its command ends, as a task does
    else:
        p.add("work", None, "is required: {samples: N}, {epochs: E, dataset_size: D} or "
              "{steps: S}", show=False)
    if "spot" in doc:
        out["spot"] = _parse_spot(p, "spot", doc["spot"])
    if "regions" in doc:
        out["regions"] = _parse_regions(p, doc["regions"])
    if "checkpoint" in doc:
        out["checkpoint"] = _parse_checkpoint(p, doc["checkpoint"])
    if "priority" in doc:
        out["priority"] = _int(p, "priority", doc["priority"])
    if "team" in doc:
        out["team"] = _parse_name(p, "team", doc["team"])
    if "model" in doc and doc["model"] is not None:
        out["model"] = _parse_name(p, "model", doc["model"])
    _parse_files(p, doc, out)
    if doc.get("nodes") is not None:
        out["nodes"] = _int(p, "nodes", doc["nodes"])
    for key in ("cpus", "memory"):  # a CPU job's node size (JobSpec checks the spelling)
        if doc.get(key) is not None:
            out[key] = str(doc[key])
    # A CPU job's units are its whole nodes (one unless given): its gpus and, as a SkyPilot
    # task's, its fixed batch follow them.
    if cpu_job and "nodes" not in p.fields:
        n = out.setdefault("nodes", 1)
        out.setdefault("gpus", {"min": n, "max": n})
        if "batch_size" not in doc:
            out["batch_size"] = {"min": n, "max": n, "default": n}
            out.setdefault("batch_mode", "fixed")
    if "run_per_node" in doc:
        out["run_per_node"] = doc["run_per_node"]  # the model names a value that is no bool
    if doc.get("container_image") is not None:
        out["container_image"] = _parse_image(p, "container_image", doc["container_image"])
    deadline_key = "deadline" if "deadline" in doc else "deadline_s"
    if doc.get(deadline_key) is not None:
        secs = parse_duration(doc[deadline_key])
        if secs is None or not 0 < secs <= MAX_DEADLINE_S:
            p.add(deadline_key, doc[deadline_key], "write a time after submission, like 90m, "
                  f"6h or 2d (at most {int(MAX_DEADLINE_S // 86400)}d)")
        else:
            out["deadline_s"] = secs
    return ParsedSpec(spec=_validate(p, out), format=FORMAT_FLEET, secrets=secret_values)


_FIELD_NAMES = {"work_samples": "work", "deadline_s": "deadline"}


def _validate(p: _Problems, fields: dict[str, Any]) -> JobSpec:
    """Run the model's own checks on what parsed cleanly; report both kinds of problem at once."""
    clean = {k: v for k, v in fields.items() if v is not None}
    try:
        spec = JobSpec.model_validate(clean)
    except ValidationError as exc:
        for err in exc.errors():
            loc = [str(x) for x in err["loc"]]
            if not loc and isinstance(cause := err.get("ctx", {}).get("error"), SpecFieldError):
                loc = [cause.field]  # a check across fields, reported at the one to fix
            if loc and (loc[0] in p.fields or _FIELD_NAMES.get(loc[0]) in p.fields):
                continue  # already reported with a better message
            if loc:
                loc[0] = _FIELD_NAMES.get(loc[0], loc[0])
            field = ".".join(loc) or "(top level)"
            msg = err["msg"].removeprefix("Value error, ")
            value = err.get("input") if err["type"] != "missing" else None
            p.add(field, value, msg, show=err["type"] != "missing" and loc != [])
        p.raise_if_any()
        raise  # pragma: no cover - raise_if_any always raises here
    p.raise_if_any()
    size = _utf8_size(spec_to_json(spec))
    if size > MAX_SPEC_BYTES:
        raise SpecError([Problem(field="(spec)", value=f"{size:,} bytes", message=(
            f"the job record may be at most {MAX_SPEC_BYTES:,} bytes as JSON; shorten run, "
            "setup or envs"))])
    return spec


# --- SkyPilot task YAML ---------------------------------------------------------------------

_SKY_RESOURCE_KEYS = {
    "accelerators", "use_spot", "infra", "cloud", "region", "zone", "any_of", "ordered",
    "job_recovery", "spot_recovery", "cpus", "memory", "disk_size", "disk_tier",
    "network_tier", "autostop", "ports", "image_id",
}
# Resource keys with no meaning here: accepted, and the job carries a note saying so.
_SKY_NOTED_RESOURCES = {
    "cpus": "ignored; FleetBroker sizes nodes by accelerator",
    "memory": "ignored; FleetBroker sizes nodes by accelerator",
    "disk_size": "ignored; nodes get the fleet's disk",
    "disk_tier": "ignored; nodes get the fleet's disk",
    "network_tier": "ignored; nodes get the fleet's network",
    "autostop": "ignored; FleetBroker releases a job's nodes as soon as it ends",
    "ports": "not opened; a training job's nodes take no inbound traffic here",
}
_SKY_UNSUPPORTED_TOP = {
    "volumes": "FleetBroker mounts no volumes; remove volumes and fetch data in setup",
    "service": "SkyServe services are not jobs; FleetBroker runs training jobs only",
    "config": "per-task SkyPilot config has no FleetBroker meaning; remove it",
    "event_callback": "remove event_callback; follow the job with `fleet logs ID --follow`",
    "inputs": "remove inputs (SkyPilot's optimizer hint)",
    "outputs": "remove outputs (SkyPilot's optimizer hint)",
}
_SKY_RECOVERY = {"failover", "eager_next_region", "none"}


def _parse_skypilot(doc: Mapping[str, Any], launch: LaunchEnv, *,
                    default_name: str | None) -> ParsedSpec:
    p = _Problems()
    warnings: list[str] = []
    for key in doc:
        if key in _SKY_UNSUPPORTED_TOP:
            p.add(key, doc[key], f"not supported: {_SKY_UNSUPPORTED_TOP[key]}")
    _unknown_keys(p, doc, _SKY_KEYS, "SkyPilot task")
    out: dict[str, Any] = {}

    name = doc.get("name")
    if name is None:
        name = default_name or "sky-task"
        warnings.append(f"name: not given; the job is named {name!r}")
    if isinstance(name, str) and name != name.lower():
        warnings.append(f"name: {name!r} is lowercased to {name.lower()!r}")
        name = name.lower()
    out["name"] = _parse_name(p, "name", name)
    out["run"] = _parse_text(p, "run", doc.get("run"), required=True)
    if doc.get("setup") is not None:
        out["setup"] = _parse_text(p, "setup", doc["setup"], required=False)
    envs, secret_values = _resolve_envs(p, _parse_envs(p, doc.get("envs")),
                                        _parse_envs(p, doc.get("secrets"), "secrets"), launch)
    out["envs"], out["secret_envs"] = envs, list(secret_values)
    _parse_files(p, {k: _fill_envs(doc[k], envs or {}) for k in ("workdir", "file_mounts")
                     if k in doc}, out)
    nodes = _int(p, "num_nodes", doc.get("num_nodes", 1))
    if nodes is not None and not 1 <= nodes <= 512:
        p.add("num_nodes", nodes, "must lie in [1, 512]")
        nodes = None
    if nodes is None:  # reported; sized as one node, so no other field is blamed
        nodes = 1

    resources = doc.get("resources") or {}
    alternatives: list[Mapping[str, Any]] = [{}]
    if not isinstance(resources, Mapping):
        p.add("resources", resources, "write a mapping (accelerators, use_spot, infra, ...)")
        resources = {}
    else:
        alternatives = _sky_alternatives(p, resources, warnings)

    accelerators: list[Accelerator] = []
    counts: list[int] = []
    allow: list[str] = []
    spot_flags: list[bool] = []
    per_alt: set[frozenset[Accelerator]] = set()
    images: dict[str, str | None] = {}  # where -> the container image it names (None: none)
    kept = 0
    for i, alt in enumerate(alternatives):
        where = "resources" if len(alternatives) == 1 and not (
            "any_of" in resources or "ordered" in resources) else (
            f"resources.{'ordered' if 'ordered' in resources else 'any_of'}[{i}]")
        cloud = _sky_cloud(alt)
        if len(alternatives) > 1 and cloud is not None and cloud not in registry.names():
            warnings.append(f"{where}: dropped; FleetBroker has no cloud {cloud!r} (its clouds "
                            f"are {', '.join(registry.names())})")
            continue
        kept += 1
        found = _sky_accelerators(p, f"{where}.accelerators", alt.get("accelerators"))
        per_alt.add(frozenset(acc for acc, _ in found))
        for acc, count in found:
            if acc not in accelerators:
                accelerators.append(acc)
            counts.append(count)
        pattern = _sky_infra(p, where, alt, warnings)
        if pattern and pattern not in allow:
            allow.append(pattern)
        use_spot = alt.get("use_spot", False)
        if not isinstance(use_spot, bool):
            p.add(f"{where}.use_spot", use_spot, "write true or false")
        spot_flags.append(use_spot is True)
        for key in sorted(set(alt) & set(_SKY_NOTED_RESOURCES)):
            if found or key not in _SKY_NODE_SIZE:  # a CPU task's cpus and memory are kept
                warnings.append(f"{where}.{key}: {_SKY_NOTED_RESOURCES[key]}")
        images[where] = _sky_image(p, where, alt.get("image_id"), warnings)

    if alternatives and not kept:
        p.add(f"resources.{'ordered' if 'ordered' in resources else 'any_of'}",
              resources.get("any_of", resources.get("ordered")),
              f"every alternative names a cloud FleetBroker does not have; add one on "
              f"{', '.join(registry.names())}")
    if len(set(images.values())) > 1:  # one job runs in one image wherever it lands
        p.add(f"{next(iter(images))}.image_id", ", ".join(str(i) for i in images.values()),
              "the alternatives name different container images (or some none); give every "
              "alternative the same image_id: docker:<image>, or put it once under resources")
    elif image := next(iter(images.values()), None):
        out["container_image"] = image
    if not accelerators and not p.items:
        out.update(_sky_cpu_only(p, alternatives))
    if accelerators:
        out["accelerators"] = accelerators
    per_node = counts or [1]
    if len(set(per_node)) > 1:
        warnings.append(f"resources: alternatives ask for {sorted(set(per_node))} GPUs per "
                        "node; the job accepts any count in that range")
    lo, hi = min(per_node) * nodes, max(per_node) * nodes
    if hi > 4096:  # reported; the rest sized within the limit, so no other field is blamed
        p.add("resources.accelerators", hi, "asks for more than 4096 GPUs in total; "
              "lower the count or num_nodes")
        lo, hi = min(lo, 4096), 4096
    out["gpus"] = {"min": lo, "max": hi}
    out["nodes"] = nodes
    out["run_per_node"] = True
    # SkyPilot knows no batch sizes: a fixed-size job, one unit of batch per GPU.
    out["batch_size"] = {"min": lo, "max": hi, "default": lo}
    out["batch_mode"] = "fixed"
    if len(per_alt) > 1 and len(allow) > 1:
        warnings.append("resources: alternatives are combined (any listed accelerator in any "
                        "listed region); their pairings are not kept")
    if allow:
        out["regions"] = {"allow": allow, "deny": []}
    if any(spot_flags) and not all(spot_flags):
        out["spot"] = "allowed"
    elif all(spot_flags):
        out["spot"] = "preferred"
        warnings.append("use_spot: true becomes spot: preferred (the broker falls back to "
                        "on-demand when spot is gone)")
    else:
        out["spot"] = "never"
    out["work_samples"] = UNBOUNDED_WORK
    return ParsedSpec(spec=_validate(p, out), format=FORMAT_SKYPILOT, warnings=warnings,
                      secrets=secret_values)


def _sky_alternatives(p: _Problems, resources: Mapping[str, Any],
                      warnings: list[str]) -> list[Mapping[str, Any]]:
    """Expand ``any_of``/``ordered`` into full resource mappings (shared keys merged in)."""
    for key in resources:
        if key == "instance_type":
            p.add(f"resources.{key}", resources[key], "not supported; FleetBroker picks "
                  "instance types itself; name accelerators instead")
        elif key == "candidates":  # read by SkyPilot's removed `sky bench`; SkyPilot refuses it
            p.add(f"resources.{key}", resources[key], "unknown key; did you mean 'any_of'? "
                  "SkyPilot tasks list alternative resources under any_of: rename candidates "
                  "to any_of")
        elif key not in _SKY_RESOURCE_KEYS:
            close = difflib.get_close_matches(str(key), sorted(_SKY_RESOURCE_KEYS), n=1)
            fix = f"did you mean {close[0]!r}?" if close else "remove it"
            p.add(f"resources.{key}", resources[key], f"unknown key; {fix}")
    recovery = resources.get("job_recovery", resources.get("spot_recovery"))
    if recovery is not None:
        _sky_recovery(p, recovery, warnings)
    groups = [k for k in ("any_of", "ordered") if k in resources]
    if len(groups) > 1:
        p.add("resources", "any_of + ordered", "use either any_of or ordered, not both")
        return [resources]
    if not groups:
        return [resources]
    key = groups[0]
    items = resources[key]
    if not isinstance(items, list) or not items or not all(isinstance(x, Mapping) for x in items):
        p.add(f"resources.{key}", items, "write a list of resource mappings")
        return [resources]
    if _too_many(p, f"resources.{key}", items, MAX_LIST_ITEMS):
        return [resources]
    shared = {k: v for k, v in resources.items() if k not in ("any_of", "ordered")}
    alts = []
    for i, item in enumerate(items):
        for k in item:
            if k not in _SKY_RESOURCE_KEYS or k in ("any_of", "ordered", "job_recovery",
                                                    "spot_recovery"):
                p.add(f"resources.{key}[{i}].{k}", item[k], "not supported inside "
                      f"{key}; put it under resources or remove it")
        alts.append({**shared, **item})
    return alts


def _sky_cloud(alt: Mapping[str, Any]) -> str | None:
    """The cloud a resource alternative names (``infra: k8s/...`` or ``cloud: lambda``)."""
    value = alt.get("infra", alt.get("cloud"))
    if not isinstance(value, str) or not value.strip():
        return None
    cloud = value.strip().lower().split("/")[0]
    return None if cloud == "*" else cloud


def _sky_image(p: _Problems, where: str, image: Any, warnings: list[str]) -> str | None:
    """A container image (``docker:<image>``) is what the task's setup and run execute in, as on
    SkyPilot: it becomes ``container_image``, returned. A cloud's machine image (an AMI, a GCP
    image) is replaced by the fleet's node image, with a note (None)."""
    if image is None:
        return None
    images = list(image.values()) if isinstance(image, Mapping) else [image]
    docker = [i for i in images if isinstance(i, str) and i.strip().lower().startswith("docker:")]
    if not docker:
        warnings.append(f"{where}.image_id: not used; every node boots the fleet's own image "
                        "(install what the task needs in setup)")
        return None
    refs = {i.strip()[len("docker:"):].strip() for i in docker}
    if len(docker) != len(images) or len(refs) > 1:  # a per-region mapping of images
        p.add(f"{where}.image_id", image, "give one container image for every region: "
              "image_id: docker:<image>")
        return None
    return _parse_image(p, f"{where}.image_id", refs.pop(), prefix="docker:")


def _parse_image(p: _Problems, field: str, value: Any, prefix: str = "") -> str | None:
    try:
        return check_image(value) if isinstance(value, str) else check_image(str(value))
    except ValueError as exc:
        p.add(field, f"{prefix}{value}", str(exc))
        return None


def _sky_cpu_only(p: _Problems, alternatives: list[Mapping[str, Any]]) -> dict[str, Any]:
    """A task naming no accelerator is a CPU task in SkyPilot: it becomes a CPU job
    (``accelerators: [CPU]``), which only a CPU pool hosts, never a GPU, with the ``cpus`` and
    ``memory`` per node it asks (SkyPilot's ``4`` exactly, ``4+`` at least)."""
    out: dict[str, Any] = {"accelerators": [Accelerator.CPU]}
    for key, unit in _SKY_NODE_SIZE.items():
        asked = {_sky_size(alt[key]) for alt in alternatives if alt.get(key) is not None}
        where = "resources" if len(alternatives) == 1 else "resources.any_of"
        if None in asked:
            bad = next(alt[key] for alt in alternatives if alt.get(key) is not None
                       and _sky_size(alt[key]) is None)
            p.add(f"{where}.{key}", bad, f"write {unit} per node, like 4 (exactly 4) or 4+ "
                  "(at least 4)")
        elif len(asked) > 1:
            p.add(f"{where}.{key}", sorted(a for a in asked if a), "alternatives ask "
                  f"different {key}; a CPU job has one node size: give one {key}")
        elif asked:
            out[key] = asked.pop()
    return out


# A CPU task's per-node size keys and what each counts.
_SKY_NODE_SIZE = {"cpus": "the vCPUs", "memory": "the GiB of memory"}


def _sky_size(value: Any) -> str | None:
    """A SkyPilot size (``2``, ``2+``, ``0.5``, ``'16+'``) as ``JobSpec.cpus`` spells it, or
    None where it is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    text = str(value).strip()
    if isinstance(value, float) and value.is_integer():
        text = str(int(value))
    return text if re.fullmatch(NODE_SIZE, text) and float(text.rstrip("+")) > 0 else None


def _sky_recovery(p: _Problems, value: Any, warnings: list[str]) -> None:
    strategy = value.get("strategy") if isinstance(value, Mapping) else value
    if isinstance(value, Mapping):
        for k in value:
            if k not in ("strategy", "max_restarts_on_errors"):
                p.add(f"resources.job_recovery.{k}", value[k],
                      "unknown key; job_recovery takes strategy and max_restarts_on_errors")
        if value.get("max_restarts_on_errors"):
            warnings.append("resources.job_recovery.max_restarts_on_errors: not applied; a job "
                            "whose command fails ends as failed")
    if strategy is None:
        return
    if not isinstance(strategy, str) or strategy.strip().lower() not in _SKY_RECOVERY:
        p.add("resources.job_recovery.strategy", strategy,
              "use FAILOVER or EAGER_NEXT_REGION")
    elif strategy.strip().lower() == "none":
        warnings.append("resources.job_recovery: FleetBroker always recovers preempted jobs")


_SKY_ACC = re.compile(r"^\s*([^:]+?)\s*(?::\s*([0-9.]+)\s*)?$")


def _sky_accelerators(p: _Problems, field: str, value: Any) -> list[tuple[Accelerator, int]]:
    """``A100:8``, ``A100``, a list (ordered), a mapping or a set ``{A100: 8, V100: 8}``."""
    if value is None:
        return []
    if isinstance(value, str) and len(value) > MAX_REGION_CHARS:
        p.add(field, value, f"write NAME or NAME:COUNT, like A100:8 (at most "
              f"{MAX_REGION_CHARS} characters)")
        return []
    if isinstance(value, str):
        entries: list[tuple[Any, Any]] = []
        m = _SKY_ACC.match(value)
        if m:
            entries.append((m.group(1), m.group(2)))
        else:
            p.add(field, value, "write NAME or NAME:COUNT, like A100:8")
            return []
    elif isinstance(value, list | Mapping) and _too_many(p, field, value, MAX_LIST_ITEMS):
        return []
    elif isinstance(value, list):
        out: list[tuple[Accelerator, int]] = []
        for i, item in enumerate(value):
            out += _sky_accelerators(p, f"{field}[{i}]", item)
        return out
    elif isinstance(value, Mapping):
        # `{A100:8, V100:8}` loads as keys "A100:8" with no value (YAML needs ": " to split).
        entries = []
        for k, v in value.items():
            m = _SKY_ACC.match(k) if isinstance(k, str) and v is None and \
                len(k) <= MAX_REGION_CHARS else None
            entries.append((m.group(1), m.group(2)) if m else (k, v))
    else:
        p.add(field, value, "write NAME:COUNT, a list or a mapping of them")
        return []
    result = []
    for name, count in entries:
        acc = _accelerator(p, field, name)
        if acc is None:
            continue
        n = 1 if count is None else count
        if isinstance(n, str):
            try:
                n = float(n)
            except ValueError:
                n = None
        if isinstance(n, float) and n.is_integer():
            n = int(n)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 4096:
            p.add(field, f"{name}:{count}", "the count must be a whole number of GPUs in "
                  "[1, 4096]; fractional GPUs are not supported")
            continue
        result.append((acc, n))
    return result


def _sky_infra(p: _Problems, where: str, alt: Mapping[str, Any],
               warnings: list[str]) -> str | None:
    """``infra: aws/us-east-1[/zone]`` (or the older cloud/region/zone keys) to a pattern."""
    if "infra" in alt and any(k in alt for k in ("cloud", "region", "zone")):
        p.add(f"{where}.infra", alt["infra"], "give infra or cloud/region/zone, not both")
        return None
    if "infra" in alt:
        infra = alt["infra"]
        if not isinstance(infra, str) or not infra.strip():
            p.add(f"{where}.infra", infra, "write cloud[/region[/zone]], like aws/us-east-1")
            return None
        parts = infra.strip().lower().split("/")
        field = f"{where}.infra"
    else:
        parts = [alt.get("cloud"), alt.get("region"), alt.get("zone")]
        while parts and parts[-1] is None:
            parts.pop()
        if not parts:
            return None
        if any(x is None or not isinstance(x, str) for x in parts):
            p.add(f"{where}.cloud", alt.get("cloud"), "region and zone need a cloud; "
                  "write infra: cloud/region")
            return None
        parts = [x.strip().lower() for x in parts]
        field = f"{where}.cloud"
    if len(parts) > 3:
        p.add(field, "/".join(parts), "write cloud[/region[/zone]], like aws/us-east-1")
        return None
    cloud = parts[0]
    if cloud not in registry.names() and cloud != "*":
        p.add(field, cloud, "this cloud is not supported; use one of: "
              + ", ".join(registry.names()))
        return None
    region = parts[1] if len(parts) > 1 else "*"
    pattern = f"{cloud}:{region}"
    if not _REGION_PATTERN.match(pattern):
        p.add(field, "/".join(parts), "write cloud[/region[/zone]], like aws/us-east-1")
        return None
    if len(parts) == 3:
        warnings.append(f"{field}: zone {parts[2]!r} widens to region {pattern!r} "
                        "(FleetBroker places jobs by region)")
    return pattern


def spec_to_json(spec: JobSpec) -> str:
    """The canonical JSON a client sends to the API (parses back to the same ``JobSpec``)."""
    return json.dumps(spec.model_dump(mode="json"), ensure_ascii=False)


def apply_overrides(spec: JobSpec, *, gpus: str | None = None,
                    spot: str | None = None) -> JobSpec:
    """``fleet launch --gpus N|MIN:MAX --spot POLICY``: replace those fields and re-validate."""
    p = _Problems()
    data = spec.model_dump(mode="json")
    if gpus is not None:
        rng = _parse_range(p, "--gpus", gpus)
        if rng is not None:
            data["gpus"] = rng
    if spot is not None:
        policy = _parse_spot(p, "--spot", spot)
        if policy is not None:
            data["spot"] = policy.value
    return _validate(p, data)
