"""quantile (kthvalue-based, numpy 'linear' definition), as_bool_mask, masked_mean."""
import pytest
import torch

from stapo.core.tensor_utils import as_bool_mask, masked_mean, quantile


def test_quantile_linear_interpolation_by_hand():
    v = torch.tensor([4.0, 1.0, 3.0, 2.0])  # sorted [1, 2, 3, 4]
    assert quantile(v, 0.75).item() == pytest.approx(3.25)  # pos 2.25 → 3 + 0.25·1
    assert quantile(v, 0.0).item() == 1.0
    assert quantile(v, 1.0).item() == 4.0
    assert quantile(v, 0.5).item() == pytest.approx(2.5)  # pos 1.5
    assert quantile(torch.tensor([7.0]), 0.3).item() == 7.0
    # bf16 input (torch.quantile rejects it): [0.5, 1.5] → q 0.5 → 1.0, returned in fp32
    r = quantile(torch.tensor([1.5, 0.5], dtype=torch.bfloat16), 0.5)
    assert r.dtype == torch.float32 and r.item() == 1.0


def test_quantile_errors():
    with pytest.raises(ValueError, match="empty"):
        quantile(torch.tensor([]), 0.5)
    with pytest.raises(ValueError, match="1-D"):
        quantile(torch.ones(2, 2), 0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        quantile(torch.ones(2), 1.5)


def test_as_bool_mask_and_masked_mean():
    assert as_bool_mask(torch.tensor([1, 0], dtype=torch.uint8)).tolist() == [True, False]
    with pytest.raises(TypeError, match="dtype torch.float32"):
        as_bool_mask(torch.tensor([1.0, 0.0]))
    with pytest.raises(TypeError):
        as_bool_mask([1, 0])
    # mean of [1, nan, 3] over [T, F, T] = 2 (the NaN never reaches the sum); empty mask → 0
    v = torch.tensor([1.0, float("nan"), 3.0])
    assert masked_mean(v, torch.tensor([True, False, True])).item() == 2.0
    assert masked_mean(v, torch.zeros(3, dtype=torch.bool)).item() == 0.0
