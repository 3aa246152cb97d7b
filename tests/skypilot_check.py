"""Run by SkyPilot's own interpreter (``.venv/skypilot``), with the repo on PYTHONPATH.

``parse``: reads a JSON list of tasks on stdin and prints what ``sky.Task.from_yaml_config``
(SkyPilot's schema check, then its resource validation) made of each, or its error.
``refuses``: for each task, why SkyPilot refuses it, or null: its parse error, else a bucket
of its ``file_mounts`` whose name the S3, GCS and Azure stores all refuse (``sky launch``
checks the name when it creates the bucket, after the parse).
``sdk``: drives ``providers.skypilot.SkySdk`` against the real ``sky`` module with only the calls
that reach SkyPilot's API server replaced; each replacement first binds its arguments to the
real function's signature, so a call our adapter makes that SkyPilot does not accept fails.
``server``: starts a real SkyPilot API server on loopback (``sky api start``, on the port in
``SKYPILOT_API_SERVER_LOCAL_PORT`` and ``SKYPILOT_API_SERVER_ENDPOINT``), drives
``SkyPilotProvider`` over ``SkySdk`` against it (status, down of a cluster that does not exist,
a launch, which fails offline: no cloud is reachable), and stops the server.
"""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import sky


def parsed(config: dict) -> dict:
    try:
        task = sky.Task.from_yaml_config(config)
    except Exception as exc:  # the error text is what the test inspects
        return {"error": f"{type(exc).__name__}: {exc}"}
    (res,) = task.resources
    return {
        "cloud": str(res.cloud).lower(), "region": res.region, "zone": res.zone,
        "accelerators": res.accelerators, "use_spot": res.use_spot,
        "instance_type": res.instance_type, "num_nodes": task.num_nodes,
        "labels": res.labels, "envs": task.envs, "run": task.run, "setup": task.setup,
        "secrets": sorted(task.secrets),
    }


def refusal(config: dict) -> str | None:
    """Why SkyPilot refuses the task, or None (see ``refuses`` above)."""
    from sky.data import storage

    try:
        task = sky.Task.from_yaml_config(config)
    except Exception as exc:  # the error text is what the test inspects
        return f"{type(exc).__name__}: {exc}"
    for path, mount in task.storage_mounts.items():
        if mount.name is None:  # a bucket source names its bucket: nothing to create
            continue
        stores = (storage.S3Store, storage.GcsStore, storage.AzureBlobStore)
        said = []
        for store in stores:
            try:
                store.validate_name(mount.name)
            except Exception as exc:
                said.append(f"{type(exc).__name__}: {exc}")
        if len(said) == len(stores):
            return f"{path}: {said[0]}"
    return None


def server_call(name: str, calls: list, result: Any) -> Any:
    """``sky.<name>`` as the API server would answer it, after the real signature check."""
    signature = inspect.signature(getattr(sky, name))

    def call(*args: Any, **kwargs: Any) -> Any:
        signature.bind(*args, **kwargs)
        calls.append([name, sorted(kwargs)])
        if isinstance(result, BaseException):
            raise result
        return result(*args, **kwargs) if callable(result) else result

    return call


def sdk(task: dict) -> dict:
    from providers.base import CapacityError
    from providers.skypilot import SkySdk

    calls: list = []
    labels = task["resources"]["labels"]
    record = {"name": "c1", "status": sky.ClusterStatus.UP, "launched_at": 1_764_680_000,
              "handle": SimpleNamespace(launched_resources=sky.Resources(labels=labels))}
    sky.launch = server_call("launch", calls, "req-launch")
    sky.stream_and_get = server_call("stream_and_get", calls, None)
    sky.status = server_call("status", calls, "req-status")
    sky.get = server_call("get", calls, lambda request_id: [record] if request_id ==
                          "req-status" else None)
    sky.down = server_call("down", calls, "req-down")
    adapter = SkySdk()
    adapter.launch(task, "c1")
    listed = adapter.status()
    adapter.down("c1")
    # The server answers a request for a cluster that is gone with ClusterDoesNotExist.
    sky.get = server_call("get", calls, sky.exceptions.ClusterDoesNotExist("c1 is gone"))
    adapter.down("c1")  # already gone: not an error
    sky.stream_and_get = server_call(
        "stream_and_get", calls, sky.exceptions.ResourcesUnavailableError("no A100 in zone"))
    try:
        adapter.launch(task, "c2")
        refused = None
    except CapacityError as exc:
        refused = str(exc)
    return {"calls": calls, "status": listed, "refused": refused}


def server(request: dict) -> dict:
    from providers.base import LaunchRequest, ProviderError
    from providers.skypilot import SkyPilotProvider, SkySdk

    port = os.environ["SKYPILOT_API_SERVER_LOCAL_PORT"]  # the client reads it at import
    cli = str(Path(sys.executable).with_name("sky"))
    subprocess.run([cli, "api", "start", "--host", "127.0.0.1", "--port", str(port)],
                   check=True, capture_output=True, timeout=120)
    try:
        provider = SkyPilotProvider("aws", backend=SkySdk())
        listed = [n.node_id for n in provider.nodes()]
        provider.terminate("fleet-000000000000#0")  # no such cluster: not an error
        try:
            provider.launch(LaunchRequest.model_validate(request))
            failed = None
        except ProviderError as exc:
            failed = f"{type(exc).__name__}: {exc}"
        return {"nodes": listed, "launch": failed,
                "after": [n.node_id for n in provider.nodes()]}
    finally:
        subprocess.run([cli, "api", "stop"], capture_output=True, timeout=120)


if __name__ == "__main__":
    tasks = json.load(sys.stdin)
    mode = sys.argv[1]
    out = [parsed(t) for t in tasks] if mode == "parse" else \
        [refusal(t) for t in tasks] if mode == "refuses" else \
        sdk(tasks[0]) if mode == "sdk" else server(tasks[0])
    print(json.dumps(out))
