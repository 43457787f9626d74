"""Every HF family the tensor-parallel tests cover (the zoo included), on a pp=2 pipeline over gloo (slow: ~10 s each, run with
``pytest -m slow tests/models/test_family_pipeline.py``): the loss and every gradient of ``pm.step`` with uneven
ignored targets over microbatches, and ``pm.eval_batch``, equal the single-device model's."""
import pytest

from tests.harness.distributed import run_distributed
from tests.harness.families import FAMILIES
from tests.harness.family_pipeline_checks import pipeline_against_single_device
from tests.models.test_more_families import CASES
from tests.harness.zoo import ZOO, build_zoo, tolerance


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES + sorted(CASES) + sorted(ZOO))
def test_family_on_two_pipeline_stages(name):
    if name in ZOO and build_zoo(name) is None:
        pytest.skip(f"this transformers has no {ZOO[name][0]}")
    for r in run_distributed(pipeline_against_single_device, 2, name, timeout=300):
        assert abs(r["loss"] - r["want"]) <= 1e-5 * abs(r["want"]), r
        assert abs(r["eval"] - r["want"]) <= 1e-5 * abs(r["want"]), r      # dropouts are 0: eval = train loss
        assert r["worst"] < (tolerance(name) if name in ZOO else 1e-5), r
