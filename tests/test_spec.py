"""Job specs: the own YAML format, SkyPilot task YAML, and every class of malformed input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.spec import (
    FORMAT_FLEET,
    FORMAT_SKYPILOT,
    MAX_SPEC_BYTES,
    UNBOUNDED_WORK,
    SpecError,
    apply_overrides,
    load_spec_file,
    parse_duration,
    parse_spec_data,
    parse_spec_text,
    spec_to_json,
)
from policies.models import NODE_SIZE, Accelerator, BatchMode, JobSpec, Market, Pool, SpotPolicy
from policies.placement import region_allowed

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "jobs"

BASE = """
name: digits
run: python examples/train_digits.py --steps 10
batch_size: {min: 32, max: 256, default: 64, per_gpu_max: 128}
work: {samples: 6400}
"""


def problems(text: str) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_spec_text(text)
    return [str(p) for p in info.value.problems]


def test_own_format_every_field() -> None:
    parsed = parse_spec_text(BASE + """
setup: pip list
envs: {OMP_NUM_THREADS: 1, FLAG: true}
accelerators: [t4, V100-32GB]
gpus: 1:4
batch_mode: fixed
spot: preferred
regions: {allow: [local:*, aws], deny: ["aws:us-west-*"]}
checkpoint: {uri: "s3://bucket/ck", region: aws:us-east-1, interval: 2m}
priority: 5
team: ml
deadline: 1h30m
model: cifar10
""")
    s = parsed.spec
    assert parsed.format == FORMAT_FLEET and parsed.warnings == []
    assert s.accelerators == [Accelerator.T4, Accelerator.V100]
    assert (s.gpus.min, s.gpus.max) == (1, 4)
    assert (s.batch_size.min, s.batch_size.max, s.batch_size.initial) == (32, 256, 64)
    assert s.batch_mode is BatchMode.FIXED and s.spot is SpotPolicy.PREFERRED
    assert s.envs == {"OMP_NUM_THREADS": "1", "FLAG": "true"}
    assert s.regions.allow == ["local:*", "aws:*"] and s.regions.deny == ["aws:us-west-*"]
    assert s.checkpoint.uri == "s3://bucket/ck" and s.checkpoint.interval == "120s"
    assert s.checkpoint.region == "aws:us-east-1"
    assert (s.priority, s.team, s.deadline_s, s.model) == (5, "ml", 5400.0, "cifar10")


def test_region_patterns_may_glob_the_cloud() -> None:
    text = BASE + "regions: {allow: ['*:us-*', 'a*:eu-*', '*'], deny: [AZURE, 'g?p:asia-*']}"
    s = parse_spec_text(text).spec
    assert s.regions.allow == ["*:us-*", "a*:eu-*", "*"]
    assert s.regions.deny == ["azure:*", "g?p:asia-*"]


def test_region_patterns_select_the_pools_placement_allows() -> None:
    """The spec's patterns are what placement matches ``cloud:region`` against."""
    text = BASE + ("regions: {allow: ['aws:us-*', 'GCP:europe-west4', 'azure:*'], "
                   "deny: ['aws:us-west-*']}")
    regions = parse_spec_text(text).spec.regions
    pools = {f"{c}:{r}": Pool(cloud=c, region=r, accelerator=Accelerator.V100, market=Market.SPOT,
                              nodes=1, gpus_per_node=1, price_per_gpu_hour=1.0)
             for c, r in [("aws", "us-east-1"), ("aws", "us-west-2"), ("aws", "eu-west-1"),
                          ("gcp", "europe-west4"), ("gcp", "us-central1"), ("azure", "eastus")]}
    allowed = {k for k, pool in pools.items()
               if region_allowed(pool, regions.allow, regions.deny)}
    assert allowed == {"aws:us-east-1", "gcp:europe-west4", "azure:eastus"}


@pytest.mark.parametrize(("work", "samples"), [
    ("{samples: 1000}", 1000), ("{epochs: 3, dataset_size: 1797}", 5391), ("{steps: 10}", 640),
])
def test_work_forms(work: str, samples: int) -> None:
    text = BASE.replace("work: {samples: 6400}", f"work: {work}")
    assert parse_spec_text(text).spec.work_samples == samples


