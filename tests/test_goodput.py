"""PD vs aggregated goodput (simulator.goodput): the sustained-rate rule and a small real run."""

from __future__ import annotations

from simulator.goodput import GoodputComparison, GoodputPoint, compare


def _pt(rate, agg, pd):
    return GoodputPoint(rate, (1, 1), {"aggregated": rate * agg, "pd": rate * pd}, {"aggregated": agg, "pd": pd},
                        {"aggregated": None, "pd": None}, {"aggregated": None, "pd": None})


def test_sustained_rate_is_the_last_rate_of_an_unbroken_run_of_passes():
    c = GoodputComparison(4, 2.0, 0.025, 0.9, (1, 2), (1, 2), 10.0)
    # out of order on purpose; aggregated fails at 6 and passes again at 7 by luck: 7 does not count
    c.points = [_pt(7, 0.95, 0.95), _pt(5, 0.99, 1.0), _pt(6, 0.80, 0.97), _pt(8, 0.5, 0.7)]
    assert c.sustained("aggregated") == 5 and c.sustained("pd") == 7
    assert c.ratio == 7 / 5 and not c.saturated
    assert "aggregated 5 req/s, PD 7 req/s -> 1.40x" in c.summary()
    c.points = [_pt(5, 0.5, 0.95), _pt(6, 0.4, 0.95)]
    assert c.ratio is None and c.saturated and "lower bound" in c.summary()


def test_compare_runs_both_setups_on_the_same_arrivals_deterministically():
    a = compare(2, [1.0, 3.0], seconds=15, isl=(2000, 3000), osl=(20, 40), seeds=2)
    b = compare(2, [1.0, 3.0], seconds=15, isl=(2000, 3000), osl=(20, 40), seeds=2)
    assert [p.__dict__ for p in a.points] == [p.__dict__ for p in b.points]
    low = a.points[0]
    # at a light load both setups serve (nearly) everything within the SLA
    assert low.attainment["aggregated"] > 0.9 and low.attainment["pd"] > 0.9
    assert sum(low.split) == 2
    assert len(a.rows()) == 2 and a.rows()[0][2] == f"{low.split[0]}P{low.split[1]}D"
