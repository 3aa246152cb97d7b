"""GCP's price catalog: the vendored host VM and GPU price tables joined into whole-instance
``vms.csv`` rows (GCE prices a GPU host and its attached GPUs apart)."""

from __future__ import annotations

import csv
import re

from providers.catalog import CatalogOffer, rows_to_offers, sum_prices
from providers.cloud import DATA

CATALOG_DIR = DATA / "cloud-gpu-prices-gcp-azure"
HOSTS_CSV = CATALOG_DIR / "gcp_gpu_host_vm_prices.csv"
GPUS_CSV = CATALOG_DIR / "gcp_gpu_accelerator_prices.csv"

_N1_HOSTED = {"T4", "P4", "P100", "V100", "K80"}
_N1_VCPUS_PER_GPU = 8  # SkyPilot's default host: n1-highmem with 8 vCPUs per attached GPU
_G2_L4S = {4: 1, 8: 1, 12: 1, 16: 1, 32: 1, 24: 2, 48: 4, 96: 8}  # g2-standard-<vCPUs> -> L4s
_FIXED_HOSTS = [
    (re.compile(r"a2-highgpu-(\d+)g$"), "A100", None),
    (re.compile(r"a2-megagpu-(\d+)g$"), "A100", None),
    (re.compile(r"a2-ultragpu-(\d+)g$"), "A100-80GB", None),
    (re.compile(r"a3-highgpu-(\d+)g$"), "H100", None),
    (re.compile(r"a3-megagpu-(\d+)g$"), "H100-MEGA", None),
    (re.compile(r"a3-ultragpu-(\d+)g$"), "H200", None),
    (re.compile(r"a4-highgpu-(\d+)g$"), "B200", None),
    (re.compile(r"g2-standard-(\d+)$"), "L4", _G2_L4S),
]


def host_gpus(instance_type: str) -> list[tuple[str, int]]:
    """The (GPU name, count) pairs a GCP machine type carries or hosts (empty: not a GPU host).

    A2/A3/A4/G2 types have their GPUs built in; N1 hosts take T4/P4/P100/V100 attachments, and
    the catalog pairs each attachment count with one n1-highmem host of 8 vCPUs per GPU.
    """
    for pattern, gpu, by_size in _FIXED_HOSTS:
        if m := pattern.match(instance_type):
            n = int(m.group(1))
            count = by_size.get(n) if by_size else n
            return [(gpu, count)] if count else []
    if m := re.fullmatch(r"n1-highmem-(\d+)", instance_type):
        vcpus = int(m.group(1))
        if vcpus % _N1_VCPUS_PER_GPU == 0 and (vcpus // _N1_VCPUS_PER_GPU) in (1, 2, 4, 8):
            return [(gpu, vcpus // _N1_VCPUS_PER_GPU) for gpu in sorted(_N1_HOSTED)]
    return []


def combine(hosts: list[dict[str, str]], gpus: list[dict[str, str]]) -> list[dict[str, str]]:
    """Join host VM rows and GPU rows of one zone into whole-instance ``vms.csv`` rows."""
    gpu_rows = {
        (r["AcceleratorName"], int(float(r["AcceleratorCount"])), r["AvailabilityZone"]): r
        for r in gpus
    }
    rows = []
    for host in hosts:
        for gpu, count in host_gpus(host["InstanceType"]):
            g = gpu_rows.get((gpu, count, host["AvailabilityZone"]))
            if g is None:
                continue
            price = sum_prices(host.get("Price"), g.get("Price"))
            spot = sum_prices(host.get("SpotPrice"), g.get("SpotPrice"))
            rows.append(
                {
                    **host,
                    "AcceleratorName": gpu,
                    "AcceleratorCount": str(count),
                    "GpuInfo": g.get("GpuInfo", ""),
                    "Price": "" if price is None else f"{price:.5f}",
                    "SpotPrice": "" if spot is None else f"{spot:.5f}",
                }
            )
    return rows


def snapshot() -> list[CatalogOffer]:
    """The vendored snapshot's offers."""
    hosts = list(csv.DictReader(HOSTS_CSV.open()))
    gpus = list(csv.DictReader(GPUS_CSV.open()))
    return rows_to_offers(combine(hosts, gpus), "gcp")