def test_gpu_and_batch_shorthands() -> None:
    s = parse_spec_text(BASE.replace("batch_size: {min: 32, max: 256, default: 64, "
                                     "per_gpu_max: 128}", "batch_size: 96") + "gpus: 3\n").spec
    assert (s.gpus.min, s.gpus.max) == (3, 3)
    assert (s.batch_size.min, s.batch_size.max, s.batch_size.default) == (96, 96, 96)


def test_gpus_default_is_the_size_the_job_asks_for() -> None:
    """``gpus.default``: the size a deadline's pace is judged at; none: ``max``."""
    s = parse_spec_text(BASE + "gpus: {min: 1, max: 8, default: 4}\n").spec
    assert (s.gpus.min, s.gpus.max, s.gpus.default, s.gpus.requested) == (1, 8, 4, 4)
    assert parse_spec_text(BASE + "gpus: 2:6\n").spec.gpus.requested == 6
    assert any("gpus.default" in p and "[1, 8]" in p
               for p in problems(BASE + "gpus: {min: 1, max: 8, default: 9}\n"))


def test_examples_all_parse() -> None:
    files = sorted(EXAMPLES.glob("*.yaml"))
    formats = {load_spec_file(f).format for f in files}
    assert len(files) >= 4 and formats == {FORMAT_FLEET, FORMAT_SKYPILOT}
    for f in files:
        spec = load_spec_file(f).spec
        assert "train_digits.py" in spec.run


