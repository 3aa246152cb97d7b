"""Shared types: accelerator naming and pool validation."""

import pytest
from pydantic import ValidationError

from policies.models import Accelerator, Market, Pool


@pytest.mark.parametrize(
    ("raw", "want"),
    [("t4", Accelerator.T4), ("A100-80GB", Accelerator.A100), ("rtx_2080ti", Accelerator.RTX2080TI),
     ("V100-32GB", Accelerator.V100), ("Quadro RTX 6000", Accelerator.RTX6000)],
)
def test_accelerator_parse_normalises_cloud_names(raw: str, want: Accelerator) -> None:
    assert Accelerator.parse(raw) is want


def test_unknown_accelerator_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown accelerator 'TPU'.*T4"):
        Accelerator.parse("TPU")


def test_pool_rejects_path_separators_in_names() -> None:
    with pytest.raises(ValidationError, match="path separators"):
        Pool(cloud="aws", region="us-east-1/../x", accelerator=Accelerator.T4, nodes=1,
             gpus_per_node=4)


def test_pool_id_and_capacity() -> None:
    pool = Pool(cloud="aws", region="us-east-1", accelerator=Accelerator.T4, nodes=16,
                gpus_per_node=4, market=Market.SPOT)
    assert pool.capacity == 64
    assert pool.id == "aws:us-east-1:spot:T4"
