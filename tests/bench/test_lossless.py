"""The chi-square p-value comes from torch's regularized incomplete gamma function; checked against closed forms
and tabulated critical values, and end to end on counts whose statistic is worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hqlab.bench.lossless import chi2_sf, chi_square_pvalue, chi_square_statistic


@pytest.mark.parametrize("x", [0.01, 0.5, 1.0, 2.0, 5.0, 13.8, 40.0, 200.0])
def test_closed_forms(x):
    assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-12, abs=1e-300)
    assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-10, abs=1e-300)
    assert chi2_sf(x, 4) == pytest.approx(math.exp(-x / 2) * (1 + x / 2), rel=1e-12, abs=1e-300)
    # df = 3: Q(3/2, x/2) = erfc(sqrt(x/2)) + sqrt(2x/pi) exp(-x/2)
    assert chi2_sf(x, 3) == pytest.approx(math.erfc(math.sqrt(x / 2)) + math.sqrt(2 * x / math.pi)
                                          * math.exp(-x / 2), rel=1e-10, abs=1e-300)


@pytest.mark.parametrize("dof, x, p", [
    # upper critical values of the chi-square distribution, as printed in statistics tables (3 decimals)
    (1, 3.841, 0.05), (2, 5.991, 0.05), (5, 11.070, 0.05), (10, 18.307, 0.05), (20, 31.410, 0.05),
    (30, 43.773, 0.05), (1, 6.635, 0.01), (10, 23.209, 0.01), (50, 76.154, 0.01), (100, 124.342, 0.05),
    (4, 0.297, 0.99), (10, 2.558, 0.99),
])
def test_tabulated_critical_values(dof, x, p):
    assert chi2_sf(x, dof) == pytest.approx(p, rel=2e-3)


def test_edges_and_many_categories():
    assert chi2_sf(0.0, 5) == 1.0
    assert chi2_sf(1e-12, 1) == pytest.approx(1.0, abs=1e-6)
    assert 0.0 <= chi2_sf(2000.0, 3) < 1e-300
    # large dof: the Wilson-Hilferty normal approximation is accurate to ~1e-4 at k = 1000
    k = 1000
    z = (1 - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))  # at x = k, (x/k)^(1/3) = 1
    assert chi2_sf(float(k), k) == pytest.approx(0.5 * math.erfc(z / math.sqrt(2)), abs=2e-4)
    with pytest.raises(ValueError, match="degrees of freedom"):
        chi2_sf(1.0, 0)


def test_pvalue_of_counts_worked_by_hand():
    # 3 categories, 60 samples, p = (1/2, 1/3, 1/6): expected 30, 20, 10; observed 25, 25, 10
    # statistic = 25/30 + 25/20 + 0 = 2.0833..., dof = 2, p = exp(-stat / 2)
    counts, probs = np.array([25, 25, 10]), np.array([1 / 2, 1 / 3, 1 / 6])
    stat, dof = chi_square_statistic(counts, probs)
    assert dof == 2 and stat == pytest.approx(25 / 30 + 25 / 20)
    assert chi_square_pvalue(counts, probs) == pytest.approx(math.exp(-stat / 2), rel=1e-12)
    # categories expecting fewer than 5 are pooled: expected 47.5, 47.5, 2.5, 2.5 -> 47.5, 47.5, 5 (dof 2)
    stat, dof = chi_square_statistic(np.array([50, 45, 3, 2]), np.array([0.475, 0.475, 0.025, 0.025]))
    assert dof == 2 and stat == pytest.approx(2 * 2.5 ** 2 / 47.5)
    assert chi_square_pvalue(np.array([100, 0]), np.array([0.5, 0.5])) < 1e-20