@pytest.mark.parametrize(("text", "field", "fix"), [
    ("name: [unclosed", "line 1", "malformed YAML"),
    ("name: a\nname: b\nrun: x", "line 2", "duplicate key 'name'"),
    ("- a\n- b", "(file)", "YAML mapping"),
    ("", "(file)", "empty"),
    ("a: 1\n---\nb: 2\n", "(file)", "one job per file"),
    (BASE + "accelerators: [TPU-v4]", "accelerators[0]", "use one of: T4"),
    (BASE + "gpus: -2", "gpus.min", "greater than or equal to 1"),
    (BASE + "gpus: {min: 8, max: 2}", "gpus", "must not exceed"),
    (BASE + "gpus: 1000000000", "gpus.min", "less than or equal to 4096"),
    (BASE + "priority: 99999999999999999999", "priority", "less than or equal to 100"),
    (BASE.replace("{samples: 6400}", "{samples: 10000000000000000000000}"), "work",
     "must lie in"),
    (BASE.replace("name: digits", "name: ../../etc/passwd"), "name", "lowercase letters"),
    (BASE.replace("name: digits", "name: a/b"), "name", "lowercase letters"),
    (BASE.replace("name: digits", 'name: "bad\\x07name"'), "name", "lowercase letters"),
    (BASE.replace("name: digits", 'name: "new\\nline"'), "name", "lowercase letters"),
    (BASE + "team: 'a\\b'", "team", "lowercase letters"),
    (BASE + "spot: yes", "spot", "never, allowed, preferred"),
    (BASE + "deadline: tomorrow", "deadline", "like 90m"),
    (BASE + "deadline: .inf", "deadline", "like 90m"),
    (BASE + "regions: {allow: ['us east']}", "regions.allow[0]", "cloud:region"),
    (BASE + "regions: [us-east-1]", "regions[0]",
     "'us-east-1' has no cloud; did you mean aws:us-east-1?"),
    (BASE + "regions: {allow: [local, europe-west4]}", "regions.allow[1]",
     "'europe-west4' has no cloud; did you mean gcp:europe-west4?"),
    (BASE + "regions: {deny: [westeurope]}", "regions.deny[0]",
     "'westeurope' has no cloud; did you mean azure:westeurope?"),
    (BASE + "regions: {allow: ['us-*']}", "regions.allow[0]",
     "'us-*' has no cloud; give its cloud, like aws:us-* or gcp:us-*"),
    (BASE + "regions: {allow: ['asw:us-east-1']}", "regions.allow[0]",
     "unknown cloud 'asw' (the clouds are aws, gcp, azure, local); did you mean 'aws:us-east-1'?"),
    (BASE + "regions: {allow: ['google:us-central1']}", "regions.allow[0]",
     "did you mean 'gcp:us-central1'?"),
    (BASE + "regions: {deny: ['gpc:*']}", "regions.deny[0]", "did you mean 'gcp:*'?"),
    (BASE + "regions: {allow: [aws, 'x*:eu-*']}", "regions.allow[1]", "unknown cloud 'x*'"),
    (BASE + "checkpoint: {interval: often}", "checkpoint.interval", "500steps"),
    (BASE + "checkpoint: {region: us-east-1}", "checkpoint.region",
     "did you mean aws:us-east-1?"),
    (BASE + "checkpoint: {region: 's3:us-east-1'}", "checkpoint.region", "unknown cloud 's3'"),
    (BASE + "checkpoint: {region: 'aws:us-east1'}", "checkpoint.region",
     "write one like aws:us-east-1"),
    (BASE + "checkpoint: {region: 'gcp:us-east-1'}", "checkpoint.region",
     "'us-east-1' is not a gcp region name"),
    (BASE + "checkpoint: {region: 'gpc:europe-west4'}", "checkpoint.region",
     "did you mean 'gcp:europe-west4'?"),
    (BASE + "checkpoint: {region: 'aws:us-*'}", "checkpoint.region", "no patterns"),
    (BASE + "checkpoint: {bucket: x}", "checkpoint.bucket", "uri, region and interval"),
    (BASE + "envs: {FLEET_RANK: 1}", "envs.FLEET_RANK", "set by the broker"),
    (BASE + "envs: {'1BAD': x}", "envs", "environment variable name"),
    (BASE + "gpu: 2", "gpu", "did you mean 'gpus'"),
    (BASE.replace("per_gpu_max", "step"), "batch_size.step", "unknown key"),
    (BASE + "nodes: 2\ngpus: 3", "gpus", "must split evenly over nodes (2)"),
    (BASE + "container_image: python:3.11", "run_per_node", "set run_per_node: true"),
    ("name: x\nrun: y\nbatch_size: 4\nresources: {}\n", "(top level)", "one format per file"),
    ("a: " + "9" * 5000, "(file)", "4300 digits"),
    ('{"a": ' + "9" * 5000 + "}", "(file)", "4300 digits"),
    ('{"run": "x", "run": "y"}', "(file)", "duplicate key 'run'"),
    ("a: " + "[" * 3000, "line 1", "nesting depth"),
    ("a: " + "[" * 100, "a[0]", "nests deeper than 32 levels"),
    (BASE + "envs: &e [*e]", "envs[0]", "contains itself"),
    (BASE + "envs: {X: &x '" + "x" * 1000 + "'}\nsetup: [" + "*x," * 300 + "]", "setup[",
     "bytes of text"),
    (BASE + "setup: [" + "a," * 3000 + "]", "setup[", "more than 2,000 values"),
    ('{"run": ' + "[" * 50 + "]" * 50 + "}", "run[0]", "nests deeper than 32 levels"),
    ('{"run": [' + "1," * 3000 + "1]}", "run", "more than 2,000 values"),
    (BASE + "setup: '" + "s" * (64 * 1024 + 1) + "'", "setup", "at most 65,536 bytes"),
    (BASE + "envs: {" + ", ".join(f"V{i}: v" for i in range(257)) + "}", "envs",
     "at most 256 entries"),
    (BASE + "envs: {BIG: '" + "e" * (16 * 1024 + 1) + "'}", "envs.BIG", "16,384 bytes"),
    (BASE + "envs: {" + ", ".join(f"V{i}: '{'v' * 16_000}'" for i in range(5)) + "}", "envs",
     "total at most 65,536 bytes"),
    # each field under its cap, but tabs double in JSON: the stored record would be too big
    ("name: t\nbatch_size: 1\nwork: {samples: 1}\nrun: '" + "\t" * 65_000 + "'\nsetup: '"
     + "\t" * 65_000 + "'\nenvs: {" + ", ".join(f"V{i}: '{chr(9) * 15_000}'" for i in range(3))
     + "}", "(spec)", "at most 262,144 bytes as JSON"),
    (BASE + "accelerators: [" + "T4," * 65 + "]", "accelerators", "at most 64 entries"),
    (BASE + "regions: ['aws:" + "a" * 70 + "']", "regions[0]", "at most 64 characters"),
    (BASE + "deadline: '" + " " * 300 + "x'", "deadline", "write a time"),
    (BASE + "gpus: '1:\u00b2'", "gpus", "MIN:MAX"),
    ("a: !!python/object/apply:os.system [ls]", "line 1", "could not determine a constructor"),
])
def test_malformed_specs_name_field_and_fix(text: str, field: str, fix: str) -> None:
    found = problems(text)
    assert any(p.startswith(field) and fix in p for p in found), found


