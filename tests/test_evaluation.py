"""rlpipe.evaluation's benchmark metrics: the unbiased pass@k against a count over every k-subset of the n
samples, and the per-benchmark numbers against a hand-computed example."""

import itertools
import math

import pytest

from rlpipe.evaluation import Judged, benchmark_metrics, pass_at_k


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of the C(n, k) subsets of k samples that hold at least one of the c correct ones."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n,c,k", [
    (1, 0, 1), (1, 1, 1), (4, 0, 1), (4, 0, 4), (4, 4, 1), (4, 4, 4), (4, 1, 1), (4, 1, 2), (4, 2, 3), (4, 3, 4),
    (5, 2, 2), (6, 1, 5), (10, 0, 10), (10, 3, 1), (10, 3, 5), (10, 3, 8), (10, 10, 10), (12, 5, 6),
])
def test_pass_at_k_equals_the_count_over_all_k_subsets(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_hand_values_and_the_closed_form():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the share of correct samples
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 3 of the 6 pairs hold the one correct sample
    assert pass_at_k(10, 0, 10) == 0.0 and pass_at_k(10, 10, 1) == 1.0 and pass_at_k(10, 1, 10) == 1.0
    # n in the hundreds: the binomials overflow a float, the product form does not.
    n, c, k = 200, 7, 100
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), rel=1e-12)


@pytest.mark.parametrize("n,c,k,match", [(4, 2, 5, "k must be between 1 and n"), (4, 2, 0, "k must be between 1 and n"),
                                          (4, 5, 1, "c must be between 0 and n"), (4, -1, 1, "c must be between 0 and n")])
def test_pass_at_k_refuses_impossible_counts(n, c, k, match):
    with pytest.raises(ValueError, match=match):
        pass_at_k(n, c, k)


def _j(status="ok", reward=1.0, n_tokens=4, truncated=False):
    return Judged(status, reward, n_tokens, truncated)


def test_benchmark_metrics_by_hand():
    """Two problems, greedy and 3 samples each. An error verdict is wrong and counted, never dropped."""
    greedy = [_j(), _j("error", None, 10, True)]
    samples = [[_j(), _j(reward=0.0), _j("timeout", None, 8, True)], [_j(reward=0.5), _j(), _j()]]
    m = benchmark_metrics(greedy, samples, [1, 2, 3])
    assert m["n"] == 2 and m["greedy_acc"] == 0.5
    # pass@1: (1/3 + 2/3) / 2; pass@2: (1 - C(2,2)/C(3,2) + 1) / 2 = (2/3 + 1) / 2; pass@3: both problems have one.
    assert m["pass_at_1"] == pytest.approx(0.5) and m["pass_at_2"] == pytest.approx(5 / 6) and m["pass_at_3"] == 1.0
    assert m["mean_len"] == pytest.approx((4 + 10 + 4 + 4 + 8 + 4 + 4 + 4) / 8) and m["truncated"] == pytest.approx(2 / 8)
    assert (m["n_ok"], m["n_error"], m["n_timeout"], m["n_unparseable"], m["n_skipped"]) == (6, 1, 1, 0, 0)


def test_benchmark_metrics_greedy_only_or_samples_only():
    assert set(benchmark_metrics([_j(), _j(reward=0.0)], None, [1])) >= {"greedy_acc", "mean_len"}
    assert "pass_at_1" not in benchmark_metrics([_j()], None, [1])
    only = benchmark_metrics(None, [[_j(), _j(reward=0.0)]], [1, 2])
    assert "greedy_acc" not in only and only["pass_at_1"] == 0.5 and only["pass_at_2"] == 1.0 and only["n"] == 1
    with pytest.raises(ValueError, match="k must be between 1 and n"):
        benchmark_metrics(None, [[_j(), _j()]], [3])
