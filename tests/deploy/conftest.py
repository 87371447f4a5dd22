"""The chart's fixtures: the Helm child process, each rendered variant, the chart's own values."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.deploy.chart import CHART, VARIANTS, helm, render


@pytest.fixture(scope="module", autouse=True)
def _helm_child() -> Iterator[None]:
    yield
    helm.close()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    values = VARIANTS[request.param]()
    return request.param, values, render(values)


@pytest.fixture(scope="module")
def chart_values() -> dict[str, Any]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert isinstance(values, dict)
    return values