def test_all_problems_reported_together() -> None:
    found = problems("name: A/B\nrun: 3\nbatch_size: {min: 0, max: 1}\ngpus: -1\n")
    fields = {p.split(" ")[0].rstrip(":") for p in found}
    assert {"name", "run", "work", "gpus.min", "batch_size.min"} <= fields


def test_size_limit() -> None:
    assert any("at most" in p for p in problems("run: '" + "x" * MAX_SPEC_BYTES + "'"))


def test_nul_and_control_characters_rejected_via_json() -> None:
    doc = yaml.safe_load(BASE)
    for field in ("name", "team"):
        with pytest.raises(SpecError, match=field):
            parse_spec_data({**doc, field: "ok\x00bad"})
    with pytest.raises(SpecError, match="NUL"):
        parse_spec_data({**doc, "run": "echo \x00"})


def test_skypilot_task_translated() -> None:
    parsed = parse_spec_text("""
name: Train
num_nodes: 2
resources:
  accelerators: A100:8
  use_spot: true
  infra: aws/us-east-1
  job_recovery: {strategy: FAILOVER, max_restarts_on_errors: 2}
  disk_size: 256
envs: {EPOCHS: 3}
setup: pip install -r requirements.txt
run: torchrun --nnodes=$SKYPILOT_NUM_NODES train.py
""")
    s = parsed.spec
    assert parsed.format == FORMAT_SKYPILOT
    assert s.name == "train" and s.accelerators == [Accelerator.A100]
    assert (s.gpus.min, s.gpus.max) == (16, 16) and s.batch_mode is BatchMode.FIXED
    assert s.regions.allow == ["aws:us-east-1"] and s.spot is SpotPolicy.PREFERRED
    assert s.envs == {"EPOCHS": "3"} and s.work_samples == UNBOUNDED_WORK
    joined = "\n".join(parsed.warnings)
    for note in ("lowercased", "max_restarts_on_errors", "disk_size", "spot: preferred"):
        assert note in joined


@pytest.mark.parametrize(("accelerators", "want", "gpus"), [
    ("V100", [Accelerator.V100], (1, 1)),
    ("'T4:4'", [Accelerator.T4], (4, 4)),
    ("[A100:8, V100:8]", [Accelerator.A100, Accelerator.V100], (8, 8)),
    ("{A100:8, V100:4}", [Accelerator.A100, Accelerator.V100], (4, 8)),
    ("{A100: 2, T4: 2}", [Accelerator.A100, Accelerator.T4], (2, 2)),
    ("{A100, H100}", [Accelerator.A100, Accelerator.H100], (1, 1)),
])
def test_skypilot_accelerator_forms(accelerators: str, want: list[Accelerator],
                                    gpus: tuple[int, int]) -> None:
    s = parse_spec_text(f"run: x\nresources:\n  accelerators: {accelerators}\n").spec
    assert s.accelerators == want and (s.gpus.min, s.gpus.max) == gpus
    assert s.spot is SpotPolicy.NEVER


def test_skypilot_any_of_and_ordered() -> None:
    parsed = parse_spec_text("""
run: python train.py
resources:
  use_spot: true
  ordered:
    - {accelerators: A100:1, infra: gcp/us-central1}
    - {accelerators: V100:1, infra: aws}
""", default_name="my-job")
    s = parsed.spec
    assert s.name == "my-job" and s.accelerators == [Accelerator.A100, Accelerator.V100]
    assert s.regions.allow == ["gcp:us-central1", "aws:*"]
    assert any("pairings are not kept" in w for w in parsed.warnings)
    mixed = parse_spec_text("run: x\nresources:\n  accelerators: T4:1\n  any_of:\n"
                            "    - {use_spot: true}\n    - {use_spot: false}\n").spec
    assert mixed.spot is SpotPolicy.ALLOWED


