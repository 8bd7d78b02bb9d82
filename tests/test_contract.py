"""The method contract (docs/architecture.md): outputs kept bit-for-bit through the refactor, and
no method writes a store field."""

import pytest
import torch

from fixtures import contract_golden as golden


@pytest.fixture(scope="module")
def reference():
    saved = torch.load(golden.PATH)
    if saved["torch"] != str(torch.__version__):
        pytest.skip(f"reference logits made with torch {saved['torch']}, this is {torch.__version__}")
    return saved["logits"]


def test_every_variant_is_in_the_reference(reference):
    assert len(reference) == len(golden.MODELS) * len(golden.VARIANTS) * len(golden.BUDGETS)


@pytest.mark.parametrize("kind", golden.MODELS)
@pytest.mark.parametrize("spec", golden.VARIANTS)
def test_logits_equal_the_reference(reference, kind, spec):
    from conftest import tiny_model

    model = tiny_model(kind, layers=3)
    for budget in golden.BUDGETS:
        expected = reference[f"{kind}|{spec}|{budget}"]
        got = golden.run(model, spec, budget)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6, msg=f"{kind} {spec} budget={budget}")
