"""Every registry of incident kinds is keyed by the one list (``ringtrain.incidents``): the
metric's pre-zeroed series, the report's colours, the policies' enum."""

from __future__ import annotations

from ringtrain import metrics
from ringtrain.policies import faults
from ringtrain.incidents import INCIDENT_KINDS, Kind
from ringtrain.telemetry.svgchart import KIND_COLORS


def test_the_policies_raise_the_declared_kinds() -> None:
    assert faults.Kind is Kind
    assert INCIDENT_KINDS == tuple(k.value for k in Kind)


def test_the_report_colours_every_kind_and_nothing_else() -> None:
    assert set(KIND_COLORS) == set(INCIDENT_KINDS)
    assert len(set(KIND_COLORS.values())) == len(KIND_COLORS)  # each kind told apart


def test_the_incident_metric_names_every_kind() -> None:
    for kind in INCIDENT_KINDS:
        assert kind in metrics.INCIDENTS.help