@pytest.mark.parametrize(("text", "field", "fix"), [
    ("run: x\nworkdir: s3://b/code", "workdir", "use file_mounts"),
    ("run: x\nfile_mounts: {/data: {name: my-bucket, mode: COPY}}", "file_mounts./data.mode",
     "a new bucket has nothing to copy"),
    ("run: x\nfile_mounts: {/data: {source: ./d, mode: MOUNT}}", "file_mounts./data.mode",
     "only a bucket"),
    ("run: x\nfile_mounts: {/data: {source: s3://b, mode: FAST}}", "file_mounts./data.mode",
     "COPY, MOUNT or MOUNT_CACHED"),
    ("run: x\nfile_mounts: {/data: {source: s3://b, size: 3}}", "file_mounts./data.size",
     "unknown key"),
    ("run: x\nservice: {replicas: 2}", "service", "not supported"),
    ("run: x\nresources: {instance_type: p3.2xlarge}", "resources.instance_type",
     "name accelerators"),
    ("run: x\nresources: {infra: k8s/my-ctx}", "resources.infra", "not supported"),
    ("run: x\nresources: {accelerators: tpu-v3-8}", "resources.accelerators", "use one of"),
    ("run: x\nresources: {accelerators: 'A100:0.5'}", "resources.accelerators", "fractional"),
    ("run: x\nresources: {accelerators: 'A100:8'}\nnum_nodes: 1000",
     "num_nodes", "[1, 512]"),
    ("run: x\nresources: {use_spot: maybe}", "resources.use_spot", "true or false"),
    ("run: x\nresources: {job_recovery: {strategy: RETRY}}", "resources.job_recovery.strategy",
     "FAILOVER"),
    ("run: x\nenvs: {TOKEN: null}", "envs.TOKEN", "has no value"),
    ("run: x\nresources: {acelerators: T4}", "resources.acelerators",
     "did you mean 'accelerators'?"),
    ("run: x\nresources: {any_of: [{accelerators: T4}], ordered: [{accelerators: T4}]}",
     "resources", "not both"),
    ("run: x\nnum_nodes: 2\nnodes: 3", "nodes", "did you mean 'num_nodes'"),
    ("setup: x", "run", "required"),
])
def test_skypilot_unsupported_keys_are_errors(text: str, field: str, fix: str) -> None:
    found = problems(text)
    assert any(p.startswith(field) and fix in p for p in found), found


@pytest.mark.parametrize(("gpus", "count", "field"), [
    ("T4", "two", "num_nodes"), ("T4", 0, "num_nodes"), ("T4", 1000, "num_nodes"),
    ("'A100:16'", 512, "resources.accelerators"),  # 8,192 GPUs in all
])
def test_a_bad_node_count_is_the_one_problem_named(gpus: str, count: object,
                                                   field: str) -> None:
    """A task whose only fault is its size hears of that alone, not of a batch size (which
    SkyPilot tasks never give) left unset by the size it could not take."""
    found = problems(f"run: x\nresources: {{accelerators: {gpus}}}\nnum_nodes: {count}")
    assert len(found) == 1 and found[0].startswith(field), found


def test_zone_widens_to_region_with_warning() -> None:
    parsed = parse_spec_text("run: x\nresources: {infra: aws/us-east-1/us-east-1a, "
                             "accelerators: T4}")
    assert parsed.spec.regions.allow == ["aws:us-east-1"]
    assert any("us-east-1a" in w for w in parsed.warnings)


def test_overrides() -> None:
    spec = parse_spec_text(BASE).spec
    changed = apply_overrides(spec, gpus="2:6", spot="never")
    assert (changed.gpus.min, changed.gpus.max, changed.spot) == (2, 6, SpotPolicy.NEVER)
    assert apply_overrides(spec, gpus="3").gpus.max == 3
    for gpus, spot, field in (("0", None, "gpus.min"), ("x:y", None, "--gpus"),
                              (None, "sometimes", "--spot"), ("9:2", None, "gpus")):
        with pytest.raises(SpecError) as info:
            apply_overrides(spec, gpus=gpus, spot=spot)
        assert info.value.problems[0].field == field


def test_missing_file_names_path(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read it"):
        load_spec_file(tmp_path / "nope.yaml")


@pytest.mark.parametrize(("raw", "secs"), [
    (90, 90.0), ("90s", 90.0), ("5m", 300.0), ("1h30m", 5400.0), ("2d", 172800.0),
    ("", None), ("soon", None), (True, None), (float("nan"), None),
])
def test_parse_duration(raw: object, secs: float | None) -> None:
    assert parse_duration(raw) == secs


# --- properties ------------------------------------------------------------------------------

names = st.from_regex(r"[a-z0-9][a-z0-9_.-]{0,20}", fullmatch=True)


@st.composite
def job_specs(draw: st.DrawFn) -> JobSpec:
    lo = draw(st.integers(1, 64))
    b_lo = draw(st.integers(1, 4096))
    b_hi = draw(st.integers(b_lo, 8192))
    # A CPU job takes exactly its nodes, with a node size; a GPU job names GPU types only.
    shape: dict[str, object] = {
        "accelerators": draw(st.lists(st.sampled_from(
            [a for a in Accelerator if a is not Accelerator.CPU]), min_size=1, max_size=3,
            unique=True)), "gpus": {"min": lo, "max": draw(st.integers(lo, 128))}}
    if draw(st.booleans()):
        size = st.none() | st.from_regex(NODE_SIZE, fullmatch=True).filter(
            lambda s: float(s.rstrip("+")) > 0)
        shape = {"accelerators": [Accelerator.CPU], "nodes": lo, "gpus": {"min": lo, "max": lo},
                 "cpus": draw(size), "memory": draw(size)}
    return JobSpec(
        name=draw(names), team=draw(names), run=draw(st.text(min_size=1).filter(
            lambda s: "\0" not in s)),
        **shape,  # type: ignore[arg-type]
        batch_size={"min": b_lo, "max": b_hi, "default": draw(st.integers(b_lo, b_hi))},
        batch_mode=draw(st.sampled_from(list(BatchMode))),
        work_samples=draw(st.integers(1, 10**15)),
        spot=draw(st.sampled_from(list(SpotPolicy))),
        priority=draw(st.integers(-100, 100)),
        deadline_s=draw(st.one_of(st.none(), st.integers(1, 10**6).map(float))),
        envs=draw(st.dictionaries(st.from_regex(r"[A-Z][A-Z0-9_]{0,8}", fullmatch=True).filter(
            lambda k: not k.startswith("FLEET_")), st.text(max_size=20).filter(
            lambda s: "\0" not in s), max_size=3)),
    )


@settings(max_examples=60, deadline=None)
@given(job_specs())
def test_canonical_json_round_trips(spec: JobSpec) -> None:
    parsed = parse_spec_text(spec_to_json(spec))
    assert parsed.format == FORMAT_FLEET and parsed.spec == spec


yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                max_size=4),
    max_leaves=20,
)
keys = st.sampled_from(["name", "run", "setup", "envs", "accelerators", "gpus", "batch_size",
                        "work", "spot", "regions", "checkpoint", "priority", "team", "deadline",
                        "resources", "num_nodes", "any_of", "x"])


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(keys, yaml_values, max_size=8))
def test_any_document_parses_or_raises_spec_error(doc: dict) -> None:
    try:
        parsed = parse_spec_data(doc)
    except SpecError as exc:
        assert exc.problems and all(p.field and p.message for p in exc.problems)
    else:
        assert parsed.spec.run


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=200))
def test_any_text_parses_or_raises_spec_error(text: str) -> None:
    try:
        parse_spec_text(text)
    except SpecError as exc:
        assert str(exc).startswith("invalid job spec")


def test_json_body_is_accepted() -> None:
    doc = yaml.safe_load(BASE)
    assert parse_spec_text(json.dumps(doc)).spec.name == "digits"
